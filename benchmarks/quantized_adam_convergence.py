"""Convergence of --optimizer adam8bit and adam4bit against adam: the default training run
(scripts/pretrain_gpt2.sh: 6 layers, hidden 384, the default corpus) with each optimizer,
in one process and under ZeRO-2 at DP=2 (scripts/pretrain_gpt2_distributed.sh, 2 processes,
micro batch 4: the same global batch of 8).

    .venv/bin/python benchmarks/quantized_adam_convergence.py               # 300 iterations
    .venv/bin/python benchmarks/quantized_adam_convergence.py --iters 1000  # slow (~1.5 h)

Each run trains from scratch into its own folder under a temporary directory; the table gives
the last validation loss, the change against adam in the same layout, and the mean time per
iteration over the logged intervals after the first (the first holds the compile and the
data-index build).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import REPO_ROOT, machine_description, markdown_table, update_docs_section  # noqa: E402

LAYOUTS = {
    "1 process": ("scripts/pretrain_gpt2.sh", []),
    "ZeRO-2 DP=2": ("scripts/pretrain_gpt2_distributed.sh", ["--deepspeed"]),
}
OPTIMIZERS = ("adam", "adam8bit", "adam4bit")
ZERO2_DP2 = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def train(script, extra, optimizer, iters, precision, folder):
    env = dict(os.environ, PRECISION=precision, TRAIN_ITERS=str(iters),
               CHECKPOINT_DIR=os.path.join(folder, "checkpoint"),
               RUN_DIR=os.path.join(folder, "run"))
    out = subprocess.run(["bash", os.path.join(REPO_ROOT, script), *extra, "--optimizer",
                          optimizer], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{script} --optimizer {optimizer} failed:\n{out.stderr[-3000:]}")
    losses = VALIDATION.findall(out.stdout)
    times = [float(ms) for ms in ITERATION_MS.findall(out.stdout)]
    if not losses or not times:
        raise RuntimeError(f"{script} printed no validation loss or iteration time: give "
                           "--iters of at least 100 (the scripts evaluate every 100)")
    times = times[1:] or times
    return float(losses[-1][1]), sum(times) / len(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="PRECISION of the scripts (default fp32: the fast path on CPUs "
                             "without AMX)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help="comma-separated; adam, the reference, always runs")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        config = os.path.join(root, "zero2_dp2.json")
        with open(config, "w") as f:
            json.dump(ZERO2_DP2, f)
        for layout in args.layouts.split(","):
            script, extra = LAYOUTS[layout]
            if extra:
                extra = extra + ["--deepspeed_config", config]
            results = {}
            for optimizer in ["adam"] + [o for o in args.optimizers.split(",") if o != "adam"]:
                folder = os.path.join(root, f"{layout}-{optimizer}".replace(" ", "_"))
                results[optimizer] = train(script, extra, optimizer, args.iters,
                                           args.precision, folder)
                print(layout, optimizer, results[optimizer], flush=True)
            base_loss, base_ms = results["adam"]
            for optimizer, (loss, ms) in results.items():
                rows.append([layout, optimizer, f"{loss:.4f}",
                             f"{100 * (loss / base_loss - 1):+.2f}%", f"{ms:.0f}",
                             f"{ms / base_ms:.2f}x"])
    body = "\n".join([
        "## Quantised Adam convergence (benchmarks/quantized_adam_convergence.py)",
        "",
        f"{machine_description()}. The default run (scripts/pretrain_gpt2.sh sizes: 6 layers, "
        f"hidden 384, seq 256, global batch 8) for {args.iters} iterations, "
        f"PRECISION={args.precision}, trained from scratch with each optimizer; validation "
        "loss at the end. ZeRO-2 DP=2 is 2 processes of 1 thread each on this 2-core box, "
        "micro batch 4.",
        "",
        markdown_table(["layout", "optimizer", "validation loss", "vs adam", "ms/iteration",
                        "time vs adam"], rows),
    ])
    print(body)
    if args.write_docs:
        update_docs_section(f"quantized_adam_convergence_{args.iters}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
