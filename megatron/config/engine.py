"""The zero engine's config: the user's DeepSpeed JSON under --deepspeed, else the ZeRO stage 0
config the Megatron flags describe. Either way it is parsed once into a typed
`DeepSpeedConfig`, which the engine receives as it is.

Under --deepspeed the JSON decides what DeepSpeed's JSON decides (ZeRO, precision, clipping,
batch sizes, and the optimizer and schedule when it has those sections). Megatron flags that
describe the same thing fill what the JSON leaves out, or must agree with it:

    train_micro_batch_size_per_gpu    <->  --batch-size
    train_batch_size                  <->  --global-batch-size (taken from the JSON when the
                                           flag is not given)
    gradient_accumulation_steps       <->  --global-batch-size / (--batch-size x data-parallel)
    fp16.enabled / bf16.enabled       <->  --fp16 / --bf16 (absent flags: the JSON decides;
                                           "auto": the flags decide)
    gradient_clipping                 <->  --clip-grad (absent flag: the JSON decides; "auto":
                                           the flag, default 1.0)
    optimizer.params weight_decay,    <->  --weight-decay, --adam-beta1/2, --adam-eps (a given
      betas, eps ("auto" or absent:        flag fills "auto" or an absent key, else must agree)
      the flag's value)
    optimizer.params.lr               <-   --lr, through Megatron's schedule, unless the JSON
                                           has a 'scheduler' section (then the schedule flags
                                           are not used: a note); without --lr the JSON's lr
                                           is the flag's value
    zero_optimization.stage, ...      <-   --zero-stage, --zero-reduce-scatter,
                                           --zero-contigious-gradients,
                                           --zero-reduce-bucket-size,
                                           --zero-allgather-bucket-size (the flags win)
    zero_optimization.offload_param   <-   --remote-device (the flag wins: zero.Init and the
      .device                              engine keep the partitions in one place)
    gradient_checkpointing            ->   --checkpoint-activations (our extension)
    compile.enabled                   <-   --compile (the flag turns it on)
    data_types.grad_accum_dtype       <-   --accumulate-allreduce-grads-in-fp32 ("fp32"; a
                                           JSON that sets another dtype is an error)
    wall_clock_breakdown              <-   --timing-log-level 1, --log-timers-to-tensorboard
                                           (they turn it on; either way the log line is
                                           followed by the phase times)

Without --deepspeed the flags are the whole story:

    --batch-size, --global-batch-size  ->  train_micro_batch_size_per_gpu, accumulation steps
    --clip-grad (default 1.0)          ->  gradient_clipping
    --fp16 --loss-scale --initial-loss-scale --loss-scale-window --hysteresis --min-scale
                                       ->  fp16 {enabled, loss_scale, initial_scale_power, ...}
    --bf16                             ->  bf16.enabled
    --ddp-bucket-size MB (default 25)  ->  zero_optimization {stage 0, reduce_bucket_size in
                                           gradient elements, overlap_comm}
    --fp32-allreduce                   ->  communication_data_type "fp32"
    --accumulate-allreduce-grads-in-fp32  ->  data_types.grad_accum_dtype "fp32" (--bf16
                                           with --DDP-impl local: always, as in Megatron-LM)
    --compile                          ->  compile {enabled}
    --timing-log-level 1, --log-timers-to-tensorboard  ->  wall_clock_breakdown
"""

import copy
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

from megatron.config.json_optimizer import settle_optimizer_params
from megatron.errors import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps")
# flag dest -> zero_optimization key it overrides
ZERO_FLAG_KEYS = (("zero_stage", "stage"), ("zero_reduce_scatter", "reduce_scatter"),
                  ("zero_contiguous_gradients", "contiguous_gradients"),
                  ("zero_reduce_bucket_size", "reduce_bucket_size"),
                  ("zero_allgather_bucket_size", "allgather_bucket_size"))
# flag dest -> how it is spelled (DeepSpeed's own flags use underscores)
DEEPSPEED_ONLY_FLAGS = {
    "cpu_optimizer": "--cpu-optimizer", "cpu_torch_adam": "--cpu_torch_adam",
    "deepspeed_config": "--deepspeed_config", "deepscale_config": "--deepscale_config",
    "deepspeed_mpi": "--deepspeed_mpi", "remote_device": "--remote-device",
    "use_pin_memory": "--use-pin-memory",
    **{dest: f"--{dest.replace('_', '-')}" for dest, _ in ZERO_FLAG_KEYS}}
# Megatron flags with no job under --deepspeed: given, they are errors.
_NO_EFFECT_UNDER_DEEPSPEED = {
    "DDP_impl": ("--DDP-impl", "the zero engine reduces the gradients as {source} configures"),
    "ddp_bucket_size": ("--ddp-bucket-size",
                        "the bucket size is zero_optimization.reduce_bucket_size in {source}"),
    "no_save_optim": ("--no-save-optim", "the zero engine always saves its partitioned "
                      "optimizer states (use --no-load-optim or --finetune when loading "
                      "instead)"),
}
# Megatron flags the DeepSpeed JSON also sets under --deepspeed: given, they must agree with it.
# flag dest -> (flag, JSON key, the JSON's value in the flag's terms)
_MUST_AGREE = {
    "loss_scale": ("--loss-scale", "fp16.loss_scale",
                   lambda c: c.fp16.loss_scale if c.fp16.loss_scale > 0 else None),
    "initial_loss_scale": ("--initial-loss-scale", "fp16.initial_scale_power",
                           lambda c: 2.0 ** c.fp16.initial_scale_power),
    "min_scale": ("--min-scale", "fp16.min_loss_scale", lambda c: c.fp16.min_loss_scale),
    "loss_scale_window": ("--loss-scale-window", "fp16.loss_scale_window",
                          lambda c: c.fp16.loss_scale_window),
    "hysteresis": ("--hysteresis", "fp16.hysteresis", lambda c: c.fp16.hysteresis),
    "fp32_allreduce": ("--fp32-allreduce", "communication_data_type",
                       lambda c: c.communication_data_type == "fp32"),
}
MAX_DDP_BUCKET_MB = 2 ** 20
DEFAULT_DDP_BUCKET_MB = 25.0
DEFAULT_CLIP_GRAD = 1.0


@dataclass(frozen=True)
class Settled:
    """What the engine config decides for the rest of the trainer's config."""
    ds_config: object  # zero.config.deepspeed_config.DeepSpeedConfig
    global_batch_size: int
    num_micro_batches: int
    fp16: bool
    bf16: bool
    clip_grad: float
    checkpoint_activations: bool
    notes: tuple = ()  # one-line notes for the start-up log


def check_deepspeed_only_flags(raw, given):
    """DeepSpeed's flags without --deepspeed: one error, before anything reads them (the
    batch arithmetic would otherwise be blamed for a config that was never used)."""
    stray = [flag for dest, flag in DEEPSPEED_ONLY_FLAGS.items() if dest in given]
    if stray and not raw["deepspeed"]:
        raise ConfigError(f"{', '.join(stray)} only act(s) with --deepspeed; add --deepspeed "
                          "to train with a DeepSpeed config, or drop them")


def settle_engine(raw, given, data_parallel_size, num_micro_batches):
    """The engine config for the parsed flags `raw` (given: the flags on the command line;
    check_deepspeed_only_flags has passed them)."""
    if raw["deepspeed"]:
        return _from_deepspeed_json(raw, given, data_parallel_size, num_micro_batches)
    return _from_megatron_flags(raw, given, data_parallel_size, num_micro_batches)


# ----------------------------------------------------------------------------- --deepspeed

def load_deepspeed_json(raw):
    """(the DeepSpeed JSON as a dict, how errors name it)."""
    from zero.config.arguments import resolve_config_from_args
    from zero.config.deepspeed_config import load_config_dict
    if raw["deepspeed_config"] is None and raw["deepscale_config"] is None:
        raise ConfigError("--deepspeed needs --deepspeed_config <ds_config.json> (e.g. "
                          "scripts/ds_zero_stage_2.config)")
    path = resolve_config_from_args(SimpleNamespace(deepspeed_config=raw["deepspeed_config"],
                                                    deepscale_config=raw["deepscale_config"]))
    return load_config_dict(path)


def micro_batch_from_json(raw, data_parallel_size):
    """--deepspeed without --batch-size: the micro batch per GPU the DeepSpeed JSON sets."""
    parsed, source = _json_batch_sizes(raw, data_parallel_size)
    if parsed is None:
        raise ConfigError(f"--batch-size is required: DeepSpeed config {source} sets no batch "
                          "size either (train_micro_batch_size_per_gpu / train_batch_size)")
    return parsed.train_micro_batch_size_per_gpu


def global_batch_from_json(raw, data_parallel_size):
    """--deepspeed: the train_batch_size the JSON sets (None when it sets no batch size)."""
    parsed, _ = _json_batch_sizes(raw, data_parallel_size)
    return None if parsed is None else parsed.train_batch_size


def _json_batch_sizes(raw, data_parallel_size):
    """(the DeepSpeed JSON parsed for its batch sizes, or None when it sets none; its name)."""
    final, source = _without_auto_batch_keys(*load_deepspeed_json(raw))
    if all(final.get(key) is None for key in BATCH_KEYS):
        return None, source
    _micro_batch_from_the_flag(final, raw)
    # the batch keys alone: the rest may hold "auto" values the flags fill in later
    batch = {key: copy.deepcopy(final[key]) for key in BATCH_KEYS if key in final}
    return _parse(batch, data_parallel_size, source), source


def lr_from_json(raw):
    """--deepspeed without --lr: the JSON optimizer's 'lr' (the peak of Megatron's schedule,
    or the lr the JSON's own 'scheduler' starts from)."""
    from zero.config.parsing import AUTO, show
    final, source = load_deepspeed_json(raw)
    section = final.get("optimizer")
    params = section.get("params") if isinstance(section, dict) else None
    lr = params.get("lr") if isinstance(params, dict) else None
    if lr is None or lr == AUTO:
        raise ConfigError(f"--lr is required: DeepSpeed config {source} sets no number at "
                          "'optimizer.params.lr' either")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) \
            or lr < 0:
        raise ConfigError(f"'optimizer.params.lr' in DeepSpeed config {source} must be a "
                          f"non-negative number, got {show(lr)}")
    return float(lr)


def _micro_batch_from_the_flag(final, raw):
    """A JSON with only gradient_accumulation_steps: --batch-size is the micro batch they
    multiply (the parse checks the product against --global-batch-size)."""
    if final.get("train_batch_size") is None and \
            final.get("train_micro_batch_size_per_gpu") is None and \
            raw.get("batch_size") is not None:
        final["train_micro_batch_size_per_gpu"] = raw["batch_size"]


def _without_auto_batch_keys(final, source):
    """Hugging Face's "auto" batch keys are left to the flags, as absent ones are."""
    from zero.config.parsing import AUTO
    return {key: value for key, value in final.items()
            if not (key in BATCH_KEYS and value == AUTO)}, source


def _from_deepspeed_json(raw, given, dp, num_micro_batches):
    from megatron.config.deepspeed_notes import unused_key_notes
    from zero.config.parsing import AUTO
    final, source = _without_auto_batch_keys(*load_deepspeed_json(raw))
    for dest, (flag, reason) in _NO_EFFECT_UNDER_DEEPSPEED.items():
        if dest in given:
            raise ConfigError(f"{flag} has no effect under --deepspeed: "
                              f"{reason.format(source=source)}; drop the flag")
    flag_keys = _apply_zero_flags(final, raw, source)
    flag_keys.update(_apply_fp32_accumulation_flag(final, raw, source))
    _settle_auto_precision(final, raw)
    stage = final["zero_optimization"].get("stage", 0)
    if stage != 3 and (raw["remote_device"] is not None or raw["use_pin_memory"]):
        flag = "--remote-device" if raw["remote_device"] is not None else "--use-pin-memory"
        raise ConfigError(f"{flag} places ZeRO stage 3 parameter partitions (zero.Init), but "
                          f"the ZeRO stage is {stage}; add --zero-stage 3 or drop {flag}")
    if all(final.get(key) is None for key in BATCH_KEYS):
        final["train_micro_batch_size_per_gpu"] = raw["batch_size"]
        final["gradient_accumulation_steps"] = num_micro_batches
    _micro_batch_from_the_flag(final, raw)
    clip_note = ()
    if final.get("gradient_clipping") == AUTO:  # Hugging Face's: --clip-grad, default 1.0
        final["gradient_clipping"] = DEFAULT_CLIP_GRAD if raw["clip_grad"] is None \
            else raw["clip_grad"]
    elif raw["clip_grad"] is not None and "gradient_clipping" not in final:
        final["gradient_clipping"] = raw["clip_grad"]
        clip_note = (f" note: --clip-grad {raw['clip_grad']:g} clips the gradients: DeepSpeed "
                     f"config {source} sets no 'gradient_clipping' (Megatron-DeepSpeed ignores "
                     "--clip-grad under --deepspeed, so the same script clips nothing there)",)
    if _wants_phase_times(raw):
        final["wall_clock_breakdown"] = True
    if raw["compile"]:
        section = final.get("compile")
        if section in (None, AUTO) or isinstance(section, dict):  # else the parse says why
            final["compile"] = {**(section if isinstance(section, dict) else {}),
                                "enabled": True}
    notes = clip_note + settle_optimizer_params(final, raw, given, source)
    config = _parse(final, dp, source, flag_keys)
    notes += unused_key_notes(config, source)
    _check_pinned_partitions(raw, config, source)
    _check_agreement(raw, given, config, source)
    global_batch, micro_batches = _settle_batch(raw, config, dp, source)
    fp16, bf16 = _settle_precision(raw, config, source)
    if raw["clip_grad"] is not None and raw["clip_grad"] != config.gradient_clipping:
        raise ConfigError(f"--clip-grad {raw['clip_grad']} disagrees with 'gradient_clipping': "
                          f"{config.gradient_clipping} in DeepSpeed config {source}; the config "
                          "decides under --deepspeed: drop --clip-grad or change the config")
    return Settled(config, global_batch, micro_batches, fp16, bf16, config.gradient_clipping,
                   raw["checkpoint_activations"] or config.gradient_checkpointing, notes)


def _parse(config_dict, data_parallel_size, source, flag_keys=None):
    """zero's strict parse of the final dict. Its errors, and the engine's later ones, name
    the user's file, not '(dict)'; its errors say which of the keys they name a flag set
    (`flag_keys`: {'section.key': '--flag value'})."""
    from zero.config.deepspeed_config import DeepSpeedConfig
    from zero.errors import ConfigError as ZeroConfigError
    try:
        return DeepSpeedConfig(config_dict, data_parallel_size, source=source)
    except ZeroConfigError as error:
        message = str(error)
        overridden = [f"{flag} sets '{key}'" for key, flag in (flag_keys or {}).items()
                      if f"'{key}'" in message]
        if overridden:
            message += f" ({', '.join(overridden)} over the config)"
        error = ZeroConfigError(message)
        error.same_on_every_rank = True  # (every rank parses the same file: rank 0 says it)
        raise error from None


def _apply_zero_flags(final, raw, source):
    """Writes the --zero-* flags over the JSON's zero_optimization section; returns
    {'zero_optimization.key': '--flag value'} for each key a flag set."""
    from zero.config.parsing import AUTO, show
    from zero.config.sections import TopLevelConfig
    TopLevelConfig.translate_deprecated(final, source, "")  # a ZeRO-1 era boolean section
    section = final.get("zero_optimization")
    if section is None or section == AUTO:  # as zero's parse reads them: the defaults
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"DeepSpeed config {source}: 'zero_optimization' must be an object "
                          f"{{...}}, got {show(section)}")
    if raw["zero_stage"] is not None and raw["zero_stage"] not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage {raw['zero_stage']} is not a ZeRO stage; use 0, 1, 2 "
                          "or 3")
    flag_keys = {}
    for dest, key in ZERO_FLAG_KEYS:
        value = raw[dest]
        if value is None:
            continue
        flag = f"--{dest.replace('_', '-')}"
        if key.endswith("bucket_size") and value < 1:
            raise ConfigError(f"{flag} must be a positive number of elements, got {value}")
        section[key] = value
        flag_keys[f"zero_optimization.{key}"] = flag if isinstance(value, bool) \
            else f"{flag} {value}"
    if raw["remote_device"] is not None:  # zero.Init's placement is the engine's too
        offload = section.get("offload_param")
        section["offload_param"] = {**(offload if isinstance(offload, dict) else {}),
                                    "device": raw["remote_device"]}
        flag_keys["zero_optimization.offload_param.device"] = \
            f"--remote-device {raw['remote_device']}"
    final["zero_optimization"] = section
    return flag_keys


def _apply_fp32_accumulation_flag(final, raw, source):
    """--accumulate-allreduce-grads-in-fp32 under --deepspeed: the JSON's
    data_types.grad_accum_dtype "fp32" (returns {key: flag} when the flag set it)."""
    from zero.config.parsing import show
    if not raw["accumulate_allreduce_grads_in_fp32"]:
        return {}
    flag, key = "--accumulate-allreduce-grads-in-fp32", "data_types.grad_accum_dtype"
    section = final.get("data_types")
    section = dict(section) if isinstance(section, dict) else {}
    given = section.get("grad_accum_dtype")
    if given is not None and str(given).lower() != "fp32":
        raise ConfigError(f"{flag} disagrees with '{key}': {show(given)} in DeepSpeed config "
                          f"{source}; drop the flag or set the key to \"fp32\"")
    section["grad_accum_dtype"] = "fp32"
    final["data_types"] = section
    return {key: flag}


def _wants_phase_times(raw):
    """--timing-log-level 1, or --log-timers-to-tensorboard (which in Megatron-LM 2.x, where
    timers always print, needs nothing else): the engine's wall_clock_breakdown."""
    return raw["timing_log_level"] >= 1 or raw["log_timers_to_tensorboard"]


def _settle_auto_precision(final, raw):
    """Hugging Face's "enabled": "auto" in 'fp16' / 'bf16' follows --fp16 / --bf16."""
    from zero.config.parsing import AUTO
    for key, flag_dest in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        section = final.get(key)
        if isinstance(section, dict) and section.get("enabled") == AUTO:
            final[key] = {**section, "enabled": bool(raw[flag_dest])}


def _check_pinned_partitions(raw, config, source):
    """--use-pin-memory pins the stage 3 partitions zero.Init keeps in host memory; with the
    parameters left on the compute device there is nothing to pin."""
    if raw["use_pin_memory"] and config.zero_optimization.offload_param is None:
        raise ConfigError("--use-pin-memory pins the parameter partitions kept in host memory, "
                          "but they stay on the compute device: neither --remote-device nor "
                          f"'zero_optimization.offload_param' in DeepSpeed config {source} "
                          "moves them; add --remote-device cpu or drop --use-pin-memory")


def _check_agreement(raw, given, config, source):
    from zero.config.parsing import show
    for dest, (flag, key, json_value) in _MUST_AGREE.items():
        if dest not in given:
            continue
        if key.startswith("fp16.") and not config.fp16.enabled:
            raise ConfigError(f"{flag} has no effect: 'fp16.enabled' is not true in DeepSpeed "
                              f"config {source}, so nothing is loss-scaled; drop the flag")
        if raw[dest] != json_value(config):
            shown = show(functools.reduce(getattr, key.split("."), config))
            raise ConfigError(f"{flag} {raw[dest]} disagrees with '{key}': {shown} in DeepSpeed "
                              f"config {source}, which decides under --deepspeed; drop the flag "
                              "or change the config")


def _settle_batch(raw, config, dp, source):
    micro, gas, total = (config.train_micro_batch_size_per_gpu,
                         config.gradient_accumulation_steps, config.train_batch_size)
    from_config = (f"DeepSpeed config {source}: train_batch_size {total} = "
                   f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                   f"{gas} x data-parallel size {dp}")
    if micro != raw["batch_size"]:
        raise ConfigError(f"--batch-size {raw['batch_size']} disagrees with {from_config}; "
                          "make --batch-size equal train_micro_batch_size_per_gpu, or remove "
                          "the batch sizes from the config to take them from the flags")
    if raw["global_batch_size"] is not None and total != raw["global_batch_size"]:
        raise ConfigError(f"--global-batch-size {raw['global_batch_size']} disagrees with "
                          f"{from_config}; make them equal, or drop --global-batch-size to "
                          "take it from the config")
    return total, gas


def _settle_precision(raw, config, source):
    for flag, wanted, key in (("--fp16", raw["fp16"], "fp16"), ("--bf16", raw["bf16"], "bf16")):
        if wanted and not getattr(config, key).enabled:
            raise ConfigError(f"{flag} is given but '{key}.enabled' is not true in DeepSpeed "
                              f"config {source}; under --deepspeed the config decides the "
                              f"precision: drop {flag} or enable {key} in the config")
    return bool(config.fp16.enabled), bool(config.bf16.enabled)


# ------------------------------------------------------------------------- Megatron flags

_LOSS_SCALE_FLAGS = {"loss_scale": "--loss-scale", "initial_loss_scale": "--initial-loss-scale",
                     "loss_scale_window": "--loss-scale-window", "hysteresis": "--hysteresis",
                     "min_scale": "--min-scale"}


def _from_megatron_flags(raw, given, dp, num_micro_batches):
    scaling = [flag for dest, flag in _LOSS_SCALE_FLAGS.items() if dest in given]
    if scaling and not raw["fp16"]:
        raise ConfigError(f"{', '.join(scaling)} only act(s) with --fp16 (loss scaling); "
                          "add --fp16 or drop them")
    dynamic = [flag for flag in scaling if flag != "--loss-scale"]
    if raw["loss_scale"] is not None and dynamic:
        raise ConfigError(f"--loss-scale {raw['loss_scale']:g} is a static scale, so "
                          f"{', '.join(dynamic)} (dynamic scaling) would not act; drop "
                          "--loss-scale for dynamic scaling, or the others")
    clip = DEFAULT_CLIP_GRAD if raw["clip_grad"] is None else raw["clip_grad"]
    bucket_mb = DEFAULT_DDP_BUCKET_MB if raw["ddp_bucket_size"] is None \
        else raw["ddp_bucket_size"]
    if not (math.isfinite(bucket_mb) and 0 < bucket_mb <= MAX_DDP_BUCKET_MB):
        raise ConfigError(f"--ddp-bucket-size must be a positive number of megabytes up to "
                          f"{MAX_DDP_BUCKET_MB} (1 TiB), got {raw['ddp_bucket_size']}")
    if not (math.isfinite(clip) and clip >= 0):
        raise ConfigError(f"--clip-grad must be >= 0 (0 disables clipping), got {clip}")
    if raw["accumulate_allreduce_grads_in_fp32"] and raw["DDP_impl"] == "torch":
        raise ConfigError("--accumulate-allreduce-grads-in-fp32 needs --DDP-impl local: torch's "
                          "DistributedDataParallel sums and all-reduces the gradients in the "
                          "parameters' dtype")
    # 16-bit gradients summed in fp32 are all-reduced in fp32 too (zero/stages/build.py)
    fp32_sums = raw["accumulate_allreduce_grads_in_fp32"] or (raw["bf16"]
                                                              and raw["DDP_impl"] == "local")
    comm_bytes = 4 if raw["fp32_allreduce"] or fp32_sums or not (raw["fp16"] or raw["bf16"]) \
        else 2
    config = {
        "train_micro_batch_size_per_gpu": raw["batch_size"],
        "gradient_accumulation_steps": num_micro_batches,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 0, "overlap_comm": True,
                              "reduce_bucket_size": max(1, int(bucket_mb * 2 ** 20 /
                                                               comm_bytes))},
        "fp16": _fp16_section(raw) if raw["fp16"] else {"enabled": False},
        "bf16": {"enabled": bool(raw["bf16"])},
    }
    if raw["fp32_allreduce"]:
        config["communication_data_type"] = "fp32"
    if raw["accumulate_allreduce_grads_in_fp32"]:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if _wants_phase_times(raw):
        config["wall_clock_breakdown"] = True
    if raw["compile"]:
        config["compile"] = {"enabled": True}
    parsed = _parse(copy.deepcopy(config), dp, "built from the command-line flags")
    return Settled(parsed, parsed.train_batch_size, num_micro_batches, bool(raw["fp16"]),
                   bool(raw["bf16"]), clip, raw["checkpoint_activations"])


def _fp16_section(raw):
    if raw["loss_scale"] is not None and not (math.isfinite(raw["loss_scale"])
                                              and raw["loss_scale"] > 0):
        raise ConfigError(f"--loss-scale must be positive, got {raw['loss_scale']}; leave it "
                          "out for dynamic loss scaling")
    initial, minimum = raw["initial_loss_scale"], raw["min_scale"]
    for flag, value in (("--initial-loss-scale", initial), ("--min-scale", minimum)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} must be positive, got {value}")
    power = math.log2(initial)
    if power != int(power) or not 0 <= power <= 127:
        raise ConfigError(f"--initial-loss-scale {initial:g} must be a power of 2 between 1 "
                          "and 2**127 (dynamic scaling halves and doubles it)")
    if initial < minimum:
        raise ConfigError(f"--initial-loss-scale {initial:g} is below --min-scale {minimum:g} "
                          "(dynamic scaling never goes below the minimum); raise the first or "
                          "lower the second")
    for dest in ("loss_scale_window", "hysteresis"):
        if raw[dest] < 1:
            raise ConfigError(f"--{dest.replace('_', '-')} must be at least 1, got {raw[dest]}")
    return {"enabled": True, "loss_scale": raw["loss_scale"] or 0.0,
            "initial_scale_power": int(power), "loss_scale_window": raw["loss_scale_window"],
            "hysteresis": raw["hysteresis"], "min_loss_scale": minimum}
