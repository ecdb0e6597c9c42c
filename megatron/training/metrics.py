"""The per-interval training log line, metrics.jsonl and TensorBoard scalars.

Rank 0 prints one Megatron-style line per log interval, appends the same numbers as one JSON
object per line to `<log_dir>/metrics.jsonl` (append mode, so a resumed run continues the
file), and writes them to TensorBoard when a directory is given. Other ranks do nothing here
(the phase times are gathered from every rank before: megatron/training/phase_times.py).
MFU values are fractions (0.413) in the record, the JSON and TensorBoard; the line shows %.
"""

import json
import math
import os

import torch

from megatron.errors import ConfigError
from megatron.training.phase_times import format_timers_lines

METRICS_FILENAME = "metrics.jsonl"

# record key -> JSON key, in the order they are written. `train_iters` only goes to the line.
_JSON_KEYS = ("iteration", "consumed_samples", "lm_loss", "lr", "loss_scale", "grad_norm",
              "ms_per_iter", "tokens_per_s", "mfu", "skipped_iters")
_TENSORBOARD_TAGS = {"lm_loss": "lm-loss", "lr": "learning-rate", "loss_scale": "loss-scale",
                     "grad_norm": "grad-norm", "ms_per_iter": "ms-per-iteration",
                     "tokens_per_s": "tokens-per-s", "mfu": "mfu",
                     "skipped_iters": "skipped-iterations", "pipeline_bubble": "pipeline-bubble"}


def mfu(tokens_per_s, flops_per_token, peak_flops):
    """Model FLOPs utilisation as a fraction: achieved model FLOP/s over the device peak.

    The units only need to agree: samples/s with FLOPs per sample works as well.
    """
    if not peak_flops or peak_flops <= 0:
        return None
    return tokens_per_s * flops_per_token / peak_flops


class TrainingLogger:
    """The log line on rank 0, the same numbers in metrics.jsonl and TensorBoard.

    A run that starts at `start_iteration` (0, or where it resumes) first drops from
    metrics.jsonl what an earlier run logged from there on (training lines after it,
    evaluations at or after it: this run logs those again), so the file holds each iteration
    once. Without `start_iteration` it only appends."""

    def __init__(self, log_dir, tensorboard_dir, rank0, start_iteration=None,
                 phase_times_to_tensorboard=False):
        self.rank0 = rank0
        self._phase_times_to_tensorboard = phase_times_to_tensorboard
        self._jsonl = None
        self._writer = None
        if not rank0:
            return
        if log_dir:
            path = os.path.join(log_dir, METRICS_FILENAME)
            try:
                os.makedirs(log_dir, exist_ok=True)
                if start_iteration is not None:
                    _drop_records_from(path, start_iteration)
                self._jsonl = open(path, "a", encoding="utf-8")
            except OSError as error:
                raise ConfigError(f"cannot write {path} ({error.strerror}); give --log-dir a "
                                  "writable directory") from error
        if tensorboard_dir:
            self._writer = _open_tensorboard(tensorboard_dir)

    @property
    def writes_tensorboard(self):
        return self._writer is not None

    def log_train(self, record):
        if not self.rank0:
            return
        print(format_train_line(record), flush=True)
        timers = format_timers_lines(record)  # Megatron's timers line, under the log line
        if timers:
            print(timers, flush=True)
        entry = {key: record.get(key) for key in _JSON_KEYS}
        entry.update({k: v for k, v in record.items() if k not in entry and k != "train_iters"})
        self._write_json(entry)
        if self._writer is not None:
            iteration = record["iteration"]
            for key, tag in _TENSORBOARD_TAGS.items():
                if record.get(key) is not None:
                    self._writer.add_scalar(tag, _number(record[key]), iteration)
            if record.get("lm_loss") is not None and record.get("consumed_samples") is not None:
                self._writer.add_scalar("lm-loss vs samples", _number(record["lm_loss"]),
                                        record["consumed_samples"])
            if self._phase_times_to_tensorboard:  # the maximum over ranks, as Megatron's
                for phase, ms in record.get("phase_ms", {}).items():
                    self._writer.add_scalar(f"{phase.replace(' ', '-')}-time", ms, iteration)

    def log_eval(self, iteration, split, loss):
        if not self.rank0:
            return
        loss = _number(loss)
        ppl = math.exp(min(loss, 20.0))  # capped so a diverged run does not overflow
        label = "validation" if split in ("valid", "validation", "val") else split
        line = (f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} |"
                f" lm loss PPL: {ppl:.6E} |")
        print("-" * (len(line) + 1), line, "-" * (len(line) + 1), sep="\n", flush=True)
        self._write_json({"iteration": iteration, "split": split, "loss": loss, "ppl": ppl})
        if self._writer is not None:
            self._writer.add_scalar(f"lm-loss-{split}", loss, iteration)
            self._writer.add_scalar(f"lm-loss-{split}-ppl", ppl, iteration)

    def close(self):
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def _write_json(self, entry):
        if self._jsonl is None:
            return
        clean = {k: _json_value(v) for k, v in entry.items()}
        self._jsonl.write(json.dumps(clean, allow_nan=False) + "\n")
        self._jsonl.flush()  # a crash must not lose the lines already logged


def format_train_line(record):
    """The Megatron log line; fields whose value is None (e.g. grad norm on a skip) are left out."""
    fields = [
        f" iteration {int(record['iteration']):8d}/{int(record['train_iters']):8d} |",
        f" consumed samples {int(record['consumed_samples']):12d} |",
        _field("elapsed time per iteration (ms): {:.1f}", record.get("ms_per_iter")),
        _field("learning rate: {:.3E}", record.get("lr")),
        _field("lm loss: {:.6E}", record.get("lm_loss")),
        _field("loss scale: {:.1f}", record.get("loss_scale")),
        _field("grad norm: {:.3f}", record.get("grad_norm")),
        _field("tokens/s: {:.0f}", record.get("tokens_per_s")),
        _field("MFU: {:.1f}%", None if record.get("mfu") is None else 100.0 * record["mfu"]),
        _field("pipeline bubble: {:.1f}%", None if record.get("pipeline_bubble") is None
               else 100.0 * record["pipeline_bubble"]),
        _field("skipped: {:d}", _as_int(record.get("skipped_iters"))),
        _field("nan iterations: {:d}", _as_int(record.get("nan_iters"))),
    ]
    return "".join(fields)


def _field(template, value):
    return "" if value is None else " " + template.format(_number(value)) + " |"


def _as_int(value):
    return None if value is None else int(_number(value))


def _number(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    return value


def _json_value(value):
    # Strict JSON has no NaN/Infinity: a non-finite number is written as null.
    value = _number(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _open_tensorboard(tensorboard_dir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(f"WARNING: --tensorboard-dir {tensorboard_dir} was given but the tensorboard "
              "package is not installed (pip install tensorboard); continuing without "
              "TensorBoard logging", flush=True)
        return None
    return SummaryWriter(log_dir=tensorboard_dir)


def _drop_records_from(path, start_iteration):
    """Rewrite metrics.jsonl without the records a run resuming at `start_iteration` writes
    again (and without a line cut short by a crash)."""
    if not os.path.exists(path):
        return
    kept, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
                iteration = int(record["iteration"])
            except (ValueError, KeyError, TypeError):
                dropped += 1
                continue
            evaluation = "split" in record
            if iteration > start_iteration or (evaluation and iteration == start_iteration):
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
