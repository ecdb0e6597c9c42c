"""Offload capacity: the largest model that trains a step within a resident-memory budget, for
no ZeRO, ZeRO stage 3, and stage 3 with the optimizer and the parameters offloaded to NVMe
swap files (ZeRO-Infinity); also ZeRO-2 + NVMe optimizer offload for comparison.

    .venv/bin/python benchmarks/offload_capacity.py [--quick] [--budget-mib 1024]
    .venv/bin/python benchmarks/offload_capacity.py --eight-bit   # AdamW vs Adam8bit states

Each (config, size) runs in a fresh process: a GPT-2-like stack of `--width` MLP blocks
(Linear h->4h, GELU, Linear 4h->h, fp32, AdamW) of the given parameter count, 3 training
steps. The process reports VmHWM (peak RSS, /proc/self/status) and the median step time. For
every config the sizes double until the peak RSS passes the budget: the table lists every
run, and the summary the largest size that stayed within the budget. fp32 model states are
16 bytes/param (weights, grads, Adam moments). Stage 3 builds under zero.Init (a rank never
holds the whole model); with NVMe, parameter shards, fp32 masters and moments live in files
under data/ and only the fp32 partition gradient (4 bytes/param) and the gathered layer stay.
--eight-bit compares AdamW with Adam8bit (8-bit moments: 10 bytes/param of model states) with
no ZeRO and with ZeRO-2 + CPU optimizer offload (its own docs section).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import machine_description, markdown_table, update_docs_section  # noqa

MODES = ("no ZeRO", "ZeRO-2 + nvme optimizer", "ZeRO-3", "ZeRO-3 + nvme optimizer + params")
EIGHT_BIT_MODES = ("no ZeRO", "no ZeRO, Adam8bit", "ZeRO-2 + cpu optimizer",
                   "ZeRO-2 + cpu optimizer, Adam8bit")
ADAM8BIT = ", Adam8bit"


def _state_bytes_per_param(mode):
    """Weights, gradients and optimizer state (+ the 8-bit block scales)."""
    return 4 + 4 + (2 + 8 / 256 if mode.endswith(ADAM8BIT) else 8)


def _block(torch, width):
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                               torch.nn.Linear(4 * width, width))


def _config(mode, nvme_path):
    zero_section = {"stage": 0}
    if mode.startswith("ZeRO-2 + nvme"):
        zero_section = {"stage": 2, "reduce_bucket_size": 2_000_000, "sub_group_size": 4_000_000,
                        "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path,
                                              "pipeline_read": True, "pipeline_write": True}}
    if mode.startswith("ZeRO-2 + cpu"):
        zero_section = {"stage": 2, "reduce_bucket_size": 2_000_000,
                        "offload_optimizer": {"device": "cpu"}}
    if mode.startswith("ZeRO-3"):
        zero_section = {"stage": 3, "reduce_bucket_size": 2_000_000,
                        "stage3_prefetch_bucket_size": 4_000_000,
                        "stage3_max_live_parameters": 20_000_000,
                        "stage3_param_persistence_threshold": 10_000}
    if mode == "ZeRO-3 + nvme optimizer + params":
        zero_section.update(sub_group_size=4_000_000, offload_optimizer={
            "device": "nvme", "nvme_path": nvme_path, "pipeline_read": True,
            "pipeline_write": True, "buffer_count": 2},
            offload_param={"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0,
                           "buffer_count": 4})
    optimizer = "Adam8bit" if mode.endswith(ADAM8BIT) else "AdamW"
    return {"train_batch_size": 4, "zero_optimization": zero_section,
            "optimizer": {"type": optimizer, "params": {"lr": 1e-4}}}


def child(mode, params, width, nvme_path):
    import torch
    import zero
    torch.set_num_threads(2)
    blocks = max(1, round(params / (8 * width * width)))
    config = _config(mode, nvme_path)
    with zero.Init(config_dict_or_path=config, enabled=mode.startswith("ZeRO-3"),
                   remote_device="nvme" if "params" in mode else None):
        model = torch.nn.Sequential(*[_block(torch, width) for _ in range(blocks)])
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = zero.initialize(model=model, config=config)
    x = torch.randn(4, 64, width)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024
    engine.destroy()
    print(json.dumps({"params": n, "hwm": hwm, "step_s": sorted(times)[1]}))


def _run(mode, params, width, nvme):
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(params), str(width),
                          nvme], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} at {params:.0f} params failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=float, default=1024)
    parser.add_argument("--start-params", type=float, default=25e6)
    parser.add_argument("--max-params", type=float, default=200e6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--quick", action="store_true",
                        help="budget 768 MiB, sizes 12.5M..100M (several minutes)")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    parser.add_argument("--eight-bit", action="store_true",
                        help="AdamW vs Adam8bit, no ZeRO and ZeRO-2 + CPU optimizer offload")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, params, width, nvme = args.child
        return child(mode, float(params), int(width), nvme)
    if args.quick:
        args.budget_mib, args.start_params, args.max_params = 768, 12.5e6, 100e6
    budget = args.budget_mib * 2**20
    modes = EIGHT_BIT_MODES if args.eight_bit else MODES
    rows, largest = [], {}
    os.makedirs(os.path.join(ROOT, "data"), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "data")) as nvme:
        for mode in modes:
            params = args.start_params
            while params <= args.max_params:
                r = _run(mode, params, args.width, nvme)
                fits = r["hwm"] <= budget
                rows.append([mode, f"{r['params'] / 1e6:.1f}M",
                             f"{_state_bytes_per_param(mode) * r['params'] / 2**20:.0f}",
                             f"{r['hwm'] / 2**20:.0f}",
                             "yes" if fits else "no", f"{r['step_s'] * 1000:.0f}"])
                print(rows[-1], flush=True)
                if not fits:
                    break
                largest[mode] = r["params"]
                params *= 2
    summary = []
    for mode in modes:
        states = _state_bytes_per_param(mode) * largest.get(mode, 0)
        summary.append([mode, f"{largest[mode] / 1e6:.1f}M" if mode in largest else "none",
                        f"{_state_bytes_per_param(mode):.2f}", f"{states / 2**20:.0f}",
                        f"{states / budget:.2f}"])
    title = ("## 8-bit optimizer states: largest model within a memory budget "
             "(benchmarks/offload_capacity.py --eight-bit)" if args.eight_bit else
             "## Offload capacity: largest model within a memory budget "
             "(benchmarks/offload_capacity.py)")
    body = (f"{title}\n\n"
            f"{machine_description()}; one process, fp32, stacks of MLP blocks "
            f"(h={args.width}, h->4h->h), batch 4 x 64 tokens; budget {args.budget_mib:.0f} MiB "
            "of peak RSS (VmHWM); sizes double until the peak passes the budget (so the largest "
            "size is within a factor 2). NVMe = files under data/ on this machine's disk. "
            "Model states = weights + gradients + optimizer state (AdamW 16 B/param, Adam8bit "
            "10.03). Measured on a shared 2-core machine: step times are noisy.\n\n"
            + markdown_table(["config", "largest params within budget",
                              "model states B/param", "its model states MiB",
                              "model states / budget"], summary)
            + "\n\nEvery run:\n\n"
            + markdown_table(["config", "params", "model states MiB", "peak RSS MiB",
                              "within budget", "step ms"], rows) + "\n")
    print(body)
    if args.write_docs:
        update_docs_section("offload_capacity_8bit" if args.eight_bit else "offload_capacity",
                            body)


if __name__ == "__main__":
    main()
