"""GPT-2 with zero.activation_checkpointing.recompute (DeepSpeed's activation checkpointing): gradients equal those
without checkpointing bit for bit (fp32, CPU, dropout on), for every combination of
partition x CPU x contiguous x synchronize, at tensor-parallel size 1 and 2, with and
without --split-transformers; partitioning really keeps 1/TP of every checkpoint."""

import itertools

import pytest
import torch

from megatron import mpu
from megatron.model import GPT2Model
from megatron.mpu.random import use_rng_tracker
from tests.dist_utils import run_distributed
from tests.model import cases
from zero import checkpointing

NUM_LAYERS = 2
# (partition, cpu, contiguous, synchronize)
COMBINATIONS = list(itertools.product([False, True], repeat=4))


def _grads(checkpoint_options, split=False, count_saved=False):
    """Loss and gradients of a tiny GPT-2 with dropout; checkpoint_options None = no
    checkpointing. Returns (loss, grads, saved bytes)."""
    checkpointing.configure(mpu, **(checkpoint_options or {}))
    use_rng_tracker(checkpointing.get_cuda_rng_tracker())
    try:
        torch.manual_seed(12)
        mpu.model_parallel_cuda_manual_seed(12)
        model = GPT2Model(cases.tiny_config(
            num_layers=NUM_LAYERS, hidden_dropout=0.2, attention_dropout=0.2,
            checkpoint_activations=checkpoint_options is not None,
            split_transformers=split, checkpoint_function=checkpointing.checkpoint),
            parallel_output=False)
        mpu.model_parallel_cuda_manual_seed(13)
        tokens, labels = cases.batch()
        saved = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved \
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            losses = model(tokens, _positions(tokens), None, labels=labels)
        loss = losses.mean()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        return loss.detach(), grads, sum(saved.values())
    finally:
        use_rng_tracker(None)
        checkpointing.unconfigure()


def _options(partition, cpu, contiguous, synchronize, split=False):
    return dict(partition_activations=partition, checkpoint_in_cpu=cpu,
                contiguous_checkpointing=contiguous, synchronize=synchronize,
                num_checkpoints=NUM_LAYERS * (2 if split else 1))


def _all_variants():
    """{name: (loss, grads)} for the reference and every combination (run on one rank)."""
    results = {"plain": _grads(None)[:2]}
    for combo in COMBINATIONS:
        results[combo] = _grads(_options(*combo))[:2]
    for combo in ((False, False, False, False), (True, True, True, True)):
        results[("split",) + combo] = _grads(_options(*combo, split=True), split=True)[:2]
    return results


def _assert_bit_for_bit(results):
    loss, grads = results["plain"]
    for name, (other_loss, other_grads) in results.items():
        assert torch.equal(loss, other_loss), name
        for key, grad in grads.items():
            assert torch.equal(grad, other_grads[key]), (name, key)


def test_tp1_every_combination_bit_for_bit():
    results = _all_variants()
    _assert_bit_for_bit(results)
    assert len(results) == 1 + len(COMBINATIONS) + 2


def _tp2_worker(rank, world_size):
    torch.set_num_threads(1)
    mpu.initialize_model_parallel(world_size)
    results = _all_variants()
    unpartitioned = _grads(_options(False, False, False, False), count_saved=True)[2]
    partitioned = _grads(_options(True, False, False, False), count_saved=True)[2]
    return results, unpartitioned, partitioned


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_tp2_worker, 2)


def test_tp2_every_combination_bit_for_bit(tp2):
    for results, _, _ in tp2:
        _assert_bit_for_bit(results)


def test_tp2_partition_keeps_half_of_each_checkpoint(tp2):
    tokens, _ = cases.batch()
    batch, seq = tokens.shape
    checkpoint_bytes = batch * seq * cases.tiny_config().hidden_size * 4  # [b, s, h] fp32
    for _, unpartitioned, partitioned in tp2:
        assert unpartitioned - partitioned == NUM_LAYERS * checkpoint_bytes // 2


def test_dropout_really_acts():
    with_dropout = _grads(None)[0]
    checkpointing.configure(mpu)
    torch.manual_seed(12)
    mpu.model_parallel_cuda_manual_seed(12)
    model = GPT2Model(cases.tiny_config(num_layers=NUM_LAYERS), parallel_output=False)
    tokens, labels = cases.batch()
    checkpointing.unconfigure()
    assert not torch.equal(model(tokens, _positions(tokens), None, labels=labels).mean(),
                           with_dropout)


def _positions(tokens):
    return torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
