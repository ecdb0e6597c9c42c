"""How --checkpoint-activations keeps its checkpoints: Megatron's recompute, or DeepSpeed's
(zero.activation_checkpointing.recompute) with partitioned / CPU / contiguous checkpoints.

    --checkpoint-activations [--checkpoint-num-layers K]   recompute chunks of K layers
        (megatron.mpu.checkpoint: each chunk keeps only its input)
    --deepspeed-activation-checkpointing   the same recompute through zero.activation_checkpointing.recompute,
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
Without --deepspeed the flags work too (zero.activation_checkpointing.recompute needs no engine).
"""

from megatron.errors import ConfigError

# flag dest -> activation_checkpointing key it sets
_OPTION_FLAGS = (("partition_activations", "partition_activations"),
                 ("checkpoint_in_cpu", "cpu_checkpointing"),
                 ("contiguous_checkpointing", "contiguous_memory_optimization"),
                 ("synchronize_each_layer", "synchronize_checkpoint_boundary"),
                 ("profile_backward", "profile"))


def add_activation_checkpointing_args(parser):
    g = parser.add_argument_group(
        "activation checkpointing", "how --checkpoint-activations keeps its checkpoints")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="recompute through zero.activation_checkpointing.recompute (DeepSpeed's), which the options "
                        "below and the config's activation_checkpointing section configure")
    g.add_argument("--partition-activations", action="store_true", default=None,
                   help="each tensor-parallel rank keeps 1/TP of every checkpoint; all-gathered "
                        "before recompute (no-op without tensor parallelism)")
    g.add_argument("--distribute-checkpointed-activations", action="store_true",
                   help="Megatron's name for --partition-activations")
    g.add_argument("--checkpoint-in-cpu", action="store_true", default=None,
                   help="keep checkpoints in host memory (pinned on CUDA)")
    g.add_argument("--contigious-checkpointing", "--contiguous-checkpointing",
                   action="store_true", default=None, dest="contiguous_checkpointing",
                   help="keep checkpoints in one buffer preallocated for all of them")
    g.add_argument("--synchronize-each-layer", action="store_true", default=None,
                   help="device synchronize at the start and end of every checkpoint")
    g.add_argument("--profile-backward", action="store_true", default=None,
                   help="print forward/recompute/backward milliseconds of every checkpoint "
                        "after each backward pass (rank 0)")
    g.add_argument("--split-transformers", action="store_true",
                   help="checkpoint the attention and MLP halves of each layer separately")
    return parser


def resolve_activation_checkpointing(args):
    """Fill args.activation_checkpointing (None or zero.activation_checkpointing.recompute.configure keywords) and
    args.activation_checkpointing_notes. Runs after the DeepSpeed config is reconciled."""
    notes = []
    if args.distribute_checkpointed_activations:
        args.partition_activations = True
    raw_section = (getattr(args, "deepspeed_config_dict", None) or {}).get(
        "activation_checkpointing") or {}
    if not isinstance(raw_section, dict):
        raise ConfigError("DeepSpeed config: 'activation_checkpointing' must be an object "
                          f"(a JSON dict of options), not {type(raw_section).__name__}")
    section = dict(raw_section)
    for dest, key in _OPTION_FLAGS:
        if getattr(args, dest):
            section[key] = True
    asked = [f"--{dest.replace('_', '-')}" for dest, key in _OPTION_FLAGS if getattr(args, dest)]
    asked += [f"'activation_checkpointing.{key}'" for key, value in raw_section.items()
              if value not in (None, False, 0) and key != "number_checkpoints"]
    for flag, given in (("--split-transformers", args.split_transformers),
                        ("--distribute-checkpointed-activations",
                         args.distribute_checkpointed_activations),
                        ("--deepspeed-activation-checkpointing",
                         args.deepspeed_activation_checkpointing), *((a, True) for a in asked)):
        if given and not args.checkpoint_activations:
            raise ConfigError(f"{flag} acts on the checkpoints of --checkpoint-activations, "
                              "which is off; add --checkpoint-activations")
    if args.checkpoint_activations and args.num_layers % args.checkpoint_num_layers:
        raise ConfigError(f"--checkpoint-num-layers {args.checkpoint_num_layers} does not "
                          f"divide --num-layers {args.num_layers}")
    args.activation_checkpointing, args.activation_checkpointing_notes = None, notes
    if not (args.deepspeed_activation_checkpointing or asked):
        return
    if not args.deepspeed_activation_checkpointing:
        notes.append(f"note: {', '.join(asked)} turn(s) on --deepspeed-activation-checkpointing")
        args.deepspeed_activation_checkpointing = True
    num_checkpoints = args.num_layers // args.checkpoint_num_layers * \
        (2 if args.split_transformers else 1)
    given = section.get("number_checkpoints")
    if given is not None and given != num_checkpoints:
        notes.append(f"note: 'activation_checkpointing.number_checkpoints' {given} replaced by "
                     f"{num_checkpoints}, the checkpoints one forward makes")
    partition = bool(section.get("partition_activations"))
    if partition and args.model_parallel_size == 1:
        notes.append("note: partitioned activations split checkpoints across tensor-parallel "
                     "ranks; with --model-parallel-size 1 each rank keeps them whole (no-op)")
    args.activation_checkpointing = dict(
        partition_activations=partition,
        checkpoint_in_cpu=bool(section.get("cpu_checkpointing")),
        contiguous_checkpointing=bool(section.get("contiguous_memory_optimization")),
        num_checkpoints=num_checkpoints,
        synchronize=bool(section.get("synchronize_checkpoint_boundary")),
        profile=bool(section.get("profile")))


def setup_activation_checkpointing(args, device, is_rank0):
    """Configure zero.activation_checkpointing.recompute and make mpu's RNG tracker its tracker, so the streams the
    model forks are the ones the recompute replays. Call before seeding."""
    options = getattr(args, "activation_checkpointing", None)
    if options is None:
        return
    from megatron import mpu
    from megatron.mpu.random import use_rng_tracker
    from zero import checkpointing
    checkpointing.configure(mpu, **options)
    use_rng_tracker(checkpointing.get_cuda_rng_tracker())
    notes = list(args.activation_checkpointing_notes)
    if device.type == "cpu":
        if options["checkpoint_in_cpu"]:
            notes.append("note: --checkpoint-in-cpu: the model runs on the CPU, so checkpoints "
                         "already live in host memory")
        if options["synchronize"]:
            notes.append("note: --synchronize-each-layer: CPU kernels are synchronous; there is "
                         "no device queue to wait for")
    if is_rank0:
        for note in notes:
            print(note, flush=True)


def teardown_activation_checkpointing():
    from megatron.mpu.random import use_rng_tracker
    use_rng_tracker(None)
    try:
        from zero import checkpointing
    except ImportError:
        return
    checkpointing.unconfigure()


def checkpoint_function(args):
    """The function ParallelTransformer recomputes chunks with."""
    if getattr(args, "activation_checkpointing", None) is None:
        from megatron import mpu
        return mpu.checkpoint
    from zero import checkpointing
    return checkpointing.checkpoint
