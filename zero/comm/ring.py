"""Collectives over point-to-point sends, for backends without fast ones (gloo on CPU, where
they are several times faster than gloo's own: docs/design/gloo-collectives.md). Messages are
cut into pieces of at most PIECE_NUMEL elements, which gloo moves several at a time.

- `RingReduceScatter`: for N ranks the input [N * n] is N chunks; chunk c ends up summed on
  rank c. In step s (0 <= s < N-1) rank r sends its running sum of chunk (r - s - 1) mod N to
  rank r+1 and adds what rank r-1 sends (its running sum of chunk (r - s - 2) mod N) into its
  own copy, so after the last step rank r holds the full sum of chunk r. Every rank sends
  (N-1)/N of the buffer, the bandwidth-optimal volume, where an all-reduce sends twice that.
  Chunk c is summed in the order x[c+1] + x[c+2] + ... + x[c] (ranks mod N): with two ranks
  the single addition a + b, bit-identical to an all-reduce; with more ranks the order
  differs from gloo's all-reduce, so results agree to fp32 rounding. The running sums
  accumulate in the input's own chunks (the input is scratch) and one receive buffer.
- `PointToPointAllGather`: every rank sends its chunk to every other rank, receiving straight
  into the output; (N-1)/N of the output sent per rank, no copies, no chain of steps.
- `PointToPointReduce`: every other rank sends its whole tensor to the destination, which adds
  them in rank order.

Each call takes `tag_base` and uses the tags [tag_base, tag_base + tags_needed(...)): the
caller hands out tag ranges in call order, which is the same on every rank, so calls in
flight together never share a tag. The first step is posted at construction, so an async
caller overlaps it with its own work; `finish()` runs the rest.
"""

import math

import torch
import torch.distributed as dist

PIECE_NUMEL = 1 << 20
TAG_SPACE = 1 << 24  # tags wrap; calls this far apart are never in flight together


def _pieces(numel):
    return max(1, math.ceil(numel / PIECE_NUMEL))


def tags_needed(world_size, chunk_numel):
    """Tags one ring call over chunks of `chunk_numel` elements uses."""
    return max(1, world_size - 1) * _pieces(chunk_numel)


class _Exchange:
    """isend/irecv of whole tensors cut into pieces; piece j of a message has tag `tag + j`."""

    def __init__(self, group):
        self.group, self.works = group, []

    def _split(self, tensor):
        return [tensor.narrow(0, lo, min(PIECE_NUMEL, tensor.numel() - lo))
                for lo in range(0, max(1, tensor.numel()), PIECE_NUMEL)]

    def send(self, tensor, peer, tag):
        for j, piece in enumerate(self._split(tensor)):
            self.works.append(dist.isend(piece, peer, group=self.group,
                                         tag=(tag + j) % TAG_SPACE))

    def recv(self, tensor, peer, tag):
        for j, piece in enumerate(self._split(tensor)):
            self.works.append(dist.irecv(piece, peer, group=self.group,
                                         tag=(tag + j) % TAG_SPACE))

    def wait(self):
        for work in self.works:
            work.wait()
        self.works = []


class RingReduceScatter:
    """One reduce-scatter of `input` ([world * n]) into `output` ([n]) over `group`.

    `to_global(group_rank)` maps a rank of `group` to a rank of the default group (what
    isend/irecv address).
    """

    def __init__(self, input, output, rank, world_size, to_global, group, tag_base):
        if not input.is_contiguous():
            raise ValueError("the ring reduce-scatter needs a contiguous input")
        self.chunks = input.view(world_size, -1)  # [N, n]
        self.output, self.rank, self.world = output, rank, world_size
        self.received = torch.empty_like(self.chunks[0])
        self.next_rank = to_global((rank + 1) % world_size)
        self.prev_rank = to_global((rank - 1) % world_size)
        self.tag_base, self.step_tags = tag_base, _pieces(self.chunks.shape[1])
        self.exchange = _Exchange(group)
        self.step = 0
        self._post()

    def _chunk(self, step_offset):
        return self.chunks[(self.rank - self.step - step_offset) % self.world]

    def _post(self):
        tag = self.tag_base + self.step * self.step_tags
        self.exchange.send(self._chunk(1), self.next_rank, tag)
        self.exchange.recv(self.received, self.prev_rank, tag)

    def finish(self):
        """Run the remaining steps; afterwards `output` holds the sum of chunk `rank`."""
        while self.step < self.world - 1:
            self.exchange.wait()
            # the chunk sent next is the one summed here, never the one that was in flight
            self._chunk(2).add_(self.received)
            self.step += 1
            if self.step < self.world - 1:
                self._post()
        own = self.chunks[self.rank]
        if self.output.data_ptr() != own.data_ptr():
            self.output.copy_(own)


class PointToPointAllGather:
    """One all-gather of every rank's `input` ([n]) into `output` ([world * n]), in place.

    Every rank sends its chunk to every other rank and receives theirs straight into the
    output, each rank sending (N-1)/N of the output as a ring would. All messages are posted at
    construction: a ring's N-1 dependent steps would each be posted only when the caller
    waits, so with N > 2 a prefetched gather would mostly run at the wait.
    """

    def __init__(self, output, input, rank, world_size, to_global, group, tag_base):
        chunks = output.view(world_size, -1)
        if input.data_ptr() != chunks[rank].data_ptr():
            chunks[rank].copy_(input)
        self.exchange = _Exchange(group)
        for peer in range(world_size):
            if peer != rank:
                self.exchange.send(chunks[rank], to_global(peer), tag_base)
                self.exchange.recv(chunks[peer], to_global(peer), tag_base)

    def finish(self):
        self.exchange.wait()


class PointToPointReduce:
    """A sum of `tensor` over `group` into rank `dst`'s copy; other ranks' stay unchanged.

    Uses tags [tag_base, tag_base + tags_needed(2, tensor.numel())).
    """

    def __init__(self, tensor, dst, rank, world_size, to_global, group, tag_base):
        self.tensor, self.received = tensor, []
        self.exchange = _Exchange(group)
        if rank == dst:
            for src in range(world_size):
                if src != dst:
                    buffer = torch.empty_like(tensor)
                    self.exchange.recv(buffer, to_global(src), tag_base)
                    self.received.append(buffer)
        else:
            self.exchange.send(tensor, to_global(dst), tag_base)

    def finish(self):
        self.exchange.wait()
        for buffer in self.received:
            self.tensor.add_(buffer)
        self.received = []
