"""DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py) and the
`scheduler` section.

The engine calls `step()` once per applied optimizer step (not on fp16-overflow-skipped steps).
`it` = `last_batch_iteration` starts at -1 and grows by one per step(); the constructor writes
the lr for the current `it` into the optimizer, so before the first step() the optimizer holds
the warmup start value.

  WarmupLR        lr = min + (max - min) * gamma, gamma = log(it + 1) / log(N) ('log') or
                  it / N ('linear') while it < N, then 1. N = max(2, warmup_num_steps).
  WarmupDecayLR   warmup as above, then gamma = max(0, (T - it) / max(1, T - N)).
  WarmupCosineLR  a ratio of each group's starting lr: warmup from warmup_min_ratio to 1 as
                  above, then cos_min + (1 - cos_min) * (1 + cos(pi * s / (T - N))) / 2 with
                  s = it - N + 1, held at cos_min_ratio once s reaches T - N (DeepSpeed lets
                  the cosine rise again past T; we keep the minimum).
  LRRangeTest     lr = min * (1 + rate * (it + 1) / step_size), the fraction floored when
                  staircase is true.

Scalar lr arguments may be lists, one value per param group. `state_dict()` is DeepSpeed's
`{'last_batch_iteration': it}`. Other `type`s name a torch.optim.lr_scheduler class, as in
DeepSpeed.
"""

import difflib
import inspect
import logging
import math
import warnings

import torch

from zero.config.parsing import AUTO, fail, show
from zero.errors import CheckpointError, ConfigError, ZeroError

logger = logging.getLogger("zero.engine")  # (its warnings are the engine's)

WARMUP_TYPES = ("log", "linear")


class _StepSchedule:
    """Step counting, optimizer writes and the state dict shared by the schedules."""

    def __init__(self, optimizer, last_batch_iteration):
        self.optimizer = optimizer
        self.last_batch_iteration = _integer(self, "last_batch_iteration", last_batch_iteration,
                                             minimum=-1)
        self._apply(self.get_lr())

    def get_lr(self):
        raise AssertionError("subclasses define get_lr")

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def get_last_lr(self):
        return list(self._last_lr)

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict):
            raise CheckpointError(f"lr scheduler state must be a dict with "
                                  f"'last_batch_iteration', got {state_dict!r}")
        if "last_batch_iteration" not in state_dict:
            raise CheckpointError(
                f"the checkpoint's lr scheduler state was saved by another scheduler (its keys: "
                f"{', '.join(sorted(map(str, state_dict)))}), not by {type(self).__name__}, "
                "which keeps 'last_batch_iteration': resume with the schedule it was saved "
                "with, or without its state (load_lr_scheduler_states=False; pretrain_gpt2.py: "
                "--no-load-optim)")
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._apply(self.get_lr())

    def _apply(self, lrs):
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = list(lrs)


class WarmupLR(_StepSchedule):
    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        self.min_lrs = _per_group(self, "warmup_min_lr", warmup_min_lr, optimizer)
        max_lrs = _per_group(self, "warmup_max_lr", warmup_max_lr, optimizer)
        self.delta_lrs = [big - small for big, small in zip(max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _integer(self, "warmup_num_steps", warmup_num_steps))
        self.warmup_type = _warmup_type(self, warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def get_lr(self):
        gamma = self._gamma()
        return [small + delta * gamma for small, delta in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self):
        return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps,
                                self.warmup_type)


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = _integer(self, "total_num_steps", total_num_steps, minimum=1)
        warmup = max(2, _integer(self, "warmup_num_steps", warmup_num_steps))
        _check_total_after_warmup(self, self.total_num_steps, warmup)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self):
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return super()._gamma()
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - it) / decay_steps)


class WarmupCosineLR(_StepSchedule):
    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = _integer(self, "total_num_steps", total_num_steps, minimum=1)
        self.warmup_num_steps = max(2, _integer(self, "warmup_num_steps", warmup_num_steps))
        _check_total_after_warmup(self, self.total_num_steps, self.warmup_num_steps)
        # (fractions of the peak: above 1 the warmup or the "decay" would climb past it)
        self.warmup_min_ratio = _ratio(self, "warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = _ratio(self, "cos_min_ratio", cos_min_ratio)
        self.warmup_type = _warmup_type(self, warmup_type)
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]  # the peak lrs
        super().__init__(optimizer, last_batch_iteration)

    def get_lr(self):
        ratio = self.get_lr_ratio()
        return [org_lr * ratio for org_lr in self.org_lrs]

    def get_lr_ratio(self):
        it, warmup = self.last_batch_iteration, self.warmup_num_steps
        if it < warmup:
            gamma = _warmup_fraction(it, warmup, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        decay_steps = self.total_num_steps - warmup
        done = min(it - warmup + 1, decay_steps)
        cosine = (1.0 + math.cos(math.pi * done / decay_steps)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)


class LRRangeTest(_StepSchedule):
    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False,
                 last_batch_iteration=-1):
        self.min_lrs = _per_group(self, "lr_range_test_min_lr", lr_range_test_min_lr, optimizer)
        self.step_size = _integer(self, "lr_range_test_step_size", lr_range_test_step_size,
                                  minimum=1)
        self.step_rate = _number(self, "lr_range_test_step_rate", lr_range_test_step_rate)
        if not isinstance(lr_range_test_staircase, bool):
            raise ConfigError(f"LRRangeTest: 'lr_range_test_staircase' must be true or false, "
                              f"got {show(lr_range_test_staircase)}")
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def get_lr(self):
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [small * (1.0 + self.step_rate * interval) for small in self.min_lrs]


def _warmup_fraction(it, warmup_steps, warmup_type):
    """gamma in [0, 1] of the warmup; it < 0 (before the first step) is the start value."""
    if it >= warmup_steps:
        return 1.0
    if it < 0:
        return 0.0
    if warmup_type == "log":
        return math.log(it + 1) / math.log(warmup_steps)
    return it / warmup_steps


# ---------------------------------------------------------------------------------------------
# Argument checks: these come from the user's JSON, so they raise ConfigError

def _number(schedule, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{type(schedule).__name__}: '{name}' must be a number, got "
                          f"{show(value)}")
    return float(value)


def _ratio(schedule, name, value):
    value = _number(schedule, name, value)
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{type(schedule).__name__}: '{name}' is a fraction of the peak "
                          f"learning rate, from 0 to 1; got {show(value)}")
    return value


def _integer(schedule, name, value, minimum=0):
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value != int(value) or value < minimum:
        raise ConfigError(f"{type(schedule).__name__}: '{name}' must be an integer >= "
                          f"{minimum}, got {show(value)}")
    return int(value)


def _per_group(schedule, name, value, optimizer):
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ConfigError(f"{type(schedule).__name__}: '{name}' lists {len(value)} values "
                              f"but the optimizer has {groups} param groups; give one value "
                              "per group or a single number")
        return [_number(schedule, name, v) for v in value]
    return [_number(schedule, name, value)] * groups


def _warmup_type(schedule, value):
    if value not in WARMUP_TYPES:
        raise ConfigError(f"{type(schedule).__name__}: 'warmup_type' must be \"log\" or "
                          f"\"linear\", got {show(value)}")
    return value


def _check_total_after_warmup(schedule, total, warmup):
    # `warmup` is already floored to 2, as DeepSpeed does
    if total < warmup:
        raise ConfigError(f"{type(schedule).__name__}: total_num_steps ({total}) is less than "
                          f"warmup_num_steps ({warmup}; at least 2), so the decay would never "
                          "happen. Raise total_num_steps or lower warmup_num_steps")
    if isinstance(schedule, WarmupCosineLR) and total == warmup:
        raise ConfigError(f"WarmupCosineLR: total_num_steps ({total}) must be greater than "
                          f"warmup_num_steps ({warmup}; at least 2), or the cosine has no steps")

# ---------------------------------------------------------------------------------------------
# The `scheduler` section

ZERO_SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR,
                                                  LRRangeTest)}
NOT_IMPLEMENTED = {"OneCycle": "its one-cycle momentum schedule is not implemented by zero"}
NOT_USABLE_FROM_JSON = ("LRScheduler", "_LRScheduler", "ReduceLROnPlateau")


def build_lr_scheduler(config, optimizer):
    """The schedule `config.scheduler` describes over `optimizer`, or None without a section."""
    if config.scheduler is None:
        return None
    return _construct(config.scheduler, optimizer, config.source)


def engine_lr_scheduler(config, optimizer, client_scheduler):
    """The schedule the engine steps: the one passed to initialize() (or built by it from
    `optimizer`), else the one `config.scheduler` describes, else None. Schedules get the
    torch optimizer (torch's classes insist on one)."""
    if client_scheduler is None:
        return build_lr_scheduler(config, optimizer)
    if config.scheduler is not None:
        logger.warning("an lr_scheduler was passed to initialize(); the config's "
                       "'scheduler' section (%s) is not used", config.scheduler.type)
    if isinstance(client_scheduler, type) or (callable(client_scheduler)
                                              and not hasattr(client_scheduler, "step")):
        client_scheduler = client_scheduler(optimizer)
    if not (callable(getattr(client_scheduler, "step", None))
            and callable(getattr(client_scheduler, "state_dict", None))):
        raise ZeroError("zero.initialize: lr_scheduler must be a schedule (with step() and "
                        "state_dict()) or a callable that builds one from the optimizer, got "
                        f"{type(client_scheduler).__name__} (name a type in the config's "
                        "'scheduler' section instead)")
    scheduled = getattr(client_scheduler, "optimizer", None)
    if isinstance(scheduled, torch.optim.Optimizer) and scheduled is not optimizer:
        # Megatron + DeepSpeed's classic mistake: the schedule was built around an
        # optimizer that the config's 'optimizer' section replaced
        logger.warning("the lr_scheduler passed to initialize() steps another optimizer "
                       "than the engine's, so its learning rates never reach training; "
                       "pass lr_scheduler as a callable taking the optimizer instead")
    return client_scheduler


def check_scheduler_section(section, source):
    """Validates a `scheduler` section on a dummy optimizer (called by DeepSpeedConfig): one
    param group per value of the longest per-group list. Two steps are taken too, since torch's
    schedules only use some arguments (StepLR's step_size) once they step."""
    groups = max([len(v) for v in section.params.values() if isinstance(v, list)] + [1])
    dummy = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]}
                             for _ in range(groups)], lr=1e-3)
    schedule = _construct(section, dummy, source)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "step() before optimizer.step()"
            for _ in range(2):
                schedule.step()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure here comes from the user's JSON values
        fail(source, f"'scheduler.params' {show(section.params)} fail when the "
                     f"{type(schedule).__name__} schedule steps: {e}")


def _construct(section, optimizer, source):
    schedule_class, kwargs = _plan_scheduler(section, source)
    try:
        return schedule_class(optimizer, **kwargs)
    except ConfigError as e:
        fail(source, f"scheduler: {e}")
    except Exception as e:  # noqa: BLE001 -- any failure here comes from the user's JSON values
        fail(source, f"'scheduler.params' {show(kwargs)} rejected by "
                     f"{schedule_class.__name__}: {e}")


def _plan_scheduler(section, source):
    name = section.type
    params = {k: v for k, v in section.params.items() if not (isinstance(v, str) and v == AUTO)}
    matches = [cls for key, cls in ZERO_SCHEDULES.items() if key.lower() == name.lower()]
    if matches:
        schedule_class = matches[0]
    elif name in NOT_IMPLEMENTED:
        fail(source, f"scheduler type \"{name}\": {NOT_IMPLEMENTED[name]}; use "
                     f"{', '.join(ZERO_SCHEDULES)} or a torch.optim.lr_scheduler class")
    else:
        schedule_class = _torch_scheduler(name)
        if schedule_class is None:
            fail(source, _unknown_type_message(name))
    _check_param_names(schedule_class, params, source)
    return schedule_class, params


def _torch_scheduler(name):
    candidate = getattr(torch.optim.lr_scheduler, name, None)
    base = torch.optim.lr_scheduler.LRScheduler
    if name not in NOT_USABLE_FROM_JSON and isinstance(candidate, type) \
            and issubclass(candidate, base):
        return candidate
    return None


def _unknown_type_message(name):
    candidates = list(ZERO_SCHEDULES) + [n for n in dir(torch.optim.lr_scheduler)
                                         if _torch_scheduler(n) is not None]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    hint = f"; did you mean \"{close[0]}\"?" if close else ""
    return (f"unknown scheduler type \"{name}\"{hint} Use {', '.join(ZERO_SCHEDULES)} or a "
            "torch.optim.lr_scheduler class by its exact name")


def _check_param_names(schedule_class, params, source):
    signature = inspect.signature(schedule_class.__init__)
    names = [n for n in signature.parameters if n not in ("self", "optimizer")]
    for key in params:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(names)}"
            fail(source, f"unknown {schedule_class.__name__} parameter "
                         f"'scheduler.params.{key}'; {hint}")
    missing = [n for n, p in signature.parameters.items()
               if n not in ("self", "optimizer") and p.default is p.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in params]
    if missing:
        fail(source, f"{schedule_class.__name__} needs 'scheduler.params.{missing[0]}' "
                     "(a value, not \"auto\": zero cannot infer it)")
