import pytest
import torch.distributed as dist

from megatron import mpu
from megatron.errors import ConfigError
from tests.mpu.conftest import WORLD_SIZE


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_groups_are_adjacent_for_tensor_and_strided_for_data(dist_results, tp):
    for rank, layout in enumerate(dist_results.get(tp, "layout")):
        first = rank // tp * tp
        assert layout["tp_group"] == list(range(first, first + tp))
        assert layout["dp_group"] == list(range(rank % tp, WORLD_SIZE, tp))
        assert (layout["tp_rank"], layout["tp_size"]) == (rank % tp, tp)
        assert (layout["dp_rank"], layout["dp_size"]) == (rank // tp, WORLD_SIZE // tp)
        assert layout["src_rank"] == first


def test_indivisible_size_is_a_config_error_with_the_arithmetic(dist_results):
    for message in dist_results.get(4, "bad_size"):
        assert message is not None and "--model-parallel-size 3" in message
        assert "4 % 3 = 1" in message


def test_without_distributed_everything_is_size_one():
    assert not dist.is_initialized() and not mpu.model_parallel_is_initialized()
    assert mpu.get_model_parallel_world_size() == 1 and mpu.get_model_parallel_rank() == 0
    assert mpu.get_data_parallel_world_size() == 1 and mpu.get_data_parallel_rank() == 0
    assert mpu.get_model_parallel_src_rank() == 0
    assert mpu.get_parallel_state() is None


def test_initialize_needs_a_process_group():
    with pytest.raises(ConfigError, match="init_process_group"):
        mpu.initialize_model_parallel(1)


def test_overrides_for_offline_tools_and_teardown():
    try:
        mpu.set_model_parallel_world_size(4)
        mpu.set_model_parallel_rank(3)
        assert mpu.get_model_parallel_world_size() == 4 and mpu.get_model_parallel_rank() == 3
    finally:
        mpu.destroy_model_parallel()
    assert mpu.get_model_parallel_world_size() == 1 and mpu.get_model_parallel_rank() == 0
