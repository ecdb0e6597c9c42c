"""Starting torch.distributed from a launcher's environment: DeepSpeed's
`deepspeed.init_distributed`, which `zero.initialize` and `zero.Init` call when no process
group is running yet."""

import datetime
import logging
import os

import torch
import torch.distributed as dist

from zero.config.arguments import MPI_ENVIRONMENTS, apply_mpi_environment
from zero.errors import ZeroError

logger = logging.getLogger("zero.comm")


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=None, init_method=None, dist_init_required=None,
                     config=None, rank=-1, world_size=-1):
    """Start the default process group (DeepSpeed's arguments, in its order) unless one is
    running or `dist_init_required` is False: from torchrun's variables (RANK, WORLD_SIZE,
    MASTER_ADDR/MASTER_PORT, defaulting to 127.0.0.1:`distributed_port`), else from mpirun's
    (`auto_mpi_discovery`), else from `init_method` with `rank` and `world_size`. Without any
    of them (or with an MPI world of one process) the process runs alone, without a group.
    `dist_backend`: nccl on CUDA, gloo on CPU by default (the GPU: LOCAL_RANK's, when set);
    `timeout`: seconds or a timedelta."""
    if config is not None:
        raise ZeroError("init_distributed: 'config' (DeepSpeed's communication logging) is not "
                        "supported; leave it out")
    if dist_init_required is False or dist.is_initialized():
        return
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if not launched and auto_mpi_discovery and _mpi_world_size() > 1:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        apply_mpi_environment()
        launched = True
    explicit = init_method is not None and rank >= 0 and world_size >= 1
    if not (launched or explicit):
        if dist_init_required:
            raise ZeroError("dist_init_required=True but RANK and WORLD_SIZE are not set; "
                            "launch with torchrun (or deepspeed/mpirun with --deepspeed_mpi), "
                            "or pass init_method with rank and world_size")
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and "LOCAL_RANK" in os.environ:  # (else the caller chose the GPU)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    options = {} if timeout is None else {"timeout": timeout if isinstance(
        timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)}
    if explicit:
        options.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend, init_method=init_method, **options)
    if verbose:
        logger.info("torch.distributed started: %s, rank %d of %d", backend, dist.get_rank(),
                    dist.get_world_size())


def _mpi_world_size():
    """The world size an MPI launcher's variables give (0: none set)."""
    for rank, size, _ in MPI_ENVIRONMENTS:
        if rank in os.environ and size in os.environ:
            try:
                return int(os.environ[size])
            except ValueError:
                return 2  # (apply_mpi_environment says what is wrong with it)
    return 0
