"""Build a GPT-2 for inference (generation, evaluation) from a checkpoint of any format.

The checkpoint carries the model's shape and tokenizer, so the tools need only --load:

    checkpoint (megatron at any TP | deepspeed any stage/TP/DP | hf)
        -> full weights (megatron.convert.loaders)
        -> vocab padded for this run's TP size, this rank's slice (tp_layout)
        -> GPT2Model(parallel_output=False) in eval mode

so a checkpoint saved at one tensor-parallel size runs at any other.
"""

import argparse
import os

import torch

from megatron import mpu
from megatron.config.from_checkpoint import TOKENIZER_FILE_KEYS
from megatron.convert.loaders import FORMATS, load_model_weights
from megatron.convert.reshard import check_recorded_tokenizer_files, check_trained_tokenizer
from megatron.convert.tp_layout import (WORD_EMBEDDINGS, parameter_layout, resize_vocab_rows,
                                        shard_of)
from megatron.errors import ConfigError
from megatron.inference.quantization import (add_quantization_arguments, quantization_config,
                                             quantize_model)
from megatron.tokenizer import build_tokenizer, vocab_size_with_padding

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_inference_arguments(parser):
    """Flags every inference tool shares (Megatron names where Megatron has them)."""
    g = parser.add_argument_group("model and runtime")
    g.add_argument("--load", required=True, help="checkpoint folder: Megatron layout, "
                   "--deepspeed layout or a Hugging Face GPT-2 folder (detected)")
    g.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="load iteration N instead of the one the checkpoint's tracker names "
                        "(Megatron-LM's)")
    g.add_argument("--deepspeed", action="store_true",
                   help="--load holds a DeepSpeed-layout checkpoint (also detected)")
    g.add_argument("--loader", choices=FORMATS, default=None,
                   help="checkpoint format (default: detected from --load)")
    g.add_argument("--model-parallel-size", type=int, default=1,
                   help="tensor-parallel size of this run (any: the checkpoint is resharded "
                        "in memory); launch that many processes with torchrun")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="taken as Megatron's scripts pass it: inference runs no pipeline "
                        "stages; a checkpoint's stages are joined as it loads")
    g.add_argument("--tokenizer-type", default=None,
                   choices=["GPT2BPETokenizer", "SentencePieceTokenizer"],
                   help="default: the one recorded in the checkpoint")
    g.add_argument("--vocab-file", default=None, help="default: from the checkpoint")
    g.add_argument("--merge-file", default=None, help="default: from the checkpoint")
    g.add_argument("--tokenizer-model", default=None, help="default: from the checkpoint")
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--precision", choices=sorted(DTYPES), default="fp32",
                           help="dtype of the weights at inference (default fp32)")
    for name in ("fp16", "bf16"):  # Megatron's spelling, which its scripts pass
        precision.add_argument(f"--{name}", dest="precision", action="store_const", const=name,
                               help=f"--precision {name}")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--threads", type=int, default=None, help="CPU threads per process")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g = parser.add_argument_group(
        "model shape", "the checkpoint records the shape; these flags (which Megatron's "
        "generation and evaluation scripts pass) are checked against it")
    for flag, kind in SHAPE_FLAGS.items():
        g.add_argument(flag, type=kind, default=None)
    g = parser.add_argument_group("Megatron flags for what inference always does")
    for flag, what in INFERENCE_ALWAYS_SO.items():
        g.add_argument(flag, action="store_true", help=f"accepted: {what}")
    return add_quantization_arguments(parser)


# Megatron flags its generation and evaluation scripts pass, asking for what inference does
INFERENCE_ALWAYS_SO = {
    "--no-load-optim": "inference never loads optimizer states",
    "--no-load-rng": "inference never loads the checkpoint's RNG states",
    "--checkpoint-activations": "inference keeps no activations for a backward pass (there "
                                "is none), which is all the flag saves",
}


# flag -> type; each is a key of the args a checkpoint records
SHAPE_FLAGS = {"--num-layers": int, "--hidden-size": int, "--num-attention-heads": int,
               "--ffn-hidden-size": int, "--max-position-embeddings": int,
               "--make-vocab-size-divisible-by": int, "--layernorm-epsilon": float}


def check_shape_flags(args, model_args, load_dir):
    """ConfigError listing every model-shape flag that disagrees with the checkpoint."""
    differences = []
    for flag in SHAPE_FLAGS:
        key = flag[2:].replace("-", "_")
        given, saved = getattr(args, key, None), model_args.get(key)
        if key == "ffn_hidden_size" and saved is None and model_args.get("hidden_size"):
            saved = 4 * model_args["hidden_size"]
        if given is not None and saved is not None and given != saved:
            differences.append(f"{flag} {given} (the checkpoint: {saved})")
    if differences:
        raise ConfigError(f"--load {load_dir} holds another model than the flags describe: "
                          f"{'; '.join(differences)}. Drop those flags (the checkpoint knows "
                          "its shape) or load the checkpoint they describe")
    limit = model_args.get("max_position_embeddings")
    seq_length = getattr(args, "seq_length", None)  # the tools' own flag, where they have it
    if seq_length is not None and limit is not None and seq_length > limit:
        raise ConfigError(f"--seq-length {seq_length} is longer than the checkpoint's "
                          f"--max-position-embeddings {limit}")


def check_output_file(flag, path, inputs=()):
    """ConfigError, before any work, unless `path` can be written as a file that is none of
    the `inputs` (which writing it would destroy)."""
    if any(os.path.realpath(path) == os.path.realpath(other) for other in inputs if other):
        raise ConfigError(f"{flag} {path} is also an input file: writing it would replace what "
                          "it reads; name another file")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; name a file in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: the directory {folder} is not writable")


def initialize_inference(args):
    """Process group (torchrun or a single process), TP groups, seeds; returns a Runtime."""
    from megatron.config.resolve import MAX_INT
    from megatron.config.sections import ParallelConfig
    from megatron.runtime.initialize import initialize_megatron
    from megatron.runtime.launch import discover_launch_environment
    quantization_config(args)  # its flag errors before any work
    launch = discover_launch_environment()
    world_size = launch.world_size
    tp = args.model_parallel_size
    for flag, value in (("--model-parallel-size", tp), ("--threads", args.threads),
                        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size)):
        if value is not None and value < 1:  # as the trainer checks them
            raise ConfigError(f"{flag} must be positive, got {value}")
        if value is not None and value > MAX_INT:
            raise ConfigError(f"{flag} {value} is out of range (at most {MAX_INT})")
    if world_size % tp != 0:
        raise ConfigError(f"world size {world_size} is not divisible by --model-parallel-size "
                          f"{tp}; start a multiple of {tp} processes, e.g. torchrun "
                          f"--nproc_per_node {tp}")
    if not args.distributed_timeout_minutes > 0:
        raise ConfigError(f"--distributed-timeout-minutes must be positive, got "
                          f"{args.distributed_timeout_minutes}")
    if args.ckpt_step is not None and not 0 <= args.ckpt_step <= MAX_INT:
        raise ConfigError(f"--ckpt-step must be from 0 to {MAX_INT}, got {args.ckpt_step}")
    if not 0 <= args.seed <= MAX_INT:  # (the trainer's range; numpy takes < 2^32)
        raise ConfigError(f"--seed must be from 0 to {MAX_INT}, got {args.seed}")
    if world_size > tp and launch.rank == 0:
        print(f" note: {world_size} processes at --model-parallel-size {tp}: each group of {tp} "
              f"runs the whole job, so {world_size // tp} groups repeat the same work; launch "
              f"{tp} process(es)", flush=True)
    return initialize_megatron(ParallelConfig(
        world_size=world_size, model_parallel_size=tp, data_parallel_size=world_size // tp,
        pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=None,
        virtual_pipeline_model_parallel_size=1, distributed_backend=None, device=args.device,
        local_rank=None,
        distributed_timeout_minutes=args.distributed_timeout_minutes, threads=args.threads,
        DDP_impl="local", ddp_bucket_size=0.0, seed=args.seed))


def load_inference_model(args, device=torch.device("cpu")):
    """(model, tokenizer, model args) for `args` from add_inference_arguments, on this rank."""
    loader = "deepspeed" if args.deepspeed and args.loader is None else args.loader
    overrides = {k: getattr(args, k) for k in ("vocab_file", "merge_file", "tokenizer_model")
                 if getattr(args, k)}
    weights = load_model_weights(args.load, loader, tokenizer_files=overrides or None,
                                 iteration=args.ckpt_step)
    check_shape_flags(args, weights.args, args.load)
    if _first_rank():
        iteration = "" if weights.source_format == "hf" else f", iteration {weights.iteration}"
        print(f" loaded {args.load} ({weights.source_format}{iteration})", flush=True)
        if args.pipeline_model_parallel_size > 1:
            print(f" note: --pipeline-model-parallel-size {args.pipeline_model_parallel_size}: "
                  "inference runs the whole model on each tensor-parallel rank (the "
                  "checkpoint's stages are joined as it loads); launch --model-parallel-size "
                  f"{args.model_parallel_size} process(es), more only repeat the work",
                  flush=True)
        for note in weights.notes:
            print(f" note: {note}", flush=True)
    model_args = dict(weights.args)
    model_args.update({k: os.path.abspath(v) for k, v in overrides.items()})
    if args.tokenizer_type:
        model_args["tokenizer_type"] = args.tokenizer_type
    _check_files_fit_the_tokenizer(model_args.get("tokenizer_type"), overrides)
    check_recorded_tokenizer_files(model_args)
    tokenizer = _build_tokenizer(model_args)
    if tokenizer.vocab_size != weights.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the "
                          f"checkpoint's vocab has {weights.vocab_size}; give the tokenizer "
                          "files the model was trained with")
    check_trained_tokenizer(weights.args, tokenizer, ", ".join(
        model_args[key] for key in TOKENIZER_FILE_KEYS if model_args.get(key)))
    model = build_model_from_weights(weights, DTYPES[args.precision], device)
    return model, tokenizer, model_args


def _check_files_fit_the_tokenizer(tokenizer_type, overrides):
    """Tokenizer files of the other kind than the tokenizer in use would be ignored."""
    takes = {"GPT2BPETokenizer": ("vocab_file", "merge_file"),
             "SentencePieceTokenizer": ("tokenizer_model",)}.get(tokenizer_type)
    ignored = [f"--{key.replace('_', '-')}" for key in overrides if takes and key not in takes]
    if ignored:
        raise ConfigError(f"{' '.join(ignored)} names a file that the {tokenizer_type} in "
                          "use does not read (the checkpoint's, unless --tokenizer-type says "
                          "otherwise); give the files of that tokenizer")


def build_model_from_weights(weights, dtype=torch.float32, device=torch.device("cpu")):
    """GPT2Model for this rank (of the current TP size) holding `weights`, eval mode."""
    from megatron.model import GPT2Model, GPTConfig
    a = weights.args
    tp, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    padded = vocab_size_with_padding(weights.vocab_size,
                                     a.get("make_vocab_size_divisible_by") or 128, tp)
    config = GPTConfig(num_layers=a["num_layers"], hidden_size=a["hidden_size"],
                       num_attention_heads=a["num_attention_heads"], vocab_size=padded,
                       max_position_embeddings=a["max_position_embeddings"],
                       ffn_hidden_size=a.get("ffn_hidden_size"), hidden_dropout=0.0,
                       attention_dropout=0.0, layernorm_epsilon=a.get("layernorm_epsilon", 1e-5))
    model = GPT2Model(config, parallel_output=False)  # its random init is overwritten below
    state = {}
    for name, tensor in weights.state_dict.items():
        if name == WORD_EMBEDDINGS:
            tensor = resize_vocab_rows(tensor, padded)
        state[name] = shard_of(tensor, parameter_layout(name).split, tp, rank).to(dtype)
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()  # load_state_dict keeps fp32


def quantize_for_inference(args, model):
    """Apply --quantize (if given) to `model` in place; rank 0 prints what it saved."""
    config = quantization_config(args)
    if config is None:
        return None
    report = quantize_model(model, config)
    if _first_rank():
        print(report.line(), flush=True)
    return report


def _first_rank():
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _build_tokenizer(model_args):
    tokenizer_type = model_args.get("tokenizer_type")
    if tokenizer_type is None:
        raise ConfigError("the checkpoint records no tokenizer; pass --tokenizer-type with "
                          "--vocab-file/--merge-file or --tokenizer-model")
    return build_tokenizer(tokenizer_type, model_args.get("vocab_file"),
                           model_args.get("merge_file"), model_args.get("tokenizer_model"))


def inference_parser(description):
    return add_inference_arguments(argparse.ArgumentParser(description=description,
                                                           allow_abbrev=False))
