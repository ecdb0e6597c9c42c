"""Hundreds of mutated command lines and DeepSpeed configs through the real flag validation:
every rejection is a user error (MegatronError / ZeroError, or argparse's usage error), never a
TypeError/KeyError/traceback, and validation writes nothing.  A few go through the real CLI."""

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.config import resolve_config
from megatron.errors import MegatronError
from tests.parallel.launching import REPO, clean_environment
from tests.zero import ds_configs
from zero.errors import ZeroError

USER_ERRORS = (MegatronError, ZeroError)
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--batch-size", "4", "--train-iters", "6", "--lr", "3e-3",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file",
        "m.txt", "--data-path", "corpus_text_document"]
OPTIONAL = [["--global-batch-size", "16"], ["--model-parallel-size", "2"], ["--fp16"],
            ["--bf16"], ["--save", "SAVE"], ["--save-interval", "2"], ["--exit-interval", "3"],
            ["--keep-last-n-checkpoints", "2"], ["--max-nan-iterations", "3"],
            ["--exit-duration-in-mins", "5"], ["--exit-signal-handler"], ["--warmup", "0.1"],
            ["--warmup-iters", "3"], ["--lr-decay-iters", "4"], ["--min-lr", "1e-4"],
            ["--clip-grad", "0.5"], ["--checkpoint-activations"], ["--checkpoint-num-layers", "2"],
            ["--distributed-timeout-minutes", "0.5"], ["--loss-scale", "128"],
            ["--ddp-bucket-size", "1"], ["--max-position-embeddings", "64"],
            ["--model-size", "gpt2-124m"], ["--train-data", "webtext"], ["--load", "SAVE"]]
JUNK_VALUES = ["0", "-1", "-3", "1", "3", "7", "1e30", "-1e-3", "nan", "inf", "-inf", "x", "",
               "2.5", "gpt2-9000", "/nonexistent/dir"]
JUNK_JSON = [None, True, 0, -1, 3, 2.5, 1e30, float("inf"), "x", "auto", "", [], [1, "a"], {},
             {"enabled": True}, {"stage": 9}]


def _mutate_argv(rng, save_dir):
    argv = list(BASE)
    for extra in rng.sample(OPTIONAL, rng.randint(0, 5)):
        argv += extra
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        flags = [i for i, a in enumerate(argv) if a.startswith("--")]
        i = rng.choice(flags)
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if kind < 0.35 and has_value:
            argv[i + 1] = rng.choice(JUNK_VALUES)
        elif kind < 0.55:
            del argv[i:i + (2 if has_value else 1)]
        elif kind < 0.7:
            argv.insert(rng.randrange(len(argv) + 1), rng.choice(["--bogus-flag", "--lrr", "-x"]))
        elif kind < 0.85:
            argv += rng.choice(OPTIONAL)  # duplicates and conflicts
        else:
            rng.shuffle(argv)
    return [save_dir if a == "SAVE" else a for a in argv]


def _mutate_config(rng, config):
    """Delete, rename or replace a random key anywhere in the tree."""
    config = copy.deepcopy(config)
    for _ in range(rng.randint(1, 3)):
        node, path = config, []
        while isinstance(node, dict) and node and rng.random() < 0.6:
            key = rng.choice(list(node))
            if not isinstance(node[key], dict):
                break
            path.append(key)
            node = node[key]
        if not isinstance(node, dict) or not node:
            continue
        key = rng.choice(list(node))
        action = rng.random()
        if action < 0.3:
            del node[key]
        elif action < 0.5:
            node[key + rng.choice(["_", "s", "x"])] = node.pop(key)
        else:
            node[key] = rng.choice(JUNK_JSON)
    return config


def _check(argv, world_size, save_dir, outcomes):
    try:
        resolve_config(argv, world_size=world_size)
        outcomes["accepted"] += 1
    except USER_ERRORS as error:
        message = str(error)
        assert message.strip(), argv
        outcomes["user error"] += 1
    except SystemExit as exit_:  # argparse: an unknown flag or a value of the wrong type
        assert exit_.code == 2, argv
        outcomes["usage error"] += 1
    assert not os.path.exists(save_dir), f"validation created {save_dir}: {argv}"


def test_mutated_flag_sets_fail_only_with_user_errors(tmp_path, capsys):
    rng = random.Random(9)
    save_dir = str(tmp_path / "save")
    outcomes = {"accepted": 0, "user error": 0, "usage error": 0}
    for _ in range(400):
        _check(_mutate_argv(rng, save_dir), rng.choice([1, 2, 4]), save_dir, outcomes)
    capsys.readouterr()
    assert outcomes["accepted"] > 20 and outcomes["user error"] > 80, outcomes


CONFIG_SOURCES = [ds_configs.tutorial_zero2, ds_configs.zero_offload, ds_configs.zero1_era,
                  ds_configs.branch_zero_stage_2, ds_configs.docs_zero_offload]


def test_mutated_deepspeed_configs_through_the_trainer_flags(tmp_path, capsys):
    """--deepspeed --deepspeed_config <mutated JSON>: reconciling the config with the flags
    (batch sizes, precision, clipping) fails only with user errors."""
    rng = random.Random(11)
    save_dir = str(tmp_path / "save")
    outcomes = {"accepted": 0, "user error": 0, "usage error": 0}
    for n in range(200):
        config = _mutate_config(rng, rng.choice(CONFIG_SOURCES)())
        path = tmp_path / f"ds{n % 4}.json"
        path.write_text(json.dumps(config))
        argv = BASE + ["--deepspeed", "--deepspeed_config", str(path), "--save", save_dir]
        if rng.random() < 0.3:
            argv += rng.choice(OPTIONAL)
        _check(argv, rng.choice([1, 2]), save_dir, outcomes)
    capsys.readouterr()
    assert outcomes["accepted"] > 3 and outcomes["user error"] > 100, outcomes


@pytest.mark.parametrize("extra, expected", [
    (["--keep-last-n-checkpoints", "0"], "error: --keep-last-n-checkpoints must be at least 1"),
    (["--max-nan-iterations", "-1"], "error: --max-nan-iterations must be >= 0"),
    (["--num-attention-heads", "0"], "error: --num-attention-heads must be positive, got 0"),
])
def test_cli_main_prints_one_error_line_and_writes_nothing(tmp_path, capsys, extra, expected):
    import pretrain_gpt2
    save = tmp_path / "save"
    assert pretrain_gpt2.main(BASE + ["--save", str(save)] + extra) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and err.startswith(expected), err
    assert not save.exists()


def test_real_cli_subprocess_with_a_bad_deepspeed_config(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1, "stagee": 2}}))
    save = tmp_path / "save"
    argv = BASE + ["--save", str(save), "--deepspeed", "--deepspeed_config", str(config)]
    result = subprocess.run([sys.executable, "pretrain_gpt2.py", *argv], cwd=REPO,
                            env=clean_environment(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "stagee" in lines[0], \
        result.stderr
    assert "Traceback" not in result.stderr and not save.exists()
    assert not list(Path(tmp_path).glob("**/metrics.jsonl"))
