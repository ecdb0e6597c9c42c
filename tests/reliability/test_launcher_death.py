"""A torchrun worker ends itself within seconds when its launcher is killed."""

import os
import signal
import subprocess
import sys
import time

from tests.parallel.launching import REPO

# A stand-in launcher: starts one "worker" that watches it (as the trainer does under
# torchrun) and then waits; the worker sleeps far longer than the test.
LAUNCHER = """
import os, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", '''
import time
from megatron.runtime.launcher_watch import watch_launcher
watch_launcher(local_rank=0, poll_seconds=0.1)
print("watching", flush=True)
time.sleep(120)
'''], env={**os.environ, "TORCHELASTIC_RUN_ID": "test"}, stdout=sys.stdout,
    stderr=open(sys.argv[1], "w"))
print(worker.pid, flush=True)
worker.wait()
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_worker_exits_when_the_launcher_is_killed(tmp_path):
    stderr = tmp_path / "worker.err"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(stderr)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    worker = int(launcher.stdout.readline())
    assert launcher.stdout.readline().strip() == "watching"
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its launcher"
        assert "error: the torchrun launcher (pid" in stderr.read_text()
        assert "is gone; stopping its workers" in stderr.read_text()
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_without_torchrun_nothing_is_watched(monkeypatch):
    from megatron.runtime.launcher_watch import watch_launcher
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert watch_launcher(local_rank=0) is None
