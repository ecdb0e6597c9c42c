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


def test_pipeline_groups_follow_megatrons_rank_order():
    """8 ranks, TP 2 x PP 2 x DP 2: rank = (stage x dp + dp rank) x tp + tp rank."""
    layout = mpu.initialize.group_ranks(8, tp=2, pp=2)
    assert layout["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # without stages, the data-parallel groups are the TP-strided ones of before
    assert mpu.initialize.group_ranks(8, tp=2, pp=1)["data"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # every rank is in exactly one group of each kind
    for kind in ("tensor", "data", "pipeline"):
        assert sorted(r for group in layout[kind] for r in group) == list(range(8))


def test_stage_layer_split_is_even_with_the_extra_layers_first():
    from megatron.model.transformer import stage_layers
    assert [stage_layers(8, 4, s) for s in range(4)] == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    assert [stage_layers(7, 3, s) for s in range(3)] == [[[0, 1, 2]], [[3, 4]], [[5, 6]]]
    # interleaved: 2 chunks a stage, chunk c of stage s is virtual stage c x 2 + s
    assert [stage_layers(8, 2, s, chunks=2) for s in range(2)] == [[[0, 1], [4, 5]],
                                                                   [[2, 3], [6, 7]]]


def test_without_pipeline_every_rank_is_first_and_last_stage():
    assert mpu.get_pipeline_model_parallel_world_size() == 1
    assert mpu.is_pipeline_first_stage() and mpu.is_pipeline_last_stage()
