"""--load as users get it wrong (and the tools' checkpoint folders): a path that cannot be a
checkpoint folder is one error before anything is built; a folder that holds no checkpoint yet
starts from scratch with a note (not silently), unless --finetune asks for one; a rank that
cannot load stops every rank."""

import re
import shutil

import pytest

from megatron.errors import CheckpointError
from tests.training.test_arguments import parse


def _checkpoint(root):
    folder = root / "ckpt"
    (folder / "iter_0000004" / "mp_rank_00").mkdir(parents=True)
    (folder / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (folder / "latest_checkpointed_iteration.txt").write_text("4")
    return folder


def test_a_file_names_the_folder_above_it(tmp_path):
    folder = _checkpoint(tmp_path)
    rank_file = folder / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    with pytest.raises(CheckpointError, match=f"^--load {rank_file} is a file; --load takes a "
                                              "checkpoint folder .*: here " + str(folder)):
        parse("--load", str(rank_file))
    weights = tmp_path / "pytorch_model.bin"  # e.g. zero_to_fp32.py's output
    weights.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is a file; --load takes a checkpoint folder "
                                              r"\(the one holding latest_checkpointed_"
                                              r"iteration.txt, or 'latest' for --deepspeed\)$"):
        parse("--load", str(weights))


@pytest.mark.parametrize("extra", [[], ["--finetune"], ["--no-load-optim"]])
def test_a_folder_that_does_not_exist_is_an_error_unless_it_is_save_too(tmp_path, extra):
    missing = tmp_path / "chekpoints"
    with pytest.raises(CheckpointError, match=f"^--load {missing} does not exist: give a "
                                              "checkpoint folder"):
        parse("--load", str(missing), *extra)
    if "--finetune" in extra:
        with pytest.raises(CheckpointError, match="does not exist"):  # nothing to fine-tune
            parse("--load", str(missing), "--save", str(missing), *extra)
        return
    config = parse("--load", str(missing), "--save", str(missing), *extra)
    assert f" note: --load {missing} does not exist yet (it is --save too): training starts " \
           "from scratch" in config.notes


def test_an_empty_folder_starts_from_scratch_with_a_note_but_not_a_finetune(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f" note: --load {empty} holds no checkpoint yet: training starts from scratch" in \
        parse("--load", str(empty)).notes
    with pytest.raises(CheckpointError, match=f"^--finetune: --load {empty} holds no "
                                              "checkpoint"):
        parse("--load", str(empty), "--finetune")


def test_a_hugging_face_folder_names_the_conversion(tmp_path):
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is a Hugging Face model folder .* python "
                                              "tools/convert_checkpoint.py --load-dir "
                                              f"{hf} --save-dir DIR --saver megatron"):
        parse("--load", str(hf))


def test_a_checkpoint_folder_gets_no_note(tmp_path):
    folder = _checkpoint(tmp_path)
    assert not any("--load" in note for note in parse("--load", str(folder)).notes)


def test_exit_on_missing_checkpoint_refuses_to_train_from_scratch(tmp_path):
    flag = "--exit-on-missing-checkpoint"
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    for load, save, what in [(empty, empty, "holds no checkpoint (no "
                                             "latest_checkpointed_iteration.txt, nor 'latest' "
                                             "for --deepspeed)"),
                             (missing, missing, "does not exist"),
                             (tmp_path / "other", None, "holds no checkpoint")]:
        with pytest.raises(CheckpointError, match=f"^{flag}: --load {load} {re.escape(what)}"):
            parse("--load", str(load), *(["--save", str(save)] if save else []), flag)
    with pytest.raises(CheckpointError, match=f"^{flag} needs --load"):
        parse(flag)
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is a Hugging Face model folder"):
        parse("--load", str(hf), flag)
    folder = _checkpoint(tmp_path)
    assert parse("--load", str(folder), flag).checkpoint.load == str(folder)
    assert any("--use-checkpoint-args asks for what this trainer always does" in note
               for note in parse("--use-checkpoint-args", "--load", str(folder)).notes)
    for lonely, what in (("--use-checkpoint-args", "the checkpoint whose model flags it takes"),
                         ("--finetune", "the checkpoint whose weights it starts from")):
        with pytest.raises(CheckpointError, match=f"^{lonely} needs --load \\({what}\\)$"):
            parse(lonely)


def test_a_folder_inside_a_checkpoint_names_the_one_above(tmp_path):
    folder = _checkpoint(tmp_path)
    for inside in (folder / "iter_0000004", folder / "iter_0000004" / "mp_rank_00"):
        with pytest.raises(CheckpointError, match=f"^--load {inside} is inside a checkpoint "
                                                  f"folder: --load takes the folder above it, "
                                                  f"{folder} \\(--ckpt-step 4 loads this "
                                                  "iteration\\)$"):
            parse("--load", str(inside))
    # a folder of that name holding a checkpoint of its own (a tracker) is one
    exported = tmp_path / "exports" / "iter_0000100"
    shutil.copytree(folder, exported)
    assert parse("--load", str(exported)).checkpoint.load == str(exported)


def test_checkpoints_without_a_tracker_name_the_step_to_give(tmp_path):
    """A tracker lost (deleted, not copied): an error naming --ckpt-step, unless the folder is
    the run's own --save, where a first save cut short before its tracker leaves the same
    (a restart starts from scratch, with a note)."""
    folder = _checkpoint(tmp_path)
    (folder / "latest_checkpointed_iteration.txt").unlink()
    (folder / "global_step2").mkdir()  # (either layout's folders count, not empty ones)
    (folder / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (folder / "iter_0000007" / "mp_rank_00").mkdir(parents=True)
    message = (f"--load {folder} holds the folders of iteration(s) 2, 4 but no "
               "latest_checkpointed_iteration.txt (nor 'latest' for --deepspeed) naming the one "
               f"to load: give --ckpt-step 4, or write 4 into {folder}/latest_checkpointed_"
               "iteration.txt")
    for extra in ([], ["--finetune"], ["--save", str(folder), "--exit-on-missing-checkpoint"]):
        with pytest.raises(CheckpointError, match=f"^{re.escape(message)}$"):
            parse("--load", str(folder), *extra)
    assert f" note: --load {folder} holds iteration 4's folder but no latest_checkpointed_" \
           "iteration.txt naming a complete checkpoint (a first save cut short?): training " \
           "starts from scratch; --ckpt-step 4 loads it if it is whole" in \
        parse("--load", str(folder), "--save", str(folder)).notes
    assert parse("--load", str(folder), "--ckpt-step", "4").checkpoint.load_step == 4


def _resume_tp2_with_a_rank_file_missing(rank, world_size, out_dir, corpus):
    """Save at TP 2, remove rank 1's file, resume: each rank's exit code and stderr."""
    import contextlib
    import io
    import os

    import torch.distributed as dist

    import pretrain_gpt2
    from tests.training.test_deepspeed import trainer_argv
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    argv = trainer_argv(corpus, f"{out_dir}/log", 3, "--model-parallel-size", 2)
    assert pretrain_gpt2.main(argv + ["--save", f"{out_dir}/ckpt"]) == 0  # (ends the group)
    if rank == 0:
        os.remove(f"{out_dir}/ckpt/iter_0000003/mp_rank_01/model_optim_rng.pt")
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world_size)
    dist.barrier()  # (the file is gone)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain_gpt2.main(trainer_argv(corpus, f"{out_dir}/log2", 5,
                                               "--model-parallel-size", 2, "--load",
                                               f"{out_dir}/ckpt"))
    return code, err.getvalue()


def test_a_rank_whose_file_is_missing_stops_every_rank_and_says_incomplete(corpus, tmp_path):
    """The missing file is named as missing (not as a checkpoint of another TP size), and
    rank 0, whose own file loaded, stops too instead of training alone."""
    from tests.dist_utils import run_distributed
    results = run_distributed(_resume_tp2_with_a_rank_file_missing, 2,
                              args=(str(tmp_path), corpus))
    (code0, err0), (code1, err1) = results[0], results[1]
    assert code0 != 0 and code1 != 0
    said = "error: rank 1 could not load the checkpoint, so every rank stops: "
    assert said in err0 and "mp_rank_01/model_optim_rng.pt is missing: the checkpoint is " \
        "incomplete" in err0
    assert "saved with --model-parallel-size" not in err0
    assert "error" not in err1, "rank 0 said it, once"


def test_a_folder_of_another_kind_is_named_by_the_deepspeed_readers(tmp_path):
    """The tools' --deepspeed reader given a Hugging Face folder, and zero_to_fp32 given a
    Megatron-layout checkpoint or a file: each says what the folder is."""
    from megatron.convert.deepspeed_source import read_deepspeed_checkpoint
    from zero.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from zero.errors import CheckpointError as ZeroCheckpointError
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is a Hugging Face model folder .*: drop "
                                              "--deepspeed"):
        read_deepspeed_checkpoint(str(hf))
    folder = _checkpoint(tmp_path)
    with pytest.raises(ZeroCheckpointError, match="holds a Megatron-layout checkpoint"):
        get_fp32_state_dict_from_zero_checkpoint(str(folder))
    with pytest.raises(ZeroCheckpointError, match="is not a folder"):
        get_fp32_state_dict_from_zero_checkpoint(str(folder / "latest_checkpointed_"
                                                              "iteration.txt"))


def test_tokenizer_files_alone_keep_the_checkpoints_tokenizer_type(monkeypatch):
    """A SentencePiece checkpoint resumed with only --tokenizer-model (its model moved): the
    recorded type stays, not GPT2BPETokenizer, the default; files of the other kind replace
    the recorded tokenizer as a whole."""
    from megatron.config import from_checkpoint
    saved = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/old/m.model",
             "num_layers": 2}
    monkeypatch.setattr(from_checkpoint, "saved_args_of", lambda *args: saved)
    raw = {"load": "ck", "tokenizer_model": "new.model", "num_layers": 2}
    taken = from_checkpoint.values_from_checkpoint(raw, {"tokenizer_model"})
    assert taken == {"tokenizer_type": "SentencePieceTokenizer"}
    raw = {"load": "ck", "vocab_file": "v.json", "merge_file": "m.txt", "num_layers": 2}
    assert from_checkpoint.values_from_checkpoint(raw, {"vocab_file", "merge_file"}) == {}


def _resume_where_rank_1_sees_no_checkpoint(rank, world_size, out_dir, corpus):
    """DP 2 saves at 3; rank 1 then resumes from a folder of its own that is empty (a node's
    own disk, where nothing was copied): each rank's exit code and stderr."""
    import contextlib
    import io
    import os

    import torch.distributed as dist

    import pretrain_gpt2
    from tests.training.test_deepspeed import trainer_argv
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    argv = trainer_argv(corpus, f"{out_dir}/log", 3, micro=2)
    assert pretrain_gpt2.main(argv + ["--save", f"{out_dir}/ckpt"]) == 0  # (ends the group)
    load = f"{out_dir}/ckpt" if rank == 0 else f"{out_dir}/node1"
    os.makedirs(load, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world_size)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain_gpt2.main(trainer_argv(corpus, f"{out_dir}/log2", 5, "--load", load,
                                               micro=2))
    return code, err.getvalue()


def test_ranks_that_loaded_different_iterations_stop_before_training(corpus, tmp_path):
    """Rank 0 resumed iteration 3, rank 1 found nothing: one error on both, not a run whose
    ranks train different weights (or wait in different collectives); said by rank 0."""
    from tests.dist_utils import run_distributed
    (code0, err0), (code1, err1) = run_distributed(_resume_where_rank_1_sees_no_checkpoint, 2,
                                                   args=(str(tmp_path), corpus))
    assert code0 != 0 and code1 != 0
    assert "the ranks did not load the same checkpoint: the iteration loaded (None: " \
           "nothing) (rank 0: 3, rank 1: None). Every rank reads --load itself" in err0, err0
    assert "error" not in err1, err1


def _deepspeed_resume_where_rank_1_reads_a_damaged_copy(rank, world_size, out_dir, corpus):
    """DP 2 at ZeRO-2 saves at 3; rank 1 then resumes from a copy whose first model-states
    file (which every rank reads before the engine loads) is cut short."""
    import contextlib
    import io
    import os
    import shutil

    import torch.distributed as dist

    import pretrain_gpt2
    from tests.training.test_deepspeed import stage_config, trainer_argv
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.makedirs(f"{out_dir}/r{rank}", exist_ok=True)
    ds = ["--deepspeed", "--deepspeed_config", stage_config(f"{out_dir}/r{rank}", 2)]
    argv = trainer_argv(corpus, f"{out_dir}/log", 3, *ds, micro=2)
    assert pretrain_gpt2.main(argv + ["--save", f"{out_dir}/ckpt"]) == 0  # (ends the group)
    load = f"{out_dir}/ckpt"
    if rank == 1:
        load = f"{out_dir}/copy"
        shutil.copytree(f"{out_dir}/ckpt", load)
        states = f"{load}/global_step3/mp_rank_00_model_states.pt"
        with open(states, "r+b") as f:
            f.truncate(200)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world_size)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain_gpt2.main(trainer_argv(corpus, f"{out_dir}/log2", 5, *ds, "--load",
                                               load, micro=2))
    return code, err.getvalue()


def test_a_deepspeed_resume_agrees_once_so_a_rank_failing_early_stops_the_others(corpus,
                                                                               tmp_path):
    """Rank 1 fails before the engine's load, rank 0 inside none: one agreement for the whole
    load, so rank 0 hears of it (its error), not gloo's 'Connection closed by peer'."""
    from tests.dist_utils import run_distributed
    (code0, err0), (code1, err1) = run_distributed(
        _deepspeed_resume_where_rank_1_reads_a_damaged_copy, 2, args=(str(tmp_path), corpus))
    assert code0 != 0 and code1 != 0
    assert "error: rank 1 could not load the checkpoint, so every rank stops: " in err0, err0
    assert "mp_rank_00_model_states.pt" in err0, err0
    assert "error" not in err1, err1
