"""Out-of-core exact deduplication and shuffling of line files.

Both spread the lines over hash/random buckets in temporary files sized about `bucket_bytes`,
so only one bucket is ever in memory, however large the input.
"""

import hashlib
import heapq
import os
import random
import shutil
import tempfile
import time

from megatron.errors import ConfigError
from tools.openwebtext.streaming import AtomicOutput, Progress, process_context, run_line_filter

BUCKET_BYTES = 64 << 20


def add_bucket_arg(parser, what):
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_BYTES / (1 << 20),
                        help=f"size of the temporary buckets of the {what}, held in memory one "
                             "at a time")


def bucket_bytes(args):
    """--bucket-mb in bytes; ConfigError unless positive."""
    if not args.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be positive, got {args.bucket_mb}")
    return max(1, int(args.bucket_mb * (1 << 20)))


def _bucket_count(path, bucket_bytes):
    return max(1, -(-os.path.getsize(path) // bucket_bytes))


def _temp_dir_beside(path, prefix):
    """A temporary folder next to `path` (same filesystem: big data, cheap renames)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=directory)


def _digest(key):
    return hashlib.blake2b(key, digest_size=16).digest()  # same in every process, unlike hash()


def filter_then_dedup_lines(stage, paths, output_path, make_filter, workers, stream,
                            key_of_line, duplicate_reason, bucket_bytes=BUCKET_BYTES):
    """run_line_filter, then dedup_lines by `key_of_line` into `output_path`: the StageReport
    counts the duplicates dropped as `duplicate_reason` and the time of both passes."""
    started = time.perf_counter()
    filtered = f"{output_path}.filtered.tmp"
    try:
        report = run_line_filter(stage, paths, filtered, make_filter, workers, stream)
        duplicates = dedup_lines(filtered, output_path, key_of_line, bucket_bytes,
                                 stage=f"{stage}: {duplicate_reason}s")
    finally:
        if os.path.exists(filtered):
            os.remove(filtered)
    report.seconds = time.perf_counter() - started
    report.kept -= duplicates
    if duplicates:
        report.dropped[duplicate_reason] += duplicates
    return report


def dedup_lines(in_path, out_path, key_of_line, bucket_bytes=BUCKET_BYTES, stage="dedup"):
    """Copy `in_path` to `out_path` keeping the first line of each key, in input order.

    Pass 1 numbers the lines and sends each to bucket digest(key) % B; pass 2 drops repeated
    keys inside each bucket (a set of one bucket's digests); pass 3 merges the buckets back
    into input order by line number.  Returns the number of lines dropped.
    """
    buckets = _bucket_count(in_path, bucket_bytes)
    tmp_dir = _temp_dir_beside(out_path, ".dedup.")
    progress = Progress(stage, os.path.getsize(in_path) * 2)
    try:
        names = [os.path.join(tmp_dir, f"b{i:05d}") for i in range(buckets)]
        files = [open(name, "wb") for name in names]
        try:
            with open(in_path, "rb") as f:
                for number, line in enumerate(f):
                    if not line.endswith(b"\n"):
                        line += b"\n"  # the last line: it must not glue to the next record
                    key = key_of_line(line)
                    files[int.from_bytes(_digest(key)[:8], "little") % buckets].write(
                        b"%d\t%s" % (number, line))
                    progress.update(1, len(line))
        finally:
            for f in files:
                f.close()
        dropped = 0
        for name in names:
            dropped += _drop_repeats_in_bucket(name, key_of_line, progress)
        with AtomicOutput(out_path) as out:
            streams = [_numbered_lines(name) for name in names]
            for _, line in heapq.merge(*streams):
                out.write(line)
        return dropped
    finally:
        progress.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _drop_repeats_in_bucket(name, key_of_line, progress):
    seen, dropped = set(), 0
    with open(name, "rb") as f, open(name + ".kept", "wb") as out:
        for record in f:
            line = record.split(b"\t", 1)[1]
            digest = _digest(key_of_line(line))
            progress.update(0, len(line))
            if digest in seen:
                dropped += 1
                continue
            seen.add(digest)
            out.write(record)
    os.replace(name + ".kept", name)
    return dropped


def _numbered_lines(name):
    with open(name, "rb") as f:
        for record in f:
            number, line = record.split(b"\t", 1)
            yield int(number), line


def shuffle_lines(in_path, out_path, seed, workers=1, bucket_bytes=BUCKET_BYTES):
    """A seeded shuffle of the lines of `in_path` into `out_path`, out of core.

    Pass 1 sends every line to a bucket drawn from Random(seed); pass 2 shuffles each bucket in
    memory with Random(seed, bucket) (in `workers` processes) and appends the buckets in order.
    The result depends on the seed and the bucket count only, never on the worker count.
    Returns (lines, seconds).
    """
    started = time.perf_counter()
    context = process_context() if workers > 1 else None
    buckets = _bucket_count(in_path, bucket_bytes)
    rng = random.Random(seed)
    tmp_dir = _temp_dir_beside(out_path, ".shuffle.")
    progress = Progress("shuffle", os.path.getsize(in_path))
    lines = 0
    try:
        names = [os.path.join(tmp_dir, f"b{i:05d}") for i in range(buckets)]
        files = [open(name, "wb") for name in names]
        try:
            with open(in_path, "rb") as f:
                for line in f:
                    if not line.endswith(b"\n"):
                        line += b"\n"  # a last line without newline must not glue to another
                    files[rng.randrange(buckets)].write(line)
                    lines += 1
                    progress.update(1, len(line))
        finally:
            for f in files:
                f.close()
        jobs = [(name, seed, i) for i, name in enumerate(names)]
        with AtomicOutput(out_path) as out:
            if workers == 1 or buckets == 1:
                for name in map(_shuffle_bucket, jobs):
                    _append(name, out)
            else:
                with context.Pool(min(workers, buckets)) as pool:
                    for name in pool.imap(_shuffle_bucket, jobs):
                        _append(name, out)
    finally:
        progress.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return lines, time.perf_counter() - started


def _shuffle_bucket(job):
    name, seed, index = job
    with open(name, "rb") as f:
        lines = f.readlines()
    random.Random(f"{seed}/{index}").shuffle(lines)
    with open(name, "wb") as f:
        f.writelines(lines)
    return name


def _append(name, out):
    with open(name, "rb") as f:
        shutil.copyfileobj(f, out, 1 << 20)
    os.remove(name)
