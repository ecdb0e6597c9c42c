"""Resolving the pipeline-parallel flags: the sizes, the interleaved schedule, what pipeline
stages compose with, and the notes they leave."""

import json
import re

import pytest

from megatron.errors import ConfigError
from tests.training.test_arguments import parse


@pytest.fixture
def ds_json(tmp_path):
    def write(**config):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        return str(path)
    return write


def test_pipeline_refuses_zero_stage_3(ds_json):
    with pytest.raises(ConfigError, match="ZeRO stage 3 does not compose with "
                                          "--pipeline-model-parallel-size"):
        parse("--pipeline-model-parallel-size", "2", "--deepspeed", "--deepspeed_config",
              ds_json(zero_optimization={"stage": 3}), world_size=2)


@pytest.mark.parametrize("extra, world_size, message", [
    (["--pipeline-model-parallel-size", "2", "--DDP-impl", "torch"], 4,
     "--DDP-impl torch does not compose with --pipeline-model-parallel-size"),
    (["--pipeline-model-parallel-size", "3"], 3, "is more stages than --num-layers 2"),
    (["--pipeline-model-parallel-size", "0"], 2, "--pipeline-model-parallel-size must be "
                                                 "positive"),
])
def test_pipeline_refusals(extra, world_size, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(*extra, world_size=world_size)


def test_pipeline_sizes_and_the_bubble_note():
    config = parse("--pipeline-model-parallel-size", "2", "--model-parallel-size", "2",
                   world_size=8)
    assert config.parallel.data_parallel_size == 2
    assert config.training.num_micro_batches == 1
    note, = [n for n in config.notes if "pipeline stages" in n]
    assert "1 micro batch(es) per step over 2 pipeline stages: each stage idles 50%" in note
    assert "--global-batch-size 64 (8 micro batches) brings that to 11%" in note
    uneven = parse("--pipeline-model-parallel-size", "2", "--num-layers", "3",
                   "--global-batch-size", "32", world_size=2)
    assert any("the first 1 stage(s) hold 2 layers, the others 1" in n for n in uneven.notes)
    assert not any("idles" in n for n in uneven.notes)


@pytest.mark.parametrize("extra, world_size, message", [
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1,
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "6",
      "--num-layers-per-virtual-pipeline-stage", "2"], 2,
     "--num-layers 6 is not divisible by --num-layers-per-virtual-pipeline-stage 2 x "
     "--pipeline-model-parallel-size 2 = 4 (6 % 4 = 2)"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4",
      "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "12"], 2,
     "runs the micro batches in groups of --pipeline-model-parallel-size 2, but a step has 3"),
])
def test_interleaved_schedule_refusals(extra, world_size, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(*extra, world_size=world_size)


def test_interleaved_schedule_refuses_zero_stage_2(ds_json):
    with pytest.raises(ConfigError, match="ZeRO stage 2 reduces them at every micro batch"):
        parse("--pipeline-model-parallel-size", "2", "--num-layers", "4",
              "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8",
              "--deepspeed", "--deepspeed_config",
              ds_json(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                      zero_optimization={"stage": 2}), world_size=2)


def test_interleaved_chunks_per_stage():
    config = parse("--pipeline-model-parallel-size", "2", "--num-layers", "8",
                   "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "8",
                   world_size=2)
    assert config.parallel.virtual_pipeline_model_parallel_size == 2
    assert not any("virtual" in note for note in config.notes)
    whole = parse("--pipeline-model-parallel-size", "2", "--num-layers", "4",
                  "--num-layers-per-virtual-pipeline-stage", "2", "--batch-size", "1",
                  "--global-batch-size", "3", world_size=2)  # 3 micro batches: not refused
    assert whole.parallel.virtual_pipeline_model_parallel_size == 1
    assert " note: --num-layers-per-virtual-pipeline-stage 2 is all of each stage's 2 layers: " \
        "one model chunk a stage, so the schedule is plain 1F1B (a divisor of it below that " \
        "interleaves)" in whole.notes


def test_checkpoint_num_layers_that_does_not_divide_a_stage_gets_a_note():
    def note_of(*extra):
        notes = parse("--pipeline-model-parallel-size", *extra, "--checkpoint-activations",
                      "--batch-size", "1", "--global-batch-size", "8", world_size=4).notes
        return [n for n in notes if "--checkpoint-num-layers" in n]
    assert note_of("2", "--num-layers", "4", "--checkpoint-num-layers", "4") == [
        " note: --checkpoint-num-layers 4 does not divide the 2 layers of a pipeline stage: "
        "each pipeline stage checkpoints 4 at a time and its last checkpoint holds the rest"]
    assert "the 2 or 1 layers of a pipeline stage" in note_of(
        "4", "--num-layers", "6", "--checkpoint-num-layers", "2")[0]
    assert note_of("2", "--num-layers", "4", "--checkpoint-num-layers", "4",
                   "--split-transformers") == []  # 4 halves a stage
    assert note_of("2", "--num-layers", "4", "--checkpoint-num-layers", "2") == []


def test_pipeline_refuses_contiguous_activation_checkpoints():
    """One forward's checkpoints in one buffer cannot hold a stage's micro batches in flight."""
    with pytest.raises(ConfigError, match="a pipeline stage holds several micro batches"):
        parse("--pipeline-model-parallel-size", "2", "--checkpoint-activations",
              "--contiguous-checkpointing", world_size=2)
