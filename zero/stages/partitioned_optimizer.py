"""What the stage 0-2 (`zero.stages.stage1_2.ZeroOptimizer`) and stage 3 (`zero.stages.stage3.Stage3Optimizer`)
optimizers share: the attributes DeepSpeed's ZeRO optimizers expose, and the rules of a step
once the gradient's global norm is known.

A subclass sets `optimizer`, `loss_scaler` (None unless fp16), `settings.gradient_clipping`,
`dp_comm` and `mp_comm` (zero.comm.communicator.Communicator; mp_comm None without tensor parallelism), and
provides `zero_grad()` and `_step_partitions()`.
"""

import math

import torch


class PartitionedOptimizer:
    overflow = False  # the last step found inf/nan gradients and was skipped
    global_grad_norm = None  # the last step's gradient norm before clipping (unscaled)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def cur_scale(self):
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    loss_scale = cur_scale

    def _use_fused_adam(self):
        """torch's fused Adam on flat fp32 tensors is ~5x faster than the default on CPU
        (offload overrides this with CPUAdam)."""
        if type(self.optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return
        for group in self.optimizer.param_groups:
            if group.get("fused") is None and not group.get("foreach") \
                    and not group.get("differentiable") and not group.get("capturable"):
                group["fused"] = True

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
        norm_sq, overflow = packed.tolist()
        return norm_sq, overflow > 0 or not math.isfinite(norm_sq)

    def _finish_step(self, norm_sq, overflow, master_grads, fold=1.0):
        """Skip the step on inf/nan gradients, else unscale and clip the fp32 gradients in one
        multiply, step, and let the loss scaler know. `norm_sq` is the squared global norm of
        the loss-scaled gradient (over DP and TP), `fold` a factor the gradients still carry
        (stage 1/2 post-division). False if the step was skipped.

        inf/nan gradients are skipped in every precision: with fp16 they mean "scale too high"
        (back off), in fp32/bf16 a NaN loss; stepping would poison the weights.
        """
        scale = self.cur_scale
        self.overflow = bool(overflow)
        self.global_grad_norm = math.sqrt(norm_sq) / scale if math.isfinite(norm_sq) else norm_sq
        if self.overflow:
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(True)
            self.zero_grad()
            return False
        combined = scale
        clip = self.settings.gradient_clipping
        if clip > 0 and math.isfinite(norm_sq):
            coefficient = (self.global_grad_norm + 1e-6) / clip
            if coefficient > 1:
                combined = coefficient * scale
        multiplier = fold / combined
        if multiplier != 1.0:
            for grad in master_grads:
                grad.mul_(multiplier)
        self._step_partitions()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        return True
