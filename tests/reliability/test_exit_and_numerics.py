"""SIGTERM and time limits save and exit 0; --keep-last-n-checkpoints; NaN losses are skipped,
counted and, after --max-nan-iterations in a row, stop training with a clear message; fp16
overflow skips the step and backs off the loss scale.

All single-process scenarios run in one forked sequence (tests/reliability/harness.py); each
test below reads the outputs of its scenarios.
"""

import json
import math
from pathlib import Path

import pytest

from tests.reliability.harness import (read_losses, read_records, run_sequence, step,
                                       trainer_argv)

NAN = "MEGATRON_FAULT_NAN_AT"
RANK_FAULT = "MEGATRON_FAULT_RANK"


def _ds(root, name, **sections):
    path = Path(root) / f"{name}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
                                **sections}))
    return ["--deepspeed", "--deepspeed_config", path]


def _scenarios(root):
    ds_fp32, ds_bf16 = _ds(root, "fp32"), _ds(root, "bf16", bf16={"enabled": True})
    shared = ["--save", root / "shared", "--save-interval", 1]
    return {
        "ref": (6, [], {}),
        "term": (6, ["--exit-signal-handler", "--save", root / "term"], {RANK_FAULT: "0:3:term"}),
        "term_resume": (6, ["--load", root / "term", "--save", root / "term2"], {}),
        "ctrl_c": (6, ["--save", root / "int", "--load", root / "int", "--num-workers", 2],
                   {RANK_FAULT: "0:3:int"}),
        "ctrl_c_resume": (6, ["--save", root / "int", "--load", root / "int"], {}),
        "duration": (6, ["--exit-duration-in-mins", 1e-6, "--save", root / "dur"], {}),
        "duration_resume": (6, ["--load", root / "dur"], {}),
        # torchrun --max-restarts: the first attempt dies at iteration 4 with nothing but
        # metrics.jsonl and the checkpoint of 2 in --save; the second (what torchrun starts,
        # TORCHELASTIC_RESTART_COUNT=1) is the same command and resumes by itself.
        "restart_first": (6, ["--save", root / "restart_first", "--load", root / "restart_first",
                              "--save-interval", 2], {RANK_FAULT: "0:4:kill"}),
        "restart_second": (6, ["--save", root / "restart_first", "--load",
                               root / "restart_first", "--save-interval", 2],
                           {RANK_FAULT: "0:4:kill", "TORCHELASTIC_RESTART_COUNT": 1}),
        "own_save_fresh": (2, ["--save", root / "fresh", "--load", root / "fresh"], {}),
        "keep": (6, ["--save", root / "keep", "--save-interval", 1,
                     "--keep-last-n-checkpoints", 2], {}),
        "keep_ds": (6, [*ds_fp32, "--save", root / "keep_ds", "--save-interval", 1,
                        "--keep-last-n-checkpoints", 2], {}),
        # two runs, one folder: retention removes only its own run's checkpoints (a resumed
        # run is the run it resumed)
        "keep_a": (2, [*shared, "--keep-last-n-checkpoints", 2], {}),
        "keep_b": (4, [*shared, "--save-interval", 4, "--keep-last-n-checkpoints", 1], {}),
        "keep_b_resumed": (6, [*shared, "--load", root / "shared",
                               "--keep-last-n-checkpoints", 1], {}),
        "nan_fp32": (5, [], {NAN: "3"}),
        "nan_stop": (8, ["--max-nan-iterations", 3, "--save", root / "nan_stop",
                         "--save-interval", 1], {NAN: "3,4,5"}),
        "nan_bf16": (5, ["--bf16"], {NAN: "2"}),
        "nan_ds_fp32": (5, ds_fp32, {NAN: "3"}),
        "nan_stop_ds_bf16": (6, [*ds_bf16, "--max-nan-iterations", 2], {NAN: "2,3"}),
        # between log lines the loop reads each loss an iteration late
        "nan_stop_unlogged": (8, ["--max-nan-iterations", 3, "--log-interval", 4],
                              {NAN: "3,4,5"}),
        # fewer NaN iterations than --max-nan-iterations, but every one of the run's
        "nan_all": (3, ["--save", root / "nan_all"], {NAN: "1,2,3"}),
        "fp16_overflow": (4, ["--fp16", "--hysteresis", 1], {}),
        "fp16_nan": (4, ["--fp16", "--hysteresis", 1, "--initial-loss-scale", 1024],
                     {NAN: "2"}),
    }


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """{scenario: (exit code, output, log dir)} after running every scenario in order."""
    root = tmp_path_factory.mktemp("exit_numerics")
    scenarios = _scenarios(root)
    (root / "fresh").mkdir()  # a job that died before its first checkpoint left only logs
    (root / "fresh" / "metrics.jsonl").write_text("")
    steps = [step(trainer_argv(corpus, root / name, iters, *extra), root / f"{name}.out", **env)
             for name, (iters, extra, env) in scenarios.items()]
    codes = run_sequence(steps)
    return {name: (code, (root / f"{name}.out").read_text(), root / name)
            for name, code in zip(scenarios, codes)}


def _ok(runs, name):
    code, output, log = runs[name]
    assert code == 0, output[-3000:]
    return output, log


def test_sigterm_saves_at_the_next_iteration_and_exits_0(runs):
    output, _ = _ok(runs, "term")
    assert "exiting at iteration 3: SIGTERM received (--exit-signal-handler), checkpoint " \
           "saved" in output
    term = Path(runs["term"][2]).parent / "term"
    assert (term / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    _ok(runs, "term_resume")
    reference = read_losses(_ok(runs, "ref")[1])
    resumed = read_losses(runs["term_resume"][2])
    assert sorted(resumed) == [4, 5, 6]
    assert read_losses(runs["term"][2]) | resumed == reference  # bit for bit


def test_ctrl_c_saves_says_how_to_resume_and_exits_130(runs):
    code, output, log = runs["ctrl_c"]
    assert code == 130, output[-3000:]
    assert "Ctrl-C: stopping at the end of this iteration" in output
    assert "exiting at iteration 3: Ctrl-C, checkpoint saved" in output
    assert f"stopped by Ctrl-C after saving to {Path(log).parent / 'int'}; to resume, run the " \
           "same command" in output
    assert "Traceback" not in output and "validation loss" not in output
    _ok(runs, "ctrl_c_resume")
    reference = read_losses(_ok(runs, "ref")[1])
    resumed = read_losses(runs["ctrl_c_resume"][2])
    assert sorted(resumed) == [4, 5, 6]
    assert read_losses(log) | resumed == reference  # bit for bit


def test_exit_duration_saves_and_exits_0(runs):
    output, _ = _ok(runs, "duration")
    assert "exiting at iteration 1: ran" in output and "--exit-duration-in-mins 1e-06" in output
    _ok(runs, "duration_resume")
    assert read_losses(runs["duration"][2]) | read_losses(runs["duration_resume"][2]) == \
        read_losses(runs["ref"][2])


@pytest.mark.parametrize("name, pattern", [("keep", "iter_*"), ("keep_ds", "global_step*")])
def test_keep_last_n_checkpoints(runs, name, pattern):
    _ok(runs, name)
    save = Path(runs[name][2]).parent / name
    kept = sorted(p.name for p in save.glob(pattern))
    assert kept == (["iter_0000005", "iter_0000006"] if name == "keep"
                    else ["global_step5", "global_step6"])
    # no debris: the run's lock file (it holds nothing once the run is over) and the marks of
    # the kept checkpoints' run
    assert sorted(p.name for p in save.iterdir() if p.name.startswith(".")) == \
        sorted([".lock"] + [f".{name}.run_id" for name in kept])


def test_retention_never_removes_another_runs_checkpoints(runs):
    for name in ("keep_a", "keep_b", "keep_b_resumed"):
        _ok(runs, name)
    save = Path(runs["keep_a"][2]).parent / "shared"
    owners = {p.name: (save / f".{p.name}.run_id").read_text() for p in save.glob("iter_*")}
    # a: 1, 2.  b (fresh, keeps 1): 4; a's older ones stay.  b resumed from 4: 5, 6, and
    # removes its own 4 and 5; a's stay.
    assert sorted(owners) == ["iter_0000001", "iter_0000002", "iter_0000006"]
    assert owners["iter_0000001"] == owners["iter_0000002"] != owners["iter_0000006"]
    assert len(owners["iter_0000006"]) == 32
    # b is told, once, that the folder holds another run's checkpoints; a is not
    note = f" note: --save {save} holds 2 checkpoint(s) of another run (iter_0000001 ... " \
           "iter_0000002)"
    assert note not in runs["keep_a"][1]
    assert runs["keep_b"][1].count(note) == 1 and note in runs["keep_b_resumed"][1]


def _skipped(log):
    return {r["iteration"]: r["skipped_iters"] for r in read_records(log) if "lm_loss" in r}


@pytest.mark.parametrize("name, at", [("nan_fp32", 3), ("nan_bf16", 2), ("nan_ds_fp32", 3)])
def test_a_nan_loss_skips_the_step_and_counts_it(runs, name, at):
    _, log = _ok(runs, name)
    losses = read_losses(log)
    loss, grad_norm = losses[at]
    assert (loss is None or math.isnan(loss)) and grad_norm is None  # JSON writes NaN as null
    assert all(math.isfinite(loss) for it, (loss, _) in losses.items() if it != at)
    skipped = _skipped(log)
    assert [skipped[it] for it in sorted(skipped)] == [0] * (at - 1) + [1] * (6 - at)


@pytest.mark.parametrize("name, first, last, limit", [("nan_stop", 3, 5, 3),
                                                      ("nan_stop_ds_bf16", 2, 3, 2),
                                                      ("nan_stop_unlogged", 3, 5, 3)])
def test_consecutive_nan_losses_stop_with_a_clear_message(runs, name, first, last, limit):
    code, output, log = runs[name]
    assert code == 2, output[-3000:]
    error = output.strip().splitlines()[-1]
    assert error.startswith(f"error: the loss was NaN or inf for {limit} consecutive iterations "
                            f"({first}-{last}; --max-nan-iterations {limit})"), error
    assert "Traceback" not in output
    logged = list(range(1, last + 1)) if name != "nan_stop_unlogged" else [4]
    assert sorted(read_losses(log)) == logged
    if name == "nan_stop":  # the newest checkpoint (skipped iterations leave weights alone)
        assert f"resume from iteration {last - 1} with --load" in error


def test_a_run_with_only_nan_losses_is_an_error(runs):
    code, output, log = runs["nan_all"]
    assert code == 2, output[-3000:]
    assert output.strip().splitlines()[-1] == (
        "error: the loss was NaN or inf in every iteration of this run (1-3); each was "
        "skipped, so nothing was trained. Check the data and the model's initialisation, or "
        f"resume from iteration 3 with --load {log} with a lower --lr, more warmup or "
        "--clip-grad")
    assert "Traceback" not in output


def test_fp16_first_batch_overflow_is_retried_at_lower_scales_not_skipped(runs):
    output, log = _ok(runs, "fp16_overflow")
    records = [r for r in read_records(log) if "lm_loss" in r]
    assert [r["skipped_iters"] for r in records] == [0] * 4  # trains from its first batch
    assert records[0]["grad_norm"] is not None
    assert records[0]["loss_scale"] < 2.0 ** 32  # backed off from --initial-loss-scale 2^32
    line = next(text for text in output.splitlines() if "overflowed on the first batch" in text)
    assert "initial loss scale 2^32" in line and "no step skipped" in line


def test_injected_fp16_nan_halves_the_scale(runs):
    _, log = _ok(runs, "fp16_nan")
    records = {r["iteration"]: r for r in read_records(log) if "lm_loss" in r}
    assert records[1]["loss_scale"] == 1024 and records[2]["loss_scale"] == 512
    assert records[2]["skipped_iters"] == 1 and records[4]["skipped_iters"] == 1


def test_a_restarted_job_resumes_from_its_own_save_dir(runs):
    code, output, log = runs["restart_first"]
    assert code == -9 and "rank 0 kills at iteration 4" in output
    output, _ = _ok(runs, "restart_second")
    assert "loaded checkpoint from" in output and "at iteration 2" in output
    resumed = read_losses(runs["restart_second"][2])
    reference = read_losses(runs["ref"][2])
    assert sorted(resumed) == [3, 4, 5, 6]
    assert all(resumed[it] == reference[it] for it in resumed)


def test_load_equal_to_save_without_a_checkpoint_starts_fresh(runs):
    output, _ = _ok(runs, "own_save_fresh")
    assert "loaded checkpoint" not in output
