"""A step the ranks fail together is said once, by rank 0, with the ranks each failure met."""

import contextlib
import io

import pytest

from tests.dist_utils import run_distributed

# Each rank's failure in the cases below (None: it passed; "bug": not a user error)
CASES = {
    "every rank alike": ["no such file", "no such file", "no such file"],
    "one rank": [None, "rank 1's file is damaged", None],
    "two failures": ["a", "b", "a"],
    "a bug on rank 2": [None, "a", "bug"],
    "rank 0 passed, a bug on rank 1": [None, "bug", None],
    "a bug on rank 0": ["bug", "a", "a"],
    "nothing failed": [None, None, None],
}


def _fail_together_as_the_cli_prints_it(rank, world_size, failures):
    """What run_cli prints on this rank (and its exit code) after fail_together."""
    import os

    from megatron.cli import run_cli
    from megatron.errors import CheckpointError, TrainingError
    from megatron.runtime import rank_failures
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    rank_failures_said = []

    def step():
        met = failures[rank]
        error = None if met is None else (ValueError("boom") if met == "bug" else TrainingError(met))
        rank_failures.fail_together(error, "read the thing", CheckpointError)
        rank_failures_said.append("passed")

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = run_cli(step)
        except ValueError:
            code = "traceback"
    return code, err.getvalue(), rank_failures_said


@pytest.mark.parametrize("case", CASES)
def test_fail_together_is_said_once(case):
    results = run_distributed(_fail_together_as_the_cli_prints_it, 3, args=(CASES[case],))
    codes = [code for code, _, _ in results]
    printed = [said for _, said, _ in results]
    if case == "nothing failed":
        assert codes == [0, 0, 0] and printed == ["", "", ""]
        assert all(passed == ["passed"] for _, _, passed in results)
        return
    assert all(passed == [] for _, _, passed in results), "every rank stops"
    expected = {
        "every rank alike": "error: no such file\n",
        "one rank": "error: rank 1 could not read the thing, so every rank stops: rank 1's "
                    "file is damaged\n",
        "two failures": "error: the ranks could not read the thing, so every rank stops:\n"
                        "ranks 0, 2: a\nrank 1: b\n",
        "a bug on rank 2": "error: the ranks could not read the thing, so every rank stops:\n"
                           "rank 1: a\nrank 2: ValueError: boom (its traceback is in that "
                           "rank's output)\n",
        "rank 0 passed, a bug on rank 1": "error: rank 1 could not read the thing, so every "
                                          "rank stops: ValueError: boom (its traceback is in "
                                          "that rank's output)\n",
        "a bug on rank 0": "error: the ranks could not read the thing, so every rank stops:\n"
                           "rank 0: ValueError: boom (its traceback is in that rank's "
                           "output)\nranks 1, 2: a\n",
    }[case]
    # the first rank without a traceback of its own prints it, once
    printer = min(rank for rank in range(3) if CASES[case][rank] != "bug")
    assert printed[printer] == expected
    for rank in range(3):
        if CASES[case][rank] == "bug":
            assert codes[rank] == "traceback"  # raised as it was, for its traceback
        elif rank != printer:
            assert codes[rank] == 2 and printed[rank] == "", "said by the printing rank"
