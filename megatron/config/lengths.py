"""Run and schedule lengths in samples (later Megatron-LM's --train-samples, --lr-decay-samples,
--lr-warmup-samples) and in tokens (Megatron-DeepSpeed's --train-tokens, --lr-decay-tokens,
--lr-warmup-tokens), turned into the iterations this trainer counts.

The global batch B is constant (under --rampup-batch-size the lengths stay in samples:
`lengths_under_a_rampup`) and so is the sequence length S
(the sequence-length curriculum is refused), so one iteration is B samples and B·S tokens:
the iteration-based schedule is the sample- or token-based one, up to rounding where a
length is not a whole number of iterations (said in the note).
"""

import math

from megatron.errors import ConfigError

# dest of a length flag -> (the iteration flag it stands for, the unit)
LENGTH_FLAGS = {
    "train_samples": ("train_iters", "samples"), "train_tokens": ("train_iters", "tokens"),
    "lr_decay_samples": ("lr_decay_iters", "samples"),
    "lr_decay_tokens": ("lr_decay_iters", "tokens"),
    "lr_warmup_samples": ("warmup_iters", "samples"),
    "lr_warmup_tokens": ("warmup_iters", "tokens"),
    "lr_wsd_decay_samples": ("lr_wsd_decay_iters", "samples"),
}


def _flag(dest):
    return "--" + dest.replace("_", "-")


def iterations_from_lengths(raw, given, global_batch, seq_length):
    """Set raw's train_iters, lr_decay_iters and warmup_iters (the caller's copy) from the
    sample and token lengths given; returns the start-up note saying what they became."""
    lengths = {dest: raw[dest] for dest in LENGTH_FLAGS if raw.get(dest) is not None}
    if not lengths:
        return ()
    per_iteration = {"samples": global_batch, "tokens": global_batch * seq_length}
    said = []
    for dest, value in lengths.items():
        target, unit = LENGTH_FLAGS[dest]
        others = [d for d in lengths if d != dest and LENGTH_FLAGS[d][0] == target]
        if others:
            raise ConfigError(f"{_flag(dest)} and {_flag(others[0])} both set the "
                              f"{target.replace('_', ' ')}; give one")
        iterations = value / per_iteration[unit]
        if dest == "train_tokens":  # Megatron-DeepSpeed stops at whichever comes first
            whole = math.ceil(iterations)
            rounding = "rounded up: the run stops once it has seen them"
            if raw["train_iters"] is not None and raw["train_iters"] < whole:
                said.append(f"{_flag(dest)} {value} leaves --train-iters "
                            f"{raw['train_iters']} (the fewer)")
                continue
        else:
            if target == "train_iters" and "train_iters" in given:
                raise ConfigError(f"{_flag(dest)} and --train-iters both set the run's length; "
                                  "give one")
            if target == "warmup_iters" and given & {"warmup", "warmup_iters"}:
                raise ConfigError(f"{_flag(dest)} and --warmup/--warmup-iters both set the "
                                  "warmup; give one")
            if target in ("lr_decay_iters", "lr_wsd_decay_iters") and target in given:
                raise ConfigError(f"{_flag(dest)} and {_flag(target)} both set the decay's "
                                  "length; give one")
            if dest == "train_samples":  # Megatron-LM: samples // global batch
                whole, rounding = math.floor(iterations), "rounded down, as in Megatron-LM"
            else:
                whole, rounding = math.floor(iterations + 0.5), "rounded"
        if target != "warmup_iters" and whole < 1:
            if dest == "train_samples":
                raise ConfigError(f"--train-samples {value} is less than one global batch "
                                  f"({global_batch} samples): the run would train nothing")
            whole, rounding = 1, "raised to 1: the shortest a length can be"
        raw[target] = whole
        exact = "" if whole == iterations else f" ({iterations:.2f}, {rounding})"
        said.append(f"{_flag(dest)} {value} is {_flag(target)} {whole}{exact}")
    return (f" note: at {global_batch} samples of {seq_length} tokens an iteration: "
            + "; ".join(said),)


def lengths_under_a_rampup(raw, given, rampup):
    """Under --rampup-batch-size an iteration is no fixed number of samples, so the lengths
    are given in samples, as Megatron-LM asks: the run's (--train-samples, which sets raw's
    train_iters, the caller's copy) and the schedule's (--lr-decay-samples, default the
    run's; --lr-warmup-samples or --warmup's fraction of the decay), which then counts
    samples. Returns the start-up note."""
    flag = "--rampup-batch-size"
    for dest in ("train_iters", "lr_decay_iters", "warmup_iters", "lr_wsd_decay_iters",
                 "train_tokens", "lr_decay_tokens", "lr_warmup_tokens"):
        if dest in given:
            instead = _flag(dest).replace("-iters", "-samples").replace("-tokens", "-samples")
            if dest == "warmup_iters":
                instead = "--lr-warmup-samples"
            raise ConfigError(f"{flag} changes the samples of an iteration, so lengths are "
                              f"given in samples: {instead}, not {_flag(dest)}")
    if "warmup" in given and "lr_warmup_samples" in given:
        raise ConfigError("--lr-warmup-samples and --warmup both set the warmup; give one")
    train_samples = raw["train_samples"]
    if train_samples is None:
        raise ConfigError(f"{flag} needs the run's length in samples: --train-samples")
    ramp_iterations, ramp_samples = rampup.ramp
    if train_samples < ramp_samples:
        raise ConfigError(f"--train-samples {train_samples} ends inside the batch-size ramp, "
                          f"which takes {ramp_iterations} iterations and {ramp_samples} samples "
                          f"(from {rampup.start} to {rampup.final}); give at least that many "
                          f"(the launch scripts: TRAIN_ITERS="
                          f"{-(-ramp_samples // rampup.final)} or more, global batches of "
                          f"{rampup.final}), or a ramp of fewer samples")
    raw["train_iters"] = rampup.iterations_for(train_samples)
    return (f" note: {flag} {rampup.start} {rampup.increment} {rampup.samples}: the global "
            f"batch grows from {rampup.start} by {rampup.increment} to {rampup.final} over the "
            f"first {ramp_iterations} iterations ({ramp_samples} samples); --train-samples "
            f"{train_samples} is {raw['train_iters']} iterations, and the learning-rate "
            "schedule counts samples",)
