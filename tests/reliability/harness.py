"""Run many short trainer processes cheaply, some of them killed on purpose, and read back
what they left.

`run_sequence(steps)` starts ONE fresh interpreter that imports torch and the trainer once and
then forks one child per step, in order: each child runs `pretrain_gpt2.main(argv)` with the
step's environment (e.g. MEGATRON_FAULT_KILL_AT) and is a real process, so a kill point's
SIGKILL is a real kill -9.  Forking from an interpreter that has imported but never computed
keeps each run at well under a second for the tiny model (a fresh `python` pays ~5 s of
imports).  Returns each step's exit code (-9 for SIGKILL).
"""

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

from tests.parallel.launching import PYTHON, REPO, clean_environment, kill_session

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
    job_path = Path(steps[0]["out"]).parent / f"job-{os.getpid()}-{id(steps)}.json"
    job_path.write_text(json.dumps(steps))
    proc = subprocess.Popen([PYTHON, "-m", "tests.reliability.harness", str(job_path)],
                            cwd=REPO, env=clean_environment(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        kill_session(proc)
    assert proc.returncode == 0, output[-3000:]
    return json.loads(output.strip().splitlines()[-1])


def _run_steps(job_path):
    import torch._dynamo  # noqa: F401  (torch.optim imports it on first use: ~3 s)
    import megatron.gpt2  # noqa: F401
    import megatron.training.pretrain  # noqa: F401
    import pretrain_gpt2
    from megatron.runtime import device
    # MFU's denominator is measured with 2048^3 matmuls (~1 s per process); these runs only
    # need some number, and the children inherit this one.
    device.measure_matmul_flops = lambda *args, **kwargs: 1e11
    codes = []
    for item in json.loads(Path(job_path).read_text()):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(pretrain_gpt2.main, item)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(json.dumps(codes), flush=True)


def _child(main, item):
    code = 1
    try:
        os.makedirs(os.path.dirname(item["out"]), exist_ok=True)
        fd = os.open(item["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(item["env"])
        code = main(item["argv"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


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


if __name__ == "__main__":
    _run_steps(sys.argv[1])
