"""Who this process is among the others, as its launcher tells it (`discover_launch_environment`).

The launchers are checked in this order:

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

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from megatron.errors import ConfigError

DEFAULT_MASTER_PORT = 6000  # Megatron's launch scripts use 6000 too


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
    # the variables that said rank and world size ("RANK=1 WORLD_SIZE=2"), for messages
    told_by: str = field(default="", compare=False)

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
        return _checked(_from_torchrun(env), env, "RANK", "WORLD_SIZE")
    if "OMPI_COMM_WORLD_RANK" in env:
        return _checked(_from_openmpi(env), env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _checked(_from_slurm(env), env, "SLURM_PROCID", "SLURM_NTASKS")
    for alone, missing, alone_default in (("RANK", "WORLD_SIZE", 0), ("WORLD_SIZE", "RANK", 1)):
        if alone in env and _int_variable(env, alone) != alone_default:
            raise ConfigError(f"environment variable {alone}={env[alone]} is set but {missing} "
                              f"is not: a launcher sets both (torchrun does); set {missing} "
                              f"too, or unset {alone} to run one process")
    # One process: no rendezvous, so a MASTER_ADDR left in the environment is not used
    return LaunchEnvironment("none", rank=0, world_size=1, local_rank=0, local_world_size=1,
                             master_addr=None, master_port=DEFAULT_MASTER_PORT)


def _checked(launch, env, rank_name, world_name):
    """`launch`, whose values its launcher's variables could not have given are one error."""
    told_by = f"{rank_name}={env.get(rank_name)} {world_name}={env.get(world_name)}"
    if launch.world_size < 1:
        raise ConfigError(f"environment variable {world_name}={launch.world_size}: a job has "
                          "at least one process")
    if not 0 <= launch.rank < launch.world_size:
        raise ConfigError(f"environment variables {told_by}: a rank runs from 0 to "
                          f"{world_name} - 1 ({launch.world_size - 1})")
    if launch.local_rank < 0:
        raise ConfigError(f"the local rank {launch.local_rank} from the environment is "
                          "negative")
    if not 1 <= launch.master_port <= 65535:
        raise ConfigError(f"MASTER_PORT {launch.master_port} is not a port (1 to 65535)")
    return dataclasses.replace(launch, told_by=told_by)


def _from_torchrun(env):
    world_size, rank = _int_variable(env, "WORLD_SIZE"), _int_variable(env, "RANK")
    # RANK/WORLD_SIZE set by hand without MASTER_ADDR: every rank is on this machine, rank 0
    # too (each its own GPU and share of the cores, unless LOCAL_RANK/LOCAL_WORLD_SIZE say)
    one_machine = "MASTER_ADDR" not in env
    return LaunchEnvironment(
        "torchrun", rank=rank, world_size=world_size,
        local_rank=_int_variable(env, "LOCAL_RANK", rank if one_machine else 0),
        local_world_size=_int_variable(env, "LOCAL_WORLD_SIZE",
                                       world_size if one_machine else 1),
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
