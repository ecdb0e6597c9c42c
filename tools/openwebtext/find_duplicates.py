"""Find near-duplicate documents: MinHash LSH on character shingles, then the exact Jaccard.

    python tools/openwebtext/find_duplicates.py cleaned.json duplicates.jsonl \
        [--threshold 0.8] [--shingle-size 5] [--num-perm 128] [--workers 4]

1. Signatures (`--workers` processes, streaming): every document's text is lowercased, its
   whitespace collapsed, and cut into character `--shingle-size`-grams; datasketch's MinHash
   (`--num-perm` permutations, `--minhash-seed`) summarises them.  Signatures go to a
   temporary file.
2. Candidates: LSH banding with the (bands, rows) datasketch's MinHashLSH picks for
   `--lsh-threshold` (by default 0.1 below --threshold, so that pairs near the threshold are
   not missed); the buckets are found by sorting band keys on disk (lsh_bands.py), so memory
   stays at 16 bytes per document instead of MinHashLSH's ~5 KB.
3. Verification: each candidate pair's exact Jaccard similarity of the shingle sets (texts
   re-read from the input by byte offset) is computed; pairs at or above --threshold are
   written, one JSON line each:
       {"url": earlier document's url, "duplicate": later document's url, "jaccard": 0.93,
        "index": 12, "duplicate_index": 40}
   (indices count the documents of the input in order).
Memory: 16 bytes per document while sorting a band, plus the candidate pairs; signatures,
band keys and texts stay on disk.
"""

import argparse
import functools
import json
import os
import re
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.errors import ConfigError  # noqa: E402
from tools.openwebtext.lsh_bands import (CHUNK, banding, candidate_pairs,  # noqa: E402
                                         remove_band_keys, write_band_keys)
from tools.openwebtext.streaming import (AtomicOutput, Progress, input_files,  # noqa: E402
                                         parse_json_record, run_line_filter,
                                         stage_main)

_WHITESPACE = re.compile(r"\s+")


def shingles(text, size):
    """The set of character `size`-grams of the normalised text (lowercase, single spaces)."""
    text = _WHITESPACE.sub(" ", text.lower()).strip()
    if len(text) <= size:
        return {text}
    return {text[i:i + size] for i in range(len(text) - size + 1)}


def jaccard(a, b):
    return len(a & b) / len(a | b) if a or b else 1.0


def signature_dtype(num_perm):
    return np.dtype([("offset", "<i8"), ("hashvalues", "<u4", (num_perm,))])


class SignatureFilter:
    """line, offset -> one fixed-size binary record (offset, MinHash hash values)."""
    wants_offset = True

    def __init__(self, shingle_size, num_perm, seed):
        from datasketch import MinHash
        self.shingle_size, self.num_perm, self.seed = shingle_size, num_perm, seed
        self.template = MinHash(num_perm=num_perm, seed=seed)  # permutations made once
        self.dtype = signature_dtype(num_perm)

    def __call__(self, line, offset):
        from datasketch import MinHash
        text = parse_json_record(line, ("text", "url"))["text"]
        # crc32 runs in C, twice as fast overall as datasketch's default sha1; distinct
        # shingles still get distinct values but for ~2**-32 collisions, and the seeded
        # permutations on top supply the randomness MinHash needs.
        minhash = MinHash(num_perm=self.num_perm, seed=self.seed, hashfunc=zlib.crc32,
                          permutations=self.template.permutations, scheme=self.template.scheme)
        minhash.update_batch([s.encode("utf-8", "surrogatepass")
                              for s in shingles(text, self.shingle_size)])
        record = np.zeros(1, self.dtype)
        record["offset"] = offset
        record["hashvalues"] = minhash.hashvalues  # uint32 under datasketch's affine32
        return record.tobytes(), None


class SignatureFilterFactory:
    def __init__(self, shingle_size, num_perm, seed):
        self.args = (shingle_size, num_perm, seed)

    def __call__(self):
        return SignatureFilter(*self.args)


class _Documents:
    """Random access to the input's documents by byte offset, with a small shingle cache."""

    def __init__(self, path, shingle_size):
        self.file = open(path, "rb")
        self.shingle_size = shingle_size
        # Pairs come sorted by their later document, so a few recent documents cover the
        # repeats; a shingle set is ~100x its text, so the cache must stay small.
        self.shingles = functools.lru_cache(maxsize=16)(self._shingles)

    def record(self, offset):
        self.file.seek(offset)
        return json.loads(self.file.readline())

    def _shingles(self, offset):
        return shingles(self.record(offset)["text"], self.shingle_size)

    def close(self):
        self.file.close()


def _signature_chunks(path, dtype):
    """The hash values of the signature file in chunks, read (not mapped: mapped pages of a
    big file would count as resident memory)."""
    with open(path, "rb") as f:
        while True:
            chunk = np.fromfile(f, dtype=dtype, count=CHUNK)
            if len(chunk) == 0:
                return
            yield chunk["hashvalues"]


def find_pairs(input_path, signatures_path, output_path, args, report):
    """LSH candidates over the signatures, verified by exact Jaccard, written as JSON lines
    ordered by (later document, earlier document)."""
    dtype = signature_dtype(args.num_perm)
    signatures = np.memmap(signatures_path, dtype=dtype, mode="r") \
        if os.path.getsize(signatures_path) else np.zeros(0, dtype)
    bands, rows = banding(args.lsh_threshold, args.num_perm)
    key_paths = write_band_keys(_signature_chunks(signatures_path, dtype), bands, rows,
                                signatures_path + ".keys")
    try:
        candidates = sorted(candidate_pairs(key_paths), key=lambda pair: (pair[1], pair[0]))
    finally:
        remove_band_keys(key_paths)
    documents = _Documents(input_path, args.shingle_size)
    pairs = 0
    progress = Progress("find_duplicates: verify", len(candidates))
    try:
        with AtomicOutput(output_path) as out:
            for earlier, later in candidates:
                first, second = (int(signatures[i]["offset"]) for i in (earlier, later))
                similarity = jaccard(documents.shingles(first), documents.shingles(second))
                if similarity >= args.threshold:
                    pairs += 1
                    out.write(json.dumps({
                        "url": documents.record(first)["url"],
                        "duplicate": documents.record(second)["url"],
                        "jaccard": round(similarity, 4), "index": earlier,
                        "duplicate_index": later}, ensure_ascii=False).encode() + b"\n")
                progress.update(1, 1)
    finally:
        progress.close()
        documents.close()
    report.notes.update({"LSH bands x rows": f"{bands} x {rows}",
                         "candidate pairs (LSH)": len(candidates),
                         f"pairs with Jaccard >= {args.threshold}": pairs})


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input", help="loose JSON, one {\"text\", \"url\"} object per line")
    parser.add_argument("output", help="duplicate pairs to write (JSON lines)")
    add_dedup_args(parser)
    parser.add_argument("--workers", type=int, default=1)
    return parser.parse_args(argv)


def add_dedup_args(parser):
    group = parser.add_argument_group("near-duplicate detection")
    group.add_argument("--threshold", type=float, default=0.8,
                       help="Jaccard similarity of shingle sets at or above which two "
                            "documents are duplicates")
    group.add_argument("--lsh-threshold", type=float, default=None,
                       help="threshold the LSH banding is tuned for (default: --threshold "
                            "- 0.1); lower finds more candidates, slower")
    group.add_argument("--shingle-size", type=int, default=5, help="characters per shingle")
    group.add_argument("--num-perm", type=int, default=128, help="MinHash permutations")
    group.add_argument("--minhash-seed", type=int, default=1,
                       help="seed of the MinHash permutations")


def check_dedup_args(args):
    if not 0.0 < args.threshold <= 1.0:
        raise ConfigError(f"--threshold must lie in (0, 1], got {args.threshold}")
    if args.lsh_threshold is None:
        args.lsh_threshold = max(args.threshold - 0.1, 0.05)
    if not 0.0 < args.lsh_threshold <= 1.0:
        raise ConfigError(f"--lsh-threshold must lie in (0, 1], got {args.lsh_threshold}")
    if args.shingle_size < 1 or args.num_perm < 2:
        raise ConfigError("--shingle-size must be >= 1 and --num-perm >= 2")


def run(args, stream=None):
    check_dedup_args(args)
    started = time.perf_counter()
    import datasketch  # noqa: F401 - once here (it pulls in scipy); forked workers inherit it
    signatures = f"{args.output}.signatures.tmp"
    try:
        report = run_line_filter("find_duplicates", input_files([args.input]), signatures,
                                 SignatureFilterFactory(args.shingle_size, args.num_perm,
                                                        args.minhash_seed),
                                 args.workers, stream)
        report.bytes_out = 0
        find_pairs(args.input, signatures, args.output, args, report)
        report.bytes_out = os.path.getsize(args.output)
    finally:
        if os.path.exists(signatures):
            os.remove(signatures)
    report.seconds = time.perf_counter() - started
    return report


def main(argv=None):
    return stage_main(run, get_args, argv)


if __name__ == "__main__":
    sys.exit(main())
