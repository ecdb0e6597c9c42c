"""--kill-switch-file (Megatron-DeepSpeed's): the file appearing stops every rank at the same
iteration, saved, exit 0; a run that finds it at start-up trains nothing; a file one rank sees
stops them all; a path the file could never appear at is a flag error."""

import json
import time
from types import SimpleNamespace

import pytest

from megatron.config import resolve_config
from megatron.errors import ConfigError
from tests.dist_utils import run_distributed
from tests.parallel.launching import kill_session, launch_ranks, start_launcher, trainer_argv


def _metrics_iterations(log_dir):
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()
            if line.strip() and "lm_loss" in line]


def test_the_file_stops_every_rank_saved_and_a_later_start_trains_nothing(corpus, tmp_path):
    switch, save, log = tmp_path / "STOP", tmp_path / "ckpt", tmp_path / "log"
    argv = trainer_argv(corpus, log, 200, "--batch-size", 2, "--save", save,
                        "--kill-switch-file", switch)
    launcher = start_launcher(argv, 2, tmp_path / "run")
    try:
        deadline = time.monotonic() + 120
        while max(_metrics_iterations(log), default=0) < 2:
            assert time.monotonic() < deadline and launcher.returncode is None, "no iteration 2"
            time.sleep(0.1)
        switch.touch()
        launcher.wait(timeout=120)
    finally:
        kill_session(launcher)
    codes = json.loads((tmp_path / "run" / "exit_codes.json").read_text())
    outputs = [(tmp_path / "run" / f"rank{r}.out").read_text() for r in range(2)]
    assert codes == [0, 0], outputs[0][-3000:]
    stopped = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= stopped < 200
    assert f" exiting at iteration {stopped}: found the kill switch {switch} " \
           "(--kill-switch-file), checkpoint saved" in outputs[0]
    assert max(_metrics_iterations(log)) == stopped  # every rank stopped there

    # the next job of a chain finds it at once: nothing is trained, loaded or written
    results = launch_ranks(argv + ["--load", save], 2, tmp_path / "again")
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    assert f" found the kill switch {switch} (--kill-switch-file): exiting before training; " \
           "remove it to train" in results[0][1]
    assert "loaded checkpoint" not in results[0][1]
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == stopped


def _a_switch_only_rank_1_sees(rank, world_size, folder):
    """Each rank watches its own path (a node's local disk); only rank 1's exists."""
    import torch

    from megatron.runtime.fault_tolerance import ExitConditions, kill_switch_found
    path = f"{folder}/STOP{rank}"
    if rank == 1:
        open(path, "w").close()
    training = SimpleNamespace(kill_switch_file=path, exit_signal_handler=False,
                               exit_duration_in_mins=None)
    conditions = ExitConditions(training, torch.device("cpu"))
    try:
        return kill_switch_found(path, torch.device("cpu")), conditions.reason()
    finally:
        conditions.close()


def test_a_switch_one_rank_sees_stops_every_rank(tmp_path):
    results = run_distributed(_a_switch_only_rank_1_sees, 2, args=(str(tmp_path),))
    for rank, (found, reason) in enumerate(results):
        assert found
        assert reason == f"found the kill switch {tmp_path}/STOP{rank} (--kill-switch-file)"


def _argv(corpus, *extra):
    return trainer_argv(corpus, "log", 2, "--batch-size", 2, *extra)


@pytest.mark.parametrize("path, said", [
    ("{tmp}", "is a folder: give the path of a file whose creation stops the run (such as "
              "{tmp}/STOP)"),
    ("{tmp}/no/such/STOP", "its folder {tmp}/no/such does not exist, so the file could never "
                           "appear there"),
    ("", "--kill-switch-file is empty"),
])
def test_a_path_the_file_could_never_appear_at_is_an_error(corpus, tmp_path, path, said):
    with pytest.raises(ConfigError) as error:
        resolve_config(_argv(corpus, "--kill-switch-file", path.format(tmp=tmp_path)))
    assert said.format(tmp=tmp_path) in str(error.value)


def test_a_file_that_is_not_there_yet_is_taken(corpus, tmp_path):
    config = resolve_config(_argv(corpus, "--kill-switch-file", tmp_path / "STOP"))
    assert config.training.kill_switch_file == str(tmp_path / "STOP")
