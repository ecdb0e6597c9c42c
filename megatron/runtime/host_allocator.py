"""glibc malloc settings for training on the CPU: reuse freed memory instead of returning it.

torch allocates CPU tensors with malloc, and glibc serves every request above 32 MiB (its
largest mmap threshold) with a fresh mmap that free() unmaps again. A training step allocates
and frees the same large tensors every step (logits and their gradient, the loss's working
copies, activations of wide layers), so each step page-faults and zero-fills them anew: 5-10%
of a CPU step here (docs/benchmarks.md, "Training throughput"). Serving every request from the
heap and never trimming it makes a step reuse the pages of the last one, as CUDA's caching
allocator does; the peak resident set stays the same (it is the step's peak either way), but
memory freed after the peak is kept by the process rather than given back.

The user's own settings win: nothing is changed when GLIBC_TUNABLES names a glibc.malloc
tunable or a MALLOC_*_ variable is set (MALLOC_MMAP_MAX_=65536 restores glibc's default), and
under another allocator (jemalloc or tcmalloc preloaded) glibc's mallopt does not apply to it.
"""

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = 2 ** 31 - 1  # mallopt takes an int: 2 GiB free at the top before it trims


def user_configured_malloc(environ=os.environ):
    """Whether the environment already tunes glibc malloc."""
    return ("glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or any(name.startswith("MALLOC_") and name.endswith("_") for name in environ))


def reuse_freed_memory():
    """Apply the settings above to this process; True if they were applied (glibc only)."""
    if user_configured_malloc():
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
