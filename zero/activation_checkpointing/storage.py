"""Where a checkpoint's inputs wait between forward and recompute: partitioned, on the host,
in one preallocated buffer.

Inputs between transformer layers are replicated on every tensor-parallel rank, so with
`partition` each rank keeps only its 1/TP slice of the flattened input (padded so every slice
has the same length) and the full tensor is all-gathered again just before recompute.
With `to_cpu` the kept tensor lives in host memory (pinned when the model runs on CUDA, so the
copy back overlaps). With contiguous buffers every kept tensor of argument position i is a row
of one preallocated [num_checkpoints, n] tensor instead of its own allocation, which keeps
long-lived checkpoints from fragmenting the allocator between the short-lived activations.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class Stashed:
    """How to rebuild one argument in backward; `kept` is what actually stays alive."""
    kept: torch.Tensor
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool


class ContiguousBuffers:
    """One [num_checkpoints, numel] buffer per argument position, rows handed out by slot."""

    def __init__(self, num_checkpoints):
        self.num_checkpoints = num_checkpoints
        self.buffers = {}  # argument position -> tensor [num_checkpoints, numel]

    def row(self, position, slot, numel, dtype, device, pin):
        buffer = self.buffers.get(position)
        fits = buffer is not None and buffer.shape[1] == numel and buffer.dtype == dtype \
            and buffer.device == device
        if not fits:
            if slot != 0 and buffer is not None:
                raise RuntimeError(
                    f"contiguous activation checkpointing: checkpoint {slot} has an input "
                    f"(argument {position}) of {numel} {dtype} elements on {device}, but the "
                    f"buffer was sized for {buffer.shape[1]} {buffer.dtype} on {buffer.device}; "
                    "every checkpoint of one forward must have inputs of the same size")
            buffer = torch.empty((self.num_checkpoints, numel), dtype=dtype, device=device,
                                 pin_memory=pin)
            buffer.zero_()  # touch every page now, not in the middle of a forward
            self.buffers[position] = buffer
        # A tensor on the row's memory that is not an autograd view of the buffer: views share
        # one version counter, so filling row k would invalidate rows saved before it.
        row = torch.empty(0, dtype=dtype, device=device)
        return row.set_(buffer.untyped_storage(), slot * numel, (numel,))

    def nbytes(self):
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


@dataclass
class StoragePlan:
    partition: bool  # only true when tp_size > 1
    tp_rank: int
    tp_size: int
    tp_group: Optional[object]
    to_cpu: bool
    buffers: Optional[ContiguousBuffers]


def stash(tensor, position, slot, plan):
    """Keep `tensor` (an argument of the checkpointed function) for recompute per `plan`."""
    requires_grad = tensor.requires_grad
    floating = tensor.is_floating_point()
    partition = plan.partition and floating and tensor.numel() >= plan.tp_size
    if not floating:  # masks and ids: small, kept as they are
        return Stashed(tensor, tensor.shape, tensor.device, requires_grad, False)
    host = plan.to_cpu and tensor.device.type != "cpu"
    where = torch.device("cpu") if plan.to_cpu else tensor.device
    pin = host and torch.cuda.is_available()
    flat = tensor.detach().reshape(-1)
    if partition:
        chunk = math.ceil(flat.numel() / plan.tp_size)
        start = min(plan.tp_rank * chunk, flat.numel())
        local = flat[start:start + chunk]
    else:
        chunk, local = flat.numel(), flat
    if plan.buffers is not None:
        kept = plan.buffers.row(position, slot, chunk, tensor.dtype, where, pin)
    elif partition or host:
        kept = torch.empty(chunk, dtype=tensor.dtype, device=where, pin_memory=pin)
    else:  # nothing to change: keep the input itself, as plain recomputation does
        return Stashed(tensor.detach(), tensor.shape, tensor.device, requires_grad, False)
    kept[:local.numel()].copy_(local, non_blocking=pin)
    kept[local.numel():].zero_()  # the last rank's padding
    return Stashed(kept, tensor.shape, tensor.device, requires_grad, partition)


def unstash(stashed, plan):
    """The full argument again, on its device, detached (a leaf for the recompute)."""
    kept = stashed.kept.to(stashed.device, non_blocking=True)
    if stashed.partitioned:
        gathered = torch.empty(kept.numel() * plan.tp_size, dtype=kept.dtype, device=kept.device)
        _all_gather(gathered, kept.contiguous(), group=plan.tp_group)
        kept = gathered
    numel = math.prod(stashed.shape)
    full = kept.reshape(-1)[:numel].view(stashed.shape).detach()
    full.requires_grad_(stashed.requires_grad)
    return full


# torch >= 2.12 names it all_gather_single and deprecates the old name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
