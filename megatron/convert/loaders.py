"""Read a GPT-2 checkpoint of any supported format into one TP-free intermediate.

    megatron    <dir>/latest_checkpointed_iteration.txt + iter_XXXXXXX|release/mp_rank_NN/
                model_optim_rng.pt, at any tensor-parallel size
    deepspeed   <dir>/latest + <tag>/mp_rank_NN_model_states.pt (+ ZeRO optim-states files),
                any ZeRO stage, tensor- and data-parallel size
    hf          <dir>/config.json (model_type gpt2) + model.safetensors or pytorch_model.bin

The intermediate (`ModelWeights`) is the full model with flat Megatron keys, the word
embeddings cut to the real vocabulary, plus the model arguments needed to rebuild it.
"""

import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict

import torch

from megatron.checkpointing.files import safe_load
from megatron.checkpointing.megatron_layout import TRACKER_FILENAME
from megatron.convert.checkpoint_files import inside_a_checkpoint, read_sharded_checkpoint
from megatron.convert.deepspeed_source import read_deepspeed_checkpoint
from megatron.convert.hf import (HF_TOKENIZER_FILES, check_hf_shapes, hf_to_megatron_state_dict,
                                 model_args_from_hf_config)
from megatron.convert.reshard import (merge_checkpoint, resize_vocab, resolve_vocab_size,
                                      tokenizer_vocab_size)
from megatron.convert.tp_layout import WORD_EMBEDDINGS
from megatron.errors import CheckpointError

FORMATS = ("megatron", "deepspeed", "hf")
FORMAT_HELP = ("megatron (latest_checkpointed_iteration.txt + iter_*/mp_rank_*/"
               "model_optim_rng.pt), deepspeed (latest + <tag>/*_model_states.pt), "
               "hf (config.json + model.safetensors or pytorch_model.bin)")
# Arguments that define the model's shape and tokenizer; carried into converted checkpoints.
MODEL_ARG_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "max_position_embeddings", "layernorm_epsilon", "orig_vocab_size",
                  "make_vocab_size_divisible_by", "tokenizer_type", "vocab_file", "merge_file",
                  "tokenizer_model", "init_method_std", "seq_length", "tokenizer_probe_sha1")


@dataclass
class ModelWeights:
    """A full GPT-2: flat Megatron keys; word embeddings [orig_vocab_size, h]."""
    state_dict: Dict[str, torch.Tensor]
    args: dict  # MODEL_ARG_KEYS that are known (tokenizer paths may be None)
    source_format: str
    iteration: int = 0
    notes: list = field(default_factory=list)

    @property
    def vocab_size(self):
        return self.state_dict[WORD_EMBEDDINGS].shape[0]


def detect_format(load_dir):
    """The format of `load_dir`, judged from the files in it; CheckpointError if none fits."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"the checkpoint folder {load_dir} is not a directory")
    names = os.listdir(load_dir)
    # DeepSpeed saves also write Megatron's tracker, so its own files decide first.
    if "latest" in names or any(glob.glob(os.path.join(load_dir, "*", "*_model_states.pt"))):
        return "deepspeed"
    if TRACKER_FILENAME in names or any(re.fullmatch(r"iter_\d{7}|release", n) for n in names):
        return "megatron"
    if "config.json" in names:
        return "hf"
    hint = inside_a_checkpoint(load_dir)
    if hint:
        raise CheckpointError(hint)
    raise CheckpointError(f"cannot tell the checkpoint format of {load_dir} (it holds "
                          f"{', '.join(sorted(names)[:6]) or 'nothing'}); understood formats: "
                          f"{FORMAT_HELP}")


def load_model_weights(load_dir, loader=None, vocab_size=None, tokenizer_files=None,
                       iteration=None):
    """ModelWeights from `load_dir` in format `loader` (detected when None), of `iteration`
    (default: the one the checkpoint's tracker names)."""
    loader = loader or detect_format(load_dir)
    if loader not in FORMATS:
        raise CheckpointError(f"unknown --loader {loader!r}; understood formats: {FORMAT_HELP}")
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"the checkpoint folder {load_dir} is not a directory")
    if loader == "megatron":
        return load_megatron(load_dir, vocab_size, tokenizer_files, iteration)
    if loader == "deepspeed":
        return load_deepspeed(load_dir, vocab_size, tokenizer_files, iteration)
    if iteration is not None:
        raise CheckpointError(f"iteration {iteration} was asked for, but {load_dir} is a "
                              "Hugging Face folder, which holds one model: leave the "
                              "iteration out")
    return load_hf(load_dir, vocab_size, tokenizer_files)


def _model_args(saved_args, vocab_size):
    args = {key: saved_args.get(key) for key in MODEL_ARG_KEYS if key in saved_args}
    args["orig_vocab_size"] = vocab_size
    args.setdefault("make_vocab_size_divisible_by", 128)
    if not args.get("ffn_hidden_size"):
        args["ffn_hidden_size"] = 4 * args["hidden_size"]
    args.setdefault("layernorm_epsilon", 1e-5)
    return args


def load_megatron(load_dir, vocab_size=None, tokenizer_files=None, iteration=None):
    return _load_sharded(read_sharded_checkpoint(load_dir, iteration), "megatron", vocab_size,
                         tokenizer_files)


def load_deepspeed(load_dir, vocab_size=None, tokenizer_files=None, iteration=None):
    """The fp32 master weights of a --deepspeed checkpoint (any ZeRO stage, TP and DP size),
    read as Megatron shards by the reader tools/merge_mp_partitions.py --deepspeed uses."""
    return _load_sharded(read_deepspeed_checkpoint(load_dir, iteration, fp32_weights=True,
                                                   with_optimizer=False), "deepspeed",
                         vocab_size, tokenizer_files)


def _load_sharded(sharded, source_format, vocab_size, tokenizer_files):
    vocab_size = resolve_vocab_size(sharded.args, vocab_size, tokenizer_files)
    full = merge_checkpoint(sharded, vocab_size)
    resize_vocab(full, vocab_size)
    return ModelWeights(dict(full.model), _model_args(sharded.args, vocab_size), source_format,
                        int(full.common.get("iteration", 0)))


# ----------------------------------------------------------------------------------- hf

def load_hf(load_dir, vocab_size=None, tokenizer_files=None):
    """ModelWeights of a Hugging Face GPT-2 folder. Its tokenizer files (or `tokenizer_files`,
    or `vocab_size`) give the vocabulary; embedding rows past it are padding and dropped."""
    config_path = os.path.join(load_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{load_dir} has no config.json: not a Hugging Face model folder")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} holds a {type(config).__name__}, not the JSON "
                              "object {...} of a model config")
    args = model_args_from_hf_config(config)
    hf_state = _read_hf_weights(load_dir)
    check_hf_shapes(hf_state, args)  # wte's rows are the config's vocab_size from here on
    state = hf_to_megatron_state_dict(hf_state, args["num_layers"], args["num_attention_heads"])
    args["make_vocab_size_divisible_by"] = 128
    args["seq_length"] = args["max_position_embeddings"]
    args["tokenizer_type"] = None
    for tokenizer_type, files in HF_TOKENIZER_FILES.items():  # GPT-2 BPE first
        paths = {key: os.path.join(load_dir, name) for key, name in files.items()}
        if args["tokenizer_type"] is None and all(map(os.path.isfile, paths.values())):
            args["tokenizer_type"] = tokenizer_type
            args.update({key: os.path.abspath(path) for key, path in paths.items()})
        else:
            args.update(dict.fromkeys(files))
    tokenizer_files = {key: path for key, path in (tokenizer_files or {}).items() if path}
    if tokenizer_files:
        args.update({key: os.path.abspath(path) for key, path in tokenizer_files.items()})
        args["tokenizer_type"] = "SentencePieceTokenizer" \
            if "tokenizer_model" in tokenizer_files else "GPT2BPETokenizer"
    tokenizer_size = tokenizer_vocab_size(args, {}) if args["tokenizer_type"] else None
    if vocab_size is not None and tokenizer_size not in (None, vocab_size):
        raise CheckpointError(f"--vocab-size {vocab_size} disagrees with the {tokenizer_size} "
                              f"tokens of the tokenizer ({_tokenizer_source(args)}); drop "
                              "--vocab-size")
    vocab_size = tokenizer_size if vocab_size is None else vocab_size
    notes = []
    if vocab_size is not None and vocab_size != args["orig_vocab_size"]:
        notes.append(_drop_padding_rows(state, args, vocab_size, load_dir))
    state = {k: v.float() for k, v in state.items()}
    return ModelWeights(state, args, "hf", 0, notes)


def _drop_padding_rows(state, args, vocab_size, load_dir):
    """Cut the embedding to `vocab_size` rows: those past the tokenizer are padding (a model
    trained with its vocabulary padded, e.g. 50257 tokens in 50304 rows)."""
    rows = args["orig_vocab_size"]
    source = _tokenizer_source(args) if args["tokenizer_type"] else "--vocab-size"
    if vocab_size > rows:
        raise CheckpointError(
            f"the tokenizer ({source}) has {vocab_size} tokens, but {load_dir}/config.json's "
            f"vocab_size is {rows}: ids from {rows} on have no embedding row; give the "
            "tokenizer files the model was trained with")
    # Padding rounds up to a multiple of 128 x TP (1024 at TP 8): more rows than that and than
    # the tokens themselves are not padding
    if rows - vocab_size >= 1024 and rows - vocab_size > vocab_size:
        raise CheckpointError(
            f"the tokenizer ({source}) has {vocab_size} tokens, but {load_dir}/config.json's "
            f"vocab_size is {rows}: {rows - vocab_size} rows more than tokens are not padding, "
            "so the tokenizer is not the model's; give the tokenizer files the model was "
            "trained with")
    state[WORD_EMBEDDINGS] = state[WORD_EMBEDDINGS][:vocab_size].clone()
    args["orig_vocab_size"] = vocab_size
    return (f"config.json's vocab_size {rows} is {rows - vocab_size} rows more than the "
            f"{vocab_size} tokens of the tokenizer ({source}): read those rows as padding "
            "and dropped them")


def _tokenizer_source(args):
    return ", ".join(args[key] for key in ("vocab_file", "merge_file", "tokenizer_model")
                     if args.get(key))


def _read_hf_weights(load_dir):
    safetensors_path = os.path.join(load_dir, "model.safetensors")
    bin_path = os.path.join(load_dir, "pytorch_model.bin")
    if os.path.isfile(safetensors_path):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError(f"{safetensors_path} needs the safetensors package: "
                                  "EXTRAS=convert bash scripts/setup.sh") from None
        from safetensors import SafetensorError
        try:
            return load_file(safetensors_path)
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{safetensors_path} cannot be read ({error}): the file is "
                                  "truncated or not a safetensors file") from None
    if os.path.isfile(bin_path):
        return safe_load(bin_path)
    sharded = glob.glob(os.path.join(load_dir, "*.index.json"))
    hint = " (sharded weights: load and re-save them unsharded with transformers first)" \
        if sharded else ""
    raise CheckpointError(f"{load_dir} has config.json but neither model.safetensors nor "
                          f"pytorch_model.bin{hint}")

