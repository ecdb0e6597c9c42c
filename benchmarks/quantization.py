"""Optimizer step time and state bytes per parameter: Adam8bit and Adam4bit
(zero.optim.quantized_adam: 8-/4-bit block-wise moments) vs zero.ops.CPUAdam and torch's fused
AdamW (fp32 moments), on one flat fp32 parameter of 10M and 100M elements, beside the
memory-bandwidth floor of each state width.

    .venv/bin/python benchmarks/quantization.py            # 10M and 100M (~3 GB of RAM)
    .venv/bin/python benchmarks/quantization.py --quick    # 10M only

Floors: a step reads param and grad (8 B), writes param (4 B), and reads and writes each
moment: 2 x 8 B in fp32 (28 B/param in all), 2 x 2 B in 8 bits (16 B/param, plus the block
scales), 2 x 1 B in 4 bits (14 B/param); floor = bytes x N / (copy bandwidth measured in the
same run). Medians after warm-up.
Peers, from a separate venv (benchmarks/install_quantization_peers_venv.sh; rows say n/a
without it): bitsandbytes AdamW8bit, torchao AdamW8bit and AdamW4bit (compiled on their first
step). Sizes are rounded to a multiple of 256: torchao keeps fp32 states for a tensor whose
size is not a multiple of its block.
"""

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    copy_bandwidth, machine_description, markdown_table, median_seconds, update_docs_section)
from zero.ops import CPUAdam  # noqa: E402
from zero.optim.quantized_adam import Adam4bit, Adam8bit  # noqa: E402

OPTIMIZERS = {  # name: (factory, floor bytes per parameter)
    "zero.optim.Adam8bit": (lambda p: Adam8bit(p, lr=1e-3, weight_decay=0.01), 16),
    "zero.optim.Adam4bit": (lambda p: Adam4bit(p, lr=1e-3, weight_decay=0.01), 14),
    "zero.ops.CPUAdam (fp32)": (lambda p: CPUAdam(p, lr=1e-3, weight_decay=0.01), 28),
    "torch AdamW fused (fp32)": (lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01,
                                                             fused=True), 28),
}


PEERS = {"bitsandbytes AdamW8bit": ("bnb8", 16), "torchao AdamW8bit": ("ao8", 16),
         "torchao AdamW4bit": ("ao4", 14)}
PEERS_VENV = os.environ.get("QUANT_PEERS_VENV", "/work/qvenv")


def measure_peer(task, numel, repeats, threads):
    """(ms per step, state bytes per parameter) from the peers' venv, or (None, why not)."""
    python = os.path.join(PEERS_VENV, "bin", "python")
    if not os.path.isfile(python):
        return None, "no peers venv (run benchmarks/install_quantization_peers_venv.sh)"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = str(threads)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "quantization_peers_task.py")
    run = subprocess.run([python, script, task, str(numel), str(repeats)], capture_output=True,
                         text=True, env=env, timeout=1800)
    match = re.search(r"RESULT ([0-9.]+) ([0-9.]+)", run.stdout)
    if run.returncode != 0 or not match:
        return None, f"{task} failed: {(run.stderr or run.stdout).strip()[-300:]}"
    return (float(match.group(1)), float(match.group(2))), None


def measure(factory, numel, repeats):
    """(median seconds per step, optimizer state bytes per parameter)."""
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel) * 1e-2
    optimizer = factory([param])
    seconds = median_seconds(optimizer.step, warmup=2, repeats=repeats)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return seconds, state / numel


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10M parameters only")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args()
    sizes = [10_000_000] if args.quick else [10_000_000, 100_000_000]
    sizes = [round(n / 256) * 256 for n in sizes]
    threads = torch.get_num_threads()
    rows, notes = [], set()
    for numel in sizes:
        repeats = 5 if numel <= 10_000_000 else 3
        bandwidth = copy_bandwidth(numel)
        results = {}
        for name, (factory, floor_bytes) in OPTIMIZERS.items():
            seconds, state_bytes = measure(factory, numel, repeats)
            results[name] = (seconds * 1000, state_bytes, floor_bytes)
        for name, (task, floor_bytes) in PEERS.items():
            measured, note = measure_peer(task, numel, repeats, threads)
            if note:
                notes.add(note)
            results[name] = (*measured, floor_bytes) if measured else (None, None, floor_bytes)
        fp32_ms = results["torch AdamW fused (fp32)"][0]
        for name, (ms, state_bytes, floor_bytes) in results.items():
            floor_ms = floor_bytes * numel / bandwidth * 1000
            rows.append([f"{numel / 1e6:.0f}M", name] + (
                ["n/a"] * 4 if ms is None else
                [f"{ms:.1f}", f"{state_bytes:.2f}", f"{floor_ms:.1f} ({floor_ms / ms:.0%})",
                 f"{ms / fp32_ms:.2f}x"]))
            print(rows[-1], flush=True)
    table = markdown_table(["params", "optimizer", "step ms", "state B/param",
                            "floor ms (share reached)", "÷ torch fused AdamW"], rows)
    body = (f"## Quantised optimizer states (benchmarks/quantization.py)\n\n"
            f"{machine_description()}; one flat fp32 tensor, lr 1e-3, weight decay 0.01, "
            f"{threads} threads; median ms per step. Floors: 16 B/param moved by an 8-bit step, "
            f"28 B/param by an fp32 one (4-bit: 14), at the copy bandwidth measured in the same "
            f"run. Peers run in their own venv with the same thread count.\n\n" + table + "\n")
    if notes:
        body += "\n" + "\n".join(f"- {note}" for note in sorted(notes)) + "\n"
    print(body)
    if args.write_docs:
        update_docs_section("quantization", body)


if __name__ == "__main__":
    main()
