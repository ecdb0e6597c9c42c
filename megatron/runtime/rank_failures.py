"""Errors the ranks meet together, printed once.

A step that every rank passes or fails together (loading a checkpoint) ends with one
all-gather of what each rank met, so one rank (rank 0, unless it met a bug) can say every
distinct failure once, with the ranks that met it; the other ranks raise the same error marked
`said_elsewhere`, and the entry point (megatron/cli.py) prints it once, not once per rank. An
error that is not a user mistake keeps its traceback on the rank that met it.
"""

import torch.distributed as dist

from megatron.errors import user_error_types


def said_once(error, printer=0):
    """`error`, which every rank raises alike (a decision they made together), marked on the
    ranks other than `printer` so that only it prints the error."""
    if dist.is_available() and dist.is_initialized():
        error.said_elsewhere = dist.get_rank() != printer
    return error


def fail_together(error, what, error_type):
    """Every rank calls this with the exception it met in a step all ranks pass or fail
    together (None: it passed). Returns when every rank passed; otherwise raises on every
    rank: `error_type` whose message is the one failure when every rank met the same, else
    each distinct failure with its ranks ("rank 1 could not load the checkpoint: ...").
    `what` completes "could not ...". A rank whose own failure is not a user error re-raises
    it (its traceback); the others say it by its type and message."""
    single = not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    if single:
        if error is not None:
            raise error
        return
    user_error = error is None or isinstance(error, user_error_types())
    said = None if error is None else (str(error) if user_error else
                                       f"{type(error).__name__}: {error} (its traceback is "
                                       "in that rank's output)")
    everyone = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, (said, user_error))
    except Exception:
        if error is not None:  # the others may be gone: this rank's failure is still said
            raise error from None
        raise
    if all(rank_said is None for rank_said, _ in everyone):
        return
    if not user_error:
        raise error
    summary = error_type(_summary(everyone, what))
    if error is not None and str(error) == str(summary):
        summary = error  # every rank met this one: raise it as it was (its type, its cause)
    # printed by the first rank without a traceback of its own to print instead
    raise said_once(summary, printer=min(rank for rank, (_, user) in enumerate(everyone)
                                         if user))


def _summary(everyone, what):
    ranks_by_failure = {}
    for rank, (said, _) in enumerate(everyone):
        if said is not None:
            ranks_by_failure.setdefault(said, []).append(rank)
    if len(ranks_by_failure) == 1:
        (said, ranks), = ranks_by_failure.items()
        if len(ranks) == len(everyone):
            return said
        return f"{_ranks(ranks)} could not {what}, so every rank stops: {said}"
    return (f"the ranks could not {what}, so every rank stops:\n"
            + "\n".join(f"{_ranks(ranks)}: {said}" for said, ranks in ranks_by_failure.items()))


def _ranks(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
