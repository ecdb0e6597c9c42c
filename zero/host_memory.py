"""How glibc hands freed host tensors back: keep them for reuse, or return them to the OS.

torch's CPU tensors come from glibc's malloc. A large block is either mmap'd (freed: unmapped
at once) or carved from the heap (freed: kept, unless the free space at the top of the heap
exceeds the trim threshold). Memory fresh from the OS costs a page fault per 4 KiB page on
first touch: measured here ~1.7 us per page, i.e. 1.15 s for 20 rounds of a 112 MB
allocate-fill-free where a reused block takes 0.30 s.

Two policies, one per process (glibc only; elsewhere both are no-ops):

- `keep_freed_buffers()` (ZeRO-3 on CPU without offload): blocks up to 1 GiB come from the
  heap and freed memory is never trimmed, so each step reuses the memory of the last. ZeRO-3
  allocates every gathered parameter and every gradient afresh each step; with glibc's
  defaults that was ~185k page faults per step on a 110M-parameter model at DP=2 (~0.3 s of a
  4 s step; torch DDP, whose gradients persist, ~49k). The price is resident memory: glibc
  2.36 does not reuse a freed block for an aligned request (torch's posix_memalign) of the
  same size, so the heap settles higher (on that model +5-10% peak RSS at stage 3, +300-450
  MB at stages 0-2, which is why the engine keeps only at stage 3).
- `return_freed_buffers_to_os()` (offload): a fixed 256 KiB mmap threshold, so every larger
  freed buffer leaves the resident set. Offload frees and reallocates many multi-MiB buffers
  (whole submodules under zero.Init, swap buffers, gathered parameters); kept, the resident
  set would hold the high-water mark of everything offloaded (measured: +250 MiB peak for a
  25M-parameter model). Offload's memory goal wins: once it is set, `keep_freed_buffers()`
  does nothing.

Neither policy can stop the creep that glibc's per-thread cache of small freed blocks (tcache)
causes, and mallopt cannot turn that cache off: only `GLIBC_TUNABLES` at process start can.
torch allocates with posix_memalign, which carves a block out of a larger free one and frees
the small pieces before and after it; tcache keeps those pieces (up to 7 per size) without
merging them with their neighbours, so when the big block is freed it stays walled in, too
small by those pieces for the next aligned request of the same size, and the heap grows
instead. Measured with ZeRO-3 (keep policy) on a 110M-parameter GPT at DP=2: the resident set
rose step after step (1.5, 2.1, 2.3, 2.5 GB after steps 0-3, 0.78 GB in use between steps);
started with `GLIBC_TUNABLES=glibc.malloc.tcache_count=0` it levelled off at 1.9 GB after step
1, the same step time within this machine's noise (ZeroRedundancyOptimizer: 2.1 GB either
way). The launch scripts in scripts/ export it (`small_block_cache_off_environ`); the engine
warns once when ZeRO-3 runs on CPU without it.
"""

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
RETURN_MMAP_THRESHOLD = 256 * 1024
KEEP_MMAP_THRESHOLD = 1 << 30
NEVER_TRIM = 2 ** 31 - 1  # mallopt takes an int
DEFAULT_TRIM_THRESHOLD = 128 * 1024
SMALL_BLOCK_CACHE_OFF = "glibc.malloc.tcache_count=0"

_policy = None  # "keep" | "return" once set
_warned_small_block_cache = False


def _mallopt(*settings):
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return all(libc.mallopt(param, value) == 1 for param, value in settings)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False


def keep_freed_buffers():
    """Reuse freed host memory instead of faulting fresh pages in every step."""
    global _policy
    if _policy is not None:
        return
    _policy = "keep"
    _mallopt((M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, NEVER_TRIM))


def return_freed_buffers_to_os():
    """Give every freed buffer over 256 KiB back to the OS (offload's resident-set budget)."""
    global _policy
    if _policy == "return":
        return
    _policy = "return"
    _mallopt((M_MMAP_THRESHOLD, RETURN_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD))


def policy():
    """"keep", "return" or None (glibc's defaults)."""
    return _policy


def is_glibc():
    return platform.libc_ver()[0] == "glibc"


def small_block_cache_off(environ=None):
    """Whether the process was started with glibc's tcache off (GLIBC_TUNABLES is read once,
    at start-up: setting it later changes nothing)."""
    tunables = (os.environ if environ is None else environ).get("GLIBC_TUNABLES", "")
    return SMALL_BLOCK_CACHE_OFF in tunables.split(":")


def small_block_cache_off_environ(environ=None):
    """`environ` (default: this process's) with the tcache turned off for processes started
    from it; a tcache_count someone already set is left alone."""
    environ = dict(os.environ if environ is None else environ)
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.tcache_count=") for t in tunables):
        environ["GLIBC_TUNABLES"] = ":".join(tunables + [SMALL_BLOCK_CACHE_OFF])
    return environ


def small_block_cache_warning():
    """The warning for a process that runs ZeRO-3 on CPU with glibc's tcache on: its text the
    first time it is asked for in a process, None afterwards and where it does not apply."""
    global _warned_small_block_cache
    if _warned_small_block_cache or not is_glibc() or small_block_cache_off():
        return None
    _warned_small_block_cache = True
    return (f"ZeRO-3 on CPU: start the processes with GLIBC_TUNABLES={SMALL_BLOCK_CACHE_OFF} "
            "(the scripts in scripts/ do) or their resident memory creeps up step after step "
            "(zero/host_memory.py)")
