"""Test hooks that make this process fail at a named place, so tests can prove that a crash
there loses nothing.  All of them do nothing unless their environment variable is set, and cost
one dictionary lookup when it is not.

    MEGATRON_FAULT_KILL_AT=<point>[@<n>]     SIGKILL this process the n-th time (default 1st)
                                             execution reaches `kill_point("<point>")`; the
                                             points of the save paths are listed in
                                             SAVE_KILL_POINTS (megatron) and
                                             zero.fault_injection.SAVE_KILL_POINTS (--deepspeed)
    MEGATRON_FAULT_NAN_AT=<it>[,<it>...]     make the loss of these iterations NaN (every rank)
    MEGATRON_FAULT_RANK=<rank>:<it>:<what>   at the start of iteration <it>, global rank <rank>
                                             does <what>: "kill" (SIGKILL itself), "term"
                                             (SIGTERM itself), "int" (SIGINT itself, as
                                             Ctrl-C) or "hang" (sleep forever);
                                             only in the first attempt of a
                                             torchrun job (TORCHELASTIC_RESTART_COUNT 0/unset),
                                             so a restarted job runs clean

The kill hook itself is zero's (zero/fault_injection.py): one variable and one count of
passes for both save paths.
"""

import math
import os
import signal
import time

from zero.fault_injection import KILL_VARIABLE, kill_point, writer  # noqa: F401 (re-exported)

NAN_VARIABLE = "MEGATRON_FAULT_NAN_AT"
RANK_VARIABLE = "MEGATRON_FAULT_RANK"

# The places in megatron/checkpointing's Megatron-layout save path where a kill must lose
# nothing, in the order a save passes them.  ("file" points are passed once per file written.)
SAVE_KILL_POINTS = (
    "save.start",
    "save.file.tmp_opened",
    "save.file.tmp_half_written",
    "save.file.tmp_written",
    "save.file.tmp_synced",
    "save.file.renamed",
    "save.files_done",
    "save.tracker.tmp_written",
    "save.tracker.renamed",
    "save.prune.start",
    "save.prune.renamed",
    "save.prune.removed",
    "save.done",
)


def nan_iterations():
    """Iterations whose loss MEGATRON_FAULT_NAN_AT makes NaN (an empty set when unset)."""
    text = os.environ.get(NAN_VARIABLE, "").strip()
    return {int(part) for part in text.split(",") if part.strip()} if text else set()


def poison_loss(forward_step_func, iterations, state):
    """forward_step_func whose loss is NaN while state['iteration'] + 1 is in `iterations`."""
    def forward_step(batch, model, ctx):
        loss = forward_step_func(batch, model, ctx)
        if state["iteration"] + 1 in iterations:
            loss = loss * math.nan
        return loss
    return forward_step


def rank_fault(rank, iteration):
    """Act on MEGATRON_FAULT_RANK at the start of `iteration` (1-based) on global `rank`."""
    spec = os.environ.get(RANK_VARIABLE)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    fault_rank, fault_iteration, what = spec.split(":")
    if int(fault_rank) != rank or int(fault_iteration) != iteration:
        return
    print(f" [fault injection] rank {rank} {what}s at iteration {iteration}", flush=True)
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif what == "term":  # what a scheduler sends before preemption
        os.kill(os.getpid(), signal.SIGTERM)
    elif what == "int":  # Ctrl-C
        os.kill(os.getpid(), signal.SIGINT)
    elif what == "hang":
        while True:
            time.sleep(3600)
    else:
        raise ValueError(f"{RANK_VARIABLE}={spec!r}: the action must be kill, term, int or "
                         "hang")
