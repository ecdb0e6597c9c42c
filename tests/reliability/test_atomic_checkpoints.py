"""kill -9 at every named point of both save paths: the tracker always names a complete,
loadable checkpoint, and resuming from it gives exactly the losses of an uninterrupted run.

Each case: train 5 iterations saving at 2 and 4 (--keep-last-n-checkpoints 1, so the save at
4 also deletes iteration 2), SIGKILLed at the named point during the save of iteration 4;
then resume from what is on disk and train to 5.  "resave" cases kill a run that went back
to iteration 2 (--ckpt-step) as it saves iteration 4 again (the tag already exists).  All runs are forked from one
interpreter (tests/reliability/harness.py), ~1 s each.
"""

import json
from pathlib import Path

import pytest
import torch

from megatron.runtime.fault_injection import SAVE_KILL_POINTS
from tests.reliability.harness import read_losses, run_sequence, step, trainer_argv
from zero.fault_injection import SAVE_KILL_POINTS as ZERO_SAVE_KILL_POINTS

KILL = "MEGATRON_FAULT_KILL_AT"
SAVES = ["--save-interval", 2, "--exit-interval", 4, "--keep-last-n-checkpoints", 1]
# (point, occurrence to kill at, scenario).  Points passed once per save are killed at their
# 2nd pass (the save of iteration 4); prune removals happen first at that save.
MEGATRON_CASES = [(p, 1 if p in ("save.prune.renamed", "save.prune.removed") else 2, "train")
                  for p in SAVE_KILL_POINTS] + [("save.file.tmp_half_written", 1, "resave"),
                                                ("save.tracker.renamed", 1, "resave")]
# Under --deepspeed (stage 1): every save writes two files (optimizer, then model states).
ZERO_CASES = [("zero.save.start", 2, "train"), ("zero.save.partial_dir_created", 2, "train"),
              ("zero.save.file.half_written", 3, "train"),
              ("zero.save.file.half_written", 4, "train"), ("zero.save.file.written", 3, "train"),
              ("zero.save.file.synced", 4, "train"), ("zero.save.files_done", 2, "train"),
              ("zero.save.publish.old_moved_aside", 1, "resave"),
              ("zero.save.publish.renamed", 2, "train"),
              ("zero.save.publish.renamed", 1, "resave"),
              ("zero.save.publish.old_removed", 2, "train"),
              ("zero.save.publish.script_copied", 2, "train"),
              ("zero.save.publish.latest_tmp_written", 2, "train"),
              ("zero.save.publish.latest_renamed", 2, "train"),
              ("save.tracker.tmp_written", 2, "train"), ("save.tracker.renamed", 2, "train"),
              ("save.prune.start", 2, "train"), ("save.prune.renamed", 1, "train"),
              ("save.prune.removed", 1, "train")]


# The default run kills at a few points of each kind (mid-file, after a rename, in the tracker
# update, in pruning, in a re-save); `pytest -m slow` kills at every point.
MEGATRON_QUICK = [MEGATRON_CASES[i] for i in (2, 5, 7, 10)] + [MEGATRON_CASES[-2]]
ZERO_QUICK = [ZERO_CASES[i] for i in (2, 7, 8, 12, 18)]
ALL = pytest.mark.slow


def test_every_named_point_is_exercised():
    assert {p for p, _, _ in MEGATRON_CASES} == set(SAVE_KILL_POINTS)
    assert set(ZERO_SAVE_KILL_POINTS) <= {p for p, _, _ in ZERO_CASES}
    assert len(MEGATRON_CASES) + len(ZERO_CASES) >= 20


def _deepspeed_flags(directory):
    config = Path(directory) / "ds_stage1.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}))
    return ["--deepspeed", "--deepspeed_config", config]


def _plan(corpus, root, cases, layout):
    """The steps: one reference run, then per case (prepare,) kill, resume."""
    steps = [step(trainer_argv(corpus, root / "ref", 5, *layout), root / "ref.out")]
    for i, (point, nth, scenario) in enumerate(cases):
        case = root / f"case{i}"
        save, argv = case / "ckpt", lambda log, iters, *extra: trainer_argv(
            corpus, case / log, iters, "--lr-decay-iters", 5, *layout, *extra)
        if scenario == "resave":  # a complete run to iteration 4; the kill re-saves 4
            steps.append(step(argv("prep", 4, "--save", save, "--save-interval", 2),
                              case / "prep.out"))
            kill = argv("kill", 4, "--load", save, "--save", save, "--ckpt-step", 2,
                        "--save-interval", 2)
        else:
            kill = argv("kill", 5, "--save", save, *SAVES)
        steps.append(step(kill, case / "kill.out", **{KILL: f"{point}@{nth}"}))
        steps.append(step(argv("resume", 5, "--load", save, "--save", case / "ckpt2"),
                          case / "resume.out"))
    return steps


def _loadable_megatron(save):
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text())
    state = torch.load(save / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=True)
    assert state["iteration"] == iteration and "optimizer" in state
    return iteration


def _loadable_deepspeed(save):
    tag = (save / "latest").read_text().strip()
    directory = save / tag
    if not directory.is_dir():  # a re-save cut short between its renames
        directory = save / f".{tag}.old"
    states = torch.load(directory / "mp_rank_00_model_states.pt", weights_only=True)
    torch.load(directory / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=True)
    assert tag == f"global_step{states['iteration']}"
    return states["iteration"]


def _check_cases(root, cases, codes, loadable):
    reference = read_losses(root / "ref")
    assert codes[0] == 0 and sorted(reference) == [1, 2, 3, 4, 5]
    codes = iter(codes[1:])
    for i, (point, nth, scenario) in enumerate(cases):
        case, what = root / f"case{i}", f"{point}@{nth} ({scenario})"
        if scenario == "resave":
            assert next(codes) == 0, (case / "prep.out").read_text()[-2000:]
        assert next(codes) == -9, f"{what} was not reached:\n" + \
            (case / "kill.out").read_text()[-2000:]
        resume_code = next(codes)
        saved_at = loadable(case / "ckpt")  # the tracker names a complete checkpoint
        assert resume_code == 0, f"{what}:\n" + (case / "resume.out").read_text()[-3000:]
        resumed = read_losses(case / "resume")
        assert sorted(resumed) == list(range(saved_at + 1, 6)), what
        assert all(resumed[it] == reference[it] for it in resumed), what  # bit for bit


@pytest.mark.parametrize("cases", [MEGATRON_QUICK, pytest.param(MEGATRON_CASES, marks=ALL)],
                         ids=["quick", "every-point"])
def test_kill_anywhere_in_a_megatron_save_loses_nothing(corpus, tmp_path, cases):
    codes = run_sequence(_plan(corpus, tmp_path, cases, []))
    _check_cases(tmp_path, cases, codes, _loadable_megatron)


@pytest.mark.parametrize("cases", [ZERO_QUICK, pytest.param(ZERO_CASES, marks=ALL)],
                         ids=["quick", "every-point"])
def test_kill_anywhere_in_a_deepspeed_save_loses_nothing(corpus, tmp_path, cases):
    layout = _deepspeed_flags(tmp_path)
    codes = run_sequence(_plan(corpus, tmp_path, cases, layout))
    _check_cases(tmp_path, cases, codes, _loadable_deepspeed)
