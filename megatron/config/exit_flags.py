"""Checks of the flags that stop a run early from outside it (--kill-switch-file)."""

import os

from megatron.errors import require


def kill_switch_file(path):
    """--kill-switch-file, checked before anything starts: a file path (a folder would count
    as found at once) whose folder exists (else the file could never appear: a typo)."""
    if path is None:
        return None
    require(path.strip() != "", "--kill-switch-file is empty: give the path of a file whose "
                                "creation stops the run")
    require(not os.path.isdir(path),
            f"--kill-switch-file {path} is a folder: give the path of a file whose creation "
            f"stops the run (such as {os.path.join(path, 'STOP')})")
    folder = os.path.dirname(os.path.abspath(path))
    require(os.path.isdir(folder),
            f"--kill-switch-file {path}: its folder {folder} does not exist, so the file "
            "could never appear there; create the folder or give another path")
    return path
