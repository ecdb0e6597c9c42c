"""Loss scaling for fp16 training: a constant scale, or Megatron/DeepSpeed dynamic scaling.

`DynamicLossScaler.update(found_inf)` is called once per optimizer step (after the gradients
of the whole global batch were checked) and follows Megatron-LM 1.1.5's `DynamicLossScaler`
with `delayed_shift` = hysteresis, which DeepSpeed's ZeRO optimizers share:

  overflow step:
    - the clean-step counter restarts at 0;
    - if the hysteresis counter is above 1 it is decremented and the scale is kept;
    - otherwise scale = max(scale * backoff_factor, min_scale). The hysteresis counter stays
      at 1, so each further overflow backs off again until the scale grows once more.
  clean step:
    - the clean-step counter increments; when it reaches growth_interval, scale *=
      growth_factor, the counter restarts at 0 and the hysteresis counter is reset to
      `hysteresis`.

With hysteresis=2 the first overflow only uses up the hysteresis, the second halves the scale.
Every overflow step is skipped by the optimizer, whether or not the scale changed. The scale
is clamped at min_scale rather than raising (DeepSpeed raises there); a run stuck at min_scale
shows up as a growing skipped-iterations count in the log.
"""

from megatron.errors import ConfigError


class ConstantLossScaler:
    """A fixed scale (`--loss-scale`). Overflow steps are still skipped by the optimizer."""

    def __init__(self, scale):
        if not scale > 0:
            raise ConfigError(f"--loss-scale must be positive, got {scale}; leave it out for "
                              "dynamic loss scaling")
        self.scale = float(scale)

    def update(self, found_inf):
        pass

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state_dict):
        # The command line's static scale wins over the checkpoint's: it is a choice, not state.
        pass


class DynamicLossScaler:
    def __init__(self, initial_scale=2.0 ** 32, min_scale=1.0, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=1000, hysteresis=2):
        if not (initial_scale > 0 and min_scale > 0):
            raise ConfigError(f"--initial-loss-scale ({initial_scale}) and --min-scale "
                              f"({min_scale}) must be positive")
        if growth_interval < 1 or hysteresis < 1:
            raise ConfigError(f"--loss-scale-window ({growth_interval}) and --hysteresis "
                              f"({hysteresis}) must be at least 1")
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0):
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got "
                             f"{growth_factor}, {backoff_factor}")
        self.scale = float(max(initial_scale, min_scale))
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_tracker = 0            # consecutive clean steps since the last overflow/growth
        self.hysteresis_tracker = self.hysteresis  # overflows left before the next back-off

    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            if self.hysteresis_tracker > 1:
                self.hysteresis_tracker -= 1
            else:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self):
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state_dict):
        # The schedule (window, factors, floor) comes from the command line; the position in
        # it comes from the checkpoint, so a resumed run scales exactly as an unbroken one.
        # A checkpoint from a static-scale run has only "scale": start the counters afresh.
        self.scale = float(state_dict["scale"])
        self.growth_tracker = int(state_dict.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state_dict.get("hysteresis_tracker", self.hysteresis))
