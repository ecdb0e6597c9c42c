"""Flat parameter buffers and how ZeRO cuts them into partitions.

Per optimizer param group the trainable params are packed in order into one flat buffer of the
model dtype, and every `param.data` becomes a view of it. The buffer is cut into K buckets of
N·C elements (N = partition count) and chunk n of every bucket belongs to rank n:

    flat      | bucket 0          | bucket 1          | ...     # K buckets, zero padding at the end
              | c0 | c1 | .. | cN | c0 | c1 | .. | cN |         # chunk n of each bucket: rank n
    partition r = [chunk r of bucket 0, chunk r of bucket 1, ...]                   # [K·C]

So one reduce-scatter of a bucket hands each rank exactly its part of that bucket (gradient
traffic = one reduce-scatter of the model, not an all-reduce), and one all-gather per bucket of
the updated chunks rebuilds the flat buffer in place. Rank r keeps the fp32 master weights, the
reduced gradient and the optimizer state of its [K·C] partition only.

DeepSpeed's checkpoint layout cuts the same flat buffer into N contiguous slices instead;
`zero/checkpoint/layout.py` converts between the two.
"""

import math

import torch

CHUNK_ALIGNMENT = 16  # elements; keeps every chunk start 64-byte aligned in fp32


class FlatLayout:
    """Where the elements of one param group's flat buffer live, for `world_size` partitions."""

    def __init__(self, numels, world_size, bucket_numel):
        self.numels = list(numels)
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.world_size = world_size
        buckets = max(1, math.ceil(self.numel / max(1, bucket_numel)))
        per_chunk = math.ceil(self.numel / (buckets * world_size))
        self.chunk = max(CHUNK_ALIGNMENT, math.ceil(per_chunk / CHUNK_ALIGNMENT) * CHUNK_ALIGNMENT)
        self.bucket = world_size * self.chunk
        # rounding the chunk up may leave whole buckets of padding: drop them
        self.num_buckets = max(1, math.ceil(self.numel / self.bucket))
        self.total = self.num_buckets * self.bucket
        self.partition_numel = self.num_buckets * self.chunk

    def bucket_pieces(self, k):
        """(param_index, param_offset, bucket_offset, length) of each param piece in bucket k."""
        return self.range_pieces(k * self.bucket, (k + 1) * self.bucket)

    def range_pieces(self, lo, hi):
        """(param_index, param_offset, offset in [lo, hi), length) of each param piece there."""
        pieces = []
        for i, (start, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                pieces.append((i, a - start, a - lo, b - a))
        return pieces

    def partition_param_pieces(self, rank):
        """(partition offset, param_index, param_offset, length) of every param piece in
        rank's partition, in partition order."""
        pieces = []
        for k in range(self.num_buckets):
            lo = k * self.bucket + rank * self.chunk
            for i, param_offset, offset, length in self.range_pieces(lo, lo + self.chunk):
                pieces.append((k * self.chunk + offset, i, param_offset, length))
        return pieces

    def partition_runs(self, rank, lo, hi):
        """(flat_start, partition_start, length) of rank's elements inside flat range [lo, hi)."""
        runs = []
        first, last = lo // self.bucket, min(self.num_buckets, math.ceil(hi / self.bucket))
        for k in range(first, last):
            start = k * self.bucket + rank * self.chunk
            a, b = max(lo, start), min(hi, start + self.chunk)
            if a < b:
                runs.append((a, k * self.chunk + a - start, b - a))
        return runs


class FlatGroup:
    """One param group: flat buffer, optional full gradient buffer, fp32 master partition."""

    def __init__(self, params, layout, rank, keep_full_grads, masters, alias_master=False):
        self.params, self.layout, self.rank = params, layout, rank
        first = params[0]
        self.dtype, self.device = first.dtype, first.device
        self.flat = torch.zeros(layout.total, dtype=self.dtype, device=self.device)
        for param, offset in zip(params, layout.offsets):
            view = self.flat.narrow(0, offset, param.numel())
            view.copy_(param.data.reshape(-1))
            param.data = view.view_as(param)  # frees the old storage as we go
            param.grad = None
        self.full_grads, self.grad_views = None, None
        if keep_full_grads:  # stage 0/1: autograd accumulates straight into this buffer
            self.full_grads = torch.zeros_like(self.flat)
            self.grad_views = [self.full_grads.narrow(0, offset, p.numel()).view_as(p)
                               for p, offset in zip(params, layout.offsets)]
            for param, view in zip(params, self.grad_views):
                param.grad = view
        self.master_is_flat = self.master_aliases_flat = False
        self.master = self._make_master(masters, alias_master)
        self.pieces = [layout.bucket_pieces(k) for k in range(layout.num_buckets)]
        self.param_pieces = [[] for _ in params]  # i -> [(bucket, param_off, bucket_off, length)]
        for k, pieces in enumerate(self.pieces):
            for i, param_offset, bucket_offset, length in pieces:
                self.param_pieces[i].append((k, param_offset, bucket_offset, length))
        self.units = None  # (flat_start, length, owner) per unit once use_owner_units is called
        self.spare_buffers = []  # stage 2 reduction buffers, reused across buckets and steps
        self._replicated_runs = None

    def _make_master(self, masters, alias_master):
        """The fp32 master of this rank's partition, from the master store (its values are
        written by the optimizer's refresh from the model). Without a copy where possible:
        - fp32 params at world size 1: the master is the flat buffer itself;
        - `alias_master` (fp32 params in one bucket): this rank's chunk of the flat buffer,
          so model states are the fp32 formulas 4Ψ + 4Ψ + 8Ψ/N (stage 2) and 4Ψ + 12Ψ/N
          (stage 1), and the master's gradient is this rank's chunk of the full gradients
          (stage 1) or its own reduced partition gradient (stage 2)."""
        lay = self.layout
        if masters.can_alias and lay.world_size == 1 and self.dtype == torch.float32:
            self.master_is_flat = True
            master = masters.new_master(lay.partition_numel, self.device, alias=self.flat)
            master.grad = self.full_grads if self.full_grads is not None \
                else torch.zeros_like(self.flat)
            return master
        if alias_master:
            if lay.num_buckets != 1 or self.dtype != torch.float32:
                raise ValueError("an aliased master needs fp32 params and one bucket (its chunk "
                                 "is then one contiguous range of the flat)")
            self.master_aliases_flat = True
            master = masters.new_master(lay.chunk, self.device,
                                        alias=self.flat.narrow(0, self.rank * lay.chunk,
                                                               lay.chunk))
            master.grad = self.full_grads.narrow(0, self.rank * lay.chunk, lay.chunk) \
                if self.full_grads is not None else torch.zeros_like(master)
            return master
        master = masters.new_master(lay.partition_numel, self.device)
        master.grad = masters.grad_buffer(master)
        return master

    def use_owner_units(self, unit_numel):
        """Reduce in units that each lie inside one rank's partition, not in buckets.

        With an aliased master the layout is one bucket, so partition r is the contiguous
        range [r·C, (r+1)·C) of the flat buffer. Cutting each partition into units of at most
        `unit_numel` elements lets backward send every unit to its owner (a reduce, the volume
        of a reduce-scatter in all) as soon as its params are done, instead of one
        reduce-scatter of the whole model after backward. `pieces` and `param_pieces` then
        index units instead of buckets."""
        lay, unit_numel = self.layout, max(CHUNK_ALIGNMENT, unit_numel)
        self.units = []
        for owner in range(lay.world_size):
            start, end = owner * lay.chunk, (owner + 1) * lay.chunk
            self.units += [(lo, min(unit_numel, end - lo), owner)
                           for lo in range(start, end, unit_numel)]
        self.pieces = [lay.range_pieces(lo, lo + n) for lo, n, _ in self.units]
        self.param_pieces = [[] for _ in self.params]
        for u, pieces in enumerate(self.pieces):
            for i, param_offset, unit_offset, length in pieces:
                self.param_pieces[i].append((u, param_offset, unit_offset, length))

    def unit(self, tensor, u):
        lo, length, _ = self.units[u]
        return tensor.narrow(0, lo, length)

    def reduce_numel(self, k):
        """Elements of reduction k: unit k, or bucket k."""
        return self.units[k][1] if self.units is not None else self.layout.bucket

    def partition_slice(self, tensor, u):
        """The part of a partition-sized tensor that unit u (owned by this rank) covers."""
        lo, length, _ = self.units[u]
        return tensor.narrow(0, lo - self.rank * self.layout.chunk, length)

    @property
    def master_grad_in_full_grads(self):
        """The master's gradient is (this rank's range of) the full gradient buffer: stages
        0 and 1 with an fp32 master that is, or aliases, the flat params."""
        return (self.master_is_flat or self.master_aliases_flat) and self.full_grads is not None

    def own_chunks(self, flat):
        """This rank's chunks of a flat-layout tensor as a [K, C] view."""
        lay = self.layout
        return flat.view(lay.num_buckets, lay.world_size, lay.chunk)[:, self.rank, :]

    def master_chunk(self, tensor, k):
        return tensor.narrow(0, k * self.layout.chunk, self.layout.chunk)

    def flat_bucket(self, tensor, k):
        return tensor.narrow(0, k * self.layout.bucket, self.layout.bucket)

    def replicated_runs(self):
        """(partition_start, length) of this rank's elements of params that are not sharded by
        tensor parallelism (no `model_parallel` / `tensor_model_parallel` attribute)."""
        if self._replicated_runs is None:
            lay, runs = self.layout, []
            for param, start, n in zip(self.params, lay.offsets, lay.numels):
                if not (getattr(param, "model_parallel", False)
                        or getattr(param, "tensor_model_parallel", False)):
                    runs += [(part_start, length) for _, part_start, length
                             in lay.partition_runs(self.rank, start, start + n)]
            self._replicated_runs = runs
        return self._replicated_runs

    def adopt_grad(self, i):
        """Make param i's grad the view of the full gradient buffer again (after set_to_none)."""
        param, view = self.params[i], self.grad_views[i]
        if param.grad is view:
            return
        if param.grad is None:
            param.grad = view.zero_()
        elif param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view
