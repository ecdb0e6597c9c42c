"""A checkpoint call made on some ranks only (`if rank == 0: engine.save_checkpoint(...)`)
fails with a CallError naming the ranks that did not call it, instead of hanging in a
collective; a rank that comes late is waited for, with a note."""

import datetime
import logging
import time

import pytest

from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases


def _short_timeouts(note_after_s, timeout_s):
    """The process group's timeout (its store's) and the note's delay, shortened for a test."""
    import torch.distributed as dist

    import zero.comm.every_rank as every_rank
    every_rank.NOTE_AFTER = datetime.timedelta(seconds=note_after_s)
    dist.distributed_c10d._get_default_store().set_timeout(
        datetime.timedelta(seconds=timeout_s))


class _Notes(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        logging.getLogger("zero.comm.every_rank").addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


def _call_on_rank0_only(rank, world_size, call, save_dir):
    _short_timeouts(note_after_s=1, timeout_s=3)
    notes = _Notes()
    engine = cases.make_engine(cases.ds_config(1))
    cases.train_steps(engine, 1)
    engine.save_checkpoint(save_dir)  # every rank: a checkpoint to load below
    try:
        if rank == 0:
            getattr(engine, call)(save_dir)
        cases.train_steps(engine, 1, start=1)  # rank 1 goes on into a gradient all-reduce
        return "no error", notes.messages, None
    except Exception as error:  # noqa: BLE001 -- what each rank saw is the result
        again = None
        if rank == 0:  # the calls can no longer be paired: the next one says so at once
            start = time.monotonic()
            try:
                engine.save_checkpoint(save_dir)
            except Exception as second:  # noqa: BLE001
                again = (f"{type(second).__name__}: {second}", time.monotonic() - start)
        return f"{type(error).__name__}: {error}", notes.messages, again


@pytest.mark.parametrize("call", ["save_checkpoint", "load_checkpoint", "save_16bit_model"])
def test_a_call_on_rank0_only_is_a_clear_error_not_a_hang(call, tmp_path):
    (error0, notes0, again), (error1, _, _) = run_distributed(
        _call_on_rank0_only, 2, args=(call, str(tmp_path)), timeout=90)
    assert error0.startswith(f"CallError: {call} was called on 1 of 2 ranks: rank 1 did not "
                             "call it within 3 s"), error0
    assert "Every rank must call" in error0
    assert len(notes0) == 1 and "waiting 1 s so far for rank 1" in notes0[0], notes0
    assert error1 != "no error"  # rank 0 left: its all-reduce cannot finish
    message, seconds = again
    assert message == f"CallError: {call} was not called on every rank earlier in this " \
        "process group, so this rank's calls can no longer be paired with the others' " \
        "(save_checkpoint now): restart the job" and seconds < 1


def _rank1_late(rank, world_size, save_dir):
    _short_timeouts(note_after_s=1, timeout_s=30)
    notes = _Notes()
    engine = cases.make_engine(cases.ds_config(2))
    cases.train_steps(engine, 1)
    if rank == 1:
        time.sleep(2.5)
    engine.save_checkpoint(save_dir)
    engine.save_checkpoint(save_dir, tag="again")  # the calls stay paired after a wait
    path, _ = engine.load_checkpoint(save_dir)
    # the first save's meeting is gone from the store once every rank passed the second
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    first = "zero/every_rank_calls/save_checkpoint/1"
    left = [name for name in (f"{first}/arrived", f"{first}/all", f"{first}/rank{rank}")
            if store.check([name])]
    return notes.messages, path, cases.train_steps(engine, 1, start=1), left


def test_a_rank_that_comes_late_is_waited_for_with_a_note(tmp_path):
    (notes0, path0, losses0, left0), (notes1, _, losses1, left1) = run_distributed(
        _rank1_late, 2, args=(str(tmp_path),), timeout=90)
    assert left0 == [] and left1 == []
    assert len(notes0) == 1 and "save_checkpoint: waiting 1 s so far for rank 1" in notes0[0]
    assert notes1 == []
    assert "/again/" in path0 and losses0 == losses1
