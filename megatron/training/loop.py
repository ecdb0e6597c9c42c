"""The training loop: iterations, the log line, evaluation, checkpoints, stopping.

Data flow of one iteration (global batch G = micro batch b x data-parallel size d x A; under
--rampup-batch-size, G and A grow with the samples consumed):

    A micro batches -> forward_step -> loss -> engine.backward (/A, x loss scale; the last
        one also reduces the gradients over data parallelism) -> engine.step (acts at the
        last: unscale, skip on inf/nan, clip, Adam, learning-rate schedule)
    loss averaged over data parallelism for the log line

The loss is read from the device one iteration late (`_LossReads`), so the host does not wait
for a step's optimizer kernels before it starts the next step (the grad-norm read before the
optimizer still waits for backward, and with several ranks so does the exit check's
all-reduce); where the loop needs the number at once (a log line, evaluation, a checkpoint,
the end) it reads it then.
"""

import itertools
import time

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.model import flops_per_token
from megatron.runtime import device as device_mod
from megatron.training.manual_gc import ManualGC
from megatron.training.metrics import mfu
from megatron.training.phase_times import gather_phase_ms
from megatron.training.profiling import IterationProfiler
from megatron.training.replica_check import check_replicas_agree


def train(forward_step_func, backend, datasets, ctx, state, logger, guards):
    """The loop. Returns the iteration of the last checkpoint written (or None)."""
    config, runtime = ctx.config, ctx.runtime
    training, checkpoint = config.training, config.checkpoint
    train_forward_step = guards.wrap_forward_step(forward_step_func)  # test fault hooks
    backend.model.train()
    iterator = _data_iterator(datasets[0], state["consumed_train_samples"], ctx)
    if config.logging.phase_times:
        iterator = _TimedIterator(iterator)
    flops_per_sample = _flops_per_sample(ctx)
    peak = device_mod.peak_flops(runtime.device, config.precision.torch_dtype) * \
        runtime.world_size
    note = device_mod.faster_precision_note(runtime.device, config.precision.torch_dtype)
    if note:
        runtime.print0(note)
    window = {"loss": 0.0, "iters": 0, "samples": 0, "start": time.perf_counter(),
              "grad_norm": None, "peak": peak}
    saved_at = None
    compiling = _CompileWatch(backend.compile_backend, backend.compiled_regions) \
        if backend.compiled else None
    losses = _LossReads(guards)
    iteration_scalars = _IterationScalars(config.logging, backend, logger)
    profiler = IterationProfiler(config.profiler, runtime, state["iteration"])
    collector = ManualGC(training)
    replicas_every = training.check_weight_hash_across_dp_replicas_interval
    collector.start()
    try:
        while state["iteration"] < training.train_iters:
            guards.before_iteration(state["iteration"] + 1)
            profiler.before_iteration(state["iteration"] + 1)
            global_batch = training.global_batch_at(state["consumed_train_samples"])
            total, updated, grad_norm = backend.train_step(train_forward_step, iterator,
                                                           global_batch)
            if compiling is not None:  # this run's first step: it compiled the model
                compiling.report(window, runtime)
                compiling = None
            state["iteration"] += 1
            state["consumed_train_samples"] += global_batch
            state["skipped_iters"] += 0 if updated else 1
            window["iters"] += 1
            window["samples"] += global_batch
            window["grad_norm"] = grad_norm
            iteration = state["iteration"]
            losses.add(iteration, _mean_over_data_parallel(
                total.double() / training.micro_batches_in(global_batch)))
            # (under a batch-size ramp the log line and TensorBoard say the batch of the iteration)
            ramp = {"batch_size": global_batch} if training.rampup else {}
            iteration_scalars.after_step(state, grad_norm, ramp)
            logging = iteration % config.logging.log_interval == 0 or \
                iteration == training.train_iters
            evaluating = datasets[1] is not None and training.eval_iters > 0 and \
                iteration % training.eval_interval == 0 and iteration != training.train_iters
            exiting = training.exit_interval and iteration % training.exit_interval == 0
            saving = checkpoint.save and (iteration % checkpoint.save_interval == 0 or exiting)
            window["loss"] += losses.read(keep_newest=not (logging or evaluating or exiting
                                                           or saving))
            if logging:
                _log_window(window, state, backend, flops_per_sample, ctx, logger, iterator,
                            iteration_scalars)
            iteration_scalars.losses_read(losses.observe())  # the NaN guard sees them there
            checks_start = time.perf_counter()  # (kept out of ms/iter, as evaluation is)
            profiler.after_iteration(iteration)  # (its trace written after the last)
            if replicas_every and iteration % replicas_every == 0:
                check_replicas_agree(backend.module, iteration, runtime)
            window["start"] += time.perf_counter() - checks_start
            if evaluating:
                eval_start = time.perf_counter()
                collector.before_eval()
                logger.log_eval(iteration, "valid",
                                evaluate(forward_step_func, backend, datasets[1], ctx))
                collector.after_eval()
                window["start"] += time.perf_counter() - eval_start  # keep eval out of ms/iter
                backend.take_phase_times()  # and its forwards out of the phase times
            stop_reason = guards.stop_reason()  # SIGTERM, time limit, kill switch: agreed
            if stop_reason:
                window["loss"] += losses.read(keep_newest=False)
                iteration_scalars.losses_read(losses.observe())
            if saving or (checkpoint.save and stop_reason):
                backend.save(iteration, state)
                saved_at = iteration
            if exiting:
                runtime.print0(f" exiting at iteration {iteration} (--exit-interval)")
                break
            if stop_reason:
                runtime.print0(f" exiting at iteration {iteration}: {stop_reason}"
                               + (", checkpoint saved" if checkpoint.save else ""))
                break
            collector.after_iteration(iteration)
    except BaseException:
        profiler.abandon()
        raise
    finally:
        collector.stop()
    profiler.close(state["iteration"])
    return saved_at


@torch.no_grad()
def evaluate(forward_step_func, backend, dataset, ctx):
    """Mean loss over --eval-iters global batches, always the same leading batches."""
    training = ctx.config.training
    backend.model.eval()
    iterator = _data_iterator(dataset, 0, ctx)
    total, count = 0.0, 0
    for _ in range(training.eval_iters):
        batches = list(itertools.islice(iterator, training.num_micro_batches))
        if not batches:
            break
        total += backend.forward_only(forward_step_func, batches)
        count += len(batches)
    backend.model.train()
    return _average_over_data_parallel(total / max(count, 1), ctx.runtime.device)


def _data_iterator(dataset, consumed_samples, ctx):
    from megatron.data.samplers import build_pretraining_data_loader
    loader = build_pretraining_data_loader(
        dataset, consumed_samples, ctx.config.training.batch_size,
        mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
        ctx.config.data.num_workers)
    return iter(loader)


def _average_over_data_parallel(value, device):
    return _mean_over_data_parallel(torch.tensor(value, dtype=torch.float64,
                                                 device=device)).item()


def _mean_over_data_parallel(tensor):
    """The mean of a 0-dim tensor over the data-parallel ranks, in fp64, on its device."""
    tensor = tensor.double()
    if mpu.get_data_parallel_world_size() > 1:
        dist.all_reduce(tensor, group=mpu.get_data_parallel_group())
        tensor /= mpu.get_data_parallel_world_size()
    return tensor


class _LossReads:
    """Each iteration's loss (the data-parallel mean) on its way from the device: `add` starts
    its copy to the host, `read` takes the numbers of the iterations added so far (all but the
    newest, with keep_newest: that one is still being computed, and waiting for it would leave
    the GPU idle while the host starts the next iteration), `observe` shows the numbers read
    to the NaN guard, in order. Every rank reads the same iterations, so every rank's guard
    stops at the same one."""

    def __init__(self, guards):
        self.guards, self.pending, self.unobserved = guards, [], []

    def add(self, iteration, loss):
        self.pending.append((iteration, device_mod.read_later(loss)))

    def read(self, keep_newest):
        """The sum of the losses read now."""
        ready = self.pending[:-1] if keep_newest else self.pending
        self.pending = self.pending[len(ready):]
        values = [(iteration, read()) for iteration, read in ready]
        self.unobserved += values
        return sum(value for _, value in values)

    def observe(self):
        """Shows the guard the losses read since the last call; returns them, (iteration,
        loss) in order."""
        values, self.unobserved = self.unobserved, []
        for iteration, value in values:
            self.guards.after_iteration(iteration, value)
        return values


class _IterationScalars:
    """--tensorboard-log-interval N: every N-th iteration's own numbers go to TensorBoard once
    its loss is read (a step late, see _LossReads). --log-params-norm: the weights' norm, on
    every rank (a collective) at those iterations and at each log line, computed once when
    both fall on one iteration. --log-optimizer-states-to-tensorboard: the optimizer states'
    norms (a collective) where TensorBoard gets the iteration's numbers: those iterations, or
    each log line without the interval."""

    def __init__(self, logging, backend, logger):
        self.every = logging.tensorboard.log_interval
        self.params_norm, self.backend, self.logger = logging.params_norm, backend, logger
        self.optimizer_states = logging.tensorboard.optimizer_states
        self.pending, self.norm_at, self.ramp = {}, (None, None), {}

    def after_step(self, state, grad_norm, ramp):
        iteration = state["iteration"]
        self.ramp = ramp
        if self.every and iteration % self.every == 0:
            self.pending[iteration] = {
                "iteration": iteration, "consumed_samples": state["consumed_train_samples"],
                **ramp,
                **self.backend.optimizer_scalars(), "grad_norm": grad_norm,
                **({"params_norm": self.weights_norm(iteration)} if self.params_norm else {}),
                **self._optimizer_states()}

    def with_the_line(self, iteration):
        """What the log line's record adds: the batch of a ramp's iteration, the weights'
        norm, and the optimizer states' norms when TensorBoard takes the iteration's numbers
        from the line."""
        return {**self.ramp,
                **({"params_norm": self.weights_norm(iteration)} if self.params_norm else {}),
                **(self._optimizer_states() if not self.every else {})}

    def _optimizer_states(self):
        if not self.optimizer_states:
            return {}
        return {"optimizer_states": self.backend.optimizer_state_norms()}

    def weights_norm(self, iteration):
        if self.norm_at[0] != iteration:
            self.norm_at = (iteration, self.backend.weights_norm())
        return self.norm_at[1]

    def losses_read(self, values):
        for iteration, loss in values:
            record = self.pending.pop(iteration, None)
            if record is not None:
                self.logger.log_iteration({**record, "lm_loss": loss})


def _flops_per_sample(ctx):
    seq_length = ctx.config.data.seq_length
    # recompute adds one more forward: 4 passes' worth instead of 3
    passes = 4 if ctx.config.activation_checkpointing.checkpoint_activations else 3
    return flops_per_token(ctx.model_config, seq_length) * seq_length * passes / 3


class _CompileWatch:
    """Times the first step of a compiled model: one line says how much of it was compiling,
    and that time is kept out of the first log line's ms/iteration, as evaluation is. (The
    count is this rank's: a peer that compiles slower shows up here as waiting.)"""

    def __init__(self, compile_backend, regions):
        from zero.compiler import compile_seconds
        self.compile_backend, self.regions = compile_backend, regions
        self.start, self.compiled_before = time.perf_counter(), compile_seconds()

    def report(self, window, runtime):
        from zero.compiler import cache_dir, compile_seconds
        step = time.perf_counter() - self.start
        now = compile_seconds()
        where = (f"; compiled code is cached in {cache_dir()}, so a run of the same shapes "
                 "loads it") if self.compile_backend == "inductor" else ""
        if now is None or self.compiled_before is None:
            runtime.print0(f" compile: the first step took {step:.1f} s, compiling included"
                           f" ({self.regions}){where}")
            return
        compiling = min(now - self.compiled_before, step)
        runtime.print0(f" compile: the first step took {step:.1f} s, {compiling:.1f} s of it "
                       f"compiling ({self.compile_backend}, {self.regions}{where})")
        window["start"] += compiling


class _TimedIterator:
    """The training data iterator, timing each batch it hands out: the 'batch generator'
    phase of --timing-log-level 1."""

    def __init__(self, iterator):
        self.iterator, self.seconds = iterator, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.iterator)
        finally:
            self.seconds += time.perf_counter() - start

    def take_seconds(self):
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _phase_fields(backend, iterator, iterations, option):
    """Milliseconds per iteration of each phase since the last log line, over all ranks as
    --timing-log-option asks (a collective: every rank logs the same iterations)."""
    times = {**backend.take_phase_times(), "batch generator": iterator.take_seconds()}
    return gather_phase_ms({phase: seconds * 1000.0 / iterations
                            for phase, seconds in times.items()}, option)


def _log_window(window, state, backend, flops_per_sample, ctx, logger, iterator,
                iteration_scalars):
    config, runtime = ctx.config, ctx.runtime
    device_mod.synchronize(runtime.device)
    elapsed = time.perf_counter() - window["start"]
    seconds_per_iter = elapsed / window["iters"]
    samples_per_s = window["samples"] / elapsed
    reached = samples_per_s * flops_per_sample
    if window["peak"] and reached > window["peak"]:
        # The measured matmul peak is a best-of-a-few square matmul; the model's own shapes
        # (or the FLOP count's full, not causal, attention) can beat it. MFU stays <= 100%.
        if not window.get("peak_raised"):
            runtime.print0(f" note: training reached {reached / 1e9:.0f} GFLOP/s, above the "
                           f"measured matmul peak {window['peak'] / 1e9:.0f}; MFU is reported "
                           "against the highest rate reached from here on")
        window.update(peak=reached, peak_raised=True)
    logger.log_train({
        "iteration": state["iteration"], "train_iters": config.training.train_iters,
        "consumed_samples": state["consumed_train_samples"],
        "ms_per_iter": seconds_per_iter * 1000.0,
        **backend.report(),  # lr (what the schedule set, ours or the config's), loss scale
        "lm_loss": window["loss"] / window["iters"],
        "grad_norm": window["grad_norm"],
        **iteration_scalars.with_the_line(state["iteration"]),
        "tokens_per_s": samples_per_s * config.data.seq_length,
        "mfu": mfu(samples_per_s, flops_per_sample, window["peak"]),
        "skipped_iters": state["skipped_iters"],
        **(_phase_fields(backend, iterator, window["iters"], config.logging.timing_log_option)
           if config.logging.phase_times else {}),
    })
    window.update(loss=0.0, iters=0, samples=0, start=time.perf_counter())

