"""DeepSpeed config keys zero does not take: unknown and misspelled keys name the key, its
section and the closest spelling; DeepSpeed features it does not implement are accepted only
disabled, and enabled ones say what runs instead."""

import pytest

from tests.zero.test_config import error_of, load
from zero import ConfigError


@pytest.mark.parametrize("config, pieces", [
    ({"train_batch_size": 1, "zero_optimisation": {}},
     ["'zero_optimisation'", "top level", "did you mean 'zero_optimization'"]),
    ({"train_batch_size": 1, "gradient_clip": 1.0}, ["did you mean 'gradient_clipping'"]),
    ({"train_batch_size": 1, "fp16": {"loss_scale_windw": 10}},
     ["section 'fp16'", "did you mean 'loss_scale_window'"]),
    ({"train_batch_size": 1, "activation_checkpointing": {"partitioned_activations": True}},
     ["section 'activation_checkpointing'", "did you mean 'partition_activations'"]),
    ({"train_batch_size": 1, "aio": {"queue_dept": 1}}, ["did you mean 'queue_depth'"]),
    ({"train_batch_size": 1, "tensorboard": {"outputpath": "x"}},
     ["did you mean 'output_path'"]),
    ({"train_batch_size": 1, "zero_optimization": {"offload_optimizer": {"pin_memroy": True}}},
     ["section 'zero_optimization.offload_optimizer'", "did you mean 'pin_memory'"]),
    ({"train_batch_size": 1, "zero_optimization": {"aio": {}}},
     ["section 'zero_optimization'", "'aio' is a key of the top level"]),
    ({"train_batch_size": 1, "bf16": {"enabled": True, "loss_scale": 0}},
     ["section 'bf16'", "section 'fp16'"]),
    ({"train_batch_size": 1, "optimizer": {"type": "Adam", "parameters": {}}},
     ["section 'optimizer'", "did you mean 'params'"]),
    ({"train_batch_size": 1, "xyzzy": 1}, ["'xyzzy'", "valid keys:", "train_batch_size"]),
    ({"train_batch_size": 1, "pipeline": {"stages": 2, "activation_checkpoint_interval": 1}},
     ["unknown key 'pipeline' at the top level: DeepSpeed's PipelineEngine section is not "
      "read", "--pipeline-model-parallel-size for the stages", "drop the section"]),
    # a hint says what the key is, without the near spelling 'sparse_gradients'
    ({"train_batch_size": 1, "sparse_attention": {"mode": "fixed"}},
     ["unknown key 'sparse_attention' at the top level: DeepSpeed's block-sparse attention "
      "(Triton kernels) is not implemented"]),
    ({"train_batch_size": 1, "zero_optimization": {"comm_overlap": True}},
     ["did you mean 'overlap_comm'?"]),  # the same words in another order
    ({"train_batch_size": 1, "data_efficiency": {"enabled": True}},
     ["'data_efficiency' enables a DeepSpeed feature that zero does not implement"]),
])
def test_unknown_keys_name_key_section_and_suggestion(config, pieces):
    message = error_of(config)
    for piece in pieces:
        assert piece in message, (piece, message)
    assert "sparse_gradients" not in message


def test_a_choice_is_read_whatever_its_case():
    config = load({"train_batch_size": 1, "bf16": {"enabled": True},
                   "communication_data_type": "BF16"})
    assert config.communication_data_type == "bf16"
    assert "must be one of \"fp32\", \"fp16\", \"bf16\", got \"bfp16\"" in error_of(
        {"train_batch_size": 1, "communication_data_type": "bfp16"})


def test_disabled_sections_of_unimplemented_features_are_accepted():
    """Configs from Megatron-DeepSpeed's examples carry these switched off."""
    config = load({"train_batch_size": 1, "data_efficiency": {"enabled": False},
                   "quantize_training": {"enabled": False}, "disable_allgather": False,
                   "graph_harvesting": False})
    assert config.train_batch_size == 1


@pytest.mark.parametrize("key, value, piece", [
    ("checkpoint", {"load_universal": True}, "reads a folder converted by DeepSpeed's "
                                             "ds_to_universal.py, which is not read here"),
    ("curriculum_learning", {"enabled": True}, "the legacy curriculum (sequence-length "
                                               "warm-up) is not built"),
    ("data_efficiency", {"enabled": True}, "curriculum sampling and random layer-token drop "
                                           "are not built"),
    ("flops_profiler", {"enabled": True}, "the log line has MFU and tokens/s"),
])
def test_enabled_features_from_megatron_deepspeed_configs_say_what_runs_instead(key, value,
                                                                                 piece):
    with pytest.raises(ConfigError) as error:
        load({"train_batch_size": 1, key: value})
    assert f"'{key}'" in str(error.value) and piece in str(error.value)
