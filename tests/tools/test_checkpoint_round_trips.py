"""Checkpoint conversions give back every tensor: TP and pipeline-stage round trips (weights,
Adam moments, fp32 masters, RNG states), vocab padding redone for the target size, release
checkpoints, and the key map that says how each parameter is split."""

import json
import os

import pytest
import torch

from megatron.convert import (COLUMN, REPLICATED, ROW, VOCAB, WORD_EMBEDDINGS, parameter_layout,
                              resolve_vocab_size, unsharded_state_dict)
from megatron.convert.optimizer_state import optimizer_group_names
from megatron.errors import CheckpointError
from tests.tools.tp_checkpoints import (PADDED, VOCAB_SIZE, assert_same, checkpoint_shards, convert,
                                        copy_checkpoint, flatten, iteration_dirs)

# ------------------------------------------------------------------------ round trips


def test_split_and_merge_round_trips_are_exact(tp2_run, tmp_path):
    # Everything comes back bit for bit, RNG states included: with attention dropout 0 the
    # dropout stream of rank 1 was never advanced, so re-deriving it gives the saved state.
    original = checkpoint_shards(tp2_run["save"])
    tp1 = convert(tp2_run["save"], str(tmp_path / "tp1"), 1)
    tp2_again = convert(tp1, str(tmp_path / "tp2"), 2)
    tp1_again = convert(tp2_again, str(tmp_path / "tp1b"), 1)
    for before, after in zip(original, checkpoint_shards(tp2_again)):
        assert_same(before, after)
    assert len(checkpoint_shards(tp2_again)) == 2
    assert_same(checkpoint_shards(tp1)[0], checkpoint_shards(tp1_again)[0])


def test_pipeline_stages_round_trip_exactly(tp2_run, tmp_path):
    """TP 2 -> TP 1 x PP 2 -> TP 2 x PP 1 gives back every tensor (weights, Adam moments, fp32
    masters, RNG), and the stage files hold each stage's layers numbered from 0."""
    original = checkpoint_shards(tp2_run["save"])
    staged = convert(tp2_run["save"], str(tmp_path / "pp2"), 1,
                      "--target-pipeline-model-parallel-size", "2")
    assert [os.path.basename(d) for d in iteration_dirs(staged)] == ["mp_rank_00_000",
                                                                      "mp_rank_00_001"]
    stages = [torch.load(os.path.join(d, "model_optim_rng.pt"), weights_only=True)
              for d in iteration_dirs(staged)]
    for stage in stages:
        assert stage["args"]["pipeline_model_parallel_size"] == 2
        layers = {k.split(".")[1] for k in stage["model"]["language_model"]["transformer"]
                  if k.startswith("layers.")}
        assert layers == {"0"}
        groups = stage["optimizer"]["optimizer"]["param_groups"]
        assert sum(len(g["params"]) for g in groups) == \
            len(flatten(stage["model"]))  # an optimizer entry per stage parameter
    back = convert(staged, str(tmp_path / "tp2"), 2)
    for before, after in zip(original, checkpoint_shards(back)):
        assert_same(before, after)


def test_round_trip_keeps_fp32_master_weights_exactly(tp2_bf16_checkpoint, tmp_path):
    original = checkpoint_shards(tp2_bf16_checkpoint)
    masters = [k for k in original[0] if k.startswith("optimizer/fp32_from_fp16_params")]
    assert masters and all(original[0][k].dtype == torch.float32 for k in masters)
    tp1 = convert(tp2_bf16_checkpoint, str(tmp_path / "tp1"), 1)
    assert checkpoint_shards(tp1)[0]["model/language_model/embedding/word_embeddings/weight"].dtype == \
        torch.bfloat16
    for before, after in zip(original, checkpoint_shards(convert(tp1, str(tmp_path / "tp2"), 2))):
        assert_same(before, after)


def test_tp4_detour_gives_the_same_merge(tp2_run, tmp_path):
    direct = convert(tp2_run["save"], str(tmp_path / "direct"), 1)
    tp4 = convert(tp2_run["save"], str(tmp_path / "tp4"), 4)
    detour = convert(tp4, str(tmp_path / "detour"), 1)
    assert len(checkpoint_shards(tp4)) == 4
    assert_same(checkpoint_shards(direct)[0], checkpoint_shards(detour)[0])


def test_rng_states_of_target_ranks(tp2_run, tmp_path):
    source = checkpoint_shards(tp2_run["save"])
    tp4 = checkpoint_shards(convert(tp2_run["save"], str(tmp_path / "tp4"), 4))
    stream = "rng_tracker_states/model-parallel-rng/cpu"
    for shard in tp4:  # the replicated generators: rank 0's everywhere
        for key in ("torch_rng_state", "np_rng_state/keys", "random_rng_state/state/0"):
            assert torch.equal(torch.as_tensor(shard[key]), torch.as_tensor(source[0][key]))
    for rank in (0, 1):  # the per-rank dropout stream continues where it was
        assert torch.equal(tp4[rank][stream], source[rank][stream])
    for rank in (2, 3):  # new ranks: seeded as mpu.model_parallel_cuda_manual_seed would
        expected = torch.Generator().manual_seed(1234 + 2718 + rank).get_state()
        assert torch.equal(tp4[rank][stream], expected)


def test_release_checkpoints_stay_release(tp2_run, tmp_path):
    release = copy_checkpoint(tp2_run["save"], tmp_path / "release")
    os.rename(os.path.join(release, "iter_0000003"), os.path.join(release, "release"))
    with open(os.path.join(release, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    out = convert(release, str(tmp_path / "out"), 1)
    assert open(os.path.join(out, "latest_checkpointed_iteration.txt")).read() == "release"
    assert os.listdir(os.path.join(out, "release")) == ["mp_rank_00"]


def test_vocab_padding_is_redone_for_the_target_size(tp2_run, tmp_path):
    tp2 = checkpoint_shards(tp2_run["save"])
    key = "model/language_model/embedding/word_embeddings/weight"
    moment = "optimizer/optimizer/state/0/exp_avg_sq"
    source = {name: torch.cat([s[name] for s in tp2]) for name in (key, moment)}
    tp4 = checkpoint_shards(convert(tp2_run["save"], str(tmp_path / "tp4"), 4))
    assert [s[key].shape[0] for s in tp4] == [PADDED[4] // 4] * 4
    assert all(s["args/padded_vocab_size"] == PADDED[4] for s in tp4)
    for name in (key, moment):
        full = torch.cat([s[name] for s in tp4])
        assert torch.equal(full[:PADDED[2]], source[name])  # tokens + padding kept
        assert not full[PADDED[2]:].any()  # the new padding rows are zeros
        assert source[name][VOCAB_SIZE:].abs().sum() > 0  # (the old padding was trained)
    state_dict = unsharded_state_dict(tp2_run["save"])
    assert torch.equal(state_dict[WORD_EMBEDDINGS], source[key][:VOCAB_SIZE])


def test_a_vocab_size_other_than_the_recorded_one_is_refused(tp2_run):
    state_dict = unsharded_state_dict(tp2_run["save"], vocab_size=VOCAB_SIZE)
    assert state_dict[WORD_EMBEDDINGS].shape == (VOCAB_SIZE, 32)
    with pytest.raises(CheckpointError, match=r"--vocab-size 297 disagrees with the vocab size "
                                              r"the checkpoint records \(300\)"):
        unsharded_state_dict(tp2_run["save"], vocab_size=297)


def test_a_vocab_size_given_for_an_old_checkpoint_must_pad_to_its_rows():
    old_args = {"padded_vocab_size": 304, "make_vocab_size_divisible_by": 8,
                "model_parallel_size": 2}  # saved before orig_vocab_size was recorded
    assert resolve_vocab_size(old_args, vocab_size=297) == 297
    with pytest.raises(CheckpointError, match="pads to 288"):
        resolve_vocab_size(old_args, vocab_size=280)


def test_tokenizer_files_of_another_size_are_refused_even_when_they_pad_alike(tp2_run,
                                                                              tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")  # a byte-level BPE of 298 tokens: pads to 304 too
    vocab.write_text(json.dumps({**{chr(i): i for i in range(297)}, "<|endoftext|>": 297}))
    with pytest.raises(CheckpointError, match="hold 298 tokens, but the checkpoint was trained "
                                              "with a tokenizer of 300"):
        unsharded_state_dict(tp2_run["save"],
                             tokenizer_files={"vocab_file": str(vocab), "merge_file": str(merges)})


# ------------------------------------------------------------------------ key map


def test_key_map_matches_the_model_tags_and_optimizer_groups():
    from megatron.model import GPT2Model, GPTConfig
    from megatron.training.param_groups import get_param_groups
    torch.manual_seed(0)
    model = GPT2Model(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                vocab_size=64, max_position_embeddings=16))
    for name, param in model.named_parameters():
        split = parameter_layout(name).split
        if not getattr(param, "model_parallel", False):
            assert split == REPLICATED, name
        elif param.partition_dim == 1:
            assert split == ROW, name
        else:
            assert split == (VOCAB if name == WORD_EMBEDDINGS else COLUMN), name
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in get_param_groups(model)]
    assert optimizer_group_names(list(model.state_dict())) == groups
