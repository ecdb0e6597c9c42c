"""torchrun workers stop when their launcher is gone.

A torchrun worker is a child of the launcher's agent process. When the launcher is killed
(`kill -9`, an out-of-memory kill, a lost login session) nothing tells the workers: they kept
training and writing checkpoints, or waited for minutes in a rendezvous store that no longer
answers. A daemon thread notices within a second that the process has a new parent and ends
it; the last checkpoint is intact (saves are atomic).
"""

import os
import sys
import threading
import time


def watch_launcher(local_rank, poll_seconds=1.0):
    """Under torchrun, end this process soon after its launcher dies."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(poll_seconds)
        if local_rank == 0:  # one line per machine, not one per worker
            print(f"error: the torchrun launcher (pid {launcher}) is gone; stopping its "
                  "workers (resume from the last checkpoint)", file=sys.stderr, flush=True)
        os._exit(1)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
