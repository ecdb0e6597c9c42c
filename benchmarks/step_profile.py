"""Where one training step's time goes: torch.profiler over our trainer's step.

The model and step of benchmarks/train_throughput.py (6 layers, hidden 384, seq 256, micro
batch 8, AdamW), eager and with --compile, in fp32 and bf16. For each, the share of the step
by kind of work (matmuls, attention, compiled kernels, elementwise, copies, optimizer, ...)
and the top ops by self time. Compiled kernels are named by inductor after the ops they fuse.
It runs as the launch scripts start training (glibc's small-block cache off).

    python benchmarks/step_profile.py [--quick] [--write-docs]
    python benchmarks/step_profile.py --device cuda --size gpt2-124m --precisions bf16
    python benchmarks/step_profile.py --quick --trace-dir /tmp/traces   # timelines to read

On a GPU the tables are of GPU kernel time, beside the step's wall time (the rest is the GPU
waiting for the host), and one line counts the host's waits for the GPU (synchronizations).
"""

import argparse
import os
import sys
import time

from common import machine_description, markdown_table, update_docs_section

from torch.autograd import DeviceType
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


# GPU kernels: kind of work -> substrings of the kernel's name (first match wins)
CUDA_KINDS = (
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("attention (SDPA)", ("flash", "fmha", "attention")),
    ("compiled kernels", ("triton_",)),
    ("copies and casts", ("memcpy", "memset", "copy", "fill")),
    ("optimizer and grad norm", ("adam", "multi_tensor", "foreach", "norm_kernel")),
)
# host calls that wait for the GPU
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "aten::_local_scalar_dense")


def kind_of(name, device_type="cpu"):
    if device_type == "cuda":
        lowered = name.lower()
        for kind, parts in CUDA_KINDS:
            if any(part in lowered for part in parts):
                return kind
        return "elementwise and reductions"
    for kind, prefixes in KINDS:
        if name.startswith(prefixes):
            return kind
    return "other (host overhead, autograd, small ops)"


def profile_step(c, device, precision, compiled, warmup, steps, trace=None):
    """({op or GPU kernel name: self ms per step}, {host wait name: (calls, ms) per step},
    wall ms per step without the profiler); with `trace` (a path), the profiled steps' Chrome
    trace is written there."""
    step = train_throughput.ours_runner(c, device, precision, compiled, dropout=0.0)
    for _ in range(warmup):
        step()
    if device.type == "cpu":
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        _export(prof, trace)
        return ({e.key: e.self_cpu_time_total / 1000.0 / steps for e in prof.key_averages()},
                {}, None)
    from megatron.runtime.device import synchronize
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1000 / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    _export(prof, trace)
    events = prof.key_averages()
    # a record_function range (Optimizer.step#AdamW.step) shows on the GPU's timeline too,
    # spanning the kernels it launched: not GPU work of its own
    kernels = {e.key: e.self_device_time_total / 1000.0 / steps for e in events
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation",
                                                                   False)}
    waits = {e.key: (e.count / steps, e.cpu_time_total / 1000.0 / steps) for e in events
             if e.key in SYNCS}
    return kernels, waits, wall_ms


def _export(prof, trace):
    if trace is not None:
        prof.export_chrome_trace(trace)
        print(f"wrote {trace} (open it in chrome://tracing or https://ui.perfetto.dev)")


def tables(label, profiled, top, device_type):
    op_ms, waits, wall_ms = profiled
    total = sum(op_ms.values())
    by_kind = {}
    for name, ms in op_ms.items():
        kind = kind_of(name, device_type)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    kinds = markdown_table(["kind of work", "ms/step", "share"],
                           [[kind, f"{ms:.1f}", f"{100 * ms / total:.1f}%"]
                            for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])])
    what = "GPU kernel" if device_type == "cuda" else "op (self time)"
    ops = markdown_table([what, "ms/step", "share"],
                         [[_short(name), f"{ms:.{2 if device_type == 'cuda' else 1}f}",
                           f"{100 * ms / total:.1f}%"]
                          for name, ms in sorted(op_ms.items(), key=lambda kv: -kv[1])[:top]])
    if device_type != "cuda":
        return f"### {label}: {total:.0f} ms of op time per step\n\n{kinds}\n\n{ops}\n"
    waited = "; ".join(f"{name} {calls:g}x, {ms:.2f} ms" for name, (calls, ms) in waits.items())
    return (f"### {label}: {wall_ms:.1f} ms per step, the GPU busy {total:.1f} ms of it "
            f"({100 * total / wall_ms:.0f}%)\n\nHost waits for the GPU per step: "
            f"{waited or 'none'}.\n\n{kinds}\n\n{ops}\n")


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
    parser.add_argument("--trace-dir", default=None,
                        help="also write each configuration's Chrome trace (the profiled "
                             "steps' timeline) into this folder")
    train_throughput.add_model_arguments(parser)
    args = parser.parse_args()
    device, c, precisions = train_throughput.model_arguments(parser, args)
    # inductor then records each compiled kernel under its own name
    import torch._inductor.config as inductor_config
    inductor_config.cpp.enable_kernel_profile = True
    warmup, steps = (2, 1) if args.quick else (4, 5)
    sections = []
    for precision in sorted(precisions):  # bf16 first, as the docs tables are
        for compiled in (False, True):
            label = f"{precision}, {'--compile' if compiled else 'eager'}"
            trace = None
            if args.trace_dir is not None:
                os.makedirs(args.trace_dir, exist_ok=True)
                trace = os.path.join(args.trace_dir, f"{device.type}_{precision}_"
                                     f"{'compiled' if compiled else 'eager'}.json")
            profiled = profile_step(c, device, precision, compiled, warmup, steps, trace)
            sections.append(tables(label, profiled, args.top, device.type))
            print(sections[-1], flush=True)
    on_gpu = device.type == "cuda"
    flags = " --device cuda" if on_gpu else ""
    flags += f" --size {args.size}" if args.size is not None else ""
    what = ("GPU kernel time per step, beside the step's wall time measured without the "
            "profiler; compiled kernels are inductor's `triton_...`" if on_gpu else
            "self time per op per step; the profiler adds a few percent of its own. Compiled "
            "kernels (`graph_*_cpp_fused_...`) are named after the ops inductor fused into them")
    body = (f"## Where a training step's time goes{', GPU' if on_gpu else ''} "
            f"(`benchmarks/step_profile.py{flags}`)\n\n"
            f"Machine: {machine_description()}.\n\n"
            f"torch.profiler over {steps} steps of our trainer (after {warmup} warm-up steps) "
            f"on the model of the training-throughput table ({c['num_layers']} layers, hidden "
            f"{c['hidden_size']}, seq {c['seq_length']}, micro batch {c['micro_batch']}, vocab "
            f"{c['vocab_size']}, AdamW), {what}.\n\n" + "\n".join(sections))
    if args.write_docs and not args.quick:
        update_docs_section("step_profile_cuda" if on_gpu else "step_profile", body)


if __name__ == "__main__":
    main()
