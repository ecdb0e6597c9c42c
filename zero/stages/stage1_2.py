"""ZeRO stages 0, 1 and 2: partitioned optimizer state and gradients over flat buffers.

Each param group lives in one flat buffer cut into buckets whose chunk n belongs to rank n
(`zero/stages/flat_buffers.py`). Rank r keeps the fp32 master weights, the reduced gradient and the
optimizer state of its partition only.

- stage 0: one partition. Gradients accumulate in a flat gradient buffer (`param.grad` are
  views of it) and are all-reduced bucket by bucket during the last micro-step's backward.
- stages 0 and 1: a step may release the views (`param.grad` None, as after DeepSpeed's step;
  `_releases_grads_after_step`), so the next backward's fresh gradients are copied into them
  instead of added into a zeroed buffer.
- stages 0 and 1 with one data-parallel rank and masters on the device: the buckets are
  handled after backward, without per-parameter hooks (nothing to overlap).
- stage 1: gradients accumulate locally in the flat gradient buffer; during the last
  micro-step's backward each bucket is reduce-scattered as soon as all its params are done.
- stage 2: no full gradient buffer. Every micro-step each finished gradient is copied into its
  bucket's buffer and freed; full buckets are reduce-scattered and accumulated into the
  partition gradient. At most two buckets are in flight when `overlap_comm` is set.
- stage 1 and 2 with fp32 params and DP > 1: the group is one bucket, so partition r is the
  contiguous range r of the flat buffer and the fp32 master partition is a view of it (stage
  1: its gradient too, of the full gradients) with no copies (`_alias_master_in_flat`).
  Backward then cuts each partition into `reduce_bucket_size` units and sends every unit to
  its owner (a reduce: the volume of a reduce-scatter in all) as soon as its params are done.

Backward's reduction, bucket by bucket in one fixed order on every rank, is
`zero/stages/bucket_reduction.py`. After the optimizer steps its partition, each bucket is
all-gathered back into the flat buffer.
"""

from dataclasses import dataclass
from functools import partial

import torch

from zero.errors import ZeroError
from zero.stages.bucket_reduction import BucketReduction, add_into, reduces_in_masters
from zero.stages.flat_buffers import FlatGroup, FlatLayout
from zero.stages.masters import DeviceMasters
from zero.stages.partitioned_optimizer import PartitionedOptimizer


@dataclass(frozen=True)
class ZeroSettings:
    """What the config decides for stages 0-2 (zero/stages/build.py fills it from the config,
    where each key's default lives)."""
    stage: int
    reduce_bucket_size: int
    overlap_comm: bool
    reduce_scatter: bool
    prescale_gradients: bool
    gradient_predivide_factor: float
    gradient_clipping: float
    ignore_unused_parameters: bool
    fp32_communication: bool  # stage 0: all-reduce 16-bit gradients in fp32 (their masters)
    external_reduction: bool  # the module reduces its own gradients (torch DDP), stage 0
    # stage 0, 16-bit params: micro batches' gradients summed, and reduced, in the fp32
    # masters' gradients
    fp32_accumulation: bool = False


class ZeroOptimizer(PartitionedOptimizer):
    """Wraps a torch optimizer: ZeRO partitioning, mixed precision, loss scaling, clipping.

    `param_order` maps each model parameter to its registration index in the module (it fixes
    the bucket launch order); `dp_comm`/`mp_comm` are zero.comm Communicators over the data-
    and model-parallel groups (`pp_comm` over the pipeline's stages, None without pipeline
    parallelism); `loss_scaler` is None unless fp16; `masters` the master store
    (zero/stages/masters.py; default DeviceMasters).
    """

    def __init__(self, optimizer, param_order, settings, dp_comm, mp_comm=None, mp_rank=0,
                 loss_scaler=None, masters=None, pp_comm=None):
        if settings.stage not in (0, 1, 2):
            raise ZeroError(f"ZeroOptimizer handles stages 0-2, got stage {settings.stage}")
        self.settings, self.masters = settings, masters or DeviceMasters()
        self.dp_comm, self.mp_comm, self.mp_rank = dp_comm, mp_comm, mp_rank
        self.pp_comm = pp_comm
        self.loss_scaler = loss_scaler
        self.partition_count = 1 if settings.stage == 0 else dp_comm.world_size
        self.partition_rank = 0 if settings.stage == 0 else dp_comm.rank
        self._pre_factor, self._post_factor = self._averaging_factors()
        self.groups = self._flatten_param_groups(optimizer, param_order)
        self.optimizer = self.masters.finish(optimizer)
        self._describe_partitions()
        self.refresh_masters_from_model()
        self._reduction = BucketReduction(self.groups, settings, dp_comm, param_order,
                                          self._pre_factor, self._post_factor,
                                          self.partition_rank)
        self._hooked = self._reduces_during_backward()
        self._hooks = []
        if self._hooked:
            self._hooks = [
                param.register_post_accumulate_grad_hook(partial(self._grad_ready, g, i))
                for g, group in enumerate(self.groups) for i, param in enumerate(group.params)]
        self._reducing = False
        self._releases_grads = self._releases_grads_after_step()
        self._grads_released = False
        self._backward_since_zero_grad = False
        # fp32 sums on one rank, where nothing is reduced: the step adds the last micro
        # batch's gradients, as param.grad holds them then (edited after backward too)
        self._sums_at_step = settings.fp32_accumulation and dp_comm.world_size == 1

    # ----- construction -----

    def _reduces_during_backward(self):
        """Whether each bucket is handled while backward runs, as soon as a hook on every
        parameter says it is complete: with several data-parallel ranks (its reduction
        overlaps backward), at stage 2 (each gradient is moved out and freed) and with
        offloaded masters (each bucket's copy to the host overlaps backward). Otherwise, at
        stage 0 or 1 on one rank, the gradients accumulate in place in the flat buffer
        (`param.grad` are views of it) and the reduction handles every bucket after
        backward, sparing a Python call per parameter: host time a fast GPU waits for."""
        return self.dp_comm.world_size > 1 or self.settings.stage == 2 \
            or not isinstance(self.masters, DeviceMasters)

    def _releases_grads_after_step(self):
        """Whether zero_grad leaves `param.grad` None at stage 0 or 1, so that the first
        backward after a step hands autograd's fresh gradients over (each then copied into its
        view) instead of adding them into a buffer zeroed for it: one pass over the gradients
        instead of a fill and an add (measured in docs/benchmarks.md). With hooks each is
        copied as it arrives. Without hooks they are all copied after backward,
        so its end holds a second copy of the gradients: taken on the CPU, not on a GPU, where
        the fill and the add are a fraction of a percent and device memory is what runs out."""
        if self.settings.stage == 2 or not self.groups:
            return False
        return self._hooked or self.groups[0].device.type == "cpu"

    def _averaging_factors(self):
        """(pre, post): grads are multiplied by `pre` before the sum over ranks, `post` after."""
        s, world = self.settings, self.dp_comm.world_size
        if s.prescale_gradients:
            return 1.0 / world, 1.0
        pre = 1.0 / s.gradient_predivide_factor
        if self.loss_scaler is not None and s.stage > 0:
            pre = 1.0 / world  # fp16 sums over ranks could overflow where the mean does not
        return pre, 1.0 / (world * pre)

    def _flatten_param_groups(self, optimizer, param_order):
        groups = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            unknown = [p for p in params if p not in param_order]
            if unknown:
                raise ZeroError(f"the optimizer holds {len(unknown)} parameter(s) that are not "
                                "parameters of the model given to zero.initialize")
            for p in group["params"]:
                optimizer.state.pop(p, None)
            if not params:
                group["params"] = []
                continue
            kinds = {(p.dtype, str(p.device)) for p in params}
            if len(kinds) > 1:
                raise ZeroError("all parameters of one optimizer param group must share dtype "
                                f"and device; found {sorted(kinds, key=str)}")
            numels = [p.numel() for p in params]
            alias = self._alias_master_in_flat(params[0].dtype)
            bucket = sum(numels) if alias else self.settings.reduce_bucket_size
            layout = FlatLayout(numels, self.partition_count, bucket)
            flat = FlatGroup(params, layout, self.partition_rank, self.settings.stage < 2,
                             self.masters, alias)
            if flat.master_aliases_flat:
                flat.use_owner_units(self.settings.reduce_bucket_size)
            group["params"] = [flat.master]
            groups.append(flat)
        return groups

    def _partition_pieces(self, rank):
        """{master: [Piece]}: which parameter elements rank's partition of each group holds."""
        from zero.optim.pieces import Piece
        return {group.master: [
            Piece(start, length, self.piece_name(g, i), offset, group.layout.numels[i],
                  self._whole_numel(group.params[i], group.layout.numels[i]))
            for start, i, offset, length in group.layout.partition_param_pieces(rank)]
            for g, group in enumerate(self.groups)}

    def _weight_runs(self):
        """(key, [(start, length)]) per master: its elements that the weights' norm counts."""
        for g, group in enumerate(self.groups):
            yield g, [(start, length) for start, i, _, length
                      in group.layout.partition_param_pieces(group.rank)
                      if self._counts_in_weights_norm(group.params[i])]

    def _master_grad(self, key):
        return self.groups[key].master.grad

    @staticmethod
    def piece_name(g, i):
        """The name of parameter i of group g in its pieces (the same at any DP size)."""
        return (g, i)

    def _alias_master_in_flat(self, dtype):
        """Stage 1/2 with fp32 params: the master partition is this rank's chunk of the flat
        params (stage 1: its gradient this rank's chunk of the full gradients), not a copy,
        so model states are the fp32 formulas 4Ψ + 4Ψ + 8Ψ/N and 4Ψ + 12Ψ/N. That needs the
        partition to be one contiguous range, i.e. a single bucket, reduced in owner units
        (FlatGroup.use_owner_units). With 16-bit params the master is a copy anyway and the
        partition stays K strided bucket chunks, reduce-scattered bucket by bucket."""
        return self.settings.stage in (1, 2) and dtype == torch.float32 \
            and self.partition_count > 1 and self.masters.can_alias

    # ----- backward: bucketed reduction -----

    def backward(self, loss, reduce_gradients, grad=None, retain_graph=False):
        """loss.backward() with loss scaling (or loss.backward(grad), `grad` already scaled);
        reduce over data parallel if `reduce_gradients` (stage 2 always reduces: it keeps no
        full gradients between micro-steps)."""
        self._backward_since_zero_grad = True
        self._reducing = (reduce_gradients and not self.settings.external_reduction) \
            or self.settings.stage == 2
        reduced_earlier = []
        if not self._reduction.fresh_partition_grads:  # a backward reduced since zero_grad
            if self.settings.stage == 1:
                reduced_earlier = self._restart_reduced_full_grads()
            elif self.settings.fp32_accumulation:
                reduced_earlier = self._restart_after_reduced_masters()
        if self.settings.stage < 2 and not self._grads_released:
            self._adopt_grads()  # the user may have set grads to None (zero_grad)
        scaled = loss * self.cur_scale if self.loss_scaler is not None and grad is None \
            else loss
        try:
            self._inside_backward = True
            scaled.backward(grad, retain_graph=retain_graph)
            if self.settings.stage < 2 and (self._grads_released or not self._hooked):
                # what the hooks would have caught, or no hook saw: the gradients autograd
                # handed over (released views) or something else put in place, and the
                # zeros of parameters that took no gradient
                self._adopt_grads()
                self._grads_released = False
            if self._reducing and not self._sums_at_step:
                self._reduction.finish()
            elif self.settings.fp32_accumulation and not self._reducing:
                self._sum_into_masters()
            for partition_grad, earlier in reduced_earlier:
                partition_grad.add_(earlier)
        finally:
            self._inside_backward = self._reducing = False
            self._reduction.reset()

    def _restart_reduced_full_grads(self):
        """Stage 1, a backward after one that reduced, before the step (two losses
        backpropagated at the accumulation boundary): the partitions already hold the
        reduced gradients so far, so the full gradients restart from zero and this backward's
        reduction adds to the partitions. Where a partition's gradient is (a range of) the full
        gradients (an fp32 master aliasing the flat buffer, or being it on one rank) it is kept
        aside and added back after the reduction: returns those (partition gradient, kept
        copy) pairs."""
        if not self._reducing:
            raise ZeroError("a backward pass with reduce_gradients=False after one that reduced "
                            "the gradients, before the step: at ZeRO stage 1 its gradients "
                            "would never reach the optimizer's partitions. Let the last "
                            "backward before the step reduce")
        kept = []
        for group in self.groups:
            if group.master_grad_in_full_grads:
                kept.append((group.master.grad, group.master.grad.clone()))
            group.full_grads.zero_()
        return kept

    def _restart_after_reduced_masters(self):
        """Stage 0 summing in fp32 over several ranks (one rank reduces nothing: it sums at
        the step), a backward after one that reduced, before the step: the fp32 masters'
        gradients hold the reduced sum so far and the flat buffer the last micro batch's
        gradients, already in it. The buffer starts empty and this backward's reduction
        reduces its own gradients, the sum so far kept aside and added back after (returns
        those (master gradient, kept copy) pairs); a backward that does not reduce is refused:
        its gradients would join the sum unreduced."""
        if not self._reducing:
            raise ZeroError("a backward pass with reduce_gradients=False after one that "
                            "reduced the gradients, before the step: summed in fp32 at ZeRO "
                            "stage 0, its gradients would reach the optimizer without the "
                            "reduction over data parallelism. Let the last backward before "
                            "the step reduce")
        self._empty_full_grads()
        self._reduction.summed_in_masters = False
        return [(group.master.grad, group.master.grad.clone()) for group in self.groups
                if reduces_in_masters(self.settings, group)]

    def _sum_into_masters(self):
        """Stage 0 summing in fp32, after a backward that did not reduce: its 16-bit gradients
        are added into the fp32 masters' gradients, and the flat buffer starts the next micro
        batch empty (the reduction at the step's last backward adds that one's too)."""
        for group in self.groups:
            if reduces_in_masters(self.settings, group):
                target = group.master.grad
                if self._reduction.summed_in_masters:
                    add_into(target, group.full_grads)
                else:
                    target.copy_(group.full_grads)
        self._reduction.summed_in_masters = True
        self._empty_full_grads()

    def _empty_full_grads(self):
        """The full gradient buffer holds nothing: zeroed, or its views released (param.grad
        None: the next backward hands autograd's fresh gradients over)."""
        for group in self.groups:
            if group.full_grads is not None and not self._releases_grads:
                group.full_grads.zero_()
            else:
                for param in group.params:
                    param.grad = None
        self._grads_released = self._releases_grads

    def _adopt_grads(self):
        for group in self.groups:
            for i in range(len(group.params)):
                group.adopt_grad(i)

    def _grad_ready(self, g, i, param):
        self._refuse_gradients_outside_backward()
        if self.settings.stage < 2:
            self.groups[g].adopt_grad(i)
            if not self._reducing:
                return
        self._reduction.grad_ready(g, i, param)

    @property
    def sums_gradients_in_fp32(self):
        """Stage 0 sums the micro batches' 16-bit gradients in the fp32 masters' gradients."""
        return self.settings.fp32_accumulation

    @torch.no_grad()
    def add_to_gradient(self, param, grad):
        """Adds `grad` to `param`'s gradient of this step: a gradient summed outside this
        engine's backward (the pipeline's tied output layer on another stage), given before
        the backward that reduces the step's gradients. Where stage 0 sums in fp32 it joins
        the fp32 masters' sums (an fp32 `grad` is not rounded to 16 bits); otherwise
        param.grad, in the parameter's dtype."""
        group, index = next(((group, i) for group in self.groups
                             for i, p in enumerate(group.params) if p is param), (None, None))
        if group is None:
            raise ZeroError("add_to_gradient: the parameter is not one this optimizer trains")
        if not (self.settings.fp32_accumulation and reduces_in_masters(self.settings, group)):
            if param.grad is None:
                param.grad = grad.to(param.dtype)
            else:
                param.grad.add_(grad)
            return
        if not self._reduction.summed_in_masters:  # the masters' gradients start the sum
            for each in self.groups:
                if reduces_in_masters(self.settings, each):
                    each.master.grad.zero_()
            self._reduction.summed_in_masters = True
        offset, numel = group.layout.offsets[index], group.layout.numels[index]
        group.master.grad.narrow(0, offset, numel).add_(grad.reshape(-1))

    # ----- step -----

    def zero_grad(self):
        """Zeroes the full gradient buffer, or releases its views (param.grad None; the
        buffer is stale until the next backward or step adopts the gradients into it)."""
        self._empty_full_grads()
        self._reduction.fresh_partition_grads = True
        self._reduction.summed_in_masters = False
        self._backward_since_zero_grad = False

    def step(self):
        """Unscale, check overflow, clip, step the partition, all-gather. False if skipped."""
        self._catch_up_with_loaded_weights()
        if self._backward_reduced_nothing():
            raise ZeroError("step() after backward passes that reduced no gradients (each had "
                            "reduce_gradients=False, or ran inside no_sync()): at ZeRO stage 0 "
                            "each rank would step on its own gradients, at stages 1 and 2 the "
                            "optimizer's partitions would miss them. Let the step's last "
                            "backward reduce (reduce_gradients=True or None, outside no_sync)")
        if self.settings.stage < 2:
            # the buffer holds what param.grad holds (zeros where None): gradients set by
            # hand after backward reach the masters where they read the buffer here (stage 0,
            # fp32 masters that are views of it)
            self._adopt_grads()
            self._grads_released = False
        self._stage_master_grads()
        norm_sq, overflow = self._reduced_grad_norm_sq()
        fold = self._post_factor if self.settings.stage > 0 else 1.0
        return self._finish_step(norm_sq, overflow, fold)

    def _step_partitions(self, grad_divisor):
        """Step the fp32 partitions on their gradients / grad_divisor; each updated range goes
        into this rank's chunks of the model's flat buffers, which are then all-gathered."""
        self.masters.step(self._write_own_chunks, grad_divisor)
        self._all_gather_own_chunks()

    def _backward_reduced_nothing(self):
        """Backward ran since zero_grad and none reduced, where the step needs a reduction:
        stages 1 and 2, and stage 0 over several ranks unless the module reduces (DDP)."""
        if not (self._backward_since_zero_grad and self.groups):
            return False
        if self.settings.stage == 0 and (self.dp_comm.world_size == 1
                                         or self.settings.external_reduction):
            return False
        return self._reduction.fresh_partition_grads

    def _nothing_reduced_since_zero_grad(self):
        """Stages 1 and 2: no backward has reduced into the partition gradients this step."""
        return self.settings.stage > 0 and self._reduction.fresh_partition_grads

    def _stage_master_grads(self):
        """Stage 0 with 16-bit params: the fp32 master's grad is a copy of the reduced grads
        (already there when they were reduced in fp32, or summed there over several ranks;
        copied from the buffer when no backward ran since zero_grad, the gradients set by
        hand; on one rank summing in fp32, the last micro batch's added now). Stages 1 and 2
        after a step with no backward since the last one: zeros, as stage 0 then has (what
        param.grad held, None counting as zeros), not the partition gradients the last step
        used."""
        nothing_reduced = self._nothing_reduced_since_zero_grad()
        for group in self.groups:
            if nothing_reduced:
                group.master.grad.zero_()
            elif self.settings.stage == 0 and not group.master_is_flat:
                if self._sums_at_step and self._reduction.summed_in_masters:
                    add_into(group.master.grad, group.full_grads)
                elif self._sums_at_step or not reduces_in_masters(self.settings, group) \
                        or not self._backward_since_zero_grad:  # gradients set by hand only
                    group.master.grad.copy_(group.full_grads)

    def _reduced_grad_norm_sq(self):
        """(sum of squares of the averaged, loss-scaled gradient over DP and TP, overflow)."""
        fold = self._post_factor if self.settings.stage > 0 else 1.0
        counted = torch.zeros((), dtype=torch.float64, device=self._norm_device())
        everything = counted.clone()
        mp_size = self.mp_comm.world_size if self.mp_comm is not None else 1
        for group in self.groups:
            replicated = group.replicated_runs() if mp_size > 1 and self.mp_rank != 0 else []
            counted_part, all_part = self._partition_norm_sq(group.master.grad, replicated,
                                                             counted.device)
            counted += counted_part
            everything += all_part
        # stage 0: every rank already holds the whole gradient
        return self._global_norm_sq(counted * fold * fold, everything,
                                    over_dp=self.partition_count > 1)

    def _norm_device(self):
        like = self.groups[0].master if self.groups else torch.empty(0)
        return self.dp_comm.scalar_device(like)

    @torch.no_grad()
    def publish_masters(self):
        """Copy the fp32 masters into the model's flat buffers and all-gather them."""
        self.masters.publish(self._write_own_chunks)
        self._all_gather_own_chunks()

    @torch.no_grad()
    def _write_own_chunks(self, g, lo, values):
        """Master elements [lo, lo + n) of group g (fp32) -> this rank's chunks of the model's
        flat buffer (model dtype and device)."""
        group = self.groups[g]
        if group.master_is_flat or group.master_aliases_flat:
            return  # the master is the buffer itself
        lay = group.layout
        own = group.own_chunks(group.flat)  # [K, C]
        non_blocking = self.masters.copies_back_async
        if lo == 0 and values.numel() == lay.partition_numel:
            own.copy_(values.view(lay.num_buckets, lay.chunk), non_blocking=non_blocking)
            return
        start, end, done = lo, lo + values.numel(), 0
        while start < end:
            k, offset = divmod(start, lay.chunk)
            length = min(end - start, lay.chunk - offset)
            own[k, offset:offset + length].copy_(values[done:done + length],
                                                 non_blocking=non_blocking)
            start, done = start + length, done + length

    def _all_gather_own_chunks(self):
        if self.masters.copies_back_async:
            torch.cuda.current_stream().synchronize()  # the non-blocking copies
        pendings = []
        for group in self.groups:
            lay = group.layout
            if lay.world_size == 1:
                continue
            own = group.own_chunks(group.flat)
            for k in range(lay.num_buckets):
                pendings.append(self.dp_comm.all_gather(group.flat_bucket(group.flat, k),
                                                        own[k], async_op=True))
        for pending in pendings:
            pending.wait()

    @torch.no_grad()
    def refresh_masters_from_model(self):
        """Rebuild the fp32 masters from the (possibly 16-bit) model weights."""
        for g, group in enumerate(self.groups):
            if not (group.master_is_flat or group.master_aliases_flat):
                own, chunk = group.own_chunks(group.flat), group.layout.chunk
                for k in range(group.layout.num_buckets):
                    self.masters.write(g, k * chunk, own[k].float())
        self._masters_behind_model = False

    def remove_hooks(self):
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
