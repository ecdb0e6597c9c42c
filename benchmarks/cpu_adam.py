"""CPU Adam step time: zero.ops.CPUAdam vs torch.optim.AdamW (foreach, fused) vs DeepSpeedCPUAdam,
on one flat fp32 parameter of 10M and 100M elements, beside the memory-bandwidth floor.

    .venv/bin/python benchmarks/cpu_adam.py            # 10M and 100M (~2.5 GB of RAM)
    .venv/bin/python benchmarks/cpu_adam.py --quick    # 10M only

The floor: an Adam step reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg,
exp_avg_sq: 28 bytes per element; floor = 28 * N / (measured copy bandwidth), the bandwidth
taken from a large tensor copy (read + write) in the same run. DeepSpeedCPUAdam runs in the
DeepSpeed venv (benchmarks/install_deepspeed_venv.sh; compiles its op on first use) with the
same thread count; skipped with a note when that venv is absent. Medians after warm-up.
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
from benchmarks.deepspeed_venv import deepspeed_env, deepspeed_python  # noqa: E402
from zero.ops import CPUAdam  # noqa: E402

BYTES_PER_PARAM = 28


def time_optimizer(factory, numel, repeats):
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    optimizer = factory([param])
    return median_seconds(optimizer.step, warmup=2, repeats=repeats)


def deepspeed_ms(numel, threads):
    python = deepspeed_python()
    if python is None:
        return None, "no DeepSpeed venv (run benchmarks/install_deepspeed_venv.sh)"
    task = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_adam_ds_task.py")
    env = deepspeed_env({"OMP_NUM_THREADS": str(threads)})
    try:
        run = subprocess.run([python, task, str(numel), str(threads)], capture_output=True,
                             text=True, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        return None, "DeepSpeedCPUAdam timed out"
    match = re.search(r"RESULT ([0-9.]+)", run.stdout)
    if run.returncode != 0 or not match:
        return None, f"DeepSpeedCPUAdam failed: {(run.stderr or run.stdout).strip()[-300:]}"
    return float(match.group(1)), None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10M parameters only")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args()
    sizes = [10_000_000] if args.quick else [10_000_000, 100_000_000]
    threads = torch.get_num_threads()
    peers = {
        "zero.ops.CPUAdam": lambda p: CPUAdam(p, lr=1e-3, weight_decay=0.01),
        "torch AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01,
                                                           foreach=True),
        "torch AdamW fused": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01,
                                                         fused=True),
    }
    rows, notes = [], []
    for numel in sizes:
        repeats = 9 if numel <= 10_000_000 else 5
        bandwidth = copy_bandwidth(numel)
        floor_ms = BYTES_PER_PARAM * numel / bandwidth * 1000
        results = {name: time_optimizer(f, numel, repeats) * 1000 for name, f in peers.items()}
        ds, note = deepspeed_ms(numel, threads)
        if note:
            notes.append(note)
        ours = results["zero.ops.CPUAdam"]
        cells = [f"{numel / 1e6:.0f}M", f"{ours:.1f}"]
        for name in ("torch AdamW foreach", "torch AdamW fused"):
            cells.append(f"{results[name]:.1f} ({results[name] / ours:.2f}x)")
        cells.append(f"{ds:.1f} ({ds / ours:.2f}x)" if ds is not None else "n/a")
        cells.append(f"{floor_ms:.1f} ({bandwidth / 1e9:.1f} GB/s; ours at "
                     f"{floor_ms / ours:.0%} of it)")
        rows.append(cells)
        print(cells, flush=True)
    table = markdown_table(["params", "CPUAdam ms", "AdamW foreach ms (÷ ours)",
                            "AdamW fused ms (÷ ours)", "DeepSpeedCPUAdam ms (÷ ours)",
                            "28 B/param floor ms"], rows)
    body = (f"## CPU Adam (benchmarks/cpu_adam.py)\n\n{machine_description()}; one flat fp32 "
            f"tensor, lr 1e-3, weight decay 0.01, {threads} threads for every optimizer; median "
            "ms per step. Ratios > 1 mean the peer is slower than ours.\n\n" + table + "\n")
    if notes:
        body += "\n" + "\n".join(f"- {n}" for n in sorted(set(notes))) + "\n"
    print(body)
    if args.write_docs:
        update_docs_section("cpu_adam", body)


if __name__ == "__main__":
    main()
