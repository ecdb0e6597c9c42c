"""Publishing a checkpoint (its owner mark, then the tracker) and --keep-last-n-checkpoints.

Beside each checkpoint directory `<name>` is a hidden `.<name>.run_id`: the id of the training
run that wrote it (outside the directory, so tools that list a checkpoint's files see only the
checkpoint's own). A run
starting fresh takes a new id; a run resuming keeps the id of the checkpoint it loaded (a
checkpoint without one, from before the mark existed, passes on the empty id: "unmarked").
Retention only ever removes checkpoints of its own run, so a run given a folder that holds
another run's checkpoints never deletes them, while a job resumed many times still keeps only
its last N.

Pruning runs on global rank 0 only after a new checkpoint is complete and its tracker file
names it, so at every moment the tracker names a complete checkpoint. A directory is first
renamed to a hidden `.<name>.deleting` (one atomic step: it stops looking like a checkpoint at
once) and then removed; a crash half way through a removal leaves only hidden debris, which
the next prune clears. The directory the tracker names is never removed, whatever its number,
nor those after it (a run that went back to an older one leaves them until it saves over
them).
"""

import os
import re
import shutil
import uuid
from dataclasses import dataclass

from megatron.checkpointing.files import atomic_write_text
from megatron.runtime.fault_injection import kill_point


@dataclass(frozen=True)
class Layout:
    pattern: str  # checkpoint directory names; group 1 is the iteration
    tracker: str  # the file naming the current checkpoint (its iteration or tag)


MEGATRON_LAYOUT = Layout(r"iter_(\d{7})", "latest_checkpointed_iteration.txt")
DEEPSPEED_LAYOUT = Layout(r"global_step(\d+)", "latest")
DELETING_SUFFIX = ".deleting"
RUN_ID_SUFFIX = ".run_id"


def new_run_id():
    return uuid.uuid4().hex


def run_id_path(save_dir, name):
    return os.path.join(save_dir, f".{name}{RUN_ID_SUFFIX}")


def run_id_of(save_dir, name):
    """The id of the run that wrote checkpoint `name` ("" when it carries none)."""
    try:
        with open(run_id_path(save_dir, name)) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def other_runs_checkpoints(save_dir, layout, run_id):
    """Names of the checkpoints in `save_dir` that another run wrote (not `run_id`)."""
    if not save_dir or not os.path.isdir(save_dir):
        return []
    return [name for _, name in checkpoint_dirs(save_dir, layout)
            if run_id_of(save_dir, name) != run_id and _holds_files(save_dir, name)]


def _holds_files(save_dir, name):
    """Not an empty shell (what removing an interrupted save's leftovers can leave)."""
    return any(files for _, _, files in os.walk(os.path.join(save_dir, name)))


def publish_checkpoint(save_dir, name, tracker_text, run_id, keep, layout):
    """Global rank 0, once every rank's files of checkpoint `name` are written: mark it as
    `run_id`'s, point the tracker at it (`tracker_text` None: the writer already did), then
    prune this run's older checkpoints."""
    if run_id:
        atomic_write_text(run_id_path(save_dir, name), run_id)
    if tracker_text is not None:
        atomic_write_text(os.path.join(save_dir, layout.tracker), tracker_text,
                          point="save.tracker")
    # Only now, with the new checkpoint complete and named, may older ones go.
    prune_checkpoints(save_dir, keep, layout, run_id)


def checkpoint_dirs(save_dir, layout):
    """[(iteration, directory name)] of the checkpoints in save_dir, oldest first."""
    found = []
    for name in os.listdir(save_dir):
        match = re.fullmatch(layout.pattern, name)
        if match and os.path.isdir(os.path.join(save_dir, name)):
            found.append((int(match.group(1)), name))
    return sorted(found)


def _current(save_dir, layout):
    """The directory name (Megatron) or tag (DeepSpeed) the tracker holds, or None."""
    path = os.path.join(save_dir, layout.tracker)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if layout is MEGATRON_LAYOUT and text.isdigit():
        return f"iter_{int(text):07d}"
    return text


def prune_checkpoints(save_dir, keep, layout, run_id):
    """Keep the newest `keep` checkpoints of run `run_id` (and the current one, and every
    other run's); None or 0 keeps everything."""
    if not keep:
        return []
    kill_point("save.prune.start")
    for name in os.listdir(save_dir):  # debris of a removal a crash interrupted
        if name.endswith(DELETING_SUFFIX):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    current = _current(save_dir, layout)
    match = re.fullmatch(layout.pattern, current or "")
    newest = int(match.group(1)) if match else None
    # (a run resumed from an older step, --ckpt-step, leaves the later ones alone: they are
    # the timeline it rolled back from, saved over only as it reaches them)
    mine = [name for iteration, name in checkpoint_dirs(save_dir, layout)
            if run_id_of(save_dir, name) == run_id and (newest is None or iteration <= newest)]
    old = [name for name in mine[:-keep] if name != current]
    for name in old:
        doomed = os.path.join(save_dir, f".{name}{DELETING_SUFFIX}")
        os.replace(os.path.join(save_dir, name), doomed)
        kill_point("save.prune.renamed")
        shutil.rmtree(doomed)
        kill_point("save.prune.removed")
    for entry in os.listdir(save_dir):  # marks whose checkpoint is gone (now or in a crash)
        if entry.startswith(".") and entry.endswith(RUN_ID_SUFFIX) and \
                not os.path.isdir(os.path.join(save_dir, entry[1:-len(RUN_ID_SUFFIX)])):
            os.remove(os.path.join(save_dir, entry))
    return old
