"""megatron/runtime/torchrun.py, the torchrun of the launch scripts: a failure ends in one
`error:` line (no traceback, no failure table) and the worker's exit code."""

import socket
import subprocess

from tests.dist_utils import free_port
from tests.parallel.launching import PYTHON, REPO, clean_environment

WORKER = """import os, sys
if os.environ["RANK"] == "1":
    print("error: rank 1 met a bad flag", file=sys.stderr)
    sys.exit(2)
"""


def _torchrun(tmp_path, *args):
    (tmp_path / "worker.py").write_text(WORKER)
    done = subprocess.run([PYTHON, "-m", "megatron.runtime.torchrun", *args,
                           str(tmp_path / "worker.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=clean_environment())
    return done.returncode, done.stderr


def test_a_failed_worker_is_one_line_and_its_exit_code(tmp_path):
    code, err = _torchrun(tmp_path, "--standalone", "--nproc_per_node", "2")
    assert code == 2  # torchrun: 1
    assert err.strip().splitlines()[-1] == "error: worker.py stopped: rank 1 exited with " \
                                           "code 2 (its error is above)"
    assert "error: rank 1 met a bad flag" in err
    assert "Traceback" not in err and "ChildFailedError" not in err


def test_a_node_that_never_joins_is_one_line_naming_the_address(tmp_path):
    port = free_port()
    code, err = _torchrun(tmp_path, "--nnodes", "2", "--node_rank", "0", "--nproc_per_node",
                          "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                          "--rdzv-conf", "timeout=2")
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(
        f"error: the 2 node(s) could not meet at 127.0.0.1:{port}: ")
    assert "Start the script on every node with the same NNODES and MASTER_ADDR/MASTER_PORT" \
        in err and "Traceback" not in err


def test_a_rendezvous_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = _torchrun(tmp_path, "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                              "--master_port", str(port))
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(
        f"error: the rendezvous port at 127.0.0.1:{port} is in use (another job on this "
        "machine?): ")
    assert err.strip().endswith("Give a free port (MASTER_PORT)") and "Traceback" not in err


def test_ctrl_c_stops_the_workers_and_exits_130_without_a_traceback(tmp_path):
    import os
    import signal
    import time
    (tmp_path / "sleeper.py").write_text(
        "import time\ntry:\n    time.sleep(120)\nexcept KeyboardInterrupt:\n    pass\n")
    launcher = subprocess.Popen([PYTHON, "-m", "megatron.runtime.torchrun", "--standalone",
                                 "--nproc_per_node", "2", str(tmp_path / "sleeper.py")],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, env=clean_environment())
    try:
        time.sleep(8)  # (torch imported, the workers started)
        os.killpg(launcher.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches the group
        output, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130
    assert "Traceback" not in output, output
