import numpy as np
import pytest
import torch

from megatron.data.samplers import PretrainingSampler, build_pretraining_data_loader
from megatron.errors import DataError


def _global_order(total, consumed, micro, dp):
    """The reference: every index from `consumed`, cut into chunks of micro*dp, tail dropped."""
    chunk = micro * dp
    usable = consumed + (total - consumed) // chunk * chunk
    return list(range(consumed, usable))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_union_over_ranks_is_the_single_rank_order(dp):
    total, micro = 50, 3
    per_rank = [list(PretrainingSampler(total, 0, micro, r, dp)) for r in range(dp)]
    assert all(len(batches) == len(PretrainingSampler(total, 0, micro, r, dp))
               for r, batches in enumerate(per_rank))
    interleaved = [i for step in zip(*per_rank) for batch in step for i in batch]
    assert interleaved == _global_order(total, 0, micro, dp)
    single = [i for batch in PretrainingSampler(total, 0, micro * dp, 0, 1) for i in batch]
    assert interleaved == single


@pytest.mark.parametrize("consumed", [0, 6, 7, 30, 48])
def test_resume_gives_the_tail_of_the_full_sequence(consumed):
    total, micro, dp = 48, 2, 3
    full = [PretrainingSampler(total, 0, micro, r, dp) for r in range(dp)]
    resumed = [list(PretrainingSampler(total, consumed, micro, r, dp)) for r in range(dp)]
    flat = [i for step in zip(*resumed) for batch in step for i in batch]
    assert flat == _global_order(total, consumed, micro, dp)
    if consumed % (micro * dp) == 0:  # resuming on a step boundary: exactly the later steps
        steps_done = consumed // (micro * dp)
        for r in range(dp):
            assert resumed[r] == list(full[r])[steps_done:]


def test_drop_last_false_serves_the_tail():
    total, micro, dp = 11, 2, 2  # 2 full global chunks of 4, tail 8, 9, 10
    rank0 = list(PretrainingSampler(total, 0, micro, 0, dp, drop_last=False))
    rank1 = list(PretrainingSampler(total, 0, micro, 1, dp, drop_last=False))
    assert rank0 == [[0, 1], [4, 5], [8, 9]] and rank1 == [[2, 3], [6, 7], [10]]
    assert len(PretrainingSampler(total, 0, micro, 1, dp, drop_last=False)) == 3
    assert list(PretrainingSampler(9, 0, micro, 1, dp, drop_last=False)) == [[2, 3], [6, 7]]


def test_bad_arguments():
    with pytest.raises(DataError, match=r"cannot resume at consumed samples 60: .* 50 "
                       r"samples. .* --train-samples\)"):
        PretrainingSampler(50, 60, 2, 0, 1)
    with pytest.raises(DataError, match="no samples"):
        PretrainingSampler(0, 0, 2, 0, 1)
    with pytest.raises(ValueError):
        PretrainingSampler(50, 0, 2, 2, 2)


class _CountingDataset:
    def __init__(self, n, seq):
        self.n, self.seq = n, seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"text": np.arange(i, i + self.seq + 1, dtype=np.int64)}


def test_loader_batches_are_long_tensors_in_global_order():
    dataset = _CountingDataset(20, seq=5)
    loader = build_pretraining_data_loader(dataset, consumed_samples=4, micro_batch_size=2,
                                           data_parallel_rank=1, data_parallel_size=2,
                                           num_workers=0)
    batches = list(loader)
    assert len(batches) == len(loader) == 4
    first = batches[0]["text"]
    assert first.dtype == torch.long and first.shape == (2, 6)
    assert first[:, 0].tolist() == [6, 7]  # chunk [4..7], rank 1 takes 6, 7
    assert [b["text"][0, 0].item() for b in batches] == [6, 10, 14, 18]
    assert build_pretraining_data_loader(None, 0, 2, 0, 1, 0) is None
