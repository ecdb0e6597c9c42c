"""--ckpt-step N (Megatron-LM's) and --load-tag TAG (Megatron-DeepSpeed's): load an older
iteration than the tracker names, a rollback, exactly as a resume of that iteration would, in
either layout; a step the folder does not hold is one error that lists those it does."""

import os

import pytest

from megatron.errors import CheckpointError
from tests.training.test_arguments import parse
from tests.training.test_deepspeed import read_losses, run, stage_config


def _saved_every_two(corpus, tmp_path, *extra):
    """A 6-iteration run saving at 2, 4 and 6 into tmp_path/ckpt; its losses."""
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "full", 6, *extra, "--save", save, "--save-interval", 2) == 0
    return save, read_losses(tmp_path / "full")


def test_a_rollback_resumes_the_older_iteration_exactly(corpus, tmp_path, capsys):
    save, full = _saved_every_two(corpus, tmp_path)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "6"
    capsys.readouterr()
    assert run(corpus, tmp_path / "rollback", 6, "--load", save, "--ckpt-step", 2) == 0
    assert f" note: --ckpt-step 2: loading iteration 2 of --load {save}, not its newest (6)\n" \
        in capsys.readouterr().out
    rollback = read_losses(tmp_path / "rollback")
    assert sorted(rollback) == [3, 4, 5, 6]
    assert rollback == {i: full[i] for i in (3, 4, 5, 6)}


def test_a_rollback_over_its_own_save_leaves_the_later_checkpoints(corpus, tmp_path):
    """--keep-last-n-checkpoints prunes the new timeline's older checkpoints, never the ones
    after it (the timeline rolled back from), until the run saves over them."""
    save, _ = _saved_every_two(corpus, tmp_path)
    assert run(corpus, tmp_path / "rollback", 3, "--load", save, "--save", save, "--ckpt-step",
               2, "--save-interval", 1, "--keep-last-n-checkpoints", 1) == 0
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert sorted(path.name for path in save.glob("iter_*")) == [
        "iter_0000003", "iter_0000004", "iter_0000006"]


def test_a_deepspeed_rollback_by_its_tag_resumes_exactly(corpus, tmp_path):
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 1)]
    save, full = _saved_every_two(corpus, tmp_path, *ds)
    assert (save / "latest").read_text().strip() == "global_step6"
    assert run(corpus, tmp_path / "rollback", 6, *ds, "--load", save,
               "--load-tag", "global_step4") == 0
    assert read_losses(tmp_path / "rollback") == {i: full[i] for i in (5, 6)}


def test_a_megatron_layout_step_loads_under_deepspeed(corpus, tmp_path):
    """--deepspeed with a Megatron-layout folder: the step's folder decides the layout."""
    save, _ = _saved_every_two(corpus, tmp_path)
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 1)]
    assert run(corpus, tmp_path / "ds", 4, *ds, "--load", save, "--ckpt-step", 2) == 0
    assert sorted(read_losses(tmp_path / "ds")) == [3, 4]


def _folder(root, *steps, tracker=None):
    """A folder of (empty) Megatron-layout checkpoints of `steps`."""
    folder = root / "ckpt"
    for step in steps:
        (folder / f"iter_{step:07d}" / "mp_rank_00").mkdir(parents=True)
        (folder / f"iter_{step:07d}" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    if tracker is not None:
        (folder / "latest_checkpointed_iteration.txt").write_text(str(tracker))
    return folder


def test_the_chosen_step_and_the_note_of_a_rollback_over_its_own_save(tmp_path):
    folder = _folder(tmp_path, 2, 4, tracker=4)
    assert parse("--load", str(folder), "--ckpt-step", "4").checkpoint.load_step == 4
    config = parse("--load", str(folder), "--load-tag", "iter_0000002", "--save", str(folder))
    assert config.checkpoint.load_step == 2
    assert f" note: --load-tag iter_0000002: loading iteration 2 of --load {folder}, not its " \
           "newest (4); this run saves over the later ones as it reaches them, and a restart " \
           "given --load-tag iter_0000002 again goes back to 2 again: drop the flag once this " \
           "run has saved" in config.notes
    (folder / "iter_0000009" / "mp_rank_00").mkdir(parents=True)  # an empty shell: none
    assert "not its newest (4)" in " ".join(parse("--load", str(folder), "--ckpt-step",
                                                   "2").notes)
    os.remove(folder / "latest_checkpointed_iteration.txt")  # a lost tracker: the step decides
    assert parse("--load", str(folder), "--ckpt-step", "2").checkpoint.load_step == 2
    with pytest.raises(CheckpointError, match="give --ckpt-step 4, or write 4 into"):
        parse("--load", str(folder))


@pytest.mark.parametrize("flags, message", [
    (["--ckpt-step", "2"], "--ckpt-step 2 needs --load (the folder holding that checkpoint)"),
    (["--ckpt-step", "-1", "--load", "{folder}"], "--ckpt-step -1 must be 0 or more, got -1"),
    (["--ckpt-step", "3", "--load", "{folder}"],
     "--ckpt-step 3: --load {folder} holds no checkpoint of iteration 3 (its iterations: 2, 4)"),
    (["--load-tag", "global_step3", "--load", "{folder}"],
     "--load-tag global_step3: --load {folder} holds no checkpoint of iteration 3 (its "
     "iterations: 2, 4)"),
    (["--ckpt-step", "3", "--load", "{empty}"],
     "--ckpt-step 3: --load {empty} holds no checkpoint of iteration 3 (its iterations: none)"),
    (["--ckpt-step", "3", "--load", "{missing}", "--save", "{missing}"],
     "--ckpt-step 3: --load {missing} does not exist"),
    (["--load-tag", "latest", "--load", "{folder}"],
     "--load-tag 'latest': this trainer's checkpoint folders are global_stepN (--deepspeed) "
     "and iter_NNNNNNN; give one of those, or the iteration as --ckpt-step N"),
    (["--load-tag", "iter_2", "--load", "{folder}"], "--load-tag 'iter_2': this trainer's"),
    (["--ckpt-step", "0", "--load", "{release}"],
     "--ckpt-step 0: --load {release} holds no checkpoint of iteration 0 (its iterations: "
     "none); its 'release' checkpoint loads without the flag"),
    (["--ckpt-step", "2", "--load-tag", "global_step4", "--load", "{folder}"],
     "--ckpt-step 2 and --load-tag global_step4 name different iterations; give one"),
])
def test_a_step_that_cannot_be_loaded_is_one_error(tmp_path, flags, message):
    paths = {"folder": _folder(tmp_path, 2, 4, tracker=4), "empty": tmp_path / "empty",
             "missing": tmp_path / "missing", "release": tmp_path / "converted"}
    paths["empty"].mkdir()
    (paths["release"] / "release" / "mp_rank_00").mkdir(parents=True)
    (paths["release"] / "latest_checkpointed_iteration.txt").write_text("release")
    flags = [flag.format(**paths) for flag in flags]
    with pytest.raises(CheckpointError) as error:
        parse(*flags)
    assert str(error.value).startswith(message.format(**paths))


def test_the_resume_advice_of_a_rollback_drops_the_step(tmp_path):
    """Resumed with --ckpt-step 2 still given, a run would go back to 2 again: the advice a
    stopped or failed run prints says to leave it out."""
    from megatron.runtime.fault_tolerance import last_checkpoint_description
    from megatron.training.pretrain import _how_to_resume
    folder = _folder(tmp_path, 2, 4, tracker=4)
    config = parse("--load", str(folder), "--save", str(folder), "--ckpt-step", "2")
    assert _how_to_resume(config) == (
        f" stopped by Ctrl-C after saving to {folder}; to resume, run the same command, without "
        "--ckpt-step/--load-tag (with it the run goes back to iteration 2)")
    assert last_checkpoint_description(str(folder), 2)() == (
        f"resume from iteration 4 with --load {folder}, without --ckpt-step/--load-tag (with it "
        "the run goes back to iteration 2)")
    assert last_checkpoint_description(str(folder))() == \
        f"resume from iteration 4 with --load {folder}"
