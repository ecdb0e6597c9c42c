"""ZeRO stage 3: partitioned parameters, gradients and optimizer state (what DeepSpeed's
deepspeed/runtime/zero/stage3.py does).

Parameters are partitioned one by one (zero/stages/partition_parameters.py) and gathered on demand
(zero/stages/param_coordinator.py). This module owns what the optimizer needs:

- sub-groups: the trainable parameters of each optimizer param group, in order, cut into runs
  of at most `sub_group_size` partition elements. Per sub-group the parameters' partitions
  (`ds_tensor`) become views of one flat buffer of the model dtype, and the fp32 master is
  that buffer itself (fp32) or an fp32 copy (fp16/bf16). The torch optimizer steps the masters,
  so its state exists for this rank's partition only.
- gradients: when a parameter's gradient is complete (post-accumulate-grad hook) it joins a
  bucket; a full bucket (`reduce_bucket_size` elements) is laid out rank-major -- piece r of
  every gradient in row r -- pre-divided by the world size and reduce-scattered, so each rank
  receives its piece of every gradient, which is added to the fp32 partition gradient. This
  happens every micro-step (as in DeepSpeed); `overlap_comm` keeps two buckets in flight.
  The fp32 partition gradients exist from backward to the step only (DeepSpeed keeps them for
  the whole run): the first backward after a step keeps each bucket's reduced piece and
  places the pieces into a fresh flat gradient at its end, after the gathered parameters are
  released. So the memory of those gathered parameters and of the partition gradients is never
  live at once: at the end of forward, this rank's peak, it holds 12Ψ/N of model states.
- step: release all gathered parameters, check overflow (fp16), global norm over DP and TP
  (replicated params counted on TP rank 0 only), step on the gradients unscaled and clipped
  (one divisor, applied inside the Adam kernel where it takes one: masters.py), copy fp32
  masters back into the partitions.
"""

import bisect
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from zero.comm.communicator import Pending
from zero.errors import ZeroError
from zero.offload.param_swapper import is_swapped, read_shard
from zero.stages.masters import DeviceMasters
from zero.stages.partition_parameters import ParamStatus, is_zero_param
from zero.stages.partitioned_optimizer import PartitionedOptimizer
from zero.stages.param_coordinator import ParamCoordinator, Stage3Knobs

NOT_PARTITIONABLE = (torch.optim.LBFGS, torch.optim.SparseAdam)


@dataclass(frozen=True)
class Stage3Settings:
    """What the config decides for stage 3 (zero/stages/build.py fills it from the config,
    where each key's default lives)."""
    reduce_bucket_size: int
    overlap_comm: bool
    reduce_scatter: bool
    gradient_clipping: float
    sub_group_size: int
    knobs: Stage3Knobs
    stage: ClassVar[int] = 3


def check_partitionable(optimizer):
    """Stage 3 steps each rank's slice of flat parameters: the optimizer must be a torch
    optimizer whose update is element-wise."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ZeroError(f"ZeRO stage 3 needs a torch.optim.Optimizer (it replaces the param "
                        f"groups' tensors by this rank's partitions); got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    if isinstance(optimizer, NOT_PARTITIONABLE):
        raise ZeroError(f"ZeRO stage 3 cannot partition torch.optim.{type(optimizer).__name__}:"
                        " its step needs whole parameters (LBFGS: the full flat vector and a "
                        "closure; SparseAdam: sparse gradients). Use Adam, AdamW, SGD, Adagrad")


class SubGroup:
    """A run of parameters whose partitions are packed into one flat buffer and one master.

    Partitions in memory: `flat` (model dtype) holds them and the `ds_tensor`s are its views.
    Swapped partitions (offload_param nvme): `flat` is None and each shard stays in its swap
    file. The fp32 master comes from the master store: the flat buffer itself when it is fp32
    and the store allows it, else a tensor of its own (its values: `partitions()`).
    """

    def __init__(self, params, mp_rank, masters):
        self.params = params
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        total = sum(self.sizes)
        self.swapped = [is_swapped(p) for p in params]
        self.flat = None
        if not any(self.swapped):
            first = params[0].ds_tensor
            self.flat = torch.empty(total, dtype=first.dtype, device=first.device)
            with torch.no_grad():
                for param, offset, size in zip(params, self.offsets, self.sizes):
                    view = self.flat.narrow(0, offset, size)
                    view.copy_(param.ds_tensor)
                    param.ds_tensor = view
        self.master_is_flat = masters.can_alias and self.flat is not None \
            and self.flat.dtype == torch.float32
        device = self.flat.device if self.flat is not None else torch.device("cpu")
        self.master = masters.new_master(total, device,
                                         alias=self.flat if self.master_is_flat else None)
        # master.grad: None between a step and the next backward, unless the store keeps
        # persistent gradient buffers (offload: host memory, allocated once)
        if not masters.frees_grads:
            self.master.grad = masters.grad_buffer(self.master)
        # (start, length) of params replicated over TP: their norm counts on TP rank 0 only
        self.replicated_runs = [] if mp_rank == 0 else [
            (o, s) for p, o, s in zip(params, self.offsets, self.sizes)
            if not (getattr(p, "model_parallel", False)
                    or getattr(p, "tensor_model_parallel", False))]

    def partitions(self):
        """(this rank's piece of each parameter in memory, its offset), one at a time."""
        for param, offset in zip(self.params, self.offsets):
            yield read_shard(param), offset

    @torch.no_grad()
    def write_tile(self, start, updated, pending):
        """Partition elements [start, start + len(updated)) <- updated (fp32); writes to
        swapped shards go to their files in the background (appended to `pending`)."""
        if self.flat is not None:
            self.flat.narrow(0, start, updated.numel()).copy_(updated)
            return
        end = start + updated.numel()
        i = bisect.bisect_right(self.offsets, start) - 1
        while i < len(self.params) and self.offsets[i] < end:
            param, offset = self.params[i], self.offsets[i]
            lo, hi = max(start, offset), min(end, offset + self.sizes[i])
            values = updated[lo - start:hi - start]
            if self.swapped[i]:
                pending.append(param.ds_swapper.write(param, values, lo - offset))
            else:
                param.ds_tensor.narrow(0, lo - offset, hi - lo).copy_(values)
            i += 1


class Stage3Optimizer(PartitionedOptimizer):
    """Wraps a torch optimizer for ZeRO stage 3 (the interface of stage1_2.ZeroOptimizer).

    `module`'s parameters must already be ZeRO parameters over `dp_comm`.
    """

    def __init__(self, optimizer, module, settings, dp_comm, mp_comm=None, mp_rank=0,
                 loss_scaler=None, masters=None):
        check_partitionable(optimizer)
        self.settings, self.masters = settings, masters or DeviceMasters()
        self.dp_comm, self.mp_comm, self.mp_rank = dp_comm, mp_comm, mp_rank
        self.loss_scaler = loss_scaler
        self.partition_count = dp_comm.world_size
        self.coordinator = ParamCoordinator(module, settings.knobs)
        self.param_names = {p: n for n, p in module.named_parameters()}
        self.sub_groups = self._build_sub_groups(optimizer, module)
        self.location = {}  # param -> (sub-group, offset in its flat)
        for sub_group in self.sub_groups:
            for param, offset in zip(sub_group.params, sub_group.offsets):
                self.location[param] = (sub_group, offset)
                param.ds_on_partition_update = self._partition_updated
        self.optimizer = self.masters.finish(optimizer)
        self._describe_partitions()
        self.refresh_masters_from_model()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for p in self.location]
        self._hooks += [p.register_hook(partial(_shape_for_accumulation, p))
                        for p in self.location]
        self._bucket, self._bucket_numel, self._in_flight = [], 0, []
        self._unplaced = []  # (sub-group, offset, reduced piece) until the end of backward

    # ----- construction -----

    def _build_sub_groups(self, optimizer, module):
        model_params = {id(p) for p in module.parameters()}
        sub_groups = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            for p in group["params"]:
                optimizer.state.pop(p, None)
            if any(id(p) not in model_params or not is_zero_param(p) for p in params):
                raise ZeroError("the optimizer holds parameters that are not parameters of the "
                                "model given to zero.initialize")
            runs = self._cut(params)
            group["params"] = []
            for run in runs:
                kinds = {(p.ds_tensor.dtype, str(p.ds_tensor.device)) for p in run}
                if len(kinds) > 1:
                    raise ZeroError("all parameters of one optimizer param group must share "
                                    f"dtype and device; found {sorted(kinds, key=str)}")
                sub_group = SubGroup(run, self.mp_rank, self.masters)
                group["params"].append(sub_group.master)
                sub_groups.append(sub_group)
        return sub_groups

    def _partition_pieces(self, rank):
        """{master: [Piece]}: rank holds elements [r·s, (r+1)·s) of every parameter (s its
        partition size; the padding past the end of a parameter belongs to none). Pieces are
        named by parameter name: sub-groups are cut differently at other DP sizes."""
        from zero.optim.pieces import Piece
        found = {}
        for sub_group in self.sub_groups:
            found[sub_group.master] = [
                Piece(offset, min(size, param.ds_numel - rank * size), self.param_names[param],
                      rank * size, param.ds_numel, self._whole_numel(param, param.ds_numel))
                for param, offset, size in zip(sub_group.params, sub_group.offsets,
                                               sub_group.sizes)
                if param.ds_numel > rank * size]
        return found

    def _weight_runs(self):
        """(key, [(start, length)]) per master: its elements that the weights' norm counts."""
        rank = self.dp_comm.rank
        for key, sub_group in enumerate(self.sub_groups):
            yield key, [(offset, min(size, param.ds_numel - rank * size))
                        for param, offset, size in zip(sub_group.params, sub_group.offsets,
                                                       sub_group.sizes)
                        if param.ds_numel > rank * size and self._counts_in_weights_norm(param)]

    def _master_grad(self, key):
        return self.sub_groups[key].master.grad

    def _cut(self, params):
        runs, run, numel = [], [], 0
        for param in params:
            size = param.ds_tensor.numel()
            if run and numel + size > self.settings.sub_group_size:
                runs.append(run)
                run, numel = [], 0
            run.append(param)
            numel += size
        return runs + ([run] if run else [])

    def _partition_updated(self, param):
        """GatheredParameters(modifier_rank=...) changed param's partition: follow in fp32."""
        sub_group, offset = self.location[param]
        self.masters.write(self.sub_groups.index(sub_group), offset, read_shard(param).float())

    def forward_context(self):
        """Wrap the module's forward: saved parameters become re-gatherable references."""
        return self.coordinator.saved_tensor_hooks()

    # ----- backward: bucketed reduce-scatter into the partition gradients -----

    def backward(self, loss, reduce_gradients=True, grad=None, retain_graph=False):
        """loss.backward() with loss scaling (or loss.backward(grad), `grad` already scaled);
        gradients are reduced every micro-step."""
        scaled = loss * self.cur_scale if self.loss_scaler is not None and grad is None \
            else loss
        try:
            self._inside_backward = True
            with self.coordinator.saved_tensor_hooks():  # recomputation inside backward
                scaled.backward(grad, retain_graph=retain_graph)
            self._flush()
            while self._in_flight:
                self._in_flight.pop(0).wait()
        finally:
            self._inside_backward = False
            self._bucket, self._bucket_numel = [], 0
            self.coordinator.end_backward()  # first, so the gathered params are freed
            self._place_gradients()

    def _grad_ready(self, param):
        self._refuse_gradients_outside_backward()
        grad, param.grad = param.grad, None
        if param.ds_status is ParamStatus.NOT_AVAILABLE:  # drop the shape-only placeholder
            param.data = torch.empty(0, dtype=param.data.dtype, device=param.data.device)
        if grad is not None and self._reduces_in_place(param, grad):
            self._reduce([param], [param.ds_tensor.numel()],
                         grad.view(self.dp_comm.world_size, -1))
        elif grad is not None:
            self._bucket.append((param, grad))
            self._bucket_numel += grad.numel()
            if self._bucket_numel >= self.settings.reduce_bucket_size:
                self._flush()
        self.coordinator.release_after_backward(param)

    def _reduces_in_place(self, param, grad):
        """A large gradient that is already laid out rank-major (contiguous, no padding: piece
        r of it is rank r's partition) is reduce-scattered on its own, in place: no copy into
        a bucket (a quarter of `reduce_bucket_size` or more, so the collectives stay few)."""
        return grad.numel() >= self.settings.reduce_bucket_size // 4 and grad.is_contiguous() \
            and grad.numel() == param.ds_tensor.numel() * self.dp_comm.world_size

    def _flush(self):
        if not self._bucket:
            return
        items = sorted(self._bucket, key=lambda item: item[0].ds_id)  # same order on all ranks
        self._bucket, self._bucket_numel = [], 0
        world = self.dp_comm.world_size
        sizes = [p.ds_tensor.numel() for p, _ in items]
        rows = torch.empty(world, sum(sizes), dtype=items[0][1].dtype,
                           device=items[0][1].device)
        offset = 0
        for (param, grad), size in zip(items, sizes):
            _copy_rank_major(rows.narrow(1, offset, size), grad.reshape(-1), size)
            offset += size
        params = [p for p, _ in items]
        del items  # the full gradients can go now
        self._reduce(params, sizes, rows)

    def _reduce(self, params, sizes, rows):
        """Reduce-scatter `rows` ([world, total]: row r = rank r's pieces, of `sizes`, of
        `params`' gradients one after another), then add this rank's row to the partition
        gradients."""
        world = self.dp_comm.world_size
        # average: fp32 sums scale the reduced partition as it is accumulated (1/N of the
        # bucket); 16-bit sums could overflow, so those buckets are divided first
        post_scale = 1.0 / world if rows.dtype == torch.float32 else 1.0
        if world > 1 and post_scale == 1.0:
            rows.mul_(1.0 / world)
        out = rows[self.dp_comm.rank]  # reduced in place: no second [total] buffer
        async_op = self.settings.overlap_comm
        while async_op and len(self._in_flight) >= 2:  # bound the buckets in flight
            self._in_flight.pop(0).wait()
        flat = rows.view(-1)
        if self.settings.reduce_scatter:
            pending = self.dp_comm.reduce_scatter(out, flat, async_op=async_op)
        else:
            pending = Pending(self.dp_comm.all_reduce(flat, async_op=async_op),
                              partial(out.copy_, rows[self.dp_comm.rank]))
        self._in_flight.append(Pending(pending, partial(self._accumulate, params, sizes, out,
                                                        post_scale)))
        if not async_op:
            self._in_flight.pop().wait()

    def _accumulate(self, params, sizes, reduced, scale):
        """The bucket's reduce-scatter is done: add this rank's pieces to the partition
        gradients (or keep them, scaled, until the end of backward); the bucket can go."""
        offset, kept = 0, None
        for param, size in zip(params, sizes):
            sub_group, start = self.location[param]
            grad = sub_group.master.grad
            if grad is not None:
                if reduced.device != grad.device:  # offloaded masters: one copy per bucket
                    reduced = reduced.to(grad.device)
                grad.narrow(0, start, size).add_(reduced.narrow(0, offset, size), alpha=scale)
            else:  # first backward since the step: keep the piece (its own memory, scaled)
                if kept is None:
                    kept = reduced.clone() if scale == 1.0 else reduced.mul(scale)
                self._unplaced.append((sub_group, start, kept.narrow(0, offset, size)))
            offset += size

    def _place_gradients(self):
        """Copy the kept pieces into fresh flat partition gradients (zero where a parameter
        got no gradient). A parameter shared by two reentrant checkpointed segments reports
        twice: its second piece is added."""
        pieces = {}
        for sub_group, start, piece in self._unplaced:
            pieces.setdefault(sub_group, []).append((start, piece))
        self._unplaced = []
        for sub_group, placed in pieces.items():
            grad = torch.empty_like(sub_group.master)
            end = 0
            for start, piece in sorted(placed, key=lambda item: item[0]):
                target = grad.narrow(0, start, piece.numel())
                if start < end:  # the same parameter again
                    target.add_(piece)
                    continue
                if start > end:
                    grad.narrow(0, end, start - end).zero_()
                target.copy_(piece)
                end = start + piece.numel()
            if end < grad.numel():
                grad.narrow(0, end, grad.numel() - end).zero_()
            sub_group.master.grad = grad

    def _ensure_gradients(self):
        """Zero partition gradients for sub-groups no backward reached (a step without one)."""
        for sub_group in self.sub_groups:
            if sub_group.master.grad is None:
                sub_group.master.grad = torch.zeros_like(sub_group.master)

    # ----- step -----

    def zero_grad(self, set_to_none=True):
        for sub_group in self.sub_groups:
            if set_to_none and self.masters.frees_grads:
                sub_group.master.grad = None
            elif sub_group.master.grad is not None:
                sub_group.master.grad.zero_()
        for param in self.location:
            param.grad = None

    def step(self):
        """Release gathered params, unscale, check overflow, clip, step, publish. False if
        the step was skipped (inf/nan gradients)."""
        self.coordinator.end_step()
        self._ensure_gradients()
        norm_sq, overflow = self._grad_norm_sq()
        return self._finish_step(norm_sq, overflow)

    def _step_partitions(self, grad_divisor):
        """Step the fp32 masters on their gradients / grad_divisor; each updated range goes
        straight into the partitions (flat buffer, or the shards' swap files, written in the
        background)."""
        pending = []
        self.masters.step(partial(self._write_partition, pending), grad_divisor)
        for p in pending:
            p.wait()

    @torch.no_grad()
    def publish_masters(self):
        pending = []
        self.masters.publish(partial(self._write_partition, pending))
        for p in pending:
            p.wait()

    def _write_partition(self, pending, key, lo, values):
        self.sub_groups[key].write_tile(lo, values, pending)

    def _grad_norm_sq(self):
        """(squared norm of the averaged, loss-scaled gradient over DP and TP, overflow)."""
        device = self.dp_comm.scalar_device(self.sub_groups[0].master if self.sub_groups
                                            else torch.empty(0))
        counted = torch.zeros((), dtype=torch.float64, device=device)
        everything = counted.clone()
        for sub_group in self.sub_groups:
            counted_part, all_part = self._partition_norm_sq(sub_group.master.grad,
                                                             sub_group.replicated_runs, device)
            counted += counted_part
            everything += all_part
        return self._global_norm_sq(counted, everything)

    @torch.no_grad()
    def refresh_masters_from_model(self):
        for key, sub_group in enumerate(self.sub_groups):
            if not sub_group.master_is_flat:
                for piece, offset in sub_group.partitions():
                    self.masters.write(key, offset, piece.float())

    def remove_hooks(self):
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.coordinator.remove_hooks()

    # ----- accounting (benchmarks, tests) -----

    def model_state_bytes(self):
        """This rank's model-state bytes by category (what the ZeRO paper's formulas count).
        The partition gradients count at their size whether or not they exist right now."""
        def nbytes(t):
            return t.untyped_storage().nbytes() if t is not None else 0
        partitions = sum(nbytes(g.flat) for g in self.sub_groups)
        partitions += sum(nbytes(p.ds_tensor) for g in self.sub_groups
                          for p, swapped in zip(g.params, g.swapped) if swapped)  # 0: on disk
        frozen = sum(nbytes(p.ds_tensor) for p in self.coordinator.owner
                     if p not in self.location)
        gathered = sum(nbytes(p.ds_full) for p in self.coordinator.owner
                       if p.ds_full is not None)
        return {"parameters": partitions + frozen,
                "gradients": sum(g.master.numel() * 4 for g in self.sub_groups),
                "master_weights": self.masters.master_bytes(),
                "optimizer_states": self.masters.state_bytes(),
                "gathered_parameters": gathered}

    def close(self):
        """Delete the swap files (optimizer states and parameter shards)."""
        super().close()
        for param in self.location:
            if is_swapped(param):
                param.ds_swapper.forget([param])


def _shape_for_accumulation(param, grad):
    """Before autograd accumulates a gradient into a released parameter (one backward did not
    need, e.g. an embedding table): give it its shape without memory -- a zero-stride view --
    since autograd lays the new .grad out like the parameter."""
    if param.ds_status is ParamStatus.NOT_AVAILABLE and param.data.numel() != param.ds_numel:
        param.data = torch.zeros(1, dtype=param.data.dtype,
                                 device=param.data.device).expand(param.ds_shape)
    return None


def _copy_rank_major(rows, flat, size):
    """rows [world, size] <- flat [numel] cut into pieces of `size`; what flat does not fill
    (the padding of the last piece and any rows after it) is zeroed."""
    full = flat.numel() // size if size else 0
    if full:
        rows.narrow(0, 0, full).copy_(flat.narrow(0, 0, full * size).view(full, size))
    rest = flat.numel() - full * size
    if rest:
        rows[full].narrow(0, 0, rest).copy_(flat.narrow(0, full * size, rest))
        rows[full].narrow(0, rest, size - rest).zero_()
        full += 1
    if full < rows.shape[0]:
        rows.narrow(0, full, rows.shape[0] - full).zero_()
