"""The command line: Megatron-LM 1.1.5's flag names plus DeepSpeed's and Megatron-DeepSpeed's.

Each flag's default is written here once. A default of None means "not given": the value is
then derived from other flags in `megatron/config/resolve.py`, as the help text says. Flags of
the original trainers that this one does not implement are not accepted rather than parsed and
ignored: `megatron_flags.py` names Megatron-LM's with what to do instead.
"""

import argparse
import copy
import difflib
import math

from megatron.config.logging_flags import add_logging_flags
from megatron.config.profiling_flags import add_profiling_flags
from megatron.config.megatron_flags import (add_always_so_flags, add_dense_model_flags,
                                           offered_here)
from megatron.errors import ConfigError


class _FlagParser(argparse.ArgumentParser):
    """argparse with its errors as the trainer's others are: one `error:` line (the usage
    block is --help's), an unknown flag followed by the closest known one."""

    def error(self, message):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = [s for action in self._actions for s in action.option_strings]
            message = prefix + " ".join(_with_suggestion(arg, known)
                                        for arg in message[len(prefix):].split(" "))
        message = message.replace("\n", "\\n").replace("\r", "\\r")  # an argument's own
        raise ConfigError(f"{message} ({self.prog} --help lists the flags)")


def _with_suggestion(arg, known):
    if not arg.startswith("--"):
        return arg
    close = difflib.get_close_matches(arg.split("=")[0], known, n=1, cutoff=0.75)
    return f"{arg} (did you mean {close[0]}?)" if close else arg


def build_parser():
    parser = _FlagParser(description="Megatron-style GPT-2 pretraining", allow_abbrev=False)
    for add_group in (_network, _regularization, _training, _learning_rate, _checkpointing,
                      _mixed_precision, _distributed, _validation, _data, add_logging_flags,
                      add_profiling_flags,
                      _reliability, _deepspeed, _zero, _activation_checkpointing, _tiling,
                      add_always_so_flags, add_dense_model_flags):
        add_group(parser)
    return parser


def given_on_command_line(parser, argv):
    """Destinations of the flags present in `argv`, whatever their value: `--layernorm-epsilon
    1e-5` counts as given even though 1e-5 is the default."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:  # argparse has no public way to reach every action
        action.default = argparse.SUPPRESS
    namespace, _ = probe.parse_known_args(argv)
    return set(vars(namespace))


# later Megatron-LM's tokenizer types -> what to give here instead
_OTHER_TOKENIZERS = {
    "GPTSentencePieceTokenizer": "a SentencePiece model is --tokenizer-type "
                                 "SentencePieceTokenizer --tokenizer-model FILE here",
    "Llama2Tokenizer": "a SentencePiece model is --tokenizer-type SentencePieceTokenizer "
                       "--tokenizer-model FILE here",
    "HuggingFaceTokenizer": "Hugging Face tokenizers are not loaded: GPT-2's is "
                            "GPT2BPETokenizer with its vocab.json and merges.txt",
    "PretrainedFromHF": "Hugging Face tokenizers are not loaded: GPT-2's is GPT2BPETokenizer "
                        "with its vocab.json and merges.txt",
    "HFTokenizer": "Hugging Face tokenizers are not loaded: GPT-2's is GPT2BPETokenizer with its "
                   "vocab.json and merges.txt",
    "NullTokenizer": "a tokenizer is needed: GPT2BPETokenizer or SentencePieceTokenizer",
}


def _gpt2_only(accepted, why):
    """A later Megatron-LM architecture flag: its GPT-2 value is taken, in any case
    (Megatron-DeepSpeed spells LayerNorm `layernorm`), others refused."""
    def parse(text):
        if text.lower() != accepted.lower():
            raise argparse.ArgumentTypeError(f"{text}: {why} (give {accepted} or drop the flag)")
        return accepted
    return parse


_OLD_DATASETS = ("older Megatron-LM's lazy and cached datasets (a TNTIDX index) are not read: "
                 "this trainer reads the mmap (MMIDIDX) format tools/preprocess_data.py writes; "
                 "give mmap or drop the flag (mmap is the default)")
# a value other Megatron-LMs offer for a choice flag -> what this trainer offers instead
_DATA_IMPLS = {"lazy": _OLD_DATASETS, "cached": _OLD_DATASETS}
_OPTIMIZERS = {"sgd": "Megatron-LM's SGD is not built: the optimizers here are adam (AdamW), "
                      "adam8bit and adam4bit"}
_BACKENDS = {name: f"{name} ({vendor}, Megatron-DeepSpeed's) is not built: nccl on CUDA, gloo "
                   "on a CPU (the default picks)" for name, vendor in (("ccl", "Intel"),
                                                                      ("hccl", "Habana"))}
_DDP_IMPLS = {"FSDP": "torch FSDP is not built: ZeRO stage 3 (--deepspeed --zero-stage 3) "
                      "shards parameters, gradients and optimizer states"}


def _byte_count(text):
    """Bucket sizes as DeepSpeed scripts write them: 50000000 or 5e7."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def _network(parser):
    g = parser.add_argument_group("network size")
    g.add_argument("--model-size", default=None,
                   help="named size from megatron.model.MODEL_SIZES (e.g. gpt2-124m); fills "
                        "--num-layers/--hidden-size/--num-attention-heads not given explicitly")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP inner size (default 4 * hidden)")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None,
                   help="later Megatron-LM's channels per attention head: checked, as "
                        "--hidden-size / --num-attention-heads is the only head size here")
    g.add_argument("--position-embedding-type", default=None,
                   type=_gpt2_only("learned_absolute", "rope and alibi positions are not built: "
                                   "GPT-2's are learned absolute embeddings"),
                   help="later Megatron-LM's: only learned_absolute, GPT-2's")
    g.add_argument("--normalization", default=None,
                   type=_gpt2_only("LayerNorm", "RMSNorm is not built: GPT-2 uses LayerNorm"),
                   help="later Megatron-LM's: only LayerNorm, GPT-2's")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocab to a multiple of this times --model-parallel-size")
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", type=float, default=1e-5,
                   dest="layernorm_epsilon", help="(--norm-epsilon: later Megatron-LM's name)")
    g.add_argument("--init-method-std", type=float, default=0.02)


def _regularization(parser):
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
    g.add_argument("--optimizer", choices=("adam", "adam8bit", "adam4bit"), default="adam",
                   type=offered_here(_OPTIMIZERS),
                   help="adam: AdamW with fp32 states; adam8bit / adam4bit: the same update "
                        "with 8-bit / 4-bit block-wise states (zero.optim.quantized_adam, "
                        "~2 / ~1.06 bytes/param instead of 8; ZeRO stages 0-3, "
                        "offload_optimizer cpu or nvme). Under --deepspeed the config's "
                        "optimizer section, when it has one, decides instead")


def _training(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--batch-size", "--micro-batch-size", type=int, default=None,
                   help="micro batch size per data-parallel rank (--micro-batch-size: later "
                        "Megatron-LM's name)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration over all data-parallel ranks; larger than "
                        "batch-size x data-parallel-size means gradient accumulation (default: "
                        "batch-size x data-parallel-size, or the DeepSpeed config's)")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Megatron-LM's batch-size ramp: the global batch starts at START and "
                        "grows by INCREMENT to --global-batch-size over the first SAMPLES "
                        "samples (lengths then in samples: --train-samples, "
                        "--lr-decay-samples, --lr-warmup-samples)")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None,
                   help="later Megatron-LM's: the run's length in samples, instead of "
                        "--train-iters (iterations = samples // global batch)")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="Megatron-DeepSpeed's: stop after this many tokens (iterations = "
                        "tokens / (global batch x --seq-length), or --train-iters if fewer)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, if --save is set) when iteration %% N == 0")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each chunk of --checkpoint-num-layers layers in backward")
    g.add_argument("--checkpoint-num-layers", type=int, default=1)
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (the layers share the "
                        "compiled code; on a lone GPU at ZeRO stage 0 or 1 without "
                        "offload or recompute, the stack of layers as one region); "
                        "under --deepspeed the same as the config's "
                        "\"compile\": {\"enabled\": true}")
    g.add_argument("--seed", type=int, default=1234)


def _learning_rate(parser):
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "exponential", "WSD",
                            "inverse-square-root"],
                   help="exponential: Megatron-LM 1.1.5's; WSD (warmup-stable-decay) and "
                        "inverse-square-root: later Megatron-LM's")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   help="--lr-decay-style WSD: the shape of its decay to --min-lr")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="--lr-decay-style WSD: the decay's length, the last iterations of "
                        "--lr-decay-iters (before them the lr holds at --lr)")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="--lr-wsd-decay-iters in samples (divided by the global batch)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    for unit, per in (("samples", "global batch"), ("tokens", "global batch x --seq-length")):
        g.add_argument(f"--lr-decay-{unit}", type=int, default=None,
                       help=f"--lr-decay-iters in {unit} (divided by the {per})")
        g.add_argument(f"--lr-warmup-{unit}", type=int, default=None,
                       help=f"--warmup-iters in {unit} (divided by the {per})")
    g.add_argument("--warmup", "--lr-warmup-fraction", type=float, default=0.01,
                   help="fraction of --lr-decay-iters used for linear warmup "
                        "(--lr-warmup-fraction: later Megatron-LM's name)")
    g.add_argument("--warmup-iters", "--lr-warmup-iters", type=int, default=None,
                   help="warmup iterations, instead of --warmup (--lr-warmup-iters: later "
                        "Megatron-LM's name)")
    g.add_argument("--override-lr-scheduler", "--override-opt_param-scheduler",
                   action="store_true", dest="override_lr_scheduler",
                   help="on --load, use the schedule from the flags, not the checkpoint "
                        "(--override-opt_param-scheduler: later Megatron-LM's name)")
    g.add_argument("--use-checkpoint-lr-scheduler", "--use-checkpoint-opt_param-scheduler",
                   action="store_true", dest="use_checkpoint_lr_scheduler",
                   help="on --load, use the schedule stored in the checkpoint "
                        "(--use-checkpoint-opt_param-scheduler: later Megatron-LM's name)")


def _checkpointing(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None, help="default: --train-iters")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--load", default=None,
                   help="directory to resume from; model flags left out are taken from its "
                        "checkpoint")
    g.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="load iteration N from --load instead of the one its tracker names "
                        "(Megatron-LM's)")
    g.add_argument("--load-tag", default=None, metavar="TAG",
                   help="the same by the checkpoint's folder name: global_stepN (--deepspeed) "
                        "or iter_NNNNNNN (Megatron-DeepSpeed's)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="a --load folder without a checkpoint is an error instead of a run "
                        "from scratch (Megatron-LM's; for jobs that must resume)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; start at iteration 0 with fresh optimizer")


def _mixed_precision(parser):
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters with fp32 master weights and loss scaling")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters with fp32 master weights (no loss scaling)")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale; default (None) is dynamic loss scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="dynamic loss scaling starts here (a power of 2)")
    g.add_argument("--min-scale", "--min-loss-scale", type=float, default=1.0,
                   dest="min_scale", help="(--min-loss-scale: later Megatron-LM's name)")
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _distributed(parser):
    g = parser.add_argument_group("distributed")
    g.add_argument("--model-parallel-size", "--tensor-model-parallel-size", type=int,
                   default=1, help="tensor-parallel size; adjacent ranks form a tensor-parallel "
                                   "group (--tensor-model-parallel-size: later Megatron-LM's "
                                   "name)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages: the transformer layers are split over this many "
                        "stages (embeddings on the first, the output layer on the last), "
                        "which run the micro batches of --global-batch-size in the 1F1B "
                        "schedule; world size = tensor x pipeline x data parallel")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B: each stage holds num_layers / (stages x N) model "
                        "chunks of N layers (chunk c of stage s is the (c x stages + s)-th "
                        "block of layers), which shrinks the pipeline bubble by that factor "
                        "for one more point-to-point message per chunk and micro batch")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   type=offered_here(_BACKENDS),
                   help="default: nccl on CUDA, gloo on CPU")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, dest="local_rank",
                   help="set by torch.distributed.launch; torchrun uses LOCAL_RANK instead")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective (or the start-up rendezvous) that waits longer than "
                        "this for another rank fails instead of hanging; fractions allowed")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: $OMP_NUM_THREADS, else cores / "
                        "local processes)")
    g.add_argument("--DDP-impl", default="local", choices=["local", "torch"], dest="DDP_impl",
                   type=offered_here(_DDP_IMPLS),
                   help="data-parallel gradient all-reduce without --deepspeed: local (the "
                        "zero engine's stage 0 buckets, overlapped with backward) or torch "
                        "(torch.nn.parallel.DistributedDataParallel)")
    g.add_argument("--ddp-bucket-size", type=float, default=None, metavar="MB",
                   help="megabytes of gradients per all-reduce bucket without --deepspeed "
                        "(default 25); smaller buckets start communicating earlier in "
                        "backward, larger ones make fewer calls")
    g.add_argument("--fp32-allreduce", action="store_true",
                   help="all-reduce 16-bit (--fp16/--bf16) gradients in fp32 (ZeRO stage 0)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="sum the micro batches' 16-bit gradients, and all-reduce them, in fp32 "
                        "(the fp32 master weights' gradients; ZeRO stage 0). Always so with "
                        "--bf16 and --DDP-impl local, as in Megatron-LM; under --deepspeed it "
                        "is the config's data_types.grad_accum_dtype \"fp32\"")


def _validation(parser):
    g = parser.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)


def _data(parser):
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="+", default=None, metavar="[WEIGHT] PREFIX",
                   help="prefix of a preprocessed dataset (without .bin/.idx); several make a "
                        "blend: W1 PREFIX1 W2 PREFIX2 ... (weights, normalized), or PREFIX1 "
                        "PREFIX2 ... (weighted by their tokens)")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="+", default=None,
                       metavar="[WEIGHT] PREFIX",
                       help=f"the {split} split's own dataset (or blend, as --data-path), all "
                            "of its documents; instead of --data-path and --split (later "
                            "Megatron-LM's)" + (": --valid-data-path and --test-data-path "
                                                "are optional" if split == "train" else ""))
    g.add_argument("--train-data", default=None,
                   help="a named loose-JSON corpus (webtext) or a .json path; tokenized into "
                        ".bin/.idx next to it on first use")
    g.add_argument("--data-impl", default="mmap", type=offered_here(_DATA_IMPLS),
                   choices=["mmap", "infer"],
                   help="only the mmap (MMIDIDX) format is supported; infer checks the file")
    g.add_argument("--mmap-warmup", action="store_true",
                   help="read the whole .bin once at start to warm the page cache")
    g.add_argument("--split", default="969, 30, 1",
                   help="train,valid,test weights over documents")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--tokenizer-type", default=None, type=offered_here(_OTHER_TOKENIZERS),
                   choices=["GPT2BPETokenizer", "SentencePieceTokenizer"])
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece model file")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _reliability(parser):
    g = parser.add_argument_group("reliability")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, every rank saves at the next iteration boundary (when "
                        "--save is set) and exits 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit once the job has run this many minutes")
    g.add_argument("--kill-switch-file", default=None, metavar="PATH",
                   help="once this file exists, every rank saves at the next iteration "
                        "boundary (when --save is set) and exits 0; a run that finds it at "
                        "start-up exits before training (Megatron-DeepSpeed's flag)")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=None, metavar="N",
                   help="after each save, delete all but the newest N checkpoints in --save "
                        "(the new one is complete before any is deleted); default: keep all")
    g.add_argument("--max-nan-iterations", type=int, default=10, metavar="N",
                   help="stop after N consecutive iterations whose loss is NaN or inf (each is "
                        "skipped and counted); 0 never stops")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   metavar="N",
                   help="every N iterations the data-parallel replicas compare a SHA-256 "
                        "digest of each weight they hold; replicas that differ stop the run, "
                        "naming the weights (a collective; not at ZeRO stage 3, whose ranks "
                        "hold different parts)")


def _deepspeed(parser):
    """DeepSpeed's own flags (as `deepspeed.add_config_arguments` adds them)."""
    from zero.config.arguments import add_config_arguments
    add_config_arguments(parser)
    # DeepSpeed's help says the flag is for user code; here it is what chooses the path
    meanings = {
        "deepspeed": "train with the DeepSpeed JSON of --deepspeed_config (ZeRO stage, "
                     "precision, batch sizes, optimizer...) and save DeepSpeed's checkpoint "
                     "layout; without it the same engine runs ZeRO stage 0 from the Megatron "
                     "flags and saves Megatron's layout",
        "deepscale": "deprecated spelling of --deepspeed"}
    for action in parser._actions:
        if action.dest in meanings:
            action.help = meanings[action.dest]


def _zero(parser):
    """Megatron-DeepSpeed's ZeRO flags: they override the DeepSpeed config's keys."""
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


def _activation_checkpointing(parser):
    g = parser.add_argument_group(
        "activation checkpointing", "how --checkpoint-activations keeps its checkpoints")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="recompute through zero.checkpointing (DeepSpeed's), which the options "
                        "below and the config's activation_checkpointing section configure")
    g.add_argument("--partition-activations", action="store_true",
                   help="each tensor-parallel rank keeps 1/TP of every checkpoint; all-gathered "
                        "before recompute (no-op without tensor parallelism)")
    g.add_argument("--distribute-checkpointed-activations", "--distribute-saved-activations",
                   action="store_true", dest="distribute_checkpointed_activations",
                   help="Megatron's name for --partition-activations (--distribute-saved-"
                        "activations: later Megatron-LM's)")
    g.add_argument("--checkpoint-in-cpu", action="store_true",
                   help="keep checkpoints in host memory (pinned on CUDA)")
    g.add_argument("--contigious-checkpointing", "--contiguous-checkpointing",
                   action="store_true", dest="contiguous_checkpointing",
                   help="keep checkpoints in one buffer preallocated for all of them")
    g.add_argument("--synchronize-each-layer", action="store_true",
                   help="device synchronize at the start and end of every checkpoint")
    g.add_argument("--profile-backward", action="store_true",
                   help="print forward/recompute/backward milliseconds of every checkpoint "
                        "after each backward pass (rank 0)")
    g.add_argument("--split-transformers", action="store_true",
                   help="checkpoint the attention and MLP halves of each layer separately")


def _tiling(parser):
    g = parser.add_argument_group("memory optimizations")
    g.add_argument("--memory-centric-tiled-linear", action="store_true",
                   help="hold QKV, dense, h->4h and 4h->h as grids of tiles "
                        "(zero.TiledLinearReturnBias); under ZeRO stage 3 one tile is "
                        "gathered at a time. Same weights and losses as untiled")
    g.add_argument("--tile-factor", type=int, default=None,
                   help="with --memory-centric-tiled-linear (default 1): F tiles QKV F x 3F, "
                        "dense F x F, h->4h F x 4F, 4h->h 4F x F (input x output splits)")

