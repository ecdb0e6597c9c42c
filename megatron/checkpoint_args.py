"""Take the model's shape and tokenizer from the checkpoint that `--load` names.

A checkpoint records the arguments it was trained with (a converted one records the model's
shape, vocab and tokenizer files), so

    python pretrain_gpt2.py --load checkpoints/converted --save out --data-path ... \
        --batch-size 8 --train-iters 100 --lr 1e-4

needs no model flags.  Every key of `FROM_CHECKPOINT` the user did not give on the command
line is filled from the checkpoint, with one note listing them; a flag the user did give
keeps its value, and `check_checkpoint_args` rejects it later when it disagrees with the
checkpoint.  "Given" is decided by parsing the command line a second time with every
default replaced by argparse.SUPPRESS, so a flag given with its default value
(`--layernorm-epsilon 1e-5`) still counts as given.
"""

import argparse
import copy
import os

import torch

from megatron.checkpointing.megatron_layout import get_checkpoint_name, read_tracker
from megatron.errors import CheckpointError

# Shape, vocab and tokenizer: what the model needs to be rebuilt as it was saved.
FROM_CHECKPOINT = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                   "max_position_embeddings", "make_vocab_size_divisible_by",
                   "layernorm_epsilon", "seq_length", "tokenizer_type", "vocab_file",
                   "merge_file", "tokenizer_model")
# --model-size fills these itself; given, it counts as giving them.
_NAMED_SIZE_KEYS = ("num_layers", "hidden_size", "num_attention_heads")
_TOKENIZER_FILE_KEYS = ("vocab_file", "merge_file", "tokenizer_model")


def given_on_command_line(parser, argv):
    """Destinations of the flags present in `argv` (whatever their value)."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:  # argparse has no public way to reach every action
        action.default = argparse.SUPPRESS
    namespace, _ = probe.parse_known_args(argv)
    return set(vars(namespace))


def saved_args_of(load_dir, deepspeed=False):
    """The `args` dict recorded in the checkpoint at `load_dir`; None when there is none."""
    if not load_dir or not os.path.isdir(load_dir):
        return None
    path = _deepspeed_states_path(load_dir) if deepspeed else _megatron_path(load_dir)
    if path is None or not os.path.isfile(path):
        return None  # a missing file is reported by load_checkpoint with its full context
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 -- load_checkpoint reports a damaged file properly
        return None
    saved = state.get("args") if isinstance(state, dict) else None
    return saved if isinstance(saved, dict) else None


def _megatron_path(load_dir):
    iteration, release = read_tracker(load_dir)
    if iteration is None:
        return None
    return get_checkpoint_name(load_dir, iteration, mp_rank=0, release=release)


def _deepspeed_states_path(load_dir):
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        tag = f.read().strip()
    return os.path.join(load_dir, tag, "mp_rank_00_model_states.pt")


def fill_model_args_from_checkpoint(args, given, log=print):
    """Set each FROM_CHECKPOINT key of `args` not in `given` from the checkpoint at
    args.load; returns the keys whose value that changed."""
    saved = saved_args_of(getattr(args, "load", None), getattr(args, "deepspeed", False))
    if saved is None:
        return []
    skip = set(given)
    if "model_size" in given:
        skip.update(_NAMED_SIZE_KEYS)
    if given & {"tokenizer_type", *_TOKENIZER_FILE_KEYS}:
        # A tokenizer named on the command line replaces the recorded one as a whole.
        skip.update(("tokenizer_type", *_TOKENIZER_FILE_KEYS))
    filled = []
    for key in FROM_CHECKPOINT:
        value = saved.get(key)
        if key in skip or value is None:
            continue
        if key in _TOKENIZER_FILE_KEYS and not os.path.isfile(value):
            raise CheckpointError(
                f"checkpoint {args.load} records --{key.replace('_', '-')} {value}, which does "
                "not exist here; give the tokenizer files on the command line")
        if getattr(args, key, None) != value:  # a resume with full flags stays quiet
            setattr(args, key, value)
            filled.append(key)
    if filled and _is_first_process():
        log(" taking from checkpoint " + args.load + ": " + ", ".join(
            f"--{key.replace('_', '-')} {getattr(args, key)}" for key in filled), flush=True)
    return filled


def _is_first_process():
    return int(os.environ.get("RANK", "0")) == 0
