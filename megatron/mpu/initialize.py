"""Tensor- and data-parallel process groups, kept in one `ParallelState` object.

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
    """Who this process is within its tensor-parallel and data-parallel groups."""
    model_parallel_group: Any
    data_parallel_group: Any
    model_parallel_size: int
    model_parallel_rank: int
    data_parallel_size: int
    data_parallel_rank: int
    model_parallel_src_rank: int  # global rank of tensor-parallel rank 0 in this group


_STATE: Optional[ParallelState] = None
# Set by tools (checkpoint merge/split) that need the layout without a process group.
_MP_WORLD_SIZE_OVERRIDE: Optional[int] = None
_MP_RANK_OVERRIDE: Optional[int] = None


def initialize_model_parallel(model_parallel_size, timeout=None):
    """Split the world into tensor-parallel groups of adjacent ranks and strided DP groups.

    With 8 processes g0..g7 and model_parallel_size 2:
        tensor-parallel groups: [g0, g1], [g2, g3], [g4, g5], [g6, g7]
        data-parallel groups:   [g0, g2, g4, g6], [g1, g3, g5, g7]
    Adjacent ranks usually share a node, so the frequent tensor-parallel all-reduces stay
    on the fastest links.  Every rank must call this (group creation is collective).
    `timeout` (a timedelta) bounds every collective on the new groups; None keeps torch's
    default.
    """
    global _STATE
    if not dist.is_initialized():
        raise ConfigError("initialize_model_parallel needs torch.distributed; call "
                          "torch.distributed.init_process_group first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if model_parallel_size < 1 or world_size % model_parallel_size != 0:
        raise ConfigError(
            f"--model-parallel-size {model_parallel_size} must be a positive divisor of the "
            f"world size {world_size} ({world_size} % {model_parallel_size} = "
            f"{world_size % max(model_parallel_size, 1)}); change --model-parallel-size or "
            f"the number of processes")
    if _STATE is not None:
        destroy_model_parallel()
    num_data_parallel = world_size // model_parallel_size
    model_group = data_group = None
    for i in range(num_data_parallel):
        ranks = list(range(i * model_parallel_size, (i + 1) * model_parallel_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            model_group = group
    for i in range(model_parallel_size):
        ranks = list(range(i, world_size, model_parallel_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            data_group = group
    _STATE = ParallelState(
        model_parallel_group=model_group, data_parallel_group=data_group,
        model_parallel_size=model_parallel_size, model_parallel_rank=rank % model_parallel_size,
        data_parallel_size=num_data_parallel, data_parallel_rank=rank // model_parallel_size,
        model_parallel_src_rank=(rank // model_parallel_size) * model_parallel_size)
    return _STATE


def model_parallel_is_initialized():
    return _STATE is not None


def get_parallel_state():
    """The current `ParallelState`, or None before `initialize_model_parallel`."""
    return _STATE


def destroy_model_parallel():
    """Forget the groups and overrides, so the next `initialize_model_parallel` starts clean."""
    global _STATE, _MP_WORLD_SIZE_OVERRIDE, _MP_RANK_OVERRIDE
    state, _STATE = _STATE, None
    _MP_WORLD_SIZE_OVERRIDE = _MP_RANK_OVERRIDE = None
    if state is not None and dist.is_initialized():
        for group in (state.model_parallel_group, state.data_parallel_group):
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
