"""The sections of a DeepSpeed JSON config as typed dataclasses (DeepSpeed key names).

Defaults are DeepSpeed's code defaults (v0.16.5: deepspeed/runtime/config.py and
zero/config.py), except where its docs and code disagree; those choices are noted next to the
field. Every section parses
completely here; the engine and its parts (offload, activation checkpointing, aio) decide what a
combination of values may not do.

Sections are frozen: `check` runs once, while `parse_section` builds a section, and is the
only place that settles a value (`_settle`); after that nothing writes to a config. (The
freeze is per attribute: a dict-valued key, such as an optimizer's params, is a plain dict
that nothing here changes.)
"""

import logging
import sys
from dataclasses import dataclass
from typing import Optional

from zero.config.parsing import (DISABLED_SECTION, deprecated_bool, fail, key_path, option,
                                section)

logger = logging.getLogger("zero.config.deepspeed_config")

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _settle(section, **values):
    """Sets fields of a frozen section from its own `check` (still being built)."""
    for name, value in values.items():
        object.__setattr__(section, name, value)


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = option(False)
    loss_scale: float = option(0.0, minimum=0.0)  # 0 = dynamic scaling
    initial_scale_power: int = option(16, minimum=0, maximum=127)  # scaling starts at 2**power
    loss_scale_window: int = option(1000, minimum=1)
    hysteresis: int = option(2, minimum=1)
    consecutive_hysteresis: bool = option(False)
    min_loss_scale: float = option(1.0)

    DEFAULT_ONLY = {"auto_cast": False, "fp16_master_weights_and_grads": False}

    @property
    def dynamic_loss_scale(self):
        return self.loss_scale == 0

    def check(self, source, path):
        if self.enabled and self.dynamic_loss_scale:
            if not self.min_loss_scale > 0:
                fail(source, f"'{path}.min_loss_scale' must be > 0 with dynamic loss scaling, "
                             f"got {self.min_loss_scale}")
            if 2.0 ** self.initial_scale_power < self.min_loss_scale:
                fail(source, f"'{path}': the initial loss scale 2**initial_scale_power = "
                             f"2**{self.initial_scale_power} = {2.0 ** self.initial_scale_power:g}"
                             f" is below min_loss_scale = {self.min_loss_scale:g}")


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = option(False)

    # v0.19.6 additions; zero's bf16 path has no overflow check, no bf16 masters/states
    DEFAULT_ONLY = {"immediate_grad_update": False, "check_grad_overflow": False,
                    "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}


@dataclass(frozen=True)
class DataTypesConfig:
    # the dtype micro batches' gradients are summed in; None: fp32 for bf16 parameters at
    # stage 0 (DeepSpeed's default there), else the parameters' own (zero/stages/build.py)
    grad_accum_dtype: Optional[str] = option(None, choices=("fp32", "fp16", "bf16"))


@dataclass(frozen=True)
class OptimizerSection:
    type: Optional[str] = option(None)  # as given; compared case-insensitively
    params: dict = option({})

    DEFAULT_ONLY = {"legacy_fusion": False}

    def check(self, source, path):
        if not self.type:
            fail(source, f"'{path}' needs a \"type\" (e.g. \"AdamW\")")


@dataclass(frozen=True)
class SchedulerSection:
    type: Optional[str] = option(None)
    params: dict = option({})

    def check(self, source, path):
        if not self.type:
            fail(source, f"'{path}' needs a \"type\" (e.g. \"WarmupDecayLR\")")


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    device: str = option("none", choices=OFFLOAD_DEVICES)
    nvme_path: Optional[str] = option(None)
    pin_memory: bool = option(False)  # v0.16.5 default; v0.19.5 made it true (needs CUDA)
    buffer_count: int = option(4, minimum=0)
    pipeline_read: bool = option(False)
    pipeline_write: bool = option(False)
    fast_init: bool = option(False)
    ratio: float = option(1.0, minimum=0.0, maximum=1.0)

    DEFAULT_ONLY = {"super_offload": False, "cpuadam_cores_perc": 0.8}

    def check(self, source, path):
        _check_nvme_path(self.device, self.nvme_path, source, path)


@dataclass(frozen=True)
class OffloadParamConfig:
    device: str = option("none", choices=OFFLOAD_DEVICES)
    nvme_path: Optional[str] = option(None)
    pin_memory: bool = option(False)
    buffer_count: int = option(5, minimum=0)
    buffer_size: int = option(100_000_000, minimum=0)
    max_in_cpu: int = option(1_000_000_000, minimum=0)

    def check(self, source, path):
        _check_nvme_path(self.device, self.nvme_path, source, path)


def _check_nvme_path(device, nvme_path, source, path):
    if device == "nvme" and not nvme_path:
        fail(source, f"'{path}.device' is \"nvme\" but '{path}.nvme_path' is not set; "
                     "give the directory on the NVMe drive to swap to")


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = option(0, minimum=0, maximum=3)
    contiguous_gradients: bool = option(True)
    overlap_comm: Optional[bool] = option(None)  # None: true for stage 3, false for 1/2
    reduce_scatter: bool = option(True)
    reduce_bucket_size: int = option(500_000_000, minimum=1)
    allgather_partitions: bool = option(True)
    allgather_bucket_size: int = option(500_000_000, minimum=1)
    round_robin_gradients: bool = option(False)
    load_from_fp32_weights: bool = option(True)
    elastic_checkpoint: bool = option(False)
    ignore_unused_parameters: bool = option(True)
    offload_optimizer: Optional[OffloadOptimizerConfig] = section(OffloadOptimizerConfig,
                                                                  optional=True)
    offload_param: Optional[OffloadParamConfig] = section(OffloadParamConfig, optional=True)
    sub_group_size: int = option(1_000_000_000, minimum=1)
    stage3_prefetch_bucket_size: int = option(50_000_000, minimum=0,
                                               aliases=("prefetch_bucket_size",))
    stage3_param_persistence_threshold: int = option(
        100_000, minimum=0, aliases=("param_persistence_threshold",))
    stage3_model_persistence_threshold: int = option(
        sys.maxsize, minimum=0, aliases=("model_persistence_threshold",))
    stage3_max_live_parameters: int = option(1_000_000_000, minimum=0,
                                              aliases=("max_live_parameters",))
    stage3_max_reuse_distance: int = option(1_000_000_000, minimum=0,
                                             aliases=("max_reuse_distance",))
    stage3_gather_16bit_weights_on_model_save: bool = option(
        False, aliases=("gather_16bit_weights_on_model_save",))

    # ZeRO++ / MiCS / tuning knobs of DeepSpeed that zero does not implement.
    DEFAULT_ONLY = {
        "use_multi_rank_bucket_allreduce": True, "legacy_stage1": False,
        "module_granularity_threshold": 0, "stage3_module_granularity_threshold": 0,
        "use_all_reduce_for_fetch_params": False, "stage3_use_all_reduce_for_fetch_params": False,
        "stage3_allgather_sequential": False, "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
        "zero_quantized_gradients": False, "zeropp_loco_param": None, "mics_shard_size": -1,
        "mics_hierarchical_params_gather": False, "memory_efficient_linear": True,
        "pipeline_loading_checkpoint": False, "override_module_apply": True,
        "log_trace_cache_warnings": False, "enable_sanity_checks": False,
    }
    DEPRECATED_KEYS = ("cpu_offload", "cpu_offload_param", "cpu_offload_params",
                       "cpu_offload_use_pin_memory", "stage3_gather_fp16_weights_on_model_save")

    @staticmethod
    def translate_deprecated(raw, source, path):
        pin = deprecated_bool(raw, "cpu_offload_use_pin_memory", source, path)
        old_offloads = [("cpu_offload", "offload_optimizer"),
                        ("cpu_offload_param", "offload_param"),
                        ("cpu_offload_params", "offload_param")]
        translated = False
        for old, new in old_offloads:
            enabled = deprecated_bool(raw, old, source, path)
            if enabled is None:
                continue
            _refuse_both(raw, old, new, source, path)
            _warn_deprecated(path, old, new)
            if enabled:
                raw[new] = {"device": "cpu", "pin_memory": bool(pin)}
                translated = True
        if pin and not translated:
            fail(source, f"'{key_path(path, 'cpu_offload_use_pin_memory')}' only applies together "
                         "with the old 'cpu_offload' / 'cpu_offload_param' keys; set "
                         "\"pin_memory\": true inside 'offload_optimizer' / 'offload_param'")
        old_gather = deprecated_bool(raw, "stage3_gather_fp16_weights_on_model_save", source, path)
        if old_gather is not None:
            new = "stage3_gather_16bit_weights_on_model_save"
            for current in (new, "gather_16bit_weights_on_model_save"):
                _refuse_both(raw, "stage3_gather_fp16_weights_on_model_save", current, source, path)
            _warn_deprecated(path, "stage3_gather_fp16_weights_on_model_save", new)
            raw[new] = old_gather
        return raw

    def check(self, source, path):
        if self.overlap_comm is None:
            _settle(self, overlap_comm=self.stage == 3)
        # device "none" means no offload: normalise so the engine tests `is None` only
        if self.offload_optimizer is not None and self.offload_optimizer.device == "none":
            _settle(self, offload_optimizer=None)
        if self.offload_param is not None and self.offload_param.device == "none":
            _settle(self, offload_param=None)
        if self.offload_param is not None and self.stage != 3:
            fail(source, f"'{path}.offload_param' needs ZeRO stage 3 (only stage 3 partitions "
                         f"parameters), but '{path}.stage' is {self.stage}")
        if self.offload_optimizer is not None:
            if self.stage == 0:
                fail(source, f"'{path}.offload_optimizer' needs ZeRO stage 1, 2 or 3, but "
                             f"'{path}.stage' is 0")
            if self.offload_optimizer.ratio < 1 and self.stage != 3:
                fail(source, f"'{path}.offload_optimizer.ratio' < 1 (partial offload) needs ZeRO "
                             f"stage 3, but '{path}.stage' is {self.stage}")


def _refuse_both(raw, old, new, source, path):
    if new in raw:
        fail(source, f"'{key_path(path, old)}' is the deprecated spelling of "
                     f"'{key_path(path, new)}'; give only '{new}'")


def _warn_deprecated(path, old, new):
    logger.warning("DeepSpeed config: '%s' is deprecated, use '%s' instead",
                   key_path(path, old), key_path(path, new))


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    partition_activations: bool = option(False)
    cpu_checkpointing: bool = option(False)
    contiguous_memory_optimization: bool = option(False)
    number_checkpoints: Optional[int] = option(None, minimum=1)
    synchronize_checkpoint_boundary: bool = option(False)
    profile: bool = option(False)


@dataclass(frozen=True)
class AioConfig:
    block_size: int = option(1_048_576, minimum=1)
    queue_depth: int = option(8, minimum=1)
    thread_count: int = option(1, minimum=1, aliases=("intra_op_parallelism",))
    single_submit: bool = option(False)
    overlap_events: bool = option(True)

    DEFAULT_ONLY = {"use_gds": False}


@dataclass(frozen=True)
class TensorboardConfig:
    enabled: bool = option(False)
    output_path: Optional[str] = option("")
    job_name: str = option("DeepSpeedJobName")

    def check(self, source, path):
        if self.output_path is None:  # the docs show null; the code default is ""
            _settle(self, output_path="")


# torch.compile's keyword arguments that 'compile.kwargs' may set, with the JSON types
COMPILE_KWARGS = {"fullgraph": (bool,), "dynamic": (bool, type(None)), "mode": (str,),
                  "options": (dict,), "disable": (bool,)}


@dataclass(frozen=True)
class CompileConfig:
    """torch.compile of the engine's module (DeepSpeed v0.14's keys; the keys of its later
    DeepCompile only at their defaults)."""
    enabled: bool = option(False)
    backend: str = option("inductor")
    kwargs: dict = option({})

    DEFAULT_ONLY = {"deepcompile": False, "free_activation": False,
                    "offload_activation": False, "offload_opt_states": False,
                    "offload_parameters": False, "double_buffer": True,
                    "symmetric_memory": False, "debug_log": False}

    def check(self, source, path):
        for key, value in self.kwargs.items():
            if key not in COMPILE_KWARGS:
                fail(source, f"'{path}.kwargs' has {key!r}, which torch.compile does not take "
                             f"here; accepted: {', '.join(COMPILE_KWARGS)}")
            if not isinstance(value, COMPILE_KWARGS[key]):
                fail(source, f"'{path}.kwargs.{key}' = {value!r} has the wrong type for "
                             f"torch.compile's {key}")
        if "mode" in self.kwargs and "options" in self.kwargs:
            fail(source, f"'{path}.kwargs' sets both 'mode' and 'options'; torch.compile takes "
                         "one of them")
        if self.enabled:
            self._check_backend(source, path)

    def _check_backend(self, source, path):
        import torch._dynamo  # only when compiling: it takes a second to import
        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.backend not in backends:
            fail(source, f"'{path}.backend' {self.backend!r} is not a torch.compile backend "
                         f"here; available: {', '.join(sorted(backends))}")
        tuning = [key for key in ("mode", "options") if key in self.kwargs]
        if tuning and self.backend != "inductor":
            fail(source, f"'{path}.kwargs.{tuning[0]}' tunes inductor; the backend is "
                         f"{self.backend!r}")
        if "mode" in self.kwargs:
            import torch._inductor
            modes = torch._inductor.list_mode_options()
            if self.kwargs["mode"] not in modes:
                fail(source, f"'{path}.kwargs.mode' {self.kwargs['mode']!r} is not one of "
                             f"torch.compile's modes: {', '.join(modes)}")


# Top-level DeepSpeed keys zero does not implement, accepted only at their defaults.
UNIMPLEMENTED_TOP_LEVEL = {
    "sparse_gradients": False, "dump_state": False, "memory_breakdown": False,
    "zero_force_ds_cpu_optimizer": True,
    "sequence_parallel_size": 1,
    "checkpoint": {"tag_validation": "Warn", "load_universal": False,
                   "use_node_local_storage": False},
    "disable_allgather": False, "graph_harvesting": False,
    **{name: DISABLED_SECTION for name in (
        "amp", "flops_profiler", "wandb", "csv_monitor", "comet", "comms_logger", "elasticity",
        "hybrid_engine", "autotuning", "nebula", "eigenvalue", "progressive_layer_drop",
        "curriculum_learning", "data_efficiency", "quantize_training")},
}


@dataclass(frozen=True)
class TopLevelConfig:
    train_batch_size: Optional[int] = option(None)
    train_micro_batch_size_per_gpu: Optional[int] = option(None)
    gradient_accumulation_steps: Optional[int] = option(None)
    steps_per_print: Optional[int] = option(None, minimum=0)  # None/0: never (code default)
    wall_clock_breakdown: bool = option(False)
    gradient_clipping: float = option(0.0, minimum=0.0)  # 0 = off (v0.16.5 code default)
    prescale_gradients: bool = option(False)
    gradient_predivide_factor: float = option(1.0)
    zero_allow_untested_optimizer: bool = option(False)
    gradient_checkpointing: bool = option(False)  # our extension
    # the loader of `training_data` leaves out a last micro batch smaller than the others
    dataloader_drop_last: bool = option(False)
    # the dtype gradients are all-reduced in; only "fp32" for 16-bit params at stage 0 differs
    # from the params' own
    communication_data_type: Optional[str] = option(None, choices=("fp32", "fp16", "bf16"))
    fp16: FP16Config = section(FP16Config)
    bf16: BF16Config = section(BF16Config, aliases=("bfloat16",))
    optimizer: Optional[OptimizerSection] = section(OptimizerSection, optional=True)
    scheduler: Optional[SchedulerSection] = section(SchedulerSection, optional=True)
    zero_optimization: ZeroConfig = section(ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = section(
        ActivationCheckpointingConfig)
    aio: AioConfig = section(AioConfig)
    tensorboard: TensorboardConfig = section(TensorboardConfig)
    compile: CompileConfig = section(CompileConfig)
    data_types: DataTypesConfig = section(DataTypesConfig)

    DEFAULT_ONLY = UNIMPLEMENTED_TOP_LEVEL
    DEFAULT_ONLY_HINTS = {
        "checkpoint": "load_universal reads a folder converted by DeepSpeed's "
                      "ds_to_universal.py, which is not read here: zero's own checkpoints "
                      "resume as they are at any data-parallel size and ZeRO stage (3 <-> "
                      "0-2), and tools/merge_mp_partitions.py --deepspeed converts them to "
                      "another tensor-parallel size with their optimizer state; ranks saving "
                      "under different tags are always refused",
        "curriculum_learning": "the legacy curriculum (sequence-length warm-up) is not built: "
                               "every sample has the full sequence length",
        "data_efficiency": "curriculum sampling and random layer-token drop are not built: "
                           "samples come in the index maps' shuffled order, every layer sees "
                           "every token",
        "flops_profiler": "the log line has MFU and tokens/s; benchmarks/step_profile.py "
                          "profiles training steps (torch.profiler)",
    }
    DEPRECATED_KEYS = ("allgather_size",)
    KEY_HINTS = {
        "sparse_attention": "DeepSpeed's block-sparse attention (Triton kernels) is not "
                            "implemented: attention is torch's scaled_dot_product_attention; "
                            "remove the section",
        "compression_training": "DeepSpeed's compression (quantisation-aware training, "
                                "pruning, layer reduction) is not implemented; remove the "
                                "section (--quantize quantises weights for inference)",
        "weight_quantization": "DeepSpeed's ZeRO-Inference weight quantisation is not "
                               "implemented; remove the section (--quantize quantises weights "
                               "for generation and evaluation)",
        "pipeline": "DeepSpeed's PipelineEngine section is not read; the pipeline is laid out "
                    "by the model (pretrain_gpt2.py: --pipeline-model-parallel-size for the "
                    "stages, --num-layers-per-virtual-pipeline-stage for interleaving, "
                    "--checkpoint-activations --checkpoint-num-layers N for the activation "
                    "checkpoint interval); drop the section",
    }

    def _check_grad_accum_dtype(self, source, params, stage):
        """What each stage sums micro batches' gradients in: fp32 parameters' in fp32; 16-bit
        parameters' at stage 0 in their dtype or fp32 (the masters' gradients), at stage 1 in
        their dtype (its full gradient buffer), at stages 2-3 in fp32 (the reduced gradients
        go into the masters')."""
        chosen = self.data_types.grad_accum_dtype
        if params == "fp32":
            built, what = {"fp32"}, "fp32, the parameters' dtype"
        elif stage == 0:
            built, what = {params, "fp32"}, f"the parameters' dtype ({params}) or fp32"
        elif stage == 1:
            built, what = {params}, (f"the parameters' dtype ({params}): ZeRO stage 1 sums them "
                                     "in its full gradient buffer (stages 0, 2 and 3 sum them "
                                     "in fp32)")
        else:
            built, what = {"fp32"}, (f"fp32: ZeRO stage {stage} adds each micro batch's "
                                     "reduced gradients into the fp32 masters' gradients")
        if chosen is not None and chosen not in built:
            fail(source, f"'data_types.grad_accum_dtype' {chosen!r} with {params} parameters "
                         f"at ZeRO stage {stage}: gradients are summed in {what}; drop the key "
                         "or change it")
        if chosen == "fp32" != params and stage == 0 and \
                self.communication_data_type not in (None, "fp32"):
            fail(source, f"'data_types.grad_accum_dtype' \"fp32\" and "
                         f"'communication_data_type' {self.communication_data_type!r}: "
                         "gradients summed in fp32 are reduced in fp32 at ZeRO stage 0; drop "
                         "one of them")

    @staticmethod
    def translate_deprecated(raw, source, path):
        zero = raw.get("zero_optimization")
        allgather_size = raw.pop("allgather_size", None)
        if isinstance(zero, bool):  # ZeRO-1 era: true = stage 1, false = off
            logger.warning("DeepSpeed config: a boolean 'zero_optimization' is deprecated; "
                           "use {\"stage\": %d}", int(zero))
            raw["zero_optimization"] = {"stage": int(zero)}
            if allgather_size is not None and zero:
                raw["zero_optimization"]["allgather_bucket_size"] = allgather_size
        elif allgather_size is not None:
            fail(source, "'allgather_size' only applies to the old boolean "
                         "\"zero_optimization\": true; set "
                         "'zero_optimization.allgather_bucket_size' instead")
        return raw

    def check(self, source, path):
        if self.fp16.enabled and self.bf16.enabled:
            fail(source, "'fp16.enabled' and 'bf16.enabled' are both true; pick one precision")
        if not self.gradient_predivide_factor > 0:
            fail(source, f"'gradient_predivide_factor' must be > 0, got "
                         f"{self.gradient_predivide_factor}")
        zero = self.zero_optimization
        params = "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"
        if self.communication_data_type not in (None, params) and (
                self.communication_data_type != "fp32" or zero.stage != 0):
            fail(source, f"'communication_data_type' {self.communication_data_type!r} with "
                         f"{params} parameters at ZeRO stage {zero.stage}: zero communicates "
                         "gradients in the parameters' dtype, except \"fp32\" for 16-bit "
                         "parameters at stage 0; drop the key or change it")
        self._check_grad_accum_dtype(source, params, zero.stage)
        if zero.stage >= 2 and zero.reduce_scatter:
            # DeepSpeed asserts both: its reduce-scatter averages with a fixed 1/dp
            if self.prescale_gradients:
                fail(source, "'prescale_gradients': true is not supported with ZeRO stage "
                             f"{zero.stage} and 'zero_optimization.reduce_scatter': true; "
                             "set one of them to false")
            if self.gradient_predivide_factor != 1.0:
                fail(source, f"'gradient_predivide_factor' must be 1.0 with ZeRO stage "
                             f"{zero.stage} and 'zero_optimization.reduce_scatter': true, got "
                             f"{self.gradient_predivide_factor}; set reduce_scatter to false to "
                             "use it")
