"""Loss scaling for fp16 training, with DeepSpeed's semantics
(deepspeed/runtime/fp16/loss_scaler.py).

`update_scale(overflow)` is called once per optimizer step, after the overflow flag of the
whole global batch has been all-reduced. The dynamic rule (DeepSpeed >= 0.17.1, which also
matches its non-ZeRO FP16_Optimizer):

  overflow:   if hysteresis is used up (delayed_shift == 1 or cur_hysteresis == 1) the scale
              becomes max(scale / scale_factor, min_scale) -- or, at min_scale with
              raise_error_at_min_scale, the run stops; otherwise cur_hysteresis -= 1 and the
              scale is kept. Either way last_overflow_iter = cur_iter.
  clean step: with consecutive_hysteresis the hysteresis is refilled. With
              stable = cur_iter - last_overflow_iter - 1, the scale is multiplied by
              scale_factor (and the hysteresis refilled) when stable > 0 and
              stable % scale_window == 0: after scale_window clean steps, on the next one.
  then:       cur_iter += 1.

The optimizer skips every overflow step whatever the scaler did. zero uses this one rule for
every ZeRO stage (DeepSpeed's non-ZeRO fp16 optimizer has no hysteresis).

Finding the first scale: until the first clean step of a run (`searching_initial_scale`) a
trainer may retry the skipped batch at the lowered scale (`forget_overflow_step` rewinds the
step count), so a run that starts far too high (Megatron's 2^32) still trains from its first
batch instead of skipping a dozen steps.
"""

import logging
import math

import torch

from zero.errors import CheckpointError, ConfigError, ZeroError

logger = logging.getLogger("zero.optim.loss_scaler")


class LossScalerBase:
    """The scale the loss is multiplied by before backward; gradients carry it until unscaled."""

    dynamic = False

    def __init__(self, scale):
        self.cur_scale = float(scale)

    @property
    def loss_scale(self):
        return self.cur_scale

    def scale_loss(self, loss):
        return loss * self.cur_scale

    def update_scale(self, overflow):
        pass

    @property
    def searching_initial_scale(self):
        """True while a skipped step is worth retrying at the lowered scale (dynamic only)."""
        return False

    def forget_overflow_step(self):
        return False

    def state_dict(self):
        return {"dynamic": self.dynamic, "cur_scale": self.cur_scale}

    def load_state_dict(self, state_dict):
        _require_keys(state_dict, ("cur_scale",))


class StaticLossScaler(LossScalerBase):
    """`"fp16": {"loss_scale": S}` with S > 0. Loading a checkpoint keeps S from the config."""

    def __init__(self, scale=1.0):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale) or scale <= 0:
            raise ConfigError(f"a static loss scale must be a finite number > 0, got {scale!r}; "
                              "use \"loss_scale\": 0 in the fp16 section for dynamic scaling")
        super().__init__(scale)


class DynamicLossScaler(LossScalerBase):
    dynamic = True

    def __init__(self, init_scale=2.0 ** 16, scale_factor=2.0, scale_window=1000, min_scale=1,
                 delayed_shift=1, consecutive_hysteresis=False, raise_error_at_min_scale=False):
        _check_dynamic_args(init_scale, scale_factor, scale_window, min_scale, delayed_shift)
        super().__init__(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)  # DeepSpeed's name for hysteresis
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift
        self._backed_off = False  # whether the last overflow lowered the scale or hysteresis

    def update_scale(self, overflow):
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    @property
    def searching_initial_scale(self):
        """No step of this run (or of the checkpoint it resumed) has been recorded yet."""
        return self.cur_iter == 0

    def forget_overflow_step(self):
        """After an overflow on the very first step: take back its step count (the scale change
        stays) so the same batch can be retried at the new scale. False, changing nothing,
        when that step was not the first or no lower scale is left to try."""
        first = self.cur_iter == 1 and self.last_overflow_iter == 0
        if not first or not self._backed_off:
            return False
        self.cur_iter = 0
        return True

    def _on_overflow(self):
        before = (self.cur_scale, self.cur_hysteresis)
        self._change_on_overflow()
        self._backed_off = (self.cur_scale, self.cur_hysteresis) != before

    def _change_on_overflow(self):
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale <= self.min_scale and self.raise_error_at_min_scale:
                raise ZeroError(
                    f"fp16 gradients overflowed with the loss scale already at its minimum "
                    f"({self.cur_scale:g}): training has diverged. Lower fp16.min_loss_scale, "
                    "lower the learning rate, or train in bf16 instead of fp16")
            new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            logger.info("OVERFLOW! Skipping step. Attempted loss scale: %g, reducing to %g",
                        self.cur_scale, new_scale)
            self.cur_scale = new_scale
        else:
            logger.info("OVERFLOW! Skipping step. Attempted loss scale: %g, but hysteresis is "
                        "%d. Reducing hysteresis to %d", self.cur_scale, self.cur_hysteresis,
                        self.cur_hysteresis - 1)
            self.cur_hysteresis -= 1

    def state_dict(self):
        # plain numbers only, so torch.load(weights_only=True) reads checkpoints
        return {"dynamic": True, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis, "scale_factor": self.scale_factor,
                "scale_window": self.scale_window, "min_scale": self.min_scale,
                "delayed_shift": self.delayed_shift,
                "consecutive_hysteresis": self.consecutive_hysteresis}

    def load_state_dict(self, state_dict):
        # The position in the schedule comes from the checkpoint; the schedule itself (window,
        # factor, floor, hysteresis) from the current config, so a resumed run can change it.
        _require_keys(state_dict, ("cur_scale",))
        self.cur_scale = float(state_dict["cur_scale"])
        if state_dict.get("dynamic", False):
            _require_keys(state_dict, ("cur_iter", "last_overflow_iter", "cur_hysteresis"))
            self.cur_iter = int(state_dict["cur_iter"])
            self.last_overflow_iter = int(state_dict["last_overflow_iter"])
            self.cur_hysteresis = min(int(state_dict["cur_hysteresis"]), self.delayed_shift)


def _check_dynamic_args(init_scale, scale_factor, scale_window, min_scale, delayed_shift):
    problems = []
    if not init_scale > 0:
        problems.append(f"initial scale must be > 0 (got {init_scale})")
    if not scale_factor > 1:
        problems.append(f"scale factor must be > 1 (got {scale_factor})")
    if not (scale_window >= 1 and int(scale_window) == scale_window):
        problems.append(f"loss_scale_window must be an integer >= 1 (got {scale_window})")
    if not min_scale > 0:
        problems.append(f"min_loss_scale must be > 0 (got {min_scale})")
    if not (delayed_shift >= 1 and int(delayed_shift) == delayed_shift):
        problems.append(f"hysteresis must be an integer >= 1 (got {delayed_shift})")
    if problems:
        raise ConfigError("dynamic loss scaling: " + "; ".join(problems))


def _require_keys(state_dict, keys):
    if not isinstance(state_dict, dict) or any(k not in state_dict for k in keys):
        raise CheckpointError(f"loss scaler state must be a dict with keys {list(keys)}, got "
                              f"{state_dict!r}; the checkpoint was not written by zero's engine")


def build_loss_scaler(config):
    """The scaler the `fp16` section asks for, or None when fp16 is off (bf16 never scales)."""
    fp16 = config.fp16
    if not fp16.enabled:
        return None
    if not fp16.dynamic_loss_scale:
        return StaticLossScaler(fp16.loss_scale)
    # DeepSpeed's ZeRO optimizers raise at the floor (raise_error_at_min_scale defaults to
    # True there): a run whose scale collapsed is diverging, so say so instead of skipping
    # every step in silence.
    return DynamicLossScaler(init_scale=2.0 ** fp16.initial_scale_power,
                             scale_window=fp16.loss_scale_window,
                             min_scale=fp16.min_loss_scale, delayed_shift=fp16.hysteresis,
                             consecutive_hysteresis=fp16.consecutive_hysteresis,
                             raise_error_at_min_scale=True)


def inf_or_nan_flag(tensors):
    """A float32 scalar tensor, 1.0 when any tensor holds inf or nan (ready to all-reduce MAX).

    One flag is accumulated on the tensors' device, so checking many gradients costs a single
    host sync when the caller finally reads it. `None` entries (params without grads) are
    skipped."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    flag = None
    for tensor in tensors:
        if tensor is None:
            continue
        bad = torch.logical_not(torch.isfinite(tensor)).any()
        flag = bad if flag is None else flag | bad.to(flag.device)
    if flag is None:
        return torch.zeros((), dtype=torch.float32)
    return flag.to(torch.float32)


def has_inf_or_nan(tensors):
    return bool(inf_or_nan_flag(tensors).item())
