"""--keep-last-n-checkpoints: remove old checkpoint directories, never the ones still needed.

Called by global rank 0 only after a new checkpoint is complete and its tracker file names it,
so at every moment the tracker names a complete checkpoint.  A directory is first renamed to a
hidden `.<name>.deleting` (one atomic step: it stops looking like a checkpoint at once) and then
removed; a crash half way through a removal leaves only hidden debris, which the next prune
clears.  The directory the tracker names is never removed, whatever its number.
"""

import os
import re
import shutil
from dataclasses import dataclass

from megatron.runtime.fault_injection import kill_point


@dataclass(frozen=True)
class Layout:
    pattern: str  # checkpoint directory names; group 1 is the iteration
    tracker: str  # the file naming the current checkpoint (its iteration or tag)


MEGATRON_LAYOUT = Layout(r"iter_(\d{7})", "latest_checkpointed_iteration.txt")
DEEPSPEED_LAYOUT = Layout(r"global_step(\d+)", "latest")
DELETING_SUFFIX = ".deleting"


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


def prune_checkpoints(save_dir, keep, layout):
    """Keep the newest `keep` checkpoints (and the current one); None or 0 keeps everything."""
    if not keep:
        return []
    kill_point("save.prune.start")
    for name in os.listdir(save_dir):  # debris of a removal a crash interrupted
        if name.endswith(DELETING_SUFFIX):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    current = _current(save_dir, layout)
    old = [name for _, name in checkpoint_dirs(save_dir, layout)[:-keep] if name != current]
    for name in old:
        doomed = os.path.join(save_dir, f".{name}{DELETING_SUFFIX}")
        os.replace(os.path.join(save_dir, name), doomed)
        kill_point("save.prune.renamed")
        shutil.rmtree(doomed)
        kill_point("save.prune.removed")
    return old
