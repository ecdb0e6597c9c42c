"""The --save folder belongs to one run at a time.

Global rank 0 holds an exclusive `flock` on `<save>/.lock` for the life of the run, and writes
who holds it there (host, pid, start time, command). A second run that is given the same
folder stops at start-up with one line naming the holder, instead of interleaving checkpoints,
moving the tracker backwards or pruning the other run's checkpoints. The lock belongs to the
open file, so it goes when the process does (even under `kill -9`): there is nothing stale to
clean up by hand. (On network filesystems `flock` is only as good as the filesystem's lock
support.)

With the folder claimed, whatever temporary files an interrupted save left behind are this
folder's garbage and are removed, with one line saying how much. The log and TensorBoard
folders are checked at the same moment, so an unusable one stops the run before the model
is built rather than at its first write.
"""

import fcntl
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from megatron.errors import ConfigError

LOCK_NAME = ".lock"
# what an interrupted save leaves: temporary files (Megatron layout `<file>.tmp.<pid>`, zero
# layout `<file>.tmp-<pid>`), unpublished zero saves `.<tag>.partial/`, interrupted pruning
# `.<name>.deleting/`
_LEFTOVER_FILE = re.compile(r".*\.tmp[.-]\d+$")
_LEFTOVER_DIR = re.compile(r"^\..*\.(partial|deleting)$")


class SaveDirLock:
    def __init__(self, save_dir):
        self.save_dir, self._file = save_dir, None

    def acquire(self):
        """Claim the folder; ConfigError (naming the holder) when another run has it."""
        check_writable_folder(self.save_dir, "--save")
        try:
            self._file = open(os.path.join(self.save_dir, LOCK_NAME), "a+")
        except OSError as error:
            raise ConfigError(f"--save {self.save_dir} cannot be written ({error.strerror}); "
                              "give a writable folder") from None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.seek(0)
            holder = self._file.read().strip() or "a process that has not said who it is"
            self._file.close()
            self._file = None
            raise ConfigError(f"--save {self.save_dir} is in use by another run ({holder}); "
                              "give this run its own --save folder, or wait for that run to "
                              "end") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}: "
                         f"{shlex.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}\n")
        self._file.flush()

    def release(self):
        if self._file is not None:
            self._file.close()  # closing the file releases the lock
            self._file = None


def remove_leftovers(save_dir):
    """Delete what interrupted saves left in `save_dir` (its top level and checkpoint folders);
    returns (paths removed, bytes freed)."""
    removed, freed = 0, 0
    for top in os.scandir(save_dir):
        if top.is_dir(follow_symlinks=False) and _LEFTOVER_DIR.match(top.name):
            freed += _tree_bytes(top.path)
            shutil.rmtree(top.path, ignore_errors=True)
            removed += 1
            continue
        candidates = [top] if not top.is_dir(follow_symlinks=False) else \
            [entry for entry in _walk(top.path, depth=2)]
        for entry in candidates:
            if entry.is_file(follow_symlinks=False) and _LEFTOVER_FILE.match(entry.name):
                freed += entry.stat(follow_symlinks=False).st_size
                os.remove(entry.path)
                removed += 1
    return removed, freed


def check_writable_folder(path, flag):
    """Make `path` if needed and prove a file can be created in it; ConfigError naming `flag`
    otherwise (a file where the folder should be, no permission, a read-only filesystem)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ConfigError(f"{flag} {path} cannot be written ({error.strerror}); give a "
                          "writable folder") from None


def claim_output_folders(save_dir, other_folders, is_rank0, device):
    """At start-up, before anything is built: rank 0 locks `save_dir` (when given) and clears
    its leftovers, and checks that every folder of `other_folders` ({flag: path}) can be
    written. Every rank learns whether that worked (the others raise an error that points at
    rank 0's). Returns the save-folder lock to release (None without `save_dir`)."""
    lock = SaveDirLock(save_dir) if save_dir else None
    failure = None
    if is_rank0:
        try:
            if lock is not None:
                lock.acquire()
                removed, freed = remove_leftovers(save_dir)
                if removed:
                    print(f" removed {removed} leftover(s) of interrupted saves from "
                          f"{save_dir} ({freed / 2 ** 20:.1f} MiB)", flush=True)
            checked = {save_dir}
            for flag, path in other_folders.items():
                if path and path not in checked:
                    check_writable_folder(path, flag)
                    checked.add(path)
        except ConfigError as error:
            failure = error
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0.0 if failure is None else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if failure is None and flag.item() > 0:
            failure = ConfigError("an output folder could not be used (rank 0 says why)")
    if failure is not None:
        if lock is not None:
            lock.release()
        raise failure
    return lock


def _walk(directory, depth):
    for entry in os.scandir(directory):
        yield entry
        if depth > 1 and entry.is_dir(follow_symlinks=False):
            yield from _walk(entry.path, depth - 1)


def _tree_bytes(directory):
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total
