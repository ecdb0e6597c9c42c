"""A test hook: SIGKILL this process at a named place in the checkpoint save path.

Does nothing unless MEGATRON_FAULT_KILL_AT is set (one dictionary lookup per point when it is
not).  `MEGATRON_FAULT_KILL_AT=<point>[@<n>]` kills the n-th time (default the first) execution
reaches `kill_point("<point>")`.  The trainer's save path (megatron/runtime/fault_injection.py)
uses this same hook, so one test drives a kill through a --deepspeed save and the trainer
around it.
"""

import os
import signal

KILL_VARIABLE = "MEGATRON_FAULT_KILL_AT"

# The places in zero/checkpoint/layout.py's save path, in the order a save passes them
# ("file" points once per file a rank writes).
SAVE_KILL_POINTS = (
    "zero.save.start",
    "zero.save.partial_dir_created",
    "zero.save.file.half_written",
    "zero.save.file.written",
    "zero.save.file.synced",
    "zero.save.files_done",
    "zero.save.publish.old_moved_aside",
    "zero.save.publish.renamed",
    "zero.save.publish.old_removed",
    "zero.save.publish.script_copied",
    "zero.save.publish.latest_tmp_written",
    "zero.save.publish.latest_renamed",
)

_hits = {}


def kill_point(name):
    wanted = os.environ.get(KILL_VARIABLE)
    if not wanted:
        return
    point, _, nth = wanted.partition("@")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


class HalfWayKiller:
    """Passes `point` right after the first bytes of a file are written."""

    def __init__(self, file, point):
        self.file, self.point = file, point

    def write(self, data):
        count = self.file.write(data)
        if self.point is not None:
            point, self.point = self.point, None
            self.file.flush()
            kill_point(point)
        return count

    def flush(self):
        self.file.flush()


def writer(file, point):
    """`file`, wrapped so that `point` is passed mid-write only when a kill is asked for."""
    return HalfWayKiller(file, point) if os.environ.get(KILL_VARIABLE) else file
