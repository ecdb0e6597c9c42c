"""Run and schedule lengths in samples (later Megatron-LM's --train-samples, --lr-decay-samples,
--lr-warmup-samples) and in tokens (Megatron-DeepSpeed's --train-tokens, --lr-decay-tokens,
--lr-warmup-tokens), turned into the iterations this trainer counts.

The global batch B is constant (batch-size rampup is refused) and so is the sequence length S
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
            if target == "lr_decay_iters" and "lr_decay_iters" in given:
                raise ConfigError(f"{_flag(dest)} and --lr-decay-iters both set the decay's "
                                  "length; give one")
            if dest == "train_samples":  # Megatron-LM: samples // global batch
                whole, rounding = math.floor(iterations), "rounded down, as in Megatron-LM"
            else:
                whole, rounding = math.floor(iterations + 0.5), "rounded"
        if target != "warmup_iters":
            whole = max(1, whole)
        raw[target] = whole
        exact = "" if whole == iterations else f" ({iterations:.2f}, {rounding})"
        said.append(f"{_flag(dest)} {value} is {_flag(target)} {whole}{exact}")
    return (f" note: at {global_batch} samples of {seq_length} tokens an iteration: "
            + "; ".join(said),)
