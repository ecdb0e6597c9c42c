"""`--deepspeed`: the ZeRO flags, and one place that reconciles the Megatron flags with the
DeepSpeed JSON config (`--deepspeed_config`).

The JSON decides what DeepSpeed's JSON decides (ZeRO, precision, clipping, and the optimizer
and schedule when it has those sections). Megatron flags that describe the same thing fill
what the JSON leaves out, or must agree with it:

    train_micro_batch_size_per_gpu    <->  --batch-size
    train_batch_size                  <->  --global-batch-size (taken from the JSON when the
                                           flag is not given)
    gradient_accumulation_steps       <->  --global-batch-size / (--batch-size x data-parallel)
    fp16.enabled / bf16.enabled       <->  --fp16 / --bf16 (absent flags: the JSON decides)
    gradient_clipping                 <->  --clip-grad (absent flag: the JSON decides)
    zero_optimization.stage, ...      <-   --zero-stage, --zero-reduce-scatter,
                                           --zero-contigious-gradients,
                                           --zero-reduce-bucket-size,
                                           --zero-allgather-bucket-size (the flags win)
    activation_checkpointing.*        <-   --partition-activations, --checkpoint-in-cpu,
                                           --contigious-checkpointing, ... (the flags win;
                                           megatron/runtime/activation_checkpointing.py)
    gradient_checkpointing            ->   --checkpoint-activations (our extension)

The result is a dict in `args.deepspeed_config_dict`, which the trainer hands to
`zero.initialize(config=...)`.
"""

import copy

from megatron.errors import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps")
# flag dest -> zero_optimization key it overrides
_ZERO_FLAG_KEYS = (("zero_stage", "stage"), ("zero_reduce_scatter", "reduce_scatter"),
                   ("zero_contiguous_gradients", "contiguous_gradients"),
                   ("zero_reduce_bucket_size", "reduce_bucket_size"),
                   ("zero_allgather_bucket_size", "allgather_bucket_size"))
BUILT_STAGES = (0, 1, 2, 3)


def _byte_count(text):
    """Bucket sizes as DeepSpeed scripts write them: 50000000 or 5e7."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if value != int(value):
        raise ValueError(f"not a whole number: {text!r}")
    return int(value)


def add_deepspeed_arguments(parser):
    """DeepSpeed's own flags (zero.add_config_arguments) and Megatron-DeepSpeed's ZeRO group."""
    from zero.config.arguments import add_config_arguments
    add_config_arguments(parser)
    g = parser.add_argument_group("ZeRO", "override the DeepSpeed config's zero_optimization "
                                          "keys (need --deepspeed)")
    g.add_argument("--zero-stage", type=int, default=None,
                   help="zero_optimization.stage: 0, 1 (optimizer states partitioned), 2 "
                        "(and gradients) or 3 (and parameters; the model is built under "
                        "zero.Init)")
    g.add_argument("--remote-device", choices=("none", "cpu", "nvme"), default=None,
                   help="stage 3: where zero.Init keeps the parameter partitions: 'none' the "
                        "compute device, 'cpu' host memory (on a CPU-only machine the same "
                        "memory), 'nvme' swap files under the config's offload_param.nvme_path "
                        "(the model is built straight into them). Default: the config's "
                        "offload_param device")
    g.add_argument("--use-pin-memory", action="store_true",
                   help="stage 3 with --remote-device cpu: pin the host partitions (CUDA)")
    g.add_argument("--zero-reduce-scatter", action="store_true", default=None,
                   help="zero_optimization.reduce_scatter = true")
    g.add_argument("--zero-contigious-gradients", "--zero-contiguous-gradients",
                   action="store_true", default=None, dest="zero_contiguous_gradients",
                   help="zero_optimization.contiguous_gradients = true")
    g.add_argument("--zero-reduce-bucket-size", type=_byte_count, default=None,
                   help="zero_optimization.reduce_bucket_size (elements)")
    g.add_argument("--zero-allgather-bucket-size", type=_byte_count, default=None,
                   help="zero_optimization.allgather_bucket_size (elements)")
    g.add_argument("--cpu-optimizer", action="store_true",
                   help="the client optimizer is zero.ops.CPUAdam (DeepSpeedCPUAdam) instead of "
                        "torch AdamW; pair it with offload_optimizer in the config")
    g.add_argument("--cpu_torch_adam", "--cpu-torch-adam", action="store_true",
                   dest="cpu_torch_adam",
                   help="with --cpu-optimizer: use torch.optim.AdamW as the CPU optimizer")
    return parser


def apply_mpi_environment_if_asked(args):
    """--deepspeed_mpi: take rank and world size from the MPI launcher before anything reads
    them (so that mpirun -np N with MPICH or MVAPICH works as torchrun would)."""
    if getattr(args, "deepspeed_mpi", False):
        from zero.config.arguments import apply_mpi_environment
        apply_mpi_environment()


def reject_deepspeed_flags_without_deepspeed(args):
    given = [flag for flag, present in (
        ("--cpu-optimizer", getattr(args, "cpu_optimizer", False)),
        ("--cpu_torch_adam", getattr(args, "cpu_torch_adam", False)),
        ("--deepspeed_config", args.deepspeed_config is not None),
        ("--deepscale_config", args.deepscale_config is not None),
        ("--deepspeed_mpi", args.deepspeed_mpi),
        ("--remote-device", args.remote_device is not None),
        ("--use-pin-memory", args.use_pin_memory),
        *((f"--{dest.replace('_', '-')}", getattr(args, dest) is not None)
          for dest, _ in _ZERO_FLAG_KEYS)) if present]
    if given:
        raise ConfigError(f"{', '.join(given)} only act(s) with --deepspeed; add --deepspeed "
                          "to train with the zero engine, or drop them")


def reconcile_deepspeed_config(args, global_batch_given):
    """Build args.deepspeed_config_dict from --deepspeed_config and the flags (see module
    docstring); fill --global-batch-size, --fp16/--bf16 and --clip-grad from it.

    Runs after the data-parallel size and the number of micro batches are known.
    """
    from zero.config.arguments import resolve_config_from_args
    from zero.config.deepspeed_config import load_config_dict
    if args.deepspeed_config is None and args.deepscale_config is None:
        raise ConfigError("--deepspeed needs --deepspeed_config <ds_config.json> (e.g. "
                          "scripts/ds_zero_stage_2.config)")
    path = resolve_config_from_args(args)
    raw, source = load_config_dict(path)
    final = copy.deepcopy(raw)
    _apply_zero_flags(final, args, source)
    _reject_unbuilt_features(final, args, source)
    if all(final.get(key) is None for key in BATCH_KEYS):
        final["train_micro_batch_size_per_gpu"] = args.batch_size
        final["gradient_accumulation_steps"] = args.num_micro_batches
    if args.clip_grad is not None and "gradient_clipping" not in final:
        final["gradient_clipping"] = args.clip_grad
    config = parse_config(final, args.data_parallel_size, source)
    _reconcile_batch(args, config, source, global_batch_given)
    _reconcile_precision(args, config, source)
    if args.clip_grad is not None and args.clip_grad != config.gradient_clipping:
        raise ConfigError(f"--clip-grad {args.clip_grad} disagrees with 'gradient_clipping': "
                          f"{config.gradient_clipping} in DeepSpeed config {source}; the config "
                          "decides under --deepspeed: drop --clip-grad or change the config")
    args.clip_grad = config.gradient_clipping
    for flag, bad in (("--loss-scale", args.loss_scale is not None),
                      ("--fp32-allreduce", args.fp32_allreduce),
                      ("--no-save-optim", args.no_save_optim)):
        if bad:
            raise ConfigError(_IGNORED_UNDER_DEEPSPEED[flag].format(source=source))
    args.deepspeed_config_dict = final
    return config


_IGNORED_UNDER_DEEPSPEED = {
    "--loss-scale": "--loss-scale has no effect under --deepspeed: loss scaling is set by the "
                    "'fp16' section of {source} (\"loss_scale\": 0 is dynamic); drop the flag",
    "--fp32-allreduce": "--fp32-allreduce has no effect under --deepspeed: the zero engine "
                        "reduces gradients into fp32 master partitions itself; drop the flag",
    "--no-save-optim": "--no-save-optim is not supported with --deepspeed: the zero engine "
                       "always saves its partitioned optimizer states (use --no-load-optim or "
                       "--finetune when loading instead)",
}


def parse_config(config_dict, data_parallel_size, source):
    """zero's strict parse of the final dict; errors name the user's file, not '(dict)'."""
    import zero
    try:
        return zero.DeepSpeedConfig(config_dict, data_parallel_size)
    except zero.ConfigError as error:
        message = str(error).replace("DeepSpeed config (dict)", f"DeepSpeed config {source}")
        raise zero.ConfigError(message) from None


def _apply_zero_flags(final, args, source):
    section = final.get("zero_optimization", {})
    if isinstance(section, bool):  # ZeRO-1 era spelling: true = stage 1
        section = {"stage": int(section)}
    if not isinstance(section, dict):
        raise ConfigError(f"DeepSpeed config {source}: 'zero_optimization' must be an object "
                          f"{{...}}, got {section!r}")
    for dest, key in _ZERO_FLAG_KEYS:
        value = getattr(args, dest)
        if value is None:
            continue
        if key.endswith("bucket_size") and value < 1:
            raise ConfigError(f"--{dest.replace('_', '-')} must be a positive number of "
                              f"elements, got {value}")
        section[key] = value
    if section or "zero_optimization" in final:
        final["zero_optimization"] = section


def _reject_unbuilt_features(final, args, source):
    section = final.get("zero_optimization", {})
    stage = section.get("stage", 0)
    if args.zero_stage is not None and args.zero_stage not in BUILT_STAGES:
        raise ConfigError(f"--zero-stage {args.zero_stage} is not a ZeRO stage; use 0, 1, 2 "
                          "or 3")
    if stage != 3 and (args.remote_device is not None or args.use_pin_memory):
        flag = "--remote-device" if args.remote_device is not None else "--use-pin-memory"
        raise ConfigError(f"{flag} places ZeRO stage 3 parameter partitions (zero.Init), but "
                          f"the ZeRO stage is {stage}; add --zero-stage 3 or drop {flag}")
    # offload_optimizer / cpu_offload are built (zero/offload); the config's own checks refuse
    # offload at stage 0 and offload_param below stage 3
    # The activation_checkpointing section is applied by
    # megatron/runtime/activation_checkpointing.py (with the --partition-activations etc. flags).
    if final.get("gradient_checkpointing"):
        args.checkpoint_activations = True  # our extension: DeepSpeed ignores this key


def _reconcile_batch(args, config, source, global_batch_given):
    dp = args.data_parallel_size
    micro, gas, total = (config.train_micro_batch_size_per_gpu,
                         config.gradient_accumulation_steps, config.train_batch_size)
    from_config = (f"DeepSpeed config {source}: train_batch_size {total} = "
                   f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                   f"{gas} x data-parallel size {dp}")
    if micro != args.batch_size:
        raise ConfigError(f"--batch-size {args.batch_size} disagrees with {from_config}; "
                          "make --batch-size equal train_micro_batch_size_per_gpu, or remove "
                          "the batch sizes from the config to take them from the flags")
    if global_batch_given and total != args.global_batch_size:
        raise ConfigError(f"--global-batch-size {args.global_batch_size} disagrees with "
                          f"{from_config}; make them equal, or drop --global-batch-size to "
                          "take it from the config")
    args.global_batch_size, args.num_micro_batches = total, gas


def _reconcile_precision(args, config, source):
    for flag, wanted, key in (("--fp16", args.fp16, "fp16"), ("--bf16", args.bf16, "bf16")):
        if wanted and not getattr(config, key).enabled:
            raise ConfigError(f"{flag} is given but '{key}.enabled' is not true in DeepSpeed "
                              f"config {source}; under --deepspeed the config decides the "
                              f"precision: drop {flag} or enable {key} in the config")
    args.fp16, args.bf16 = bool(config.fp16.enabled), bool(config.bf16.enabled)
