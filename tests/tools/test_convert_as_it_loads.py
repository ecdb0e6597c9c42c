"""pretrain_gpt2.py --load of a checkpoint saved at another tensor-parallel or pipeline size:
each rank converts in memory what tools/merge_mp_partitions.py writes to disk, cutting only
its own shards of its own stage, one full tensor at a time."""

import os
import shutil
import weakref
from types import SimpleNamespace

import pytest
import torch

import pretrain_gpt2
from megatron import mpu
from megatron.checkpointing import megatron_layout as checkpointing
from megatron.errors import CheckpointError
from tests.tools.tp_checkpoints import (assert_same, checkpoint_shards, convert, flatten,
                                        iteration_dirs, pretrain_argv)


def test_loading_at_another_tp_size_converts_as_it_loads(corpus, tp2_run, tmp_path, capsys):
    """The trainer's --load converts in memory what tools/merge_mp_partitions.py writes to
    disk, and says so."""
    argv = pretrain_argv(corpus, tmp_path / "log", "--load", tp2_run["save"])
    assert pretrain_gpt2.main(argv) == 0
    out = capsys.readouterr().out
    assert ("saved at tensor-parallel size 2 x 1 pipeline stage(s); converted to "
            "tensor-parallel size 1 x 1 pipeline stage(s)") in out


def _convert_on_rank(load_dir, tp, rank, step=None):
    """What `--load load_dir` (`--ckpt-step step`) converts on tensor-parallel rank `rank` of
    `tp` (mpu's overrides stand in for the process group)."""
    from megatron.convert import online
    mpu.set_model_parallel_world_size(tp)
    mpu.set_model_parallel_rank(rank)
    try:
        return online.convert_for_this_rank(load_dir, step)
    finally:
        mpu.destroy_model_parallel()


def test_a_rank_converting_as_it_loads_cuts_its_own_shards_one_full_tensor_at_a_time(
        tp2_run, tmp_path, monkeypatch):
    """--load at TP=4 on rank 1: the tool's mp_rank_01 file. No other rank's shard is made,
    and each full tensor is merged when it is cut and dropped before the next, so the rank
    holds its shards and one parameter's full tensors (its two Adam moments at most), not
    every rank's part or the whole full form (memory a large model does not have)."""
    from megatron.convert import optimizer_state, reshard, tp_layout
    cut_for, merged, most_alive = set(), [], [0]

    def recording_shard_of(full, split, num_partitions, rank):
        cut_for.add(rank)
        return tp_layout.shard_of(full, split, num_partitions, rank)

    def recording_merge_shards(name, shards, split, **options):
        full = tp_layout.merge_shards(name, shards, split, **options)
        if not any(full is shard for shard in shards):  # a copy, not a file's tensor
            merged.append(weakref.ref(full))
            most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in merged))
        return full
    for module in (reshard, optimizer_state):  # the model's tensors, the optimizer's
        monkeypatch.setattr(module, "shard_of", recording_shard_of)
        monkeypatch.setattr(module, "merge_shards", recording_merge_shards)
    mine, note = _convert_on_rank(tp2_run["save"], tp=4, rank=1)
    assert cut_for == {1} and "converted to tensor-parallel size 4" in note
    assert len(merged) > 10 and most_alive[0] == 2  # exp_avg with exp_avg_sq
    tool_files = checkpoint_shards(convert(tp2_run["save"], str(tmp_path / "t"), 4))
    assert_same(flatten(mine), tool_files[1])


@pytest.mark.parametrize("tp, stage, held", [
    (2, 1, (".layers.1.", "final_layernorm")),   # the same vocab padding
    (4, 0, (".layers.0.", ".embedding.")),      # the embeddings re-padded to 320 rows
])
def test_a_rank_of_a_pipeline_stage_merges_only_its_stages_tensors(tp2_run, tmp_path,
                                                                   monkeypatch, tp, stage, held):
    """--load at TP x 2 pipeline stages on tensor-parallel rank 1 of a stage: the tool's
    mp_rank_01_00<stage> file, and the full tensors merged (weights, moments, masters) are those
    of the stage's parameters only (its layer of 2, the embeddings or the final LayerNorm),
    not every stage's."""
    from megatron.convert import optimizer_state, reshard, tp_layout
    merged_names = set()

    def recording_merge_shards(name, shards, split, **options):
        merged_names.add(name)
        return tp_layout.merge_shards(name, shards, split, **options)
    for module in (reshard, optimizer_state):
        monkeypatch.setattr(module, "merge_shards", recording_merge_shards)
    monkeypatch.setattr(mpu, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(mpu, "get_pipeline_model_parallel_rank", lambda: stage)
    mine, note = _convert_on_rank(tp2_run["save"], tp=tp, rank=1)
    assert f"converted to tensor-parallel size {tp} x 2 pipeline stage(s)" in note
    assert merged_names and all(any(part in name for part in held)
                                for name in merged_names), sorted(merged_names)
    staged = convert(tp2_run["save"], str(tmp_path / "pp2"), tp,
                     "--target-pipeline-model-parallel-size", "2")
    tool_file = [d for d in iteration_dirs(staged)
                 if os.path.basename(d) == f"mp_rank_01_{stage:03d}"]
    assert_same(flatten(mine), flatten(torch.load(os.path.join(tool_file[0], "model_optim_rng.pt"),
                                                  weights_only=True)))


def test_tp1_checkpoint_loaded_by_tp_rank_1_names_the_tool(tp2_run, tmp_path):
    merged = convert(tp2_run["save"], str(tmp_path / "m"), 1)
    checkpoint = SimpleNamespace(load=merged, load_step=None, save=None)
    mpu.set_model_parallel_world_size(2)
    mpu.set_model_parallel_rank(1)  # this rank's file does not exist at TP=1
    try:
        with pytest.raises(CheckpointError, match="merge_mp_partitions.py") as error:
            checkpointing.load_checkpoint(None, None, checkpoint, {"model_parallel_size": 2},
                                          torch.device("cpu"))
        assert "saved with --model-parallel-size 1" in str(error.value)
    finally:
        mpu.destroy_model_parallel()


def test_an_older_step_is_the_one_converted(tp2_run, tmp_path):
    """--ckpt-step 3 converts iteration 3 when the tracker names a newer one, here one whose
    files are damaged, of another size."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tp2_run["save"], folder)
    newer = folder / "iter_0000007"
    for rank in range(3):
        (newer / f"mp_rank_{rank:02d}").mkdir(parents=True)
        (newer / f"mp_rank_{rank:02d}" / "model_optim_rng.pt").write_bytes(b"damaged")
    (folder / "latest_checkpointed_iteration.txt").write_text("7")
    mine, note = _convert_on_rank(str(folder), tp=4, rank=1, step=3)
    assert "saved at tensor-parallel size 2 x 1 pipeline stage(s)" in note
    tool_files = checkpoint_shards(convert(tp2_run["save"], str(tmp_path / "t"), 4))
    assert_same(flatten(mine), tool_files[1])
