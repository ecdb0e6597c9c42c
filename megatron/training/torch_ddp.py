"""`--DDP-impl torch`: torch.nn.parallel.DistributedDataParallel reduces the gradients.

The model is wrapped before the zero engine is built; the engine sees a module that reduces
its own gradients and keeps only stage 0's step (masters, loss scaling, clipping). A
communication hook averages each bucket over the data-parallel group, in fp32 when the engine
config asks for fp32 communication (`--fp32-allreduce`).
"""

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Buffers are computed identically on every rank: broadcasting them in every forward would
# only add a collective. torch 2.13 renamed the switch and warns about the old name.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(
        torch.nn.parallel.DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False})


def wrap_torch_ddp(module, group, bucket_size_mb, fp32_allreduce):
    first = next(module.parameters())
    device_ids = [first.device.index] if first.device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(
        module, device_ids=device_ids, process_group=group, bucket_cap_mb=bucket_size_mb,
        **_NO_FORWARD_BUFFER_SYNC)
    ddp.register_comm_hook(_HookState(group, dist.get_world_size(group), fp32_allreduce),
                           _averaging_allreduce_hook)
    return ddp


@dataclass
class _HookState:
    group: object
    world_size: int
    fp32_allreduce: bool


def _averaging_allreduce_hook(state, bucket):
    """Mean over the group, optionally reduced in fp32."""
    buffer = bucket.buffer()
    reduced = buffer.float() if state.fp32_allreduce else buffer
    reduced.div_(state.world_size)
    future = dist.all_reduce(reduced, group=state.group, async_op=True).get_future()

    def back_to_bucket_dtype(fut):
        result = fut.value()[0]
        if result is not buffer:
            buffer.copy_(result)
        return buffer

    return future.then(back_to_bucket_dtype)
