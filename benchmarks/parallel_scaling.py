"""Tensor- and data-parallel scaling on this machine: tokens/s, time split, bytes on the wire.

One GPT-2 model and one global batch, trained with the trainer's own step (the backend
pretrain() builds) in several layouts (gloo, one torch thread per process unless stated):

    TP=1 DP=1 (1 and 2 threads), TP=2 DP=1, TP=1 DP=2 with --DDP-impl local (25 MB buckets,
    and 2 MB buckets to overlap the all-reduce with backward) and torch, TP=1 DP=2 at ZeRO
    stage 2 (--deepspeed); TP=1 DP=1, TP=2, DP=2 and ZeRO-2 DP=2 again with --compile

For each layout: median ms per iteration and tokens/s after warm-up; the time split into
compute, tensor-parallel all-reduces (synchronous, timed around each call of an eager layer;
a compiled layer holds them in its graph) and the wait for
the data-parallel gradient all-reduce (local only: torch's DDP waits inside backward);
the bytes each rank sent per iteration, measured from the kernel's count of bytes the process
wrote (/proc/self/io `wchar`: gloo sends with writev on TCP sockets), against the analytic
ring all-reduce volume 2 (N - 1) / N x payload, with payloads from first principles:
    data parallel:   the gradients, numel x 4 bytes (fp32; in bf16 2 with torch's DDP and at
                     ZeRO stage 2, 4 with --DDP-impl local, whose stage 0 sums and all-reduces
                     bf16 gradients in fp32 as Megatron-LM does)
    tensor parallel: (4 L + 2) all-reduces of [b, s, h] activations (embedding, two per layer
                     forward and backward, the logits' input in backward; 4 bytes an element,
                     2 in bf16) + 3 of [b, s] (vocab-parallel cross entropy, fp32) per micro
                     batch (and one scalar for the gradient norm, left out).

    python benchmarks/parallel_scaling.py [--quick] [--bf16] [--write-docs]

--bf16 trains in bf16 (the fast path on CPUs with AMX) and runs only the layouts that have a
compiled twin, into a section of its own.
"""

import argparse
import base64
import json
import os
import statistics
import time

from common import machine_description, markdown_table, run_ranks, update_docs_section

import torch
import torch.distributed as dist

FULL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128,
            vocab_size=8192, global_batch=8, warmup=2, steps=6, rounds=2)
QUICK = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
             vocab_size=1024, global_batch=4, warmup=1, steps=3, rounds=1)

ZERO2 = ("--deepspeed",)  # with the config of _zero2_config
COMPILE = ("--compile",)
# (label, processes, tensor-parallel size, --DDP-impl, --ddp-bucket-size, threads per process,
#  more flags); under --deepspeed the JSON replaces --DDP-impl and --ddp-bucket-size
LAYOUTS = [("TP=1 DP=1", 1, 1, "local", 25.0, 1, ()),
           ("TP=1 DP=1, 2 threads", 1, 1, "local", 25.0, 2, ()),
           ("TP=2 DP=1", 2, 2, "local", 25.0, 1, ()),
           ("TP=1 DP=2, local DDP", 2, 1, "local", 25.0, 1, ()),
           ("TP=1 DP=2, local DDP, 2 MB buckets", 2, 1, "local", 2.0, 1, ()),
           ("TP=1 DP=2, torch DDP", 2, 1, "torch", 25.0, 1, ()),
           ("TP=1 DP=2, ZeRO-2", 2, 1, "local", 25.0, 1, ZERO2),
           ("TP=1 DP=1, --compile", 1, 1, "local", 25.0, 1, COMPILE),
           ("TP=2 DP=1, --compile", 2, 2, "local", 25.0, 1, COMPILE),
           ("TP=1 DP=2, local DDP, --compile", 2, 1, "local", 25.0, 1, COMPILE),
           ("TP=1 DP=2, ZeRO-2, --compile", 2, 1, "local", 25.0, 1, ZERO2 + COMPILE)]


def _zero2_config(bf16):
    """The ZeRO-2 DeepSpeed config as base64 JSON (--deepspeed_config takes that too)."""
    config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
              "bf16": {"enabled": bf16}}
    return base64.urlsafe_b64encode(json.dumps(config).encode()).decode()


# the data-parallel gradient reduction: an all-reduce at stage 0, reduce(-scatter) at 1-2
GRADIENT_OPS = ("all_reduce", "reduce_scatter", "reduce")


def _bytes_written():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


class _TensorParallelTimer:
    """Wraps dist.all_reduce to time and count the synchronous tensor-parallel calls of eager
    layers. Compiled layers trace their all-reduces into the graph (dynamo turns them into
    functional collectives), where no Python wrapper runs, and a wrapper dynamo cannot trace
    would break the graph the user gets: those layouts are not wrapped (`active` False)."""

    def __init__(self, group, active):
        self.group, self.active = group, active
        self.seconds, self.payload_bytes = 0.0, 0
        if active:
            self._all_reduce = dist.all_reduce
            dist.all_reduce = self._timed  # mpu looks dist.all_reduce up at call time

    def _timed(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not (group is self.group and not async_op):
            return self._all_reduce(tensor, op=op, group=group, async_op=async_op)
        start = time.perf_counter()
        result = self._all_reduce(tensor, op=op, group=group, async_op=async_op)
        self.seconds += time.perf_counter() - start
        self.payload_bytes += tensor.numel() * tensor.element_size()
        return result

    def reset(self):
        self.seconds, self.payload_bytes = 0.0, 0


def _build(config, tp, impl, bucket_mb, extra, world_size):
    """The trainer's backend and a batch iterator, the way pretrain() builds them."""
    from common import trainer_backend
    from megatron import mpu
    c = config
    micro_batch = c["global_batch"] * tp // world_size
    flags = ["--num-layers", c["num_layers"], "--hidden-size", c["hidden_size"],
             "--num-attention-heads", c["num_attention_heads"], "--seq-length", c["seq_length"],
             "--batch-size", micro_batch, "--train-iters", 10 ** 6, "--lr", 1e-4,
             "--lr-decay-style", "constant", "--warmup-iters", 0, "--clip-grad", 1.0,
             "--attention-dropout", 0, "--hidden-dropout", 0, "--model-parallel-size", tp,
             "--threads", torch.get_num_threads(), *extra]
    if "--deepspeed" in extra:  # the precision and the reduction come from the config
        flags += ["--deepspeed_config", _zero2_config(c["bf16"])]
    else:
        flags += ["--DDP-impl", impl, "--ddp-bucket-size", bucket_mb] + \
            (["--bf16"] if c["bf16"] else [])
    backend, _ = trainer_backend([str(f) for f in flags], c["vocab_size"], world_size)
    generator = torch.Generator().manual_seed(mpu.get_data_parallel_rank())
    data = torch.randint(0, c["vocab_size"], (micro_batch, c["seq_length"] + 1),
                         generator=generator)
    batches = iter(lambda: {"text": data}, None)
    numel = sum(p.numel() for p in backend.module.parameters())
    return backend, batches, numel, micro_batch


def _worker(rank, world_size, layout, config, port, queue):
    _, _, tp, impl, bucket_mb, threads, extra = layout
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        queue.put((rank, _measure(tp, impl, bucket_mb, extra, config, world_size)))
    finally:
        from megatron.runtime.initialize import destroy
        destroy()


def _measure(tp, impl, bucket_mb, extra, config, world_size):
    from megatron import mpu
    from megatron.gpt2 import forward_step
    backend, batches, numel, micro_batch = _build(config, tp, impl, bucket_mb, extra,
                                                  world_size)
    dp_stats = backend.engine.optimizer.dp_comm.stats
    tp_timer = _TensorParallelTimer(mpu.get_model_parallel_group(),
                                    active=tp > 1 and "--compile" not in extra)
    records = []
    for step in range(config["warmup"] + config["steps"]):
        dp_stats.reset()
        tp_timer.reset()
        dist.barrier()
        written, cpu, start = _bytes_written(), time.process_time(), time.perf_counter()
        backend.train_step(forward_step, batches, backend.ctx.config.training.global_batch_size)
        seconds = time.perf_counter() - start
        if step >= config["warmup"]:
            dp_payload = sum(dp_stats.ops[op].payload_bytes for op in GRADIENT_OPS
                             if op in dp_stats.ops)
            records.append(dict(seconds=seconds, cpu=time.process_time() - cpu,
                                dp_wait=dp_stats.wait_seconds,
                                tp_seconds=tp_timer.seconds, sent=_bytes_written() - written,
                                dp_payload=dp_payload, tp_payload=tp_timer.payload_bytes))
    return dict(records=records, numel=numel, micro_batch=micro_batch,
                dp=mpu.get_data_parallel_world_size(), tp_timed=tp_timer.active or tp == 1)


def run_layout(layout, config, port):
    label, procs = layout[:2]
    return run_ranks(_worker, (procs, layout, config, port), procs, label)


def _ring(payload, n):
    return 2 * (n - 1) / n * payload if n > 1 else 0.0


def analytic_bytes(config, tp, dp, numel, micro_batch, fp32_gradient_sums):
    """(DP payload, TP payload, ring bytes each rank sends) per iteration."""
    c = config
    element = 2 if c["bf16"] else 4  # gradients and activations travel in the params' dtype
    activations = (4 * c["num_layers"] + 2) * micro_batch * c["seq_length"] * \
        c["hidden_size"] * element
    loss = 3 * micro_batch * c["seq_length"] * 4
    dp_payload = numel * (4 if fp32_gradient_sums else element) if dp > 1 else 0
    tp_payload = activations + loss if tp > 1 else 0
    return dp_payload, tp_payload, _ring(dp_payload, dp) + _ring(tp_payload, tp)


def summarize(layout, config, per_rank):
    """Medians over the measured steps of every round; bytes from the rank sending most."""
    label, procs, tp, impl, _, threads, _ = layout
    records = [r for rank in per_rank for r in rank["records"]]
    rank0 = per_rank[0]["records"]

    def med(key, rows=rank0):
        return statistics.median(r[key] for r in rows)
    info = per_rank[0]
    stage0_local = impl == "local" and "--deepspeed" not in layout[6]
    dp_payload, tp_payload, ring = analytic_bytes(config, tp, info["dp"], info["numel"],
                                                  info["micro_batch"], stage0_local)
    seconds = med("seconds")
    sent = max(med("sent", rank["records"]) for rank in per_rank)
    return dict(label=label, procs=procs, threads=threads, seconds=seconds, cpu=med("cpu"),
                tokens_per_s=config["global_batch"] * config["seq_length"] / seconds,
                compute=seconds - med("tp_seconds") - med("dp_wait"),
                tp_seconds=med("tp_seconds"), dp_wait=med("dp_wait"),
                dp_wait_known=impl == "local", tp_timed=info["tp_timed"], sent=sent,
                dp_counted=med("dp_payload", records), tp_counted=med("tp_payload", records),
                dp_payload=dp_payload, tp_payload=tp_payload, ring=ring)


def _mib(n):
    return f"{n / 2 ** 20:.2f}"


def table_rows(summaries):
    base = summaries[0]["tokens_per_s"]
    rows = []
    for s in summaries:
        ratio = f"{s['sent'] / s['ring']:.3f}" if s["ring"] else "-"
        rows.append([
            s["label"], f"{s['procs']} x {s['threads']}", f"{s['seconds'] * 1000:.0f}",
            f"{s['tokens_per_s']:,.0f}", f"{s['tokens_per_s'] / base:.2f}x",
            f"{s['cpu'] * 1000:.0f}",
            f"{s['compute'] * 1000:.0f}",
            f"{s['tp_seconds'] * 1000:.1f}" if s["tp_timed"] else "in graph",
            f"{s['dp_wait'] * 1000:.1f}" if s["dp_wait_known"] else "in backward",
            # torch DDP reduces in its own hooks: the engine counts nothing there
            f"{_mib(s['dp_counted']) if s['dp_wait_known'] else 'in DDP'} / "
            f"{_mib(s['dp_payload'])}",
            f"{_mib(s['tp_counted']) if s['tp_timed'] else 'in graph'} / "
            f"{_mib(s['tp_payload'])}",
            _mib(s["sent"]), _mib(s["ring"]), ratio])
    return rows


HEADERS = ["layout", "procs x threads", "ms/iter", "tokens/s", "vs TP=1 DP=1",
           "CPU ms/iter (rank 0)",
           "compute ms", "TP all-reduce ms", "DP wait ms", "DP payload MiB (counted / formula)",
           "TP payload MiB (counted / formula)", "sent MiB/rank (measured)",
           "ring analytic MiB", "measured / analytic"]


def main():
    from tests.dist_utils import free_port
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 training, the layouts with a compiled twin only")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args()
    config = dict(QUICK if args.quick else FULL, bf16=args.bf16)
    layouts = LAYOUTS
    if args.bf16:
        twins = {layout[0].replace(", --compile", "") for layout in LAYOUTS
                 if "--compile" in layout[0]}
        layouts = [layout for layout in LAYOUTS
                   if layout[0] in twins or "--compile" in layout[0]]
    load_before = os.getloadavg()[0]
    per_layout = {layout: None for layout in layouts}
    for _ in range(config["rounds"]):  # layouts take turns, so machine drift hits all alike
        for layout in layouts:
            ranks = run_layout(layout, config, free_port())
            if per_layout[layout] is None:
                per_layout[layout] = ranks
            else:
                for kept, new in zip(per_layout[layout], ranks):
                    kept["records"] += new["records"]
            print(f"  measured {layout[0]}", flush=True)
    summaries = [summarize(layout, config, ranks) for layout, ranks in per_layout.items()]
    table = markdown_table(HEADERS, table_rows(summaries))
    c = config
    precision = "bf16" if args.bf16 else "fp32"
    body = (f"## Tensor- and data-parallel scaling{', bf16' if args.bf16 else ''} "
            f"(`benchmarks/parallel_scaling.py{' --bf16' if args.bf16 else ''}`)\n\n"
            f"Machine: {machine_description()}; gloo over loopback TCP; 1-minute load "
            f"average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after the run "
            f"(the cores are shared: above ~2, other work competes with the processes).\n\n"
            f"Model: GPT-2, {c['num_layers']} layers, hidden {c['hidden_size']}, "
            f"{c['num_attention_heads']} heads, seq {c['seq_length']}, vocab {c['vocab_size']}, "
            f"{precision}, AdamW, clip 1.0; global batch {c['global_batch']} in every layout "
            f"({c['global_batch'] * c['seq_length']} tokens per iteration), the trainer's "
            f"training step. Medians of {c['steps'] * c['rounds']} steps "
            f"per layout after {c['warmup']} warm-up steps, layouts taking turns.\n\n"
            f"{table}\n\n"
            "CPU ms/iter: CPU time of rank 0's process (all its threads, gloo's included) "
            "per iteration; wall time above it means the process waited for a core. "
            "Compute = ms/iter - TP all-reduce - DP wait. TP all-reduces are synchronous (timed "
            "around each call on the tensor-parallel group); the DP wait is the time the zero "
            "engine blocks on its gradient reduction after backward (stage 0: all-reduces; "
            "ZeRO-2: each partition reduced to its owner), i.e. the part backward did not hide. "
            "--compile layouts compile each transformer layer as one graph, its TP "
            "all-reduces included (dynamo traces them as functional collectives), so at TP=2 "
            "they are neither timed nor counted ('in graph': their time is in the compute "
            "column, their bytes in the measured column). "
            "Payloads: counted by the engine's data-parallel "
            "`Communicator` (DP; its flat buckets include a little alignment padding) and a "
            "wrapper around `dist.all_reduce` (TP) "
            "against the formula in the script's docstring. Sent bytes are measured by the "
            "kernel (/proc/self/io wchar; gloo writes to TCP sockets); analytic = "
            "2 (N - 1) / N x payload per all-reduce (ring).\n")
    print("\n" + body)
    if args.write_docs and not args.quick:
        update_docs_section("parallel_scaling_bf16" if args.bf16 else "parallel_scaling", body)


if __name__ == "__main__":
    main()
