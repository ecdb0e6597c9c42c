"""Backward's gradient reduction for ZeRO stages 0-2, bucket by bucket.

A bucket (or, with an aliased fp32 master, an owner unit: FlatGroup.use_owner_units) is
launched once every parameter piece in it has its gradient, in one fixed order on every rank
(latest-registered params first, the order backward produces them), so collectives match
across ranks whatever order hooks fire in: an all-reduce at stage 0, a reduce-scatter (or a
reduce to the unit's owner) at stages 1 and 2. Stage 2 copies each finished gradient into its
bucket's buffer and frees it; the reduced buckets are accumulated into the partition
gradients. At most two buffers are in flight when `overlap_comm` is set.
"""

from functools import partial

import torch

from zero.comm.communicator import Pending
from zero.errors import ZeroError


def reduces_in_masters(settings, group):
    """Stage 0 with fp32 communication or accumulation of 16-bit gradients: each bucket is
    copied (or, after micro batches summed there, added) into the fp32 master's gradient and
    all-reduced there."""
    return settings.stage == 0 and (settings.fp32_communication or settings.fp32_accumulation) \
        and not settings.external_reduction and not group.master_is_flat


class BucketReduction:
    """The reduction state of one backward pass over the optimizer's FlatGroups.

    `grad_ready(g, i, param)` as each gradient is complete (from a hook), `finish()` after
    backward (launches what is left, waits for everything), `reset()` before the next.
    `fresh_partition_grads` says the partition gradients hold nothing yet this step (the
    optimizer's zero_grad sets it): the first reduced bucket is copied in, later ones added.
    `summed_in_masters` says stage 0's fp32 master gradients hold earlier micro batches'
    gradients (fp32 accumulation), which a bucket adds to before they are reduced.
    """

    def __init__(self, groups, settings, dp_comm, param_order, pre_factor, post_factor,
                 partition_rank):
        self.groups, self.settings, self.dp_comm = groups, settings, dp_comm
        self.launch_order = _launch_order(groups, param_order)
        self.pre_factor, self.post_factor = pre_factor, post_factor
        self.partition_rank = partition_rank
        self.fresh_partition_grads = True
        self.summed_in_masters = False
        self.reset()

    def reset(self):
        """Before each backward: no gradient ready, nothing launched or in flight."""
        self._ready = [[False] * len(g.params) for g in self.groups]
        self._pending = [[len(p) for p in g.pieces] for g in self.groups]
        self._buffers = {}  # (g, k) -> [bucket] buffer, stage 2
        self._in_flight = []  # Pending collectives with their post-processing
        self._next_launch = 0

    def grad_ready(self, g, i, param):
        """Gradient i of group g is complete: launch every bucket that now is."""
        if self._ready[g][i]:
            raise ZeroError("a gradient was produced twice for one parameter in one backward "
                            "pass; call engine.backward once per micro-batch")
        self._ready[g][i] = True
        if self.settings.stage == 2:
            self._copy_into_buckets(g, i, param)
        for k, *_ in self.groups[g].param_pieces[i]:
            self._pending[g][k] -= 1
        self._launch_ready()

    def _copy_into_buckets(self, g, i, param):
        grad = param.grad.reshape(-1)
        for k, param_offset, bucket_offset, length in self.groups[g].param_pieces[i]:
            buffer = self._bucket_buffer(g, k)
            buffer.narrow(0, bucket_offset, length).copy_(grad.narrow(0, param_offset, length))
        param.grad = None  # the full gradient is not kept (stage 2)

    def _bucket_buffer(self, g, k):
        """Stage 2's buffer for reduction k (a bucket, or an owner unit)."""
        if (g, k) not in self._buffers:
            group = self.groups[g]
            capacity = group.reduce_numel(0)  # the first unit or bucket is a largest one
            spare = group.spare_buffers.pop() if group.spare_buffers else \
                torch.empty(capacity, dtype=group.dtype, device=group.device)
            self._buffers[(g, k)] = (spare, spare.narrow(0, 0, group.reduce_numel(k)))
        return self._buffers[(g, k)][1]

    def _release_buffer(self, g, k):
        spare, _ = self._buffers.pop((g, k), (None, None))
        if spare is not None and len(self.groups[g].spare_buffers) < 3:
            self.groups[g].spare_buffers.append(spare)

    def _launch_ready(self):
        while self._next_launch < len(self.launch_order):
            g, k = self.launch_order[self._next_launch]
            if self._pending[g][k] > 0:
                return
            self._launch(g, k)
            self._next_launch += 1

    def finish(self):
        """Launch what backward left (buckets with unused params, or every bucket without
        hooks), then wait for everything."""
        if self.settings.stage == 2 and not self.settings.ignore_unused_parameters:
            unused = sum(not is_ready for ready in self._ready for is_ready in ready)
            if unused:
                raise ZeroError(f"{unused} parameter(s) received no gradient in this backward "
                                "pass; set zero_optimization.ignore_unused_parameters to true "
                                "if that is intended")
        for g, k in self.launch_order[self._next_launch:]:
            self._launch(g, k)
        self._next_launch = len(self.launch_order)
        while self._in_flight:
            self._in_flight.pop(0).wait()
        self.fresh_partition_grads = False

    def _launch(self, g, k):
        group, async_op = self.groups[g], self.settings.overlap_comm
        if self.settings.stage == 2:
            source = self._bucket_buffer(g, k)
            self._zero_unfilled(g, k, source)
        elif group.units is not None:
            source = group.unit(group.full_grads, k)
        else:
            source = group.flat_bucket(group.full_grads, k)
            if reduces_in_masters(self.settings, group):  # reduce the fp32 copy: the master's grad
                target = group.flat_bucket(group.master.grad, k)
                if self.summed_in_masters:
                    add_into(target, source)
                    source = target
                else:
                    source = target.copy_(source)
        if async_op and (self.settings.stage == 2 or group.units is not None):
            while len(self._in_flight) >= 2:  # bound the buffers in flight
                self._in_flight.pop(0).wait()
        if self.pre_factor != 1.0:
            source.mul_(self.pre_factor)
        if self.settings.stage == 0:
            pending = self.dp_comm.all_reduce(source, async_op=async_op)
            post = self.post_factor
            then = (lambda: source.mul_(post)) if post != 1.0 else None
        elif group.units is not None:
            pending, then = self._reduce_to_owner(g, k, source, async_op)
        else:
            pending, then = self._reduce_to_partition(g, k, source, async_op)
        self._in_flight.append(Pending(pending, then))
        if not async_op:
            self._in_flight.pop().wait()

    def _zero_unfilled(self, g, k, buffer):
        group = self.groups[g]
        for i, _, bucket_offset, length in group.pieces[k]:
            if not self._ready[g][i]:
                buffer.narrow(0, bucket_offset, length).zero_()
        covered = sum(length for *_, length in group.pieces[k])  # pieces start at 0, in order
        if covered < buffer.numel():  # the padding at the end of the last bucket or unit
            buffer.narrow(0, covered, buffer.numel() - covered).zero_()

    def _reduce_to_owner(self, g, k, source, async_op):
        """Sum unit k over ranks into the rank that owns it. Stage 1: the sum lands in place
        (the owner's master grad is this range of its full gradients); stage 2: the owner
        accumulates it into its partition gradient, every rank frees the buffer."""
        group, owner = self.groups[g], self.groups[g].units[k][2]
        if self.settings.reduce_scatter:
            pending = self.dp_comm.reduce(source, owner, async_op=async_op)
        else:
            pending = self.dp_comm.all_reduce(source, async_op=async_op)
        if self.settings.stage == 1:
            return pending, None
        fresh, mine = self.fresh_partition_grads, owner == group.rank

        def accumulate():
            if mine:
                target = group.partition_slice(group.master.grad, k)
                _accumulate_into(target, source, fresh)
            self._release_buffer(g, k)
        return pending, accumulate

    def _reduce_to_partition(self, g, k, source, async_op):
        group = self.groups[g]
        target = group.master_chunk(group.master.grad, k)
        # the master's gradient may be this rank's chunk of `source`: reduce in place
        direct = group.master_grad_in_full_grads or (
            source.dtype == target.dtype and source.device == target.device
            and self.fresh_partition_grads)
        out = target if direct else torch.empty(group.layout.chunk, dtype=source.dtype,
                                                 device=source.device)
        if not self.settings.reduce_scatter:
            pending = self.dp_comm.all_reduce(source, async_op=async_op)
            own = source.narrow(0, self.partition_rank * group.layout.chunk, group.layout.chunk)
            pending = Pending(pending, partial(out.copy_, own))
        else:
            pending = self.dp_comm.reduce_scatter(out, source, async_op=async_op)
        release = partial(self._release_buffer, g, k)
        if direct:
            return pending, release
        fresh = self.fresh_partition_grads

        def accumulate():
            _accumulate_into(target, out, fresh)
            release()
        return pending, accumulate


def _launch_order(groups, param_order):
    """All (group, bucket) pairs, the one whose earliest param is latest in the model first."""
    keyed = []
    for g, group in enumerate(groups):
        for k, pieces in enumerate(group.pieces):
            first = min((param_order[group.params[i]] for i, *_ in pieces), default=-1)
            keyed.append((-first, g, -k))
    return [(g, -neg_k) for _, g, neg_k in sorted(keyed)]


def _accumulate_into(target, reduced, fresh):
    """target <- reduced (first micro-batch since the step) or += reduced; offloaded masters'
    gradients live in host memory, the reduced gradients on the compute device."""
    if fresh:
        target.copy_(reduced)
    else:
        add_into(target, reduced.to(target.device))


_WIDENING_CHUNK = 1 << 20


def add_into(target, source):
    """target += source. On a CPU torch adds a 16-bit tensor into an fp32 one several times
    slower than it converts one (docs/benchmarks.md, bf16 gradient sums): there the source is
    widened a chunk at a time into one fp32 buffer first."""
    if source.dtype == target.dtype or target.device.type != "cpu":
        target.add_(source)
        return
    flat_target, flat_source = target.view(-1), source.reshape(-1)
    numel = flat_target.numel()
    widened = torch.empty(min(_WIDENING_CHUNK, numel), dtype=target.dtype)
    for lo in range(0, numel, _WIDENING_CHUNK):
        n = min(_WIDENING_CHUNK, numel - lo)
        chunk = widened[:n].copy_(flat_source[lo:lo + n])
        flat_target[lo:lo + n].add_(chunk)
