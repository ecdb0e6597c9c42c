"""How every GPT-2 parameter is split across tensor-parallel ranks, as plain data.

`GPT2_PARAMETER_LAYOUT` is the key map that checkpoint conversions go through: for each
flat state-dict key pattern, how the tensor-parallel layers shard it and whether the trainer's
optimizer puts it in the weight-decay group (megatron/training/param_groups.py).  A test
checks both columns against the tags and groups of a real model, so they cannot drift.

Splits (Megatron stores linear weights as A^T, [out, in]):
  column      dim 0, output features.  query_key_value rows are ordered per head
              [np, 3, hn], so TP shards concatenated along dim 0 already give the full tensor
              in head order: no interleaving (stride 1) is needed in either direction.
  row         dim 1, input features.
  vocab       dim 0, the rows of the padded vocabulary; padding depends on the TP size.
  replicated  every rank holds the whole tensor.
"""

import re
from typing import NamedTuple

import torch

from megatron.errors import CheckpointError

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
SPLIT_DIM = {COLUMN: 0, VOCAB: 0, ROW: 1}

WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
_LAYER = r"language_model\.transformer\.layers\.\d+\."

# (flat state-dict key pattern, tensor-parallel split, in the weight-decay group)
GPT2_PARAMETER_LAYOUT = (
    (re.escape(WORD_EMBEDDINGS), VOCAB, True),
    (r"language_model\.embedding\.position_embeddings\.weight", REPLICATED, True),
    (_LAYER + r"input_layernorm\.(weight|bias)", REPLICATED, False),
    (_LAYER + r"attention\.query_key_value\.weight", COLUMN, True),
    (_LAYER + r"attention\.query_key_value\.bias", COLUMN, False),
    (_LAYER + r"attention\.dense\.weight", ROW, True),
    (_LAYER + r"attention\.dense\.bias", REPLICATED, False),
    (_LAYER + r"post_attention_layernorm\.(weight|bias)", REPLICATED, False),
    (_LAYER + r"mlp\.dense_h_to_4h\.weight", COLUMN, True),
    (_LAYER + r"mlp\.dense_h_to_4h\.bias", COLUMN, False),
    (_LAYER + r"mlp\.dense_4h_to_h\.weight", ROW, True),
    (_LAYER + r"mlp\.dense_4h_to_h\.bias", REPLICATED, False),
    (r"language_model\.transformer\.final_layernorm\.(weight|bias)", REPLICATED, False),
)


class ParameterLayout(NamedTuple):
    split: str
    weight_decay: bool


def parameter_layout(name):
    """The ParameterLayout of a flat state-dict key; CheckpointError for an unknown key."""
    for pattern, split, weight_decay in GPT2_PARAMETER_LAYOUT:
        if re.fullmatch(pattern, name):
            return ParameterLayout(split, weight_decay)
    raise CheckpointError(f"parameter {name!r} is not part of this trainer's GPT-2 model; "
                          "only checkpoints saved by pretrain_gpt2.py can be converted")


def merge_shards(name, shards, split, check_replicas=True):
    """The full tensor from its tensor-parallel shards (one per rank, in rank order).

    A replicated tensor is taken from rank 0; with check_replicas the others must agree. The
    one shard of a tensor-parallel size 1 is the full tensor itself (not a copy: it may be
    mapped from its file, which a copy would turn into memory of the process's own).
    """
    if split == REPLICATED:
        if check_replicas:
            _check_replicas_agree(name, shards)
        return shards[0]
    if len(shards) == 1:
        return shards[0]
    return torch.cat(shards, dim=SPLIT_DIM[split])


def split_full(full, split, num_partitions):
    """The shards of `full` for `num_partitions` ranks (see shard_of)."""
    return [shard_of(full, split, num_partitions, rank) for rank in range(num_partitions)]


def shard_of(full, split, num_partitions, rank):
    """Rank `rank`'s shard of `full` among `num_partitions`, its own storage (a replicated
    tensor, or the one shard of one, is `full` itself)."""
    if split == REPLICATED or num_partitions == 1:
        return full
    dim = SPLIT_DIM[split]
    if full.shape[dim] % num_partitions != 0:
        raise CheckpointError(f"a tensor of shape {tuple(full.shape)} cannot be split into "
                              f"{num_partitions} equal parts along dim {dim}")
    # clone: torch.save of a view would write the whole full tensor into every rank's file.
    return torch.chunk(full, num_partitions, dim=dim)[rank].clone()


def resize_vocab_rows(weight, padded_vocab_size):
    """`weight` [v_old, h] cut or zero-extended to [padded_vocab_size, h].

    Callers keep padded_vocab_size >= the real vocabulary, so only padding rows are cut.
    Padding rows that exist at both sizes keep their trained values: their logits take part
    in the softmax, so keeping them leaves the loss unchanged when the padded size is equal.
    """
    rows = weight.shape[0]
    if rows == padded_vocab_size:
        return weight
    if rows > padded_vocab_size:
        return weight[:padded_vocab_size].clone()
    extra = weight.new_zeros((padded_vocab_size - rows,) + tuple(weight.shape[1:]))
    return torch.cat([weight, extra], dim=0)


def _check_replicas_agree(name, shards):
    reference = shards[0]
    for rank, shard in enumerate(shards[1:], start=1):
        if shard.shape != reference.shape or not torch.allclose(
                shard.float(), reference.float(), rtol=1e-4, atol=1e-6):
            raise CheckpointError(
                f"{name} should be the same on every tensor-parallel rank, but mp_rank_00 and "
                f"mp_rank_{rank:02d} differ; the shards do not come from one training run")
