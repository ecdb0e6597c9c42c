"""Rank discovery: torchrun's, SLURM's and OpenMPI's variables, the values no launcher gives
(each one error), and the local rank each process takes (its GPU, its share of the cores)."""

import pytest

from megatron.errors import ConfigError, LaunchError
from megatron.runtime.launch import LaunchEnvironment, discover_launch_environment, first_host
from tests.dist_utils import free_port
from tests.parallel.launching import FLAGS_FOR_SETUP_ONLY, trainer_argv

def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert discover_launch_environment(env) == LaunchEnvironment(
        "torchrun", rank=5, world_size=8, local_rank=1, local_world_size=4,
        master_addr="node0", master_port=29500)


def test_rank_and_world_size_set_by_hand_rendezvous_on_this_machine():
    """Every rank on this machine: each its own local rank (GPU) and share of the cores."""
    launch = discover_launch_environment({"RANK": "1", "WORLD_SIZE": "2"})
    assert (launch.master_addr, launch.master_port, launch.local_rank,
            launch.local_world_size) == ("localhost", 6000, 1, 2)
    launch = discover_launch_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "n0"})
    assert (launch.local_rank, launch.local_world_size) == (0, 1)  # where is unknown


def test_slurm_variables():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-08,12],cpu1", "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
           "SLURM_JOB_ID": "123456", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.99"}
    assert discover_launch_environment(env) == LaunchEnvironment(
        "slurm", rank=9, world_size=16, local_rank=1, local_world_size=8,
        master_addr="gpu07", master_port=20000 + 123456 % 20000)


def test_slurm_prefers_the_step_node_list_and_explicit_master():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a[1-4]",
           "SLURM_STEP_NODELIST": "a[3-4]"}
    assert discover_launch_environment(env).master_addr == "a3"
    env.update(MASTER_ADDR="10.1.1.1", MASTER_PORT="7000")
    launch = discover_launch_environment(env)
    assert (launch.master_addr, launch.master_port) == ("10.1.1.1", 7000)


def test_slurm_without_node_list_uses_the_launch_node():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5"}
    assert discover_launch_environment(env).master_addr == "10.0.0.5"


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("node[01-04]", "node01"), ("node[3,5-7]", "node3"),
    ("gpu[07-09,12],cpu1", "gpu07"), ("cpu1,gpu[1-2]", "cpu1"), ("r1-[10-11]-ib", "r1-10-ib"),
])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_openmpi_variables_on_one_node():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert discover_launch_environment(env) == LaunchEnvironment(
        "openmpi", rank=3, world_size=4, local_rank=3, local_world_size=4,
        master_addr="localhost", master_port=6000)


def test_openmpi_across_nodes_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
        discover_launch_environment(env)
    assert discover_launch_environment({**env, "MASTER_ADDR": "n0"}).master_addr == "n0"


def test_a_launcher_inside_a_slurm_job_wins_over_the_slurm_variables():
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "n1", "MASTER_PORT": "6000"}
    openmpi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    assert discover_launch_environment({**slurm, **torchrun}).rank == 3
    assert discover_launch_environment({**slurm, **openmpi}).rank == 5


def test_no_launcher_is_one_process():
    launch = discover_launch_environment({})
    assert (launch.launcher, launch.rank, launch.world_size, launch.master_addr) == \
        ("none", 0, 1, None)


def test_malformed_variable_is_a_clear_error():
    with pytest.raises(ConfigError, match="SLURM_PROCID='x' is not an integer"):
        discover_launch_environment({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize("env, said", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 WORLD_SIZE=2: a rank runs from 0 to WORLD_SIZE "
                                       "- 1 (1)"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 WORLD_SIZE=2: a rank runs from 0"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0: a job has at least one process"),
    ({"RANK": "0", "WORLD_SIZE": "-2"}, "WORLD_SIZE=-2: a job has at least one process"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "SLURM_NTASKS=0: a job has at least one"),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "2"},
     "OMPI_COMM_WORLD_RANK=3 OMPI_COMM_WORLD_SIZE=2: a rank runs from 0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "local rank -1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT 70000 is not a port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, "MASTER_PORT 0 is not a port"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not: a launcher sets both"),
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
])
def test_launcher_values_no_launcher_could_give_are_one_error(env, said):
    with pytest.raises(ConfigError) as error:
        discover_launch_environment(env)
    assert said in str(error.value)


def test_one_process_ignores_a_master_address_left_in_the_environment():
    """No rendezvous for one process (it waited for 'the others' at an unreachable host)."""
    for env in ({"MASTER_ADDR": "node0", "MASTER_PORT": "1234"}, {"RANK": "0"},
                {"WORLD_SIZE": "1"}):
        launch = discover_launch_environment(env)
        assert (launch.world_size, launch.master_addr) == (1, None)


def test_flags_are_checked_against_the_world_size_the_launcher_reports(monkeypatch):
    from megatron.config import resolve_config
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    parallel = resolve_config(FLAGS_FOR_SETUP_ONLY).parallel
    assert parallel.world_size == 2 and parallel.data_parallel_size == 2


def test_more_local_ranks_than_gpus_is_an_error_not_a_shared_gpu(monkeypatch):
    """4 processes on a node whose torch sees 2 GPUs: local ranks 2 and 3 took GPUs 0 and 1
    again (NCCL then refuses two ranks on one GPU, at the first collective)."""
    import torch

    from megatron.runtime import device as device_mod
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert device_mod.resolve_device("auto", 1) == torch.device("cuda", 1) and chosen == [1]
    with pytest.raises(LaunchError, match=r"local rank 2, but torch sees 2 GPUs on this node: "
                                          r"start at most 2 processes per node"):
        device_mod.resolve_device("auto", 2)
    # one GPU per task (srun --gpus-per-task=1): each rank's own, whatever its local rank
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_mod.resolve_device("auto", 5) == torch.device("cuda", 0)


def test_a_local_rank_flag_against_the_launchers_is_an_error_rank_1_prints(monkeypatch,
                                                                          capsys):
    """--local_rank=0 given to every rank by hand under torchrun: rank 1 (LOCAL_RANK=1) would
    have taken GPU 0 too. Only rank 1 meets it, so rank 1 prints it (rank 0 would not)."""
    import pretrain_gpt2
    for name, value in dict(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2,
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()).items():
        monkeypatch.setenv(name, str(value))
    argv = trainer_argv({"prefix": "unused", "vocab": "unused", "merges": "unused"}, "unused",
                        2, "--batch-size", 2, "--local_rank=0")
    assert pretrain_gpt2.main(argv) == 2
    assert capsys.readouterr().err == (
        "error: --local_rank 0 differs from the local rank 1 the torchrun launcher gave this "
        "process (LOCAL_RANK): drop --local_rank, the launcher sets it\n")
