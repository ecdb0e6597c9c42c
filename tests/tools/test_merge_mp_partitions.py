"""tools/merge_mp_partitions.py: change the tensor-parallel size of real trainer checkpoints.

A tiny GPT-2 is trained at TP=2 in two gloo processes; its checkpoint is merged, split and
re-split.  Vocab: 300 BPE tokens with --make-vocab-size-divisible-by 8 pads to 304 at TP=1
and TP=2 (so those layouts compute the same function) and to 320 at TP=4.
"""

import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import pretrain_gpt2
from megatron.checkpointing import megatron_layout as checkpointing
from megatron import mpu
from megatron.checkpointing.megatron_layout import to_flat_state_dict
from megatron.convert import (COLUMN, REPLICATED, ROW, VOCAB, WORD_EMBEDDINGS,
                              parameter_layout, unsharded_state_dict)
from megatron.convert.optimizer_state import optimizer_group_names
from megatron.errors import CheckpointError
from tests.dist_utils import free_port, run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "merge_mp_partitions.py")
VOCAB_SIZE = 300
PADDED = {1: 304, 2: 304, 4: 320}  # 300 rounded up to a multiple of 8 * TP

_WORDS = ("the king queen lord night day love death sword crown honour heaven earth thou "
          "shall speak would come go hath doth good sweet fair noble brother sister father "
          "mother friend enemy war peace gold land sea ship storm wind fire water").split()


def _load_tool():
    spec = importlib.util.spec_from_file_location("merge_mp_partitions_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron.data.preprocessing import ConstantFactory, tokenize_loose_json
    from megatron.tokenizer import build_tokenizer
    from megatron.tokenizer.bpe_trainer import (count_pretokens, train_byte_level_bpe,
                                                write_gpt2_files)
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    texts = [" ".join(rng.choices(_WORDS, k=rng.randint(30, 90))) + "." for _ in range(150)]
    json_path = root / "data.json"
    json_path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    vocab, merges = write_gpt2_files(
        train_byte_level_bpe(count_pretokens(texts), vocab_size=VOCAB_SIZE), str(root / "tok"))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    assert tokenizer.vocab_size == VOCAB_SIZE
    prefix = str(root / "corpus")
    tokenize_loose_json(str(json_path), prefix, ConstantFactory(tokenizer), append_eod=True)
    return {"vocab": vocab, "merges": merges, "prefix": prefix + "_text_document"}


def _argv(corpus, log_dir, *extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--batch-size", "4",
            "--train-iters", "6", "--lr", "3e-3", "--min-lr", "3e-4", "--warmup-iters", "2",
            "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-interval", "1000",
            "--eval-iters", "1", "--num-workers", "0", "--split", "90,9,1", "--threads", "1",
            "--attention-dropout", "0", "--hidden-dropout", "0",
            "--make-vocab-size-divisible-by", "8", "--data-path", corpus["prefix"],
            "--vocab-file", corpus["vocab"], "--merge-file", corpus["merges"],
            "--log-dir", str(log_dir), *extra]


def _pretrain_worker(rank, world_size, argv, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return pretrain_gpt2.main(argv)


def _pretrain_tp2(argv):
    argv = argv + ["--model-parallel-size", "2"]
    assert run_distributed(_pretrain_worker, 2, args=(argv, free_port())) == [0, 0]


def _pretrain_tp1(argv):
    saved = {k: os.environ.pop(k, None) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        assert pretrain_gpt2.main(argv) == 0
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def _losses(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


@pytest.fixture(scope="module")
def tp2_run(corpus, tmp_path_factory):
    """A TP=2 fp32 checkpoint at iteration 3 of 6 (model, Adam state, RNG), and the losses
    of iterations 4-6 when TP=2 resumes from it."""
    root = tmp_path_factory.mktemp("tp2")
    save = str(root / "ckpt")
    _pretrain_tp2(_argv(corpus, root / "first", "--save", save, "--exit-interval", "3"))
    _pretrain_tp2(_argv(corpus, root / "tp2", "--load", save))
    return {"root": root, "save": save, "first": _losses(root / "first"),
            "resumed": _losses(root / "tp2")}


@pytest.fixture(scope="module")
def tp2_bf16_checkpoint(corpus, tmp_path_factory):
    """A TP=2 bf16 checkpoint: fp32 master weights in the optimizer state."""
    root = tmp_path_factory.mktemp("tp2_bf16")
    save = str(root / "ckpt")
    _pretrain_tp2(_argv(corpus, root / "log", "--bf16", "--save", save, "--train-iters", "2"))
    return save


def _convert(load, save, target, *extra):
    assert tool.main(["--load", load, "--save", save, "--target-model-parallel-size",
                      str(target), *extra]) == 0
    return save


def _shards(ckpt_dir):
    """[flat dict of every tensor in mp_rank_XX, ...] for the tracked iteration."""
    iteration, release = checkpointing.read_tracker(ckpt_dir)
    shards = []
    for rank in range(8):
        path = checkpointing.get_checkpoint_name(ckpt_dir, iteration, rank, release)
        if not os.path.isfile(path):
            return shards
        shards.append(_flatten(torch.load(path, weights_only=True)))
    return shards


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {prefix.rstrip("/"): obj}
    return {k: v for key, value in items for k, v in _flatten(value, f"{prefix}{key}/").items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ------------------------------------------------------------------------ numeric parity

def test_merged_checkpoint_continues_training_with_the_same_losses(corpus, tp2_run):
    root = tp2_run["root"]
    merged = _convert(tp2_run["save"], str(root / "merged"), 1)
    _pretrain_tp1(_argv(corpus, root / "tp1", "--load", merged, "--model-parallel-size", "1"))
    tp2, tp1 = tp2_run["resumed"], _losses(root / "tp1")
    assert sorted(tp2) == sorted(tp1) == [4, 5, 6]
    for iteration in tp2:
        assert tp1[iteration] == pytest.approx(tp2[iteration], rel=1e-5)
    assert tp2[6] < tp2_run["first"][1]  # training went on: not a frozen copy


def test_an_8bit_checkpoint_merges_and_trains_on(corpus, tmp_path):
    """--optimizer adam8bit saves codes whose blocks follow each TP shard: merging decodes
    them to fp32 moments, which TP=1 requantises on its own blocks at its first step."""
    save, eight_bit = str(tmp_path / "ckpt"), ("--optimizer", "adam8bit")
    _pretrain_tp2(_argv(corpus, tmp_path / "first", *eight_bit, "--save", save,
                        "--exit-interval", "3"))
    _pretrain_tp2(_argv(corpus, tmp_path / "tp2", *eight_bit, "--load", save))
    merged = _convert(save, str(tmp_path / "merged"), 1)
    adam = _shards(merged)[0]
    assert any(k.endswith("/exp_avg") for k in adam)
    assert not any(k.endswith("/exp_avg_codes") for k in adam)
    _pretrain_tp1(_argv(corpus, tmp_path / "tp1", *eight_bit, "--load", merged,
                        "--model-parallel-size", "1"))
    tp2, tp1 = _losses(tmp_path / "tp2"), _losses(tmp_path / "tp1")
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
    split = _convert(tp2_run["save"], str(root / "split4"), 4)
    argv = _argv(corpus, root / "tp4", "--load", split, "--model-parallel-size", "4")
    assert run_distributed(_pretrain_worker, 4, args=(argv, free_port())) == [0] * 4
    tp2, tp4 = tp2_run["resumed"], _losses(root / "tp4")
    assert sorted(tp4) == [4, 5, 6]
    assert 0.0 < tp4[4] - tp2[4] < 2 * math.log(320 / 304)
    for iteration in (5, 6):
        assert tp4[iteration] == pytest.approx(tp2[iteration], rel=2e-2)


def test_each_target_rank_is_cut_when_its_file_is_written(tp2_run, tmp_path, monkeypatch):
    """The tool holds one target rank's shards at a time: rank r's are cut after rank r-1's
    file is written, and by then nothing holds rank r-1's tensors any more (a list of every
    rank's, or a loop variable kept alive, would hold a whole checkpoint of them)."""
    import weakref

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
    _convert(tp2_run["save"], str(tmp_path / "split4"), 4)
    assert events == [event for rank in range(4)
                      for event in (f"cut {rank}", f"write mp_rank_{rank:02d}")]


def test_merged_files_hold_full_tensors_and_updated_args(tp2_run, tmp_path):
    tp2 = [torch.load(p, weights_only=True) for p in sorted(
        (os.path.join(d, "model_optim_rng.pt") for d in
         _iteration_dirs(tp2_run["save"])))]
    merged_dir = _convert(tp2_run["save"], str(tmp_path / "m"), 1)
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


def _iteration_dirs(ckpt_dir):
    iteration, _ = checkpointing.read_tracker(ckpt_dir)
    base = os.path.join(ckpt_dir, f"iter_{iteration:07d}")
    return [os.path.join(base, d) for d in sorted(os.listdir(base))]


# ------------------------------------------------------------------------ round trips

def test_split_and_merge_round_trips_are_exact(tp2_run, tmp_path):
    # Everything comes back bit for bit, RNG states included: with attention dropout 0 the
    # dropout stream of rank 1 was never advanced, so re-deriving it gives the saved state.
    original = _shards(tp2_run["save"])
    tp1 = _convert(tp2_run["save"], str(tmp_path / "tp1"), 1)
    tp2_again = _convert(tp1, str(tmp_path / "tp2"), 2)
    tp1_again = _convert(tp2_again, str(tmp_path / "tp1b"), 1)
    for before, after in zip(original, _shards(tp2_again)):
        _assert_same(before, after)
    assert len(_shards(tp2_again)) == 2
    _assert_same(_shards(tp1)[0], _shards(tp1_again)[0])


def test_pipeline_stages_round_trip_exactly(tp2_run, tmp_path):
    """TP 2 -> TP 1 x PP 2 -> TP 2 x PP 1 gives back every tensor (weights, Adam moments, fp32
    masters, RNG), and the stage files hold each stage's layers numbered from 0."""
    original = _shards(tp2_run["save"])
    staged = _convert(tp2_run["save"], str(tmp_path / "pp2"), 1,
                      "--target-pipeline-model-parallel-size", "2")
    assert [os.path.basename(d) for d in _iteration_dirs(staged)] == ["mp_rank_00_000",
                                                                      "mp_rank_00_001"]
    stages = [torch.load(os.path.join(d, "model_optim_rng.pt"), weights_only=True)
              for d in _iteration_dirs(staged)]
    for stage in stages:
        assert stage["args"]["pipeline_model_parallel_size"] == 2
        layers = {k.split(".")[1] for k in stage["model"]["language_model"]["transformer"]
                  if k.startswith("layers.")}
        assert layers == {"0"}
        groups = stage["optimizer"]["optimizer"]["param_groups"]
        assert sum(len(g["params"]) for g in groups) == \
            len(_flatten(stage["model"]))  # an optimizer entry per stage parameter
    back = _convert(staged, str(tmp_path / "tp2"), 2)
    for before, after in zip(original, _shards(back)):
        _assert_same(before, after)


def test_round_trip_keeps_fp32_master_weights_exactly(tp2_bf16_checkpoint, tmp_path):
    original = _shards(tp2_bf16_checkpoint)
    masters = [k for k in original[0] if k.startswith("optimizer/fp32_from_fp16_params")]
    assert masters and all(original[0][k].dtype == torch.float32 for k in masters)
    tp1 = _convert(tp2_bf16_checkpoint, str(tmp_path / "tp1"), 1)
    assert _shards(tp1)[0]["model/language_model/embedding/word_embeddings/weight"].dtype == \
        torch.bfloat16
    for before, after in zip(original, _shards(_convert(tp1, str(tmp_path / "tp2"), 2))):
        _assert_same(before, after)


def test_tp4_detour_gives_the_same_merge(tp2_run, tmp_path):
    direct = _convert(tp2_run["save"], str(tmp_path / "direct"), 1)
    tp4 = _convert(tp2_run["save"], str(tmp_path / "tp4"), 4)
    detour = _convert(tp4, str(tmp_path / "detour"), 1)
    assert len(_shards(tp4)) == 4
    _assert_same(_shards(direct)[0], _shards(detour)[0])


def test_rng_states_of_target_ranks(tp2_run, tmp_path):
    source = _shards(tp2_run["save"])
    tp4 = _shards(_convert(tp2_run["save"], str(tmp_path / "tp4"), 4))
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
    release = _copy(tp2_run["save"], tmp_path / "release")
    os.rename(os.path.join(release, "iter_0000003"), os.path.join(release, "release"))
    with open(os.path.join(release, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    out = _convert(release, str(tmp_path / "out"), 1)
    assert open(os.path.join(out, "latest_checkpointed_iteration.txt")).read() == "release"
    assert os.listdir(os.path.join(out, "release")) == ["mp_rank_00"]


def test_vocab_padding_is_redone_for_the_target_size(tp2_run, tmp_path):
    tp2 = _shards(tp2_run["save"])
    key = "model/language_model/embedding/word_embeddings/weight"
    moment = "optimizer/optimizer/state/0/exp_avg_sq"
    source = {name: torch.cat([s[name] for s in tp2]) for name in (key, moment)}
    tp4 = _shards(_convert(tp2_run["save"], str(tmp_path / "tp4"), 4))
    assert [s[key].shape[0] for s in tp4] == [PADDED[4] // 4] * 4
    assert all(s["args/padded_vocab_size"] == PADDED[4] for s in tp4)
    for name in (key, moment):
        full = torch.cat([s[name] for s in tp4])
        assert torch.equal(full[:PADDED[2]], source[name])  # tokens + padding kept
        assert not full[PADDED[2]:].any()  # the new padding rows are zeros
        assert source[name][VOCAB_SIZE:].abs().sum() > 0  # (the old padding was trained)
    state_dict = unsharded_state_dict(tp2_run["save"])
    assert torch.equal(state_dict[WORD_EMBEDDINGS], source[key][:VOCAB_SIZE])


def test_unsharded_state_dict_takes_vocab_size_and_checks_it(tp2_run):
    state_dict = unsharded_state_dict(tp2_run["save"], vocab_size=297)
    assert state_dict[WORD_EMBEDDINGS].shape == (297, 32)
    with pytest.raises(CheckpointError, match="pads to 288"):
        unsharded_state_dict(tp2_run["save"], vocab_size=280)


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


# ------------------------------------------------------------------------ errors

def test_loading_at_another_tp_size_converts_as_it_loads(corpus, tp2_run, tmp_path, capsys):
    """The trainer's --load converts in memory what this tool writes to disk, and says so."""
    argv = _argv(corpus, tmp_path / "log", "--load", tp2_run["save"])
    assert pretrain_gpt2.main(argv) == 0
    out = capsys.readouterr().out
    assert ("saved at tensor-parallel size 2 x 1 pipeline stage(s); converted to "
            "tensor-parallel size 1 x 1 pipeline stage(s)") in out


def test_a_rank_converting_as_it_loads_cuts_its_own_shards_one_full_tensor_at_a_time(
        tp2_run, tmp_path, monkeypatch):
    """--load at TP=4 on rank 1: the tool's mp_rank_01 file. No other rank's shard is made,
    and each full tensor is merged when it is cut and dropped before the next, so the rank
    holds its shards and one parameter's full tensors (its two Adam moments at most), not
    every rank's part or the whole full form (memory a large model does not have)."""
    import weakref
    from megatron.convert import online, optimizer_state, reshard, tp_layout
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
    mpu.set_model_parallel_world_size(4)
    mpu.set_model_parallel_rank(1)
    try:
        mine, note = online.convert_for_this_rank(tp2_run["save"])
    finally:
        mpu.destroy_model_parallel()
    assert cut_for == {1} and "converted to tensor-parallel size 4" in note
    assert len(merged) > 10 and most_alive[0] == 2  # exp_avg with exp_avg_sq
    _assert_same(_flatten(mine), _shards(_convert(tp2_run["save"], str(tmp_path / "t"), 4))[1])


def test_tp1_checkpoint_loaded_by_tp_rank_1_names_the_tool(tp2_run, tmp_path):
    merged = _convert(tp2_run["save"], str(tmp_path / "m"), 1)
    checkpoint = SimpleNamespace(load=merged, save=None)
    mpu.set_model_parallel_world_size(2)
    mpu.set_model_parallel_rank(1)  # this rank's file does not exist at TP=1
    try:
        with pytest.raises(CheckpointError, match="merge_mp_partitions.py") as error:
            checkpointing.load_checkpoint(None, None, checkpoint, {"model_parallel_size": 2},
                                          torch.device("cpu"))
        assert "saved with --model-parallel-size 1" in str(error.value)
    finally:
        mpu.destroy_model_parallel()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _tool_error(capsys, *argv):
    assert tool.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_bad_inputs_are_clear_errors(tp2_run, tmp_path, capsys):
    save = tp2_run["save"]
    broken = _copy(save, tmp_path / "no_rank1")
    shutil.rmtree(os.path.join(broken, "iter_0000003", "mp_rank_01"))
    err = _tool_error(capsys, "--load", broken, "--save", str(tmp_path / "o1"))
    assert "mp_rank_01/model_optim_rng.pt is missing" in err
    assert "model_parallel_size 2" in err

    untracked = _copy(save, tmp_path / "no_tracker")
    os.remove(os.path.join(untracked, "latest_checkpointed_iteration.txt"))
    err = _tool_error(capsys, "--load", untracked, "--save", str(tmp_path / "o2"))
    assert "latest_checkpointed_iteration.txt" in err and "--iteration" in err
    # ... and naming the iteration explicitly works.
    _convert(untracked, str(tmp_path / "o2"), 1, "--iteration", "3")

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("hello")
    assert "not a checkpoint directory" in _tool_error(capsys, "--load", str(plain))
    assert "is not a directory" in _tool_error(capsys, "--load", str(tmp_path / "nowhere"))
    err = _tool_error(capsys, "--load", save, "--iteration", "7")
    assert "iter_0000003" in err

    not_ours = _copy(save, tmp_path / "not_ours")
    torch.save({"weights": torch.zeros(2)}, os.path.join(
        not_ours, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    assert "not saved by pretrain_gpt2.py" in _tool_error(capsys, "--load", not_ours)


def test_command_line_runs_as_a_script(tmp_path):
    result = subprocess.run([sys.executable, TOOL, "--load", str(tmp_path / "nowhere")],
                            capture_output=True, text=True, cwd=str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith("error: --load") and "Traceback" not in result.stderr


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
    _convert(save, out, 1)
    assert "already exists" in _tool_error(capsys, "--load", save, "--save", out)
    # Megatron's spelling of the source size is accepted when it agrees; default --save.
    assert tool.main(["--load", save, "--model-parallel-size", "2",
                      "--target-model-parallel-size", "2"]) == 0
    assert os.path.isfile(os.path.join(save + "_mp2", "iter_0000003", "mp_rank_01",
                                       "model_optim_rng.pt"))
    shutil.rmtree(save + "_mp2")
