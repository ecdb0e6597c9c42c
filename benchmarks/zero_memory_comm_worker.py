"""One rank of one runner of benchmarks/zero_memory_comm.py (started by it, one process per rank).

    RANK=r WORLD_SIZE=n MASTER_ADDR=.. MASTER_PORT=.. python zero_memory_comm_worker.py \
        --runner RUNNER --stage S --model small|gpt-91m --steps N --warmup W \
        --micro-batch B --out PREFIX                        # writes PREFIX.rank<r>.json

    RUNNER: ours, ours_release, ddp, zero_redundancy, fsdp2_reshard, fsdp2_keep, deepspeed,
    paired_ddp

Runs in the project's venv, or (runner deepspeed) in the DeepSpeed venv: so it imports only
torch at the top, zero or deepspeed inside its runner. Every runner trains the same PlainGPT
(benchmarks/train_throughput.py: fp32, tied head, dropout 0) with AdamW on random tokens,
one micro batch per rank per step, gloo, one thread per rank.
`paired_ddp` builds our stage S and torch DDP in the same processes and alternates their steps
(median step time of each). The other runners measure, per rank: median step time
(barrier-to-barrier), model-state bytes (the distinct tensor storages the runner holds after
a backward, where all of them exist: parameters, gradients, optimizer state, fp32 masters,
communication buffers), bytes sent per step, peak RSS (VmHWM), and the peak of malloc's bytes
in use over one step (what the runner holds, without what the allocator keeps of freed
memory).
"""

import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_throughput import PlainGPT  # noqa: E402  (torch only)

MODELS = {
    # a step takes ~0.5-1 s per rank here (1 thread)
    "small": dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                  vocab_size=8192),
    # the comparison: 91.5M parameters (GPT-2 small with a 32k vocab... see README)
    "gpt-91m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=128,
                    vocab_size=32768),
}
LR = 1e-4
# ZeRO's reduce_bucket_size for ours and DeepSpeed: 25 MB of fp32 gradients, DDP's default
# bucket_cap_mb (gloo moves one 25 MB bucket ~2x faster per byte than 4 MB ones here)
BUCKET_NUMEL = 25 * 2 ** 20 // 4


# ------------------------------------------------------------------ byte accounting of peers

class WireCounter:
    """Counts what torch.distributed collectives send from this rank (bandwidth-optimal ring
    volumes, as zero/comm/communicator.py does): patched over torch.distributed's functions, plus a
    DDP
    comm hook (DDP's reducer calls the backend directly)."""

    def __init__(self, world):
        self.world, self.sent = world, 0.0
        frac = (world - 1) / world

        def nbytes(args, kwargs, position, name):
            t = args[position] if len(args) > position else kwargs[name]
            if isinstance(t, (list, tuple)):
                return sum(x.numel() * x.element_size() for x in t)
            return t.numel() * t.element_size()

        def src(args, kwargs):
            return args[1] if len(args) > 1 else kwargs.get("src", 0)
        # bytes this rank sends (ring) or, for a broadcast, receives
        sizes = {
            "all_reduce": lambda a, k: 2 * frac * nbytes(a, k, 0, "tensor"),
            "all_gather_into_tensor": lambda a, k: frac * nbytes(a, k, 0, "output_tensor"),
            "all_gather_single": lambda a, k: frac * nbytes(a, k, 0, "output_tensor"),
            "reduce_scatter_tensor": lambda a, k: frac * nbytes(a, k, 1, "input"),
            "reduce_scatter_single": lambda a, k: frac * nbytes(a, k, 1, "input"),
            "all_gather": lambda a, k: frac * nbytes(a, k, 0, "tensor_list"),
            "reduce_scatter": lambda a, k: frac * nbytes(a, k, 1, "input_list"),
            "broadcast": lambda a, k: 0 if src(a, k) == dist.get_rank()
            else nbytes(a, k, 0, "tensor"),
        }
        for name, size in sizes.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counting(original, size))

    def _counting(self, original, size):
        def wrapper(*args, **kwargs):
            self.sent += size(args, kwargs)
            return original(*args, **kwargs)
        return wrapper

    def ddp_hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        # allreduce_hook calls the patched dist.all_reduce, which counts the bucket: routing
        # DDP's reducer through it is what makes its traffic visible
        return allreduce_hook(state, bucket)


# ------------------------------------------------------------------ model-state accounting

_WALK_MODULES = ("zero", "deepspeed", "torch.optim", "torch.distributed")


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def held_bytes(module, *roots):
    """{category: bytes} of the distinct storages reachable from the module's parameters (and
    their grads and DeepSpeed-style partition attributes) and from `roots` (optimizers), walked
    through lists, dicts and objects of zero/deepspeed/torch.optim classes."""
    seen, totals, visited = set(), {}, set()

    def add(tensor, category):
        tensor = _local(tensor)
        if not torch.is_tensor(tensor):
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return
        seen.add(storage.data_ptr())
        totals[category] = totals.get(category, 0) + storage.nbytes()

    def walk(obj, category, depth):
        if depth > 6 or id(obj) in visited:
            return
        visited.add(id(obj))
        if torch.is_tensor(obj):
            add(obj, category)
            if obj.grad is not None:
                add(obj.grad, "grads")
            for value in getattr(obj, "__dict__", {}).values():  # ds_tensor and friends
                if torch.is_tensor(value):
                    walk(value, category, depth + 1)
            return
        if isinstance(obj, dict):
            for key, value in obj.items():
                if torch.is_tensor(key):
                    walk(key, "masters", depth + 1)
                walk(value, "optimizer state" if category == "optimizer" else category, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for value in obj:
                walk(value, category, depth + 1)
        elif type(obj).__module__.startswith(_WALK_MODULES) and hasattr(obj, "__dict__"):
            if isinstance(obj, torch.optim.Optimizer):
                walk(dict(obj.state), "optimizer", depth + 1)
                for group in obj.param_groups:
                    walk(group["params"], "masters", depth + 1)
            for value in vars(obj).values():
                walk(value, "other", depth + 1)

    for param in module.parameters():
        walk(param, "params", 0)
    for root in roots:
        walk(root, "other", 0)
    return totals


class MallocPeak:
    """The most bytes glibc's malloc has handed out and not taken back (main arena plus mmapped
    blocks, mallinfo2), sampled every 0.5 ms by a thread while running. Unlike the resident set
    it does not count freed memory the allocator keeps, so it shows what a runner holds; None
    where glibc's mallinfo2 is missing."""

    class _Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    def __init__(self):
        try:
            self._mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
            self._mallinfo2.restype = self._Info
        except (OSError, AttributeError):
            self._mallinfo2 = None
        self.peak, self._running = 0, False

    def _in_use(self):
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def _sample(self):
        while self._running:
            self.peak = max(self.peak, self._in_use())
            time.sleep(0.0005)

    def __enter__(self):
        if self._mallinfo2 is not None:
            self._running = True
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._mallinfo2 is not None:
            self._running = False
            self._thread.join()
            self.peak = max(self.peak, self._in_use())

    def result(self):
        return self.peak if self._mallinfo2 is not None else None


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------ runners

def _batch(step, rank, micro, config):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, config["vocab_size"], (micro, config["seq_length"] + 1),
                           generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _nothing():
    pass


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)


def build_ours(config, stage, counter, release_after_forward=False):
    import zero
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": stage, "overlap_comm": True,
                                       "reduce_bucket_size": BUCKET_NUMEL},
                 "steps_per_print": 10 ** 9}
    if release_after_forward:  # the paper's stage 3: every param re-gathered in backward
        ds_config["zero_optimization"].update(stage3_max_reuse_distance=0,
                                              stage3_param_persistence_threshold=0)
    if stage == 3:
        with zero.Init(config=ds_config):
            model = PlainGPT(config)
        zero.register_external_parameter(model, model.wte.weight)
    else:
        model = PlainGPT(config)
    engine, optimizer, _, _ = zero.initialize(model=model, optimizer=_adamw(model.parameters()),
                                              config=ds_config)

    def step(tokens, labels, after_backward=_nothing):
        loss = engine(tokens, labels)
        engine.backward(loss)
        after_backward()
        engine.step()
    sent = lambda: engine.dp_comm.stats.total_sent_bytes()  # noqa: E731
    return model, [engine.optimizer], step, sent


def build_deepspeed(config, stage, counter):
    import deepspeed
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": stage, "overlap_comm": True,
                                       "reduce_bucket_size": BUCKET_NUMEL},
                 "steps_per_print": 10 ** 9}
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = PlainGPT(config)
        deepspeed.zero.register_external_parameter(model, model.wte.weight)
    else:
        model = PlainGPT(config)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters()),
                                           config=ds_config, dist_init_required=False)

    def step(tokens, labels, after_backward=_nothing):
        loss = engine(tokens, labels)
        engine.backward(loss)
        after_backward()
        engine.step()
    return model, [engine.optimizer], step, lambda: counter.sent


def build_ddp(config, stage, counter):
    from torch.nn.parallel import DistributedDataParallel
    model = PlainGPT(config)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, counter.ddp_hook)
    optimizer = _adamw(model.parameters())
    return model, [optimizer], _plain_step(ddp, optimizer), lambda: counter.sent


def build_zero_redundancy(config, stage, counter):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    model = PlainGPT(config)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, counter.ddp_hook)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                        lr=LR, weight_decay=0.01, fused=True)
    return model, [optimizer], _plain_step(ddp, optimizer), lambda: counter.sent


def _build_fsdp2(config, reshard):
    from torch.distributed.fsdp import fully_shard
    model = PlainGPT(config)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, optimizer


def build_fsdp2_reshard(config, stage, counter):
    model, optimizer = _build_fsdp2(config, True)
    return model, [optimizer], _plain_step(model, optimizer), lambda: counter.sent


def build_fsdp2_keep(config, stage, counter):
    model, optimizer = _build_fsdp2(config, False)
    return model, [optimizer], _plain_step(model, optimizer), lambda: counter.sent


def _plain_step(model, optimizer):
    def step(tokens, labels, after_backward=_nothing):
        loss = model(tokens, labels)
        loss.backward()
        after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep grads allocated, as the engines do
    return step


def build_ours_release(config, stage, counter):
    return build_ours(config, stage, counter, release_after_forward=True)


RUNNERS = {"ours": build_ours, "ours_release": build_ours_release,
           "deepspeed": build_deepspeed, "ddp": build_ddp,
           "zero_redundancy": build_zero_redundancy, "fsdp2_reshard": build_fsdp2_reshard,
           "fsdp2_keep": build_fsdp2_keep}


def paired_with_ddp(args, config, rank, counter):
    """Our stage and torch DDP built side by side in the same processes, stepped alternately
    (which goes first alternates too): the machine's speed drifts by 10-30% over minutes
    here, which separate runs cannot tell from a difference between the runners."""
    torch.manual_seed(1234)
    steps = {"ours": build_ours(config, args.stage, counter)[2]}
    torch.manual_seed(1234)
    steps["ddp"] = build_ddp(config, 0, counter)[2]
    times = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        order = list(steps.items()) if i % 2 == 0 else list(reversed(steps.items()))
        for name, step in order:
            dist.barrier()
            start = time.perf_counter()
            step(*_batch(i, rank, args.micro_batch, config))
            dist.barrier()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {"rank": rank, "steps": args.steps,
            **{f"{name}_step_s": statistics.median(t) for name, t in times.items()},
            **{f"{name}_all_s": t for name, t in times.items()}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runner", choices=sorted(RUNNERS) + ["paired_ddp"], required=True)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", required=True, help="result prefix: <out>.rank<r>.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counter = WireCounter(world)
    config = MODELS[args.model]
    if args.runner == "paired_ddp":
        result = paired_with_ddp(args, config, rank, counter)
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
        return
    torch.manual_seed(1234)
    model, roots, step, sent = RUNNERS[args.runner](config, args.stage, counter)
    numel = int(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))
    for i in range(args.warmup):
        step(*_batch(i, rank, args.micro_batch, config))
    dist.barrier()
    sent_before, times = sent(), []
    for i in range(args.warmup, args.warmup + args.steps):
        start = time.perf_counter()
        step(*_batch(i, rank, args.micro_batch, config))
        dist.barrier()
        times.append(time.perf_counter() - start)
    sent_per_step = (sent() - sent_before) / args.steps
    # model states where all of them exist: after backward (our stage 3 frees its partition
    # gradients at the step, as torch's zero_grad(set_to_none=True) would)
    # (and, in the same untimed step, the peak of malloc's bytes in use: the sampling thread
    # would take the GIL from the timed ones)
    held = {}
    with MallocPeak() as in_use:
        step(*_batch(0, rank, args.micro_batch, config),
             after_backward=lambda: held.update(held_bytes(model, *roots)))
    result = {"rank": rank, "world": world, "numel": numel, "step_s": statistics.median(times),
              "sent_per_step": sent_per_step, "held": held, "peak_rss": peak_rss_bytes(),
              "peak_in_use": in_use.result()}
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
