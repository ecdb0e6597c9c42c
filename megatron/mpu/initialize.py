"""Tensor-, pipeline- and data-parallel process groups, kept in one `ParallelState` object.

Megatron's getter functions (`get_model_parallel_rank()`, ...) read that object, so code
written against Megatron's `mpu` (and DeepSpeed's `mpu=` argument) works unchanged, while
tests can build and tear the state down as often as they like.  With nothing initialised
(a single process, unit tests) the getters report size 1 / rank 0 and every mapping in
`mappings.py` is the identity, so the model runs without torch.distributed.
"""

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from megatron.errors import ConfigError


@dataclass
class ParallelState:
    """Who this process is within its tensor-, pipeline- and data-parallel groups."""
    model_parallel_group: Any
    data_parallel_group: Any
    model_parallel_size: int
    model_parallel_rank: int
    data_parallel_size: int
    data_parallel_rank: int
    model_parallel_src_rank: int  # global rank of tensor-parallel rank 0 in this group
    pipeline_group: Any = None
    pipeline_size: int = 1
    pipeline_rank: int = 0
    pipeline_ranks: tuple = ()  # global ranks of this pipeline, stage 0 first
    virtual_pipeline_size: int = 1  # model chunks per stage (the interleaved schedule)


_STATE: Optional[ParallelState] = None
# The model chunk a stage is running (interleaved schedule); None outside the schedule.
_VIRTUAL_RANK: Optional[int] = None
# Set by tools (checkpoint merge/split) that need the layout without a process group.
_MP_WORLD_SIZE_OVERRIDE: Optional[int] = None
_MP_RANK_OVERRIDE: Optional[int] = None


def initialize_model_parallel(model_parallel_size, timeout=None,
                              pipeline_model_parallel_size=1,
                              virtual_pipeline_model_parallel_size=1):
    """Split the world into tensor-parallel groups of adjacent ranks, data-parallel groups
    strided by the tensor-parallel size within a pipeline stage, and pipelines strided by
    tensor x data parallel (Megatron's rank order: rank = (pipeline stage x dp + dp rank) x
    tp + tp rank).

    With 8 processes g0..g7, model_parallel_size 2, pipeline_model_parallel_size 2:
        tensor-parallel groups: [g0, g1], [g2, g3], [g4, g5], [g6, g7]
        data-parallel groups:   [g0, g2], [g1, g3], [g4, g6], [g5, g7]
        pipelines:              [g0, g4], [g1, g5], [g2, g6], [g3, g7]
    Adjacent ranks usually share a node, so the frequent tensor-parallel all-reduces stay
    on the fastest links.  Every rank must call this (group creation is collective).
    `timeout` (a timedelta) bounds every collective on the new groups; None keeps torch's
    default. `virtual_pipeline_model_parallel_size` > 1: each stage holds that many model
    chunks (interleaved 1F1B); the schedule names the chunk at work with
    set_virtual_pipeline_model_parallel_rank.
    """
    global _STATE
    if not dist.is_initialized():
        raise ConfigError("initialize_model_parallel needs torch.distributed; call "
                          "torch.distributed.init_process_group first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = model_parallel_size, pipeline_model_parallel_size
    if tp < 1 or world_size % tp != 0:
        raise ConfigError(
            f"--model-parallel-size {tp} must be a positive divisor of the "
            f"world size {world_size} ({world_size} % {tp} = "
            f"{world_size % max(tp, 1)}); change --model-parallel-size or "
            f"the number of processes")
    if pp < 1 or world_size % (tp * pp) != 0:
        raise ConfigError(
            f"--pipeline-model-parallel-size {pp} x --model-parallel-size {tp} = {tp * pp} "
            f"must divide the world size {world_size}; change the sizes or the number of "
            "processes")
    if _STATE is not None:
        destroy_model_parallel()
    stage_size = world_size // pp  # ranks per pipeline stage: tp x dp
    dp = stage_size // tp
    layout = group_ranks(world_size, tp, pp)
    model_group = data_group = pipeline_group = None
    pipeline_ranks = (rank,)
    for ranks in layout["tensor"]:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            model_group = group
    for ranks in layout["data"]:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            data_group = group
    if pp > 1:
        for ranks in layout["pipeline"]:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                pipeline_group, pipeline_ranks = group, tuple(ranks)
    _STATE = ParallelState(
        model_parallel_group=model_group, data_parallel_group=data_group,
        model_parallel_size=tp, model_parallel_rank=rank % tp,
        data_parallel_size=dp, data_parallel_rank=(rank % stage_size) // tp,
        model_parallel_src_rank=(rank // tp) * tp,
        pipeline_group=pipeline_group, pipeline_size=pp, pipeline_rank=rank // stage_size,
        pipeline_ranks=pipeline_ranks,
        virtual_pipeline_size=virtual_pipeline_model_parallel_size)
    return _STATE


def group_ranks(world_size, tp, pp):
    """{"tensor" | "data" | "pipeline": [[global ranks of one group], ...]} in Megatron's rank
    order (see initialize_model_parallel); every rank creates the groups in this order."""
    stage_size = world_size // pp
    return {
        "tensor": [list(range(i * tp, (i + 1) * tp)) for i in range(world_size // tp)],
        "data": [list(range(stage * stage_size + t, (stage + 1) * stage_size, tp))
                 for stage in range(pp) for t in range(tp)],
        "pipeline": [list(range(first, world_size, stage_size)) for first in range(stage_size)],
    }


def model_parallel_is_initialized():
    return _STATE is not None


def get_parallel_state():
    """The current `ParallelState`, or None before `initialize_model_parallel`."""
    return _STATE


def destroy_model_parallel():
    """Forget the groups and overrides, so the next `initialize_model_parallel` starts clean."""
    global _STATE, _MP_WORLD_SIZE_OVERRIDE, _MP_RANK_OVERRIDE, _VIRTUAL_RANK
    state, _STATE, _VIRTUAL_RANK = _STATE, None, None
    _MP_WORLD_SIZE_OVERRIDE = _MP_RANK_OVERRIDE = None
    if state is not None and dist.is_initialized():
        for group in (state.model_parallel_group, state.data_parallel_group,
                      state.pipeline_group):
            if group is not None:
                dist.destroy_process_group(group)


def _require_state(what):
    assert _STATE is not None, f"{what}: model parallel is not initialized; call " \
                               f"mpu.initialize_model_parallel first"
    return _STATE


def get_model_parallel_group():
    return _require_state("get_model_parallel_group").model_parallel_group


def get_data_parallel_group():
    return _require_state("get_data_parallel_group").data_parallel_group


def set_model_parallel_world_size(world_size):
    """Override the tensor-parallel size reported by the getters (for offline tools)."""
    global _MP_WORLD_SIZE_OVERRIDE
    _MP_WORLD_SIZE_OVERRIDE = world_size


def set_model_parallel_rank(rank):
    """Override the tensor-parallel rank reported by the getters (for offline tools)."""
    global _MP_RANK_OVERRIDE
    _MP_RANK_OVERRIDE = rank


def get_model_parallel_world_size():
    if _MP_WORLD_SIZE_OVERRIDE is not None:
        return _MP_WORLD_SIZE_OVERRIDE
    return _STATE.model_parallel_size if _STATE is not None else 1


def get_model_parallel_rank():
    if _MP_RANK_OVERRIDE is not None:
        return _MP_RANK_OVERRIDE
    return _STATE.model_parallel_rank if _STATE is not None else 0


def get_model_parallel_src_rank():
    """Global rank of tensor-parallel rank 0 in this process's group."""
    return _STATE.model_parallel_src_rank if _STATE is not None else 0


def get_data_parallel_world_size():
    if _STATE is not None:
        return _STATE.data_parallel_size
    return dist.get_world_size() if dist.is_initialized() else 1


def get_data_parallel_rank():
    if _STATE is not None:
        return _STATE.data_parallel_rank
    return dist.get_rank() if dist.is_initialized() else 0


def get_pipeline_model_parallel_group():
    """The ranks holding the other stages of this rank's model replica (None without
    pipeline parallelism)."""
    return _require_state("get_pipeline_model_parallel_group").pipeline_group


def get_pipeline_model_parallel_world_size():
    return _STATE.pipeline_size if _STATE is not None else 1


def get_pipeline_model_parallel_rank():
    """This rank's pipeline stage (0 holds the embeddings, the last the output layer)."""
    return _STATE.pipeline_rank if _STATE is not None else 0


def get_virtual_pipeline_model_parallel_world_size():
    """Model chunks per pipeline stage (1 unless the schedule is interleaved)."""
    return _STATE.virtual_pipeline_size if _STATE is not None else 1


def get_virtual_pipeline_model_parallel_rank():
    return _VIRTUAL_RANK


def set_virtual_pipeline_model_parallel_rank(rank):
    """The model chunk the next forward or backward runs (None: not inside a schedule)."""
    global _VIRTUAL_RANK
    _VIRTUAL_RANK = rank


def is_pipeline_first_stage(ignore_virtual=False):
    """This rank holds the embeddings; unless `ignore_virtual`, with interleaving, also the
    chunk at work is the first one."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() > 1 \
            and _VIRTUAL_RANK not in (None, 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=False):
    """This rank holds the output layer; unless `ignore_virtual`, with interleaving, also the
    chunk at work is the last one."""
    chunks = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and chunks > 1 and _VIRTUAL_RANK not in (None, chunks - 1):
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_pipeline_model_parallel_stage_rank(stage):
    """Global rank of pipeline stage `stage` in this rank's pipeline (same TP and DP rank)."""
    return _require_state("get_pipeline_model_parallel_stage_rank").pipeline_ranks[stage]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage (the first one after the last, as Megatron's ring)."""
    stages = get_pipeline_model_parallel_world_size()
    return get_pipeline_model_parallel_stage_rank((get_pipeline_model_parallel_rank() + 1)
                                                  % stages)


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage (the last one before the first)."""
    stages = get_pipeline_model_parallel_world_size()
    return get_pipeline_model_parallel_stage_rank((get_pipeline_model_parallel_rank() - 1)
                                                  % stages)
