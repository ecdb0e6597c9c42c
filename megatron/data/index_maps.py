"""GPT-2 index maps: which tokens make up sample i, built in vectorized numpy and cached.

Think of the training stream as the documents of `doc_idx` (every document of the split
repeated num_epochs times, shuffled) laid end to end.  Sample i is the seq_length+1 tokens at
stream positions [i*seq_length, i*seq_length + seq_length], so consecutive samples share one
token and documents flow across sample boundaries with no padding.

    doc_idx      int32 [num_epochs * num_docs]   document ids in stream order
    sample_idx   int32 [num_samples + 1, 2]      (index into doc_idx, token offset) of the
                                                 first token of each sample (row i+1 = its last)
    shuffle_idx  uint32 [num_samples]            the order samples are served in

These equal what Megatron-LM 1.1.5's `_build_index_mappings` (with its C++ `build_sample_idx`)
produces for the same seed, and use its cache file names.
"""

import os
import time

import numpy as np

from megatron.data.rank_zero import build_on_rank_zero, log_rank_zero
from megatron.errors import DataError

MAP_KINDS = ("doc_idx", "sample_idx", "shuffle_idx")
_CHUNK_SAMPLES = 1 << 20  # rows of sample_idx computed at a time, to bound temporary memory


def index_map_paths(data_prefix, name, num_samples, seq_length, seed):
    base = f"{data_prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s"
    return {kind: f"{base}_{kind}.npy" for kind in MAP_KINDS}


def num_epochs_needed(tokens_per_epoch, seq_length, num_samples):
    """Smallest E with (E * tokens_per_epoch - 1) // seq_length >= num_samples."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def sample_counts_spanning(num_epochs, tokens_per_epoch, seq_length):
    """(fewest, most) sample counts whose maps span exactly `num_epochs` epochs: the counts
    served in the same order (the shuffle depends on the epoch count, not on the count)."""
    most = (num_epochs * tokens_per_epoch - 1) // seq_length
    fewest = 1 if num_epochs == 1 else ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length + 1
    return fewest, most


def build_doc_idx(documents, num_epochs, rng):
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(doc_idx)  # all epochs shuffled together, as Megatron 1.1.5 does
    return doc_idx


def build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_lengths = np.asarray(sizes)[doc_idx].astype(np.int64)  # [len(doc_idx)]
    doc_ends = np.cumsum(doc_lengths)                            # exclusive end in the stream
    fits_int32 = max(len(doc_idx), int(doc_lengths.max(initial=0))) < np.iinfo(np.int32).max
    sample_idx = np.empty((num_samples + 1, 2), dtype=np.int32 if fits_int32 else np.int64)
    for first in range(0, num_samples + 1, _CHUNK_SAMPLES):
        positions = np.arange(first, min(first + _CHUNK_SAMPLES, num_samples + 1),
                              dtype=np.int64) * seq_length          # [chunk] first token
        rows = np.searchsorted(doc_ends, positions, side="right")  # doc holding that token
        sample_idx[first:first + len(positions), 0] = rows
        sample_idx[first:first + len(positions), 1] = positions - (doc_ends[rows] -
                                                                   doc_lengths[rows])
    sample_idx[0] = (0, 0)  # Megatron's first row, even when doc_idx begins with empty docs
    return sample_idx


def build_shuffle_idx(size, rng):
    dtype = np.uint32 if size < np.iinfo(np.uint32).max - 1 else np.int64
    shuffle_idx = np.arange(size, dtype=dtype)
    rng.shuffle(shuffle_idx)
    return shuffle_idx


def compute_index_maps(documents, sizes, num_samples, seq_length, seed):
    """(doc_idx, sample_idx, shuffle_idx) for one split; the RNG order matches Megatron's."""
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[documents], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, num_epochs, rng)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    shuffle_idx = build_shuffle_idx(sample_idx.shape[0] - 1, rng)
    return doc_idx, sample_idx, shuffle_idx


def _expected_shapes(documents, sizes, num_samples, seq_length):
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[documents], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    rows = (num_epochs * tokens_per_epoch - 1) // seq_length + 1
    return {"doc_idx": (num_epochs * len(documents),), "sample_idx": (rows, 2),
            "shuffle_idx": (rows - 1,)}


def _cache_problem(paths, expected, data_index_path, documents):
    """Why the cached maps cannot be used (missing, stale, wrong shape, another split's
    documents), or None if they can. The file names (Megatron's) do not say which documents
    a split holds: maps cached under one --split have the shapes of another's often enough
    (a split repeated over epochs), so doc_idx's document range is checked too."""
    data_mtime = os.path.getmtime(data_index_path)
    for kind, path in paths.items():
        if not os.path.exists(path):
            return f"{path} does not exist"
        if os.path.getmtime(path) < data_mtime:
            return f"{path} is older than {data_index_path}"
        try:
            shape = np.load(path, mmap_mode="r").shape
        except (ValueError, OSError) as e:
            return f"{path} does not load ({e})"
        if shape != expected[kind]:
            return f"{path} has shape {shape}, expected {expected[kind]}"
    doc_idx = np.load(paths["doc_idx"], mmap_mode="r")
    if len(doc_idx) and (int(doc_idx.min()), int(doc_idx.max())) != (int(np.min(documents)),
                                                                      int(np.max(documents))):
        return (f"{paths['doc_idx']} holds documents {int(doc_idx.min())}..{int(doc_idx.max())}, "
                f"this split {int(np.min(documents))}..{int(np.max(documents))} (another --split)")
    return None


def save_atomic(path, array):
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise DataError(f"cannot write the index map {path}: {e}. The maps are cached next to "
                        f"the data; make that directory writable, or pre-build the maps once "
                        f"with tools/build_index_maps.py where it is") from None


def _not_older_than(path, reference):
    """Give `path` at least `reference`'s mtime, so a clock skew (or an .idx copied with a
    future mtime) does not make fresh maps look stale forever."""
    reference_ns = os.stat(reference).st_mtime_ns
    if os.stat(path).st_mtime_ns < reference_ns:
        os.utime(path, ns=(reference_ns, reference_ns))


def build_index_mappings(name, data_prefix, documents, sizes, num_samples, seq_length, seed,
                         group=None):
    """Load the cached maps for this split, building them first (on rank 0) if needed."""
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[documents], dtype=np.int64))
    if tokens_per_epoch == 0:
        raise DataError(f"{data_prefix}: the {name} split (documents {documents[0]}.."
                        f"{documents[-1]}) holds no tokens; the corpus was preprocessed empty or "
                        f"--split gives this split only empty documents")
    paths = index_map_paths(data_prefix, name, num_samples, seq_length, seed)
    expected = _expected_shapes(documents, sizes, num_samples, seq_length)
    data_index_path = data_prefix + ".idx"

    def build_if_needed():
        problem = _cache_problem(paths, expected, data_index_path, documents)
        if problem is None:
            return
        start = time.perf_counter()
        maps = compute_index_maps(documents, sizes, num_samples, seq_length, seed)
        for kind, array in zip(MAP_KINDS, maps):
            save_atomic(paths[kind], array)
            _not_older_than(paths[kind], data_index_path)
        log_rank_zero(f" > built {name} index maps ({problem}) in "
                      f"{time.perf_counter() - start:.2f} s: {expected['shuffle_idx'][0]} samples "
                      f"over {expected['doc_idx'][0] // len(documents)} epoch(s)")

    build_on_rank_zero(build_if_needed, group, what=f"the {name} index maps of {data_prefix}")
    problem = _cache_problem(paths, expected, data_index_path, documents)
    if problem is not None:
        raise DataError(f"index maps for the {name} split are unusable after building: "
                        f"{problem}. Is {os.path.dirname(os.path.abspath(data_prefix))} on a "
                        f"filesystem shared by all ranks?")
    return tuple(np.load(paths[kind], mmap_mode="r") for kind in MAP_KINDS)
