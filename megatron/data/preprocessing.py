"""Tokenize a loose-JSON corpus (one JSON object per line) into mmap `.bin/.idx` files.

Shared by `tools/preprocess_data.py` and `megatron.data.corpora`.  Memory stays bounded: input
is streamed line by line and tokens go straight to disk.  With N workers the file is cut into N
contiguous byte ranges at line boundaries; each worker process tokenizes its range into its own
partial `.bin/.idx`, and the main process concatenates the partials in order.  The output is
therefore byte-identical for every worker count, and no single writer process is the bottleneck
(Megatron's one-writer design topped out near 15 MB/s).
"""

import glob
import multiprocessing
import os
import queue as queue_module
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from megatron.data.json_lines import MalformedLine, compression_of, parse_record
from megatron.data.indexed_dataset import (MMapIndexedDatasetBuilder, best_dtype,
                                           data_file_path, index_file_path)
from megatron.data.progress import Progress
from megatron.data.tokenization_record import (record_path, remove_record, tokenization_record,
                                               write_record)
from megatron.errors import DataError, MegatronError

_MAX_EXAMPLES = 5  # malformed lines quoted in the final report


@dataclass
class TokenizeStats:
    documents: int = 0
    tokens: int = 0
    malformed: int = 0
    empty: int = 0
    bytes_read: int = 0
    # [(byte offset, reason)] of the first malformed lines; tokenize_loose_json turns the
    # offsets into line numbers
    examples: list = field(default_factory=list)

    def add(self, other):
        self.documents += other.documents
        self.tokens += other.tokens
        self.malformed += other.malformed
        self.empty += other.empty
        self.bytes_read += other.bytes_read
        room = _MAX_EXAMPLES - len(self.examples)
        self.examples.extend(other.examples[:max(room, 0)])


def output_prefix_for(output_prefix, key):
    """Megatron's naming: one dataset per JSON key, `{prefix}_{key}_document`."""
    return f"{output_prefix}_{key}_document"


class MalformedLineError(DataError):
    """--strict: the first malformed line stops the run (`offset`: its first byte)."""

    def __init__(self, offset, reason):
        super().__init__(offset, reason)  # args as given, so it pickles back from a worker
        self.offset, self.reason = offset, reason

    def __str__(self):
        return f"malformed line at byte {self.offset}: {self.reason}"


def line_numbers(path, offsets):
    """{byte offset: 1-based number of the line starting there}, in one pass over the file up
    to the largest offset."""
    numbers, line, position = {}, 1, 0
    pending = sorted(set(offsets))
    with open(path, "rb") as f:
        while pending:
            chunk = f.read(1 << 24)
            if not chunk:
                break
            while pending and pending[0] < position + len(chunk):
                numbers[pending[0]] = line + chunk.count(b"\n", 0, pending[0] - position)
                pending.pop(0)
            line += chunk.count(b"\n")
            position += len(chunk)
    return numbers


def _texts_of_line(line, json_keys):
    record = parse_record(line, json_keys)
    return [record[key] for key in json_keys]


def _tokenize_texts(texts, tokenizer, append_eod):
    """Token lists per key, or None when any key's document is empty (keeps keys aligned)."""
    token_lists = []
    for text in texts:
        try:
            ids = tokenizer.tokenize(text)
        except UnicodeEncodeError:  # a JSON "\ud800" escape: a lone surrogate, not text
            raise MalformedLine("a lone UTF-16 surrogate escape in the text") from None
        if len(ids) == 0:
            return None
        token_lists.append(list(ids) + [tokenizer.eod] if append_eod else ids)
    return token_lists


class _BatchedReporter:
    """Forwards (documents, bytes) progress in batches so reporting stays cheap."""

    def __init__(self, sink, every_docs, every_seconds=0.5):
        self._sink, self._every_docs, self._every_seconds = sink, every_docs, every_seconds
        self._docs = self._bytes = 0
        self._last = time.monotonic()

    def __call__(self, docs, nbytes):
        self._docs += docs
        self._bytes += nbytes
        if self._docs >= self._every_docs or time.monotonic() - self._last >= self._every_seconds:
            self.flush()

    def flush(self):
        if self._docs or self._bytes:
            self._sink(self._docs, self._bytes)
        self._docs = self._bytes = 0
        self._last = time.monotonic()


@dataclass
class _RangeJob:
    input_path: str
    start: int
    end: int
    prefixes: dict     # json key -> output prefix of this job
    json_keys: tuple
    append_eod: bool
    dtype: object
    strict: bool


def _tokenize_range(job, tokenizer, report):
    """Tokenize input bytes [start, end) (whole lines) into one dataset per key."""
    stats = TokenizeStats()
    builders = {key: MMapIndexedDatasetBuilder(data_file_path(prefix), job.dtype)
                for key, prefix in job.prefixes.items()}
    try:
        with open(job.input_path, "rb") as f:
            f.seek(job.start)
            position = job.start
            while position < job.end:
                line = f.readline()
                if not line:
                    break
                _tokenize_line(line, position, job, tokenizer, builders, stats)
                position += len(line)
                report(1, len(line))
        stats.bytes_read = position - job.start
        for key, builder in builders.items():
            builder.finalize(index_file_path(job.prefixes[key]))
    finally:
        for builder in builders.values():
            builder.discard()  # no-op after finalize; removes temp files after an error
    return stats


def _tokenize_line(line, position, job, tokenizer, builders, stats):
    if not line.strip():
        return  # blank lines (e.g. a trailing newline) are not documents
    try:
        token_lists = _tokenize_texts(_texts_of_line(line, job.json_keys), tokenizer,
                                      job.append_eod)
    except MalformedLine as e:
        if job.strict:
            raise MalformedLineError(position, str(e)) from None
        stats.malformed += 1
        if len(stats.examples) < _MAX_EXAMPLES:
            stats.examples.append((position, str(e)))
        return
    if token_lists is None:
        stats.empty += 1
        return
    for key, ids in zip(job.json_keys, token_lists):
        builders[key].add_item(ids)
        builders[key].end_document()
    stats.documents += 1
    stats.tokens += len(token_lists[0])


def split_line_ranges(path, parts):
    """`parts` contiguous byte ranges covering the file, each starting at a line start."""
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as f:
        for i in range(1, parts):
            target = max(size * i // parts, bounds[-1])
            if 0 < target < size:
                f.seek(target - 1)
                f.readline()  # the line holding byte target-1 belongs to the previous range
                target = f.tell()
            bounds.append(min(max(target, bounds[-1]), size))
    bounds.append(size)
    return list(zip(bounds[:-1], bounds[1:]))


def tokenize_loose_json(input_path, output_prefix, make_tokenizer, json_keys=("text",),
                        append_eod=False, workers=1, log_interval=100, stream=None,
                        strict=False):
    """Tokenize `input_path` into `{output_prefix}_{key}_document.bin/.idx` for every key.

    make_tokenizer: a zero-argument callable returning a tokenizer (`tokenize`, `eod`,
    `vocab_size`).  With workers > 1 it may be sent to spawned processes, so it must pickle (a
    `TokenizerFactory`, or a picklable tokenizer wrapped in `ConstantFactory`).
    Malformed lines (not UTF-8, not a JSON object, a key missing or not a string) are
    skipped and counted, the first few reported by line number; with `strict` the first one
    stops the run (DataError naming its line). Returns ({key: prefix}, TokenizeStats).
    """
    _check_input(input_path)
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    json_keys = tuple(json_keys)
    if len(set(json_keys)) < len(json_keys):
        raise DataError(f"--json-keys {' '.join(json_keys)} names a key twice (each key is "
                        "one output dataset)")
    context = _process_context()  # before tqdm may start its monitor thread
    tokenizer = make_tokenizer()
    dtype = best_dtype(tokenizer.vocab_size)
    outputs = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    records = {key: tokenization_record(input_path, key, append_eod, tokenizer)
               for key in json_keys}  # the source as read, before any change made mid-run
    out_dir = os.path.dirname(os.path.abspath(next(iter(outputs.values()))))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        raise DataError(f"--output-prefix {output_prefix}: cannot make the folder {out_dir} "
                        f"({error.strerror})") from None
    for prefix in outputs.values():
        remove_record(prefix)
        _remove_what_killed_runs_left(prefix, stream or sys.stderr)
    progress = Progress(os.path.getsize(input_path), log_interval, stream or sys.stderr)
    ranges = split_line_ranges(input_path, workers)
    try:
        if workers == 1:
            job = _RangeJob(input_path, 0, ranges[0][1], outputs, json_keys, append_eod, dtype,
                            strict)
            reporter = _BatchedReporter(progress.update, max(1, min(log_interval, 256)))
            stats = _tokenize_range(job, tokenizer, reporter)
            reporter.flush()
        else:
            if context.get_start_method() == "fork":
                # inherited by the forked workers, neither pickled nor rebuilt
                make_tokenizer = ConstantFactory(tokenizer)
            stats = _tokenize_in_workers(context, input_path, ranges, outputs, make_tokenizer,
                                         json_keys, append_eod, dtype, progress, log_interval,
                                         strict)
    except MalformedLineError as e:
        line = line_numbers(input_path, [e.offset])[e.offset]
        raise DataError(f"{input_path} line {line}: {e.reason} (--strict stops at the first "
                        "malformed line; without it such lines are skipped and counted)") from None
    finally:
        progress.close()
    numbers = line_numbers(input_path, [offset for offset, _ in stats.examples])
    stats.examples = [(numbers[offset], reason) for offset, reason in stats.examples]
    if stats.documents == 0:  # a dataset of nothing would only fail later, far from here
        for prefix in outputs.values():
            for path in (data_file_path(prefix), index_file_path(prefix)):
                os.remove(path)
        first = "".join(f"; line {line}: {reason}" for line, reason in stats.examples[:1])
        keys = ", ".join(f'"{key}": "..."' for key in json_keys)
        what = ("is empty" if os.path.getsize(input_path) == 0 else
                f"holds no usable documents ({stats.malformed} malformed lines, {stats.empty} "
                f"empty documents{first})")
        raise DataError(f"{input_path} {what}; it must be loose JSON, one {{{keys}}} object "
                        "per line")
    for key, prefix in outputs.items():
        write_record(prefix, records[key])
    return outputs, stats


def _remove_what_killed_runs_left(prefix, stream):
    """Delete the temporary files and worker parts (named after their writer's pid) of runs
    into `prefix` that were killed (SIGKILL, an out-of-memory kill, a cancelled job): they can
    be as large as the dataset, and nothing else removes them. A live writer's are kept."""
    left = [path for pattern in (".bin.tmp.*", ".idx.tmp.*", ".parts.*")
            for path in glob.glob(glob.escape(prefix) + pattern)
            if not _process_alive(path.rsplit(".", 1)[-1])]
    for path in left:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
    if left:
        print(f"note: removed {len(left)} temporary file(s) an interrupted earlier run left: "
              f"{', '.join(left)}", file=stream, flush=True)


def _process_alive(pid):
    if not pid.isdigit():
        return True  # not one of ours: leave it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _check_input(input_path):
    """DataError unless `input_path` is an uncompressed regular file (read by byte ranges)."""
    if not os.path.isfile(input_path):
        if os.path.isdir(input_path):
            what = "a directory"
        elif os.path.exists(input_path) or input_path == "-":
            what = ("not a regular file (a pipe or a device?): it is read by byte ranges, so "
                    "write it to a file first")
        else:
            what = "no such file"
        raise DataError(f"--input {input_path}: {what} (expected a loose JSON file, one object "
                        f"per line, e.g. {{\"text\": \"...\"}})")
    compression = compression_of(input_path)
    if compression is not None:
        raise DataError(f"--input {input_path} is {compression}-compressed: decompress it to a "
                        "file first (it is read by byte ranges, as loose JSON lines)")


def _process_context():
    """fork when this process is a plain single-threaded tool (fast: nothing is re-imported or
    rebuilt); spawn when it has threads (torch's, a process group's) that a fork would copy in
    an undefined state."""
    single_threaded = threading.active_count() == 1 and "torch" not in sys.modules
    if single_threaded and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _tokenize_in_workers(context, input_path, ranges, outputs, make_tokenizer, json_keys,
                         append_eod, dtype, progress, log_interval, strict):
    first_output = next(iter(outputs.values()))
    parts_dir = f"{first_output}.parts.{os.getpid()}"
    os.makedirs(parts_dir, exist_ok=True)
    try:
        jobs = [_RangeJob(input_path, start, end,
                          {key: os.path.join(parts_dir, f"part{i:05d}_{key}") for key in json_keys},
                          json_keys, append_eod, dtype, strict)
                for i, (start, end) in enumerate(ranges)]
        part_stats = _run_workers(context, jobs, make_tokenizer, progress, log_interval)
        stats = TokenizeStats()
        for part in part_stats:
            stats.add(part)
        for key, prefix in outputs.items():
            with MMapIndexedDatasetBuilder(data_file_path(prefix), dtype) as builder:
                for job in jobs:
                    builder.merge_file_(job.prefixes[key])
                builder.finalize(index_file_path(prefix))
        return stats
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)


def _worker_main(index, job, make_tokenizer, messages, every_docs):
    try:
        reporter = _BatchedReporter(lambda d, b: messages.put(("progress", index, (d, b))),
                                    every_docs)
        stats = _tokenize_range(job, make_tokenizer(), reporter)
        reporter.flush()
        messages.put(("done", index, stats))
    except BaseException as e:  # hand every failure to the parent, which re-raises it
        error = e if isinstance(e, MegatronError) else None
        messages.put(("error", index, (error, traceback.format_exc())))


def _run_workers(context, jobs, make_tokenizer, progress, log_interval):
    messages = context.Queue()
    every_docs = max(1, min(log_interval, 256))
    procs = [context.Process(target=_worker_main, daemon=True,
                             args=(i, job, make_tokenizer, messages, every_docs))
             for i, job in enumerate(jobs)]
    for p in procs:
        p.start()
    results, malformed = {}, []
    try:
        while len(results) + len(malformed) < len(jobs):
            try:
                kind, index, payload = messages.get(timeout=1.0)
            except queue_module.Empty:
                _check_workers_alive(procs, results)
                continue
            if kind == "progress":
                progress.update(*payload)
            elif kind == "done":
                results[index] = payload
            else:
                error, trace = payload
                if isinstance(error, MalformedLineError):
                    # --strict: each worker stops at its first bad line; the file's first is
                    # the one with the smallest offset, known once every worker has stopped
                    malformed.append(error)
                    continue
                if error is not None:
                    raise error
                raise RuntimeError(f"preprocessing worker {index} failed:\n{trace}")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    if malformed:
        raise min(malformed, key=lambda error: error.offset)
    return [results[i] for i in range(len(jobs))]


def _check_workers_alive(procs, results):
    for i, p in enumerate(procs):
        if i not in results and p.exitcode not in (None, 0):
            raise RuntimeError(f"preprocessing worker {i} died with exit code {p.exitcode} "
                               f"before reporting; its stderr above says why (exit code -9: "
                               f"killed, e.g. for memory, so try fewer --workers)")


class TokenizerFactory:
    """`build_tokenizer(tokenizer_type, ...)` as a picklable callable, for spawned workers."""

    def __init__(self, tokenizer_type, vocab_file=None, merge_file=None, tokenizer_model=None):
        self.tokenizer_type = tokenizer_type
        self.files = dict(vocab_file=vocab_file, merge_file=merge_file,
                          tokenizer_model=tokenizer_model)

    def __call__(self):
        from megatron.tokenizer import build_tokenizer
        return build_tokenizer(self.tokenizer_type, **self.files)


class ConstantFactory:
    """A picklable zero-argument callable returning a given (picklable) tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self):
        return self.tokenizer


def format_summary(outputs, stats, seconds):
    mb = stats.bytes_read / 1e6
    lines = [f"done: {stats.documents} documents, {stats.tokens} tokens, "
             f"{stats.malformed} malformed lines skipped, {stats.empty} empty documents skipped, "
             f"{mb:.2f} MB in {seconds:.2f} s ({mb / max(seconds, 1e-9):.2f} MB/s)"]
    for line, reason in stats.examples:
        lines.append(f"  line {line}: {reason}")
    if stats.malformed > len(stats.examples):
        lines.append(f"  ... and {stats.malformed - len(stats.examples)} more malformed lines")
    for prefix in outputs.values():
        lines.append(f"  wrote {data_file_path(prefix)}, {index_file_path(prefix)} and "
                     f"{record_path(prefix)} (source and tokenizer, checked by training)")
    return "\n".join(lines)
