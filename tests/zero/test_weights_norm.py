"""The weights' norm (--log-params-norm) from the ZeRO optimizers' fp32 masters: every stage,
data parallelism (partitions cut mid-parameter, padding), several buckets, offload, tensor
parallelism (a replicated parameter counted once) — against the norm of the whole model's
weights on one process."""

import math

import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from tests.zero.test_stage1_2 import _FakeMpu, _ShardedAndReplicated

STEPS = 2
# name: (stage, precision, zero options)
CASES = {
    "stage0": (0, "fp32", {}),
    "stage1": (1, "fp32", {}),
    "stage2": (2, "fp32", {}),
    "stage3": (3, "fp32", {}),
    "stage2-bf16": (2, "bf16", {}),  # 16-bit params: masters are copies, in several buckets
    "stage3-bf16": (3, "bf16", {}),
    "stage2-offload": (2, "fp32", {"offload_optimizer": {"device": "cpu"}}),
    "stage3-offload": (3, "fp32", {"offload_optimizer": {"device": "cpu"}}),
}


def _model_norm(model):
    """The norm of a plain model's trained weights (the tied embedding once)."""
    return math.sqrt(sum(p.detach().double().pow(2).sum().item()
                         for p in model.parameters() if p.requires_grad))


def _engine_norms(rank, world_size, names):
    """{case: (norm before training, norm after STEPS steps)} from a DP `world_size` engine."""
    norms = {}
    for name in names:
        stage, precision, options = CASES[name]
        config = cases.ds_config(stage, precision=precision, **options)
        context = zero.Init(enabled=stage == 3)
        with context:
            model = cases.make_model()
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        engine = cases.make_engine(config, model=model)
        before = engine.optimizer.weights_norm()
        cases.train_steps(engine, STEPS)
        norms[name] = (before, engine.optimizer.weights_norm())
    return norms


@pytest.fixture(scope="module")
def reference():
    """(initial norm, norm after STEPS steps) of plain single-process training."""
    initial = _model_norm(cases.make_model())
    _, model, _ = cases.train_reference(STEPS)
    return initial, _model_norm(model)


@pytest.fixture(scope="module")
def dp2():
    return run_distributed(_engine_norms, 2, args=(list(CASES),))


@pytest.mark.parametrize("name", list(CASES))
def test_one_process_norm_is_the_models(reference, name):
    before, after = _engine_norms(0, 1, [name])[name]
    _check(name, before, after, reference)


@pytest.mark.parametrize("name", list(CASES))
def test_two_data_parallel_ranks_give_the_one_process_norm(reference, dp2, name):
    assert dp2[0][name] == dp2[1][name]  # every rank gets the same number
    _check(name, *dp2[0][name], reference)


def _check(name, before, after, reference):
    initial, trained = reference
    if CASES[name][1] == "bf16":  # the masters start from the bf16 weights
        assert before == pytest.approx(initial, rel=1e-2)
        assert after == pytest.approx(trained, rel=1e-2)
    else:
        assert before == pytest.approx(initial, rel=1e-6)
        assert after == pytest.approx(trained, rel=1e-5)
    assert after != pytest.approx(before, rel=1e-6)  # the steps moved the weights


def filled_tensor_parallel_model(rank):
    """TP over 2 ranks: a sharded parameter (rank r holds 5 elements of value r + 1) and a
    replicated one (3 elements of 2 on each rank)."""
    model = _ShardedAndReplicated(rank)
    with torch.no_grad():
        model.sharded.fill_(rank + 1)
        model.replicated.fill_(2.0)
    return model


def _tensor_parallel_norms(rank, world_size):
    mpu = _FakeMpu(rank, world_size)
    norms = {}
    for stage in (0, 2, 3):
        model = filled_tensor_parallel_model(rank)
        config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                  "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}}
        engine, *_ = zero.initialize(model=model, config=config, mpu=mpu)
        norms[stage] = engine.optimizer.weights_norm()
    return norms


def test_a_parameter_replicated_over_tensor_parallelism_counts_once():
    expected = math.sqrt(5 * 1 + 5 * 4 + 3 * 4)  # the sharded halves, the replicated once
    for norms in run_distributed(_tensor_parallel_norms, 2):
        for stage, norm in norms.items():
            assert norm == pytest.approx(expected, rel=1e-6), stage
