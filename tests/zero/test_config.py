import ast
import base64
import dataclasses
import json
import logging
import pathlib

import pytest

import zero
from tests.zero import ds_configs
from zero import ConfigError, DeepSpeedConfig


def load(config, world=1):
    return DeepSpeedConfig(config, dp_world_size=world)


def error_of(config, world=1):
    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig(config, dp_world_size=world)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# Batch-size rule: every row of the derivation table (DeepSpeed's deepspeed/runtime/config.py), hand-computed

@pytest.mark.parametrize("given, world, expected", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 4}, 2, (16, 2, 4)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3}, 2, (24, 3, 4)),
    ({"train_batch_size": 24, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 3}, 4, (60, 5, 3)),
    ({"train_batch_size": 12}, 3, (12, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 7}, 2, (14, 7, 1)),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}, 1, (8, 8, 1)),
])
def test_batch_derivation_rows(given, world, expected):
    config = load(given, world)
    got = (config.train_batch_size, config.train_micro_batch_size_per_gpu,
           config.gradient_accumulation_steps)
    assert got == expected
    assert got[0] == got[1] * got[2] * world


@pytest.mark.parametrize("given", [{}, {"gradient_accumulation_steps": 4}])
def test_batch_needs_train_or_micro(given):
    message = error_of(given)
    assert "train_batch_size" in message and "train_micro_batch_size_per_gpu" in message


@pytest.mark.parametrize("given, world, pieces", [
    # a given value <= 0
    ({"train_batch_size": 0}, 1, ["'train_batch_size' must be > 0, got 0"]),
    ({"train_micro_batch_size_per_gpu": -2}, 1, ["must be > 0, got -2"]),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 0}, 1, ["must be > 0, got 0"]),
    # floor division yields 0 (DeepSpeed's checks 2 and 3)
    ({"train_batch_size": 4}, 8, ["4 // 8 = 0", "multiple of 8"]),
    ({"train_batch_size": 4, "gradient_accumulation_steps": 1}, 8, ["4 // 8 // 1 = 0"]),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, 8,
     ["10 // 3 // 8 = 0", "multiple of 24"]),
    # not divisible: the consistency check (DeepSpeed's check 4)
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3,
      "gradient_accumulation_steps": 1}, 2, ["16 != 3 * 1 * 2 = 6"]),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, 1,
     ["10 // 3 // 1 = 3", "10 != 3 * 3 * 1 = 9", "multiple of 3"]),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, 1,
     ["10 // 1 // 3 = 3", "10 != 3 * 3 * 1 = 9"]),
    ({"train_batch_size": 10}, 4, ["10 // 4 = 2", "10 != 2 * 1 * 4 = 8", "multiple of 4"]),
])
def test_batch_failures_show_the_arithmetic(given, world, pieces):
    message = error_of(given, world)
    for piece in pieces:
        assert piece in message, (piece, message)


def test_batch_values_must_be_integers():
    assert "must be an integer" in error_of({"train_batch_size": 2.5})
    assert "must be an integer" in error_of({"train_batch_size": "16"})
    assert load({"train_batch_size": 16.0}).train_batch_size == 16


# ---------------------------------------------------------------------------------------------
# Published configs

@pytest.mark.parametrize("make", ds_configs.LOADABLE, ids=lambda f: f.__name__)
def test_published_configs_load(make):
    config = load(make(), world=2 if make is not ds_configs.tutorial_zero2 else 4)
    assert config.fp16.enabled and config.fp16.dynamic_loss_scale
    assert config.fp16.hysteresis == 2 and config.fp16.loss_scale_window == 1000
    assert config.raw == make()  # the user's dict, untouched by the old-spelling mapping


def test_tutorial_zero2_values():
    config = load(ds_configs.tutorial_zero2(), world=4)
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 1)
    assert config.zero_optimization.stage == 2 and config.zero_optimization.overlap_comm is False
    assert config.optimizer.type == "Adam" and config.optimizer.params["lr"] == 0.00015
    assert config.activation_checkpointing.partition_activations
    assert config.gradient_clipping == 1.0 and config.zero_allow_untested_optimizer


def test_zero_offload_maps_cpu_offload(caplog):
    with caplog.at_level(logging.WARNING, logger="zero.config.deepspeed_config"):
        config = load(ds_configs.zero_offload(), world=2)
    offload = config.zero_optimization.offload_optimizer
    assert offload.device == "cpu" and offload.pin_memory is False
    assert config.zero_optimization.reduce_bucket_size == 50_000_000
    assert config.train_batch_size == 12 * 5 * 2
    assert "cpu_offload' is deprecated" in caplog.text


def test_a_parsed_config_and_its_sections_are_frozen():
    config = load({"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    with pytest.raises(AttributeError, match="frozen once parsed"):
        config.train_batch_size = 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.zero_optimization.stage = 3
    assert config.train_batch_size == 8 and config.zero_optimization.stage == 2


def test_release_config_old_offload_spellings():
    zero = load(ds_configs.z3_release(), world=2).zero_optimization
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory
    assert zero.stage3_max_reuse_distance == 100_000_000
    assert isinstance(zero.sub_group_size, int) and zero.sub_group_size == 400_000_000


def test_infinity_config_typo_suggests_the_key():
    message = error_of(ds_configs.z3_infinity())
    assert "'stage3_param_persitence_threshold'" in message
    assert "zero_optimization" in message
    assert "did you mean 'stage3_param_persistence_threshold'" in message


def test_infinity_config_fixed():
    config = load(ds_configs.z3_infinity_fixed())
    zero = config.zero_optimization
    assert zero.offload_optimizer.device == "nvme" and zero.offload_optimizer.nvme_path
    assert zero.offload_param.max_in_cpu == 1 and zero.offload_param.buffer_count == 5
    assert zero.overlap_comm is True  # resolved default for stage 3
    assert (config.aio.thread_count, config.aio.queue_depth) == (2, 16)


def test_max_grad_norm_is_refused_like_deepspeed():
    for make in (ds_configs.zero1_era, ds_configs.z3_zero_stage_2):
        message = error_of(make())
        assert "'max_grad_norm' is not supported" in message and "gradient_clipping" in message
        fixed = make()
        del fixed["optimizer"]["params"]["max_grad_norm"]
        load(fixed)


def test_zero1_era_boolean_zero_optimization():
    config = ds_configs.zero1_era()
    del config["optimizer"]["params"]["max_grad_norm"]
    assert load(config).zero_optimization.stage == 1
    config["zero_optimization"] = False
    assert load(config).zero_optimization.stage == 0
    config.update({"zero_optimization": True, "allgather_size": 1000})
    assert load(config).zero_optimization.allgather_bucket_size == 1000
    config["zero_optimization"] = {"stage": 1}
    assert "zero_optimization.allgather_bucket_size" in error_of(config)


def test_script_configs_are_valid():
    scripts = pathlib.Path(__file__).resolve().parents[2] / "scripts"
    for stage in (1, 2, 3):
        config = load(str(scripts / f"ds_zero_stage_{stage}.config"), world=2)
        assert config.zero_optimization.stage == stage
        assert config.bf16.enabled and not config.fp16.enabled


# ---------------------------------------------------------------------------------------------
# Sections, defaults, old spellings, aliases, "auto"

def test_defaults():
    config = load({"train_batch_size": 1})
    zero = config.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size) == \
        (0, 500_000_000, 50_000_000)
    assert zero.offload_optimizer is None and zero.offload_param is None
    assert config.fp16.initial_scale_power == 16 and config.fp16.min_loss_scale == 1.0
    assert config.gradient_clipping == 0.0 and config.steps_per_print is None
    assert config.optimizer is None and config.scheduler is None
    assert config.aio.block_size == 1048576 and config.aio.overlap_events is True
    assert config.tensorboard.job_name == "DeepSpeedJobName"
    assert config.gradient_checkpointing is False


def test_every_section_parses():
    config = load({
        "train_batch_size": 4, "steps_per_print": 5, "wall_clock_breakdown": True,
        "prescale_gradients": True, "gradient_predivide_factor": 2.0,
        "gradient_checkpointing": True,
        "bf16": {"enabled": True},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": 1, "round_robin_gradients": True,
                              "elastic_checkpoint": True, "load_from_fp32_weights": False,
                              "offload_optimizer": {"device": "cpu", "fast_init": True,
                                                    "buffer_count": 2}},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                     "contiguous_memory_optimization": True,
                                     "number_checkpoints": 4,
                                     "synchronize_checkpoint_boundary": True, "profile": True},
        "aio": {"block_size": 4096, "queue_depth": 4, "intra_op_parallelism": 3,
                "single_submit": True, "overlap_events": False},
        "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "j"},
    })
    assert config.prescale_gradients and config.gradient_predivide_factor == 2.0
    assert config.zero_optimization.offload_optimizer.buffer_count == 2
    assert config.activation_checkpointing.number_checkpoints == 4
    assert config.aio.thread_count == 3 and config.tensorboard.output_path == "runs/"
    assert config.scheduler.params == {"warmup_num_steps": 10}


def test_bfloat16_alias_and_both_spellings():
    assert load({"train_batch_size": 1, "bfloat16": {"enabled": True}}).bf16.enabled
    message = error_of({"train_batch_size": 1, "bf16": {}, "bfloat16": {}})
    assert "two spellings" in message


def test_stage3_aliases():
    zero = load({"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "prefetch_bucket_size": 7, "param_persistence_threshold": 8,
        "max_live_parameters": 9, "max_reuse_distance": 10,
        "gather_16bit_weights_on_model_save": True}}).zero_optimization
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance) == (7, 8, 9, 10)
    assert zero.stage3_gather_16bit_weights_on_model_save


def test_old_gather_fp16_spelling():
    config = {"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "stage3_gather_fp16_weights_on_model_save": True}}
    assert load(config).zero_optimization.stage3_gather_16bit_weights_on_model_save
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    assert "deprecated spelling" in error_of(config)


def test_old_offload_spellings_edge_cases():
    base = {"train_batch_size": 1}
    off = load({**base, "zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert off.zero_optimization.offload_optimizer is None
    param = load({**base, "zero_optimization": {"stage": 3, "cpu_offload_param": True}})
    assert param.zero_optimization.offload_param.device == "cpu"
    assert "offload_optimizer" in error_of({**base, "zero_optimization": {
        "stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    assert "pin_memory" in error_of({**base, "zero_optimization": {
        "stage": 2, "cpu_offload_use_pin_memory": True}})
    assert "must be true or false" in error_of({**base, "zero_optimization": {
        "stage": 2, "cpu_offload": "yes"}})


def test_auto_means_default():
    config = load({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                   "fp16": {"enabled": "auto", "loss_scale_window": "auto"},
                   "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                         "stage3_prefetch_bucket_size": "auto"},
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto",
                                                             "weight_decay": "auto"}}}, 2)
    assert (config.train_batch_size, config.gradient_accumulation_steps) == (8, 1)
    assert config.gradient_clipping == 0.0 and config.fp16.enabled is False
    assert config.fp16.loss_scale_window == 1000
    assert config.zero_optimization.reduce_bucket_size == 500_000_000


def test_device_none_means_no_offload():
    zero = load({"train_batch_size": 1, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True}}}
    ).zero_optimization
    assert zero.offload_optimizer is None


# ---------------------------------------------------------------------------------------------
# Values and cross-key checks

@pytest.mark.parametrize("config, piece", [
    ({"zero_optimization": {"stage": "2"}}, "'zero_optimization.stage' must be an integer"),
    ({"zero_optimization": {"stage": 4}}, "must be <= 3"),
    ({"zero_optimization": {"reduce_bucket_size": 2.5}}, "must be an integer"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "must be >= 1"),
    ({"fp16": {"enabled": 1}}, "'fp16.enabled' must be true or false"),
    ({"gradient_clipping": "1.0"}, "must be a number"),
    ({"gradient_clipping": float("nan")}, "must be finite"),
    ({"fp16": []}, "'fp16' must be a JSON object"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "one of \"none\""),
    ({"fp16": {"enabled": True, "bf16": True}}, "unknown key 'bf16'"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "pick one precision"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "min_loss_scale' must be > 0"),
    ({"fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 8}},
     "2**2 = 4 is below min_loss_scale = 8"),
    ({"fp16": {"loss_scale": -1}}, "must be >= 0.0"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "offload_param' needs ZeRO stage 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "needs ZeRO stage 1, 2"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "partial offload"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "nvme_path"),
    ({"zero_optimization": {"stage": 2}, "prescale_gradients": True}, "prescale_gradients"),
    ({"zero_optimization": {"stage": 2}, "gradient_predivide_factor": 2.0}, "must be 1.0"),
    ({"gradient_predivide_factor": 0}, "must be > 0"),
    ({"optimizer": {"params": {}}}, "needs a \"type\""),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}}, "warmup_type"),
])
def test_bad_values(config, piece):
    message = error_of({"train_batch_size": 2, **config})
    assert piece in message, message


def test_compile_section():
    """DeepSpeed's "compile" keys; torch.compile arguments other than its own are refused,
    and so are backends torch does not have and DeepCompile (not implemented)."""
    assert load({"train_batch_size": 2}).compile.enabled is False
    config = load({"train_batch_size": 2, "compile": {
        "enabled": True, "backend": "inductor", "kwargs": {"mode": "max-autotune-no-cudagraphs"},
        "deepcompile": False}})
    assert (config.compile.enabled, config.compile.backend, config.compile.kwargs) == \
        (True, "inductor", {"mode": "max-autotune-no-cudagraphs"})
    for section, piece in (({"enabled": True, "backend": "tvm-typo"}, "is not a torch.compile "
                                                                      "backend here"),
                           ({"kwargs": {"model": "x"}}, "'model', which torch.compile does not "
                                                        "take"),
                           ({"kwargs": {"fullgraph": "yes"}}, "has the wrong type"),
                           ({"kwargs": {"mode": "default", "options": {}}}, "one of them"),
                           ({"enabled": True, "kwargs": {"mode": "fastest"}}, "is not one of "
                                                                              "torch.compile's "
                                                                              "modes"),
                           ({"enabled": True, "backend": "eager", "kwargs": {"mode": "default"}},
                            "tunes inductor"),
                           ({"deepcompile": True}, "does not implement"),
                           ({"enabeld": True}, "did you mean 'enabled'")):
        message = error_of({"train_batch_size": 2, "compile": section})
        assert piece in message, message


def test_predivide_allowed_without_reduce_scatter():
    config = load({"train_batch_size": 2, "gradient_predivide_factor": 2.0,
                   "zero_optimization": {"stage": 2, "reduce_scatter": False}})
    assert config.gradient_predivide_factor == 2.0


@pytest.mark.parametrize("config", [
    {"sparse_gradients": False}, {"zero_force_ds_cpu_optimizer": True},
    {"wandb": {"enabled": False, "project": "p"}}, {"flops_profiler": {"enabled": False}},
    {"checkpoint": {"tag_validation": "Warn"}}, {"fp16": {"auto_cast": False}},
    {"zero_optimization": {"legacy_stage1": False, "zero_quantized_weights": False}},
    {"optimizer": {"type": "Adam", "legacy_fusion": False}}, {"aio": {"use_gds": False}},
])
def test_unimplemented_deepspeed_keys_accepted_at_defaults(config):
    load({"train_batch_size": 2, **config})


@pytest.mark.parametrize("config", [
    {"sparse_gradients": True}, {"wandb": {"enabled": True}}, {"amp": {"enabled": True}},
    {"checkpoint": {"tag_validation": "Fail"}}, {"fp16": {"auto_cast": True}},
    {"bf16": {"immediate_grad_update": 0}}, {"zero_optimization": {"legacy_stage1": True}},
    {"zero_optimization": {"zero_quantized_gradients": True}},
])
def test_unimplemented_deepspeed_keys_refused_otherwise(config):
    assert "does not implement" in error_of({"train_batch_size": 2, **config})


# ---------------------------------------------------------------------------------------------
# Where the config comes from

def test_json_file_and_pathlike(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_configs.tutorial_zero2()))
    for source in (str(path), path):
        config = load(source, world=4)
        assert config.raw == ds_configs.tutorial_zero2() and config.source == str(path)


def test_duplicate_keys_in_file(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false},'
                    ' "train_batch_size": 16}')
    message = error_of(str(path))
    assert "duplicate keys" in message and str(path) in message
    assert "train_batch_size" in message or "enabled" in message


def test_invalid_json_and_missing_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,\n "fp16": {},}')
    assert "not valid JSON" in error_of(str(bad)) and "line 2" in error_of(str(bad))
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    assert "must hold a JSON object" in error_of(str(listing))
    assert "does not exist" in error_of(str(tmp_path / "missing.json"))
    assert "is a directory" in error_of(str(tmp_path))
    assert "got a int" in error_of(5)


def test_base64_config():
    text = json.dumps({"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 1}})
    encoded = base64.urlsafe_b64encode(text.encode()).decode()
    config = load(encoded, world=2)
    assert config.train_batch_size == 6 and config.source == "(base64 string)"
    unpadded = encoded.rstrip("=")
    assert load(unpadded, world=2).zero_optimization.stage == 1
    duplicated = base64.urlsafe_b64encode(b'{"a": 1, "a": 2}').decode()
    assert "duplicate keys" in error_of(duplicated)


def test_a_dict_read_from_a_file_keeps_the_files_name_in_errors(tmp_path):
    config = {"train_batch_size": 4, "gradient_clipping": -1}
    assert "DeepSpeed config (dict):" in error_of(config)
    with pytest.raises(ConfigError, match=r"^DeepSpeed config my\.json: 'gradient_clipping'"):
        DeepSpeedConfig(config, source="my.json")
    assert DeepSpeedConfig({"train_batch_size": 4}, source="my.json").source == "my.json"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4}))
    assert DeepSpeedConfig(str(path), source="ignored").source == str(path)  # a path names itself


def test_dict_is_copied():
    given = {"train_batch_size": 4, "zero_optimization": {"stage": 2, "cpu_offload": True}}
    config = load(given)
    given["zero_optimization"]["stage"] = 3
    assert config.raw["zero_optimization"] == {"stage": 2, "cpu_offload": True}
    assert config.zero_optimization.stage == 2


def test_zero_never_imports_megatron():
    package = pathlib.Path(zero.__file__).parent
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] == "megatron"], path


def test_auto_values_nothing_filled_in_are_said_with_what_is_used(caplog, tmp_path):
    """Hugging Face's "auto" given to zero directly (no Trainer, no pretrain_gpt2.py flags to
    fill it in) takes zero's default: one warning per key says which, once per config."""
    path = tmp_path / "hf.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
                                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    with caplog.at_level(logging.WARNING, logger="zero.config"):
        config = DeepSpeedConfig(str(path))
        DeepSpeedConfig(str(path))  # parsed again: not said again
    assert config.gradient_clipping == 0.0 and not config.fp16.enabled
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{path}: 'gradient_clipping' is \"auto\", which nothing filled in: the "
                    "default 0.0 is used",
                    f"{path}: 'fp16.enabled' is \"auto\", which nothing filled in: the default "
                    "false is used",
                    f"{path}: 'optimizer.params.lr' is \"auto\", which nothing filled in: "
                    "AdamW's default is used"], said
