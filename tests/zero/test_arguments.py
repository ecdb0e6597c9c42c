"""DeepSpeed's flags (deepspeed.add_config_arguments) and the rules choosing the config (deepspeed.initialize)."""

import argparse

import pytest

from zero import ConfigError, add_config_arguments, resolve_config_from_args
from zero.config.arguments import apply_mpi_environment


def parse(*argv):
    return add_config_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_flags_and_defaults():
    args = parse()
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config,
            args.deepspeed_mpi) == (False, None, False, None, False)
    args = parse("--deepspeed", "--deepspeed_config", "ds.json", "--deepspeed_mpi")
    assert args.deepspeed and args.deepspeed_config == "ds.json" and args.deepspeed_mpi
    group_titles = [g.title for g in add_config_arguments(argparse.ArgumentParser())
                    ._action_groups]
    assert "DeepSpeed" in group_titles


def test_deprecated_deepscale_sets_deepspeed():
    args = parse("--deepscale")
    assert args.deepscale and args.deepspeed


def test_config_from_flag_or_call():
    assert resolve_config_from_args(parse("--deepspeed_config", "a.json")) == "a.json"
    assert resolve_config_from_args(parse(), {"train_batch_size": 1}) == {"train_batch_size": 1}
    assert resolve_config_from_args(None, "b.json") == "b.json"


def test_deepscale_config_is_moved_into_deepspeed_config():
    args = parse("--deepscale_config", "old.json")
    assert resolve_config_from_args(args) == "old.json"
    assert (args.deepspeed_config, args.deepscale_config) == ("old.json", None)


@pytest.mark.parametrize("argv, config, piece", [
    (["--deepscale_config", "a.json", "--deepspeed_config", "b.json"], None, "keep only"),
    (["--deepspeed_config", "a.json"], {"train_batch_size": 1}, "given twice"),
    ([], None, "needs a DeepSpeed config"),
])
def test_config_choice_errors(argv, config, piece):
    with pytest.raises(ConfigError, match=piece):
        resolve_config_from_args(parse(*argv), config)


def test_mpi_environment_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "node0"}
    assert apply_mpi_environment(env) == (3, 8, 1)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == \
        ("3", "8", "1", "29500")


def test_mpi_environment_mpich_keeps_master_port():
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "6000"}
    assert apply_mpi_environment(env) == (0, 2, 0)
    assert env["MASTER_PORT"] == "6000"


@pytest.mark.parametrize("env, piece", [
    ({}, "none of the MPI rank variables"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "MASTER_ADDR"),
    ({"PMI_RANK": "x", "PMI_SIZE": "2", "MASTER_ADDR": "h"}, "not integers"),
])
def test_mpi_environment_errors(env, piece):
    with pytest.raises(ConfigError, match=piece):
        apply_mpi_environment(env)


_BUILD_UNDER_INIT = """
import torch, torch.distributed as dist, zero
with zero.Init(config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}):
    model = torch.nn.Linear(4, 4, bias=False)
print(dist.is_initialized() and dist.get_world_size(), model.weight.ds_tensor.numel())
zero.init_distributed()  # DeepSpeed's deepspeed.init_distributed: running already, a no-op
"""


def test_zero_init_starts_the_process_group_a_launcher_set_up(tmp_path):
    """A script run by torchrun that builds its model under zero.Init before initialize (as
    DeepSpeed's zero.Init does, it starts torch.distributed): the partitions are halves."""
    import subprocess
    import sys
    from tests.dist_utils import REPO, free_port
    from tests.parallel.launching import clean_environment, torchrun_variables
    port, rank_env = free_port(), torchrun_variables(2)
    ranks = [subprocess.Popen([sys.executable, "-c", _BUILD_UNDER_INIT], cwd=REPO, text=True,
                              env=clean_environment(**rank_env(rank, port)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(2)]
    outputs = [process.communicate(timeout=120)[0] for process in ranks]
    for process, output in zip(ranks, outputs):
        assert process.returncode == 0, output
        assert output.split()[-2:] == ["2", "8"], output  # 16 elements over 2 ranks


_BY_HAND = """
import sys, torch.distributed as dist, zero
zero.init_distributed()  # no launcher's variables: alone, without a group
assert not dist.is_initialized()
try:
    zero.init_distributed(config={"comms_logger": {"enabled": True}})
except zero.ZeroError as e:
    print("config:", e)
# DeepSpeed's positional order, then its tcp/file initialisation by rank and world size
zero.init_distributed("gloo", True, 29500, False, 60, "file://" + sys.argv[1], None, None, 0, 1)
print("started", dist.get_backend(), dist.get_world_size())
"""


def _run_python(script, *args, **environment):
    import subprocess
    import sys
    from tests.dist_utils import REPO
    from tests.parallel.launching import clean_environment
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=REPO,
                            env=clean_environment(**environment), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_init_distributed_takes_deepspeeds_arguments(tmp_path):
    process = _run_python(_BY_HAND, tmp_path / "rendezvous")
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output
    assert output.splitlines()[-1] == "started gloo 1"
    assert "config: init_distributed: 'config' (DeepSpeed's communication logging) is not " \
           "supported" in output


_FROM_MPIRUN = """
import torch.distributed as dist, zero
zero.init_distributed(distributed_port=int(__import__("sys").argv[1]))
print("started", *((dist.get_backend(), dist.get_world_size()) if dist.is_initialized()
                   else (None, None)))
"""


def test_init_distributed_takes_mpiruns_variables():
    """Two processes as mpirun starts them (Open MPI's variables, MASTER_ADDR exported): one
    group of 2 on distributed_port; one process of an MPI world of 1 runs alone."""
    from tests.dist_utils import free_port
    port = free_port()
    ranks = [_run_python(_FROM_MPIRUN, port, OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_SIZE=2,
                         OMPI_COMM_WORLD_LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1")
             for rank in range(2)]
    alone = _run_python(_FROM_MPIRUN, port, OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=1)
    expected = ("started gloo 2", "started gloo 2", "started None None")
    for process, said in zip((*ranks, alone), expected):
        output = process.communicate(timeout=120)[0]
        assert process.returncode == 0, output
        assert output.splitlines()[-1] == said, output
