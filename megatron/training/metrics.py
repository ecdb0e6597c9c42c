"""The per-interval training log line, metrics.jsonl and TensorBoard scalars.

Rank 0 prints one Megatron-style line per log interval, appends the same numbers as one JSON
object per line to `<log_dir>/metrics.jsonl` (append mode, so a resumed run continues the
file), and writes them to TensorBoard when a directory is given. Other ranks do nothing here
(the phase times are gathered from every rank before: megatron/training/phase_times.py).
MFU values are fractions (0.413) in the record, the JSON and TensorBoard; the line shows %.

TensorBoard gets two kinds of numbers: the interval's (ms-per-iteration, tokens-per-s, mfu,
skipped-iterations, the phase times), always with the log line, and an iteration's (lm-loss,
learning-rate, ...), with the log line (the loss averaged over the interval) or, under
--tensorboard-log-interval, of every N-th iteration alone (`log_iteration`).
"""

import json
import math
import os
import resource
import sys

import torch

from megatron.config.sections import TensorboardScalars
from megatron.errors import ConfigError
from megatron.training.phase_times import format_timers_lines

METRICS_FILENAME = "metrics.jsonl"

# record key -> JSON key, in the order they are written. `train_iters` only goes to the line.
_JSON_KEYS = ("iteration", "consumed_samples", "lm_loss", "lr", "loss_scale", "grad_norm",
              "ms_per_iter", "tokens_per_s", "mfu", "skipped_iters")
# the interval's numbers: record key -> tag
_INTERVAL_TAGS = {"ms_per_iter": "ms-per-iteration", "tokens_per_s": "tokens-per-s",
                  "mfu": "mfu", "skipped_iters": "skipped-iterations",
                  "pipeline_bubble": "pipeline-bubble"}
# an iteration's numbers: record key -> (tag, the TensorboardScalars switch that writes it)
_ITERATION_TAGS = {"lm_loss": ("lm-loss", None), "lr": ("learning-rate", "learning_rate"),
                   "loss_scale": ("loss-scale", "loss_scale"), "grad_norm": ("grad-norm", None),
                   "params_norm": ("params-norm", None),
                   "num_zeros_in_grad": ("num-zeros", None),
                   "batch_size": ("batch-size", "batch_size"),
                   "world_size": ("world-size", "world_size")}


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
                 tensorboard=TensorboardScalars(), run_facts=None, device=None):
        """`tensorboard`: what TensorBoard gets; `run_facts`: the numbers that do not change
        during the run ({"batch_size": global batch, "world_size": processes}); `device`:
        whose memory --log-memory-to-tensorboard writes."""
        self.rank0 = rank0
        self._tensorboard, self._run_facts = tensorboard, dict(run_facts or {})
        self._device = device
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
            self._writer = _open_tensorboard(tensorboard_dir, tensorboard.queue_size)

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
            for key, tag in _INTERVAL_TAGS.items():
                if record.get(key) is not None:
                    self._writer.add_scalar(tag, _number(record[key]), iteration)
            if self._tensorboard.phase_times:  # the maximum over ranks, as Megatron's
                for phase, ms in record.get("phase_ms", {}).items():
                    self._writer.add_scalar(f"{phase.replace(' ', '-')}-time", ms, iteration)
            if self._tensorboard.log_interval is None:
                self._write_iteration(record)

    def log_iteration(self, record):
        """--tensorboard-log-interval: one iteration's numbers (iteration, consumed_samples,
        lm_loss, lr, loss_scale, grad_norm, params_norm, optimizer_states) to TensorBoard."""
        if self._writer is not None:
            self._write_iteration(record)

    def _write_iteration(self, record):
        iteration, samples = record["iteration"], record.get("consumed_samples")
        values = {**self._run_facts, **record}
        for key, (tag, switch) in _ITERATION_TAGS.items():
            if values.get(key) is None or (switch and not getattr(self._tensorboard, switch)):
                continue
            value = _number(values[key])
            self._writer.add_scalar(tag, value, iteration)
            if samples is not None:
                self._writer.add_scalar(f"{tag} vs samples", value, samples)
        for name, value in values.get("optimizer_states", {}).items():
            self._writer.add_scalar(f"optimizer/{name}", value, iteration)
            if samples is not None:
                self._writer.add_scalar(f"optimizer/{name} vs samples", value, samples)
        if self._tensorboard.memory:
            for tag, value in memory_scalars(self._device).items():
                self._writer.add_scalar(tag, value, iteration)

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
        _field("global batch size: {:5d}", _as_int(record.get("batch_size"))),
        _field("elapsed time per iteration (ms): {:.1f}", record.get("ms_per_iter")),
        _field("learning rate: {:.3E}", record.get("lr")),
        _field("lm loss: {:.6E}", record.get("lm_loss")),
        _field("loss scale: {:.1f}", record.get("loss_scale")),
        _field("grad norm: {:.3f}", record.get("grad_norm")),
        _field("num zeros: {:.1f}", record.get("num_zeros_in_grad")),
        _field("params norm: {:.3f}", record.get("params_norm")),
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


def memory_scalars(device):
    """This process's memory, as --log-memory-to-tensorboard writes it: on a GPU the caching
    allocator's (Megatron-LM's three tags), on a CPU the resident set, now and at its peak."""
    if device is not None and torch.device(device).type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
                "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
                "mem-allocated-count": stats.get("allocation.all.current", 0)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    found = {"mem-max-rss-bytes": peak if sys.platform == "darwin" else peak * 1024}  # KiB
    try:
        with open("/proc/self/statm") as f:
            found["mem-rss-bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (macOS): the peak only
        pass
    return found


def _open_tensorboard(tensorboard_dir, queue_size):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(f"WARNING: --tensorboard-dir {tensorboard_dir} was given but the tensorboard "
              "package is not installed (pip install tensorboard); continuing without "
              "TensorBoard logging", flush=True)
        return None
    return SummaryWriter(log_dir=tensorboard_dir, max_queue=queue_size)


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
