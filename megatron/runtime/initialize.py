"""Process setup: device, torch.distributed (NCCL on CUDA, gloo on CPU), mpu groups, seeds.

Who the process is comes from its launcher (megatron/runtime/launch.py); everything else from
the resolved config's `parallel` section.
"""

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron import mpu
from megatron.errors import ConfigError, LaunchError
from megatron.runtime import device as device_mod
from megatron.runtime.activation_checkpointing import (setup_activation_checkpointing,
                                                       teardown_activation_checkpointing)
from megatron.runtime.launch import discover_launch_environment
from megatron.runtime.launcher_watch import watch_launcher


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

    def print0(self, message):
        """Print on global rank 0 only."""
        if self.is_rank0:
            print(message, flush=True)


def initialize_megatron(parallel, recompute=None, notes=()):
    """Set threads, device, process group, model-parallel groups and seeds; return a Runtime.

    `parallel` is the config's ParallelConfig; `recompute` its activation checkpointing's
    DeepSpeed options (None: Megatron's recompute) and `notes` what rank 0 prints about it.
    """
    launch = discover_launch_environment()
    local_rank = launch.local_rank if parallel.local_rank is None else parallel.local_rank
    if launch.launcher == "torchrun" and "LOCAL_RANK" in os.environ and \
            local_rank != launch.local_rank:
        raise LaunchError(f"--local_rank {parallel.local_rank} differs from the local rank "
                          f"{launch.local_rank} the {launch.launcher} launcher gave this process "
                          "(LOCAL_RANK): drop --local_rank, the launcher sets it")
    watch_launcher(local_rank)
    if launch.world_size != parallel.world_size:
        raise ConfigError(
            f"the flags were checked for a world size of {parallel.world_size} but the "
            f"{launch.launcher} launcher started {launch.world_size} processes; resolve the "
            f"config in the launched process (resolve_config(world_size=None))")
    if launch.launcher != "none":
        # Code that reads torchrun's variables (the CPU thread default) sees this job too,
        # as do ranks started by hand with RANK and WORLD_SIZE only
        for name, value in launch.as_torchrun_variables().items():
            os.environ.setdefault(name, value)
    device = device_mod.resolve_device(parallel.device, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(parallel.threads or device_mod.default_num_threads())
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    _init_process_group(parallel, device, launch, timeout)
    mpu.initialize_model_parallel(
        parallel.model_parallel_size, timeout=timeout,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size)
    # Before seeding: under --deepspeed-activation-checkpointing mpu uses zero's RNG tracker.
    setup_activation_checkpointing(recompute, notes, device, is_rank0=launch.rank == 0)
    set_random_seed(parallel.seed, device)
    return Runtime(device=device, rank=launch.rank, world_size=launch.world_size,
                   local_rank=local_rank)


def _init_process_group(parallel, device, launch, timeout):
    """Join the job. Every collective (and the rendezvous itself) fails after the timeout
    instead of waiting forever for a rank that died or hangs."""
    if dist.is_initialized():
        return
    backend = parallel.distributed_backend or device_mod.backend_for(device)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("--distributed-backend nccl needs CUDA; use gloo on the CPU")
    if launch.world_size == 1:
        # A single process needs no rendezvous (nor any MASTER_ADDR left in the environment):
        # an in-memory store is enough.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    try:
        rendezvous = _restart_safe_store(launch, timeout)
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout,
                                device_id=device if device.type == "cuda" else None,
                                **({"store": rendezvous} if rendezvous is not None
                                   else {"init_method": _tcp_address(launch)}))
    except (dist.DistStoreError, dist.DistNetworkError) as error:
        # The usual causes are a node not started or started with other variables.
        reason = str(error).strip().splitlines()[0].rstrip(".")
        raise LaunchError(
            f"rank {launch.rank} of {launch.world_size} could not meet the "
            f"others at {launch.master_addr}:{launch.master_port} within "
            f"--distributed-timeout-minutes {parallel.distributed_timeout_minutes:g}: {reason}. "
            f"The {launch.launcher} launcher's {launch.told_by} said {launch.world_size} "
            f"processes: check that all were started, with the same world size, and that "
            f"MASTER_ADDR/MASTER_PORT is rank 0's host and reachable"
            + (". In a batch script, start them with srun (one process started by hand reads "
               "the allocation's SLURM_NTASKS)" if launch.launcher == "slurm" else "")) from None


def _restart_safe_store(launch, timeout):
    """Under torchrun (elastic), a store whose keys are private to this restart attempt.

    torchrun --max-restarts keeps its rendezvous store across restarts; joining it the plain
    way, the restarted ranks read the addresses the dead attempt published and gloo's
    connectFullMesh times out ("Connection refused").  None outside torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or launch.launcher != "torchrun":
        return None
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                          is_master=not agent_hosts_it and launch.rank == 0, timeout=timeout)
    return dist.PrefixStore(f"megatron/attempt_{attempt}", store)


def _tcp_address(launch):
    host = launch.master_addr
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"tcp://{host}:{launch.master_port}"


def set_random_seed(seed, device):
    """Seed python, numpy, torch and the model-parallel RNG tracker.

    The same seed on every rank: weights are generated identically everywhere and then
    sliced, which is what makes every parallel layout start from the same model.
    """
    random.seed(seed)
    np.random.seed(seed)
    device_mod.manual_seed(device, seed)
    mpu.model_parallel_cuda_manual_seed(seed)


def seed_pipeline_stage(seed, device):
    """After the model is built (every stage draws the single-process weights): give each
    pipeline stage its own dropout streams, seed + 100 x stage as Megatron does, so stages do
    not repeat each other's masks."""
    stage = mpu.get_pipeline_model_parallel_rank()
    if stage > 0:
        device_mod.manual_seed(device, seed + 100 * stage)
        mpu.model_parallel_cuda_manual_seed(seed + 100 * stage)


def destroy():
    teardown_activation_checkpointing()
    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
