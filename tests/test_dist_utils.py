"""tests/dist_utils.run_distributed, the harness of the gloo tests: results by rank, and a
rank that fails or dies is reported at once, not after the timeout."""

import os
import time

import pytest

from tests.dist_utils import run_distributed


def _rank_squared(rank, world_size):
    return rank * rank


def _rank_1_dies(rank, world_size):
    if rank == 1:
        os._exit(3)  # no exception to report: as a rank killed by a signal, or one that
        # could not unpickle its function
    time.sleep(600)


def test_results_come_back_by_rank():
    assert run_distributed(_rank_squared, 2) == [0, 1]


def test_a_rank_that_dies_without_a_result_ends_the_run_at_once():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"exited without a result, exit codes \{1: 3\}"):
        run_distributed(_rank_1_dies, 2, timeout=120)
    assert time.monotonic() - start < 100  # the timeout, and rank 0's sleep, are longer
