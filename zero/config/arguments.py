"""DeepSpeed's command-line flags (as deepspeed.add_config_arguments adds them) and how the
config is chosen (as deepspeed.initialize chooses it).

    parser = zero.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()      # --deepspeed --deepspeed_config ds_config.json
    source = resolve_config_from_args(args, config=None)   # what DeepSpeedConfig should read
"""

import argparse
import logging
import os

from zero.errors import ConfigError

logger = logging.getLogger("zero.config.arguments")

DEFAULT_MASTER_PORT = "29500"  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT

# (rank, world size, local rank) variables of the common MPI launchers
MPI_ENVIRONMENTS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # Open MPI
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH / Intel MPI (Hydra)
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),  # MVAPICH2
)


class _DeprecatedDeepscale(argparse.Action):
    """--deepscale: the old name of --deepspeed; sets both so user code may test either."""

    def __call__(self, parser, namespace, values, option_string=None):
        logger.warning("--deepscale is deprecated, please use --deepspeed")
        namespace.deepscale = True
        namespace.deepspeed = True


def add_config_arguments(parser):
    """Adds the 'DeepSpeed' argument group to `parser` and returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the "
                            "engine)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, nargs=0, action=_DeprecatedDeepscale,
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact "
                            "on the engine)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    group.add_argument("--deepspeed_mpi", default=False, action="store_true",
                       help="Run via MPI: take rank, world size and local rank from the MPI "
                            "launcher's environment (MASTER_ADDR must be set)")
    return parser


def resolve_config_from_args(args, config=None):
    """The config to read: `--deepspeed_config` (or the deprecated `--deepscale_config`, moved
    into it) or the `config` given to initialize(), exactly one of them."""
    from_flags = getattr(args, "deepspeed_config", None) if args is not None else None
    old = getattr(args, "deepscale_config", None) if args is not None else None
    if old is not None:
        if from_flags is not None:
            raise ConfigError(f"both --deepscale_config ({old}) and --deepspeed_config "
                              f"({from_flags}) were given; --deepscale_config is the deprecated "
                              "name of --deepspeed_config, keep only --deepspeed_config")
        logger.warning("--deepscale_config is deprecated, please use --deepspeed_config")
        args.deepspeed_config = from_flags = old
        args.deepscale_config = None
    if from_flags is not None and config is not None:
        raise ConfigError(f"a DeepSpeed config was given twice: --deepspeed_config {from_flags} "
                          "and the config argument of initialize(); pass only one of them")
    if from_flags is None and config is None:
        raise ConfigError("zero needs a DeepSpeed config: pass --deepspeed_config <file.json> "
                          "(flags added by zero.add_config_arguments(parser)) or "
                          "initialize(config=<dict or path>)")
    return from_flags if from_flags is not None else config


def apply_mpi_environment(environ=None):
    """For --deepspeed_mpi (and init_distributed's MPI discovery): sets RANK, WORLD_SIZE,
    LOCAL_RANK (and a default MASTER_PORT) from the MPI launcher's variables so
    torch.distributed's env:// rendezvous works. Returns (rank, world_size, local_rank)."""
    environ = os.environ if environ is None else environ
    found = [names for names in MPI_ENVIRONMENTS if names[0] in environ and names[1] in environ]
    if not found:
        expected = ", ".join(names[0] for names in MPI_ENVIRONMENTS)
        raise ConfigError(f"--deepspeed_mpi was given but none of the MPI rank variables "
                          f"({expected}) is set; launch with mpirun, or drop --deepspeed_mpi")
    rank_name, size_name, local_name = found[0]
    if "MASTER_ADDR" not in environ:
        raise ConfigError(f"started by an MPI launcher ({rank_name} is set): MASTER_ADDR must "
                          "be the host name of rank 0 (e.g. mpirun -x MASTER_ADDR=node0 ...)")
    try:
        rank, world_size = int(environ[rank_name]), int(environ[size_name])
        local_rank = int(environ.get(local_name, rank))
    except ValueError:
        raise ConfigError(f"MPI variables {rank_name}={environ.get(rank_name)!r}, "
                          f"{size_name}={environ.get(size_name)!r} are not integers") from None
    environ["RANK"], environ["WORLD_SIZE"] = str(rank), str(world_size)
    environ["LOCAL_RANK"] = str(local_rank)
    environ.setdefault("MASTER_PORT", DEFAULT_MASTER_PORT)
    return rank, world_size, local_rank
