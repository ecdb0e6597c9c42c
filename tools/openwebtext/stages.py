"""Resumable stages for run_pipeline.py: markers, skip rules, the summary table."""

import glob
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

from tools.openwebtext.streaming import AtomicOutput, StageReport, require_something_kept

_MARKER_FORMAT = 1


@dataclass
class Stage:
    name: str
    outputs: list              # files that must exist for the stage to count as done
    settings: dict             # what the output depends on besides the previous stage
    run: Callable              # () -> StageReport
    independent: bool = False  # its output feeds no later stage


def files_identity(paths):
    """A digest of the named files (recursing into directories): paths, sizes, mtimes."""
    entries = []
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()
                entries += [os.path.join(root, name) for name in sorted(files)]
        else:
            entries.append(path)
    digest = hashlib.sha1()
    for path in entries:
        stat = os.stat(path) if os.path.exists(path) else None
        digest.update(f"{os.path.abspath(path)}\0{stat and stat.st_size}\0"
                      f"{stat and stat.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return f"{len(entries)} files, sha1 {digest.hexdigest()[:16]}"


def _marker_path(marker_dir, stage):
    return os.path.join(marker_dir, f"{stage.name}.json")


def _load_marker(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_done(stage, marker, upstream):
    return (marker is not None and marker.get("format") == _MARKER_FORMAT and
            marker.get("settings") == stage.settings and marker.get("upstream") == upstream and
            all(os.path.exists(p) for p in stage.outputs))


def _remove_leftovers(stage):
    """Temporary files and folders a killed earlier run of this stage left next to its
    outputs (atomic-write temps, worker parts, dedup/shuffle buckets, signatures)."""
    for output in stage.outputs:
        directory, name = os.path.split(os.path.abspath(output))
        patterns = [f".{name}.tmp.*", f"{name}.*tmp*", ".*.parts.*", ".dedup.*", ".shuffle.*",
                    f"{os.path.splitext(name)[0]}.parts.*"]  # preprocess_data's worker parts
        for pattern in patterns:
            for leftover in glob.glob(os.path.join(directory, pattern)):
                if os.path.isdir(leftover):
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    os.remove(leftover)


def run_stages(stages, marker_dir, force=False):
    """Run each stage unless its marker says it is done; returns [(report, skipped)].

    A marker records the stage's settings and the upstream stage's marker digest, so a stage
    whose input changed (the previous stage ran again) runs again too.
    """
    os.makedirs(marker_dir, exist_ok=True)
    results, upstream = [], None
    for stage in stages:
        path = _marker_path(marker_dir, stage)
        marker = _load_marker(path)
        stage_upstream = None if stage.independent else upstream
        if not force and _is_done(stage, marker, stage_upstream):
            report, skipped = StageReport.from_json(marker["report"]), True
            print(f"[{stage.name}] done earlier; skipped (marker {path})", flush=True)
        else:
            if os.path.exists(path):
                os.remove(path)  # a run killed from here on must not look finished
            _remove_leftovers(stage)
            print(f"[{stage.name}] running", flush=True)
            started = time.perf_counter()
            report = stage.run()
            report.seconds = time.perf_counter() - started
            print(report.summary(), flush=True)
            if not stage.independent:
                require_something_kept(stage.name, report)
            marker = {"format": _MARKER_FORMAT, "settings": stage.settings,
                      "upstream": stage_upstream, "report": report.to_json()}
            with AtomicOutput(path) as out:
                out.write(json.dumps(marker, indent=1, sort_keys=True).encode())
            skipped = False
        if not stage.independent:
            upstream = hashlib.sha1(json.dumps(marker, sort_keys=True).encode()).hexdigest()
        results.append((report, skipped))
    return results


def format_table(results, seconds):
    rows = [("stage", "status", "read", "kept", "dropped", "reasons", "seconds", "MB/s")]
    for report, skipped in results:
        reasons = "; ".join(f"{reason}: {n}" for reason, n in sorted(report.dropped.items()))
        mb_per_s = report.bytes_in / 1e6 / max(report.seconds, 1e-9)
        rows.append((report.stage, "skipped" if skipped else "ran", str(report.read),
                     str(report.kept), str(sum(report.dropped.values())), reasons or "-",
                     f"{report.seconds:.2f}", f"{mb_per_s:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines.append(f"pipeline finished in {seconds:.2f} s")
    return "\n".join(lines)


def tokenize_stage(input_json, output_prefix, args):
    """tools/preprocess_data.py's work (eod appended) as a stage with a StageReport."""
    from megatron.data.preprocessing import TokenizerFactory, tokenize_loose_json
    factory = TokenizerFactory(args.tokenizer_type, args.vocab_file, args.merge_file,
                               args.tokenizer_model)
    outputs, stats = tokenize_loose_json(input_json, output_prefix, factory, append_eod=True,
                                         workers=args.workers, log_interval=10000)
    report = StageReport("preprocess", read=stats.documents + stats.malformed + stats.empty,
                         kept=stats.documents, bytes_in=stats.bytes_read)
    if stats.malformed:
        report.dropped["malformed"] = stats.malformed
    if stats.empty:
        report.dropped["empty"] = stats.empty
    report.bytes_out = sum(os.path.getsize(p + ".bin") for p in outputs.values())
    report.notes["tokens"] = stats.tokens
    return report
