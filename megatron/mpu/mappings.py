"""Communication at the edges of a tensor-parallel region, as paired autograd functions
(with grad mode off, where there is no backward, reduce_from is the bare all-reduce).

Each op's backward is the conjugate of its forward:

    copy_to      identity  / all-reduce      (enter a region with a replicated input)
    reduce_from  all-reduce / identity       (leave a region holding partial sums)
    scatter_to   split last dim / all-gather
    gather_from  all-gather last dim / split

All four are the identity when the tensor-parallel size is 1, with no communication.
"""

import torch
import torch.distributed as dist

from megatron.mpu.initialize import (get_model_parallel_group, get_model_parallel_rank,
                                     get_model_parallel_world_size)


# Newer torch renames all_gather_into_tensor (equal sizes, one flat output tensor).
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_reduce_(tensor):
    """Sum `tensor` in place over the tensor-parallel group."""
    dist.all_reduce(tensor, group=get_model_parallel_group())
    return tensor


def _split_last_dim(tensor):
    """Keep this rank's slice of the last dimension."""
    world_size = get_model_parallel_world_size()
    chunk = tensor.size(-1) // world_size
    assert chunk * world_size == tensor.size(-1), (
        f"last dim {tensor.size(-1)} is not divisible by tensor-parallel size {world_size}")
    rank = get_model_parallel_rank()
    # contiguous: the slice feeds F.linear and, in backward, an all-gather.
    return tensor.narrow(-1, rank * chunk, chunk).contiguous()


def _gather_last_dim(tensor):
    """Concatenate every rank's tensor along the last dimension."""
    world_size = get_model_parallel_world_size()
    flat = tensor.contiguous().view(-1)
    gathered = flat.new_empty(world_size * flat.numel())  # rank i's tensor at [i * n, (i+1) * n)
    _all_gather_into_tensor(gathered, flat, group=get_model_parallel_group())
    return torch.cat(gathered.view((world_size,) + tuple(tensor.shape)).unbind(0), dim=-1)


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        # Autograd may hand the same gradient tensor to several consumers: reduce a copy.
        return _all_reduce_(grad_output.clone())


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        # The input is a fresh partial sum (a matmul output): reduce it in place.
        ctx.mark_dirty(input_)
        return _all_reduce_(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_last_dim(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_last_dim(grad_output)


def copy_to_model_parallel_region(input_):
    if get_model_parallel_world_size() == 1:
        return input_
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_model_parallel_region(input_):
    """All-reduce over the tensor-parallel group.  Reduces `input_` in place (under grad
    mode through mark_dirty)."""
    if get_model_parallel_world_size() == 1:
        return input_
    if not torch.is_grad_enabled():
        # No graph to record (evaluation, generation). Also the only way torch.compile traces
        # it there: dynamo handles mark_dirty only when apply() records a backward.
        return _all_reduce_(input_)
    return _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_model_parallel_region(input_):
    if get_model_parallel_world_size() == 1:
        return input_
    return _ScatterToModelParallelRegion.apply(input_)


def gather_from_model_parallel_region(input_):
    if get_model_parallel_world_size() == 1:
        return input_
    return _GatherFromModelParallelRegion.apply(input_)
