"""Checkpoints written by an earlier version of the code still load, resume and convert.

tests/compat/fixtures holds what `make_fixtures.py` wrote with that version: tiny GPT-2 runs
saved at iteration 2 in every layout (Megatron fp32/fp16/bf16 at TP 1 and 2, tiled; ZeRO
stages 1-3 at DP 2, tiled stage 3), a Hugging Face folder converted from one of them, and
what the old code logged when it resumed each to iteration 4 and what it generated.
"""

import importlib.util
import json
import math
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import pretrain_gpt2
from tests.compat.make_fixtures import CASES, REPO, case_flags
from tests.parallel.launching import launch_ranks

FIXTURES = Path(__file__).parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


@pytest.fixture
def fixtures(tmp_path):
    """A copy of the fixtures: training writes index maps next to the data."""
    root = tmp_path / "fixtures"
    shutil.copytree(FIXTURES, root)
    return root


def _train(name, fixtures, work_dir, *extra):
    nproc, flags = case_flags(name, fixtures)
    argv = [str(a) for a in (*flags, "--load", fixtures / "checkpoints" / name,
                             "--log-dir", work_dir / "log", *extra)]
    if nproc == 1:
        assert pretrain_gpt2.main(argv) == 0
    else:
        for code, output in launch_ranks(argv, nproc, work_dir / "ranks", timeout=240):
            assert code == 0, output[-3000:]
    with open(work_dir / "log" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if "lm_loss" in line]


def _close(a, b, rtol):
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_continues_the_old_run(fixtures, tmp_path, name):
    """Iterations 3 and 4 after resuming the old checkpoint are the old code's iterations
    3 and 4: same data position, learning rate, loss scale, and (through the optimizer
    state and the RNG streams, dropout is on) the same losses and gradient norms."""
    records = _train(name, fixtures, tmp_path)
    expected = EXPECTED["cases"][name]
    assert [r["iteration"] for r in records] == [e["iteration"] for e in expected] == [3, 4]
    for got, want in zip(records, expected):
        for key in ("consumed_samples", "skipped_iters", "loss_scale"):
            assert got[key] == want[key], (key, got, want)
        assert _close(got["lr"], want["lr"], 1e-12), (got, want)
        assert _close(got["lm_loss"], want["lm_loss"], 2e-6), (got, want)
        assert _close(got["grad_norm"], want["grad_norm"], 1e-4), (got, want)


def _megatron_file(root, iteration, rank=0):
    return root / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"


def _tensors(tree, prefix=""):
    """{path: tensor} of every tensor in a nest of dicts and lists."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else \
        enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    found = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}/{key}"))
    return found


@pytest.mark.parametrize("name", ["megatron_fp32", "megatron_fp16", "megatron_tiled_fp32"])
def test_megatron_checkpoint_saved_again_holds_the_same_state(fixtures, tmp_path, name):
    """Loading the old file and saving it again (no training step) writes the same weights,
    Adam moments, fp32 masters and RNG states."""
    save = tmp_path / "again"
    _train(name, fixtures, tmp_path, "--train-iters", "2", "--lr-decay-iters", "4",
           "--save", save)
    old = torch.load(_megatron_file(fixtures / "checkpoints" / name, 2), weights_only=True)
    new = torch.load(_megatron_file(save, 2), weights_only=True)
    for key in ("model", "optimizer", "torch_rng_state", "rng_tracker_states"):
        old_tensors, new_tensors = _tensors(old[key]), _tensors(new[key])
        if key == "optimizer":  # the loss scaler's own bookkeeping may be stored differently
            old_tensors = {k: v for k, v in old_tensors.items() if "grad_scaler" not in k}
            new_tensors = {k: v for k, v in new_tensors.items() if "grad_scaler" not in k}
        assert sorted(old_tensors) == sorted(new_tensors), key
        for path, tensor in old_tensors.items():
            assert torch.equal(tensor, new_tensors[path]), (key, path)
    assert old["iteration"] == new["iteration"] == 2
    # the old file carried no run id: the resumed run goes on as the unmarked run; it records
    # the epochs its train split's maps span, which the old file did not
    assert new["train_state"].pop("train_epochs") >= 1
    assert {**old["train_state"], "run_id": ""} == new["train_state"]


def test_generation_from_old_checkpoints(fixtures, tmp_path):
    """tools/generate_samples.py on the old Megatron checkpoint and on the HF folder converted
    from it by the old code: the same greedy text as the old code generated."""
    spec = importlib.util.spec_from_file_location(
        "generate_samples_tool", REPO / "tools" / "generate_samples.py")
    generate_samples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate_samples)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(EXPECTED["prompt"] + "\n")
    for source, expected in EXPECTED["generation"].items():
        out = tmp_path / f"{source}.jsonl"
        assert generate_samples.main([
            "--load", str(fixtures / "checkpoints" / source),
            "--vocab-file", str(fixtures / "data" / "vocab.json"),
            "--merge-file", str(fixtures / "data" / "merges.txt"), "--greedy",
            "--out-seq-length", "12", "--sample-input-file", str(prompts),
            "--sample-output-file", str(out)]) == 0
        assert [json.loads(line) for line in out.read_text().splitlines()] == expected


def test_a_checkpoint_in_torchs_legacy_format_is_read_for_conversion(fixtures):
    """Files torch.save wrote before torch 1.6 (not zip) cannot be memory-mapped: conversion
    reads them whole, so `--load` still sees the layout they were saved at and converts them
    to the same tensors as the zip files."""
    from megatron.convert.checkpoint_files import read_sharded_checkpoint
    from megatron.convert.online import saved_layout
    zipped = fixtures / "checkpoints" / "megatron_bf16_tp2"
    legacy = fixtures / "checkpoints" / "legacy_bf16_tp2"
    shutil.copytree(zipped, legacy)
    for path in legacy.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        torch.save(torch.load(path, weights_only=True), path,
                   _use_new_zipfile_serialization=False)
        assert not zipfile.is_zipfile(path)
    assert saved_layout(str(legacy)) == saved_layout(str(zipped)) == (2, 1, None)
    old, new = read_sharded_checkpoint(str(legacy)), read_sharded_checkpoint(str(zipped))
    for rank, (a, b) in enumerate(zip(old.shards, new.shards)):
        assert a["model"].keys() == b["model"].keys(), rank
        for key in a["model"]:
            torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0)
