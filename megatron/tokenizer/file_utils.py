"""Writing a file so that it is either complete or absent, with the permissions the user's
umask gives any new file (temporary files are created 0600)."""

import os
import tempfile


def current_umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def permissions_as_new_file(path):
    """chmod `path` to what open() would have given a new file (0666 less the umask)."""
    os.chmod(path, 0o666 & ~current_umask())


def atomic_write_bytes(path, data):
    """Write `data` to `path` so that readers see either the old file or the whole new one.

    The bytes go to a temporary file in the same directory (same filesystem, so os.replace is
    atomic), are fsynced, and only then replace `path`; a crash leaves no half-written file.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                    suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        permissions_as_new_file(tmp_path)
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
