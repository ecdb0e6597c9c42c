"""What the stage 0-2 (`zero.stages.stage1_2.ZeroOptimizer`) and stage 3
(`zero.stages.stage3.Stage3Optimizer`) optimizers share: the attributes DeepSpeed's ZeRO
optimizers expose, the rules of a step once the gradient's global norm is known, and the
checkpoint hooks into their master store.

A subclass sets `optimizer`, `masters` (its master store, zero/stages/masters.py),
`loss_scaler` (None unless fp16), `settings.gradient_clipping`, `dp_comm` and `mp_comm`
(zero.comm.communicator.Communicator; None without tensor parallelism), `mp_rank`, `pp_comm`
(None without pipeline parallelism), `partition_count`, and provides `zero_grad()`,
`_step_partitions(grad_divisor)`, `_partition_pieces(rank)`, `_weight_runs()` and
`_master_grad(key)`.
"""

import math

import torch

from zero.errors import CheckpointError, ZeroError

# Elements per piece of a squared norm: one fp32 reduction over millions of elements
# (torch.linalg.vector_norm on CPU) comes out up to 1e-3 low; pieces of 2**14 summed in
# float64 stay within ~1e-6 (docs/design/grad-norm.md).
_NORM_PIECE = 1 << 14


def piece_norms(tensors, ord=2):
    """The `ord` norms of the pieces of `tensors` (flat tensors) of _NORM_PIECE elements, one
    float per piece. A tensor's whole pieces are the rows of one [pieces, _NORM_PIECE] view,
    normed in one call (on CPU, torch._foreach_norm over a list of pieces costs a call per
    piece: docs/design/grad-norm.md)."""
    norms = []
    for tensor in tensors:
        rows = tensor.numel() // _NORM_PIECE
        if rows:
            whole = tensor[:rows * _NORM_PIECE].view(rows, _NORM_PIECE)
            norms.append(torch.linalg.vector_norm(whole, ord, dim=1).float())
        if tensor.numel() > rows * _NORM_PIECE:
            norms.append(torch.linalg.vector_norm(tensor[rows * _NORM_PIECE:], ord)
                         .float().reshape(1))
    return torch.cat(norms) if norms else torch.zeros(0)


def sum_of_squares(tensors, device):
    """Float64 sum of the squares of the elements of `tensors` (flat tensors), on `device`."""
    return piece_norms(tensors).double().pow(2).sum().to(device)


def _dense_moments(entry, pieces, numel):
    """(exp_avg, exp_avg_sq) of one master's saved optimizer state, fp32 per element (Adam8bit
    and Adam4bit's codes decoded); (None, None) before the first step."""
    from zero.optim.quantized_state import decode, is_quantized
    if is_quantized(entry):
        return decode(entry, pieces, numel)
    if "exp_avg" in entry:
        return entry["exp_avg"].reshape(-1), entry["exp_avg_sq"].reshape(-1)
    return None, None


# Keys a saved param group may lack and still be this optimizer's kind: torch's implementation
# switches (the loading optimizer defaults them), amsgrad (absent: off; the quantised Adams
# have none), CPUAdam's own flags (it keeps its values).
_SWITCHES = {"foreach", "maximize", "capturable", "differentiable", "fused",
             "decoupled_weight_decay", "amsgrad", "adamw_mode", "bias_correction"}


class PartitionedOptimizer:
    pp_comm = None  # over the pipeline's stages; a subclass sets it under pipeline parallelism
    _inside_backward = False  # the engine's backward is running (gradient hooks check it)
    _masters_behind_model = False  # weights were loaded into the module since the masters' last
    _model_behind_masters = False  # a load restored the masters; publish_restored_masters() next
    overflow = False  # the last step found inf/nan gradients and was skipped
    global_grad_norm = None  # the last step's gradient norm before clipping (unscaled)
    counts_zeros_in_grad = False  # count_zeros_in_grad() turns it on
    num_zeros_in_grad = None  # the last applied step's count (None when not counted)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def _describe_partitions(self):
        """An optimizer whose state is laid out on the original parameters (the quantisation
        blocks of Adam8bit and Adam4bit) learns which parameter elements each master element is, on
        every rank, so its result does not depend on where the partitions cut."""
        describe = getattr(self.optimizer, "describe_partition", None)
        if describe is None:
            return
        mine = self._partition_pieces(self.dp_comm.rank if self.partition_count > 1 else 0)
        everyone = [[piece for pieces in self._partition_pieces(rank).values()
                     for piece in pieces] for rank in range(self.partition_count)]
        describe(mine, everyone, self.dp_comm.group if self.partition_count > 1 else None)

    def _whole_numel(self, param, numel):
        """Elements of the whole parameter `param` (`numel` here): a tensor-parallel shard
        counts for the full tensor."""
        parallel = getattr(param, "model_parallel", False) and self.mp_comm is not None
        return numel * (self.mp_comm.world_size if parallel else 1)

    def _refuse_gradients_outside_backward(self):
        """From a gradient hook: a gradient produced by loss.backward() instead of the
        engine's backward would skip the loss scale and the reduction; say so there. (Without
        hooks, at stages 0 and 1 on one rank, gradients found in param.grad at the step are
        taken as set by hand: as the engine's backward would have left them.)"""
        if not self._inside_backward:
            raise ZeroError("gradients reached the ZeRO optimizer outside engine.backward (was "
                            "loss.backward() called?): call engine.backward(loss), which "
                            "divides the loss by the gradient accumulation steps, applies the "
                            "fp16 loss scale and reduces the gradients over data parallel")

    @property
    def cur_scale(self):
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    loss_scale = cur_scale

    @staticmethod
    def _partition_norm_sq(grad, replicated_runs, device):
        """(what this rank's flat gradient partition `grad` adds to the global squared norm,
        its own squared norm). Parameters replicated over tensor parallelism count on TP
        rank 0 only: `replicated_runs` are their (start, length) in `grad` on other ranks."""
        everything = sum_of_squares([grad], device)
        if not replicated_runs:
            return everything, everything
        replicated = sum_of_squares([grad.narrow(0, s, n) for s, n in replicated_runs], device)
        return (everything - replicated).clamp(min=0), everything

    def _global_norm_sq(self, counted, everything, over_dp=True):
        """(squared global norm, overflow) from this rank's float64 sums of squares: `counted`
        (what this rank contributes to the norm: replicated TP parameters count on one TP
        rank) and `everything` (all it holds, for the inf/nan check), summed over DP (unless
        every DP rank holds the whole gradient) and TP in one all-reduce each."""
        packed = torch.stack([counted, (~torch.isfinite(everything)).double()])
        if over_dp:
            self.dp_comm.all_reduce(packed)
        if self.mp_comm is not None:
            self.mp_comm.all_reduce(packed)
        if self.pp_comm is not None:  # every pipeline stage holds its own parameters
            self.pp_comm.all_reduce(packed)
        norm_sq, overflow = packed.tolist()
        return norm_sq, overflow > 0 or not math.isfinite(norm_sq)

    @torch.no_grad()
    def weights_norm(self):
        """The L2 norm of the trained weights, from their fp32 masters: over data, tensor and
        pipeline parallelism, each element once (a parameter replicated over tensor
        parallelism on TP rank 0 only, partition padding not at all). A collective: every
        rank of the job calls it."""
        self._catch_up_with_loaded_weights()
        parts = []
        for key, runs in self._weight_runs():
            master = self.masters.read_master(key)
            parts += [master.narrow(0, start, length) for start, length in runs]
        device = self.dp_comm.scalar_device(parts[0] if parts else torch.empty(0))
        total = sum_of_squares(parts, device).reshape(1)
        if self.partition_count > 1:
            self.dp_comm.all_reduce(total)
        for comm in (self.mp_comm, self.pp_comm):
            if comm is not None:
                comm.all_reduce(total)
        return math.sqrt(total.item())

    @torch.no_grad()
    def optimizer_state_norms(self):
        """Norms of Adam's moments and of the fp32 master weights, with Megatron-DeepSpeed's
        names (its --log-optimizer-states-to-tensorboard): the L2 and L1 norms and the
        largest magnitude of exp_avg_sq ("variance"), of its square root ("variance_sqrt"),
        of exp_avg ("momentum") and of the weights. Each element counts once, as in
        `weights_norm`; moments not made yet (before the first step) are Adam's zeros. One
        master at a time (offloaded moments swapped in, 8-bit ones decoded, then dropped). A
        collective: every rank of the job calls it."""
        self._catch_up_with_loaded_weights()
        rank = self.dp_comm.rank if self.partition_count > 1 else 0
        pieces = self._partition_pieces(rank)  # {master: its pieces}, in key order
        masters = list(pieces)
        sums = dict.fromkeys(("variance_l2", "variance_l1", "variance_sqrt_l1", "momentum_l2",
                              "momentum_l1", "weight_l2", "weight_l1"), 0.0)
        maxima = dict.fromkeys(("variance_abs_max", "momentum_abs_max", "weight_abs_max"), 0.0)
        for key, runs in self._weight_runs():
            master = self.masters.read_master(key)
            exp_avg, exp_avg_sq = _dense_moments(self.masters.saved_state(key),
                                                 pieces[masters[key]], master.numel())
            for name, tensor in (("weight", master), ("momentum", exp_avg),
                                 ("variance", exp_avg_sq)):
                if tensor is None or not runs:
                    continue
                parts = [tensor.narrow(0, start, length) for start, length in runs]
                sums[f"{name}_l2"] += piece_norms(parts, 2).double().pow(2).sum().item()
                sums[f"{name}_l1"] += piece_norms(parts, 1).double().sum().item()
                maxima[f"{name}_abs_max"] = max(maxima[f"{name}_abs_max"],
                                                piece_norms(parts, math.inf).max().item())
                if name == "variance":  # ord 0.5 gives (sum of sqrt|v|)**2 per piece
                    sums["variance_sqrt_l1"] += piece_norms(parts, 0.5).double().sqrt() \
                        .sum().item()
        device = self.dp_comm.scalar_device(masters[0] if masters else torch.empty(0))
        summed = torch.tensor(list(sums.values()), dtype=torch.float64, device=device)
        largest = torch.tensor(list(maxima.values()), dtype=torch.float64, device=device)
        for comm in (self.dp_comm if self.partition_count > 1 else None, self.mp_comm,
                     self.pp_comm):
            if comm is not None:
                comm.all_reduce(summed)
                comm.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
        values = dict(zip(sums, summed.tolist()))
        values.update(zip(maxima, largest.tolist()))
        for name in ("variance_l2", "momentum_l2", "weight_l2"):
            values[name] = math.sqrt(values[name])
        # sqrt(v)'s squares sum to v's L1 norm; its largest is the largest v's root
        values["variance_sqrt_l2"] = math.sqrt(values["variance_l1"])
        values["variance_sqrt_abs_max"] = math.sqrt(values["variance_abs_max"])
        return values

    def count_zeros_in_grad(self):
        """From now on each applied step counts the zero elements of its gradient
        (`num_zeros_in_grad`: Megatron-LM's --log-num-zeros-in-grad), over every parallel
        rank, each element once: a collective inside step()."""
        self.counts_zeros_in_grad = True

    @torch.no_grad()
    def _zeros_in_grad(self):
        counted, nonzero, device = 0, 0, None
        for key, runs in self._weight_runs():
            grad = self._master_grad(key)
            device = device or self.dp_comm.scalar_device(grad)
            for start, length in runs:  # (summed where the gradient is: one sync at the end)
                counted += length
                nonzero = nonzero + torch.count_nonzero(grad.narrow(0, start, length))
        device = device or self.dp_comm.scalar_device(torch.empty(0))
        total = (counted - torch.as_tensor(nonzero, device=device)).double().reshape(1)
        for comm in (self.dp_comm if self.partition_count > 1 else None, self.mp_comm,
                     self.pp_comm):
            if comm is not None:
                comm.all_reduce(total)
        return int(total.item())

    def _counts_in_weights_norm(self, param):
        """Whether this rank's elements of `param` count in the weights' norm: a parameter
        replicated over tensor parallelism counts on TP rank 0 only."""
        return self.mp_comm is None or self.mp_rank == 0 or \
            getattr(param, "model_parallel", False) or \
            getattr(param, "tensor_model_parallel", False)

    def _finish_step(self, norm_sq, overflow, fold=1.0):
        """Skip the step on inf/nan gradients, else step on the fp32 gradients unscaled and
        clipped (one divisor, which the masters' Adam kernel applies as it reads them) and let
        the loss scaler know. `norm_sq` is the squared global norm of the loss-scaled gradient
        (over DP and TP), `fold` a factor the gradients still carry (stage 1/2
        post-division). False if the step was skipped.

        inf/nan gradients are skipped in every precision: with fp16 they mean "scale too high"
        (back off), in fp32/bf16 a NaN loss; stepping would poison the weights.
        """
        scale = self.cur_scale
        self.overflow = bool(overflow)
        self.global_grad_norm = math.sqrt(norm_sq) / scale if math.isfinite(norm_sq) else norm_sq
        self.num_zeros_in_grad = None
        if self.overflow:
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(True)
            self.zero_grad()
            return False
        if self.counts_zeros_in_grad:
            self.num_zeros_in_grad = self._zeros_in_grad()
        combined = scale
        clip = self.settings.gradient_clipping
        if clip > 0 and math.isfinite(norm_sq):
            coefficient = (self.global_grad_norm + 1e-6) / clip
            if coefficient > 1:
                combined = coefficient * scale
        self._step_partitions(combined / fold)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        return True

    # ----- what zero/checkpoint reads and writes: the masters in their store -----

    def master_partition(self, key):
        """This rank's fp32 master of `key` (a param group, or a stage 3 sub-group)."""
        return self.masters.read_master(key)

    def follow_loaded_weights(self):
        """Weights were loaded into the module after initialize (module.load_state_dict): the
        fp32 masters take them before they are next read (a step, a checkpoint save), unless
        a checkpoint load restores the masters first."""
        self._masters_behind_model = True

    def _catch_up_with_loaded_weights(self):
        if self._masters_behind_model:
            self.refresh_masters_from_model()

    def base_state_dict(self):
        self._catch_up_with_loaded_weights()
        return self.masters.state_dict()

    def master_restore_target(self, key):
        """The tensor a checkpoint load writes the fp32 master of `key` into."""
        return self.masters.restore_target(key)

    def load_base_state_dict(self, state_dict):
        self._check_saved_hyperparameters(state_dict["param_groups"])
        if not hasattr(self.optimizer, "describe_partition"):
            # an fp32 optimizer given a quantised state (--optimizer adam after adam8bit)
            state_dict = self._decoded(state_dict)
        self.masters.load_state_dict(state_dict)

    def load_saved_state(self, state_dict, loss_scaler_state):
        """A checkpoint's optimizer state (torch's format, one entry per master) and loss
        scaler; torch's complaint about a state that does not fit becomes one that says so."""
        try:
            self.load_base_state_dict(state_dict)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"saved optimizer state does not fit this optimizer: {e}") \
                from None
        if self.loss_scaler is not None and loss_scaler_state is not None:
            self.loss_scaler.load_state_dict(loss_scaler_state)

    def _check_saved_hyperparameters(self, saved_groups):
        """torch's load_state_dict takes the saved param groups whole: a state saved by another
        kind of optimizer (AdamW's into SGD) would fail at the first step with a KeyError, or
        leave this optimizer's groups broken. Said before anything is loaded."""
        base = self.optimizer
        for group in saved_groups:
            lacking = sorted(set(base.defaults) - set(group) - _SWITCHES)
            if lacking:
                raise CheckpointError(
                    f"the checkpoint's optimizer state was saved by another optimizer: its "
                    f"param groups lack {lacking}, which {type(base).__name__} needs. Resume "
                    "with the optimizer it was saved with, or load without its state "
                    "(load_optimizer_states=False; Megatron: --no-load-optim)")

    def _decoded(self, state_dict):
        from zero.optim.quantized_state import decode_state_dict
        pieces = self._partition_pieces(self.dp_comm.rank if self.partition_count > 1 else 0)
        masters = [p for group in self.optimizer.param_groups for p in group["params"]]
        return decode_state_dict(state_dict, {i: pieces[m] for i, m in enumerate(masters)},
                                 {i: m.numel() for i, m in enumerate(masters)})

    def commit_restored_masters(self):
        """Called after a load wrote the masters. The model takes them in
        publish_restored_masters(), once every rank's load has succeeded: at stages 1-2 that
        is an all-gather, which a rank whose files could not be read would never join."""
        self.masters.commit()
        self._masters_behind_model = False
        self._model_behind_masters = True

    def publish_restored_masters(self):
        """The masters a load restored -> the model's weights (every rank calls it)."""
        if self._model_behind_masters:
            self._model_behind_masters = False
            self.publish_masters()

    def forget_restored_masters(self):
        """A load failed (or starts): nothing it restored is published."""
        self._model_behind_masters = False

    def close(self):
        """Release what the masters keep outside memory (NVMe swap files)."""
        self.masters.close()
