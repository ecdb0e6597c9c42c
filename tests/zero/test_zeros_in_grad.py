"""The zeros in each step's gradient (--log-num-zeros-in-grad) from the ZeRO optimizers:
every stage, data parallelism (partitions cut mid-parameter, padding not counted), offload,
bf16, tensor parallelism (a replicated parameter counted once), and no count for a skipped
step."""

import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from tests.zero.test_stage1_2 import _FakeMpu, _ShardedAndReplicated

VOCAB, WIDTH, USED = 32, 12, 10  # tokens below USED only: the other rows' gradients are 0
ZEROS = (VOCAB - USED) * WIDTH
CASES = {
    "stage0": (0, "fp32", {}),
    "stage1": (1, "fp32", {}),
    "stage2": (2, "fp32", {}),
    "stage3": (3, "fp32", {}),
    "stage0-bf16": (0, "bf16", {}),
    "stage2-offload": (2, "fp32", {"offload_optimizer": {"device": "cpu"}}),
    "stage3-offload": (3, "fp32", {"offload_optimizer": {"device": "cpu"}}),
}


class _UnusedRows(torch.nn.Module):
    """449 elements (odd: data-parallel partitions end in padding)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.out = torch.nn.Linear(WIDTH, 5)

    def forward(self, tokens):
        return self.out(self.embed(tokens)).float().pow(2).mean()


def _tokens(step, rank, micro):
    generator = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    return torch.randint(USED, (4, 6), generator=generator)


def _counts(rank, world_size, names, steps=2):
    """{case: [each step's count]}; the last entry: a NaN loss's skipped step."""
    counts = {}
    for name in names:
        stage, precision, options = CASES[name]
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, **options}}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        with zero.Init(enabled=stage == 3):
            model = _UnusedRows()
        engine, *_ = zero.initialize(model=model.to(torch.bfloat16) if precision == "bf16"
                                     else model, config=config)
        assert engine.optimizer.num_zeros_in_grad is None  # not counted unless asked
        engine.optimizer.count_zeros_in_grad()
        found = []
        for step in range(steps + 1):
            for micro in range(2):
                loss = engine(_tokens(step, rank, micro))
                engine.backward(loss * float("nan") if step == steps else loss)
                engine.step()
            found.append(engine.optimizer.num_zeros_in_grad)
        counts[name] = found
    return counts


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_zeros_of_the_whole_gradient_are_counted_once(world_size):
    results = run_distributed(_counts, world_size, args=(list(CASES),))
    for counts in results:
        for name, found in counts.items():
            assert found == [ZEROS, ZEROS, None], name  # (a skipped step: none)


def _tensor_parallel_counts(rank, world_size):
    """TP over 2 ranks, every gradient zero: the sharded parameter's 5 elements per rank and
    the replicated one's 3, once."""
    mpu = _FakeMpu(rank, world_size)
    counts = {}
    for stage in (0, 2, 3):
        config = {"train_batch_size": 1, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1.0}}}
        engine, *_ = zero.initialize(model=_ShardedAndReplicated(rank), config=config, mpu=mpu)
        engine.optimizer.count_zeros_in_grad()
        engine.backward(engine(rank) * 0)
        engine.step()
        counts[stage] = engine.optimizer.num_zeros_in_grad
    return counts


def test_a_parameter_replicated_over_tensor_parallelism_counts_once():
    for counts in run_distributed(_tensor_parallel_counts, 2):
        assert counts == {0: 13, 2: 13, 3: 13}
