import pytest
import torch

from megatron import mpu
from tests.mpu.cases import det_ints


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_broadcast_reaches_the_whole_tensor_parallel_group(dist_results, tp):
    for rank, got in enumerate(dist_results.get(tp, "broadcast")):
        dp = rank // tp  # data comes from tensor-parallel rank 0 of my group
        assert torch.equal(got["text"], det_ints(2, 5, high=100, seed=60 + dp))
        assert torch.equal(got["other"], det_ints(3, high=100, seed=70 + dp))
        assert torch.equal(got["cube"], det_ints(2, 1, 2, 3, high=100, seed=80 + dp))


def test_single_process_checks_dtype_and_passes_through():
    data = {"text": torch.arange(6).view(2, 3)}
    assert mpu.broadcast_data(["text"], data, torch.int64)["text"] is data["text"]
    with pytest.raises(AssertionError, match="dtype"):
        mpu.broadcast_data(["text"], data, torch.float32)
