"""Change the tensor-parallel (TP) and pipeline (PP) sizes of a checkpoint through a full,
unsharded form.

    TP=N x PP=P files --join stages--> TP=N shards --merge--> FullCheckpoint --re-pad vocab-->
        --split--> TP=M shards --split stages--> TP=M x PP=Q files

(the stages: megatron/convert/pipeline_layout.py).
Everything sharded is converted: model weights, Adam moments and fp32 master weights, so
training resumes at the new size with the loss it would have had at the old one.  The word
embeddings are padded to a multiple of make_vocab_size_divisible_by * TP; the real rows are
kept, the padding is cut or zero-extended to the target's multiple (`resize_vocab_rows`).
Padding rows are part of the output softmax, so the loss is only unchanged when the padded
size is the same at both TP sizes; new zero rows (logit 0) add mass to its denominator.

RNG states: python/numpy/torch/cuda generators are the same on every TP rank by design, so
every target rank gets rank 0's.  The tracker's per-rank dropout stream ("model-parallel-rng",
used for attention dropout) continues from source rank r on target rank r; ranks that did not
exist get a fresh stream seeded as `mpu.model_parallel_cuda_manual_seed` seeds that rank.
"""

import os
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch

from megatron.checkpointing.state_dicts import to_flat_state_dict, to_nested_state_dict
from megatron.convert.checkpoint_files import read_sharded_checkpoint, write_sharded_checkpoint
from megatron.convert.deferred import Deferred
from megatron.convert.optimizer_state import (FullOptimizerState, map_optimizer_tensors,
                                              merge_optimizer_states, optimizer_state_of)
from megatron.convert.tp_layout import (WORD_EMBEDDINGS, merge_shards, parameter_layout,
                                        resize_vocab_rows, shard_of)
from megatron.config.from_checkpoint import TOKENIZER_FILE_KEYS
from megatron.data.tokenization_record import tokenizer_identity
from megatron.errors import CheckpointError, ConfigError
from megatron.tokenizer import build_tokenizer, vocab_size_with_padding
from zero.activation_checkpointing.rng_tracker import (
    MODEL_PARALLEL_RNG_TRACKER_NAME, TENSOR_PARALLEL_SEED_OFFSET, RNGStatesTracker)

_TP_RNG_STREAM = MODEL_PARALLEL_RNG_TRACKER_NAME
_PER_RANK_KEYS = ("model", "optimizer", "rng_tracker_states")


@dataclass
class FullCheckpoint:
    """A checkpoint with every tensor whole, independent of the TP size it was saved at. The
    tensors are merged from the files' shards as they are read (megatron/convert/deferred.py),
    so a rank converting as it loads holds one full tensor at a time."""
    model: Deferred                   # flat keys -> tensor; word embeddings [padded vocab, h]
    vocab_size: int                   # real tokens: the leading rows of the word embeddings
    optimizer: Optional[FullOptimizerState]
    common: dict                      # iteration, args, lr_scheduler, train_state, RNG, ...
    rng_tracker_states: List[dict]    # per source TP rank (empty without saved RNG)

    @property
    def args(self):
        return self.common["args"]

    @property
    def padded_vocab_size(self):
        return self.args["padded_vocab_size"]


def merge_checkpoint(sharded, vocab_size):
    """FullCheckpoint from a ShardedCheckpoint; `vocab_size` = the tokenizer's, unpadded."""
    models = [to_flat_state_dict(shard["model"]) for shard in sharded.shards]
    for rank, model in enumerate(models[1:], start=1):
        if list(model) != list(models[0]):
            raise CheckpointError(f"mp_rank_{rank:02d} holds other parameters than mp_rank_00; "
                                  "the shards do not come from one model")
    splits = {name: parameter_layout(name).split for name in models[0]}
    full_model = Deferred(models[0], lambda name: merge_shards(
        name, [model[name] for model in models], splits[name]))
    optimizer = None
    with_optimizer = ["optimizer" in shard for shard in sharded.shards]
    if any(with_optimizer) and not all(with_optimizer):
        raise CheckpointError(f"mp_rank_{with_optimizer.index(False):02d} has no optimizer "
                              f"state but mp_rank_{with_optimizer.index(True):02d} has: the "
                              "shards come from different saves")
    if all(with_optimizer):
        optimizer = merge_optimizer_states([s["optimizer"] for s in sharded.shards], models)
    common = {k: v for k, v in sharded.shards[0].items() if k not in _PER_RANK_KEYS}
    rows = sum(model[WORD_EMBEDDINGS].shape[0] for model in models)
    args = common["args"]
    if rows < vocab_size or rows != args.get("padded_vocab_size", rows):
        raise CheckpointError(f"the word embeddings have {rows} rows, but the checkpoint's "
                              f"args say padded_vocab_size {args.get('padded_vocab_size')}"
                              f" and the vocab has {vocab_size} tokens")
    common["args"] = dict(args, padded_vocab_size=rows)
    trackers = [s["rng_tracker_states"] for s in sharded.shards if "rng_tracker_states" in s]
    return FullCheckpoint(full_model, vocab_size, optimizer, common, trackers)


def resize_vocab(full, padded_vocab_size):
    """Re-pad the word embeddings (weights, fp32 master, Adam moments) to a new size."""
    if padded_vocab_size < full.vocab_size:
        raise ValueError(f"padded vocab {padded_vocab_size} < vocab {full.vocab_size}")
    full.model.then(WORD_EMBEDDINGS, lambda t: resize_vocab_rows(t, padded_vocab_size))
    if full.optimizer is not None:
        map_optimizer_tensors(full.optimizer, WORD_EMBEDDINGS,
                              lambda t: resize_vocab_rows(t, padded_vocab_size))
    full.common["args"] = dict(full.args, padded_vocab_size=padded_vocab_size)


def checkpoint_of_rank(full, target_tp, rank, names=None):
    """The model_optim_rng.pt contents of rank `rank` of `target_tp`: its own shards only, each
    full tensor merged when it is cut and dropped before the next (a rank converting as it
    loads, and the tool writing one target rank's file at a time). `names`: the parameters
    to cut (default: every one); the others' weights are None, and they have no optimizer
    state and a None master (a rank that keeps one pipeline stage of them,
    megatron/convert/online.py)."""
    wanted = set(full.model if names is None else names)
    model = {}
    for name in full.model:  # names, not items(): those not wanted are never merged
        if name not in wanted:
            model[name] = None
            continue
        tensor = full.model[name]
        model[name] = shard_of(tensor, parameter_layout(name).split, target_tp, rank)
        del tensor  # before the next name's is merged
    shard = dict(full.common, args=dict(full.args, model_parallel_size=target_tp))
    shard["model"] = to_nested_state_dict(model)
    if full.optimizer is not None:
        shard["optimizer"] = optimizer_state_of(full.optimizer, target_tp, rank, wanted)
    if full.rng_tracker_states:
        shard["rng_tracker_states"] = _tracker_states_for_rank(full, rank)
    return shard


def _tracker_states_for_rank(full, rank):
    if rank < len(full.rng_tracker_states):
        return full.rng_tracker_states[rank]
    base = full.rng_tracker_states[0]
    if "cuda" in base.get(_TP_RNG_STREAM, {}) and torch.cuda.is_available():
        # saved on a GPU: the new rank's stream needs a CUDA state, and the tracker seeds one
        # only once CUDA is in use (a checkpoint saved on the CPU opens no CUDA context)
        torch.cuda.init()
    derived = RNGStatesTracker()
    derived.add(_TP_RNG_STREAM, full.args.get("seed", 1234) + TENSOR_PARALLEL_SEED_OFFSET + rank)
    states = {name: dict(per_device) for name, per_device in base.items()}
    fresh = derived.get_states()[_TP_RNG_STREAM]
    # A CUDA stream cannot be seeded on a machine without CUDA: keep rank 0's there.
    states[_TP_RNG_STREAM] = {device: fresh.get(device, state)
                              for device, state in base.get(_TP_RNG_STREAM, fresh).items()}
    return states


# ------------------------------------------------------------------------- vocab size

def resolve_vocab_size(args, vocab_size=None, tokenizer_files=None):
    """The unpadded vocab size: given, or from the tokenizer the checkpoint was trained with.

    `tokenizer_files` ({"vocab_file", "merge_file", "tokenizer_model"}) override the paths
    recorded in the checkpoint's args.  The result must pad to the checkpoint's vocab rows.
    """
    tokenizer_files = {key: path for key, path in (tokenizer_files or {}).items() if path}
    recorded = args.get("orig_vocab_size")  # by the trainer since it existed
    # The trainer records its tokenizer's size; a Hugging Face conversion without tokenizer
    # files records only the embedding's rows, which may include padding (e.g. 50304).
    trained_with = recorded if args.get("tokenizer_type") else None
    if vocab_size is not None and trained_with and vocab_size != trained_with:
        raise CheckpointError(f"--vocab-size {vocab_size} disagrees with the vocab size the "
                              f"checkpoint records ({trained_with}); drop --vocab-size")
    if vocab_size is None and tokenizer_files:
        tokenizer = tokenizer_of(args, tokenizer_files)
        vocab_size = tokenizer.vocab_size
        if trained_with and vocab_size != trained_with:
            # a different tokenizer of a size that pads alike would decode every id wrongly
            raise CheckpointError(
                f"the tokenizer files given ({_describe(tokenizer_files)}) hold {vocab_size} "
                f"tokens, but the checkpoint was trained with a tokenizer of {trained_with}; "
                "give the tokenizer files the model was trained with")
        check_trained_tokenizer(args, tokenizer, _describe(tokenizer_files))
    if vocab_size is None:
        vocab_size = recorded or tokenizer_vocab_size(args, {})
    divisible_by = args.get("make_vocab_size_divisible_by", 128)
    source_tp = args.get("model_parallel_size", 1)
    padded = vocab_size_with_padding(vocab_size, divisible_by, source_tp)
    if padded != args.get("padded_vocab_size", padded):
        raise CheckpointError(
            f"vocab size {vocab_size} pads to {padded} (multiple of {divisible_by} x "
            f"{source_tp}), but the checkpoint's vocab is padded to "
            f"{args['padded_vocab_size']}: give the tokenizer files the model was trained "
            "with (or, where the tool has it, its size with --vocab-size)")
    return vocab_size


def _describe(tokenizer_files):
    return ", ".join(str(path) for path in tokenizer_files.values() if path)


def check_recorded_tokenizer_files(args):
    """ConfigError naming the tokenizer files checkpoint `args` record that are not found
    here (a relative path recorded where training ran, or a folder since moved)."""
    missing = [f"--{key.replace('_', '-')} {args[key]}" for key in TOKENIZER_FILE_KEYS
               if args.get(key) and not os.path.isfile(args[key])]
    if missing:
        raise ConfigError(f"the checkpoint records {', '.join(missing)}, which is not found from "
                          f"{os.getcwd()} (a path relative to where training ran?); give the "
                          "tokenizer files on the command line (--vocab-file and --merge-file, "
                          "or --tokenizer-model)")


def check_trained_tokenizer(args, tokenizer, files):
    """CheckpointError when `tokenizer` (built from `files`) splits text differently from the
    tokenizer the checkpoint `args` record (their probe hash): another vocabulary of the same
    size, or files rewritten in place, would decode every id as other text."""
    recorded = args.get("tokenizer_probe_sha1") if args.get("tokenizer_type") else None
    probe = tokenizer_identity(tokenizer)["probe_sha1"] if recorded else None
    if probe is not None and probe != recorded:
        raise CheckpointError(
            f"the tokenizer files {files} split text differently from the tokenizer the "
            f"checkpoint was trained with (probe hash {probe[:8]}, the checkpoint's "
            f"{recorded[:8]}), though both hold {tokenizer.vocab_size} tokens: every id would "
            "stand for other text. Give the tokenizer files the model was trained with")


def tokenizer_vocab_size(args, overrides):
    """The vocab size of the tokenizer `args` names (`overrides` replace its file paths)."""
    return tokenizer_of(args, overrides).vocab_size


def tokenizer_of(args, overrides):
    """The tokenizer `args` names (`overrides` replace its file paths)."""
    tokenizer_type = args.get("tokenizer_type")
    flags = {"vocab_file": "--vocab-file", "merge_file": "--merge-file",
             "tokenizer_model": "--tokenizer-model"}
    needed = ("tokenizer_model",) if tokenizer_type == "SentencePieceTokenizer" else \
        ("vocab_file", "merge_file")
    paths = {key: overrides.get(key) or args.get(key) for key in flags}
    missing = [f"{flags[key]} {paths[key]}" for key in needed
               if not paths[key] or not os.path.isfile(paths[key])]
    if missing:
        raise CheckpointError(
            "removing the vocab padding needs the tokenizer's vocab size, but the tokenizer "
            f"files ({', '.join(missing)}) are not found from {os.getcwd()}; give the "
            "tokenizer files with " + " ".join(flags[key] for key in needed) +
            " (or, where the tool has it, the unpadded size with --vocab-size N)")
    return build_tokenizer(tokenizer_type, paths["vocab_file"], paths["merge_file"],
                           paths["tokenizer_model"])


# ------------------------------------------------------------------------- entry points

def load_unsharded_checkpoint(load_dir, iteration=None, vocab_size=None, tokenizer_files=None):
    """Read all TP shards of a checkpoint and return its FullCheckpoint."""
    sharded = read_sharded_checkpoint(load_dir, iteration)
    vocab_size = resolve_vocab_size(sharded.args, vocab_size, tokenizer_files)
    return merge_checkpoint(sharded, vocab_size)


def unsharded_state_dict(load_dir, iteration=None, vocab_size=None, tokenizer_files=None):
    """The full model state dict (flat Megatron keys), word embeddings cut to [vocab, h].

    The canonical TP-free intermediate that other formats (e.g. Hugging Face) convert from.
    """
    full = load_unsharded_checkpoint(load_dir, iteration, vocab_size, tokenizer_files)
    resize_vocab(full, full.vocab_size)
    return dict(full.model)


def check_target_size(args, target_tp):
    """ConfigError, with the arithmetic, if the model cannot be split `target_tp` ways."""
    if target_tp < 1:
        raise ConfigError(f"the target tensor-parallel size must be >= 1, got {target_tp}")
    heads = args["num_attention_heads"]
    ffn = args.get("ffn_hidden_size") or 4 * args["hidden_size"]
    for value, name in ((heads, "num_attention_heads"), (ffn, "ffn_hidden_size")):
        if value % target_tp != 0:
            raise ConfigError(f"the target tensor-parallel size {target_tp} must divide the "
                              f"checkpoint's {name} {value} ({value} % {target_tp} = "
                              f"{value % target_tp})")


def check_target_stages(args, target_pp):
    """ConfigError unless every one of `target_pp` pipeline stages gets a layer."""
    if target_pp < 1 or target_pp > args["num_layers"]:
        raise ConfigError(f"--target-pipeline-model-parallel-size {target_pp} must be between 1 "
                          f"and the checkpoint's num_layers {args['num_layers']}")


class ReshardResult(NamedTuple):
    iteration: int
    release: bool
    source_tp: int
    target_tp: int
    source_pp: int
    target_pp: int
    vocab_size: int
    source_padded_vocab_size: int
    target_padded_vocab_size: int
    optimizer_converted: bool
    paths: List[str]
    saved_by: Optional[str]  # the trainer that saved a foreign checkpoint (None: this one)
    schedule_converted: bool


def reshard_checkpoint(load_dir, save_dir, target_tp, iteration=None, vocab_size=None,
                       tokenizer_files=None, source_tp=None, reader=read_sharded_checkpoint,
                       target_pp=1):
    """Convert `load_dir` (at its saved TP and pipeline sizes) to a TP=`target_tp`, PP=
    `target_pp` checkpoint in `save_dir`.

    `source_tp`, when given, must be the TP size the checkpoint was saved at. `reader(load_dir,
    iteration)` -> ShardedCheckpoint (deepspeed_source.read_deepspeed_checkpoint for --deepspeed).
    """
    if os.path.abspath(save_dir) == os.path.abspath(load_dir):
        raise ConfigError("--save must differ from --load: the converted checkpoint would mix "
                          "two tensor-parallel sizes in one directory")
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ConfigError(f"--save {save_dir} exists and is not a directory")
    sharded = reader(load_dir, iteration)
    if source_tp is not None and source_tp != sharded.model_parallel_size:
        raise ConfigError(f"--model-parallel-size {source_tp} (the source size) disagrees with "
                          f"the checkpoint, which was saved with model_parallel_size "
                          f"{sharded.model_parallel_size}; drop the flag, it is read from "
                          "the checkpoint")
    check_target_size(sharded.args, target_tp)
    check_target_stages(sharded.args, target_pp)
    full, source_padded = resharded(sharded, target_tp, vocab_size, tokenizer_files)
    # each rank's shards are cut when its file is written (each full tensor merged once per
    # target rank), so the tool holds one rank's part of the checkpoint, not all of them
    shards = (checkpoint_of_rank(full, target_tp, rank) for rank in range(target_tp))
    paths = write_sharded_checkpoint(save_dir, sharded.iteration, sharded.release, shards,
                                     target_pp)
    return ReshardResult(sharded.iteration, sharded.release, sharded.model_parallel_size,
                         target_tp, sharded.pipeline_model_parallel_size, target_pp,
                         full.vocab_size, source_padded, full.padded_vocab_size,
                         full.optimizer is not None, paths, full.common.get("saved_by"),
                         "lr_scheduler" in full.common)


def resharded(sharded, target_tp, vocab_size=None, tokenizer_files=None):
    """(FullCheckpoint with the vocab padded for `target_tp`, the source's padded vocab) of a
    ShardedCheckpoint."""
    vocab_size = resolve_vocab_size(sharded.args, vocab_size, tokenizer_files)
    full = merge_checkpoint(sharded, vocab_size)
    source_padded = full.padded_vocab_size
    divisible_by = full.args.get("make_vocab_size_divisible_by", 128)
    resize_vocab(full, vocab_size_with_padding(vocab_size, divisible_by, target_tp))
    return full, source_padded
