"""LSH banding over MinHash signatures on disk, with memory flat in the number of documents.

datasketch's MinHashLSH keeps its buckets in Python dicts: about 5 KB per document (measured
with 128 permutations), 40 GB for OpenWebText's 8M pages.  Here the banding parameters still
come from datasketch (MinHashLSH's optimal (bands, rows) for the threshold), but the buckets
are found by sorting: one pass over the signatures (read in chunks, never mapped whole)
appends a 64-bit key per document to one file per band, then each band's keys are sorted and
runs of equal keys are buckets.  Peak memory is one chunk plus two N-long arrays (16 bytes per
document) plus the candidate pairs.
"""

import os


import numpy as np

CHUNK = 8192               # signatures hashed at a time (~8 MB as uint64)
_MAX_CLIQUE = 32           # buckets larger than this are linked as a star plus a chain
_MULTIPLIERS = np.random.RandomState(0x5EED).randint(
    1, np.iinfo(np.int64).max, size=256, dtype=np.int64).astype(np.uint64) | np.uint64(1)


def banding(threshold, num_perm):
    """(bands, rows per band) that datasketch's MinHashLSH picks for this threshold."""
    from datasketch import MinHashLSH
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    return lsh.b, lsh.r


def write_band_keys(signature_chunks, bands, rows, keys_prefix):
    """One file of uint64 keys per band, `{keys_prefix}.band{k}`, from [c, num_perm] chunks of
    MinHash values in document order; a key is a multiply-add hash of the band's `rows`
    values.  Returns the file paths."""
    paths = [f"{keys_prefix}.band{band}" for band in range(bands)]
    files = [open(path, "wb") for path in paths]
    multipliers = _MULTIPLIERS[:rows]
    try:
        with np.errstate(over="ignore"):  # wrapping uint64 arithmetic is the hash
            for chunk in signature_chunks:
                values = np.asarray(chunk, dtype=np.uint64)                   # [c, perm]
                for band, out in enumerate(files):
                    columns = values[:, band * rows:(band + 1) * rows]       # [c, rows]
                    ((columns * multipliers).sum(axis=1) + np.uint64(band)).tofile(out)
    finally:
        for out in files:
            out.close()
    return paths


def remove_band_keys(paths):
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


def candidate_pairs(key_paths):
    """{(earlier, later)} document indices sharing a bucket in at least one band."""
    pairs = set()
    for path in key_paths:
        column = np.fromfile(path, dtype=np.uint64)              # [N]
        order = np.argsort(column, kind="stable")                # equal keys keep index order
        ordered = column[order]
        run_starts = np.flatnonzero(np.diff(ordered) != 0) + 1
        bounds = np.concatenate(([0], run_starts, [len(ordered)]))
        long_runs = np.flatnonzero(np.diff(bounds) > 1)
        for run in long_runs:
            members = order[bounds[run]:bounds[run + 1]].tolist()  # ascending indices
            pairs.update(_bucket_pairs(members))
    return pairs


def _bucket_pairs(members):
    if len(members) <= _MAX_CLIQUE:
        return [(a, b) for i, a in enumerate(members) for b in members[i + 1:]]
    # A huge bucket (boilerplate pages) would give a quadratic number of pairs; linking each
    # member to the first and to its predecessor keeps it connected in linear pairs.
    first = members[0]
    return [(first, b) for b in members[1:]] + list(zip(members[1:-1], members[2:]))
