"""gloo reduce-scatter on CPU: zero/comm's ring against an all-reduce and the native collective.

    python benchmarks/reduce_scatter_gloo.py [--quick] [--dp 2 4] [--numel 1000000 4000000]
                                             [--repeats 10] [--write-docs]

For each data-parallel size (gloo processes, one thread each) and bucket size (fp32 elements),
times, per call, the three ways `Communicator.reduce_scatter` (zero/comm) can run on gloo:
  ring        isend/irecv ring (zero/comm/ring.py), gloo's default here: sends (N-1)/N
  all_reduce  in-place all-reduce then keep this rank's chunk: sends 2(N-1)/N
  native      torch.distributed.reduce_scatter_tensor (gloo's own)
and checks the ring's result against the all-reduce's (bit-identical at 2 ranks, fp32
rounding beyond). Reports the median of `--repeats` calls after one warm-up, on rank 0, and
the ratios to the ring. The machine is shared: the load average is printed in the caption.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import REPO_ROOT, machine_description, markdown_table, update_docs_section

IMPLS = ("ring", "all_reduce", "native")


def _time_calls(comm, numel, repeats, rank):
    n = numel // comm.world_size
    source = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    inputs = [source.clone() for _ in range(repeats + 1)]  # the input is scratch
    out = torch.empty(n)
    comm.reduce_scatter(out, inputs[-1])  # warm-up
    times = []
    for buffer in inputs[:-1]:
        dist.barrier()
        start = time.perf_counter()
        comm.reduce_scatter(out, buffer)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _worker(rank, world, port, sizes, repeats, queue):
    sys.path.insert(0, REPO_ROOT)
    from zero.comm.communicator import Communicator
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    rows = []
    for numel in sizes:
        timings, outs = {}, {}
        for impl in IMPLS:
            timings[impl], outs[impl] = _time_calls(
                Communicator(reduce_scatter_impl=impl), numel, repeats, rank)
        diff = (outs["ring"] - outs["all_reduce"]).abs().max().item()
        rows.append((numel, timings, diff))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run(world, sizes, repeats):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29000 + os.getpid() % 1000 + world
    mp.start_processes(_worker, args=(world, port, sizes, repeats, queue), nprocs=world,
                       start_method="spawn")
    return queue.get(timeout=5)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="DP=2, one bucket size")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--numel", type=int, nargs="+", default=[1_000_000, 4_000_000])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args()
    if args.quick:
        args.dp, args.numel, args.repeats = [2], [1_000_000], 5
    rows = []
    for world in args.dp:
        sizes = [n - n % (16 * world) for n in args.numel]
        for numel, t, diff in run(world, sizes, args.repeats):
            rows.append([world, f"{numel:,}"] + [f"{t[i] * 1e3:.1f}" for i in IMPLS]
                        + [f"{t['all_reduce'] / t['ring']:.2f}", f"{t['native'] / t['ring']:.2f}",
                           "identical" if diff == 0 else f"max diff {diff:.1e}"])
    load = os.getloadavg()[0]
    table = markdown_table(["DP", "fp32 elements", "ring ms", "all-reduce ms", "native ms",
                            "all-reduce / ring", "native / ring", "ring vs all-reduce result"],
                           rows)
    body = (f"Machine: {machine_description()}; gloo, 1 thread per rank, median of "
            f"{args.repeats} calls; load average {load:.1f} when written (shared machine).\n\n"
            + table)
    print(body)
    if args.write_docs:
        update_docs_section("reduce_scatter_gloo",
                            "## gloo reduce-scatter: ring vs all-reduce vs native "
                            "(`benchmarks/reduce_scatter_gloo.py`)\n\n" + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
