"""Stopping cleanly: on a signal or a time limit, after too many NaN losses, when a peer dies.

- `--exit-signal-handler`: SIGTERM (what schedulers send before preemption) only sets a flag;
  at the next iteration boundary the ranks all-reduce their flags, so they all stop at the same
  iteration even when the signal reached only some of them, save, and exit 0.
- Ctrl-C (SIGINT) always acts like that signal: the ranks agree to stop at the iteration
  boundary, save when --save is set, print the command that resumes, and the process exits
  with 130 and no traceback. A second Ctrl-C exits at once.
- `--exit-duration-in-mins`: the same agreement on "this job has run long enough" (each rank's
  clock is read, the maximum wins), so no rank waits in a collective for one that already left.
- `--kill-switch-file PATH` (Megatron-DeepSpeed's): the same agreement on "PATH exists", read
  by every rank (a file on one node's disk stops every node); found at start-up, the run
  exits 0 before it trains.
- `--max-nan-iterations N`: an iteration whose loss is NaN/inf is skipped (the optimizer skips
  non-finite gradients) and counted; N in a row stop training with a clear message instead of
  burning the allocation. The count sees each loss when the loop reads it: at once on an
  iteration that logs, evaluates, saves or exits, otherwise after the next iteration's step
  (megatron/training/loop.py), so between those the stop comes one (skipped) step later; no
  checkpoint is written in between.
- A collective that fails (a rank died, or hung past --distributed-timeout-minutes) becomes
  a TrainingError naming the iteration, the timeout and the checkpoint to resume from.
"""

import contextlib
import math
import os
import shlex
import re
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron.checkpointing.megatron_layout import read_tracker
from megatron.errors import TrainingError
from megatron.runtime.rank_failures import said_once


DUPLICATE_SIGINT_SECONDS = 2.0


class ExitConditions:
    """Decides, identically on every rank, whether to save and stop after this iteration."""

    def __init__(self, training, device, start_time=None, rank0=True):
        self.training, self.device, self.rank0 = training, device, rank0
        self.start_time = time.monotonic() if start_time is None else start_time
        self.signal_received = False
        self.interrupted = False  # Ctrl-C
        self._interrupted_at = None
        self._previous_handlers = {signal.SIGINT: signal.signal(signal.SIGINT, self._on_sigint)}
        if training.exit_signal_handler:
            self._previous_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM,
                                                                    self._on_signal)

    def _on_signal(self, signum, frame):
        self.signal_received = True  # acted on at the next iteration boundary

    def _on_sigint(self, signum, frame):
        if self.interrupted:
            # torchrun forwards the terminal's Ctrl-C to workers that got it already: a
            # second SIGINT within a moment is the same keypress
            if time.monotonic() - self._interrupted_at < DUPLICATE_SIGINT_SECONDS:
                return
            print("\n second Ctrl-C: exiting now, without saving", file=sys.stderr, flush=True)
            os._exit(130)
        self.interrupted, self._interrupted_at = True, time.monotonic()
        if self.rank0:
            print("\n Ctrl-C: stopping at the end of this iteration (and saving, with --save);"
                  " press Ctrl-C again to quit at once", file=sys.stderr, flush=True)

    def reason(self):
        """None, or why every rank stops now (agreed by all ranks: one small all-reduce)."""
        minutes = (time.monotonic() - self.start_time) / 60.0
        # [Ctrl-C, SIGTERM received anywhere, longest run time, kill switch]: MAX over ranks.
        switch = self.training.kill_switch_file
        flags = [float(self.interrupted), float(self.signal_received), minutes,
                 float(switch is not None and os.path.exists(switch))]
        if dist.is_initialized() and dist.get_world_size() > 1:
            flags = torch.tensor(flags, dtype=torch.float64, device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            flags = flags.tolist()  # one device sync (alone, nothing to agree on: none)
        interrupted, terminated, longest, switched = flags
        if interrupted:
            if not self.interrupted:  # a rank the Ctrl-C did not reach
                self.interrupted, self._interrupted_at = True, time.monotonic()
            return "Ctrl-C"
        if terminated:
            return "SIGTERM received (--exit-signal-handler)"
        if switched:
            return f"found the kill switch {switch} (--kill-switch-file)"
        limit = self.training.exit_duration_in_mins
        if limit and longest >= limit:
            return f"ran {longest:.2f} minutes (--exit-duration-in-mins {limit:g})"
        return None

    def close(self):
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}


def kill_switch_found(path, device):
    """Whether `path` (--kill-switch-file; None: not watched) exists on any rank: every rank
    must call it (one all-reduce)."""
    if path is None:
        return False
    found = torch.tensor([float(os.path.exists(path))], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())


class NanGuard:
    """Counts consecutive iterations with a non-finite loss; raises after the limit."""

    def __init__(self, max_nan_iterations, last_checkpoint):
        self.limit = max_nan_iterations
        self.last_checkpoint = last_checkpoint  # callable -> description of what to resume
        self.consecutive = 0
        self.total = 0

    def observe(self, iteration, loss):
        """`loss` is the data-parallel mean (the last stage's, on every stage), so every rank
        sees the same value, agrees, and rank 0 alone says so."""
        if math.isfinite(loss):
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.limit and self.consecutive >= self.limit:
            first = iteration - self.consecutive + 1
            raise said_once(TrainingError(
                f"the loss was NaN or inf for {self.consecutive} consecutive iterations "
                f"({first}-{iteration}; --max-nan-iterations {self.limit}); each was skipped, "
                f"the model was not updated by them. Training is diverging: "
                f"{self.last_checkpoint()}, with a lower --lr, more warmup, --clip-grad, or "
                f"--bf16 instead of --fp16"))

    def finish(self, iterations_run, last_iteration):
        """A run whose every iteration had a non-finite loss trained nothing: an error, even
        when it ended before the streak reached the limit (0 turns the guard off)."""
        if self.limit and iterations_run and self.consecutive == iterations_run:
            first = last_iteration - iterations_run + 1
            raise said_once(TrainingError(
                f"the loss was NaN or inf in every iteration of this run ({first}-"
                f"{last_iteration}); each was skipped, so nothing was trained. Check the data "
                f"and the model's initialisation, or "
                f"{self.last_checkpoint()} with a lower --lr, more warmup or --clip-grad"))


# gloo raises plain RuntimeErrors; NCCL raises torch.distributed.DistError subclasses. A gloo
# wait that times out says "Timed out ..." or, when the pair is torn down first, "Application
# timeout caused pair closure".
_PEER_FAILURE = re.compile(r"gloo|nccl|Timed out|timeout caused pair closure|"
                           r"Connection (reset|closed|refused)|Broken pipe|Socket", re.IGNORECASE)


@contextlib.contextmanager
def explain_collective_failures(timeout_minutes, state, rank, last_checkpoint):
    """A collective that fails because a peer died or hangs -> one clear TrainingError."""
    try:
        yield
    except RuntimeError as error:
        if not (isinstance(error, dist.DistError) or _PEER_FAILURE.search(str(error))):
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise TrainingError(
            f"rank {rank}: a collective failed during iteration {state['iteration'] + 1}: "
            f"{first_line}. Another rank most likely died or hangs (see its log); a collective "
            f"waits at most --distributed-timeout-minutes {timeout_minutes:g}. "
            f"{last_checkpoint()[0].upper()}{last_checkpoint()[1:]} (under torchrun "
            f"--max-restarts with --load = --save, the restarted job resumes from it)") \
            from None


def last_checkpoint_description(save_dir, load_step=None):
    """A callable describing the checkpoint a user resumes from (read when needed);
    `load_step`: the run's --ckpt-step, which a resume must drop."""
    def describe():
        if not save_dir:
            return "no checkpoint was saved (no --save); restart from scratch"
        try:
            iteration, _ = read_tracker(save_dir)
        except Exception:  # noqa: BLE001 -- a message about the message must not fail
            iteration = None
        if iteration is None:
            return f"no checkpoint in {save_dir} yet; restart from scratch"
        return f"resume from iteration {iteration} with --load {shlex.quote(str(save_dir))}" \
            + without_the_chosen_step(load_step)
    return describe


def without_the_chosen_step(load_step):
    """What a resume command must leave out of a run started at an older step."""
    if load_step is None:
        return ""
    return (f", without --ckpt-step/--load-tag (with it the run goes back to iteration "
            f"{load_step})")


class TrainingGuards:
    """What the train loop asks at each iteration boundary, in one object (see module doc)."""

    def __init__(self, config, runtime, state):
        from megatron.runtime import fault_injection
        self.config, self.runtime, self.state = config, runtime, state
        self.last_checkpoint = last_checkpoint_description(config.checkpoint.save,
                                                           config.checkpoint.load_step)
        self.exit_conditions = ExitConditions(config.training, runtime.device,
                                              rank0=runtime.is_rank0)
        self.nan_guard = NanGuard(config.training.max_nan_iterations, self.last_checkpoint)
        self._start_iteration = state["iteration"]
        self._injection = fault_injection

    def wrap_forward_step(self, forward_step_func):
        """The forward step, with the NaN losses a test asked for (MEGATRON_FAULT_NAN_AT)."""
        iterations = self._injection.nan_iterations()
        if not iterations:
            return forward_step_func
        return self._injection.poison_loss(forward_step_func, iterations, self.state)

    def before_iteration(self, iteration):
        self._injection.rank_fault(self.runtime.rank, iteration)

    def after_iteration(self, iteration, loss):
        self.nan_guard.observe(iteration, loss)

    def after_training(self):
        """Called when the loop ends without an interruption (see NanGuard.finish)."""
        self.nan_guard.finish(self.state["iteration"] - self._start_iteration,
                              self.state["iteration"])

    def stop_reason(self):
        return self.exit_conditions.reason()

    @property
    def interrupted(self):
        """The run stopped for Ctrl-C (the process should then exit as Ctrl-C does)."""
        return self.exit_conditions.interrupted

    def explaining_failures(self):
        return explain_collective_failures(self.config.parallel.distributed_timeout_minutes,
                                           self.state, self.runtime.rank,
                                           self.last_checkpoint)

    def close(self):
        self.exit_conditions.close()
