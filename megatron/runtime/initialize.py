"""Process setup: device, torch.distributed (NCCL on CUDA, gloo on CPU), mpu groups, seeds.

Who a process is comes from the launcher that started it (`discover_launch_environment`),
checked in this order:

- torchrun / torch.distributed.launch / `deepspeed`: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
  `MASTER_ADDR`, `MASTER_PORT`;
- OpenMPI `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
  `OMPI_COMM_WORLD_LOCAL_RANK`; `MASTER_ADDR` must be exported across nodes (localhost when
  every rank is on one node);
- SLURM `srun` with one task per process: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`;
  `MASTER_ADDR` defaults to the first host of the step's node list, `MASTER_PORT` to a port
  derived from `SLURM_JOB_ID`.

The order matters: torchrun started by srun, or mpirun inside a SLURM allocation, describe the
processes they started, while the SLURM variables they inherit describe the allocation.
"""

import datetime
import os
import random
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.runtime import device as device_mod
from megatron import mpu
from megatron.runtime.activation_checkpointing import (setup_activation_checkpointing,
                                               teardown_activation_checkpointing)
from megatron.errors import ConfigError

DEFAULT_MASTER_PORT = 6000  # Megatron's launch scripts use 6000 too


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


@dataclass(frozen=True)
class LaunchEnvironment:
    """This process's place in the job, as told by its launcher's environment variables."""
    launcher: str  # "torchrun", "openmpi", "slurm" or "none" (a plain `python` process)
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # processes on this node; sets the default CPU threads per process
    master_addr: Optional[str]  # where rank 0 listens for the rendezvous; None for one process
    master_port: int

    def as_torchrun_variables(self):
        """The same facts under torchrun's names, for code that reads those (the CPU thread
        default in megatron/runtime/device.py, DataLoader worker processes)."""
        variables = {"RANK": self.rank, "WORLD_SIZE": self.world_size,
                     "LOCAL_RANK": self.local_rank, "LOCAL_WORLD_SIZE": self.local_world_size,
                     "MASTER_PORT": self.master_port}
        if self.master_addr is not None:
            variables["MASTER_ADDR"] = self.master_addr
        return {name: str(value) for name, value in variables.items()}


def discover_launch_environment(env=None):
    """Read rank, world size and rendezvous address from torchrun, OpenMPI or SLURM variables."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_openmpi(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    return LaunchEnvironment("none", rank=0, world_size=1, local_rank=0, local_world_size=1,
                             master_addr=env.get("MASTER_ADDR"),
                             master_port=_int_variable(env, "MASTER_PORT", DEFAULT_MASTER_PORT))


def _from_torchrun(env):
    world_size = _int_variable(env, "WORLD_SIZE")
    return LaunchEnvironment(
        "torchrun", rank=_int_variable(env, "RANK"), world_size=world_size,
        local_rank=_int_variable(env, "LOCAL_RANK", 0),
        local_world_size=_int_variable(env, "LOCAL_WORLD_SIZE", 1),
        # RANK/WORLD_SIZE set by hand on one machine: rank 0 is local.
        master_addr=env.get("MASTER_ADDR", "localhost" if world_size > 1 else None),
        master_port=_int_variable(env, "MASTER_PORT", DEFAULT_MASTER_PORT))


def _from_openmpi(env):
    world_size = _int_variable(env, "OMPI_COMM_WORLD_SIZE")
    local_world_size = _int_variable(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world_size)
    master_addr = env.get("MASTER_ADDR")
    if master_addr is None and local_world_size == world_size:
        master_addr = "localhost"  # every rank on this node
    if master_addr is None:
        raise ConfigError(
            f"OpenMPI started {world_size} processes on several nodes but MASTER_ADDR is not "
            f"set: export the host of rank 0 to every process, e.g. "
            f"`mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT={DEFAULT_MASTER_PORT} ...`")
    return LaunchEnvironment(
        "openmpi", rank=_int_variable(env, "OMPI_COMM_WORLD_RANK"), world_size=world_size,
        local_rank=_int_variable(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_world_size=local_world_size, master_addr=master_addr,
        master_port=_int_variable(env, "MASTER_PORT", DEFAULT_MASTER_PORT))


def _from_slurm(env):
    # srun puts task 0 on the first node of the step, and rank 0 hosts the rendezvous store.
    # (SLURM_LAUNCH_NODE_IPADDR is where srun ran: a login node for an interactive srun.)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" in env:
        master_addr = env["MASTER_ADDR"]
    elif nodelist:
        master_addr = first_host(nodelist)
    else:
        master_addr = env.get("SLURM_LAUNCH_NODE_IPADDR", "localhost")
    # A port derived from the job id, so two jobs sharing a node do not collide.
    job_port = 20000 + _int_variable(env, "SLURM_JOB_ID", 0) % 20000
    # "4(x2),3": 4 tasks on each of two nodes, then 3; only the thread default depends on it.
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    leading_count = re.match(r"\d+", tasks_per_node)
    return LaunchEnvironment(
        "slurm", rank=_int_variable(env, "SLURM_PROCID"),
        world_size=_int_variable(env, "SLURM_NTASKS"),
        local_rank=_int_variable(env, "SLURM_LOCALID", 0),
        local_world_size=int(leading_count.group()) if leading_count else 1,
        master_addr=master_addr, master_port=_int_variable(env, "MASTER_PORT", job_port))


def first_host(nodelist):
    """The first host of a SLURM node list: "gpu[07-09,12],cpu1" -> "gpu07".

    Handles one bracketed range group per host name, which is what SLURM prints for the usual
    `prefix[ranges]` names.
    """
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)", nodelist.strip())
    prefix, ranges, suffix = match.groups()
    first = ranges.split(",")[0].split("-")[0] if ranges else ""
    return prefix + first + suffix


def _int_variable(env, name, default=None):
    if name not in env:
        if default is None:
            raise ConfigError(f"environment variable {name} is required by the launcher "
                              f"variables that are set; set it or unset the others")
        return default
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") \
            from None


def initialize_megatron(args):
    """Set threads, device, process group, model-parallel groups and seeds; return a Runtime."""
    launch = discover_launch_environment()
    local_rank = launch.local_rank if args.local_rank is None else args.local_rank
    if launch.world_size != args.world_size:
        raise ConfigError(
            f"the flags were checked for a world size of {args.world_size} but the "
            f"{launch.launcher} launcher started {launch.world_size} processes; parse the "
            f"flags in the launched process (parse_args(world_size=None))")
    if launch.launcher in ("openmpi", "slurm"):
        # Code that reads torchrun's variables (the CPU thread default) sees this job too.
        for name, value in launch.as_torchrun_variables().items():
            os.environ.setdefault(name, value)
    device = device_mod.resolve_device(args.device, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or device_mod.default_num_threads())
    _init_process_group(args, device, launch)
    mpu.initialize_model_parallel(args.model_parallel_size,
                                  timeout=collective_timeout(args))
    # Before seeding: under --deepspeed-activation-checkpointing mpu uses zero's RNG tracker.
    setup_activation_checkpointing(args, device, is_rank0=launch.rank == 0)
    set_random_seed(args.seed, device)
    return Runtime(device=device, rank=launch.rank, world_size=launch.world_size,
                   local_rank=local_rank)


def collective_timeout(args):
    """--distributed-timeout-minutes as a timedelta (fractions allowed, e.g. 0.5)."""
    minutes = args.distributed_timeout_minutes
    if not minutes > 0:
        raise ConfigError(f"--distributed-timeout-minutes must be positive, got {minutes}")
    return datetime.timedelta(minutes=minutes)


def _init_process_group(args, device, launch):
    """Join the job. Every collective (and the rendezvous itself) fails after the timeout
    instead of waiting forever for a rank that died or hangs."""
    if dist.is_initialized():
        return
    backend = args.distributed_backend or device_mod.backend_for(device)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("--distributed-backend nccl needs CUDA; use gloo on the CPU")
    timeout = collective_timeout(args)
    if launch.world_size == 1 and launch.master_addr is None:
        # A single process needs no rendezvous: an in-memory store is enough.
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
        raise ConfigError(
            f"rank {launch.rank} of {launch.world_size} could not meet the "
            f"others at {launch.master_addr}:{launch.master_port} within "
            f"--distributed-timeout-minutes {args.distributed_timeout_minutes}: {reason}. "
            f"Check that all {launch.world_size} processes were started, with the same world "
            f"size, and that MASTER_ADDR/MASTER_PORT is rank 0's host and reachable") from None


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


def destroy():
    teardown_activation_checkpointing()
    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
