"""Helpers for the tensor-parallel checkpoint tests: tiny pretrain_gpt2.py runs, the
tools/merge_mp_partitions.py tool, and reading checkpoint files back as flat dicts.

Vocab: 300 BPE tokens with --make-vocab-size-divisible-by 8 pads to 304 at TP=1 and TP=2 (so
those layouts compute the same function) and to 320 at TP=4.
"""

import importlib.util
import json
import os
import shutil

import torch

import pretrain_gpt2
from megatron.checkpointing import megatron_layout as checkpointing
from tests.dist_utils import free_port, run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "merge_mp_partitions.py")
VOCAB_SIZE = 300
PADDED = {1: 304, 2: 304, 4: 320}  # 300 rounded up to a multiple of 8 * TP

WORDS = ("the king queen lord night day love death sword crown honour heaven earth thou "
         "shall speak would come go hath doth good sweet fair noble brother sister father "
         "mother friend enemy war peace gold land sea ship storm wind fire water").split()


def _load_tool():
    spec = importlib.util.spec_from_file_location("merge_mp_partitions_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def pretrain_argv(corpus, log_dir, *extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--batch-size", "4",
            "--train-iters", "6", "--lr", "3e-3", "--min-lr", "3e-4", "--warmup-iters", "2",
            "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-interval", "1000",
            "--eval-iters", "1", "--num-workers", "0", "--split", "90,9,1", "--threads", "1",
            "--attention-dropout", "0", "--hidden-dropout", "0",
            "--make-vocab-size-divisible-by", "8", "--data-path", corpus["prefix"],
            "--vocab-file", corpus["vocab"], "--merge-file", corpus["merges"],
            "--log-dir", str(log_dir), *extra]


def pretrain_worker(rank, world_size, argv, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return pretrain_gpt2.main(argv)


def pretrain_tp2(argv):
    argv = argv + ["--model-parallel-size", "2"]
    assert run_distributed(pretrain_worker, 2, args=(argv, free_port())) == [0, 0]


def pretrain_tp1(argv):
    saved = {k: os.environ.pop(k, None) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        assert pretrain_gpt2.main(argv) == 0
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def losses(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


def convert(load, save, target, *extra):
    assert tool.main(["--load", load, "--save", save, "--target-model-parallel-size",
                      str(target), *extra]) == 0
    return save


def checkpoint_shards(ckpt_dir):
    """[flat dict of every tensor in mp_rank_XX, ...] for the tracked iteration."""
    iteration, release = checkpointing.read_tracker(ckpt_dir)
    shards = []
    for rank in range(8):
        path = checkpointing.get_checkpoint_name(ckpt_dir, iteration, rank, release)
        if not os.path.isfile(path):
            return shards
        shards.append(flatten(torch.load(path, weights_only=True)))
    return shards


def flatten(obj, prefix=""):
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {prefix.rstrip("/"): obj}
    return {k: v for key, value in items for k, v in flatten(value, f"{prefix}{key}/").items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def iteration_dirs(ckpt_dir):
    iteration, _ = checkpointing.read_tracker(ckpt_dir)
    base = os.path.join(ckpt_dir, f"iter_{iteration:07d}")
    return [os.path.join(base, d) for d in sorted(os.listdir(base))]


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return str(dst)
