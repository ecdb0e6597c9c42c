"""Shared pieces of the benchmarks: machine facts, timing, markdown tables, docs update."""

import contextlib
import os
import platform
import re
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
DOCS_PATH = os.path.join(REPO_ROOT, "docs", "benchmarks.md")


def machine_description():
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {device}; "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def median_seconds(step, warmup, repeats, synchronize=lambda: None):
    """Median wall time of `step()` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        step()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(numel=25_000_000, device="cpu"):
    """Bytes read + written per second by an fp32 copy of `numel` elements on `device` (the
    memory bandwidth a streaming kernel can reach there)."""
    import torch
    from megatron.runtime.device import synchronize
    device = torch.device(device)
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    seconds = median_seconds(lambda: dst.copy_(src), warmup=2, repeats=7,
                             synchronize=lambda: synchronize(device))
    return 8 * numel / seconds


def markdown_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def update_docs_section(section, body, path=DOCS_PATH):
    """Replace (or append) the block between this section's markers in docs/benchmarks.md."""
    begin, end = f"<!-- begin {section} -->", f"<!-- end {section} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else \
        text.rstrip() + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def trainer_backend(flags, vocab_size, world_size=1):
    """The trainer's backend (model + zero engine) for pretrain_gpt2.py `flags`, as pretrain()
    builds it, without data or tokenizer files: (backend, ctx). Under several processes the
    caller sets the launcher variables (RANK, WORLD_SIZE, ...) first."""
    from types import SimpleNamespace

    from megatron.config import resolve_config
    from megatron.gpt2 import model_provider
    from megatron.runtime.initialize import initialize_megatron
    from megatron.training.backend import build_backend
    from megatron.training.pretrain import TrainContext, model_config
    config = resolve_config(list(flags) + ["--data-path", "unused", "--tokenizer-type",
                                           "GPT2BPETokenizer", "--vocab-file", "unused",
                                           "--merge-file", "unused"], world_size=world_size)
    runtime = initialize_megatron(config.parallel)
    tokenizer = SimpleNamespace(eod=0, vocab_size=vocab_size)
    ctx = TrainContext(config, tokenizer, runtime, model_config(config, vocab_size))
    return build_backend(ctx, model_provider), ctx


@contextlib.contextmanager
def launch_scripts_environment():
    """While inside, os.environ is what scripts/launch_env.sh gives training processes
    (glibc's small-block cache off, on which the engine's host-memory policy depends:
    zero/host_memory.py); processes spawned inside inherit it."""
    from zero.host_memory import small_block_cache_off_environ
    saved = dict(os.environ)
    os.environ.update(small_block_cache_off_environ())
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_ranks(worker, args, procs, label):
    """Start `procs` spawned processes of `worker(rank, *args, queue)`, as the launch scripts
    start training, each putting (rank, result) on the queue; the results in rank order. A
    worker that dies stops them all (its peers would wait in a collective forever)."""
    import queue as queue_module

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=worker, args=(r, *args, queue)) for r in range(procs)]
    with launch_scripts_environment():
        for process in workers:
            process.start()
    results = {}
    while len(results) < procs:
        try:
            rank, result = queue.get(timeout=1.0)
            results[rank] = result
        except queue_module.Empty:
            dead = [w for w in workers if w.exitcode not in (None, 0)]
            if dead:
                for process in workers:
                    process.kill()
                raise RuntimeError(f"{label}: a worker exited with code {dead[0].exitcode} "
                                   "(its traceback is above)")
    for process in workers:
        process.join()
    return [results[r] for r in range(procs)]
