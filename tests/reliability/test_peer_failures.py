"""Ranks that die, hang or get signalled: the others stop clearly (or save and exit 0 together),
torchrun --max-restarts resumes from the last checkpoint by itself, and a two-node launch on this
machine trains and resumes."""

import subprocess
import time

import pytest

from tests.dist_utils import free_port
from tests.parallel.launching import (PYTHON, REPO, clean_environment, kill_session,
                                      launch_ranks, read_metrics, relative_difference,
                                      start_launcher, torchrun_variables, trainer_argv)
from tests.reliability.harness import run_sequence, step

RANK_FAULT = "MEGATRON_FAULT_RANK"


def _with_fault(world_size, spec):
    base = torchrun_variables(world_size)
    return lambda rank, port: {**base(rank, port), RANK_FAULT: spec}


def _reference(corpus, root, iters):
    """One process, micro batch 4 == two data-parallel ranks with micro batch 2 (contract 1)."""
    codes = run_sequence([step(trainer_argv(corpus, root / "ref", iters, "--batch-size", 4),
                               root / "ref.out")])
    assert codes == [0], (root / "ref.out").read_text()[-3000:]
    return read_metrics(root / "ref")


def _assert_same_losses(reference, metrics, iterations):
    assert sorted(metrics) == iterations
    for it in iterations:
        assert relative_difference(metrics[it][0], reference[it][0]) < 1e-4, it


def test_sigterm_on_one_rank_stops_both_at_the_same_iteration(corpus, tmp_path):
    """The scheduler's SIGTERM reached rank 1 only: the all-reduced flag stops both ranks
    after the same iteration, both save their part and exit 0."""
    save = tmp_path / "ckpt"
    argv = trainer_argv(corpus, tmp_path / "log", 100, "--batch-size", 2, "--save", save,
                        "--exit-signal-handler")
    results = launch_ranks(argv, 2, tmp_path, _with_fault(2, "1:3:term"))
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank}:\n{output[-3000:]}"
    assert "exiting at iteration 3: SIGTERM received" in results[0][1]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert sorted(read_metrics(tmp_path / "log")) == [1, 2, 3]


def test_a_nan_streak_on_pipeline_stages_is_said_once(corpus, tmp_path):
    """Every stage sees the last stage's loss, so both stop at the same iteration; the error
    is printed by rank 0 alone (not once per rank)."""
    argv = trainer_argv(corpus, tmp_path / "log", 6, "--batch-size", 2,
                        "--pipeline-model-parallel-size", 2,
                        "--max-nan-iterations", 2)
    env = torchrun_variables(2)
    results = launch_ranks(argv, 2, tmp_path,
                           lambda rank, port: {**env(rank, port), "MEGATRON_FAULT_NAN_AT": "2,3"})
    said = "error: the loss was NaN or inf for 2 consecutive iterations (2-3;"
    assert [code for code, _ in results] == [2, 2], results[0][1][-3000:]
    assert results[0][1].count(said) == 1, results[0][1][-3000:]
    assert "error" not in results[1][1], results[1][1][-3000:]


def test_a_hanging_rank_stops_the_others_with_a_clear_message(corpus, tmp_path):
    """Rank 1 hangs at iteration 2: rank 0's next collective gives up after
    --distributed-timeout-minutes (0.05 = 3 s) with one line saying what happened and what
    to resume from."""
    save = tmp_path / "ckpt"
    argv = trainer_argv(corpus, tmp_path / "log", 100, "--batch-size", 2, "--save", save,
                        "--save-interval", 1, "--distributed-timeout-minutes", 0.05)
    launcher = start_launcher(argv, 2, tmp_path, _with_fault(2, "1:2:hang"))
    rank0 = tmp_path / "rank0.out"
    try:
        deadline, hung_at = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            text = rank0.read_text() if rank0.exists() else ""
            if hung_at is None and (tmp_path / "rank1.out").exists() and \
                    "hangs at iteration 2" in (tmp_path / "rank1.out").read_text():
                hung_at = time.monotonic()
            if "error:" in text:
                stopped_at = time.monotonic()
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"rank 0 did not stop:\n{rank0.read_text()[-3000:]}")
    finally:
        kill_session(launcher)
    error = text.strip().splitlines()[-1]
    assert error.startswith("error: rank 0: a collective failed during iteration 2: "), error
    assert "Another rank most likely died or hangs" in error
    assert "--distributed-timeout-minutes 0.05" in error
    assert f"esume from iteration 1 with --load {save}" in error
    assert "Traceback" not in text
    assert hung_at is not None and stopped_at - hung_at < 15  # 3 s timeout + slack on 2 cores


def _torchrun(args, argv, out_path, env=None):
    command = [PYTHON, "-m", "torch.distributed.run", *map(str, args), "pretrain_gpt2.py",
               *map(str, argv)]
    with open(out_path, "w") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=clean_environment(**(env or {})), start_new_session=True)


def _wait(procs, timeout=240):
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            kill_session(proc)
    return [proc.returncode for proc in procs]


@pytest.mark.slow  # ~30 s idle (two torchrun starts); the fast version is in
# test_exit_and_numerics.py::test_a_restarted_job_resumes_from_its_own_save_dir
def test_torchrun_max_restarts_resumes_from_the_last_checkpoint(corpus, tmp_path):
    """Rank 1 is killed at the start of iteration 4 (after the checkpoint of iteration 2):
    rank 0 stops, torchrun restarts both, and with --load = --save they resume at 2 and finish
    with the losses of a run that never failed."""
    save = tmp_path / "ckpt"
    argv = trainer_argv(corpus, tmp_path / "log", 5, "--batch-size", 2, "--save", save,
                        "--load", save, "--save-interval", 2,
                        "--distributed-timeout-minutes", 0.5)
    proc = _torchrun(["--standalone", "--nproc_per_node", 2, "--max-restarts", 1], argv,
                     tmp_path / "torchrun.out", {RANK_FAULT: "1:4:kill"})
    code, = _wait([proc])
    output = (tmp_path / "torchrun.out").read_text()
    assert code == 0, output[-4000:]
    assert "rank 1 kills at iteration 4" in output
    assert "loaded checkpoint from" in output and "at iteration 2" in output
    # metrics.jsonl holds the first attempt's 1-3 and the second's 3-5: the last record wins.
    reference = _reference(corpus, tmp_path, 5)
    _assert_same_losses(reference, read_metrics(tmp_path / "log"), [1, 2, 3, 4, 5])


@pytest.mark.slow  # ~30 s idle; tests/parallel/test_launch.py::test_same_script_on_two_nodes
# is the default-run two-node launch
def test_two_nodes_on_this_machine_train_and_resume(corpus, tmp_path):
    """Two torchrun invocations, --nnodes 2, --node_rank 0/1, one process each, master
    127.0.0.1: 2 iterations and a checkpoint, then the same two commands resume to 4."""
    save = tmp_path / "ckpt"

    def both_nodes(phase, *extra):
        port = free_port()
        argv = trainer_argv(corpus, tmp_path / "log", 4, "--batch-size", 2, "--save", save,
                            *extra)
        procs = [_torchrun(["--nnodes", 2, "--node_rank", node, "--nproc_per_node", 1,
                            "--master_addr", "127.0.0.1", "--master_port", port], argv,
                           tmp_path / f"{phase}{node}.out") for node in range(2)]
        codes = _wait(procs)
        for node, code in enumerate(codes):
            assert code == 0, (tmp_path / f"{phase}{node}.out").read_text()[-3000:]

    both_nodes("first", "--exit-interval", 2)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    both_nodes("resume", "--load", save)
    assert "loaded checkpoint from" in (tmp_path / "resume0.out").read_text()
    reference = _reference(corpus, tmp_path, 4)
    _assert_same_losses(reference, read_metrics(tmp_path / "log"), [1, 2, 3, 4])


@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms",
    "Application timeout caused pair closure",
    "Connection closed by peer [127.0.0.1]:5000",
])
def test_the_messages_of_a_dead_or_hanging_peer_become_one_error(message):
    """gloo's wordings of a peer that died or hangs (the second appears when the pair is torn
    down before the wait times out) all become the one TrainingError line."""
    from megatron.errors import TrainingError
    from megatron.runtime.fault_tolerance import explain_collective_failures
    with pytest.raises(TrainingError, match="a collective failed during iteration 3"):
        with explain_collective_failures(0.05, {"iteration": 2}, 0, lambda: "restart"):
            raise RuntimeError(message)
