"""Start `world_size` gloo processes on the CPU and collect what each returns.

Usage from a test:

    def _body(rank, world_size, x):        # module-level, so it pickles
        ...                                 # torch.distributed is initialised here
        return something_picklable

    results = run_distributed(_body, world_size=2, args=(x,))   # list indexed by rank

`start_process(target, args, env=..., cwd=..., output=...)` runs any module-level function
in a process of its own forked from the same server (the trainer's launchers use it).
"""

import io
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing import forkserver
from pathlib import Path
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_started_now(environ):
    """In a process forked from the fork server: take `environ` (the caller's environment at
    the call, not the server's at its start) before anything imports a test module, and
    leave multiprocessing's start method to its default, as in a freshly started Python
    (multiprocessing set it to forkserver for this process and what it forks)."""
    os.environ.clear()
    os.environ.update(environ)
    mp.set_start_method(None, force=True)


def _worker(rank, world_size, init_file, call, queue, environ):
    as_started_now(environ)
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(call)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
        result = fn(rank, world_size, *args)
        # Serialise: tensors sent through the queue as shared-memory handles die with the
        # worker before the parent reads them.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including assertion failures, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron import mpu
            mpu.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


# torch._dynamo: every torch optimizer imports it at its first step (~2 s on a slow CPU);
# the trainer's modules: what launch_ranks' and the reliability harness's launchers run.
PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "pretrain_gpt2", "megatron.gpt2",
             "megatron.training.pretrain"]


def fork_server():
    """Processes are forked from one server process that imported torch and the trainer once
    per test session: ~5 s of imports per process on a slow 2-core CPU become ~0.1 s. The
    server never runs a torch op, so it has no threads to lose in a fork. Unlike a launched
    process, a forked one shares the server's hash seed and what torch read from the
    environment at its import (ranks set their thread count explicitly), and leaves by
    os._exit (no atexit handlers: release what a test made, e.g. engine.destroy())."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    # The server imports from its working directory (this Python passes it no sys.path):
    # started in the repository, it preloads this checkout's trainer wherever pytest runs.
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        forkserver.ensure_running()
    finally:
        os.chdir(cwd)
    return ctx


class ForkedProcess:
    """What start_process returns: the part of subprocess.Popen that tests use."""

    def __init__(self, process):
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
        return self._process.exitcode


def start_process(target, args=(), *, env, cwd, output):
    """Start target(*args) in a process forked from the fork server, in a session of its own
    (so killing its process group ends whatever it forks), with `env` as its whole
    environment, in `cwd`, its stdout and stderr written unbuffered to the file `output`."""
    call = pickle.dumps((target, args))
    ctx = fork_server()
    ready, tell_ready = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_session,
                          args=(call, dict(env), str(cwd), str(output), tell_ready))
    process.start()
    tell_ready.close()
    # its own session before it is handed out: killing its process group then always reaches it
    if not ready.poll(60):
        process.kill()
        raise AssertionError("a forked process did not start within 60 s")
    ready.recv()
    ready.close()
    return ForkedProcess(process)


def _session(call, env, cwd, output, tell_ready):
    os.setsid()
    tell_ready.send(True)
    tell_ready.close()
    os.chdir(cwd)
    as_started_now(env)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if fd > 2:
        os.close(fd)
    # as PYTHONUNBUFFERED: what a killed process printed is in the file
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    target, args = pickle.loads(call)
    target(*args)


def run_distributed(fn, world_size, args=(), timeout=240):
    """Run fn(rank, world_size, *args) in `world_size` processes; return results by rank.
    `timeout` bounds the whole run; a rank that fails, or dies without a result, ends it."""
    ctx = fork_server()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        call = pickle.dumps((fn, args))
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, call, queue,
                                                   dict(os.environ)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors, reported = {}, [], set()
        deadline = time.monotonic() + timeout
        while len(results) < world_size and not errors:
            try:
                rank, ok, payload = queue.get(timeout=1)
            except Empty:
                # a rank that died before reporting (it could not unpickle `fn`, a signal)
                # would otherwise keep the others waiting until the timeout
                died = {r: p.exitcode for r, p in enumerate(procs)
                        if p.exitcode and r not in results}
                if died:
                    errors.append(f"rank(s) exited without a result, exit codes {died} (any "
                                  "output of theirs is above)")
                elif time.monotonic() > deadline:
                    exited = [r for r, p in enumerate(procs) if not p.is_alive()]
                    errors.append(f"timed out after {timeout}s waiting for ranks; exited: "
                                  f"{exited}")
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                reported.add(rank)
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.terminate()
        silent = {r: p.exitcode for r, p in enumerate(procs)
                  if p.exitcode and p.exitcode > 0 and r not in results and r not in reported}
        if silent and not any(e.startswith("rank(s) exited without a result") for e in errors):
            # the cause, when another rank's error (a broken rendezvous) was read first
            errors.insert(0, f"rank(s) exited without a result, exit codes {silent} (any "
                             "output of theirs is above)")
        if errors:
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode}
            raise AssertionError("\n".join(errors) + f"\nexit codes of ranks that died: {dead}")
        return [results[r] for r in range(world_size)]
