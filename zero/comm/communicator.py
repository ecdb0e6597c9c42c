"""Collectives over one process group, with byte accounting.

Every collective the engine issues goes through a `Communicator`, which counts calls and bytes
per operation in `stats`, so benchmarks and tests can check the traffic ZeRO promises
(stage 1/2 move about as many gradient bytes as plain data parallelism, arXiv 1910.02054 §7).

What differs between backends is hidden here:
- gloo's collectives that do not reduce in place are slow on CPU (zero/comm/ring.py has the
  numbers): its `reduce_scatter_tensor` runs here as a ring over isend/irecv, its
  `all_gather_into_tensor` and `reduce` as direct sends (`zero/comm/ring.py`), each rank sending
  (N-1)/N of the buffer.
  The ring reduce-scatter accumulates in the input's chunks, so its input is scratch: callers
  must not rely on it afterwards. `reduce_scatter_impl="all_reduce"` keeps the older path (an
  in-place all-reduce of the input, then a copy of this rank's chunk) for comparison; NCCL
  always uses its native collectives.
- `all_gather_into_tensor` was renamed `all_gather_single` (and `reduce_scatter_tensor`
  `reduce_scatter_single`) in recent torch; whichever exists is used.

Every op takes `async_op` and returns a `Pending` whose `wait()` finishes it (including any copy
the emulation needs). With a world of one, ops are local copies and nothing is sent.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zero.comm.ring import (PointToPointAllGather, PointToPointReduce, RingReduceScatter,
                       tags_needed)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0  # bytes of the full (world-sized) buffer each call works on
    sent_bytes: float = 0.0  # what a bandwidth-optimal ring sends from this rank


@dataclass
class CommStats:
    """Traffic of one rank since the last `reset()`, per operation name, and the time spent
    waiting for collectives to finish (`Pending.wait`)."""
    ops: dict = field(default_factory=dict)
    wait_seconds: float = 0.0

    def record(self, op, payload_bytes, sent_bytes):
        entry = self.ops.setdefault(op, OpStats())
        entry.calls += 1
        entry.payload_bytes += payload_bytes
        entry.sent_bytes += sent_bytes

    def reset(self):
        self.ops.clear()
        self.wait_seconds = 0.0

    def total_sent_bytes(self):
        return sum(entry.sent_bytes for entry in self.ops.values())

    def calls(self, op):
        return self.ops[op].calls if op in self.ops else 0

    def sent_bytes(self, op):
        return self.ops[op].sent_bytes if op in self.ops else 0.0


class Pending:
    """A launched collective; `wait()` blocks until its result is in place (and adds the time
    it blocked to `stats.wait_seconds` when given)."""

    def __init__(self, work=None, then=None, stats=None):
        self._work, self._then, self._stats = work, then, stats

    def wait(self):
        start = time.perf_counter()
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()
        if self._stats is not None:
            self._stats.wait_seconds += time.perf_counter() - start


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


class Communicator:
    """Collectives over `group` (None = the default world group) that count their bytes."""

    def __init__(self, group=None, stats=None, reduce_scatter_impl=None):
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self.backend = dist.get_backend(group) if initialized else "local"
        # how a reduce-scatter runs: "native" (the backend's collective), "ring" (isend/irecv,
        # the gloo default) or "all_reduce" (all-reduce, then keep this rank's chunk)
        if reduce_scatter_impl is None:
            reduce_scatter_impl = "ring" if self.backend == "gloo" else "native"
        if reduce_scatter_impl not in ("native", "ring", "all_reduce"):
            raise ValueError(f"unknown reduce_scatter_impl {reduce_scatter_impl!r}")
        self.reduce_scatter_impl = reduce_scatter_impl
        self._next_tag = 0  # every rank issues the same calls in the same order: tags match

    def global_rank(self, group_rank):
        """The rank in the default group of rank `group_rank` of this group."""
        if self.world_size == 1 and not dist.is_initialized():
            return group_rank
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _tags(self, chunk_numel):
        """The first of the tags a point-to-point call over `chunk_numel`-element chunks uses."""
        first = self._next_tag
        self._next_tag += tags_needed(self.world_size, chunk_numel)
        return first

    def _run(self, call, async_op):
        if async_op:
            return Pending(then=call.finish, stats=self.stats)
        call.finish()
        return Pending()

    def _ring_fraction(self):
        return (self.world_size - 1) / self.world_size

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False):
        if self.world_size == 1:
            return Pending()
        nbytes = _nbytes(tensor)
        self.stats.record("all_reduce", nbytes, 2 * self._ring_fraction() * nbytes)
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
        return Pending(work if async_op else None, stats=self.stats)

    def reduce_scatter(self, output, input, async_op=False):
        """Sum `input` ([world * n]) over ranks; this rank's chunk `n` lands in `output`.

        `input` is scratch: on gloo it ends up holding the full sum, elsewhere it is unchanged.
        """
        n = output.numel()
        assert input.numel() == n * self.world_size, (input.numel(), n, self.world_size)
        own_chunk = input.narrow(0, self.rank * n, n)
        if self.world_size == 1:
            if output.data_ptr() != own_chunk.data_ptr():
                output.copy_(own_chunk)
            return Pending()
        if self.reduce_scatter_impl == "all_reduce":
            pending = self.all_reduce(input, async_op=async_op)
            copy_back = lambda: output.copy_(own_chunk)  # noqa: E731
            if async_op:
                return Pending(pending, copy_back)
            copy_back()
            return Pending()
        self.stats.record("reduce_scatter", _nbytes(input), self._ring_fraction() * _nbytes(input))
        if self.reduce_scatter_impl == "ring":
            ring = RingReduceScatter(input, output, self.rank, self.world_size,
                                     self.global_rank, self.group, self._tags(n))
            return self._run(ring, async_op)
        work = _reduce_scatter_single(output, input, group=self.group, async_op=async_op)
        return Pending(work if async_op else None, stats=self.stats)

    def reduce(self, tensor, dst, async_op=False):
        """Sum `tensor` over ranks into group rank `dst`'s copy; other ranks' are unchanged."""
        if self.world_size == 1:
            return Pending()
        nbytes = _nbytes(tensor)
        self.stats.record("reduce", nbytes, 0 if self.rank == dst else nbytes)
        if self.backend == "gloo":
            reduce = PointToPointReduce(tensor, dst, self.rank, self.world_size,
                                        self.global_rank, self.group,
                                        self._tags(tensor.numel()))
            return self._run(reduce, async_op)
        work = dist.reduce(tensor, self.global_rank(dst), group=self.group, async_op=async_op)
        return Pending(work if async_op else None, stats=self.stats)

    def all_gather(self, output, input, async_op=False):
        """Concatenate every rank's `input` ([n]) in rank order into `output` ([world * n]).

        `input` may be this rank's own chunk of `output` (gathering in place).
        """
        n = input.numel()
        assert output.numel() == n * self.world_size, (output.numel(), n, self.world_size)
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Pending()
        self.stats.record("all_gather", _nbytes(output), self._ring_fraction() * _nbytes(output))
        if self.backend == "gloo":
            gather = PointToPointAllGather(output, input, self.rank, self.world_size,
                                           self.global_rank, self.group, self._tags(n))
            return self._run(gather, async_op)
        work = _all_gather_single(output, input, group=self.group, async_op=async_op)
        return Pending(work if async_op else None, stats=self.stats)

    def broadcast(self, tensor, src_group_rank=0):
        if self.world_size == 1:
            return
        self.stats.record("broadcast", _nbytes(tensor), _nbytes(tensor))
        dist.broadcast(tensor, src=self.global_rank(src_group_rank), group=self.group)

    def barrier(self):
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def scalar_device(self, like):
        """Where a small all-reduce buffer must live: NCCL needs the GPU, gloo the CPU."""
        if self.backend == "nccl":
            return like.device if like.is_cuda else torch.device("cuda",
                                                                 torch.cuda.current_device())
        return torch.device("cpu")
