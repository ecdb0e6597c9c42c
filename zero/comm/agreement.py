"""What every layer's collectives share: the device a process group moves tensors on,
whether any rank failed a step that all ranks must pass or fail together, and whether the
ranks were given the same settings."""

import hashlib

import torch
import torch.distributed as dist

from zero.errors import ConfigError


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


def require_agreement(settings, comm, what):
    """ConfigError "`what`, but these differ: ..." unless every rank of `comm`'s group has the
    same `settings` ({name: a comparable value}). Every rank of the group must call it."""
    differ = disagreements(settings, comm)
    if differ:
        raise ConfigError(f"{what}, but these differ: " + "; ".join(differ))


def parameters_fingerprint(module):
    """A short hash of `module`'s parameter names, shapes (ZeRO-3's full ones), dtypes and
    requires_grad: equal on ranks that hold the same model."""
    described = [(name, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype), p.requires_grad)
                 for name, p in module.named_parameters()]
    return hashlib.sha1(repr(described).encode()).hexdigest()[:12]


def _comparable(value):
    """`value` as plain data that compares equal across processes: a tensor's values (not its
    device or printed rounding), an object's type."""
    if torch.is_tensor(value):
        return value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return [_comparable(item) for item in value]
    if isinstance(value, dict):
        return {key: _comparable(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def disagreements(settings, comm):
    """The entries of `settings` ({name: a comparable value}) whose values differ between
    the ranks of `comm`'s group, each as "name (rank 0: v0, rank 1: v1, ...)". Every rank of
    the group must call it (one all-gather of the dicts)."""
    if comm.world_size == 1:
        return []
    everyone = [None] * comm.world_size
    dist.all_gather_object(everyone, {name: _comparable(value) for name, value in
                                      settings.items()}, group=comm.group)
    said = []
    for name in settings:
        values = [ranks_settings.get(name) for ranks_settings in everyone]
        if any(value != values[0] for value in values):
            said.append(f"{name} (" + ", ".join(f"rank {rank}: {value}" for rank, value
                                                in enumerate(values)) + ")")
    return said
