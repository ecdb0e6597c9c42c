"""tests/dist_utils.run_distributed, the harness of the gloo tests: results by rank, the
caller's environment, and a rank that fails or dies is reported at once, not after the
timeout."""

import os
import sys
import time

import pytest

from tests.dist_utils import REPO, run_distributed


def _rank_squared(rank, world_size):
    return rank * rank


def _rank_1_dies(rank, world_size):
    if rank == 1:
        os._exit(3)  # no exception to report: as a rank killed by a signal, or one that
        # could not unpickle its function
    time.sleep(600)


def _rank_1_dies_and_rank_0_then_fails(rank, world_size):
    if rank == 1:
        os._exit(3)
    raise RuntimeError("the rendezvous broke")  # what rank 0 meets when its peer is gone


def _environment_variable(rank, world_size, name):
    return os.environ.get(name)


def test_results_come_back_by_rank():
    assert run_distributed(_rank_squared, 2) == [0, 1]


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch):
    """The ranks are forked from a server started at the session's first call: they must still
    see what the caller set since, and not what it removed."""
    run_distributed(_rank_squared, 2)  # the server is running from here on
    monkeypatch.setenv("DIST_UTILS_TEST_SETTING", "set after the server started")
    monkeypatch.delenv("PATH")
    assert run_distributed(_environment_variable, 2, args=("DIST_UTILS_TEST_SETTING",)) == \
        ["set after the server started"] * 2
    assert run_distributed(_environment_variable, 2, args=("PATH",)) == [None, None]


def test_a_rank_that_dies_without_a_result_ends_the_run_at_once():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"exited without a result, exit codes \{1: 3\}"):
        run_distributed(_rank_1_dies, 2, timeout=120)
    assert time.monotonic() - start < 100  # the timeout, and rank 0's sleep, are longer


def test_a_silent_death_is_named_even_when_another_ranks_error_is_read_first():
    with pytest.raises(AssertionError) as failure:
        run_distributed(_rank_1_dies_and_rank_0_then_fails, 2, timeout=120)
    # rank 0's own error (in its function, or in the rendezvous when rank 1 left first) may
    # or may not have been read by then: the silent death comes first either way
    assert str(failure.value).startswith("rank(s) exited without a result, exit codes {1: 3}")


def _preloaded_trainer_and_start_method(rank, world_size):
    import multiprocessing
    trainer = sys.modules.get("pretrain_gpt2")  # nothing in this module imports it
    return (None if trainer is None else trainer.__file__), multiprocessing.get_start_method()


def test_ranks_have_this_checkouts_trainer_preloaded_and_the_default_start_method(
        tmp_path, monkeypatch):
    """Wherever pytest runs, the fork server preloads this checkout's trainer (it imports from
    its working directory), and a rank forks its own workers as a fresh Python would."""
    import multiprocessing
    default = multiprocessing.get_all_start_methods()[0]  # "the first is the default"
    monkeypatch.chdir(tmp_path)
    for path, method in run_distributed(_preloaded_trainer_and_start_method, world_size=2):
        assert path == str(REPO / "pretrain_gpt2.py")
        assert method == default
