"""Parse the command line, merge what `--load`'s checkpoint supplies, validate, freeze.

    config = resolve_config(argv)          # a frozen TrainConfig, before any process group

Each flag is validated here once, with the arithmetic in the one-line error; the values other
flags, the checkpoint or the DeepSpeed JSON decide are settled here too, so nothing downstream
fills in or checks a flag again. Architecture checks are the model's own
(`megatron.model.shape.check_shape`, which imports no torch), called from here.
"""

import dataclasses
import math
import os
import sys
from types import MappingProxyType

from megatron.config import activation, engine, json_optimizer, lengths
from megatron.config.batch_rampup import rampup_from_flags
from megatron.config.exit_flags import kill_switch_file
from megatron.config.command_line import (in_the_users_spelling, parse_command_line,
                                          repeated_flag_notes)
from megatron.config.flags import build_parser, given_on_command_line
from megatron.config.logging_flags import resolve_logging, timing_option_note
from megatron.config.profiling_flags import (empty_cache_notes, manual_gc_fields,
                                             resolve_profiler)
from megatron.config.megatron_flags import always_so_notes
from megatron.config.pipeline_checks import check_pipeline, checkpoints_per_model_chunk
from megatron.config.from_checkpoint import (describe, load_dir_notes, load_step, resume_notes,
                                             values_from_checkpoint)
from megatron.config.sections import (CheckpointConfig, DataConfig, EngineConfig, ModelConfig,
                                      OptimizerConfig, ParallelConfig, PrecisionConfig,
                                      TrainConfig, TrainingConfig)
from megatron.data.data_path import parse_data_path
from megatron.data.splits import parse_splits
from megatron.errors import require

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "batch_size",
            "train_iters", "lr")
POSITIVE_INTS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "batch_size", "train_iters", "train_samples", "train_tokens",
                 "lr_decay_samples", "lr_decay_tokens", "max_position_embeddings",
                 "global_batch_size", "ffn_hidden_size", "make_vocab_size_divisible_by",
                 "exit_interval", "save_interval", "log_interval", "eval_interval",
                 "lr_decay_iters", "model_parallel_size", "pipeline_model_parallel_size",
                 "num_layers_per_virtual_pipeline_stage", "threads",
                 "check_weight_hash_across_dp_replicas_interval")
MAX_INT = 2 ** 31 - 1
NON_NEGATIVE_INTS = ("eval_iters", "num_workers", "warmup_iters", "max_nan_iterations",
                     "lr_warmup_samples", "lr_warmup_tokens")
# float flags that must be finite (NaN and inf are never meaningful) -> (low, high, what)
FLOAT_RANGES = {
    "lr": (0.0, None, "non-negative"), "min_lr": (0.0, None, "non-negative"),
    "weight_decay": (0.0, None, "non-negative"), "adam_eps": (0.0, None, "positive"),
    "adam_beta1": (0.0, 1.0, "in [0, 1)"), "adam_beta2": (0.0, 1.0, "in [0, 1)"),
    "warmup": (0.0, 1.0, "a fraction in [0, 1]"),
    "init_method_std": (0.0, None, "positive"), "layernorm_epsilon": (0.0, None, "positive"),
    "distributed_timeout_minutes": (0.0, None, "positive"),
    "exit_duration_in_mins": (0.0, None, "positive"),
}
_STRICT_LOW = {"adam_eps", "init_method_std", "layernorm_epsilon",
               "distributed_timeout_minutes", "exit_duration_in_mins"}
_INCLUSIVE_HIGH = {"warmup"}


# (token counts pass 2**31 in real runs: Megatron-DeepSpeed's --train-tokens 300B)
INT_FLAGS = tuple(action.dest for action in build_parser()._actions if action.type is int
                  and action.nargs is None and not action.dest.endswith("_tokens"))


def resolve_config(argv=None, world_size=None, defaults=None, extra_args_provider=None):
    """The frozen TrainConfig of a pretrain_gpt2.py command line.

    `defaults` fills flags the user did not give (Megatron's `args_defaults`);
    `extra_args_provider(parser) -> parser` adds a script's own flags, whose values land in
    `config.extra`. `world_size` defaults to what the launcher says (torchrun, SLURM or
    OpenMPI variables; 1 when absent).
    """
    parser = build_parser()
    known = {action.dest for action in parser._actions}
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    argv, raw = parse_command_line(parser, argv)
    given = given_on_command_line(parser, argv)
    if raw["deepspeed_mpi"]:  # rank and world size from the MPI launcher, before they are read
        from zero.config.arguments import apply_mpi_environment
        apply_mpi_environment()
    load_notes = load_dir_notes(raw)
    taken = values_from_checkpoint(raw, given)
    raw.update(taken)
    for key, value in (defaults or {}).items():
        if raw.get(key) is None:
            raw[key] = value
    if world_size is None:
        from megatron.runtime.launch import discover_launch_environment
        world_size = discover_launch_environment().world_size
    extra = {key: value for key, value in raw.items() if key not in known}
    notes = always_so_notes(raw) + repeated_flag_notes(parser, argv)
    notes += load_notes + ((describe(raw["load"], taken),) if taken else ())
    notes += resume_notes(raw)
    with in_the_users_spelling(parser, argv):
        return freeze(raw, given, world_size, notes, extra)


def freeze(raw, given, world_size, notes=(), extra=None):
    """TrainConfig from the parsed flags `raw` (`given`: the flags on the command line)."""
    raw = dict(raw)
    _fill_model_defaults(raw)
    _check_scalars(raw, INT_FLAGS)
    require(not {"warmup", "warmup_iters"} <= set(given),
            f"--warmup {raw['warmup']:g} and --warmup-iters {raw['warmup_iters']} both set the "
            "warmup (as a fraction of --lr-decay-iters, and in iterations); give one")
    engine.check_deepspeed_only_flags(raw, given)
    parallel = _parallel(raw, world_size)
    if raw["batch_size"] is None:  # --deepspeed without --batch-size
        raw["batch_size"] = engine.micro_batch_from_json(raw, parallel.data_parallel_size)
    global_batch, named = _global_batch_before_the_engine(raw, parallel)
    rampup = rampup_from_flags(raw, global_batch, named,
                               raw["batch_size"] * parallel.data_parallel_size)
    notes += lengths.lengths_under_a_rampup(raw, given, rampup) if rampup else \
        lengths.iterations_from_lengths(raw, given, global_batch, raw["seq_length"])
    training = _training(raw, given, parallel)
    settled = engine.settle_engine(raw, given, parallel.data_parallel_size,
                                   training.num_micro_batches)
    require(rampup is None or settled.ds_config.scheduler is None,
            "--rampup-batch-size changes the samples of an optimizer step, which the DeepSpeed "
            "config's 'scheduler' section counts; drop that section for Megatron's schedule "
            "(--lr, --lr-decay-style, --lr-decay-samples, --lr-warmup-samples), which counts "
            "samples under a ramp")
    training = dataclasses.replace(training, global_batch_size=settled.global_batch_size,
                                   num_micro_batches=settled.num_micro_batches)
    model = _model(raw, parallel.model_parallel_size)
    kv_channels = raw["kv_channels"]
    require(kv_channels is None
            or kv_channels * model.num_attention_heads == model.hidden_size,
            f"--kv-channels {kv_channels} is not --hidden-size {model.hidden_size} / "
            f"--num-attention-heads {model.num_attention_heads}: each head has hidden / heads "
            "channels here (other head sizes are not built)")
    require(raw["seq_length"] <= model.max_position_embeddings,
            f"--seq-length {raw['seq_length']} is longer than --max-position-embeddings "
            f"{model.max_position_embeddings}")
    checkpoint = _checkpoint(raw)
    _check_optimizer_choice(raw, settled.ds_config)
    notes += settled.notes
    if settled.ds_config.scheduler is None:  # else the JSON's schedule sets the lr
        notes += _schedule_end_note(raw, training.train_iters)
    notes += check_pipeline(raw, parallel, training, settled.ds_config)
    notes += _replica_check(training, parallel, settled.ds_config)
    notes += timing_option_note(raw, given, settled.ds_config)
    notes += empty_cache_notes(raw, raw["empty_unused_memory_level"] and
                               _runs_on_cuda(raw["device"]))
    recompute = activation.activation_checkpointing(
        raw, settled.checkpoint_activations, settled.ds_config.activation_checkpointing,
        model.num_layers, parallel.model_parallel_size)
    notes += checkpoints_per_model_chunk(parallel, model.num_layers, recompute)
    options = recompute.deepspeed_activation_checkpointing
    require(not (parallel.pipeline_model_parallel_size > 1 and options is not None
                 and options.contiguous_checkpointing),
            "contiguous activation checkpoints (--contiguous-checkpointing, 'activation_"
            "checkpointing.contiguous_memory_optimization') keep one forward's checkpoints in "
            "one buffer, but a pipeline stage holds several micro batches' forwards at once; "
            "drop it with --pipeline-model-parallel-size")
    logging = resolve_logging(raw, given, settled.ds_config)
    profiler, profiler_notes = resolve_profiler(raw, given, world_size, logging.log_dir,
                                                training.train_iters)
    return TrainConfig(
        model=model,
        activation_checkpointing=recompute,
        data=_data(raw, given),
        optimizer=_optimizer(raw, given, settled.clip_grad,
                             json_schedule=settled.ds_config.scheduler is not None),
        precision=PrecisionConfig(fp16=settled.fp16, bf16=settled.bf16),
        parallel=parallel,
        training=training,
        checkpoint=checkpoint,
        logging=logging,
        engine=EngineConfig(deepspeed=raw["deepspeed"], deepspeed_config=raw["deepspeed_config"],
                            ds_config=settled.ds_config, remote_device=raw["remote_device"],
                            use_pin_memory=raw["use_pin_memory"]),
        profiler=profiler, notes=tuple(notes) + profiler_notes,
        extra=MappingProxyType(dict(extra or {})))


def _replica_check(training, parallel, ds_config):
    """--check-weight-hash-across-dp-replicas-interval compares replicas: none at stage 3,
    whose data-parallel ranks hold different parts of each weight, nor with one rank."""
    interval = training.check_weight_hash_across_dp_replicas_interval
    if interval is None:
        return ()
    require(ds_config.zero_optimization.stage < 3,
            "--check-weight-hash-across-dp-replicas-interval compares the weights data-parallel "
            "replicas hold; at ZeRO stage 3 each rank holds its own part of them")
    if parallel.data_parallel_size > 1:
        return ()
    return (" note: --check-weight-hash-across-dp-replicas-interval: one data-parallel rank, no "
            "replicas to compare",)


def _fill_model_defaults(raw):
    if raw["model_size"] is not None:
        from megatron.model.shape import MODEL_SIZES
        require(raw["model_size"] in MODEL_SIZES,
                f"--model-size {raw['model_size']!r} is not known; choose one of "
                f"{', '.join(sorted(MODEL_SIZES))}")
        for key, value in MODEL_SIZES[raw["model_size"]].items():
            if raw[key] is None:
                raw[key] = value
    for flag in REQUIRED:
        if flag in ("batch_size", "lr") and raw["deepspeed"]:
            continue  # the DeepSpeed JSON may set it (taken from there just below)
        if flag == "train_iters" and any(raw[length] is not None for length in (
                "train_samples", "train_tokens", "rampup_batch_size")):
            continue  # in samples or tokens (lengths.py, once the global batch is known)
        require(raw[flag] is not None, f"--{flag.replace('_', '-')} is required"
                + (" (or --train-samples / --train-tokens)" if flag == "train_iters" else ""))
    if raw["lr"] is None:  # --deepspeed without --lr
        raw["lr"] = engine.lr_from_json(raw)
    if raw["max_position_embeddings"] is None:
        raw["max_position_embeddings"] = raw["seq_length"]
    if raw["ffn_hidden_size"] is None and isinstance(raw["hidden_size"], int):
        raw["ffn_hidden_size"] = 4 * raw["hidden_size"]


def _check_scalars(raw, int_flags):
    for flag in int_flags:  # sizes and counts: a 32-bit signed int holds every sensible one
        value = raw.get(flag)
        require(value is None or abs(value) <= MAX_INT,
                f"--{flag.replace('_', '-')} {value} is out of range (at most {MAX_INT})")
    require(raw["seed"] >= 0, f"--seed must be >= 0, got {raw['seed']}")
    for flag in POSITIVE_INTS:
        value = raw.get(flag)
        require(value is None or value > 0, f"--{flag.replace('_', '-')} must be positive, got "
                                            f"{value}")
    for flag in NON_NEGATIVE_INTS:
        value = raw.get(flag)
        require(value is None or value >= 0, f"--{flag.replace('_', '-')} must be >= 0, got "
                                             f"{value}")
    for flag, (low, high, what) in FLOAT_RANGES.items():
        value = raw.get(flag)
        if value is None:
            continue
        ok = math.isfinite(value) and (value > low if flag in _STRICT_LOW else value >= low)
        if high is not None:
            ok = ok and (value <= high if flag in _INCLUSIVE_HIGH else value < high)
        require(ok, f"--{flag.replace('_', '-')} must be {what}, got {value}")
    require(raw["min_lr"] <= raw["lr"], f"--min-lr {raw['min_lr']} is larger than --lr "
                                        f"{raw['lr']}")
    require(not (raw["fp16"] and raw["bf16"]), "--fp16 and --bf16 are mutually exclusive")


def _parallel(raw, world_size):
    tp, pp = raw["model_parallel_size"], raw["pipeline_model_parallel_size"]
    require(world_size % tp == 0,
            f"world size {world_size} is not divisible by --model-parallel-size {tp} "
            f"({world_size} % {tp} = {world_size % tp})")
    require(world_size % (tp * pp) == 0,
            f"world size {world_size} is not divisible by --model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp} ({world_size} % {tp * pp} = "
            f"{world_size % (tp * pp)}); start a multiple of {tp * pp} processes")
    require(not (raw["no_pipeline_parallel"] and pp > 1),
            f"--no-pipeline-parallel asks for no pipeline, but --pipeline-model-parallel-size "
            f"is {pp}: drop one of them")
    require(not (raw["universal_checkpoint"] and raw["load"]
                 and os.path.isfile(os.path.join(raw["load"], "latest_universal"))),
            f"--universal-checkpoint: {raw['load']}/latest_universal names a folder converted "
            "by DeepSpeed's ds_to_universal.py, which is not read here (it may be another step "
            "than `latest`'s); --load resumes this trainer's own checkpoints at any data-"
            "parallel size and ZeRO stage as they are: point --load at one")
    per_virtual = raw["num_layers_per_virtual_pipeline_stage"]
    chunks = 1
    if per_virtual is not None:
        require(pp > 1, "--num-layers-per-virtual-pipeline-stage needs "
                        "--pipeline-model-parallel-size > 1")
        stage_blocks = per_virtual * pp
        require(raw["num_layers"] % stage_blocks == 0,
                f"--num-layers {raw['num_layers']} is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {per_virtual} x "
                f"--pipeline-model-parallel-size {pp} = {stage_blocks} "
                f"({raw['num_layers']} % {stage_blocks} = {raw['num_layers'] % stage_blocks})")
        chunks = raw["num_layers"] // stage_blocks
    return ParallelConfig(
        world_size=world_size, model_parallel_size=tp, pipeline_model_parallel_size=pp,
        num_layers_per_virtual_pipeline_stage=per_virtual,
        virtual_pipeline_model_parallel_size=chunks,
        data_parallel_size=world_size // (tp * pp),
        distributed_backend=raw["distributed_backend"], device=raw["device"],
        local_rank=raw["local_rank"],
        distributed_timeout_minutes=raw["distributed_timeout_minutes"], threads=raw["threads"],
        DDP_impl=raw["DDP_impl"], seed=raw["seed"],
        ddp_bucket_size=engine.DEFAULT_DDP_BUCKET_MB if raw["ddp_bucket_size"] is None
        else raw["ddp_bucket_size"])


def _global_batch_before_the_engine(raw, parallel):
    """(the global batch the engine will settle on, where it comes from in words), for
    lengths in samples: --global-batch-size, the DeepSpeed JSON's train_batch_size, or the
    micro batch x data-parallel size."""
    if raw["global_batch_size"] is not None:
        return raw["global_batch_size"], f"--global-batch-size {raw['global_batch_size']}"
    from_json = engine.global_batch_from_json(raw, parallel.data_parallel_size) \
        if raw["deepspeed"] else None
    if from_json:
        return from_json, f"the DeepSpeed config's global batch {from_json}"
    per_step = raw["batch_size"] * parallel.data_parallel_size
    return per_step, (f"the global batch {per_step} (--batch-size x data-parallel size; "
                      "--global-batch-size sets another)")


def _training(raw, given, parallel):
    """The batch arithmetic from the flags (a DeepSpeed JSON may still decide it)."""
    per_step = raw["batch_size"] * parallel.data_parallel_size
    global_batch = per_step if raw["global_batch_size"] is None else raw["global_batch_size"]
    require(global_batch % per_step == 0,
            f"--global-batch-size {global_batch} is not divisible by --batch-size "
            f"{raw['batch_size']} x data-parallel size {parallel.data_parallel_size} = "
            f"{per_step} ({global_batch} % {per_step} = {global_batch % per_step})")
    return TrainingConfig(
        batch_size=raw["batch_size"], global_batch_size=global_batch,
        num_micro_batches=global_batch // per_step, train_iters=raw["train_iters"],
        exit_interval=raw["exit_interval"], eval_iters=raw["eval_iters"],
        eval_interval=raw["eval_interval"], exit_signal_handler=raw["exit_signal_handler"],
        exit_duration_in_mins=raw["exit_duration_in_mins"],
        kill_switch_file=kill_switch_file(raw["kill_switch_file"]),
        max_nan_iterations=raw["max_nan_iterations"],
        check_weight_hash_across_dp_replicas_interval=raw[
            "check_weight_hash_across_dp_replicas_interval"],
        rampup_batch_size=None if raw["rampup_batch_size"] is None
        else tuple(raw["rampup_batch_size"]), **manual_gc_fields(raw, given),
        empty_unused_memory_level=raw["empty_unused_memory_level"])


def _model(raw, model_parallel_size):
    from megatron.model.shape import check_shape
    tiled = raw["memory_centric_tiled_linear"]
    require(raw["tile_factor"] is None or tiled,
            f"--tile-factor {raw['tile_factor']} has no effect without "
            "--memory-centric-tiled-linear; add that flag or drop --tile-factor")
    model = ModelConfig(
        num_layers=raw["num_layers"], hidden_size=raw["hidden_size"],
        ffn_hidden_size=raw["ffn_hidden_size"], num_attention_heads=raw["num_attention_heads"],
        max_position_embeddings=raw["max_position_embeddings"],
        make_vocab_size_divisible_by=raw["make_vocab_size_divisible_by"],
        layernorm_epsilon=raw["layernorm_epsilon"], init_method_std=raw["init_method_std"],
        attention_dropout=raw["attention_dropout"], hidden_dropout=raw["hidden_dropout"],
        memory_centric_tiled_linear=tiled,
        tile_factor=1 if raw["tile_factor"] is None else raw["tile_factor"])
    check_shape(model, model_parallel_size)
    return model


def _data(raw, given):
    sources = [raw["data_path"], raw["train_data"], raw["train_data_path"]]
    require(sum(source is not None for source in sources) == 1,
            "give exactly one of --data-path (a preprocessed .bin/.idx prefix, or a blend), "
            "--train-data (a loose-JSON corpus name or path) or --train-data-path (the train "
            "split's own datasets, with --valid-data-path and --test-data-path)")
    require(raw["train_data_path"] is not None or (raw["valid_data_path"] is None
                                                   and raw["test_data_path"] is None),
            "--valid-data-path and --test-data-path go with --train-data-path (each split's "
            "own datasets); with --data-path, --split cuts the validation and test documents")
    require(raw["train_data_path"] is None or "split" not in given,
            "--split cuts --data-path's datasets into train, validation and test; with "
            "--train-data-path each split reads all of its own datasets: drop --split")
    values = {name: raw[name] for name in DataConfig.__dataclass_fields__}
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if raw[name] is not None:  # (a string from a caller's defaults: one prefix)
            values[name] = (raw[name],) if isinstance(raw[name], str) else tuple(raw[name])
            parse_data_path(values[name], flag=f"--{name.replace('_', '-')}")  # errors now
    require(raw["tokenizer_type"] is not None, "--tokenizer-type is required")
    if raw["tokenizer_type"] == "GPT2BPETokenizer":
        require(raw["vocab_file"] and raw["merge_file"],
                "GPT2BPETokenizer needs --vocab-file and --merge-file (build them with: python "
                "tools/train_tokenizer.py --input data.json --output-dir DIR)")
    else:
        require(raw["tokenizer_model"], "SentencePieceTokenizer needs --tokenizer-model")
    from megatron.tokenizer import check_tokenizer_files
    check_tokenizer_files(raw["tokenizer_type"], *(raw[key] if key in given else None for key
                                                   in ("vocab_file", "merge_file",
                                                       "tokenizer_model")))
    train_share = parse_splits(raw["split"])[0]  # its errors now, not after the model is built
    require(train_share > 0 or raw["train_data_path"] is not None,
            f"--split {raw['split']!r} gives the train split no share of the documents; give "
            "the first split a positive weight (e.g. '949,50,1')")
    return DataConfig(**values)


def _optimizer(raw, given, clip_grad, json_schedule):
    """(`json_schedule`: the DeepSpeed JSON has a 'scheduler', which replaces Megatron's.)"""
    decay_steps, warmup_steps = json_optimizer.schedule_lengths(raw)
    wsd_steps = None if json_schedule else \
        json_optimizer.wsd_decay_length(raw, given, decay_steps)
    in_samples = raw["rampup_batch_size"] is not None
    decay_given = raw["lr_decay_samples" if in_samples else "lr_decay_iters"] is not None
    warmup_given = raw["lr_warmup_samples" if in_samples else "warmup_iters"] is not None
    return OptimizerConfig(
        lr=raw["lr"], min_lr=raw["min_lr"], weight_decay=raw["weight_decay"],
        clip_grad=clip_grad, adam_beta1=raw["adam_beta1"], adam_beta2=raw["adam_beta2"],
        adam_eps=raw["adam_eps"], lr_decay_style=raw["lr_decay_style"],
        lr_decay_steps=decay_steps, warmup_steps=warmup_steps,
        lr_wsd_decay_steps=wsd_steps, lr_wsd_decay_style=raw["lr_wsd_decay_style"],
        schedule_unit="samples" if in_samples else "iterations",
        override_lr_scheduler=raw["override_lr_scheduler"],
        use_checkpoint_lr_scheduler=raw["use_checkpoint_lr_scheduler"],
        schedule_follows_train_iters=(() if decay_given else ("end_iter",))
        + (() if decay_given or warmup_given else ("warmup_iter",)),
        cpu_optimizer=raw["cpu_optimizer"], cpu_torch_adam=raw["cpu_torch_adam"],
        optimizer=raw["optimizer"])


def _schedule_end_note(raw, train_iters):
    """Megatron's schedule holds --min-lr after --lr-decay-iters, whatever the style (constant
    too, as in Megatron-LM 1.1.5): say so when the decay ends before training does (in
    samples under --rampup-batch-size, whose schedule counts them)."""
    unit, end = ("samples", raw["train_samples"]) if raw["rampup_batch_size"] is not None \
        else ("iters", train_iters)
    decay = raw[f"lr_decay_{unit}"]
    if decay is None or decay >= end:
        return ()
    words = "samples" if unit == "samples" else "iterations"
    return (f" note: --lr-decay-{unit} {decay} ends the {raw['lr_decay_style']} schedule "
            f"before --train-{unit} {end}: {words} {decay + 1}-{end} run "
            f"at --min-lr {raw['min_lr']:g} (Megatron's rule, for every --lr-decay-style); "
            f"leave --lr-decay-{unit} out to schedule over the whole run",)


def _check_optimizer_choice(raw, ds_config):
    section = f"the DeepSpeed config's optimizer section (\"" \
              f"{getattr(ds_config.optimizer, 'type', '')}\")"
    require(not (raw["cpu_optimizer"] and ds_config.optimizer is not None),
            f"--cpu-optimizer and {section} both choose the optimizer; drop one (for the "
            "config's optimizer to step on the CPU, add zero_optimization.offload_optimizer "
            "{\"device\": \"cpu\"})")
    require(not (raw["cpu_torch_adam"] and not raw["cpu_optimizer"]),
            "--cpu_torch_adam picks torch's AdamW as --cpu-optimizer's CPU Adam; add "
            "--cpu-optimizer or drop it")
    offloaded = ds_config.zero_optimization.offload_optimizer is not None
    require(not (raw["cpu_optimizer"] and not raw["cpu_torch_adam"] and not offloaded
                 and _runs_on_cuda(raw["device"])),
            "--cpu-optimizer steps a CPU Adam, but without zero_optimization.offload_optimizer "
            "the fp32 parameters and gradients stay on the GPU; add \"offload_optimizer\": "
            "{\"device\": \"cpu\"} to the DeepSpeed config's zero_optimization, or drop "
            "--cpu-optimizer")
    require(not (raw["cpu_torch_adam"] and offloaded),
            "--cpu_torch_adam has no effect under zero_optimization.offload_optimizer: the "
            "engine steps the offloaded optimizer with its CPU Adam; drop the flag")
    name = raw["optimizer"]
    if name == "adam":
        return
    require(ds_config.optimizer is None,
            f"--optimizer {name} and {section} both choose the optimizer; drop one (the config "
            f"spells it \"type\": \"{name.replace('adam', 'Adam')}\")")
    require(not raw["cpu_optimizer"],
            f"--optimizer {name} keeps its own quantised state and --cpu-optimizer is the fp32 "
            "CPU Adam: drop --cpu-optimizer (to step on the CPU, add "
            "zero_optimization.offload_optimizer {\"device\": \"cpu\"} to the DeepSpeed "
            "config)")


def _runs_on_cuda(device):
    if device != "auto":
        return device == "cuda"
    import torch  # only here: most flag errors are reported before torch is imported
    return torch.cuda.is_available()


def _checkpoint(raw):
    keep = raw["keep_last_n_checkpoints"]
    if keep is not None:
        require(keep >= 1, f"--keep-last-n-checkpoints must be at least 1, got {keep}")
        require(raw["save"] is not None,
                "--keep-last-n-checkpoints needs --save (the directory to prune)")
    save_interval = raw["save_interval"]
    require(save_interval is None or raw["save"] is not None,
            f"--save-interval {save_interval} needs --save (the directory checkpoints go to); "
            "without it nothing is saved")
    if raw["save"] is not None and save_interval is None:
        save_interval = raw["train_iters"]
    return CheckpointConfig(
        save=raw["save"], save_interval=save_interval, load=raw["load"],
        load_step=load_step(raw),
        no_save_optim=raw["no_save_optim"], no_save_rng=raw["no_save_rng"],
        no_load_optim=raw["no_load_optim"], no_load_rng=raw["no_load_rng"],
        finetune=raw["finetune"], keep_last_n_checkpoints=keep)
