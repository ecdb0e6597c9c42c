"""Launching: the trainer started by each launcher, collective timeouts, a rank killed mid-run,
and the launch scripts run as they are (one node, two nodes, a rendezvous). Rank discovery:
test_launch_variables.py."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.dist_utils import as_started_now, fork_server, free_port
from tests.parallel.launching import (FLAGS_FOR_SETUP_ONLY, REPO, build_corpus,
                                      clean_environment, kill_session, launch_ranks,
                                      read_metrics, relative_difference, start_torchrun,
                                      trainer_argv)

# ---------------------------------------------------------------- launchers' processes

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("data"))


def _slurm_task(rank, port):
    # No WORLD_SIZE: the flags are checked against the world size SLURM reports.
    return dict(SLURM_PROCID=rank, SLURM_NTASKS=2, SLURM_LOCALID=rank, SLURM_JOB_ID=1,
                SLURM_JOB_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE=2,
                MASTER_PORT=port)


def _openmpi_rank(rank, port):
    return dict(OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_SIZE=2,
                OMPI_COMM_WORLD_LOCAL_RANK=rank, OMPI_COMM_WORLD_LOCAL_SIZE=2,
                MASTER_PORT=port)


@pytest.mark.parametrize("rank_env", [_slurm_task, _openmpi_rank], ids=["slurm", "openmpi"])
def test_trainer_starts_from_launcher_variables(corpus, tmp_path, rank_env):
    """Two processes with only SLURM (or OpenMPI) ranks: a TP=2 run writes both shards."""
    argv = trainer_argv(corpus, tmp_path / "log", 2, "--batch-size", 2,
                        "--model-parallel-size", 2, "--save", tmp_path / "ckpt")
    for rank, (code, output) in enumerate(launch_ranks(argv, 2, tmp_path, rank_env)):
        assert code == 0, f"rank {rank}:\n{output[-3000:]}"
    assert sorted(read_metrics(tmp_path / "log")) == [1, 2]
    for rank in range(2):
        assert (tmp_path / "ckpt" / "iter_0000002" / f"mp_rank_0{rank}" /
                "model_optim_rng.pt").is_file()


# ------------------------------------------------------------------- timeouts and dead ranks

def _collective_with_a_silent_peer(rank, port, subgroup, results, environ):
    """Rank 0 all-reduces while rank 1 never joins: gloo must give up after the timeout."""
    as_started_now(environ)
    import torch
    import torch.distributed as dist
    from megatron import mpu
    from megatron.config import resolve_config
    from megatron.runtime.initialize import destroy, initialize_megatron
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    config = resolve_config(FLAGS_FOR_SETUP_ONLY + ["--threads", "1",
                                                    "--distributed-timeout-minutes", "0.05"],
                            world_size=2)
    initialize_megatron(config.parallel)
    if rank == 1:
        time.sleep(7)  # alive, connected, silent; exiting would close the sockets instead
        return
    group = mpu.get_data_parallel_group() if subgroup else None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        results.put(("returned", time.monotonic() - start))
    except RuntimeError as error:
        results.put((str(error), time.monotonic() - start))
    finally:
        destroy()


def _run_silent_peer(subgroup):
    context = fork_server()
    results, port = context.Queue(), free_port()
    procs = [context.Process(target=_collective_with_a_silent_peer,
                             args=(rank, port, subgroup, results, clean_environment()))
             for rank in range(2)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=60)
    finally:
        procs[0].join(timeout=15)
        for p in procs:  # the silent peer has served its purpose once rank 0 has reported
            p.kill()
            p.join()


def test_timeout_flag_bounds_a_collective():
    message, seconds = _run_silent_peer(subgroup=False)
    assert "Timed out" in message, message
    assert 2.5 < seconds < 6, seconds  # --distributed-timeout-minutes 0.05 = 3 s


def test_timeout_flag_bounds_a_data_parallel_collective():
    message, seconds = _run_silent_peer(subgroup=True)
    assert "Timed out" in message and seconds < 6, (message, seconds)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_never_starts_is_a_clear_start_up_error(monkeypatch, capsys, rank):
    """The other rank never started: each says so, rank 1 too (its error depends on the rank,
    so it is printed there, not left to a rank 0 that may never have started)."""
    import pretrain_gpt2
    import torch.distributed as dist
    port = free_port()
    for name, value in dict(RANK=rank, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=port).items():
        monkeypatch.setenv(name, str(value))
    argv = trainer_argv({"prefix": "unused", "vocab": "unused", "merges": "unused"}, "unused",
                        2, "--batch-size", 2, "--distributed-timeout-minutes", 0.05)
    started = time.monotonic()
    assert pretrain_gpt2.main(argv) == 2
    assert time.monotonic() - started < 30
    assert not dist.is_initialized()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: rank {rank} of 2 could not meet the others at 127.0.0.1:"
                          f"{port} within --distributed-timeout-minutes 0.05: "), err
    assert f"The torchrun launcher's RANK={rank} WORLD_SIZE=2 said 2 processes: check that " \
           "all were started" in err
    if rank == 0:
        assert "1/2 clients joined" in err


def _worker_pids(launcher_pid):
    """{local rank: pid} of the processes torchrun started."""
    children = []
    for task in os.listdir(f"/proc/{launcher_pid}/task"):
        children += Path(f"/proc/{launcher_pid}/task/{task}/children").read_text().split()
    workers = {}
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        local_rank = [v for v in environ if v.startswith(b"LOCAL_RANK=")]
        if local_rank:
            workers[int(local_rank[0].split(b"=")[1])] = pid
    return workers


def _wait_for_iteration(log_dir, proc, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it was killed"
        if (log_dir / "metrics.jsonl").exists() and read_metrics(log_dir):
            return
        time.sleep(0.1)
    raise AssertionError(f"no iteration logged within {timeout}s")


def test_a_killed_rank_ends_the_job_promptly_under_torchrun(corpus, tmp_path):
    """kill -9 rank 1 after iteration 1: torchrun stops rank 0 and exits non-zero, naming
    the killed rank, well within the collective timeout (not after it, and never hangs)."""
    timeout_s = 6
    argv = trainer_argv(corpus, tmp_path / "log", 100000, "--batch-size", 2,
                        "--distributed-timeout-minutes", timeout_s / 60)
    proc = start_torchrun(argv, 2, tmp_path / "torchrun.out")
    try:
        _wait_for_iteration(tmp_path / "log", proc)
        workers = _worker_pids(proc.pid)
        assert sorted(workers) == [0, 1]
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=60)
        seconds = time.monotonic() - killed_at
    finally:
        kill_session(proc)
    output = (tmp_path / "torchrun.out").read_text()
    assert proc.returncode != 0
    assert seconds < timeout_s, seconds
    assert f"Signal 9 (SIGKILL) received by PID {workers[1]}" in output, output[-3000:]
    assert "rank      : 1 (local_rank: 1)" in output
    assert not Path(f"/proc/{workers[0]}").exists()


# ----------------------------------------------------------------------- the launch scripts

def _script_env(corpus, out_dir, **overrides):
    """Tiny sizes for the launch scripts; the corpus is already in DATA_DIR's layout."""
    variables = dict(
        DATA_DIR=corpus["data_dir"], NLAYERS=2, NHIDDEN=32, NHEADS=4, SEQ_LEN=32,
        TRAIN_ITERS=3, WARMUP_ITERS=1, PRECISION="fp32", LOG_INTERVAL=1, EVAL_INTERVAL=100,
        EVAL_ITERS=1, CHECKPOINT_DIR=out_dir / "ckpt", RUN_DIR=out_dir / "run",
        MASTER_PORT=free_port())
    return clean_environment(**{**variables, **overrides})


def _start_script(name, env, out_path, *args):
    with open(out_path, "w") as out:
        return subprocess.Popen(["bash", f"scripts/{name}", *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _run_scripts(*runs, timeout=150):
    """Start (script, env, out_path) runs together (nodes of one job); wait for all."""
    procs = [_start_script(*run) for run in runs]
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            kill_session(proc)
    return [(p.returncode, Path(run[2]).read_text()) for p, run in zip(procs, runs)]


def _assert_ran(results):
    for code, output in results:
        assert code == 0, output[-3000:]


@pytest.fixture(scope="module")
def single_process_script(corpus, tmp_path_factory):
    """scripts/pretrain_gpt2.sh with a global batch of 4."""
    out = tmp_path_factory.mktemp("single")
    _assert_ran(_run_scripts(("pretrain_gpt2.sh", _script_env(corpus, out, MICRO_BATCH=4),
                              out / "out.txt")))
    return read_metrics(out / "run")


def _assert_same_losses(reference, metrics):
    assert sorted(metrics) == sorted(reference) == [1, 2, 3]
    for it in reference:
        assert relative_difference(metrics[it][0], reference[it][0]) < 1e-4, it


def test_distributed_script_as_is(corpus, single_process_script, tmp_path):
    """No GPU here: 2 CPU processes (DP 2, micro batch 2) == one process with batch 4."""
    env = _script_env(corpus, tmp_path, MICRO_BATCH=2)
    (code, output), = _run_scripts(("pretrain_gpt2_distributed.sh", env, tmp_path / "o.txt"))
    assert code == 0, output[-3000:]
    assert "1 node(s) x 2 processes: tensor-parallel 1, pipeline stages 1, data-parallel 2, global batch 4" in output
    _assert_same_losses(single_process_script, read_metrics(tmp_path / "run"))


def test_model_parallel_script_as_is(corpus, single_process_script, tmp_path):
    env = _script_env(corpus, tmp_path, MICRO_BATCH=4, GPUS_PER_NODE=2)
    (code, output), = _run_scripts(("pretrain_gpt2_model_parallel.sh", env, tmp_path / "o.txt"))
    assert code == 0, output[-3000:]
    assert "tensor-parallel 2, pipeline stages 1, data-parallel 1, global batch 4" in output
    _assert_same_losses(single_process_script, read_metrics(tmp_path / "run"))
    shards = sorted(p.name for p in (tmp_path / "ckpt" / "iter_0000003").iterdir())
    assert shards == ["mp_rank_00", "mp_rank_01"]


def test_same_script_on_two_nodes(corpus, single_process_script, tmp_path):
    """Two 'nodes' on this machine: NODE_RANK 0 and 1, one process each, one job."""
    env = _script_env(corpus, tmp_path, MICRO_BATCH=2, GPUS_PER_NODE=1, NNODES=2)
    nodes = [("pretrain_gpt2_distributed.sh", {**env, "NODE_RANK": str(rank)},
              tmp_path / f"node{rank}.txt") for rank in range(2)]
    _assert_ran(_run_scripts(*nodes))
    _assert_same_losses(single_process_script, read_metrics(tmp_path / "run"))


@pytest.mark.slow
def test_same_script_on_two_nodes_with_a_rendezvous(corpus, single_process_script, tmp_path):
    env = _script_env(corpus, tmp_path, MICRO_BATCH=2, GPUS_PER_NODE=1, NNODES=2,
                      RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", RDZV_ID="test")
    nodes = [("pretrain_gpt2_distributed.sh", env, tmp_path / f"node{i}.txt") for i in range(2)]
    _assert_ran(_run_scripts(*nodes))
    _assert_same_losses(single_process_script, read_metrics(tmp_path / "run"))


@pytest.mark.slow
def test_a_rank_killed_on_one_node_ends_the_job_on_the_other(corpus, tmp_path):
    env = _script_env(corpus, tmp_path, MICRO_BATCH=2, GPUS_PER_NODE=1, NNODES=2,
                      TRAIN_ITERS=100000, LOG_INTERVAL=1)
    nodes = [_start_script("pretrain_gpt2_distributed.sh", {**env, "NODE_RANK": str(rank)},
                           tmp_path / f"node{rank}.txt") for rank in range(2)]
    try:
        _wait_for_iteration(tmp_path / "run", nodes[0])
        worker = _worker_pids(nodes[1].pid)[0]  # the script exec's torchrun: same pid
        os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()
        for node in nodes:
            node.wait(timeout=60)
        seconds = time.monotonic() - killed_at
    finally:
        for node in nodes:
            kill_session(node)
    assert nodes[0].returncode != 0 and nodes[1].returncode != 0
    assert seconds < 10, seconds


def test_script_rejects_a_tensor_parallel_size_that_does_not_divide(corpus, tmp_path):
    env = _script_env(corpus, tmp_path, MP_SIZE=3, GPUS_PER_NODE=2)
    (code, output), = _run_scripts(("pretrain_gpt2_model_parallel.sh", env, tmp_path / "o.txt"))
    assert code == 2
    assert output.strip().splitlines()[-1] == \
        "MP_SIZE=3 x PP_SIZE=1 does not divide the 2 processes (NNODES=1 x GPUS_PER_NODE=2)"


@pytest.mark.parametrize("config_form", ["separate", "with ="])
def test_script_rejects_fp32_against_a_deepspeed_config_in_bf16(corpus, tmp_path, config_form):
    """fp32 has no flag of its own, so the script names both values instead of letting the
    JSON's bf16 decide silently."""
    env = _script_env(corpus, tmp_path, PRECISION="fp32")
    config = "scripts/ds_zero_stage_2.config"
    args = ["--deepspeed", "--deepspeed_config", config] if config_form == "separate" \
        else ["--deepspeed", f"--deepspeed_config={config}"]
    (code, output), = _run_scripts(("pretrain_gpt2.sh", env, tmp_path / "o.txt", *args))
    assert code == 2, output[-3000:]
    assert output.strip().splitlines()[-1] == (
        f'PRECISION=fp32, but {config} enables bf16 ("bf16": {{"enabled": true}}); '
        "set PRECISION=bf16 or give a config without it")


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_node_that_never_arrives_ends_the_launch_after_the_timeout(corpus, tmp_path,
                                                                     rendezvous):
    """The launcher's rendezvous waits --distributed-timeout-minutes, not torchrun's 10 min."""
    extra = {"RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "RDZV_ID": "lonely"} \
        if rendezvous == "c10d" else {}
    env = _script_env(corpus, tmp_path, GPUS_PER_NODE=1, NNODES=2, **extra)
    start = time.monotonic()
    proc = _start_script("pretrain_gpt2_distributed.sh", env, tmp_path / "o.txt",
                         "--distributed-timeout-minutes", "0.1")
    try:
        proc.wait(timeout=120)
    finally:
        kill_session(proc)
    seconds = time.monotonic() - start
    output = (tmp_path / "o.txt").read_text()
    assert proc.returncode != 0, output[-3000:]
    assert "waiting up to 0.1 min for the 2 nodes to meet" in output
    assert seconds < 60, seconds


def test_script_rejects_a_timeout_that_is_not_a_number(corpus, tmp_path):
    """Named as it was given: the variable (checked first) or the flag."""
    env = _script_env(corpus, tmp_path, DISTRIBUTED_TIMEOUT_MINUTES="soon")
    (code, output), = _run_scripts(("pretrain_gpt2_distributed.sh", env, tmp_path / "o.txt"))
    assert code == 2
    assert output.strip().splitlines()[-1] == "DISTRIBUTED_TIMEOUT_MINUTES must be a " \
        "non-negative number such as 3, 0.5 or 1e-3 (got 'soon')"
    env = _script_env(corpus, tmp_path, DISTRIBUTED_TIMEOUT_MINUTES="0")
    (code, output), = _run_scripts(("pretrain_gpt2_distributed.sh", env, tmp_path / "o.txt",
                                    "--distributed-timeout-minutes", "0.001"))
    assert code == 2
    assert output.strip().splitlines()[-1].startswith(
        "--distributed-timeout-minutes must be a number of minutes, at least 1 second's worth "
        "(got '0.001')")
