"""pretrain_gpt2.py with --checkpoint-activations and DeepSpeed's activation checkpointing
options: 20 iterations with dropout on train exactly as without checkpointing (bit for bit on
CPU in fp32), with and without --deepspeed; every flag acts or is refused clearly."""

import pytest

from megatron.config import resolve_config
from megatron.config.sections import RecomputeOptions
from megatron.errors import ConfigError
from tests.training.test_deepspeed import (NO_DROPOUT, read_losses, run, stage_config,
                                           trainer_argv)

ITERS = 20
ALL_OPTIONS = ["--partition-activations", "--contigious-checkpointing", "--checkpoint-in-cpu",
               "--synchronize-each-layer", "--profile-backward"]


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("plain")
    assert run(corpus, log_dir, ITERS) == 0
    return read_losses(log_dir)


def test_losses_match_without_deepspeed(corpus, tmp_path, plain, capsys):
    assert run(corpus, tmp_path / "mpu", ITERS, "--checkpoint-activations") == 0
    assert read_losses(tmp_path / "mpu") == plain
    assert run(corpus, tmp_path / "ds", ITERS, "--checkpoint-activations",
               "--split-transformers", *ALL_OPTIONS) == 0
    assert read_losses(tmp_path / "ds") == plain
    out = capsys.readouterr().out
    assert "turn(s) on --deepspeed-activation-checkpointing" in out
    assert "with --model-parallel-size 1 each rank keeps them whole (no-op)" in out
    # --profile-backward: 4 checkpoints (2 layers split in halves) timed after each backward
    assert out.count(" activation checkpoint times (ms, forward/recompute/backward): 0: ") \
        == ITERS
    assert " | 3: " in out and " | 4: " not in out


def test_losses_match_with_deepspeed_config_section(corpus, tmp_path, capsys):
    baseline = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 2)]
    assert run(corpus, tmp_path / "base", ITERS, *baseline) == 0
    section = {"partition_activations": True, "contiguous_memory_optimization": True,
               "cpu_checkpointing": True, "number_checkpoints": 7}
    config = stage_config(tmp_path / "..", 2, activation_checkpointing=section)
    assert run(corpus, tmp_path / "ckpt", ITERS, "--deepspeed", "--deepspeed_config", config,
               "--checkpoint-activations") == 0
    assert read_losses(tmp_path / "ckpt") == read_losses(tmp_path / "base")
    out = capsys.readouterr().out
    assert "'activation_checkpointing.number_checkpoints' 7 replaced by 2" in out


def _parse(corpus, tmp_path, *extra):
    return resolve_config(trainer_argv(corpus, tmp_path, 2, *NO_DROPOUT, *extra),
                          defaults={"tokenizer_type": "GPT2BPETokenizer"}, world_size=1)


def test_flags_reconcile_with_the_config(corpus, tmp_path):
    config = stage_config(tmp_path, 1, activation_checkpointing={"profile": True})
    recompute = _parse(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config,
                       "--checkpoint-activations", "--distribute-checkpointed-activations",
                       "--checkpoint-num-layers", "2").activation_checkpointing
    assert recompute.deepspeed_activation_checkpointing == RecomputeOptions(
        partition_activations=True, checkpoint_in_cpu=False, contiguous_checkpointing=False,
        num_checkpoints=1, synchronize=False, profile=True)
    recompute = _parse(corpus, tmp_path, "--checkpoint-activations").activation_checkpointing
    assert recompute.checkpoint_activations
    assert recompute.deepspeed_activation_checkpointing is None  # Megatron's own recompute
    assert recompute.notes == ()
    counted = stage_config(tmp_path / "..", 1, activation_checkpointing={"number_checkpoints": 4})
    recompute = _parse(corpus, tmp_path, "--deepspeed", "--deepspeed_config", counted,
                       "--checkpoint-activations").activation_checkpointing
    assert recompute.deepspeed_activation_checkpointing is None
    assert recompute.notes == (" note: 'activation_checkpointing.number_checkpoints' not used: "
                               "it sizes DeepSpeed's activation checkpointing, which is off (add "
                               "--deepspeed-activation-checkpointing)",)
    # the config's "gradient_checkpointing" turns --checkpoint-activations on: not asked again
    (tmp_path / "on").mkdir()
    on = stage_config(tmp_path / "on", 1, gradient_checkpointing=True,
                      activation_checkpointing={"number_checkpoints": 4})
    recompute = _parse(corpus, tmp_path, "--deepspeed", "--deepspeed_config",
                       on).activation_checkpointing
    assert recompute.checkpoint_activations
    assert recompute.notes[0].endswith("which is off (add --deepspeed-activation-checkpointing)")
    recompute = _parse(corpus, tmp_path, "--deepspeed", "--deepspeed_config",
                       counted).activation_checkpointing
    assert recompute.notes[0].endswith("(add --checkpoint-activations "
                                       "--deepspeed-activation-checkpointing)")


@pytest.mark.parametrize("extra, message", [
    (["--partition-activations"], "--partition-activations acts on the checkpoints of "
                                  "--checkpoint-activations, which is off"),
    (["--split-transformers"], "--split-transformers acts on"),
    (["--deepspeed-activation-checkpointing"], "add --checkpoint-activations"),
    (["--checkpoint-num-layers", "2"], "--checkpoint-num-layers acts on the checkpoints of "
                                       "--checkpoint-activations, which is off"),
    (["--checkpoint-activations", "--checkpoint-num-layers", "3"],
     "--checkpoint-num-layers 3 does not divide --num-layers 2"),
])
def test_bad_flags_are_clear_errors(corpus, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _parse(corpus, tmp_path, *extra)


def test_config_section_without_checkpoint_activations_is_an_error(corpus, tmp_path):
    config = stage_config(tmp_path, 1, activation_checkpointing={"cpu_checkpointing": True})
    with pytest.raises(ConfigError, match="'activation_checkpointing.cpu_checkpointing' acts"):
        _parse(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config)
