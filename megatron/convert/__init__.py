"""Checkpoint conversions through a full, unsharded intermediate.

`reshard_checkpoint` changes the tensor-parallel size of a Megatron-layout checkpoint
(tools/merge_mp_partitions.py); `unsharded_state_dict` returns the full model for converters
to other formats.  The key map (`GPT2_PARAMETER_LAYOUT`) is plain data in `tp_layout`.
"""

from megatron.convert.checkpoint_files import (ShardedCheckpoint, read_sharded_checkpoint,
                                               write_sharded_checkpoint)
from megatron.convert.reshard import (FullCheckpoint, ReshardResult, check_target_size,
                                      load_unsharded_checkpoint, merge_checkpoint,
                                      reshard_checkpoint, resize_vocab, resolve_vocab_size,
                                      unsharded_state_dict)
from megatron.convert.tp_layout import (COLUMN, GPT2_PARAMETER_LAYOUT, REPLICATED, ROW, VOCAB,
                                        WORD_EMBEDDINGS, merge_shards, parameter_layout,
                                        resize_vocab_rows, split_full)

__all__ = [
    "COLUMN", "GPT2_PARAMETER_LAYOUT", "REPLICATED", "ROW", "VOCAB", "WORD_EMBEDDINGS",
    "FullCheckpoint", "ReshardResult", "ShardedCheckpoint", "check_target_size",
    "load_unsharded_checkpoint", "merge_checkpoint", "merge_shards", "parameter_layout",
    "read_sharded_checkpoint", "reshard_checkpoint", "resize_vocab", "resize_vocab_rows",
    "resolve_vocab_size", "split_full", "unsharded_state_dict",
    "write_sharded_checkpoint",
]
