"""Hugging Face's "auto" values in a DeepSpeed config (its Trainer's convention): the
batch, clipping, precision and schedule keys take the Megatron flags' values."""

import pytest

from megatron.config import resolve_config
from megatron.errors import ConfigError
from tests.training.test_deepspeed import write_config
from tests.training.test_deepspeed_config import BASE, parse


def test_hugging_face_auto_batch_and_clipping_keys_take_the_flags(tmp_path):
    config = write_config(tmp_path, "auto.json", train_batch_size="auto",
                          train_micro_batch_size_per_gpu="auto",
                          gradient_accumulation_steps="auto", gradient_clipping="auto")
    parsed = parse("--deepspeed", "--deepspeed_config", config, "--global-batch-size", 16,
                   "--clip-grad", 0.5, world_size=2)
    assert (parsed.training.batch_size, parsed.training.global_batch_size,
            parsed.training.num_micro_batches) == (4, 16, 2)
    assert parsed.engine.ds_config.gradient_clipping == 0.5
    parsed = parse("--deepspeed", "--deepspeed_config", config, "--global-batch-size", 16,
                   world_size=2)
    assert parsed.engine.ds_config.gradient_clipping == 1.0  # --clip-grad's default, as HF's
    without = [a for i, a in enumerate(BASE) if "--batch-size" not in BASE[max(i - 1, 0):i + 1]]
    with pytest.raises(ConfigError, match="--batch-size is required: DeepSpeed config"):
        resolve_config(without + ["--deepspeed", "--deepspeed_config", config])
    # only the accumulation steps: --batch-size is the micro batch they multiply
    steps_only = write_config(tmp_path, "gas.json", gradient_accumulation_steps=2)
    parsed = parse("--deepspeed", "--deepspeed_config", steps_only, world_size=2)
    assert (parsed.training.global_batch_size, parsed.training.num_micro_batches) == (16, 2)


def test_hugging_face_auto_precision_follows_the_flags(tmp_path):
    fp16 = write_config(tmp_path, "fp16.json", fp16={"enabled": "auto", "loss_scale_window": 50})
    parsed = parse("--deepspeed", "--deepspeed_config", fp16, "--fp16")
    assert parsed.precision.fp16 and parsed.engine.ds_config.fp16.loss_scale_window == 50
    parsed = parse("--deepspeed", "--deepspeed_config", fp16)
    assert not parsed.precision.fp16 and not parsed.precision.bf16
    bf16 = write_config(tmp_path, "bf16.json", bfloat16={"enabled": "auto"})
    assert parse("--deepspeed", "--deepspeed_config", bf16, "--bf16").precision.bf16


def test_hugging_face_auto_schedule_takes_megatrons_schedule(tmp_path):
    """As Hugging Face's Trainer fills them: warmup_min_lr 0, warmup_max_lr --lr,
    warmup_num_steps the warmup iterations, total_num_steps the decay iterations; the flags
    that filled a key get no "not used" note."""
    config = write_config(tmp_path, scheduler={"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}})
    parsed = parse("--deepspeed", "--deepspeed_config", config, "--lr", "5e-4",
                   "--warmup-iters", 2, "--min-lr", "1e-5")
    assert parsed.engine.ds_config.scheduler.params == {
        "warmup_min_lr": 0.0, "warmup_max_lr": 5e-4, "warmup_num_steps": 2,
        "total_num_steps": 10}
    assert parsed.notes[-1] == (" note: --min-lr not used: the 'scheduler' section of "
                                f"DeepSpeed config {config} sets the learning rate under "
                                "--deepspeed, not Megatron's schedule")
    assert not any("--lr," in note or "--warmup-iters" in note for note in parsed.notes)
    fraction = parse("--deepspeed", "--deepspeed_config", config, "--warmup", "0.15")
    assert fraction.optimizer.warmup_steps == 1.5  # a whole number of steps in the JSON:
    assert fraction.engine.ds_config.scheduler.params["warmup_num_steps"] == 2  # rounded up
    with pytest.raises(ConfigError, match=r"the warmup \(20 iterations, from --warmup-iters "
                                          r"20\) must lie between 0 and the decay's end \(10 "
                                          r"iterations, from --train-iters 10\)"):
        parse("--deepspeed", "--deepspeed_config", config, "--warmup-iters", 20)
    # WarmupCosineLR scales the optimizer's lr: --lr is used where it sets that lr
    cosine = write_config(tmp_path, "cosine.json", scheduler={
        "type": "WarmupCosineLR", "params": {"total_num_steps": "auto",
                                             "warmup_num_steps": "auto"}})
    assert parse("--deepspeed", "--deepspeed_config", cosine).notes == ()
    # beside the batch sizes the JSON sets (which are read before the schedule is filled in)
    with_batch = write_config(tmp_path, "batch.json", train_micro_batch_size_per_gpu=4,
                              scheduler={"type": "WarmupDecayLR",
                                         "params": {"total_num_steps": "auto",
                                                    "warmup_num_steps": "auto"}})
    parsed = parse("--deepspeed", "--deepspeed_config", with_batch, "--lr-decay-iters", 6)
    assert parsed.engine.ds_config.scheduler.params["total_num_steps"] == 6
    assert parsed.training.batch_size == 4
    fixed_lr = write_config(tmp_path, "fixed.json", optimizer={"type": "AdamW",
                                                               "params": {"lr": 2e-4}},
                            scheduler={"type": "WarmupCosineLR",
                                       "params": {"total_num_steps": 10,
                                                  "warmup_num_steps": 2}})
    assert parse("--deepspeed", "--deepspeed_config", fixed_lr).notes[0].startswith(
        " note: --lr not used: the 'scheduler' section")
