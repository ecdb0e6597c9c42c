"""Write a `ModelWeights` as a Megatron-layout checkpoint (any TP size) or an HF GPT-2 folder.

Megatron: a `release` checkpoint (weights only, like Megatron's converted checkpoints), so
`pretrain_gpt2.py --load` starts at iteration 0 with a fresh optimizer: continued pretraining
or fine-tuning.  Its `args` record the model's shape, vocab and tokenizer, which
`check_checkpoint_args` compares with the flags and the generation/evaluation tools read.
Tokenizer files travel along (copied next to the checkpoint), so the folder is self-contained.

HF: config.json, model.safetensors (no lm_head.weight: it is tied to transformer.wte) and
the tokenizer: vocab.json and merges.txt (GPT-2 BPE), or tokenizer.model (SentencePiece, which
Hugging Face's GPT-2 tokenizer classes do not read; the HF loader here does).
"""

import json
import os
import shutil

import torch

from megatron.checkpointing.files import atomic_write_text
from megatron.tokenizer.file_utils import permissions_as_new_file
from megatron.checkpointing.megatron_layout import CHECKPOINT_VERSION
from megatron.checkpointing.state_dicts import to_nested_state_dict
from megatron.config.from_checkpoint import TOKENIZER_FILE_KEYS
from megatron.convert.checkpoint_files import write_sharded_checkpoint
from megatron.convert.hf import (HF_TOKENIZER_FILES, hf_config_from_model_args,
                                 megatron_to_hf_state_dict)
from megatron.convert.reshard import (check_recorded_tokenizer_files, check_target_size,
                                      check_target_stages)
from megatron.convert.tp_layout import (WORD_EMBEDDINGS, parameter_layout, resize_vocab_rows,
                                        split_full)
from megatron.errors import CheckpointError, ConfigError
from megatron.tokenizer import SentencePieceTokenizer, vocab_size_with_padding

SAVERS = ("megatron", "hf")


def save_model_weights(weights, save_dir, saver, target_tp=1, dtype=torch.float32, target_pp=1):
    """Write `weights` in format `saver`; returns a list of the files written."""
    if saver not in SAVERS:
        raise ConfigError(f"unknown --saver {saver!r}; choose one of {', '.join(SAVERS)}")
    check_save_dir(save_dir)
    # the converted checkpoint carries copies of them: a missing one would be left out
    check_recorded_tokenizer_files(weights.args)
    if saver == "megatron":
        return save_megatron(weights, save_dir, target_tp, dtype, target_pp)
    if target_tp != 1 or target_pp != 1:
        raise ConfigError("--target-tensor-parallel-size and --target-pipeline-model-parallel-"
                          "size apply to --saver megatron; a Hugging Face folder always holds "
                          "the full model")
    return save_hf(weights, save_dir, dtype)


def check_save_dir(save_dir):
    """ConfigError unless `save_dir` is an empty folder or can be made as one: nothing is
    overwritten, and a path that cannot be written fails before a checkpoint is read."""
    if os.path.exists(save_dir) and (not os.path.isdir(save_dir) or os.listdir(save_dir)):
        raise ConfigError(f"--save-dir {save_dir} exists and is not an empty directory; choose "
                          "a new one so no checkpoint is overwritten")
    existing = os.path.abspath(save_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        why = "is a file" if not os.path.isdir(existing) else "is not writable"
        raise ConfigError(f"--save-dir {save_dir} cannot be made: {existing} {why}")


def _copy_tokenizer_files(args, save_dir):
    """Copy the tokenizer files that exist into save_dir; returns {arg key: new path}."""
    copied = {}
    for key in TOKENIZER_FILE_KEYS:
        path = args.get(key)
        if path and os.path.isfile(path):
            target = os.path.join(save_dir, os.path.basename(path))
            if os.path.abspath(target) != os.path.abspath(path):
                shutil.copyfile(path, target)
            copied[key] = os.path.abspath(target)
    return copied


def save_megatron(weights, save_dir, target_tp, dtype=torch.float32, target_pp=1):
    args = dict(weights.args)
    check_target_size(args, target_tp)
    check_target_stages(args, target_pp)
    divisible_by = args.get("make_vocab_size_divisible_by") or 128
    padded = vocab_size_with_padding(weights.vocab_size, divisible_by, target_tp)
    state = {name: tensor.to(dtype) for name, tensor in weights.state_dict.items()}
    state[WORD_EMBEDDINGS] = resize_vocab_rows(state[WORD_EMBEDDINGS], padded)
    os.makedirs(save_dir, exist_ok=True)
    args.update(_copy_tokenizer_files(args, save_dir))
    args.update(model_parallel_size=target_tp, padded_vocab_size=padded,
                make_vocab_size_divisible_by=divisible_by,
                orig_vocab_size=weights.vocab_size)
    args.setdefault("seq_length", args["max_position_embeddings"])
    # An unknown value is left out: check_checkpoint_args only compares recorded keys.
    args = {key: value for key, value in args.items() if value is not None}
    split = {name: split_full(tensor, parameter_layout(name).split, target_tp)
             for name, tensor in state.items()}
    shards = [{"iteration": 0, "checkpoint_version": CHECKPOINT_VERSION, "args": dict(args),
               "model": to_nested_state_dict({name: parts[rank]
                                              for name, parts in split.items()})}
              for rank in range(target_tp)]
    return write_sharded_checkpoint(save_dir, 0, True, shards, target_pp)


def save_hf(weights, save_dir, dtype=torch.float32):
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("--saver hf needs the safetensors package: "
                          "EXTRAS=convert bash scripts/setup.sh") from None
    args = weights.args
    hf_state = megatron_to_hf_state_dict(weights.state_dict, args["num_layers"],
                                         args["num_attention_heads"])
    hf_state = {k: v.to(dtype).contiguous() for k, v in hf_state.items()}
    os.makedirs(save_dir, exist_ok=True)
    written = []
    eod = None
    for key, name in HF_TOKENIZER_FILES.get(args.get("tokenizer_type"), {}).items():
        path = args.get(key)
        if path and os.path.isfile(path):
            shutil.copyfile(path, os.path.join(save_dir, name))
            written.append(os.path.join(save_dir, name))
    if args.get("tokenizer_type") == "GPT2BPETokenizer":
        eod = _eod_id(os.path.join(save_dir, "vocab.json"))
    elif written:  # SentencePiece: its eod, as the trainer's tokenizer finds it
        eod = SentencePieceTokenizer(written[0]).eod
    weights_path = os.path.join(save_dir, "model.safetensors")
    save_file(hf_state, weights_path + ".tmp", metadata={"format": "pt"})
    permissions_as_new_file(weights_path + ".tmp")  # safetensors creates it 0600
    os.replace(weights_path + ".tmp", weights_path)
    config = hf_config_from_model_args(args, eod)
    config["torch_dtype"] = str(dtype).replace("torch.", "")
    config_path = os.path.join(save_dir, "config.json")
    atomic_write_text(config_path, json.dumps(config, indent=2) + "\n")
    return [config_path, weights_path] + written


def _eod_id(vocab_path):
    if not os.path.isfile(vocab_path):
        return None
    try:
        with open(vocab_path, encoding="utf-8") as f:
            return json.load(f).get("<|endoftext|>")
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {vocab_path}: {error}") from None
