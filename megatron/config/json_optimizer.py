"""The DeepSpeed JSON's 'optimizer' and 'scheduler' sections against Megatron's optimizer
and schedule flags (under --deepspeed): a given flag fills an "auto" or absent key and must
agree with a set one; a 'scheduler' section replaces Megatron's schedule, its "auto" values
filled from the schedule the flags describe, as Hugging Face's Trainer fills them."""

import math

from megatron.errors import ConfigError

# Megatron optimizer flags -> the key of the JSON optimizer's params they describe
# (--lr is not among them: Megatron's schedule sets the lr, see settle_optimizer_params)
_OPTIMIZER_FLAGS = {"weight_decay": ("--weight-decay", "weight_decay"),
                    "adam_beta1": ("--adam-beta1", "betas"),
                    "adam_beta2": ("--adam-beta2", "betas"), "adam_eps": ("--adam-eps", "eps")}
_ADAM_TYPES = ("adam", "adamw", "adam8bit", "adamw8bit", "adam4bit", "adamw4bit")
# the flags of Megatron's learning-rate schedule, which a JSON 'scheduler' section replaces
_SCHEDULE_FLAGS = {"lr": "--lr", "lr_decay_style": "--lr-decay-style",
                   "lr_decay_iters": "--lr-decay-iters", "min_lr": "--min-lr",
                   "warmup": "--warmup", "warmup_iters": "--warmup-iters",
                   "lr_wsd_decay_iters": "--lr-wsd-decay-iters",
                   "lr_wsd_decay_samples": "--lr-wsd-decay-samples",
                   "lr_wsd_decay_style": "--lr-wsd-decay-style"}


def schedule_lengths(raw):
    """(decay iterations, warmup iterations) of the learning-rate schedule the flags `raw`
    describe: --lr-decay-iters (default --train-iters), --warmup-iters or --warmup x that.
    A fraction's warmup stays fractional, as in Megatron-LM (0.01 of 150 iterations is 1.5:
    the first step's lr is 1/1.5 of --lr); an int where it is whole. Under
    --rampup-batch-size the schedule counts samples: (decay samples, warmup samples) from
    --lr-decay-samples (default --train-samples), --lr-warmup-samples or --warmup x that."""
    if raw.get("rampup_batch_size") is not None:
        decay = raw["lr_decay_samples"] or raw["train_samples"]
        warmup, unit = raw["lr_warmup_samples"], "samples"
    else:
        decay = raw["train_iters"] if raw["lr_decay_iters"] is None else raw["lr_decay_iters"]
        warmup, unit = raw["warmup_iters"], "iterations"
    if warmup is None:
        warmup = float(raw["warmup"]) * decay  # (0.07 x 100 is 7.000000000000001)
        whole = round(warmup)
        warmup = whole if abs(warmup - whole) < 1e-9 else warmup
    if not 0 <= warmup <= decay:
        raise ConfigError(
            f"the warmup ({warmup:g} {unit}, from {_given(raw, _WARMUP_FLAGS)}) must lie "
            f"between 0 and the decay's end ({decay:g} {unit}, from "
            f"{_given(raw, _DECAY_FLAGS)})")
    return decay, warmup


# where a schedule length came from, first match: (dest, flag); lengths.py turned sample and
# token lengths into iterations without a ramp
_WARMUP_FLAGS = (("lr_warmup_samples", "--lr-warmup-samples"),
                 ("lr_warmup_tokens", "--lr-warmup-tokens"), ("warmup_iters", "--warmup-iters"),
                 ("warmup", "--warmup"))
_DECAY_FLAGS = (("lr_decay_samples", "--lr-decay-samples"),
                ("lr_decay_tokens", "--lr-decay-tokens"), ("lr_decay_iters", "--lr-decay-iters"),
                ("train_samples", "--train-samples"), ("train_tokens", "--train-tokens"),
                ("train_iters", "--train-iters"))


def _given(raw, flags):
    return next(f"{flag} {raw[dest]:g}" for dest, flag in flags if raw.get(dest) is not None)


def wsd_decay_length(raw, given, decay):
    """--lr-decay-style WSD's decay length, in the schedule's unit (`decay`: schedule_lengths'),
    or None for another style; its flags without WSD are an error."""
    unit = "samples" if raw.get("rampup_batch_size") is not None else "iters"
    length = raw[f"lr_wsd_decay_{unit}"]
    if raw["lr_decay_style"] != "WSD":
        stray = [flag for flag in ("lr_wsd_decay_iters", "lr_wsd_decay_samples",
                                   "lr_wsd_decay_style") if flag in given]
        if stray:
            raise ConfigError(f"--{stray[0].replace('_', '-')} has no effect without "
                              "--lr-decay-style WSD; add that or drop it")
        return None
    if length is None:
        raise ConfigError(f"--lr-decay-style WSD needs the length of its decay, the last steps "
                          f"of the schedule: --lr-wsd-decay-{unit} N (Megatron-LM's)")
    typed = f"--lr-wsd-decay-{unit} {length}"
    if unit == "iters" and "lr_wsd_decay_samples" in given:  # (lengths.py made it iterations)
        typed = f"--lr-wsd-decay-samples {raw['lr_wsd_decay_samples']} ({length} iterations)"
    if not 0 < length <= decay:
        raise ConfigError(f"{typed}: WSD's decay must be positive and within the schedule's "
                          f"{decay} {'samples' if unit == 'samples' else 'iterations'} "
                          f"(--lr-decay-{unit}); as in Megatron-LM, one that starts inside the "
                          "warmup drops the lr from the warmup's value")
    return length


def _fill_auto_schedule(section, raw):
    """Hugging Face's "auto" in a JSON 'scheduler' takes the schedule the flags describe (as
    its Trainer fills them): warmup_min_lr 0, warmup_max_lr --lr, warmup_num_steps the
    warmup iterations (rounded up where a --warmup fraction leaves part of one, as the
    Trainer rounds its warmup_ratio), total_num_steps the decay iterations. Returns the flag
    dests used."""
    from zero.config.parsing import AUTO
    params = section.get("params")
    if not isinstance(params, dict):
        return set()  # the parse says why
    decay_iters, warmup_iters = schedule_lengths(raw)
    fills = {"warmup_min_lr": (0.0, ()), "warmup_max_lr": (raw["lr"], ("lr",)),
             "warmup_num_steps": (math.ceil(warmup_iters),
                                  ("warmup", "warmup_iters", "lr_decay_iters", "train_iters")),
             "total_num_steps": (decay_iters, ("lr_decay_iters", "train_iters"))}
    used = set()
    for key, (value, dests) in fills.items():
        if params.get(key) == AUTO:
            params[key] = value
            used.update(dests)
    return used


def _lr_is_the_schedules_base(final):
    """Whether --lr reaches the lr a JSON 'scheduler' works from: WarmupCosineLR and torch's
    schedules scale the optimizer's lr, which is --lr when the flags build the optimizer or
    its 'lr' is "auto"; WarmupLR, WarmupDecayLR and LRRangeTest set absolute values."""
    from zero.config.parsing import AUTO
    kind = str(final["scheduler"].get("type", "")).lower()
    if kind in ("warmuplr", "warmupdecaylr", "lrrangetest"):
        return False
    optimizer = final.get("optimizer")
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    return optimizer is None or (isinstance(params, dict) and params.get("lr") == AUTO)


def settle_optimizer_params(final, raw, given, source):
    """The JSON optimizer's params against the Megatron optimizer flags: "auto" (Hugging
    Face's spelling) and a key the JSON leaves out take a given flag's value; a value the
    JSON sets must equal a given flag's. A 'scheduler' section replaces Megatron's schedule
    (its flags get a note); without one, Megatron's schedule sets the lr from --lr."""
    from zero.config.parsing import AUTO, show
    notes = []
    if isinstance(final.get("scheduler"), dict):  # a note: the launch scripts pass these
        used = _fill_auto_schedule(final["scheduler"], raw)
        if _lr_is_the_schedules_base(final):
            used.add("lr")
        unused = [flag for dest, flag in _SCHEDULE_FLAGS.items()
                  if dest in given and dest not in used]
        if unused:
            notes.append(f" note: {', '.join(unused)} not used: the 'scheduler' section of "
                         f"DeepSpeed config {source} sets the learning rate under --deepspeed, "
                         "not Megatron's schedule")
    section = final.get("optimizer")
    if not isinstance(section, dict) or not isinstance(section.get("params", {}), dict):
        return tuple(notes)  # none: the flags build the optimizer; a bad one: the parse says
    params = section.setdefault("params", {})
    adam = str(section.get("type", "")).lower() in _ADAM_TYPES
    flag_values = {"lr": raw["lr"], "weight_decay": raw["weight_decay"], "eps": raw["adam_eps"],
                   "betas": [raw["adam_beta1"], raw["adam_beta2"]]}
    for key, value in flag_values.items():
        if params.get(key) == AUTO:
            params[key] = value
    for dest, (flag, key) in _OPTIMIZER_FLAGS.items():
        if dest not in given:
            continue
        if key != "weight_decay" and not adam:
            raise ConfigError(f"{flag} sets an Adam hyperparameter, but the optimizer of "
                              f"DeepSpeed config {source} is \"{section.get('type')}\"; drop "
                              "the flag")
        if key not in params:
            params[key] = flag_values[key]
            continue
        json_value = params[key][dest == "adam_beta2"] if key == "betas" \
            and isinstance(params[key], list) and len(params[key]) == 2 else params[key]
        if json_value != raw[dest]:
            raise ConfigError(f"{flag} {raw[dest]} disagrees with 'optimizer.params.{key}': "
                              f"{show(params[key])} in DeepSpeed config {source}, which decides "
                              "under --deepspeed; drop the flag or change the config")
    json_lr = params.get("lr")
    if "scheduler" not in final and raw["lr"] is not None and json_lr is not None \
            and json_lr != raw["lr"]:
        notes.append(f" note: 'optimizer.params.lr' {show(json_lr)} in DeepSpeed config "
                     f"{source} is replaced by Megatron's schedule from --lr {raw['lr']} (the "
                     "config has no 'scheduler' section)")
    return tuple(notes)
