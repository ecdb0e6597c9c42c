"""The optimizer the engine steps through, for the configured ZeRO stage and offload.

Stages 0-2 wrap the base optimizer in a ZeroOptimizer over flat buffers (zero/stages/
stage1_2.py); with offload_optimizer its masters and states live on the host or NVMe
(zero/offload/). Stage 3 first turns the model into a partitioned one:

1. Parameters not built under `zero.Init` are partitioned now (each rank keeps its piece of
   DP rank 0's values), over the engine's data-parallel group.
2. Partitions follow what was done to the module after `zero.Init`: `module.half()`,
   `.bfloat16()`, `.to(device)` only change the empty placeholders, so the partitions are
   cast/moved to match (except partitions kept in host memory by remote_device "cpu").
3. Buffers are broadcast from DP rank 0, as for the other stages.
4. The Stage3Optimizer wraps the base optimizer with the config's stage 3 knobs.
   offload_param "nvme" puts the shards in swap files (zero/offload/param_swapper.py).

Every stage composes with a master store (zero/stages/masters.py): DeviceMasters, or with
offload_optimizer HostMasters (zero/offload/host_masters.py).
"""

import torch

from zero.errors import ConfigError
from zero.optim.loss_scaler import build_loss_scaler
from zero.offload.param_swapper import read_shard
from zero.stages.partition_parameters import (is_zero_param, normalize_remote_device,
                                              param_swapper_for, partition_module)
from zero.stages.masters import DeviceMasters
from zero.stages.stage1_2 import ZeroOptimizer, ZeroSettings
from zero.stages.stage3 import Stage3Optimizer, Stage3Settings
from zero.stages.param_coordinator import Stage3Knobs


def build_zero_optimizer(engine, base_optimizer, module_reduces_gradients=False):
    """The partitioning optimizer for engine.config around `base_optimizer` (a torch one)."""
    config = engine.config
    loss_scaler = build_loss_scaler(config)
    if config.zero_optimization.stage == 3:
        if engine.pp_comm is not None:
            raise ConfigError("ZeRO stage 3 does not compose with pipeline parallelism (as in "
                            "DeepSpeed's PipelineEngine); use stage 0, 1 or 2")
        return build_stage3_optimizer(engine, base_optimizer, loss_scaler)
    if any(is_zero_param(p) for p in engine.module.parameters()):
        raise ConfigError(f"the model was built under zero.Init, which partitions its "
                          f"parameters for ZeRO stage 3; this config asks for stage "
                          f"{config.zero_optimization.stage}. Use stage 3, or build the model "
                          "without zero.Init")
    param_order = {p: i for i, p in enumerate(engine.module.parameters())}
    settings = zero_settings(config, module_reduces_gradients)
    return ZeroOptimizer(base_optimizer, param_order, settings, engine.dp_comm, engine.mp_comm,
                         engine.mp_rank, loss_scaler, masters=master_store(engine),
                         pp_comm=engine.pp_comm)


def master_store(engine):
    """Where the fp32 masters and optimizer state live: on the device (stepped by the torch
    optimizer), or with offload_optimizer on the host or NVMe (stepped by CPUAdam)."""
    if engine.config.zero_optimization.offload_optimizer is None:
        return DeviceMasters()
    from zero.offload.host_masters import HostMasters, OptimizerOffload
    return HostMasters(OptimizerOffload.from_config(engine.config, engine.global_rank))


def zero_settings(config, module_reduces_gradients=False):
    zero = config.zero_optimization
    if module_reduces_gradients and zero.stage != 0:
        raise ConfigError(f"a model that reduces its own gradients (torch DistributedDataParallel)"
                          f" runs at ZeRO stage 0 only; the config asks for stage {zero.stage}")
    return ZeroSettings(stage=zero.stage, reduce_bucket_size=zero.reduce_bucket_size,
                        overlap_comm=bool(zero.overlap_comm), reduce_scatter=zero.reduce_scatter,
                        prescale_gradients=config.prescale_gradients,
                        gradient_predivide_factor=config.gradient_predivide_factor,
                        gradient_clipping=config.gradient_clipping,
                        ignore_unused_parameters=zero.ignore_unused_parameters,
                        fp32_communication=config.communication_data_type == "fp32",
                        external_reduction=module_reduces_gradients,
                        fp32_accumulation=_sums_16bit_gradients_in_fp32(
                            config, module_reduces_gradients))


def _sums_16bit_gradients_in_fp32(config, module_reduces_gradients):
    """Stage 0 with 16-bit parameters: whether micro batches' gradients are summed (and
    reduced) in the fp32 masters' gradients. 'data_types.grad_accum_dtype' decides; without
    it bf16 does (DeepSpeed's default for bf16 without ZeRO, Megatron-LM's for bf16) unless
    'communication_data_type' asks for bf16 reductions, fp16 does not. A module that reduces
    its own gradients (torch DDP) reduces them in its parameters' dtype, so there they are
    summed in it too."""
    params = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else "fp32"
    if config.zero_optimization.stage != 0 or params == "fp32":
        return False
    chosen = config.data_types.grad_accum_dtype
    if chosen == "fp32" and module_reduces_gradients:
        raise ConfigError(f"DeepSpeed config {config.source}: 'data_types.grad_accum_dtype' "
                          "\"fp32\" with a model that reduces its own gradients (torch "
                          f"DistributedDataParallel), which reduces them in {params}; let the "
                          "engine reduce them (Megatron: --DDP-impl local), or drop the key")
    if chosen is None:  # (a 16-bit communication_data_type asks for 16-bit reductions)
        return params == "bf16" and not module_reduces_gradients \
            and config.communication_data_type in (None, "fp32")
    return chosen == "fp32"


def remote_device_of(config):
    """The partitions' home from the config: offload_param's device, else the device."""
    offload = config.zero_optimization.offload_param
    return normalize_remote_device(offload.device if offload is not None else None)


def build_stage3_optimizer(engine, base_optimizer, loss_scaler):
    config, zero = engine.config, engine.config.zero_optimization
    offload = zero.offload_param
    remote = remote_device_of(config)
    if remote == "nvme" and zero.offload_optimizer is None:
        raise ConfigError(f"DeepSpeed config {config.source}: 'zero_optimization.offload_param' "
                          "device \"nvme\" needs 'offload_optimizer' (\"cpu\" or \"nvme\") too: "
                          "the fp32 masters cannot share memory with swapped parameter shards")
    pin = bool(getattr(offload, "pin_memory", False)) if offload is not None else False
    module = engine.module
    swapper = param_swapper_for(config, remote, engine.global_rank)
    partition_module(module, engine.dp_comm, remote_device=remote, pin_memory=pin,
                     swapper=swapper)
    _match_placeholders(module)
    with torch.no_grad():
        for buffer in module.buffers():
            engine.dp_comm.broadcast(buffer.data)
    knobs = Stage3Knobs(
        prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
        max_live_parameters=zero.stage3_max_live_parameters,
        max_reuse_distance=zero.stage3_max_reuse_distance,
        param_persistence_threshold=zero.stage3_param_persistence_threshold,
        model_persistence_threshold=zero.stage3_model_persistence_threshold)
    overlap = True if zero.overlap_comm is None else bool(zero.overlap_comm)  # DeepSpeed: on
    settings = Stage3Settings(reduce_bucket_size=zero.reduce_bucket_size, overlap_comm=overlap,
                              reduce_scatter=zero.reduce_scatter,
                              gradient_clipping=config.gradient_clipping,
                              sub_group_size=zero.sub_group_size, knobs=knobs)
    return Stage3Optimizer(base_optimizer, module, settings, engine.dp_comm, engine.mp_comm,
                           engine.mp_rank, loss_scaler, masters=master_store(engine))


@torch.no_grad()
def _match_placeholders(module):
    for param in module.parameters():
        if not is_zero_param(param):
            continue
        want = param.data
        shard = param.ds_tensor
        if getattr(param, "ds_swapper", None) is not None:
            if shard.dtype != want.dtype:  # e.g. module.half() after zero.Init: rewrite the file
                values = read_shard(param).to(want.dtype)
                param.ds_tensor = param.ds_swapper.offload(param, values)
            continue
        device = shard.device if param.ds_remote_device == "cpu" else want.device
        if shard.dtype != want.dtype or shard.device != device:
            param.ds_tensor = shard.to(dtype=want.dtype, device=device)
