"""How glibc hands freed host tensors back: kept for reuse, or returned to the OS.

Two policies, one per process (glibc only; elsewhere both are no-ops):

- `keep_freed_buffers()` (training on CPU without offload: at ZeRO-3 always, at stages 0-2
  when the process started with the tcache off, as the launch scripts start it): blocks up to
  1 GiB come from the heap and freed memory is never trimmed, so each step reuses the last
  step's memory instead of faulting fresh pages in (a step allocates its logits and
  activations, and under ZeRO-3 every gathered parameter and gradient, afresh). A user's own
  MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (or the glibc.malloc tunables of the same
  names) at process start wins, over this policy and the next.
- `return_freed_buffers_to_os()` (offload): every freed buffer over 256 KiB leaves the
  resident set; offload's memory budget wins over reuse.

glibc's per-thread cache of small freed blocks (tcache) makes the heap creep under ZeRO-3, and
only `GLIBC_TUNABLES` at process start turns it off: `small_block_cache_off_environ()` is the
environment the launch scripts start training with, `small_block_cache_warning()` the
engine's warning without it. The measurements behind these choices: docs/design/host-memory.md.
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
    if _policy is not None or user_set_thresholds():
        return
    _policy = "keep"
    _mallopt((M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, NEVER_TRIM))


def return_freed_buffers_to_os():
    """Give every freed buffer over 256 KiB back to the OS (offload's resident-set budget)."""
    global _policy
    if _policy == "return" or user_set_thresholds():
        return
    _policy = "return"
    _mallopt((M_MMAP_THRESHOLD, RETURN_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD))


def start_environ():
    """The environment this process was started with, which is what glibc read (a variable
    set in os.environ later changes nothing for malloc); os.environ where /proc is missing."""
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    return dict(entry.decode(errors="replace").split("=", 1)
                for entry in entries if b"=" in entry)


def user_set_thresholds(environ=None):
    """Whether the process was started with its own mmap or trim threshold for glibc."""
    environ = start_environ() if environ is None else environ
    tunables = environ.get("GLIBC_TUNABLES", "").split(":")
    return any(name in environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) \
        or any(t.startswith(("glibc.malloc.mmap_threshold=", "glibc.malloc.trim_threshold="))
               for t in tunables)


def policy():
    """"keep", "return" or None (glibc's defaults)."""
    return _policy


def is_glibc():
    return platform.libc_ver()[0] == "glibc"


def small_block_cache_off(environ=None):
    """Whether the process was started with glibc's tcache off (GLIBC_TUNABLES is read once,
    at start-up: setting it later changes nothing)."""
    tunables = (start_environ() if environ is None else environ).get("GLIBC_TUNABLES", "")
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


def tune_host_allocator(device, zero_optimization):
    """The engine's policy, on CPU without offload: reuse freed tensor memory across steps.
    Every step allocates and frees the same large tensors (logits, activations, and under
    ZeRO-3 every gathered parameter and gradient); with glibc's defaults each step page-faults
    them in anew. At stages 0-2 only when the process started with glibc's small-block cache
    off (the launch scripts start it so): with the cache on, kept memory can creep up step
    after step, and below stage 3 glibc's defaults are the safe choice; stage 3 keeps
    regardless. Offload keeps its own policy. Returns the warning to give, or None (stage 3
    with the cache on: small_block_cache_warning's, once a process)."""
    if device.type != "cpu" or zero_optimization.offload_optimizer is not None \
            or zero_optimization.offload_param is not None:
        return None
    if zero_optimization.stage == 3:
        keep_freed_buffers()
        return small_block_cache_warning()
    if small_block_cache_off():
        keep_freed_buffers()
    return None
