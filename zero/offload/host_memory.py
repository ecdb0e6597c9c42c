"""Make freed host tensors leave the process's resident set (glibc only; elsewhere a no-op).

glibc serves an allocation from the heap, not from its own mmap, once a freed mmap chunk has
raised its dynamic mmap threshold (up to 32 MiB); freed heap memory then stays resident.
Offload frees and reallocates many multi-MiB buffers (whole submodules under zero.Init,
swap buffers, gathered parameters), so without a fixed threshold the resident set keeps the
high-water mark of everything offloaded (measured: +250 MiB peak for a 25M-parameter model).
A fixed threshold of 256 KiB returns every larger buffer to the OS as soon as it is freed.
"""

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 256 * 1024
_done = False


def return_freed_buffers_to_os():
    global _done
    if _done:
        return
    _done = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass
