"""Run many short trainer processes cheaply, some of them killed on purpose, and read back
what they left.

`run_sequence(steps)` starts ONE process, forked from the tests' fork server (which imported
torch and the trainer once, tests/dist_utils.py), that forks one child per step, in order:
each child runs `pretrain_gpt2.main(argv)` with the step's environment (e.g.
MEGATRON_FAULT_KILL_AT) and is a real process, so a kill point's SIGKILL is a real kill -9.
Forking from an interpreter that has imported but never computed keeps each run at well under
a second for the tiny model (a fresh `python` pays ~5 s of imports).  Returns each step's exit
code (-9 for SIGKILL).
"""

import json
import os
from pathlib import Path

from tests.dist_utils import start_process
from tests.parallel.launching import REPO, clean_environment, fork_trainer, kill_session

# Dropout stays on (Megatron's defaults): resume must restore the RNG states exactly.
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--lr", "3e-3",
        "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--warmup-iters", "2",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--num-workers", "0", "--split", "90,9,1", "--threads", "1", "--batch-size", "4"]


def trainer_argv(corpus, log_dir, iters, *extra):
    return TINY + ["--train-iters", str(iters), "--data-path", corpus["prefix"],
                   "--vocab-file", corpus["vocab"], "--merge-file", corpus["merges"],
                   "--log-dir", str(log_dir)] + [str(e) for e in extra]


def step(argv, out_path, **env):
    return {"argv": [str(a) for a in argv], "out": str(out_path),
            "env": {k: str(v) for k, v in env.items()}}


def run_sequence(steps, timeout=300):
    job = Path(steps[0]["out"]).parent / f"job-{os.getpid()}-{id(steps)}"
    codes = job.with_suffix(".codes.json")
    proc = start_process(_run_steps, (steps, str(codes)), env=clean_environment(), cwd=REPO,
                         output=job.with_suffix(".out"))
    try:
        proc.wait(timeout=timeout)
    finally:
        kill_session(proc)
    assert proc.returncode == 0, job.with_suffix(".out").read_text()[-3000:]
    return json.loads(codes.read_text())


def _run_steps(steps, codes_path):
    import pretrain_gpt2
    from megatron.runtime import device
    # MFU's denominator is measured with 2048^3 matmuls (~1 s per process); these runs only
    # need some number, and the children inherit this one.
    device.measure_matmul_flops = lambda *args, **kwargs: 1e11
    codes = []
    for item in steps:
        pid = fork_trainer(pretrain_gpt2.main, item["argv"], item["env"], item["out"])
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    Path(codes_path).write_text(json.dumps(codes))


def read_losses(log_dir):
    """{iteration: (lm_loss, grad_norm)} from metrics.jsonl (training records)."""
    path = Path(log_dir) / "metrics.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in records if "lm_loss" in r}


def read_records(log_dir):
    path = Path(log_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
