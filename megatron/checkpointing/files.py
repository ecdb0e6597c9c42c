"""Checkpoint files that are complete or absent: atomic writes, and reads that execute no
pickled code. Both layouts (Megatron's and DeepSpeed's) write through these.

Every file is written to a temporary name, fsynced and renamed, so a crash at any moment
leaves either the old file or the new one, never a partial one.
"""

import contextlib
import errno
import os

import torch
import torch.distributed as dist

from zero.checkpoint.files import (DAMAGED_ADVICE, PICKLED_CODE, UNREADABLE, fsync_dir,
                                   load_failure, load_plain)

from megatron.errors import CheckpointError
from megatron.runtime.fault_injection import kill_point
from megatron.runtime.fault_injection import writer as fault_writer


def atomic_torch_save(obj, path):
    """torch.save to `path` so that `path` is either absent/old or complete, never partial."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with _write_failures_explained(path, tmp):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            kill_point("save.file.tmp_opened")
            torch.save(obj, fault_writer(f, "save.file.tmp_half_written"))
            kill_point("save.file.tmp_written")
            f.flush()
            os.fsync(f.fileno())
    kill_point("save.file.tmp_synced")
    os.replace(tmp, path)
    kill_point("save.file.renamed")
    fsync_dir(os.path.dirname(path))


def atomic_write_text(path, text, point=None):
    """Replace `path` by `text` atomically; `point` names the kill points on the way."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with _write_failures_explained(path, tmp), open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if point:
        kill_point(f"{point}.tmp_written")
    os.replace(tmp, path)
    if point:
        kill_point(f"{point}.renamed")
    fsync_dir(os.path.dirname(path))


@contextlib.contextmanager
def _write_failures_explained(path, tmp):
    """A write that fails (a full disk, a lost mount) removes its temporary file and becomes a
    CheckpointError; `path` and the tracker keep naming the last complete checkpoint."""
    try:
        yield
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        advice = "write to a folder this user can write" if error.errno in (
            errno.EACCES, errno.EPERM, errno.EROFS) else "free space or write to another folder"
        raise CheckpointError(f"could not write {path}: {error.strerror or error}. The last "
                              f"complete checkpoint there (the one the tracker names) is "
                              f"intact; {advice}") from None




def safe_load(path, mmap=False):
    """Load a checkpoint file without executing pickled code; with `mmap`, mapped from the
    file (privately; zero.checkpoint.files.load_plain). Megatron-LM's pickled arguments and
    NumPy RNG state are allowed (megatron/checkpointing/megatron_lm.py), nothing else."""
    from megatron.checkpointing.megatron_lm import allowed_globals
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return load_plain(path, mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist") from None
    except MemoryError:
        raise
    except Exception as exc:  # corrupt file or a pickle with code in it
        reason, kind = load_failure(exc)
        why = {PICKLED_CODE: "The file holds pickled code, refused: only tensors and plain "
                             "containers are unpickled",
               UNREADABLE: "Check its permissions and the file system"}.get(kind, DAMAGED_ADVICE)
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}. {why}") from None


def barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def is_global_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0
