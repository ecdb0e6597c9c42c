"""What the engine reports on its own, as DeepSpeed's does: `steps_per_print` progress lines,
`wall_clock_breakdown` timers and the `tensorboard` section's scalars, from global rank 0."""

import os
import time

import torch


class Monitor:
    """steps_per_print progress lines, wall_clock_breakdown timers and TensorBoard scalars,
    all from global rank 0."""

    def __init__(self, config, global_rank):
        self.config, self.enabled = config, global_rank == 0
        self.elapsed, self._loss_sum, self._loss_count = {}, 0.0, 0
        self._since_taken = {}  # the same times, summed until take_times()
        self._writer = None
        self._timing = config.wall_clock_breakdown

    def timed(self, name):
        return _Timer(self, name) if self._timing else _NULL_TIMER

    def take_times(self):
        """{phase: seconds} summed over the steps since the last call (empty unless
        wall_clock_breakdown): a training loop's per-interval breakdown."""
        times, self._since_taken = self._since_taken, {}
        return times

    def add_time(self, phase, seconds):
        for totals in (self.elapsed, self._since_taken):
            totals[phase] = totals.get(phase, 0.0) + seconds

    def record_loss(self, loss):
        if self.enabled and self.config.tensorboard.enabled:
            self._loss_sum += float(loss.detach().float().mean())
            self._loss_count += 1

    def report(self, engine):
        if not self.enabled:
            return
        every = self.config.steps_per_print
        if every and engine.global_steps % every == 0:
            print(f"[zero] step={engine.global_steps}, skipped={engine.skipped_steps}, "
                  f"lr={engine.get_lr()}, mom={_momentum(engine.optimizer)}", flush=True)
            if self._timing:
                parts = " | ".join(f"{k}: {v * 1000:.2f}" for k, v in self.elapsed.items())
                print(f"[zero] time (ms) | {parts}", flush=True)
        self._write_tensorboard(engine)
        self.elapsed = {}

    def _write_tensorboard(self, engine):
        tb = self.config.tensorboard
        if not tb.enabled:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            self._writer = SummaryWriter(log_dir=os.path.join(tb.output_path, tb.job_name))
        x = engine.global_samples
        if self._loss_count:
            mean_loss = self._loss_sum / self._loss_count
            self._writer.add_scalar("Train/Samples/train_loss", mean_loss, x)
        self._writer.add_scalar("Train/Samples/lr", engine.get_lr()[0], x)
        if engine.fp16_enabled():
            self._writer.add_scalar("Train/Samples/loss_scale", engine.cur_scale, x)
        for name, seconds in self.elapsed.items():
            self._writer.add_scalar(f"Train/Samples/elapsed_time_ms_{name}", seconds * 1000, x)
        self._writer.flush()
        self._loss_sum, self._loss_count = 0.0, 0


def _momentum(optimizer):
    moms = []
    for group in optimizer.param_groups:
        moms.append(group["betas"] if "betas" in group else group.get("momentum"))
    return moms


class _Timer:
    def __init__(self, monitor, name):
        self.monitor, self.name = monitor, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.monitor.add_time(self.name, time.perf_counter() - self.start)


class _NullTimer:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL_TIMER = _NullTimer()
