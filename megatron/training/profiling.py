"""--profile: torch.profiler over a range of training iterations on the ranks asked for. Each
profiled rank writes a gzipped Chrome trace (https://ui.perfetto.dev, chrome://tracing or
TensorBoard read it) and prints the ops that took the most time in the range."""

import os

from torch.profiler import ProfilerActivity, profile

from megatron.runtime import device as device_mod

TOP_OPS = 8


class IterationProfiler:
    """Started before the first iteration of the range this run reaches (a resume inside the
    range starts there), stopped after its last one or when training ends."""

    def __init__(self, config, runtime, start_iteration):
        self.config, self.runtime = config, runtime
        self.here = config.profile and runtime.rank in config.profile_ranks
        self.running, self.first = None, None
        if self.here and start_iteration >= config.profile_last:
            print(f" rank {runtime.rank}: nothing to profile: this run starts after iteration "
                  f"{start_iteration}, past --profile-step-end {config.profile_last}",
                  flush=True)

    def before_iteration(self, iteration):
        config = self.config
        if self.here and self.running is None and self.first is None \
                and config.profile_first <= iteration <= config.profile_last:
            activities = [ProfilerActivity.CPU]
            if self.runtime.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.running = profile(activities=activities, record_shapes=True,
                                   with_stack=config.profile_with_stack)
            self.running.start()
            self.first = iteration

    def after_iteration(self, iteration):
        if self.running is not None and iteration >= self.config.profile_last:
            self._finish(iteration)

    def close(self, iteration):
        """Training ended after `iteration`: a range still open ends there."""
        if self.running is not None:
            self._finish(iteration)

    def abandon(self):
        """Training failed: stop without writing anything."""
        if self.running is not None:
            self.running.stop()
            self.running = None

    def _finish(self, last):
        device_mod.synchronize(self.runtime.device)
        self.running.stop()
        profiled, self.running = self.running, None
        rank, count = self.runtime.rank, last - self.first + 1
        os.makedirs(self.config.profile_trace_dir, exist_ok=True)
        path = os.path.join(self.config.profile_trace_dir,
                            f"rank{rank}.iterations_{self.first}-{last}.pt.trace.json.gz")
        profiled.export_chrome_trace(path)
        events = profiled.key_averages()
        lines = [f" rank {rank}: profiled iterations {self.first} to {last} (the profiler "
                 f"slows them): trace in {path}"]
        lines += _top(events, "self CPU time", lambda e: e.self_cpu_time_total, count)
        if self.runtime.device.type == "cuda":  # (a record_function range spans kernels)
            kernels = [e for e in events if not getattr(e, "is_user_annotation", False)]
            lines += _top(kernels, "self GPU time", lambda e: e.self_device_time_total, count)
        print("\n".join(lines), flush=True)


def _top(events, what, microseconds, iterations):
    total = sum(microseconds(e) for e in events) or 1.0
    ranked = sorted(events, key=microseconds, reverse=True)[:TOP_OPS]
    return [f"   top ops by {what}, ms per iteration:"] + [
        f"     {microseconds(e) / 1000.0 / iterations:10.2f}  {100 * microseconds(e) / total:5.1f}%"
        f"  {e.key}" for e in ranked if microseconds(e) > 0]
