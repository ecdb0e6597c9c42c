"""Checks on `nvme_path` before anything is written, and the per-rank swap directory.

Every problem is a ConfigError raised on every rank before the first swap file exists: a path
that does not exist, is not a directory, is not writable, or whose file system has less free
space than the swap files need (shutil.disk_usage, swap files of an earlier run of this rank
counted as free since they are replaced).
"""

import os
import shutil
import tempfile


from zero.errors import ConfigError


def swap_dir_for(nvme_path, stage, kind, global_rank):
    """DeepSpeed's folder layout: <nvme_path>/zero_stage_<s>/<kind>/rank<R>."""
    return os.path.join(nvme_path, f"zero_stage_{stage}", kind, f"rank{global_rank}")


def check_nvme_path(nvme_path, needed_bytes, swap_dir, key_name):
    """Raise ConfigError if `nvme_path` cannot hold `needed_bytes` of swap files."""
    if not os.path.exists(nvme_path):
        raise ConfigError(f"'{key_name}' {nvme_path!r} does not exist; create it (mkdir -p "
                          f"{nvme_path}) or point it at a directory on the NVMe drive")
    if not os.path.isdir(nvme_path):
        raise ConfigError(f"'{key_name}' {nvme_path!r} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=nvme_path, prefix=".zero-write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"'{key_name}' {nvme_path!r} is not writable ({e.strerror}); fix its "
                          "permissions or choose another directory") from None
    free = shutil.disk_usage(nvme_path).free + _bytes_under(swap_dir)
    if free < needed_bytes:
        raise ConfigError(f"'{key_name}' {nvme_path!r} has {_gib(free)} free but the swapped "
                          f"optimizer states of this rank need {_gib(needed_bytes)} "
                          f"({needed_bytes} bytes: fp32 master, exp_avg and exp_avg_sq); free "
                          "space or choose a larger drive")


def remove_swap_dir(swap_dir):
    """Delete a rank's swap folder, then the folders above it that are left empty
    (<kind>, zero_stage_<s>), so nvme_path is as clean as before; another rank's folder
    keeps them, and the last rank to finish removes them."""
    shutil.rmtree(swap_dir, ignore_errors=True)
    remove_empty_folders(os.path.dirname(swap_dir), 2)


def remove_empty_folders(folder, levels):
    """rmdir `folder` and up to `levels` - 1 of its parents, stopping at one not empty."""
    for _ in range(levels):
        try:
            os.rmdir(folder)
        except OSError:  # not empty, or already gone
            return
        folder = os.path.dirname(folder)


def fresh_swap_dir(swap_dir):
    """Empty the folder (files of an earlier run of this rank are stale) and create it."""
    shutil.rmtree(swap_dir, ignore_errors=True)
    os.makedirs(swap_dir)


def agree_on_errors(error):
    """Every rank learns whether any rank's check failed, so no rank trains on alone."""
    from zero.comm.agreement import any_rank_failed
    failed = any_rank_failed(error is not None)
    if error is not None:
        raise error
    if failed:
        raise ConfigError("optimizer offload: the nvme_path check failed on another rank "
                          "(see its error); nothing was written")


def _bytes_under(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _gib(n):
    return f"{n / 2**30:.2f} GiB"
