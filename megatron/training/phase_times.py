"""The phase times of --timing-log-level 1 over all the job's ranks (--timing-log-option).

Each rank times its own forward, backward, optimizer step and batch generator; a slow rank
holds every other one up at the next collective, so the log shows them across ranks, as
Megatron-LM's timers do:

    max      the slowest rank's time per phase
    minmax   the fastest and the slowest rank's
    all      every rank's

`gather_phase_ms` is a collective: every rank calls it at the same log iteration (the loop's
log step runs on all ranks; only the printing is rank 0's). Its fields go into the log
record: `phase_ms` is always the maximum over ranks (what the one-value line and TensorBoard
show), `phase_ms_min` the minimum (minmax), `phase_ms_by_rank` each rank's (all, None for a
rank that did not time the phase).
"""

import math

import torch
import torch.distributed as dist

from zero.comm.agreement import collective_device

# the order of the timers line; every rank gathers all of them, NaN where it has no time
PHASES = ("forward", "backward", "optimizer", "batch generator")


def gather_phase_ms(local_ms, option):
    """The log record's phase fields from this rank's {phase: ms per iteration}. Every rank
    must call it, at the same iteration."""
    by_rank = _gather_over_ranks([local_ms.get(phase, math.nan) for phase in PHASES])
    per_phase = {phase: [row[i] for row in by_rank] for i, phase in enumerate(PHASES)}
    timed = {phase: [ms for ms in times if not math.isnan(ms)]
             for phase, times in per_phase.items()}
    timed = {phase: times for phase, times in timed.items() if times}  # by some rank
    fields = {"phase_ms": {phase: max(times) for phase, times in timed.items()}}
    if option == "minmax":
        fields["phase_ms_min"] = {phase: min(times) for phase, times in timed.items()}
    elif option == "all":
        fields["phase_ms_by_rank"] = {
            phase: [None if math.isnan(ms) else ms for ms in per_phase[phase]]
            for phase in timed}
    return fields


def _gather_over_ranks(values):
    """[values of rank 0, values of rank 1, ...]: one all-gather of a few floats over the
    whole job, on the device its process group moves tensors on (CUDA for NCCL)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=collective_device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [tensor.tolist() for tensor in everyone]


def format_timers_lines(record):
    """Megatron's timers line under the log line, from the record's phase fields (None when
    it has none): the form follows the fields the option put there."""
    maxima = record.get("phase_ms")
    if not maxima:
        return None
    by_rank = record.get("phase_ms_by_rank")
    if by_rank is not None:
        return "\n".join([" times across ranks (ms):"] + [
            f"    {phase} | " + " | ".join(f"rank {rank}: {ms:.2f}"
                                          for rank, ms in enumerate(times) if ms is not None)
            for phase, times in by_rank.items()])
    minima = record.get("phase_ms_min")
    if minima is not None:
        return " (min, max) time across ranks (ms) | " + " | ".join(
            f"{phase}: ({minima[phase]:.2f}, {ms:.2f})" for phase, ms in maxima.items())
    return " max time across ranks (ms) | " + " | ".join(
        f"{phase}: {ms:.2f}" for phase, ms in maxima.items())
