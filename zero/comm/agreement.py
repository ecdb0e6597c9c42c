"""What every layer's collectives share: the device a process group moves tensors on, and
whether any rank failed a step that all ranks must pass or fail together."""

import torch
import torch.distributed as dist


def collective_device(group=None):
    """NCCL moves CUDA tensors only; gloo (and a single process) CPU tensors."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank_failed(failed_here, group=None):
    """Whether this rank or any other of `group` failed: an all-reduce of a flag, which every
    rank of the group must call (so none waits forever on a rank that stopped, or goes on
    alone). With one process, just `failed_here`."""
    flag = torch.tensor([1 if failed_here else 0], dtype=torch.int32,
                        device=collective_device(group))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, group=group)
    return bool(flag.item())
