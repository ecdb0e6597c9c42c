"""How --checkpoint-activations keeps its checkpoints: Megatron's recompute, or DeepSpeed's
(zero.checkpointing) with partitioned / CPU / contiguous checkpoints.

    --checkpoint-activations [--checkpoint-num-layers K]   recompute chunks of K layers
        (megatron.mpu.checkpoint: each chunk keeps only its input)
    --deepspeed-activation-checkpointing   the same recompute through zero.checkpointing,
        configured from the flags below and the DeepSpeed config's activation_checkpointing
        section (the flags win, as the --zero-* flags do over zero_optimization):
            --partition-activations | --distribute-checkpointed-activations  partition_activations
            --checkpoint-in-cpu                                             cpu_checkpointing
            --contigious-checkpointing | --contiguous-checkpointing   contiguous_memory_optimization
            --synchronize-each-layer                            synchronize_checkpoint_boundary
            --profile-backward                                                          profile
        number_checkpoints is always the count one forward makes: layers / K (x 2 with
        --split-transformers), as Megatron-DeepSpeed passes it.
    --split-transformers   checkpoint the attention half and the MLP half of every layer
        separately (K then counts halves): twice the checkpoints, half the recompute each.

Megatron-DeepSpeed's scripts set --partition-activations etc. without
--deepspeed-activation-checkpointing, where they silently do nothing; here any of those
options (flag or config key) turns DeepSpeed checkpointing on and says so in one line.
Without --deepspeed the flags work too (zero.checkpointing needs no engine).
"""

from megatron.config.sections import ActivationCheckpointConfig, RecomputeOptions
from megatron.errors import ConfigError

# flag dest -> activation_checkpointing key it sets
_OPTION_FLAGS = (("partition_activations", "partition_activations"),
                 ("checkpoint_in_cpu", "cpu_checkpointing"),
                 ("contiguous_checkpointing", "contiguous_memory_optimization"),
                 ("synchronize_each_layer", "synchronize_checkpoint_boundary"),
                 ("profile_backward", "profile"))


def activation_checkpointing(raw, enabled, section, num_layers, model_parallel_size):
    """The ActivationCheckpointConfig for the flags `raw`, whether checkpointing is on
    (`enabled`: the flag or the config's gradient_checkpointing), and the DeepSpeed config's
    typed activation_checkpointing `section`."""
    per_layer = raw["checkpoint_num_layers"]
    if per_layer < 1:
        raise ConfigError(f"--checkpoint-num-layers must be >= 1, got {per_layer}")
    if raw["distribute_checkpointed_activations"]:
        raw = dict(raw, partition_activations=True)
    chosen = {key: bool(getattr(section, key)) for _, key in _OPTION_FLAGS}
    chosen.update({key: True for dest, key in _OPTION_FLAGS if raw[dest]})
    asked = [f"--{dest.replace('_', '-')}" for dest, _ in _OPTION_FLAGS if raw[dest]]
    asked += [f"'activation_checkpointing.{key}'" for _, key in _OPTION_FLAGS
              if getattr(section, key)]
    for flag, on in (("--checkpoint-num-layers", per_layer != 1),  # (1: its default)
                     ("--split-transformers", raw["split_transformers"]),
                     ("--distribute-checkpointed-activations",
                      raw["distribute_checkpointed_activations"]),
                     ("--deepspeed-activation-checkpointing",
                      raw["deepspeed_activation_checkpointing"]), *((a, True) for a in asked)):
        if on and not enabled:
            raise ConfigError(f"{flag} acts on the checkpoints of --checkpoint-activations, "
                              "which is off; add --checkpoint-activations")
    if enabled and num_layers % per_layer:
        raise ConfigError(f"--checkpoint-num-layers {per_layer} does not divide --num-layers "
                          f"{num_layers} ({num_layers} % {per_layer} = {num_layers % per_layer})")
    notes, options = [], None
    if raw["deepspeed_activation_checkpointing"] or asked:
        if not raw["deepspeed_activation_checkpointing"]:
            notes.append(f" note: {', '.join(asked)} turn(s) on "
                         "--deepspeed-activation-checkpointing")
        options = _recompute_options(chosen, section, num_layers // per_layer *
                                     (2 if raw["split_transformers"] else 1),
                                     model_parallel_size, notes)
    elif section.number_checkpoints is not None:
        missing = ("" if enabled else "--checkpoint-activations ") + \
            "--deepspeed-activation-checkpointing"
        notes.append(" note: 'activation_checkpointing.number_checkpoints' not used: it sizes "
                     f"DeepSpeed's activation checkpointing, which is off (add {missing})")
    return ActivationCheckpointConfig(enabled, per_layer, raw["split_transformers"], options,
                                      tuple(notes))


def _recompute_options(chosen, section, num_checkpoints, model_parallel_size, notes):
    given = section.number_checkpoints
    if given is not None and given != num_checkpoints:
        notes.append(f" note: 'activation_checkpointing.number_checkpoints' {given} replaced by "
                     f"{num_checkpoints}, the checkpoints one forward makes")
    if chosen["partition_activations"] and model_parallel_size == 1:
        notes.append(" note: partitioned activations split checkpoints across tensor-parallel "
                     "ranks; with --model-parallel-size 1 each rank keeps them whole (no-op)")
    return RecomputeOptions(
        partition_activations=chosen["partition_activations"],
        checkpoint_in_cpu=chosen["cpu_checkpointing"],
        contiguous_checkpointing=chosen["contiguous_memory_optimization"],
        num_checkpoints=num_checkpoints,
        synchronize=chosen["synchronize_checkpoint_boundary"],
        profile=chosen["profile"])
