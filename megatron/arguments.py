"""Command-line flags with Megatron-LM 1.1.5 names, and one `validate()` for their arithmetic.

Every flag here acts; flags of the original trainer that this one does not implement are not
accepted (argparse says so) rather than parsed and ignored.
"""

import argparse
import math

from megatron.runtime.activation_checkpointing import (add_activation_checkpointing_args,
                                               resolve_activation_checkpointing)
from megatron.checkpoint_args import fill_model_args_from_checkpoint, given_on_command_line
from megatron.deepspeed_config import (add_deepspeed_arguments, apply_mpi_environment_if_asked,
                                       reconcile_deepspeed_config,
                                       reject_deepspeed_flags_without_deepspeed)
from megatron.errors import ConfigError
from megatron.model.tiling import add_tiling_arguments, validate_tiling
from megatron.runtime.fault_tolerance import add_reliability_arguments, validate_reliability


def parse_args(argv=None, extra_args_provider=None, defaults=None, world_size=None):
    """Parse and validate the command line.

    `defaults` fills flags the user did not give (Megatron's `args_defaults`).  `world_size`
    defaults to what the launcher says (torchrun, SLURM or OpenMPI variables; 1 when absent).
    """
    parser = build_parser()
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_args(argv)
    apply_mpi_environment_if_asked(args)  # --deepspeed_mpi: before the world size is read
    # Model shape and tokenizer not given on the command line come from --load's checkpoint.
    fill_model_args_from_checkpoint(args, given_on_command_line(parser, argv))
    for key, value in (defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if world_size is None:
        from megatron.runtime.initialize import discover_launch_environment
        world_size = discover_launch_environment().world_size  # torchrun, SLURM or OpenMPI
    validate(args, world_size)
    return args


def build_parser():
    parser = argparse.ArgumentParser(description="Megatron-style GPT-2 pretraining",
                                     allow_abbrev=False)
    _add_network_args(parser)
    _add_regularization_args(parser)
    _add_training_args(parser)
    _add_learning_rate_args(parser)
    _add_checkpointing_args(parser)
    _add_mixed_precision_args(parser)
    _add_distributed_args(parser)
    _add_validation_args(parser)
    _add_data_args(parser)
    _add_logging_args(parser)
    add_deepspeed_arguments(parser)  # --deepspeed, --deepspeed_config, --zero-*
    add_activation_checkpointing_args(parser)  # --deepspeed-activation-checkpointing, ...
    add_tiling_arguments(parser)  # --memory-centric-tiled-linear, --tile-factor
    add_reliability_arguments(parser)  # --exit-signal-handler, --keep-last-n-checkpoints, ...
    return parser


def _add_network_args(parser):
    g = parser.add_argument_group("network size")
    g.add_argument("--model-size", default=None,
                   help="named size from megatron.model.MODEL_SIZES (e.g. gpt2-124m); fills "
                        "--num-layers/--hidden-size/--num-attention-heads not given explicitly")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP inner size (default 4 * hidden)")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocab to a multiple of this times --model-parallel-size")
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)


def _add_regularization_args(parser):
    g = parser.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=None,
                   help="0 disables clipping (default 1.0; under --deepspeed the config's "
                        "gradient_clipping)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--batch-size", type=int, default=None,
                   help="micro batch size per data-parallel rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration over all data-parallel ranks; larger than "
                        "batch-size x data-parallel-size means gradient accumulation")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, if --save is set) when iteration %% N == 0")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each chunk of --checkpoint-num-layers layers in backward")
    g.add_argument("--checkpoint-num-layers", type=int, default=1)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--init-method-std", type=float, default=0.02)


def _add_learning_rate_args(parser):
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "exponential"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--warmup", type=float, default=0.01,
                   help="fraction of --lr-decay-iters used for linear warmup")
    g.add_argument("--warmup-iters", type=int, default=None, help="overrides --warmup")
    g.add_argument("--override-lr-scheduler", action="store_true",
                   help="on --load, use the schedule from the flags, not the checkpoint")
    g.add_argument("--use-checkpoint-lr-scheduler", action="store_true",
                   help="on --load, use the schedule stored in the checkpoint")


def _add_checkpointing_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--load", default=None, help="directory to resume from")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; start at iteration 0 with fresh optimizer")


def _add_mixed_precision_args(parser):
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters with fp32 master weights and loss scaling")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters with fp32 master weights (no loss scaling)")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale; default (None) is dynamic loss scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_distributed_args(parser):
    g = parser.add_argument_group("distributed")
    g.add_argument("--model-parallel-size", type=int, default=1,
                   help="tensor-parallel size; adjacent ranks form a tensor-parallel group")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default: nccl on CUDA, gloo on CPU")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, dest="local_rank",
                   help="set by torch.distributed.launch; torchrun uses LOCAL_RANK instead")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective (or the start-up rendezvous) that waits longer than "
                        "this for another rank fails instead of hanging; fractions allowed")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: cores / local processes)")
    g.add_argument("--DDP-impl", default="local", choices=["local", "torch"], dest="DDP_impl",
                   help="data-parallel gradient all-reduce: local (bucketed, overlapped with "
                        "backward; megatron/distributed.py) or torch "
                        "(torch.nn.parallel.DistributedDataParallel); not used under "
                        "--deepspeed, where the zero engine reduces the gradients")
    g.add_argument("--ddp-bucket-size", type=float, default=25.0, metavar="MB",
                   help="megabytes of gradients per all-reduce bucket; smaller buckets start "
                        "communicating earlier in backward, larger ones make fewer calls")
    g.add_argument("--fp32-allreduce", action="store_true",
                   help="all-reduce 16-bit (--fp16/--bf16) gradients in fp32")


def _add_validation_args(parser):
    g = parser.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)


def _add_data_args(parser):
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", default=None,
                   help="prefix of a preprocessed dataset (without .bin/.idx)")
    g.add_argument("--train-data", default=None,
                   help="a named loose-JSON corpus (webtext) or a .json path; tokenized into "
                        ".bin/.idx next to it on first use")
    g.add_argument("--data-impl", default="mmap", choices=["mmap", "infer"],
                   help="only the mmap (MMIDIDX) format is supported; infer checks the file")
    g.add_argument("--mmap-warmup", action="store_true",
                   help="read the whole .bin once at start to warm the page cache")
    g.add_argument("--split", default="969, 30, 1",
                   help="train,valid,test weights over documents")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--tokenizer-type", default=None,
                   choices=["GPT2BPETokenizer", "SentencePieceTokenizer"])
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece model file")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-dir", default=None,
                   help="where metrics.jsonl goes (default: --tensorboard-dir, else --save)")


def _require(condition, message):
    if not condition:
        raise ConfigError(message)


def validate(args, world_size):
    """Check flag consistency; fill derived values. Errors show the arithmetic."""
    _fill_model_size(args)
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "batch_size", "train_iters", "lr"):
        _require(getattr(args, flag) is not None,
                 f"--{flag.replace('_', '-')} is required")
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "batch_size", "train_iters", "max_position_embeddings", "global_batch_size",
                 "ffn_hidden_size", "make_vocab_size_divisible_by", "exit_interval"):
        value = getattr(args, flag)
        _require(value is None or value > 0,
                 f"--{flag.replace('_', '-')} must be positive, got {value}")
    _require(math.isfinite(args.lr) and args.lr >= 0 and math.isfinite(args.min_lr),
             f"--lr {args.lr} and --min-lr {args.min_lr} must be finite and non-negative")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
             f"{args.num_attention_heads} ({args.hidden_size} % {args.num_attention_heads} = "
             f"{args.hidden_size % args.num_attention_heads})")
    _require(args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} is longer than --max-position-embeddings "
             f"{args.max_position_embeddings}")
    _require(args.min_lr <= args.lr, f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    _require(args.save_interval is None or args.save_interval > 0,
             "--save-interval must be positive")
    if args.save is not None and args.save_interval is None:
        args.save_interval = args.train_iters
    _require(args.checkpoint_num_layers >= 1, "--checkpoint-num-layers must be >= 1")
    _require(args.num_layers % args.checkpoint_num_layers == 0 or not args.checkpoint_activations,
             f"--checkpoint-num-layers {args.checkpoint_num_layers} does not divide "
             f"--num-layers {args.num_layers}")
    _require(args.log_interval > 0 and args.eval_interval > 0,
             "--log-interval and --eval-interval must be positive")
    _require((args.data_path is None) != (args.train_data is None),
             "give exactly one of --data-path (a preprocessed .bin/.idx prefix) or "
             "--train-data (a loose-JSON corpus name or path)")
    _require(args.tokenizer_type is not None, "--tokenizer-type is required")
    if args.tokenizer_type == "GPT2BPETokenizer":
        _require(args.vocab_file and args.merge_file,
                 "GPT2BPETokenizer needs --vocab-file and --merge-file "
                 "(build them with: python tools/train_tokenizer.py --input data.json "
                 "--output-dir DIR)")
    else:
        _require(args.tokenizer_model, "SentencePieceTokenizer needs --tokenizer-model")
    global_batch_given = args.global_batch_size is not None
    _validate_parallel(args, world_size)
    validate_tiling(args)
    if args.deepspeed:  # the DeepSpeed JSON may set batch sizes, precision and clipping
        reconcile_deepspeed_config(args, global_batch_given)
    else:
        reject_deepspeed_flags_without_deepspeed(args)
        if args.clip_grad is None:
            args.clip_grad = 1.0
    resolve_activation_checkpointing(args)  # after the config may set gradient_checkpointing
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.warmup_iters is None:
        args.warmup_iters = int(args.warmup * args.lr_decay_iters)
    _require(0 <= args.warmup_iters <= args.lr_decay_iters,
             f"warmup iterations ({args.warmup_iters}, from --warmup or --warmup-iters) must "
             f"lie between 0 and --lr-decay-iters ({args.lr_decay_iters})")
    validate_reliability(args)
    if args.log_dir is None:
        args.log_dir = args.tensorboard_dir or args.save
    args.params_dtype = "float16" if args.fp16 else "bfloat16" if args.bf16 else "float32"
    return args


def _fill_model_size(args):
    if args.model_size is None:
        return
    from megatron.model import MODEL_SIZES
    _require(args.model_size in MODEL_SIZES,
             f"--model-size {args.model_size!r} is not known; choose one of "
             f"{', '.join(sorted(MODEL_SIZES))}")
    for key, value in MODEL_SIZES[args.model_size].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _validate_parallel(args, world_size):
    tp = args.model_parallel_size
    _require(tp >= 1, "--model-parallel-size must be >= 1")
    _require(args.ddp_bucket_size > 0,
             f"--ddp-bucket-size must be a positive number of megabytes, got "
             f"{args.ddp_bucket_size}")
    _require(world_size % tp == 0,
             f"world size {world_size} is not divisible by --model-parallel-size {tp} "
             f"({world_size} % {tp} = {world_size % tp})")
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--model-parallel-size {tp}")
    dp = world_size // tp
    args.world_size, args.data_parallel_size = world_size, dp
    per_step = args.batch_size * dp
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    _require(args.global_batch_size % per_step == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by --batch-size "
             f"{args.batch_size} x data-parallel size {dp} = {per_step} "
             f"({args.global_batch_size} % {per_step} = {args.global_batch_size % per_step})")
    args.num_micro_batches = args.global_batch_size // per_step
