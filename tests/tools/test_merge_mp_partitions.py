"""tools/merge_mp_partitions.py: change the tensor-parallel size of real trainer checkpoints.

A tiny GPT-2 trained at TP=2 in two gloo processes (tests/tools/conftest.py) is merged and
split; the converted checkpoints train on with the same losses. Also the tool's errors, and
its memory: one target rank's shards at a time.
"""

import math
import os
import shutil
import socket
import subprocess
import sys
import weakref

import pytest
import torch

from megatron.checkpointing.state_dicts import to_flat_state_dict
from megatron.convert import REPLICATED, WORD_EMBEDDINGS, parameter_layout
from tests.dist_utils import free_port, run_distributed
from tests.tools.tp_checkpoints import (PADDED, TOOL, checkpoint_shards, convert, copy_checkpoint,
                                        iteration_dirs, losses, pretrain_argv, pretrain_tp1,
                                        pretrain_tp2, pretrain_worker, tool)

# ------------------------------------------------------------------------ numeric parity


def test_merged_checkpoint_continues_training_with_the_same_losses(corpus, tp2_run, capsys):
    """... resumed in place too: the merged checkpoint carries the run it continues (its mark
    beside it), so that run's retention may prune it, and no note calls it another run's."""
    root = tp2_run["root"]
    merged = convert(tp2_run["save"], str(root / "merged"), 1)
    assert os.path.isfile(os.path.join(merged, ".iter_0000003.run_id"))
    capsys.readouterr()
    pretrain_tp1(pretrain_argv(corpus, root / "tp1", "--load", merged, "--save", merged,
                               "--model-parallel-size", "1"))
    assert "of another run" not in capsys.readouterr().out
    tp2, tp1 = tp2_run["resumed"], losses(root / "tp1")
    assert sorted(tp2) == sorted(tp1) == [4, 5, 6]
    for iteration in tp2:
        assert tp1[iteration] == pytest.approx(tp2[iteration], rel=1e-5)
    assert tp2[6] < tp2_run["first"][1]  # training went on: not a frozen copy


def test_an_8bit_checkpoint_merges_and_trains_on(corpus, tmp_path):
    """--optimizer adam8bit saves codes whose blocks follow each TP shard: merging decodes
    them to fp32 moments, which TP=1 requantises on its own blocks at its first step."""
    save, eight_bit = str(tmp_path / "ckpt"), ("--optimizer", "adam8bit")
    pretrain_tp2(pretrain_argv(corpus, tmp_path / "first", *eight_bit, "--save", save,
                        "--exit-interval", "3"))
    pretrain_tp2(pretrain_argv(corpus, tmp_path / "tp2", *eight_bit, "--load", save))
    merged = convert(save, str(tmp_path / "merged"), 1)
    adam = checkpoint_shards(merged)[0]
    assert any(k.endswith("/exp_avg") for k in adam)
    assert not any(k.endswith("/exp_avg_codes") for k in adam)
    pretrain_tp1(pretrain_argv(corpus, tmp_path / "tp1", *eight_bit, "--load", merged,
                        "--model-parallel-size", "1"))
    tp2, tp1 = losses(tmp_path / "tp2"), losses(tmp_path / "tp1")
    assert sorted(tp1) == sorted(tp2) == [4, 5, 6]
    assert tp1[4] == pytest.approx(tp2[4], rel=1e-5)  # the same weights
    for iteration in (5, 6):  # requantised on other blocks: close, not equal
        assert tp1[iteration] == pytest.approx(tp2[iteration], rel=1e-2)


@pytest.mark.slow
def test_split_checkpoint_trains_at_tp4(corpus, tp2_run):
    """TP=4 pads the vocab to 320, not 304.  The 16 new zero rows only add probability mass
    to the softmax, so the loss rises, by about log(320 / 304) = 0.051 for this nearly
    uniform model, then training goes on as at TP=2."""
    root = tp2_run["root"]
    split = convert(tp2_run["save"], str(root / "split4"), 4)
    argv = pretrain_argv(corpus, root / "tp4", "--load", split, "--model-parallel-size", "4")
    assert run_distributed(pretrain_worker, 4, args=(argv, free_port())) == [0] * 4
    tp2, tp4 = tp2_run["resumed"], losses(root / "tp4")
    assert sorted(tp4) == [4, 5, 6]
    assert 0.0 < tp4[4] - tp2[4] < 2 * math.log(320 / 304)
    for iteration in (5, 6):
        assert tp4[iteration] == pytest.approx(tp2[iteration], rel=2e-2)


def test_merged_files_hold_full_tensors_and_updated_args(tp2_run, tmp_path):
    tp2 = [torch.load(p, weights_only=True) for p in sorted(
        (os.path.join(d, "model_optim_rng.pt") for d in
         iteration_dirs(tp2_run["save"])))]
    merged_dir = convert(tp2_run["save"], str(tmp_path / "m"), 1)
    merged = torch.load(os.path.join(merged_dir, "iter_0000003", "mp_rank_00",
                                     "model_optim_rng.pt"), weights_only=True)
    assert open(os.path.join(merged_dir, "latest_checkpointed_iteration.txt")).read() == "3"
    assert merged["args"]["model_parallel_size"] == 1
    assert merged["args"]["padded_vocab_size"] == PADDED[1]
    assert merged["iteration"] == 3 and merged["train_state"] == tp2[0]["train_state"]
    full = to_flat_state_dict(merged["model"])
    parts = [to_flat_state_dict(s["model"]) for s in tp2]
    qkv = "language_model.transformer.layers.1.attention.query_key_value.weight"
    assert full[qkv].shape == (96, 32)
    # Per-head rows [np, 3, hn]: rank 0 owns heads 0-1, rank 1 heads 2-3.
    assert torch.equal(full[qkv].view(4, 3, 8, 32)[2:], parts[1][qkv].view(2, 3, 8, 32))
    dense = "language_model.transformer.layers.0.mlp.dense_4h_to_h.weight"
    assert torch.equal(full[dense][:, 64:], parts[1][dense])
    assert full[WORD_EMBEDDINGS].shape == (PADDED[1], 32)
    assert torch.equal(full[WORD_EMBEDDINGS][152:], parts[1][WORD_EMBEDDINGS])
    adam = merged["optimizer"]["optimizer"]
    assert adam["param_groups"] == tp2[0]["optimizer"]["optimizer"]["param_groups"]
    assert adam["state"][0]["exp_avg"].shape == (PADDED[1], 32)  # index 0: word embeddings
    assert not [p for p in os.listdir(merged_dir) if ".tmp" in p]


def test_each_target_rank_is_cut_when_its_file_is_written(tp2_run, tmp_path, monkeypatch):
    """The tool holds one target rank's shards at a time: rank r's are cut after rank r-1's
    file is written, and by then nothing holds rank r-1's tensors any more (a list of every
    rank's, or a loop variable kept alive, would hold a whole checkpoint of them)."""
    import megatron.convert.checkpoint_files as checkpoint_files
    import megatron.convert.reshard as reshard
    events, written = [], []
    cut, save = reshard.checkpoint_of_rank, checkpoint_files.atomic_torch_save

    def cutting(full, tp, rank):
        alive = [ref for ref in written if ref() is not None]
        events.append(f"cut {rank}" + (f" with {len(alive)} written tensors alive"
                                       if alive else ""))
        return cut(full, tp, rank)

    def saving(contents, path):
        # the cut shards (replicated tensors are the source's own, alive with it)
        written.extend(weakref.ref(t) for name, t in to_flat_state_dict(contents["model"]).items()
                       if parameter_layout(name).split != REPLICATED)
        events.append(f"write {os.path.basename(os.path.dirname(path))}")
        save(contents, path)
    monkeypatch.setattr(reshard, "checkpoint_of_rank", cutting)
    monkeypatch.setattr(checkpoint_files, "atomic_torch_save", saving)
    convert(tp2_run["save"], str(tmp_path / "split4"), 4)
    assert events == [event for rank in range(4)
                      for event in (f"cut {rank}", f"write mp_rank_{rank:02d}")]


# ------------------------------------------------------------------------ errors


def _tool_error(capsys, *argv):
    assert tool.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_bad_inputs_are_clear_errors(tp2_run, tmp_path, capsys):
    save = tp2_run["save"]
    broken = copy_checkpoint(save, tmp_path / "no_rank1")
    shutil.rmtree(os.path.join(broken, "iter_0000003", "mp_rank_01"))
    err = _tool_error(capsys, "--load", broken, "--save", str(tmp_path / "o1"))
    assert "mp_rank_01/model_optim_rng.pt is missing" in err
    assert "model_parallel_size 2" in err

    untracked = copy_checkpoint(save, tmp_path / "no_tracker")
    os.remove(os.path.join(untracked, "latest_checkpointed_iteration.txt"))
    err = _tool_error(capsys, "--load", untracked, "--save", str(tmp_path / "o2"))
    assert "holds iter_0000003 but no latest_checkpointed_iteration.txt naming the one to " \
           "read: give it, with --iteration N (merge_mp_partitions.py" in err
    # ... and naming the iteration explicitly works.
    convert(untracked, str(tmp_path / "o2"), 1, "--iteration", "3")

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("hello")
    assert "is not a Megatron-layout checkpoint folder: it has no latest_checkpointed_" \
           "iteration.txt" in _tool_error(capsys, "--load", str(plain))
    assert "is not a directory" in _tool_error(capsys, "--load", str(tmp_path / "nowhere"))
    err = _tool_error(capsys, "--load", save, "--iteration", "7")
    assert "iter_0000003" in err

    for inner in (os.path.join(save, "iter_0000003"),
                  os.path.join(save, "iter_0000003", "mp_rank_01")):
        err = _tool_error(capsys, "--load", inner, "--save", str(tmp_path / "o3"))
        assert err.startswith(f"error: {inner} is a") and \
            f"give the checkpoint folder above it, {os.path.abspath(save)} (its tracker" in err
    err = _tool_error(capsys, "--load", save, "--deepspeed", "--save", str(tmp_path / "o4"))
    assert err.startswith(f"error: {save} holds a Megatron-layout checkpoint (written without "
                          "--deepspeed): read it without --deepspeed")

    not_ours = copy_checkpoint(save, tmp_path / "not_ours")
    torch.save({"weights": torch.zeros(2)}, os.path.join(
        not_ours, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    assert "not saved by pretrain_gpt2.py" in _tool_error(capsys, "--load", not_ours)


def test_an_older_iteration_written_beside_a_newer_one_keeps_the_tracker(tp2_run, tmp_path,
                                                                          capsys):
    older = copy_checkpoint(tp2_run["save"], tmp_path / "older")
    os.rename(os.path.join(older, "iter_0000003"), os.path.join(older, "iter_0000001"))
    with open(os.path.join(older, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    out = convert(tp2_run["save"], str(tmp_path / "out"), 1)
    capsys.readouterr()
    convert(older, out, 1)
    assert (f" note: {out} also holds iteration 3, which its tracker keeps naming: --load {out} "
            "reads iteration 3, not 1 (--ckpt-step 1 reads it)") in capsys.readouterr().out
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "3"
    assert os.path.isdir(os.path.join(out, "iter_0000001"))


def test_an_interrupted_conversion_leaves_no_partial_copy(tp2_run, tmp_path, monkeypatch,
                                                         capsys):
    import megatron.convert.checkpoint_files as checkpoint_files
    written = []

    def save_then_interrupt(state, path):
        if written:
            raise KeyboardInterrupt
        written.append(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)

    monkeypatch.setattr(checkpoint_files, "atomic_torch_save", save_then_interrupt)
    out = tmp_path / "out"
    assert tool.main(["--load", tp2_run["save"], "--save", str(out),
                      "--target-model-parallel-size", "2"]) == 130
    assert written and "Traceback" not in capsys.readouterr().err
    assert not out.exists() or os.listdir(out) == []
    # a conversion killed outright (SIGKILL: no cleanup) leaves its staging folder; the next
    # conversion there removes it, and says so (a live process's is left alone)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out.mkdir(exist_ok=True)
    here = socket.gethostname()
    for name in (f"{here}-{dead.pid}", f"{here}-{os.getppid()}", f"node7-{dead.pid}"):
        (out / f".iter_0000003.tmp.{name}" / "mp_rank_00").mkdir(parents=True)
    monkeypatch.undo()
    assert tool.main(["--load", tp2_run["save"], "--save", str(out),
                      "--target-model-parallel-size", "2"]) == 0
    assert f" removed {out}/.iter_0000003.tmp.{here}-{dead.pid}, left by a conversion that " \
        "was killed" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == sorted([
        ".iter_0000003.run_id", f".iter_0000003.tmp.{here}-{os.getppid()}",
        f".iter_0000003.tmp.node7-{dead.pid}", "iter_0000003",
        "latest_checkpointed_iteration.txt"])  # (another machine's may be alive: left)


def test_command_line_runs_as_a_script(tmp_path):
    result = subprocess.run([sys.executable, TOOL, "--load", str(tmp_path / "nowhere")],
                            capture_output=True, text=True, cwd=str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith("error: the checkpoint folder") and "Traceback" not in result.stderr


def test_bad_flags_are_clear_errors(tp2_run, tmp_path, capsys):
    save = tp2_run["save"]
    out = str(tmp_path / "out")
    err = _tool_error(capsys, "--load", save, "--save", out, "--model-parallel-size", "4")
    assert "disagrees" in err and "model_parallel_size 2" in err
    err = _tool_error(capsys, "--load", save, "--save", out,
                      "--target-model-parallel-size", "3")
    assert "num_attention_heads 4 (4 % 3 = 1)" in err
    assert "--save must differ" in _tool_error(capsys, "--load", save, "--save", save)
    err = _tool_error(capsys, "--load", save, "--save", out, "--vocab-file",
                      str(tmp_path / "missing.json"))
    assert "--vocab-size" in err and "missing.json" in err
    convert(save, out, 1)
    assert "already exists" in _tool_error(capsys, "--load", save, "--save", out)
    # Megatron's spelling of the source size is accepted when it agrees; default --save.
    assert tool.main(["--load", save, "--model-parallel-size", "2",
                      "--target-model-parallel-size", "2"]) == 0
    assert (f" resume with: torchrun --nproc_per_node 2 pretrain_gpt2.py --load {save}_mp2 "
            "--model-parallel-size 2 ...") in capsys.readouterr().out
    assert os.path.isfile(os.path.join(save + "_mp2", "iter_0000003", "mp_rank_01",
                                       "model_optim_rng.pt"))
    shutil.rmtree(save + "_mp2")


def test_the_printed_commands_quote_a_path_with_spaces(tmp_path):
    from megatron.convert.checkpoint_files import trainer_command
    from megatron.runtime.fault_tolerance import last_checkpoint_description
    assert trainer_command("/runs/my model", 2) == \
        "torchrun --nproc_per_node 2 pretrain_gpt2.py --load '/runs/my model' " \
        "--model-parallel-size 2"
    assert trainer_command("ckpt", 1) == "python pretrain_gpt2.py --load ckpt --model-parallel-size 1"
    save = tmp_path / "my run"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    assert last_checkpoint_description(str(save))() == \
        f"resume from iteration 3 with --load '{save}'"
