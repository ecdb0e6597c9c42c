"""Starting torch.distributed from a launcher's environment: DeepSpeed's
`deepspeed.init_distributed`, which `zero.initialize` and `zero.Init` call when no process
group is running yet."""

import datetime
import os

import torch
import torch.distributed as dist

from zero.errors import ZeroError


def init_distributed(dist_backend=None, distributed_port=29500, timeout=None, init_method=None,
                     dist_init_required=None):
    """Start the default process group from torchrun's variables (RANK, WORLD_SIZE, and
    MASTER_ADDR/MASTER_PORT, defaulting to 127.0.0.1:`distributed_port`) unless one is running
    or `dist_init_required` is False. `dist_backend`: nccl on CUDA, gloo on CPU by default.
    Without a launcher (no RANK/WORLD_SIZE) the process runs alone, without a group."""
    if dist_init_required is False or dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        if dist_init_required:
            raise ZeroError("dist_init_required=True but RANK and WORLD_SIZE are not set; "
                            "launch with torchrun (or deepspeed/mpirun with --deepspeed_mpi)")
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    options = {} if timeout is None else {"timeout": timeout if isinstance(
        timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)}
    dist.init_process_group(backend, init_method=init_method, **options)
