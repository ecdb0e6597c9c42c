import pytest
import torch

from megatron import mpu


def test_divide_and_divisibility():
    assert mpu.divide(12, 4) == 3
    with pytest.raises(AssertionError, match="not divisible"):
        mpu.divide(10, 4)


def test_split_along_last_dim():
    x = torch.arange(24.).view(2, 12)
    chunks = mpu.split_tensor_along_last_dim(x, 3)
    assert [c.shape for c in chunks] == [torch.Size([2, 4])] * 3
    assert torch.equal(torch.cat(chunks, dim=-1), x)
    assert not chunks[1].is_contiguous()
    assert all(c.is_contiguous() for c in mpu.split_tensor_along_last_dim(x, 3, True))


def test_vocab_ranges():
    assert mpu.VocabUtility.vocab_range_from_global_vocab_size(16, 2, 4) == (8, 12)
    assert mpu.VocabUtility.vocab_range_from_per_partition_vocab_size(5, 1, 2) == (5, 10)
