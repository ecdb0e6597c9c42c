"""The one helper that reaches real DeepSpeed: a separate virtualenv, used through subprocesses.

DeepSpeed must never be importable from the project's own venv (zero/ replaces it, and the
comparison has to be against the real thing), so it lives in its own venv, made by
`benchmarks/install_deepspeed_venv.sh` (default /work/dsvenv, or $DEEPSPEED_VENV). Code that
runs inside it is `benchmarks/deepspeed_tasks.py` (torch + deepspeed only). Everything here is
stdlib, so tests and benchmarks can import it anywhere and skip cleanly when the venv is absent.
"""

import os
import subprocess
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
TASKS = os.path.join(BENCH_DIR, "deepspeed_tasks.py")
DEFAULT_VENV = "/work/dsvenv"


def deepspeed_python():
    """The venv's interpreter if it exists and imports deepspeed, else None."""
    venv = os.environ.get("DEEPSPEED_VENV", DEFAULT_VENV)
    python = os.path.join(venv, "bin", "python")
    return python if os.path.isfile(python) and os.access(python, os.X_OK) else None


def deepspeed_env(extra=None):
    """Environment for DeepSpeed on this machine: CPU accelerator, no CUDA probing, 1 thread,
    and no trace of the project's venv or PYTHONPATH (the two must not mix)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def deepspeed_version():
    python = deepspeed_python()
    if python is None:
        return None
    run = subprocess.run([python, TASKS, "version"], capture_output=True, text=True,
                         env=deepspeed_env(), timeout=300)
    return run.stdout.strip().splitlines()[-1] if run.returncode == 0 and run.stdout else None


def run_task(*args, timeout=600):
    """Run `deepspeed_tasks.py <args>` in the DeepSpeed venv (one process); raise with its
    output if it fails."""
    python = deepspeed_python()
    if python is None:
        raise RuntimeError("no DeepSpeed venv: run benchmarks/install_deepspeed_venv.sh")
    run = subprocess.run([python, TASKS, *map(str, args)], capture_output=True, text=True,
                         env=deepspeed_env(), timeout=timeout, cwd=BENCH_DIR)
    if run.returncode != 0:
        raise RuntimeError(f"deepspeed_tasks.py {' '.join(map(str, args))} failed "
                           f"({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}")
    return run.stdout


def launch_ranks(world_size, argv, env_extra=None, python=None, port=None, timeout=900):
    """Start `world_size` processes of `python argv...` with torchrun's rendezvous variables;
    wait for all; raise with the first failing rank's output."""
    from socket import socket
    if port is None:
        with socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    base = deepspeed_env(env_extra) if python is None else dict(os.environ, **(env_extra or {}))
    python = python or deepspeed_python()
    procs = []
    for rank in range(world_size):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([python, *map(str, argv)], env=env, cwd=BENCH_DIR,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs, failed = [], None
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            failed = failed if failed is not None else (rank, f"timed out after {timeout}s")
        outputs.append(out)
        if proc.returncode != 0 and failed is None:
            failed = (rank, proc.returncode)
    if failed is not None:
        rank, why = failed
        raise RuntimeError(f"rank {rank} of {' '.join(map(str, argv))} failed ({why}):\n"
                           f"{outputs[rank][-6000:]}")
    return outputs


if __name__ == "__main__":
    print(deepspeed_python(), deepspeed_version(), file=sys.stderr)
