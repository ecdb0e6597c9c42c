"""Build shared files once: rank 0 of a process group builds, the others wait for it."""

import torch.distributed as dist

from megatron.errors import DataError
from zero.comm.agreement import any_rank_failed


def distributed_ready():
    return dist.is_available() and dist.is_initialized()


def is_rank_zero(group=None):
    return not distributed_ready() or dist.get_rank(group) == 0


def log_rank_zero(message):
    if is_rank_zero():
        print(message, flush=True)


def build_on_rank_zero(build, group=None, what="shared files"):
    """Run build() on rank 0 of `group` (default: all ranks); every rank of it must call this.

    The wait is an all-reduce of a failure flag rather than a bare barrier, so when rank 0
    fails the other ranks raise too instead of waiting forever.
    """
    if not distributed_ready():
        build()
        return
    error = None
    if dist.get_rank(group) == 0:
        try:
            build()
        except Exception as e:  # re-raised below, after telling the other ranks
            error = e
    failed = any_rank_failed(error is not None, group)
    if error is not None:
        raise error
    if failed:
        raise DataError(f"rank 0 failed to build {what}; its error message says why")
