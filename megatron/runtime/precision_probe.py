"""`python -m megatron.runtime.precision_probe`: prints bf16 or fp32, whichever trains faster
on this machine by its matmul throughput (measured, under a second), for launch scripts whose
user named no precision. The measurements go to stderr as one line.

CPUs differ: with AMX, bf16 matmuls are several times faster than fp32; with AVX512-BF16 and
no AMX they are about half as fast (docs/benchmarks.md). On a GPU without bf16, fp32.
"""

import sys

import torch

from megatron.runtime.device import RATIO_SECONDS, measure_matmul_flops, resolve_device


def fastest_precision(device):
    """("bf16" | "fp32", {name: measured matmul FLOP/s})."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "fp32", {}
    peaks = {"bf16": measure_matmul_flops(device, torch.bfloat16, min_seconds=RATIO_SECONDS),
             "fp32": measure_matmul_flops(device, torch.float32, min_seconds=RATIO_SECONDS)}
    return max(peaks, key=peaks.get), peaks


def main():
    device = resolve_device("auto")
    best, peaks = fastest_precision(device)
    measured = ", ".join(f"{name} {peak / 1e9:.0f}" for name, peak in peaks.items())
    why = f"matmul GFLOP/s on this {device.type}: {measured}" if peaks else "no bf16 on this GPU"
    print(f"[precision] {best}, the faster here ({why}); PRECISION=bf16|fp16|fp32 or "
          "--bf16/--fp16 choose", file=sys.stderr)
    print(best)


if __name__ == "__main__":
    main()
