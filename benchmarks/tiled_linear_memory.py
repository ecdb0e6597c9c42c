"""Peak working memory of a tiled vs an untiled MLP (h -> 4h -> h), with and without ZeRO-3.

Question: does `zero.TiledLinear` (memory-centric tiling, ZeRO-Infinity) shrink the memory a
layer needs while it runs?  The layer is GPT-2's MLP, tiled as --tile-factor F tiles it:
h->4h as F x 4F tiles, 4h->h as 4F x F.  F=1 is the untiled layer (plain torch.nn.Linear).

* ZeRO stage 3 (2 gloo ranks, fp32, prefetch off, persistence threshold 0 so no tile stays
  gathered): the engine gathers each submodule's parameters in its forward/backward hooks.
  "gathered peak" is the most parameter bytes held gathered at once on a rank, counted
  exactly by wrapping the stage-3 gather/release functions; it also reports the rank's peak
  RSS growth over one training step and the step time.
* No ZeRO (1 process): every weight is resident anyway; what tiling changes is the
  activation/temporary working set of forward + backward (per-tile partial outputs, the sum
  and the concatenation).  Peak RSS growth over one step, and the step time.

Every configuration runs in a fresh process so that ru_maxrss is its own.  Run:

    python benchmarks/tiled_linear_memory.py            # hidden 1024, tokens 2048
    python benchmarks/tiled_linear_memory.py --quick    # hidden 256, tokens 512
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_description, markdown_table, update_docs_section  # noqa

MB = 2 ** 20
TILE_FACTORS = (1, 2, 4)


def build_mlp(hidden, tile_factor):
    import zero
    torch.manual_seed(0)
    if tile_factor == 1:
        first, second = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
    else:
        f = tile_factor
        first = zero.TiledLinear(hidden, 4 * hidden, in_splits=f, out_splits=4 * f)
        second = zero.TiledLinear(4 * hidden, hidden, in_splits=4 * f, out_splits=f)
    return nn.Sequential(first, nn.GELU(approximate="tanh"), second)


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


class GatheredBytes:
    """Parameter bytes currently gathered by stage 3, and the peak, via the gather/release
    functions the coordinator and GatheredParameters call."""

    def __init__(self):
        import zero.stages.partition_parameters as pp
        import zero.stages.param_coordinator as coordinator
        self.now = self.peak = 0
        self.held = set()
        start, release = pp.start_gather, pp.release_param

        def counting_start(param):
            result = start(param)
            if id(param) not in self.held:
                self.held.add(id(param))
                self.now += param.ds_numel * param.element_size()
                self.peak = max(self.peak, self.now)
            return result

        def counting_release(param):
            if id(param) in self.held:
                self.held.discard(id(param))
                self.now -= param.ds_numel * param.element_size()
            return release(param)

        for module in (pp, coordinator):
            module.start_gather, module.release_param = counting_start, counting_release


def _step_once(step, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run_plain(hidden, tokens, tile_factor, repeats):
    torch.set_num_threads(1)
    model = build_mlp(hidden, tile_factor)
    x = torch.randn(tokens, hidden)

    def step():
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
    base = _rss_mb()
    step()  # the first step's peak: what this configuration needs
    peak = _peak_rss_mb() - base
    return dict(peak_rss_growth_mb=peak, step_s=_step_once(step, repeats))


def run_stage3_rank(hidden, tokens, tile_factor, repeats):
    import torch.distributed as dist
    import zero
    torch.set_num_threads(1)
    counter = GatheredBytes()
    model = build_mlp(hidden, tile_factor)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0,
                                    "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0,
                                    "reduce_bucket_size": 5_000_000}}
    engine, _, _, _ = zero.initialize(model=model, config=config)
    del model
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():  # forward alone: what inference gathers
        engine(x)
    result = dict(forward_gathered_peak_mb=counter.peak / MB)
    counter.peak = counter.now

    def step():
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    base = _rss_mb()
    try:
        step()
        result.update(gathered_peak_mb=counter.peak / MB, peak_rss_growth_mb=_peak_rss_mb() - base,
                      step_s=_step_once(step, repeats))
    except RuntimeError as error:  # report, so the table says what is missing and why
        result["step_error"] = str(error).splitlines()[0][:160]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


def _child(mode, hidden, tokens, tile_factor, repeats):
    """Run one configuration in a fresh interpreter; returns its JSON result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    command = [sys.executable, os.path.abspath(__file__), "--child", mode, "--hidden",
               str(hidden), "--tokens", str(tokens), "--tile-factor", str(tile_factor),
               "--repeats", str(repeats)]
    if mode == "stage3":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2"] + command[1:]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} F={tile_factor} failed:\n{out.stdout[-2000:]}"
                           f"{out.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])


def child_main(args):
    if args.child == "plain":
        print("RESULT " + json.dumps(run_plain(args.hidden, args.tokens, args.tile_factor,
                                               args.repeats)), flush=True)
        return
    results = run_stage3_rank(args.hidden, args.tokens, args.tile_factor, args.repeats)
    if int(os.environ.get("RANK", "0")) == 0:
        worst = {key: (max(r[key] for r in results) if key != "step_error" else value)
                 for key, value in results[0].items()}
        print("RESULT " + json.dumps(worst), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="hidden 256, 512 tokens")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tile-factor", type=int, default=1)
    parser.add_argument("--child", choices=["plain", "stage3"], default=None)
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args(argv)
    args.hidden = args.hidden or (256 if args.quick else 1024)
    args.tokens = args.tokens or (512 if args.quick else 2048)
    if args.child:
        return child_main(args)
    rows = []
    weights_mb = 2 * 4 * args.hidden * args.hidden * 4 / MB  # both matrices, fp32
    results = {}
    load_before = os.getloadavg()[0]
    for f in TILE_FACTORS:
        results[f] = (_child("stage3", args.hidden, args.tokens, f, args.repeats),
                      _child("plain", args.hidden, args.tokens, f, args.repeats))
        print(f"F={f}: stage3 {results[f][0]}, plain {results[f][1]}", flush=True)
    base3, base_plain = results[1]
    step_errors = sorted({z3["step_error"] for z3, _ in results.values() if "step_error" in z3})

    def ratio(value, base):
        return f"{value / base:.3f}" if base else "-"

    def z3_step(z3, key, fmt, scale=1.0):
        return fmt.format(z3[key] * scale) if key in z3 else "failed"
    for f, (z3, plain) in results.items():
        grid = "1 x 1 (nn.Linear)" if f == 1 else f"{f} x {4 * f}, {4 * f} x {f}"
        rows.append([
            f, grid,
            f"{z3['forward_gathered_peak_mb']:.3f}",
            ratio(z3["forward_gathered_peak_mb"], base3["forward_gathered_peak_mb"]),
            z3_step(z3, "gathered_peak_mb", "{:.3f}"),
            ratio(z3["gathered_peak_mb"], base3["gathered_peak_mb"])
            if "gathered_peak_mb" in z3 and "gathered_peak_mb" in base3 else "-",
            z3_step(z3, "peak_rss_growth_mb", "{:.0f}"),
            z3_step(z3, "step_s", "{:.0f}", 1e3),
            f"{plain['peak_rss_growth_mb']:.0f}",
            ratio(plain["peak_rss_growth_mb"], base_plain["peak_rss_growth_mb"]),
            f"{plain['step_s'] * 1e3:.0f}", ratio(plain["step_s"], base_plain["step_s"])])
    table = markdown_table(
        ["F", "tiles (h->4h, 4h->h)", "ZeRO-3 forward gathered peak MB", "ratio",
         "ZeRO-3 train-step gathered peak MB", "ratio", "ZeRO-3 step peak RSS growth MB",
         "ZeRO-3 step ms", "no-ZeRO step peak RSS growth MB", "ratio", "no-ZeRO step ms",
         "ratio"], rows)
    if step_errors:
        table += ("\n\nThe ZeRO-3 training step failed in this run (" + step_errors[0] +
                  "): only the forward pass is measured under stage 3.")
    body = (f"## Tiled vs untiled layer memory (benchmarks/tiled_linear_memory.py)\n\n"
            f"{machine_description()}\n\n"
            f"GPT-2 MLP h={args.hidden} (h->4h->h, {weights_mb:.0f} MB of fp32 weights), "
            f"{args.tokens} tokens, fp32, 1 thread per process; ZeRO stage 3 over 2 gloo "
            f"ranks with prefetch off, persistence threshold 0 and max reuse distance 0, so "
            f"no tile stays gathered (worst rank shown); "
            f"median step of {args.repeats} after the first.  Ratios are against F=1 "
            f"(untiled) in the same run.  1-minute load average {load_before:.1f} at the "
            f"start, {os.getloadavg()[0]:.1f} at the end (on 2 cores: above ~2 the times are "
            f"shared with other work; byte counts are not affected).\n\n{table}\n")
    print(body)
    if args.write_docs:
        update_docs_section("tiled-linear-memory", body)


if __name__ == "__main__":
    main()
