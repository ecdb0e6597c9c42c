"""Where one training step's time goes: torch.profiler over our trainer's step.

The model and step of benchmarks/train_throughput.py (6 layers, hidden 384, seq 256, micro
batch 8, AdamW), eager and with --compile, in fp32 and bf16. For each, the share of the step
by kind of work (matmuls, attention, compiled kernels, elementwise, copies, optimizer, ...)
and the top ops by self time. Compiled kernels are named by inductor after the ops they fuse.
It runs as the launch scripts start training (glibc's small-block cache off).

    python benchmarks/step_profile.py [--quick] [--write-docs]
"""

import argparse
import os
import sys

from common import machine_description, markdown_table, update_docs_section

from torch.profiler import ProfilerActivity, profile

import train_throughput

# kind of work -> op-name prefixes (first match wins; the rest is "other")
KINDS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention (SDPA)", ("aten::_scaled_dot_product",)),
    ("compiled kernels", ("graph_",)),
    ("copies and casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::fill_",
                          "aten::zero_", "aten::cat", "aten::stack")),
    ("optimizer and grad norm", ("aten::_fused_adamw", "aten::_foreach",
                                 "aten::linalg_vector_norm")),
    ("elementwise and reductions", ("aten::gelu", "aten::add", "aten::mul", "aten::sub",
                                    "aten::div", "aten::exp", "aten::amax", "aten::sum",
                                    "aten::native_layer_norm", "aten::masked_fill",
                                    "aten::gather", "aten::scatter", "aten::log",
                                    "aten::embedding")),
)


def kind_of(name):
    for kind, prefixes in KINDS:
        if name.startswith(prefixes):
            return kind
    return "other (host overhead, autograd, small ops)"


def profile_step(precision, compiled, warmup, steps):
    """{op name: self ms per step}, and the measured ms per step with the profiler on."""
    step = train_throughput.ours_runner(precision, compiled, dropout=0.0)
    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {event.key: event.self_cpu_time_total / 1000.0 / steps
            for event in prof.key_averages()}


def tables(label, op_ms, top):
    total = sum(op_ms.values())
    by_kind = {}
    for name, ms in op_ms.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + ms
    kinds = markdown_table(["kind of work", "ms/step", "share"],
                           [[kind, f"{ms:.1f}", f"{100 * ms / total:.1f}%"]
                            for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])])
    ops = markdown_table(["op (self time)", "ms/step", "share"],
                         [[_short(name), f"{ms:.1f}", f"{100 * ms / total:.1f}%"]
                          for name, ms in sorted(op_ms.items(), key=lambda kv: -kv[1])[:top]])
    return f"### {label}: {total:.0f} ms of op time per step\n\n{kinds}\n\n{ops}\n"


def _short(name):
    name = name.replace("## Call CompiledFxGraph", "call of a compiled graph").split(" ##")[0]
    return name if len(name) <= 70 else name[:67] + "..."


def _as_the_launch_scripts_start_training():
    """Re-run this process with glibc's small-block cache off, as scripts/launch_env.sh starts
    training (the engine's host-memory policy depends on it: zero/host_memory.py)."""
    from zero.host_memory import is_glibc, small_block_cache_off, small_block_cache_off_environ
    if is_glibc() and not small_block_cache_off():
        os.execve(sys.executable, [sys.executable] + sys.argv, small_block_cache_off_environ())


def main():
    _as_the_launch_scripts_start_training()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one step, for a smoke test")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    parser.add_argument("--top", type=int, default=10, help="ops listed per configuration")
    args = parser.parse_args()
    # inductor then records each compiled kernel under its own name
    import torch._inductor.config
    torch._inductor.config.cpp.enable_kernel_profile = True
    warmup, steps = (2, 1) if args.quick else (4, 5)
    sections = []
    for precision in ("bf16", "fp32"):
        for compiled in (False, True):
            label = f"{precision}, {'--compile' if compiled else 'eager'}"
            sections.append(tables(label, profile_step(precision, compiled, warmup, steps),
                                   args.top))
            print(sections[-1], flush=True)
    c = train_throughput.CONFIG
    body = (f"## Where a training step's time goes (`benchmarks/step_profile.py`)\n\n"
            f"Machine: {machine_description()}.\n\n"
            f"torch.profiler over {steps} steps of our trainer (after {warmup} warm-up steps) "
            f"on the model of the training-throughput table ({c['num_layers']} layers, hidden "
            f"{c['hidden_size']}, seq {c['seq_length']}, micro batch {c['micro_batch']}, vocab "
            f"{c['vocab_size']}, AdamW), self time per op per step; the profiler adds a few "
            f"percent of its own. Compiled kernels (`graph_*_cpp_fused_...`) are named after "
            f"the ops inductor fused into them.\n\n" + "\n".join(sections))
    if args.write_docs and not args.quick:
        update_docs_section("step_profile", body)


if __name__ == "__main__":
    main()
