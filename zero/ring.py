"""A ring reduce-scatter over point-to-point sends, for backends without a fast collective.

For N ranks the input [N * n] is N chunks; chunk c ends up summed on rank c. In step s
(0 <= s < N-1) rank r sends its running sum of chunk (r - s - 1) mod N to rank r+1 and adds
what rank r-1 sends (its running sum of chunk (r - s - 2) mod N) into its own copy, so after
the last step rank r holds the full sum of chunk r. Every rank sends (N-1)/N of the buffer,
the bandwidth-optimal volume, where an all-reduce sends twice that.

Chunk c is summed in the order x[c+1] + x[c+2] + ... + x[c] (ranks mod N). With two ranks that
is the single addition a + b, bit-identical to an all-reduce; with more ranks the order differs
from gloo's all-reduce, so results agree to fp32 rounding.

The running sums accumulate in the input's own chunks (the input is scratch) and one receive
buffer of n elements. The first step is posted at construction, so an async caller overlaps it
with its own work; `finish()` runs the remaining steps and leaves chunk `rank` in the output.
"""

import torch
import torch.distributed as dist

_TAG_SPACE = 1 << 24  # tags wrap; calls far apart never have messages in flight together


class RingReduceScatter:
    """One reduce-scatter of `input` ([world * n]) into `output` ([n]) over `group`.

    `to_global(group_rank)` maps a rank of `group` to a rank of the default group (what
    isend/irecv address); `call_index` must be the same on every rank for the same call.
    """

    def __init__(self, input, output, rank, world_size, to_global, group, call_index):
        if not input.is_contiguous():
            raise ValueError("the ring reduce-scatter needs a contiguous input")
        self.chunks = input.view(world_size, -1)  # [N, n]
        self.output, self.rank, self.world = output, rank, world_size
        self.group = group
        self.next_rank = to_global((rank + 1) % world_size)
        self.prev_rank = to_global((rank - 1) % world_size)
        self.tag_base = (call_index * world_size) % _TAG_SPACE
        self.received = torch.empty_like(self.chunks[0])
        self.step = 0
        self._works = self._post(0)

    def _chunk_index(self, step_offset):
        return (self.rank - self.step - step_offset) % self.world

    def _post(self, step):
        tag = self.tag_base + step
        send = dist.isend(self.chunks[self._chunk_index(1)], self.next_rank, group=self.group,
                          tag=tag)
        recv = dist.irecv(self.received, self.prev_rank, group=self.group, tag=tag)
        return send, recv

    def finish(self):
        """Run the remaining steps; afterwards `output` holds the sum of chunk `rank`."""
        while self._works is not None:
            send, recv = self._works
            recv.wait()
            self.chunks[self._chunk_index(2)].add_(self.received)
            send.wait()  # the chunk sent next is the one just summed, never the one in flight
            self.step += 1
            self._works = self._post(self.step) if self.step < self.world - 1 else None
        own = self.chunks[self.rank]
        if self.output.data_ptr() != own.data_ptr():
            self.output.copy_(own)
