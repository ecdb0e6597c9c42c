"""Entry points: one error line (once per job, not once per rank), Ctrl-C as exit code 130."""

import pytest

from megatron.cli import run_cli
from megatron.errors import ConfigError, DataError, Interrupted, TrainingError


def _raise(error):
    def main():
        raise error
    return main


@pytest.mark.parametrize("rank", ["0", "3"])
def test_errors_every_rank_meets_alike_are_printed_by_rank_0_only(monkeypatch, capsys, rank):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets them
    for error in (ConfigError("bad flag"), DataError("bad file")):
        assert run_cli(_raise(error)) == 2
        printed = capsys.readouterr().err
        assert printed == (f"error: {error}\n" if rank == "0" else "")


def test_rank_specific_errors_are_printed_by_every_rank(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert run_cli(_raise(TrainingError("rank 3: a collective failed"))) == 2
    assert capsys.readouterr().err == "error: rank 3: a collective failed\n"


def test_ctrl_c_is_exit_code_130_without_a_traceback(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert run_cli(_raise(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert run_cli(_raise(Interrupted(" stopped by Ctrl-C after saving"))) == 130
    assert capsys.readouterr().err == " stopped by Ctrl-C after saving\n"
    assert run_cli(_raise(Interrupted(""))) == 130  # other ranks: rank 0 said it
    assert capsys.readouterr().err == ""


def test_success_is_0():
    assert run_cli(lambda: None) == 0
