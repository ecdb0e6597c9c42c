"""Calls that every rank must make (a checkpoint save or load, DeepSpeed's rule too): the
ranks meet in the process group's key-value store before the call's first collective. Made
on some ranks only (`if rank == 0: engine.save_checkpoint(...)`), the call waits in the store,
where no other rank's collective can be matched against it, says after a minute which ranks
have not come, and fails with a CallError at the process group's timeout, instead of hanging
in a collective."""

import collections
import datetime
import logging

import torch.distributed as dist

from zero.errors import CallError

logger = logging.getLogger(__name__)

NOTE_AFTER = datetime.timedelta(seconds=60)
NAMED_UP_TO = 64  # ranks; beyond, the note and the error count the missing ranks

_calls_made = collections.Counter()  # by call: every rank makes its calls in the same order
_unpaired = []  # the call that failed: the ranks' counts of it differ from then on


def every_rank_calls(call):
    """Wait until every rank of the default process group has called `call` as many times as
    this one. Nothing to wait for with one process (or a group without a store)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    store = _default_store()
    if store is None:
        return
    if _unpaired:
        raise CallError(f"{_unpaired[0]} was not called on every rank earlier in this process "
                        f"group, so this rank's calls can no longer be paired with the others' "
                        f"({call} now): restart the job")
    _calls_made[call] += 1
    key = _key(call, _calls_made[call])
    world, rank = dist.get_world_size(), dist.get_rank()
    store.set(f"{key}/rank{rank}", b"")
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/all", b"")
    limit, waited = store.timeout, datetime.timedelta(0)
    while True:
        wait = min(NOTE_AFTER, limit) if not waited else limit - waited  # one note
        try:
            store.wait([f"{key}/all"], wait)
            _forget(store, _key(call, _calls_made[call] - 1), rank)
            return
        except RuntimeError:  # the store's "Wait timeout" (DistStoreError is one)
            waited += wait
        missing = _missing(store, key, world)
        if waited >= limit:
            _unpaired.append(call)
            raise CallError(f"{call} was called on {world - missing[0]} of {world} ranks: "
                            f"{missing[1]} did not call it within {_seconds(limit)} s (the "
                            f"process group's timeout). Every rank must call {call}, not "
                            "only rank 0: it saves or reads every rank's part")
        logger.warning("%s: waiting %d s so far for %s (every rank must call it; at the "
                       "process group's timeout, %d s, this is an error)", call,
                       _seconds(waited), missing[1], _seconds(limit))


def _key(call, count):
    return f"zero/every_rank_calls/{call}/{count}"


def _forget(store, earlier, rank):
    """Every rank has passed the meeting before this one: its keys go (each rank its own, rank
    0 the shared ones), so a long run does not fill the store."""
    names = [f"{earlier}/rank{rank}"] + ([f"{earlier}/arrived", f"{earlier}/all"]
                                         if rank == 0 else [])
    for name in names:
        try:
            store.delete_key(name)
        except (RuntimeError, NotImplementedError):  # a store that cannot delete keeps them
            return


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # an initialisation without one
        return None


def _missing(store, key, world):
    """(how many ranks have not arrived, those ranks in words)."""
    missing = world - store.add(f"{key}/arrived", 0)
    if world > NAMED_UP_TO:
        return missing, f"{missing} ranks"
    ranks = [rank for rank in range(world) if not store.check([f"{key}/rank{rank}"])]
    return missing, f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def _seconds(delta):
    return int(round(delta.total_seconds()))
