"""Pipeline parallelism on this machine: the bubble, and the schedule against its peers.

Two stages (two processes, one torch thread each, gloo over loopback), one GPT-2 model and
micro batches of the same size; for m = 1, 4, 8, 16 micro batches per step:

- ours, 1F1B: ms per step, and the measured bubble (the share of the schedule's span, the
  first forward to the last backward, a stage spends outside its forward and backward passes,
  mean over the stages: the figure the log line prints as "pipeline bubble") against the
  formula (P - 1) / (m + P - 1);
- ours, interleaved 1F1B with two model chunks a stage (m a multiple of P), against
  (P - 1) / (v m + P - 1);
- torch.distributed.pipelining's Schedule1F1B on a plain-PyTorch GPT of the same shapes
  (benchmarks/train_throughput.py's blocks; its output layer is untied, since a pipelining
  stage owns its parameters), AdamW;
- DeepSpeed's PipelineEngine (a PipelineModule of the same blocks, ZeRO stage 0, AdamW) in
  its own venv (benchmarks/install_deepspeed_venv.sh), when it exists;

and, at m = 8, tokens/s of the same global batch at PP = 2, TP = 2 and DP = 2.

    python benchmarks/pipeline.py [--quick] [--write-docs]
"""

import argparse
import json
import os
import statistics
import sys
import time

from common import machine_description, markdown_table, run_ranks, update_docs_section

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

FULL = dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128,
            micro_batch=4, vocab_size=1024, micro_batches=(1, 4, 8, 16), warmup=2, steps=5)
QUICK = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
             micro_batch=2, vocab_size=256, micro_batches=(1, 4), warmup=1, steps=2)
STAGES = 2


# ---------------------------------------------------------------- ours (the trainer's step)

def _ours(config, m, layout, port, rank):
    from common import trainer_backend
    from megatron import mpu
    from megatron.gpt2 import forward_step
    c = config
    world = 2
    flags = ["--num-layers", c["num_layers"], "--hidden-size", c["hidden_size"],
             "--num-attention-heads", c["num_attention_heads"], "--seq-length", c["seq_length"],
             "--train-iters", 10 ** 6, "--lr", 1e-4, "--lr-decay-style", "constant",
             "--warmup-iters", 0, "--clip-grad", 1.0, "--attention-dropout", 0,
             "--hidden-dropout", 0, "--threads", 1,
             "--global-batch-size", m * c["micro_batch"]]
    if layout == "tp":
        flags += ["--model-parallel-size", 2, "--batch-size", c["micro_batch"]]
    elif layout == "dp":
        flags += ["--batch-size", c["micro_batch"]]
    else:
        flags += ["--pipeline-model-parallel-size", STAGES, "--batch-size", c["micro_batch"]]
        if layout == "interleaved":
            flags += ["--num-layers-per-virtual-pipeline-stage",
                      c["num_layers"] // (2 * STAGES)]
    backend, _ = trainer_backend([str(f) for f in flags], c["vocab_size"], world)
    generator = torch.Generator().manual_seed(mpu.get_data_parallel_rank())
    data = torch.randint(0, c["vocab_size"], (c["micro_batch"], c["seq_length"] + 1),
                         generator=generator)
    batches = iter(lambda: {"text": data}, None)
    seconds, bubbles = [], []
    for step in range(c["warmup"] + c["steps"]):
        dist.barrier()
        start = time.perf_counter()
        backend.train_step(forward_step, batches, backend.ctx.config.training.global_batch_size)
        elapsed = time.perf_counter() - start
        bubble = backend.pipeline.bubble() if backend.pipeline is not None else None
        if step >= c["warmup"]:
            seconds.append(elapsed)
            bubbles.append(bubble)
    return dict(seconds=seconds, bubbles=bubbles)


# ------------------------------------------------- torch.distributed.pipelining's 1F1B

class _FirstStage(nn.Module):
    def __init__(self, c, blocks):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.wpe = nn.Embedding(c["seq_length"], c["hidden_size"])
        self.blocks = nn.ModuleList(blocks)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(nn.Module):
    def __init__(self, c, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(c["hidden_size"])
        self.head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _torch_pipelining(config, m, port, rank):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from train_throughput import PlainGPT, _Block
    c = config
    torch.manual_seed(0)
    blocks = [_Block(c["hidden_size"], c["num_attention_heads"]) for _ in range(c["num_layers"])]
    half = c["num_layers"] // 2
    module = _FirstStage(c, blocks[:half]) if rank == 0 else _LastStage(c, blocks[half:])
    module.apply(PlainGPT._init_weights)
    stage = PipelineStage(module, rank, STAGES, torch.device("cpu"))
    vocab = c["vocab_size"]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float().view(-1, vocab), labels.reshape(-1))

    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01,
                                  foreach=True)
    data = torch.randint(0, vocab, (m * c["micro_batch"], c["seq_length"] + 1),
                         generator=torch.Generator().manual_seed(0))
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    seconds = []
    for step in range(c["warmup"] + c["steps"]):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=labels)
        optimizer.step()
        if step >= c["warmup"]:
            seconds.append(time.perf_counter() - start)
    return dict(seconds=seconds)


# ------------------------------------------------------------------ process plumbing

def _worker(rank, runner, args, port, queue):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if runner == "torch":
            dist.init_process_group("gloo", rank=rank, world_size=2)
            queue.put((rank, _torch_pipelining(*args, port, rank)))
        else:
            queue.put((rank, _ours(*args, port, rank)))
    finally:
        if runner == "torch":
            dist.destroy_process_group()
        else:
            from megatron.runtime.initialize import destroy
            destroy()


def _run(runner, args):
    from tests.dist_utils import free_port
    return run_ranks(_worker, (runner, args, free_port()), 2, f"{runner} {args[1:]}")[0]


def _deepspeed(config, m):
    """DeepSpeed's PipelineEngine in its venv: median seconds per step, or None."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from deepspeed_venv import deepspeed_python, launch_ranks
    if deepspeed_python() is None:
        return None
    task = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_ds_task.py")
    outputs = launch_ranks(2, [task, json.dumps(dict(config, m=m, stages=STAGES))],
                           timeout=900)
    line = [text for text in outputs[0].splitlines() if text.startswith("{")][-1]
    return json.loads(line)["median_seconds"]


# ------------------------------------------------------------------------ the report

def _bubble_formula(m, chunks=1):
    return (STAGES - 1) / (chunks * m + STAGES - 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed peer")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args()
    c = QUICK if args.quick else FULL
    load_before = os.getloadavg()[0]
    rows = []
    for m in c["micro_batches"]:
        ours = _run("ours", (c, m, "1f1b"))
        interleaved = _run("ours", (c, m, "interleaved")) if m % STAGES == 0 else None
        # Schedule1F1B refuses fewer micro batches than stages
        peer = _run("torch", (c, m)) if m >= STAGES else None
        deepspeed = None if args.no_deepspeed else _deepspeed(c, m)
        ms = 1000 * statistics.median(ours["seconds"])
        row = [m, f"{_bubble_formula(m):.1%}", f"{statistics.median(ours['bubbles']):.1%}",
               f"{ms:.0f}"]
        if interleaved is not None:
            row += [f"{_bubble_formula(m, 2):.1%}",
                    f"{statistics.median(interleaved['bubbles']):.1%}",
                    f"{1000 * statistics.median(interleaved['seconds']):.0f}"]
        else:
            row += ["-", "-", "-"]
        if peer is not None:
            peer_ms = 1000 * statistics.median(peer["seconds"])
            row += [f"{peer_ms:.0f}", f"{peer_ms / ms:.2f}x"]
        else:
            row += ["refuses m < P", "-"]
        if deepspeed is not None:
            row += [f"{1000 * deepspeed:.0f}", f"{1000 * deepspeed / ms:.2f}x"]
        else:
            row += ["-", "-"]
        rows.append(row)
        print(f"  m={m}: {row}", flush=True)
    m = 8 if 8 in c["micro_batches"] else c["micro_batches"][-1]
    tokens = m * c["micro_batch"] * c["seq_length"]
    layout_rows = []
    for label, layout in (("PP=2 (1F1B)", "1f1b"), ("PP=2 (interleaved, 2 chunks)", "interleaved"),
                          ("TP=2", "tp"), ("DP=2", "dp")):
        seconds = statistics.median(_run("ours", (c, m, layout))["seconds"])
        layout_rows.append([label, f"{1000 * seconds:.0f}", f"{tokens / seconds:.0f}"])
        print(f"  {label}: {layout_rows[-1]}", flush=True)
    table = markdown_table(
        ["m", "1F1B formula", "1F1B measured", "ms/step", "interleaved formula",
         "interleaved measured", "ms/step", "torch.distributed.pipelining ms/step",
         "ours vs it", "DeepSpeed PipelineEngine ms/step", "ours vs it"], rows)
    layouts = markdown_table(["layout (2 processes)", "ms/step", "tokens/s"], layout_rows)
    body = (f"## Pipeline parallelism (`benchmarks/pipeline.py`)\n\n"
            f"Machine: {machine_description()}; 2 processes, 1 thread each, gloo over "
            f"loopback; 1-minute load average {load_before:.1f} before and "
            f"{os.getloadavg()[0]:.1f} after.\n\n"
            f"Model: GPT-2, {c['num_layers']} layers, hidden {c['hidden_size']}, "
            f"{c['num_attention_heads']} heads, seq {c['seq_length']}, vocab "
            f"{c['vocab_size']}, fp32, AdamW; micro batch {c['micro_batch']}; medians of "
            f"{c['steps']} steps after {c['warmup']} warm-up steps. Two stages of "
            f"{c['num_layers'] // 2} layers (the interleaved run: two chunks of "
            f"{c['num_layers'] // 4} a stage). Bubble: the share of the schedule's span (first "
            "forward to last backward, the optimizer step left out) a stage spends outside "
            "its forward and backward passes, mean over the stages, against (P-1)/(m+P-1) "
            "and (P-1)/(v m+P-1). \"ours vs it\": the peer's time over ours (above 1: ours "
            "is faster).\n\n" + table +
            f"\n\nThe same global batch ({m} micro batches of {c['micro_batch']}) over 2 "
            "processes in each layout:\n\n" + layouts)
    print(body)
    if args.write_docs:
        update_docs_section("pipeline", body)


if __name__ == "__main__":
    main()
