"""The streaming machinery every webtext stage shares.

A stage reads lines, decides per line "keep (this output line)" or "drop (for this reason)",
and writes the kept lines in input order.  Memory stays flat in the corpus size: lines are
streamed, and with `--workers N` the input is cut into byte segments at line boundaries, each
worker filters whole segments into its own part file, and the main process appends the parts in
order (so the output is byte-identical for every worker count).  A malformed line is counted,
up to a few are quoted with their byte offset, and the run goes on.
"""

import itertools
import json
import multiprocessing
import os
import queue as queue_module
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from megatron.cli import run_cli
from megatron.data.json_lines import MalformedLine, compression_of, parse_record
from megatron.data.preprocessing import split_line_ranges
from megatron.errors import DataError

MAX_EXAMPLES = 5               # malformed lines quoted per stage
SEGMENT_BYTES = 32 * 1 << 20   # a worker's unit of work; bounds part files and lost work
MALFORMED = "malformed"        # reasons starting with this are bad input, not filtering


class Malformed(Exception):
    """A line that is not what the stage reads; the message is the reason shown to users."""


@dataclass
class StageReport:
    """What one stage read, kept and dropped (per reason), and how fast."""
    stage: str
    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    examples: list = field(default_factory=list)   # [(file, byte offset, reason)]
    notes: dict = field(default_factory=dict)      # stage-specific numbers (e.g. pairs found)

    def count_drop(self, reason, where=None):
        self.dropped[reason] += 1
        if where is not None and reason.startswith(MALFORMED) and \
                len(self.examples) < MAX_EXAMPLES:
            self.examples.append((where[0], where[1], reason))

    def add(self, other):
        self.read += other.read
        self.kept += other.kept
        self.dropped.update(other.dropped)
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.examples.extend(other.examples[:max(MAX_EXAMPLES - len(self.examples), 0)])

    def to_json(self):
        return {"stage": self.stage, "read": self.read, "kept": self.kept,
                "dropped": dict(sorted(self.dropped.items())), "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "seconds": round(self.seconds, 3),
                "examples": [list(e) for e in self.examples], "notes": self.notes}

    @classmethod
    def from_json(cls, record):
        return cls(record["stage"], record["read"], record["kept"], Counter(record["dropped"]),
                   record["bytes_in"], record["bytes_out"], record["seconds"],
                   [tuple(e) for e in record["examples"]], record.get("notes", {}))

    def summary(self):
        """Lines for the terminal: counts, reasons, throughput, quoted malformed lines."""
        mb = self.bytes_in / 1e6
        rate = f"{self.read / max(self.seconds, 1e-9):.0f} docs/s, " \
               f"{mb / max(self.seconds, 1e-9):.2f} MB/s"
        lines = [f"{self.stage}: read {self.read}, kept {self.kept}, dropped "
                 f"{sum(self.dropped.values())} in {self.seconds:.2f} s ({rate})"]
        lines += [f"  dropped {n}: {reason}" for reason, n in sorted(self.dropped.items())]
        lines += [f"  {key}: {value}" for key, value in self.notes.items()]
        lines += [f"  malformed line at byte {offset} of {path}: {reason}"
                  for path, offset, reason in self.examples]
        malformed = sum(n for r, n in self.dropped.items() if r.startswith(MALFORMED))
        if malformed > len(self.examples):
            lines.append(f"  ... and {malformed - len(self.examples)} more malformed lines")
        return "\n".join(lines)


def parse_json_record(line, required=("text", "url")):
    """The JSON object on one raw line, with a string under every `required` key."""
    try:
        return parse_record(line, required)
    except MalformedLine as e:
        raise Malformed(f"{MALFORMED}: {e.kind}") from None


def dump_json_line(record):
    """One compact UTF-8 JSON line; a lone surrogate (from a "\\ud800" escape) is malformed."""
    try:
        return json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        raise Malformed(f"{MALFORMED}: a lone UTF-16 surrogate in the text") from None


def input_files(paths, patterns=None):
    """Files named, plus the files under named directories, subfolders too (sorted; `patterns`
    are suffixes). Files a directory holds that do not match are named in one note; a
    compressed file is an error (its lines would all be malformed)."""
    files, skipped = [], []
    for path in paths:
        if os.path.isdir(path):
            for name in _files_under(path):
                matches = patterns is None or name.endswith(tuple(patterns))
                (files if matches else skipped).append(name)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist")
    if skipped:
        print(f"note: skipped {len(skipped)} file(s) that are not *{', *'.join(patterns)}: "
              f"{', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''}"
              + ("; decompress the compressed ones first" if any(
                  compression_of(name) for name in skipped) else ""),
              file=sys.stderr, flush=True)
    if not files:
        raise DataError(f"no input files in {', '.join(paths)}"
                        + (f" (looked for *{', *'.join(patterns)})" if patterns else ""))
    for name in files:
        compression = compression_of(name)
        if compression is not None:
            raise DataError(f"input {name} is {compression}-compressed: decompress it first "
                            "(the stages read loose JSON lines)")
    return files


def _files_under(directory):
    found = []
    for root, dirs, names in os.walk(directory):
        # hidden ones are editors' and this pipeline's own (its stage markers, temporaries)
        dirs[:] = sorted(name for name in dirs if not name.startswith("."))
        found += [os.path.join(root, name) for name in sorted(names) if not name.startswith(".")]
    return found


def plan_segments(paths, workers, segment_bytes=SEGMENT_BYTES):
    """[(path, start, end)] covering every file, cut at line starts, about segment_bytes each
    and at least `workers` segments overall so every worker has something to do."""
    total = sum(os.path.getsize(p) for p in paths)
    segments = []
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        parts = max(-(-size // segment_bytes), -(-workers * size // max(total, 1)))
        segments += [(path, start, end) for start, end in split_line_ranges(path, parts)
                     if end > start]
    return segments


def iter_lines(path, start, end):
    """(byte offset, line) for the whole lines in [start, end) of a file."""
    with open(path, "rb") as f:
        f.seek(start)
        position = start
        while position < end:
            line = f.readline()
            if not line:
                break
            yield position, line
            position += len(line)


class Progress:
    """A tqdm bar over input bytes on stderr (plain, rare lines when tqdm is missing)."""

    def __init__(self, stage, total_bytes, stream=None):
        self.stage, self.total, self.stream = stage, total_bytes, stream or sys.stderr
        self.docs = self.bytes = 0
        self.start = time.monotonic()
        try:
            from tqdm import tqdm
            tqdm.monitor_interval = 0  # no monitor thread: it would force spawn over fork
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=stage,
                            file=self.stream, mininterval=0.5, leave=False)
        except ImportError:
            self.bar, self.next_print = None, 0.0

    def update(self, docs, nbytes):
        self.docs += docs
        self.bytes += nbytes
        rate = self.docs / max(time.monotonic() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.docs} docs, {rate:.0f} docs/s", refresh=False)
            self.bar.update(nbytes)
        elif time.monotonic() >= self.next_print:
            self.next_print = time.monotonic() + 10
            print(f"{self.stage}: {self.docs} docs ({rate:.0f} docs/s), "
                  f"{100 * self.bytes / max(self.total, 1):.0f}% of input", file=self.stream,
                  flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def process_context():
    """fork for a plain single-threaded tool (nothing re-imported); spawn when threads (torch,
    tqdm's monitor) exist, since forking them leaves their locks in an undefined state."""
    if threading.active_count() == 1 and "torch" not in sys.modules and \
            "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


# --- per-segment work, in the main process (workers == 1) or in a pool worker ---------------

_worker = {}  # the filter and progress queue of this pool worker (set by _init_worker)


def _init_worker(make_filter, progress_queue):
    _worker["filter"] = make_filter()
    _worker["queue"] = progress_queue


def filter_segment(segment, line_filter, out, report_progress, stage):
    """Run `line_filter(line) -> (bytes, None) | (None, reason)` over one segment (it may also
    raise Malformed); a filter with `wants_offset` is called as line_filter(line, offset).
    Returns the segment's StageReport."""
    path, start, end = segment
    report = StageReport(stage)
    wants_offset = getattr(line_filter, "wants_offset", False)  # find_duplicates keeps it
    pending_docs = pending_bytes = 0
    last = time.monotonic()
    for offset, line in iter_lines(path, start, end):
        report.bytes_in += len(line)
        pending_docs, pending_bytes = pending_docs + 1, pending_bytes + len(line)
        if time.monotonic() - last > 0.25:
            report_progress(pending_docs, pending_bytes)
            pending_docs = pending_bytes = 0
            last = time.monotonic()
        if not line.strip():
            continue  # blank lines are not documents
        report.read += 1
        try:
            kept, reason = line_filter(line, offset) if wants_offset else line_filter(line)
        except Malformed as e:
            report.count_drop(str(e), (path, offset))
            continue
        if kept is None:
            report.count_drop(reason)
            continue
        out.write(kept)
        report.kept += 1
        report.bytes_out += len(kept)
    report_progress(pending_docs, pending_bytes)
    return report


def _filter_segment_to_part(args):
    index, segment, part_path, stage = args
    queue = _worker["queue"]
    with open(part_path, "wb") as out:
        return part_path, filter_segment(segment, _worker["filter"], out,
                                         lambda d, b: queue.put((d, b)), stage)


def run_line_filter(stage, paths, output_path, make_filter, workers=1, stream=None,
                    segment_bytes=SEGMENT_BYTES):
    """Filter the lines of `paths` into `output_path` (written atomically).

    make_filter: zero-argument callable returning `line -> (bytes | None, reason)`; with
    workers > 1 it is called once in each worker (so under spawn it must pickle).
    """
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    started = time.perf_counter()
    context = process_context() if workers > 1 else None  # before any thread starts
    segments = plan_segments(paths, workers, segment_bytes)
    progress = Progress(stage, sum(os.path.getsize(p) for p in paths), stream)
    report = StageReport(stage)
    try:
        with AtomicOutput(output_path) as out:
            if workers == 1:
                line_filter = make_filter()
                for segment in segments:
                    report.add(filter_segment(segment, line_filter, out, progress.update, stage))
            else:
                _filter_in_pool(context, stage, segments, out, make_filter, workers, progress,
                                report)
    finally:
        progress.close()
    report.seconds = time.perf_counter() - started
    return report


def _filter_in_pool(context, stage, segments, out, make_filter, workers, progress, report):
    progress_queue = context.Queue()
    parts_dir = tempfile.mkdtemp(prefix=f".{stage}.parts.", dir=os.path.dirname(out.name))
    jobs = [(i, segment, os.path.join(parts_dir, f"part{i:06d}"), stage)
            for i, segment in enumerate(segments)]
    waiting = iter(jobs)
    try:
        # A process pool raises BrokenProcessPool when a worker dies (e.g. killed for memory),
        # from a result or from the next submit, whichever comes first, where
        # multiprocessing.Pool would wait forever for the lost segment.
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                 initargs=(make_filter, progress_queue)) as pool:
            # At most 2 segments per worker in flight: bounded part files on disk.
            in_flight = deque(pool.submit(_filter_segment_to_part, job)
                              for job in itertools.islice(waiting, 2 * workers))
            while in_flight:
                part_path, part_report = _wait_for(in_flight.popleft(), progress_queue,
                                                   progress)
                with open(part_path, "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 20)
                os.remove(part_path)
                report.add(part_report)
                for job in itertools.islice(waiting, 1):
                    in_flight.append(pool.submit(_filter_segment_to_part, job))
            _drain(progress_queue, progress)
    except BrokenProcessPool:
        raise RuntimeError("a worker process died (exit without a Python error; killed "
                           "for memory?); try fewer --workers") from None
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)


def _wait_for(future, progress_queue, progress):
    while True:
        _drain(progress_queue, progress)
        try:
            return future.result(timeout=0.2)
        except FutureTimeout:
            continue


def _drain(progress_queue, progress):
    while True:
        try:
            progress.update(*progress_queue.get_nowait())
        except queue_module.Empty:
            return


class AtomicOutput:
    """A binary file that appears under its name only when complete (tmp + fsync + rename)."""

    def __init__(self, path):
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")

    def __enter__(self):
        self.file = open(self.tmp, "wb")
        return self.file

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        else:
            self.file.close()
            os.remove(self.tmp)
        return False


def require_something_kept(stage_name, report, malformed_only=False):
    """A stage that dropped every line it read keeps nothing for the next stage: stop here,
    where the reason is known, instead of at the end on an empty corpus. `malformed_only`
    (a stage run alone): only when the lines were malformed, the sign of a wrong or swapped
    input file; dropping every page for what it says (blacklisted, below the threshold, too
    short) is an answer there."""
    if report.kept > 0 or not report.dropped:
        return
    reason, count = max(report.dropped.items(), key=lambda item: item[1])
    if malformed_only and not reason.startswith(MALFORMED):
        return
    hint = ""
    if "'url'" in reason:
        hint = ('; every page needs a "url" string (pages downloaded twice are dropped by it): '
                "give each line one")
    elif "pair" in reason or "groups" in reason:
        hint = "; are the input files given in the order the usage names them?"
    raise DataError(f"stage {stage_name} kept none of the {max(report.read, count)} lines it "
                    f"read ({count} dropped as {reason!r}){hint}")


def stage_main(run, get_args, argv=None):
    """A stage's command line: print the summary of run(get_args(argv)); a user error, or a
    stage that kept nothing of what it read, is one `error:` line and exit code 2
    (megatron.cli.run_cli)."""
    def run_and_report():
        report = run(get_args(argv))
        print(report.summary(), flush=True)
        require_something_kept(report.stage, report, malformed_only=True)
    return run_cli(run_and_report)
