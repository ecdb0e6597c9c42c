"""Published DeepSpeed configs (DeepSpeedExamples' Megatron-LM ds_*_config.json files), as fixtures.

Each function returns a fresh dict so tests may mutate it.
"""

FP16_DYNAMIC = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
                "min_loss_scale": 1}


def tutorial_zero2():
    """DSE-old scripts/ds_zero2_config.json (the seed tutorial)."""
    return {"train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "weight_decay": 1e-2}},
            "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 1.0, "fp16": dict(FP16_DYNAMIC),
            "activation_checkpointing": {"partition_activations": True,
                                         "contiguous_memory_optimization": False},
            "wall_clock_breakdown": False}


def zero_offload():
    """DSE-old scripts/ds_zero-offload_config.json (old `cpu_offload` spelling)."""
    return {"train_micro_batch_size_per_gpu": 12, "gradient_accumulation_steps": 5,
            "steps_per_print": 100,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "weight_decay": 1e-2}},
            "zero_optimization": {"stage": 2, "cpu_offload": True,
                                  "reduce_bucket_size": 50000000},
            "gradient_clipping": 1.0, "fp16": dict(FP16_DYNAMIC),
            "activation_checkpointing": {"partition_activations": True,
                                         "contiguous_memory_optimization": True,
                                         "cpu_checkpointing": True}}


def zero_offload_10b():
    config = zero_offload()
    config.update({"train_micro_batch_size_per_gpu": 10, "gradient_accumulation_steps": 1,
                   "zero_allow_untested_optimizer": True, "wall_clock_breakdown": True})
    return config


def docs_zero_offload():
    """The docs tutorial's ds_zero_offload.config (new `offload_optimizer` spelling)."""
    return {"train_micro_batch_size_per_gpu": 10, "gradient_accumulation_steps": 1,
            "steps_per_print": 100,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "weight_decay": 1e-2}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "contiguous_gradients": True, "overlap_comm": True},
            "gradient_clipping": 1.0, "fp16": dict(FP16_DYNAMIC)}


def zero1_era():
    """DSE-old ds_config.json of the removed ds_pretrain_gpt2.sh (boolean zero_optimization)."""
    return {"train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
            "zero_optimization": True,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0}},
            "fp16": dict(FP16_DYNAMIC)}


def branch_zero_stage_2():
    """The branch-only ds_zero_stage_2_config.json (1d212964)."""
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 2, "allgather_partitions": True,
                                  "reduce_scatter": True, "allgather_bucket_size": 5e8,
                                  "reduce_bucket_size": 5e8},
            "fp16": {**FP16_DYNAMIC, "initial_scale_power": 17}}


def z3_zero_stage_2():
    """DSE-Z3 examples/ds_zero_stage_2_config.json (its optimizer carries max_grad_norm)."""
    return {"train_batch_size": 2048, "gradient_accumulation_steps": 1, "steps_per_print": 1,
            "zero_optimization": {"stage": 2, "allgather_partitions": True,
                                  "reduce_scatter": True, "allgather_bucket_size": 50000000,
                                  "reduce_bucket_size": 50000000, "overlap_comm": True},
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0,
                                                     "betas": [0.9, 0.95]}},
            "gradient_clipping": 1.0, "fp16": dict(FP16_DYNAMIC), "wall_clock_breakdown": True,
            "zero_allow_untested_optimizer": False}


def z3_zero_stage_3():
    """DSE-Z3 examples/ds_zero_stage_3_config.json (no optimizer: the client passes AdamW)."""
    return {"train_batch_size": 64, "gradient_accumulation_steps": 1, "steps_per_print": 1,
            "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9,
                                  "stage3_max_reuse_distance": 1e9,
                                  "stage3_prefetch_bucket_size": 1e7,
                                  "stage3_param_persistence_threshold": 1e5,
                                  "reduce_bucket_size": 1e7, "contiguous_gradients": True},
            "gradient_clipping": 1.0, "fp16": dict(FP16_DYNAMIC), "wall_clock_breakdown": True,
            "zero_allow_untested_optimizer": False}


def z3_release():
    """DSE-Z3 ds_zero_stage_3_config_release.json (ZeRO-3 Offload, old offload spellings)."""
    return {"train_batch_size": 64, "gradient_accumulation_steps": 1, "steps_per_print": 1,
            "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9,
                                  "stage3_max_reuse_distance": 1e8,
                                  "stage3_param_persistence_threshold": 1e5,
                                  "stage3_prefetch_bucket_size": 5e7,
                                  "contiguous_gradients": True, "cpu_offload": True,
                                  "cpu_offload_params": True, "cpu_offload_use_pin_memory": True,
                                  "overlap_comm": True, "reduce_bucket_size": 9e7,
                                  "sub_group_size": 4e8},
            "gradient_clipping": 1.0, "fp16": dict(FP16_DYNAMIC), "wall_clock_breakdown": True,
            "zero_allow_untested_optimizer": False}


def z3_infinity():
    """DSE-Z3 ds_zero_stage_infinity_config.json, with its published typo
    `stage3_param_persitence_threshold`."""
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "steps_per_print": 1,
            "zero_optimization": {
                "stage": 3, "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
                "stage3_param_persitence_threshold": 1e5, "reduce_bucket_size": 1e7,
                "contiguous_gradients": True, "sub_group_size": 1e8,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme_data",
                                      "buffer_count": 4, "pipeline_read": False,
                                      "pipeline_write": False, "pin_memory": True},
                "offload_param": {"device": "nvme", "nvme_path": "/nvme_data", "max_in_cpu": 1,
                                  "pin_memory": True}},
            "aio": {"block_size": 1048576, "queue_depth": 16, "single_submit": False,
                    "overlap_events": True, "thread_count": 2},
            "gradient_clipping": 1.0, "fp16": dict(FP16_DYNAMIC), "wall_clock_breakdown": True,
            "zero_allow_untested_optimizer": False}


def z3_infinity_fixed():
    config = z3_infinity()
    zero = config["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = zero.pop("stage3_param_persitence_threshold")
    return config


# Configs that load as published (the others need the fix their test shows).
LOADABLE = [tutorial_zero2, zero_offload, zero_offload_10b, docs_zero_offload,
            branch_zero_stage_2, z3_zero_stage_3, z3_release, z3_infinity_fixed]
ALL = LOADABLE + [zero1_era, z3_zero_stage_2, z3_infinity]
