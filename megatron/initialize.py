"""Process setup: device, torch.distributed (NCCL on CUDA, gloo on CPU), mpu groups, seeds."""

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron import device as device_mod
from megatron import mpu
from megatron.errors import ConfigError


@dataclass
class Runtime:
    """Where this process runs and who it is among the others."""
    device: torch.device
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_rank0(self):
        return self.rank == 0


def _rank_from_environment():
    """(rank, world_size, local_rank) from torchrun, SLURM or OpenMPI variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "OMPI_COMM_WORLD_RANK" in env:
        return (int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return (int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                int(env.get("SLURM_LOCALID", 0)))
    return 0, 1, 0


def initialize_megatron(args):
    """Set threads, device, process group, model-parallel groups and seeds; return a Runtime."""
    rank, world_size, local_rank = _rank_from_environment()
    if args.local_rank is not None:
        local_rank = args.local_rank
    if world_size != args.world_size:
        raise ConfigError(f"arguments were validated for world size {args.world_size} but "
                          f"the launcher reports {world_size}")
    device = device_mod.resolve_device(args.device, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or device_mod.default_num_threads())
    _init_process_group(args, device, rank, world_size)
    mpu.initialize_model_parallel(args.model_parallel_size)
    set_random_seed(args.seed, device)
    return Runtime(device=device, rank=rank, world_size=world_size, local_rank=local_rank)


def _init_process_group(args, device, rank, world_size):
    if dist.is_initialized():
        return
    backend = args.distributed_backend or device_mod.backend_for(device)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("--distributed-backend nccl needs CUDA; use gloo on the CPU")
    timeout = datetime.timedelta(minutes=getattr(args, "distributed_timeout_minutes", 10))
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        # A single process needs no rendezvous: an in-memory store is enough.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "6000")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)


def set_random_seed(seed, device):
    """Seed python, numpy, torch and the model-parallel RNG tracker.

    The same seed on every rank: weights are generated identically everywhere and then
    sliced, which is what makes every parallel layout start from the same model.
    """
    random.seed(seed)
    np.random.seed(seed)
    device_mod.manual_seed(device, seed)
    mpu.model_parallel_cuda_manual_seed(seed)


def destroy():
    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
