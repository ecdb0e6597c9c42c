"""The only module that knows whether we run on CPU or CUDA.

Everything else asks here for the device, the distributed backend, RNG state and memory
statistics, so the same training code runs on a 2-core laptop (gloo) and on GPU nodes (NCCL).
"""

import os

import torch

from megatron.errors import ConfigError, LaunchError


def resolve_device(requested="auto", local_rank=0):
    """Turn `--device auto|cpu|cuda` into a torch.device for this process."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but torch sees no CUDA device; "
                          "use --device cpu (or auto)")
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    # One GPU visible: this process's own (srun --gpus-per-task=1, a per-rank
    # CUDA_VISIBLE_DEVICES), whatever its local rank. More, but fewer than the local ranks:
    # two ranks would share one, which NCCL refuses at the first collective.
    index = 0 if visible == 1 else local_rank
    if index >= visible:
        raise LaunchError(f"this process has local rank {local_rank}, but torch sees {visible} "
                          f"GPUs on this node: start at most {visible} processes per node "
                          f"(torchrun --nproc_per_node {visible}; check CUDA_VISIBLE_DEVICES), "
                          "or use --device cpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def backend_for(device):
    """NCCL for CUDA tensors, gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache(device):
    """Hand the caching allocator's unused blocks back to the device (CUDA; else nothing)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def read_later(tensor):
    """A function that returns `tensor`'s value (a Python number). On a GPU the copy to the
    host starts now, queued after the work that computes it, and the function waits for that
    copy only: unlike `.item()`, which waits for everything queued so far, it leaves the GPU
    busy with the work queued after `tensor` while the host reads."""
    tensor = tensor.detach()
    if tensor.device.type != "cuda":
        return tensor.item
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read():
        copied.synchronize()
        return host.item()
    return read


def get_rng_state(device):
    """The device RNG state (None on CPU, whose state is torch.get_rng_state())."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def set_rng_state(device, state):
    if device.type == "cuda" and state is not None:
        torch.cuda.set_rng_state(state, device)


def manual_seed(device, seed):
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def max_memory_allocated(device):
    """Peak bytes allocated on the device; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def peak_rss_bytes():
    import resource
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def default_num_threads():
    """Threads per process on CPU when --threads is not given: $OMP_NUM_THREADS when set
    (torchrun sets it to 1 when it starts several processes and finds it unset), else the
    cores divided among the local ranks."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={text!r} is not a positive number of threads; "
                              "unset it or pass --threads N")
        return int(text)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def peak_flops(device, dtype):
    """Nominal peak FLOP/s used as the MFU denominator.

    CUDA: looked up from the device name (dense tensor-core numbers).  CPU: measured once
    with a large matmul in this process (see `measure_matmul_flops`).
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        half = dtype in (torch.float16, torch.bfloat16)
        table = {"H200": (989e12, 67e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12),
                 "V100": (125e12, 15.7e12), "A10": (125e12, 31.2e12), "L4": (121e12, 30.3e12)}
        for key, (half_peak, fp32_peak) in table.items():
            if key in name:
                return half_peak if half else fp32_peak
        return measure_matmul_flops(device, dtype)
    return measure_matmul_flops(device, dtype)


def faster_precision_note(device, dtype):
    """On CPU in a 16-bit precision: one line naming the precision whose matmuls are at least
    1.5x faster here (measured), or None. CPUs differ: fp16 is emulated on some, bf16 on
    others (no AMX), and fp32 can beat both."""
    if device.type != "cpu" or dtype == torch.float32:
        return None
    peaks = {name: measure_matmul_flops(device, other, min_seconds=RATIO_SECONDS)
             for name, other in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                                 ("fp32", torch.float32))}
    mine = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    best = max(peaks, key=peaks.get)
    if peaks[best] < 1.5 * peaks[mine]:
        return None
    flag = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "fp32 (no --fp16/--bf16)"}[best]
    measured = ", ".join(f"{name} {peak / 1e9:.0f}" for name, peak in peaks.items())
    return (f" note: matmul GFLOP/s measured on this CPU: {measured}; {flag} is the fast path "
            f"here, {peaks[best] / peaks[mine]:.1f}x {mine}")


_measured_peaks = {}
# How long one product must take for its time to count (`min_seconds`). A peak (the MFU's
# denominator) wants products of 50 ms; comparing dtypes by throughput needs less, and an
# emulated dtype (~1 GFLOP/s) is then timed at 256 rows, not 512 (0.15 s instead of 0.8).
PEAK_SECONDS, RATIO_SECONDS = 0.05, 0.01


def measure_matmul_flops(device, dtype, size=2048, repeats=5, min_seconds=PEAK_SECONDS,
                         remeasure=False):
    """Best-of-`repeats` FLOP/s of a square matmul: the practical peak of this device
    (measured once per device, dtype and `min_seconds`; `remeasure` measures again and keeps
    the higher). A product that takes PEAK_SECONDS or more is timed three times, not
    `repeats` + 1.

    The matrices grow from 256 up to `size` until one product takes `min_seconds`, so a
    dtype the device only emulates (fp16 on most CPUs: ~1 GFLOP/s) is measured in a fraction
    of a second instead of minutes.
    """
    import time
    key = (str(device), dtype, min_seconds)
    if key in _measured_peaks and not remeasure:
        return _measured_peaks[key]
    # A private generator: measuring must not consume the training RNG streams.
    generator = torch.Generator().manual_seed(0)
    n = min(256, size)
    while True:
        a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
        best = float("inf")
        for timed in range(1, repeats + 2):
            synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
            if n < size and best < min_seconds / 4:
                break  # far too quick to time well: go straight to a larger size
            if best >= PEAK_SECONDS and timed >= 3:
                break  # long enough to time well: more repeats of an emulated dtype cost seconds
        if n >= size or best >= min_seconds:
            break
        n = min(2 * n, size)
    _measured_peaks[key] = max(2 * n ** 3 / best, _measured_peaks.get(key, 0.0))
    return _measured_peaks[key]
