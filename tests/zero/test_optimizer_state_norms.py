"""The optimizer states' norms (--log-optimizer-states-to-tensorboard) from the ZeRO
optimizers: every stage, data parallelism (partitions cut mid-parameter, padding), offload to
CPU and NVMe, 8-bit moments (decoded), tensor parallelism (a replicated parameter counted
once) — against the same numbers of a plain model trained by torch's AdamW on one process."""

import math

import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from tests.zero.test_stage1_2 import _FakeMpu
from tests.zero.test_weights_norm import filled_tensor_parallel_model

STEPS = 2
# name: (stage, zero options, optimizer section or None: torch's AdamW)
CASES = {
    "stage0": (0, {}, None),
    "stage1": (1, {}, None),
    "stage2": (2, {}, None),
    "stage3": (3, {}, None),
    "stage2-offload": (2, {"offload_optimizer": {"device": "cpu"}}, None),
    "stage3-nvme": (3, {"offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}}, None),
    "stage2-adam8bit": (2, {}, {"type": "Adam8bit", "params": {"lr": cases.LR}}),
}
NAMES = [f"{kind}_{norm}" for kind in ("variance", "variance_sqrt", "momentum", "weight")
         for norm in ("l2", "l1", "abs_max")]


def _stats(weights, exp_avgs, exp_avg_sqs):
    """Megatron-DeepSpeed's twelve numbers of flat float64 tensors."""
    values = {}
    for kind, tensor in (("variance", exp_avg_sqs), ("variance_sqrt", exp_avg_sqs.sqrt()),
                         ("momentum", exp_avgs), ("weight", weights)):
        values[f"{kind}_l2"] = tensor.pow(2).sum().sqrt().item()
        values[f"{kind}_l1"] = tensor.abs().sum().item()
        values[f"{kind}_abs_max"] = tensor.abs().max().item()
    return values


@pytest.fixture(scope="module")
def reference():
    _, model, optimizer = cases.train_reference(STEPS)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = lambda tensors: torch.cat([t.detach().double().flatten() for t in tensors])  # noqa
    return _stats(flat(params), flat(optimizer.state[p]["exp_avg"] for p in params),
                  flat(optimizer.state[p]["exp_avg_sq"] for p in params))


def _engine_norms(rank, world_size, names, nvme_path):
    norms = {}
    for name in names:
        stage, options, section = CASES[name]
        options = {key: {k: nvme_path if v == "NVME" else v for k, v in value.items()}
                   for key, value in options.items()}
        config = cases.ds_config(stage, **options)
        with zero.Init(enabled=stage == 3):
            model = cases.make_model()
        if section is None:
            engine = cases.make_engine(config, model=model)
        else:
            engine, *_ = zero.initialize(model=model, config={**config, "optimizer": section},
                                         model_parameters=cases.param_groups(model))
        before = engine.optimizer.optimizer_state_norms()
        cases.train_steps(engine, STEPS)
        norms[name] = (before, engine.optimizer.optimizer_state_norms())
    return norms


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _engine_norms(0, 1, list(CASES), str(tmp_path_factory.mktemp("nvme1")))


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return run_distributed(_engine_norms, 2,
                           args=(list(CASES), str(tmp_path_factory.mktemp("nvme2"))))


@pytest.mark.parametrize("name", list(CASES))
def test_one_process_gives_the_numbers_of_torchs_adamw(reference, one_process, name):
    before, after = one_process[name]
    assert sorted(after) == sorted(NAMES)
    assert all(before[key] == 0 for key in NAMES if not key.startswith("weight"))
    _check(name, after, reference)


@pytest.mark.parametrize("name", list(CASES))
def test_two_data_parallel_ranks_give_the_one_process_numbers(reference, one_process, dp2,
                                                              name):
    assert dp2[0][name] == dp2[1][name]  # every rank gets the same numbers
    _check(name, dp2[0][name][1], reference)
    for key, value in one_process[name][1].items():
        assert dp2[0][name][1][key] == pytest.approx(value, rel=1e-5), key


def _check(name, found, reference):
    quantized = CASES[name][2] is not None
    for key in NAMES:
        if quantized and not key.startswith("weight"):  # 8-bit codes of the same moments
            assert found[key] == pytest.approx(reference[key], rel=5e-2), key
        else:
            assert found[key] == pytest.approx(reference[key], rel=1e-5), key


def _tensor_parallel_norms(rank, world_size):
    """Before any step, on test_weights_norm's TP model."""
    mpu = _FakeMpu(rank, world_size)
    norms = {}
    for stage in (0, 2, 3):
        model = filled_tensor_parallel_model(rank)
        config = {"train_batch_size": 1, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1.0}}}
        engine, *_ = zero.initialize(model=model, config=config, mpu=mpu)
        norms[stage] = engine.optimizer.optimizer_state_norms()
    return norms


def test_a_parameter_replicated_over_tensor_parallelism_counts_once():
    for norms in run_distributed(_tensor_parallel_norms, 2):
        for stage, values in norms.items():
            assert values["weight_l2"] == pytest.approx(math.sqrt(5 + 5 * 4 + 3 * 4)), stage
            assert values["weight_l1"] == pytest.approx(5 + 5 * 2 + 3 * 2), stage
            assert values["weight_abs_max"] == 2.0, stage
            assert values["momentum_l2"] == 0.0, stage
