"""Learning-rate schedule: linear warmup, then linear / cosine / exponential / constant decay,
or later Megatron-LM's WSD and inverse-square-root.

The formula is Megatron-LM 1.1.5's `AnnealingLR.get_lr`, with n = number of steps taken:

    n <= warmup_steps (and warmup_steps > 0):  lr = max_lr * n / warmup_steps
        (warmup_steps is fractional where --warmup's fraction of the decay is, as in 1.1.5)
    n >  decay_steps:                          lr = min_lr
    otherwise, ratio = (n - warmup_steps) / (decay_steps - warmup_steps) in [0, 1] and
        linear       lr = max_lr * (1 - ratio)
        cosine       lr = max_lr * (1 + cos(pi * ratio)) / 2
        exponential  lr = max_lr * exp(-0.693 * ratio)      (exp(-0.693) ~ 1/2)
        constant     lr = max_lr
    and the result is floored: lr = max(lr, min_lr).

So decay runs over `decay_steps - warmup_steps` steps (counted after warmup) and ends at step
`decay_steps`. Two consequences of keeping 1.1.5's rule that users sometimes miss: the first
iteration with warmup runs at lr 0 (the schedule is stepped after each update), and
`exponential` and `constant` only reach half of / all of max_lr at `decay_steps`, then drop to
min_lr for every later step.

Later Megatron-LM's two styles, which 1.1.5 lacks, follow its formula (after the warmup;
n > decay_steps is min_lr there too):
        inverse-square-root  lr = max(min_lr, max_lr * sqrt(max(warmup, 1) / max(N, 1))),
                             warmup and N in samples, as later Megatron-LM counts them
                             (a step of an iteration is `samples_per_step` of them; N is
                             kept in the state, so a resume at another global batch goes on
                             from the samples seen)
        WSD                  lr = max_lr until the last `wsd_decay_steps` of the decay, then
                             min_lr + (max_lr - min_lr) * c(r), r = the fraction of those
                             taken: c = 1 - r (linear), (1 + cos(pi r)) / 2 (cosine),
                             2 * 0.5^r - 1 (exponential), 1 - sqrt(r) (minus_sqrt)

A checkpoint converted from Megatron-DeepSpeed (Megatron-LM 2.x and later) carries that run's
formula in its state ("decay_formula": "2.x"), which it keeps: lr = min_lr + (max_lr - min_lr)
x (1 - ratio) or x (1 + cos(pi * ratio)) / 2, and `constant` holds max_lr for good.

Checkpoint values versus command-line values on resume (Megatron's rule):
    override_lr_scheduler=True          the constructor's values win, the step count is loaded
    use_checkpoint_lr_scheduler=True    the checkpoint's values win
    neither                             values must agree, else ConfigError naming the flag
except for the lengths in `follows_train_iters` (the state keys "end_iter", "warmup_iter"
whose values the trainer derived from --train-iters): a run resumed with another --train-iters
takes the new lengths and says so in `resume_notes`, since continuing a finished run for
longer is the common case.

A step is an iteration, or under --rampup-batch-size (unit "samples", as Megatron-LM counts
then) a sample: the trainer steps by the iteration's global batch, `step(increment=B)`, and
the lengths are --lr-decay-samples and --lr-warmup-samples.
"""

import math

from megatron.errors import CheckpointError, ConfigError

DECAY_STYLES = ("linear", "cosine", "exponential", "constant", "WSD", "inverse-square-root")
# WSD's decay over its last steps, a coefficient from 1 to 0 of the fraction r taken
WSD_DECAYS = {"exponential": lambda r: 2.0 * 0.5 ** r - 1.0, "linear": lambda r: 1.0 - r,
              "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
              "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}
# a state key Megatron-LM ignores: the warmup was saved fractional (not cut to whole steps)
FRACTIONAL_WARMUP = "fractional_warmup"
# and one saved only when a step is not an iteration: "samples" (--rampup-batch-size)
STEP_UNIT = "step_unit"

# state_dict key -> (attribute, what the user sets it with). The keys are Megatron 1.1.5's,
# so its checkpoints load here and ours load there.
_CHECKED_FIELDS = (
    ("start_lr", "max_lr", "--lr"),
    ("min_lr", "min_lr", "--min-lr"),
    ("warmup_iter", "warmup_steps", "--warmup / --warmup-iters"),
    ("end_iter", "decay_steps", "--lr-decay-iters"),
    ("decay_style", "decay_style", "--lr-decay-style"),
)
# and WSD's (keys of this trainer's own: Megatron-LM does not save them)
_WSD_FIELDS = (("wsd_decay_iter", "wsd_decay_steps", "--lr-wsd-decay-iters"),
               ("wsd_decay_style", "wsd_decay_style", "--lr-wsd-decay-style"))
# Megatron 2.x names for the same values, accepted on load.
_NEWER_KEY_NAMES = {"start_lr": "max_lr", "warmup_iter": "warmup_steps",
                    "end_iter": "decay_steps", "num_iters": "num_steps"}


class AnnealingLR:
    """Sets `lr` on every param group of `optimizer` from the number of steps taken."""

    def __init__(self, optimizer, max_lr, min_lr, warmup_steps, decay_steps, decay_style,
                 use_checkpoint_lr_scheduler=True, override_lr_scheduler=False,
                 follows_train_iters=(), unit="iterations", wsd_decay_steps=None,
                 wsd_decay_style="exponential", samples_per_step=1):
        _validate(max_lr, min_lr, warmup_steps, decay_steps, decay_style, wsd_decay_steps,
                  wsd_decay_style)
        if override_lr_scheduler and use_checkpoint_lr_scheduler:
            raise ConfigError("--override-lr-scheduler and --use-checkpoint-lr-scheduler "
                              "contradict each other; pass at most one")
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_steps = warmup_steps  # fractional from a --warmup fraction, as in 1.1.5
        self.decay_steps = int(decay_steps)
        self.decay_style = decay_style
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.use_checkpoint_lr_scheduler = use_checkpoint_lr_scheduler
        self.override_lr_scheduler = override_lr_scheduler
        self.follows_train_iters = frozenset(follows_train_iters)
        self.unit = unit  # what a step counts: "iterations", or "samples" (step(increment))
        self.samples_per_step = samples_per_step  # (the global batch, for iterations)
        self.decay_formula = "1.1.5"  # "2.x": a converted Megatron-DeepSpeed run's (above)
        self.resume_notes = []  # what a load changed, for the trainer to print once
        self.num_steps = 0
        self.num_samples = 0  # inverse-square-root's count, whatever the batch of each step
        self.step(0)

    def get_lr(self):
        n = self.num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * n / self.warmup_steps
        if self.decay_style in ("WSD", "inverse-square-root"):
            return self._later_megatron_lr(n)
        if self.decay_formula == "2.x":
            return self._megatron_2_lr(n)
        if n > self.decay_steps:
            return self.min_lr
        ratio = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            lr = self.max_lr * (1.0 - ratio)
        elif self.decay_style == "cosine":
            lr = self.max_lr * 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif self.decay_style == "exponential":
            lr = self.max_lr * math.exp(-0.693 * ratio)
        else:
            lr = self.max_lr
        return max(lr, self.min_lr)

    def _megatron_2_lr(self, n):
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        ratio = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        coefficient = 1.0 - ratio if self.decay_style == "linear" else \
            0.5 * (math.cos(math.pi * ratio) + 1.0) if self.decay_style == "cosine" else \
            math.exp(-0.693 * ratio)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def _later_megatron_lr(self, n):
        if n > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            warmup_samples = self.warmup_steps * self.samples_per_step
            return max(self.min_lr, self.max_lr * math.sqrt(max(warmup_samples, 1))
                       / math.sqrt(max(self.num_samples, 1)))
        anneal_start = self.decay_steps - self.wsd_decay_steps
        coefficient = 1.0 if n <= anneal_start else \
            WSD_DECAYS[self.wsd_decay_style]((n - anneal_start) / self.wsd_decay_steps)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def step(self, increment=1):
        """Advance by `increment` steps and set the new lr on every param group."""
        self.num_steps += increment
        self.num_samples += increment * self.samples_per_step
        new_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = new_lr

    def state_dict(self):
        # (Megatron-LM 1.1.5's keys, and two it ignores: the warmup is kept fractional, and
        # a converted run's formula)
        state = {"start_lr": self.max_lr, "warmup_iter": self.warmup_steps,
                 "num_iters": self.num_steps, "decay_style": self.decay_style,
                 "end_iter": self.decay_steps, "min_lr": self.min_lr,
                 FRACTIONAL_WARMUP: True}
        if self.decay_formula != "1.1.5":
            state["decay_formula"] = self.decay_formula
        if self.unit != "iterations":
            state[STEP_UNIT] = self.unit
        if self.decay_style == "WSD":
            state.update(wsd_decay_iter=self.wsd_decay_steps, wsd_decay_style=self.wsd_decay_style)
        if self.decay_style == "inverse-square-root":
            state["num_samples"] = self.num_samples
        return state

    def load_state_dict(self, state_dict):
        sd = {old: state_dict[new] for old, new in _NEWER_KEY_NAMES.items() if new in state_dict}
        sd.update(state_dict)
        saved_unit = sd.get(STEP_UNIT, "iterations")
        if saved_unit != self.unit:
            ramp = "with" if saved_unit == "samples" else "without"
            raise ConfigError(f"the checkpoint's learning-rate schedule counts {saved_unit} (it "
                              f"was trained {ramp} --rampup-batch-size), this run's counts "
                              f"{self.unit}: resume {ramp} --rampup-batch-size, or train on "
                              "from its weights with --finetune (the optimizer, the schedule "
                              "and the data position start afresh)")
        lengthened = []
        for key, attribute, flag in _CHECKED_FIELDS + _WSD_FIELDS:
            if (key, attribute, flag) in _WSD_FIELDS and (self.decay_style != "WSD"
                                                          or key not in sd):
                continue  # WSD's, when the style chosen above is WSD and the checkpoint's was
            if key not in sd:
                raise _missing_key_error(key, sd)
            ours = getattr(self, attribute)
            if key == "warmup_iter" and FRACTIONAL_WARMUP not in sd \
                    and self._truncated_warmup(ours, sd[key]):
                self.warmup_steps = sd[key]
                continue
            if _same(ours, sd[key]):
                continue
            if key in self.follows_train_iters and not self.use_checkpoint_lr_scheduler:
                lengthened.append(f"{attribute.replace('_', ' ')} {sd[key]:g} -> {ours:g}")
                continue
            setattr(self, attribute, self._choose(ours, sd[key], _in_unit(flag, self.unit)))
        if lengthened:
            self.resume_notes.append(
                f"learning-rate schedule: {_in_unit('--train-iters', self.unit)} differs from "
                "the checkpoint's run, so "
                f"the schedule follows the new length ({', '.join(lengthened)}; resuming at "
                f"step {int(sd['num_iters'])}); pass --use-checkpoint-lr-scheduler to keep the "
                "old one")
        if "num_iters" not in sd:
            raise _missing_key_error("num_iters", sd)
        self.decay_formula = sd.get("decay_formula", "1.1.5")
        if self.decay_formula not in ("1.1.5", "2.x"):
            raise CheckpointError(f"the checkpoint's lr_scheduler has decay_formula "
                                  f"{self.decay_formula!r}, not one AnnealingLR runs (1.1.5, "
                                  "2.x). Load it with --no-load-optim")
        if self.decay_formula == "2.x":
            self.resume_notes.append(
                "learning-rate schedule: Megatron-LM 2.x's decay, toward --min-lr, as in the "
                "Megatron-DeepSpeed run the checkpoint was converted from")
        _validate(self.max_lr, self.min_lr, self.warmup_steps, self.decay_steps,
                  self.decay_style, self.wsd_decay_steps, self.wsd_decay_style)
        self.num_steps = int(sd["num_iters"])
        # (a checkpoint from before num_samples: its steps at this run's batch)
        self.num_samples = int(sd.get("num_samples", self.num_steps * self.samples_per_step))
        self.step(0)

    def _truncated_warmup(self, ours, checkpoint_value):
        """Whether the checkpoint (saved before its warmup was kept fractional) holds this
        --warmup fraction's warmup cut to whole steps: the run resumes with the schedule it
        was trained with, unless --override-lr-scheduler says otherwise."""
        if self.override_lr_scheduler or float(ours).is_integer() \
                or checkpoint_value != math.floor(ours):
            return False
        self.resume_notes.append(
            f"learning-rate schedule: the checkpoint's warmup is {checkpoint_value} "
            f"iterations, --warmup's {ours:g} cut to whole iterations by the trainer that saved "
            "it; the run keeps its warmup")
        return True

    def _choose(self, ours, checkpoint_value, flag):
        if _same(ours, checkpoint_value):
            return checkpoint_value
        if (self.override_lr_scheduler
                                         or self.use_checkpoint_lr_scheduler):
            kept, dropped, why = (ours, checkpoint_value, "--override-lr-scheduler") \
                if self.override_lr_scheduler else \
                (checkpoint_value, ours, "--use-checkpoint-lr-scheduler")
            source = "command line's" if self.override_lr_scheduler else "checkpoint's"
            self.resume_notes.append(f"learning-rate schedule: {flag} {kept!r}, the {source} "
                                     f"({why}), not {dropped!r}")
        if self.override_lr_scheduler:
            return ours
        if not self.use_checkpoint_lr_scheduler:
            raise ConfigError(
                f"learning-rate schedule: the checkpoint has {flag} = {checkpoint_value!r} but "
                f"the command line gives {ours!r}. Pass --override-lr-scheduler to use the "
                "command-line schedule, or --use-checkpoint-lr-scheduler to keep the "
                "checkpoint's")
        return checkpoint_value


def _in_unit(flags, unit):
    """A message's flags in the schedule's unit (--lr-decay-samples when it counts samples)."""
    if unit == "iterations":
        return flags
    return flags.replace("--warmup-iters", "--lr-warmup-samples").replace("-iters", "-samples")


def _same(ours, checkpoint_value):
    """Equal, or floats equal but for rounding (a warmup fraction times a length computed
    another way)."""
    if isinstance(ours, (int, float)) and isinstance(checkpoint_value, (int, float)):
        return math.isclose(ours, checkpoint_value, rel_tol=1e-9, abs_tol=1e-12)
    return ours == checkpoint_value


def _validate(max_lr, min_lr, warmup_steps, decay_steps, decay_style, wsd_decay_steps=None,
              wsd_decay_style="exponential"):
    if decay_style not in DECAY_STYLES:
        raise ConfigError(f"--lr-decay-style {decay_style!r} is not one of "
                          f"{', '.join(DECAY_STYLES)}")
    if decay_style == "WSD" and (wsd_decay_style not in WSD_DECAYS or wsd_decay_steps is None
                                 or not 0 < wsd_decay_steps <= decay_steps):
        raise ConfigError(f"--lr-decay-style WSD decays over its last {wsd_decay_steps} steps, "
                          f"which must be positive and within the {decay_steps} of the decay, "
                          f"in a --lr-wsd-decay-style of {', '.join(WSD_DECAYS)} "
                          f"({wsd_decay_style!r})")
    if max_lr < 0 or min_lr < 0 or min_lr > max_lr:
        raise ConfigError(f"learning rates must satisfy 0 <= --min-lr ({min_lr}) <= --lr "
                          f"({max_lr})")
    if decay_steps <= 0:
        raise ConfigError(f"--lr-decay-iters must be positive, got {decay_steps} "
                          "(it defaults to --train-iters)")
    if warmup_steps < 0 or warmup_steps > decay_steps:
        raise ConfigError(f"warmup iterations ({warmup_steps}, from --warmup or --warmup-iters) "
                          f"must lie between 0 and --lr-decay-iters ({decay_steps})")


def _missing_key_error(key, state):
    deepspeeds = "last_batch_iteration" in state  # a JSON 'scheduler' section's
    return CheckpointError(
        f"the checkpoint's lr_scheduler state has no {key!r}; it was not written by "
        "AnnealingLR (--lr-decay-style's schedule)"
        + (", but by the 'scheduler' section of the DeepSpeed config it was trained with: add "
           "that section back to resume its schedule, or start --lr-decay-style's afresh with "
           "--no-load-optim" if deepspeeds else ". Load it with --no-load-optim"))
