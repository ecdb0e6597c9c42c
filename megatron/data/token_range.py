"""The largest token id of a `.bin/.idx` dataset, checked against the model's vocabulary.

An id at or above the (padded) vocabulary size would otherwise surface as an IndexError deep in
the embedding, or as garbage on CUDA. Scanning a large corpus costs a pass over its `.bin`, so
the result is cached beside the index in `<prefix>.max_token_id` (keyed on the `.bin`'s size and
modification time; skipped silently when the folder is read-only).
"""

import json
import os

import numpy as np

from megatron.data.indexed_dataset import BUILD_HINT, data_file_path
from megatron.errors import DataError
from megatron.tokenizer.file_utils import atomic_write_bytes

_SCAN_BYTES = 1 << 26


def cache_path(prefix):
    return f"{prefix}.max_token_id"


def max_token_id(dataset):
    """The largest id in MMapIndexedDataset `dataset` (-1 when it holds no tokens)."""
    bin_path = data_file_path(dataset.prefix)
    stat = os.stat(bin_path)
    key = {"bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}
    cached = _read_cache(cache_path(dataset.prefix))
    if cached is not None and {k: cached.get(k) for k in key} == key:
        return int(cached["max_token_id"])
    largest = _scan(bin_path, dataset.dtype, stat.st_size)
    _write_cache(cache_path(dataset.prefix), {**key, "max_token_id": largest})
    return largest


def check_token_ids(dataset, vocab_size, tokenizer_vocab_size):
    """DataError unless every token id of `dataset` is below `vocab_size` (padded)."""
    largest = max_token_id(dataset)
    if largest >= vocab_size:
        raise DataError(
            f"{data_file_path(dataset.prefix)} holds token id {largest}, but the model's "
            f"vocabulary has {vocab_size} entries (the tokenizer's {tokenizer_vocab_size}, "
            f"padded): the dataset was built with another tokenizer. Pass that tokenizer's "
            f"files, or rebuild the dataset with this one ({BUILD_HINT})")


def _scan(bin_path, dtype, size):
    if size == 0:
        return -1
    tokens = np.memmap(bin_path, mode="r", dtype=dtype)
    step = max(1, _SCAN_BYTES // dtype.itemsize)
    return int(max(tokens[lo:lo + step].max() for lo in range(0, len(tokens), step)))


def _read_cache(path):
    try:
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def _write_cache(path, value):
    try:
        atomic_write_bytes(path, json.dumps(value).encode("utf-8"))
    except OSError:  # a read-only data folder: scan again next time
        pass
