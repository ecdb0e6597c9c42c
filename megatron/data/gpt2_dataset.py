"""GPT-2 training samples: fixed windows of seq_length+1 tokens over a shuffled document stream."""

import math
import os

import numpy as np
import torch

from megatron.data.blend import MARGIN, BlendedDataset, cached_choices
from megatron.data.data_path import parse_data_path
from megatron.data.index_maps import (build_index_mappings, index_map_paths,
                                      sample_counts_spanning)
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.rank_zero import log_rank_zero
from megatron.data.splits import split_document_ranges
from megatron.errors import DataError

SPLIT_NAMES = ("train", "valid", "test")


class GPT2Dataset(torch.utils.data.Dataset):
    """Sample i is `{"text": int64 [seq_length + 1]}`; consecutive samples overlap by one token."""

    def __init__(self, name, data_prefix, documents, indexed_dataset, num_samples, seq_length,
                 seed, group=None):
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        assert 0 <= documents.min() and documents.max() < len(indexed_dataset)
        self.doc_idx, self.sample_idx, self.shuffle_idx = build_index_mappings(
            name, data_prefix, documents, indexed_dataset.sizes, num_samples, seq_length, seed,
            group)
        self.num_epochs = len(self.doc_idx) // len(documents)  # the documents' repeats
        self.map_paths = list(index_map_paths(data_prefix, name, num_samples, seq_length,
                                              seed).values())
        self._tokens_per_epoch = int(np.sum(indexed_dataset.sizes[documents], dtype=np.int64))

    def sample_counts_spanning(self, num_epochs):
        """(fewest, most) sample counts whose order of samples is this split's order over
        `num_epochs` epochs."""
        return sample_counts_spanning(num_epochs, self._tokens_per_epoch, self.seq_length)

    def __len__(self):
        # All samples of the epochs the maps cover; at least the number asked for.
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx):
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.name} sample {idx} out of range (length {len(self)})")
        idx = int(self.shuffle_idx[idx])
        first_row, first_offset = (int(v) for v in self.sample_idx[idx])
        last_row, last_offset = (int(v) for v in self.sample_idx[idx + 1])
        get = self.indexed_dataset.get
        if first_row == last_row:
            pieces = [get(self.doc_idx[first_row], offset=first_offset,
                          length=last_offset - first_offset + 1)]
        else:
            pieces = [get(self.doc_idx[first_row], offset=first_offset)]
            pieces += [get(self.doc_idx[row]) for row in range(first_row + 1, last_row)]
            pieces.append(get(self.doc_idx[last_row], length=last_offset + 1))
        tokens = np.concatenate(pieces).astype(np.int64)  # [seq_length + 1]
        if len(tokens) != self.seq_length + 1:
            raise DataError(f"{self.name} sample {idx} has {len(tokens)} tokens instead of "
                            f"{self.seq_length + 1}: the cached index maps do not match "
                            f"{self.indexed_dataset.prefix}; delete its *_indexmap_*.npy files")
        return {"text": tokens}


def _open(data_prefix, skip_warmup):
    indexed_dataset = MMapIndexedDataset(data_prefix, skip_warmup=skip_warmup)
    if len(indexed_dataset) == 0:
        raise DataError(f"{data_prefix}.bin/.idx hold no documents: the input they were made "
                        "from had none that tokenized (see tools/preprocess_data.py's report)")
    return indexed_dataset


def _split_documents(data_prefix, splits_string, skip_warmup):
    indexed_dataset = _open(data_prefix, skip_warmup)
    bounds = split_document_ranges(splits_string, len(indexed_dataset))
    log_rank_zero(f" > {data_prefix}: {len(indexed_dataset)} documents; split "
                  + ", ".join(f"{name} [{bounds[k]}, {bounds[k + 1]})"
                              for k, name in enumerate(SPLIT_NAMES)))
    return indexed_dataset, bounds


def _check_num_samples(train_valid_test_num_samples):
    if len(train_valid_test_num_samples) != 3:
        raise ValueError("train_valid_test_num_samples needs 3 entries (train, valid, test)")
    for n in train_valid_test_num_samples:
        if int(n) < 0:
            raise ValueError(f"number of samples must be >= 0, got {n}")


def build_train_valid_test_datasets(data_path, splits_string, train_valid_test_num_samples,
                                    seq_length, seed, skip_warmup=True, group=None,
                                    split_data_paths=None):
    """(train, valid, test) datasets of `data_path` (one prefix, or --data-path's values: a
    blend, megatron/data/blend.py) cut by `splits_string`: GPT2Datasets, or BlendedDatasets of
    them; None for a split with no documents or 0 samples. With `split_data_paths` (the
    values of --train-data-path, --valid-data-path, --test-data-path; None: no such split)
    each split reads every document of its own datasets instead, and `data_path` and
    `splits_string` are not used.

    group: the process group whose ranks all call this (default: every rank).  Its rank 0
    builds missing index maps while the others wait.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    _check_num_samples(train_valid_test_num_samples)
    if split_data_paths is None:
        blend = parse_data_path(data_path)
        sources = [(blend, [_split_documents(prefix, splits_string, skip_warmup)
                            for prefix in blend.prefixes])] * 3
    else:
        sources = [None if values is None else _whole_datasets(values, k, skip_warmup)
                   for k, values in enumerate(split_data_paths)]
    return tuple(None if sources[k] is None else
                 _dataset_of_split(name, *sources[k], k, int(train_valid_test_num_samples[k]),
                                   seq_length, seed, group)
                 for k, name in enumerate(SPLIT_NAMES))


def _whole_datasets(values, k, skip_warmup):
    """(blend, [(indexed dataset, bounds)]) of one split's own data path: split k of each
    dataset is all of its documents."""
    blend, cut = parse_data_path(values), []
    for prefix in blend.prefixes:
        indexed_dataset = _open(prefix, skip_warmup)
        log_rank_zero(f" > {prefix}: {len(indexed_dataset)} documents, all {SPLIT_NAMES[k]}")
        cut.append((indexed_dataset, [0] * (k + 1) + [len(indexed_dataset)] * (3 - k)))
    return blend, cut


def _dataset_of_split(name, blend, cut, k, num_samples, seq_length, seed, group):
    present = [i for i, (_, bounds) in enumerate(cut) if bounds[k + 1] > bounds[k]]
    if not present or num_samples == 0:
        return None
    if len(blend.prefixes) == 1:
        return _split_dataset(name, blend.prefixes[0], *cut[0], k, num_samples, seq_length,
                              seed, group)
    return _blended_split(name, blend, cut, present, k, num_samples, seq_length, seed, group)


def _split_dataset(name, data_prefix, indexed_dataset, bounds, k, num_samples, seq_length,
                   seed, group):
    documents = np.arange(bounds[k], bounds[k + 1], dtype=np.int32)
    return GPT2Dataset(name, data_prefix, documents, indexed_dataset, num_samples, seq_length,
                       seed, group)


def _blended_split(name, blend, cut, present, k, num_samples, seq_length, seed, group):
    """Split k of every dataset that has documents in it, blended by their weights (or their
    tokens in it), renormalized over those datasets."""
    if blend.weights is None:
        tokens = {i: int(np.sum(cut[i][0].sizes[cut[i][1][k]:cut[i][1][k + 1]],
                                dtype=np.int64)) for i in present}
        present = [i for i in present if tokens[i]] or present[:1]  # (none: its error)
        shares = [tokens[i] or 1 for i in present]
    else:
        shares = [blend.weights[i] for i in present]
    shares = [share / sum(shares) for share in shares]
    prefixes = [blend.prefixes[i] for i in present]
    choices, within, paths = cached_choices(name, prefixes, shares, num_samples, group)
    counts = np.bincount(choices, minlength=len(present))
    datasets = [_split_dataset(name, prefixes[j], *cut[i], k,
                               max(math.ceil(num_samples * shares[j] * MARGIN), int(counts[j])),
                               seq_length, seed, group) for j, i in enumerate(present)]
    log_rank_zero(f" > {name} blend: " + ", ".join(
        f"{prefix} {share:.1%} ({int(count)} samples)"
        for prefix, share, count in zip(prefixes, shares, counts)))
    return BlendedDataset(name, datasets, choices, within, paths)


def require_training_documents(train, data_path, splits_string):
    """DataError when the train split (`train`, from build_train_valid_test_datasets) is
    empty."""
    if train is None:
        shown = data_path if isinstance(data_path, str) else " ".join(data_path)
        raise DataError(f"--split {splits_string!r} leaves no training documents in "
                        f"{shown}; give the first split a positive weight")


def indexed_datasets(dataset):
    """The MMapIndexedDatasets a split's dataset reads (several for a blend)."""
    if isinstance(dataset, BlendedDataset):
        return [d.indexed_dataset for d in dataset.datasets]
    return [dataset.indexed_dataset]


def build_index_mappings_only(data_path, splits_string, train_valid_test_num_samples,
                              seq_length, seed, split_data_paths=None):
    """Pre-build (or validate) the cached index maps of every split (and a blend's choices),
    e.g. from a login node before a job starts, so no GPU waits on rank 0.  Returns the .npy
    paths.
    """
    datasets = build_train_valid_test_datasets(data_path, splits_string,
                                               train_valid_test_num_samples, seq_length, seed,
                                               split_data_paths=split_data_paths)
    require_training_documents(datasets[0], data_path, splits_string)
    paths = [path for dataset in datasets if dataset is not None
             for path in dataset.map_paths]
    assert all(os.path.exists(p) for p in paths)
    return paths
