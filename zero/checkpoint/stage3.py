"""ZeRO stage 3 checkpoints in DeepSpeed's layout (as deepspeed/runtime/zero/stage3.py saves
them), loadable at any DP size.

Every DP rank writes two files into the tag directory (zero/checkpoint/layout.py does the atomic
partial-directory dance around them):

    zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt
        module (partitioned params are empty placeholders; buffers are real), buffer_names,
        param_shapes (one OrderedDict name -> shape per sub-group, in flat order),
        frozen_param_shapes + frozen_param_fragments (this rank's pieces), shared_params,
        lr_scheduler, counters, dp/mp world sizes, ds_config, ds_version, client_state
    [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt
        {"optimizer_state_dict": {zero_stage: 3, partition_count: dp, loss_scaler, overflow,
         dynamic_loss_scale, optimizer_state_dict: torch state of the sub-group masters,
         fp32_flat_groups: [this rank's fp32 flat per sub-group, per-param padding included]},
         ds_config, ds_version}

A parameter of n elements holds ceil(n / dp) elements on every rank at the same offset of the
concatenated fp32_flat_groups, which is what DeepSpeed's zero_to_fp32.py reads. Loading walks
the parameters one at a time: each parameter (and each Adam moment) is reassembled from the
saved ranks' memory-mapped pieces and this rank's new piece is cut out, so a checkpoint loads
at any data-parallel size, and a stage 0-2 checkpoint loads too (the readers of both layouts:
zero/checkpoint/whole_params.py). fp32 weights always come from the saved fp32 masters (a
stage 3 checkpoint holds no full 16-bit module), whatever `load_from_fp32_weights` says.
"""

import logging
import os
from collections import OrderedDict

import torch

from zero.checkpoint import files as common
from zero.checkpoint.files import stage3_model_states_name
from zero.checkpoint.whole_params import check_param_groups, load_buffers, open_saved
from zero.errors import CheckpointError
from zero.optim.quantized_state import TABLE as QUANTIZED_TABLE
from zero.optim.quantized_state import merge_tables
from zero.offload.param_swapper import read_shard, write_shard
from zero.stages.gathered_parameters import GatheredParameters
from zero.stages.partition_parameters import is_zero_param

logger = logging.getLogger("zero.checkpoint.layout")


# ---------------------------------------------------------------------------------------------
# Saving

def stage3_files(engine, client_state):
    """[(file name, object)] this rank writes."""
    optimizer = engine.optimizer
    states = _model_states(engine)
    states.update(client_state)
    optim = {
        "zero_stage": 3,
        "loss_scaler": optimizer.loss_scaler.state_dict() if optimizer.loss_scaler else None,
        "dynamic_loss_scale": bool(getattr(optimizer.loss_scaler, "dynamic", False)),
        "overflow": optimizer.overflow,
        "partition_count": engine.dp_world_size,
        "optimizer_state_dict": _on_cpu(optimizer.base_state_dict()),  # swapped in (NVMe)
        "fp32_flat_groups": [optimizer.master_partition(i).to("cpu", copy=True)
                             for i in range(len(optimizer.sub_groups))],
        "ds_version": common.DS_VERSION,
    }
    optim_name = common.optim_states_name(engine.dp_rank, engine.mp_rank,
                                          engine.bfloat16_enabled())
    return [(optim_name, {"optimizer_state_dict": optim, "ds_config": engine.config.raw,
                          "ds_version": common.DS_VERSION}),
            (stage3_model_states_name(engine.dp_rank, engine.mp_rank), states)]


def _on_cpu(value):
    if torch.is_tensor(value):
        return value.to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_on_cpu(v) for v in value]
    return value


def _model_states(engine):
    module, optimizer = engine.module, engine.optimizer
    names = {p: n for n, p in module.named_parameters()}
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    persistent = set(module.state_dict().keys())
    scheduler = engine.lr_scheduler
    return {
        "module": common.module_state_on_cpu(module),
        "buffer_names": [n for n, _ in module.named_buffers() if n in persistent],
        "optimizer": None,
        "param_shapes": [OrderedDict((names[p], torch.Size(p.ds_shape)) for p in g.params)
                         for g in optimizer.sub_groups],
        "frozen_param_shapes": OrderedDict((n, torch.Size(_shape(p))) for n, p in frozen),
        "frozen_param_fragments": {n: _piece(p) for n, p in frozen},
        "shared_params": common.shared_params(module),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        **common.engine_counters(engine),
    }


def _shape(param):
    return param.ds_shape if is_zero_param(param) else tuple(param.shape)


def _piece(param):
    source = read_shard(param) if is_zero_param(param) else param.detach().reshape(-1)
    return source.to("cpu", copy=True)


# ---------------------------------------------------------------------------------------------
# Loading

def load_stage3(engine, ckpt_dir, strict, with_state):
    """Fill the partitions (and, `with_state`, the optimizer state) from a stage 3 checkpoint
    saved at any DP size; not `strict`, parameters and buffers the checkpoint lacks keep their
    values. Returns (path of this rank's model states, model states dict)."""
    saved = open_saved(ckpt_dir, engine.mp_rank, engine.mp_world_size,  # stage 0-2's too
                       engine.dp_rank)
    if saved.pipelined:
        raise CheckpointError(f"{ckpt_dir} was saved with pipeline stages, which ZeRO stage 3 "
                              "does not run; resume it at stage 0-1")
    states = saved.model_states(engine.dp_rank)
    skipped = load_buffers(engine.module, states, saved.path, strict)
    missing = restore_stage3(engine.optimizer, saved, with_state, strict)
    missing += _load_frozen(engine.module, saved, strict)
    common.report_skipped_keys(missing, skipped, saved.path)
    return saved.path, states


def restore_stage3(optimizer, saved, with_state, strict):
    """The masters (and, `with_state`, the optimizer state and loss scale) of a stage 3
    optimizer from `saved` (a reader of zero/checkpoint/whole_params.py). Returns the names
    the checkpoint lacks (not `strict`: they keep their values)."""
    optimizer.coordinator.release_all()
    if with_state:
        check_param_groups(saved, group_names(optimizer))
    restored, missing = _restore(saved, optimizer, with_state, strict)
    if with_state:
        groups = _regroup(saved.param_groups, optimizer.optimizer.param_groups)
        index = {id(g.master): i for i, g in enumerate(optimizer.sub_groups)}
        optimizer.load_saved_state(
            {"state": {index[id(g.master)]: s for g, s in restored.items() if s},
             "param_groups": groups}, saved.loss_scaler)
    optimizer.commit_restored_masters()
    return missing


def _regroup(saved_groups, current_groups):
    """Saved hyperparameters with this run's sub-group indices (sub-group counts may differ)."""
    if len(saved_groups) != len(current_groups):
        raise CheckpointError(f"the checkpoint has {len(saved_groups)} optimizer param groups, "
                              f"the optimizer {len(current_groups)}")
    groups, next_index = [], 0
    for saved, current in zip(saved_groups, current_groups):
        count = len(current["params"])
        groups.append({**saved, "params": list(range(next_index, next_index + count))})
        next_index += count
    return groups


def _load_frozen(module, saved, strict):
    """Returns the frozen parameters the checkpoint lacks (an error when `strict`)."""
    missing = []
    for name, param in module.named_parameters():
        if param.requires_grad or not is_zero_param(param):
            continue
        if not saved.has_frozen(name):
            if strict:
                raise CheckpointError(f"{saved.ckpt_dir} has no saved values for frozen "
                                      f"parameter {name} (load_module_strict=False keeps it)")
            missing.append(name)
            continue
        full = saved.frozen_full(name, param.ds_numel)
        piece = torch.empty(param.ds_tensor.shape, dtype=param.ds_tensor.dtype)
        _cut_into(piece, full, param.ds_comm.rank)
        write_shard(param, piece)  # (in memory, or its NVMe swap file)
    return missing


def _cut_into(target, full, rank):
    """target [s] <- elements [rank*s, (rank+1)*s) of full, zero padded."""
    size = target.numel()
    lo, hi = rank * size, min(full.numel(), (rank + 1) * size)
    with torch.no_grad():
        target.zero_()
        if lo < hi:
            target.narrow(0, 0, hi - lo).copy_(full.narrow(0, lo, hi - lo))


def _restore(saved, optimizer, with_state, strict):
    """Write the masters (and per-element optimizer state) of every sub-group from `saved`
    (zero/checkpoint/whole_params.py: a checkpoint of any stage). Returns ({sub-group: {state
    key: tensor}} for the torch optimizer, names of the parameters the checkpoint lacks: not
    `strict`, their masters take their current values and their optimizer state starts at
    zero)."""
    names = dict(_named(optimizer))
    missing = [n for n in names.values() if not saved.has(n)]
    if missing and strict:
        raise CheckpointError(f"{saved.ckpt_dir} has no saved values for parameter(s) "
                              f"{missing[:5]}; the model differs from the saved one "
                              "(load_module_strict=False keeps their values)")
    restored = {}
    for index, sub_group in enumerate(optimizer.sub_groups):
        state = restored.setdefault(sub_group, {})
        tables = []
        for param, offset, size in zip(sub_group.params, sub_group.offsets, sub_group.sizes):
            name = names[param]
            rank = param.ds_comm.rank
            target = optimizer.master_restore_target(index).narrow(0, offset, size)
            master = saved.master(name, param.ds_numel) if saved.has(name) else None
            if master is None:  # kept (not strict), or the checkpoint's weights are the master
                target.copy_(read_shard(param).float())
                if not saved.has(name):
                    continue
            else:
                _cut_into(target, master, rank)
            if not with_state:
                continue
            for key, dtype in saved.per_element_keys(name).items():
                target = state.setdefault(key, torch.zeros(sub_group.master.shape, dtype=dtype))
                _cut_into(target.narrow(0, offset, size), saved.state(name, key, param.ds_numel),
                          rank)
            for key, value in saved.scalar_state(name).items():
                if key not in state:
                    state[key] = value.clone() if torch.is_tensor(value) else value
            tables.append(saved.table(name, name))  # stage 3 names runs by parameter
        if any(t is not None for t in tables):
            state[QUANTIZED_TABLE] = merge_tables(tables)
    return restored, missing


def group_names(optimizer):
    """[names of the parameters of each optimizer param group] (its sub-groups, in order)."""
    names, group_of_master = optimizer.param_names, {}
    for k, group in enumerate(optimizer.optimizer.param_groups):
        for master in group["params"]:
            group_of_master[id(master)] = k
    result = [[] for _ in optimizer.optimizer.param_groups]
    for sub_group in optimizer.sub_groups:
        result[group_of_master[id(sub_group.master)]] += [names[p] for p in sub_group.params]
    return result


def _named(optimizer):
    module_names = optimizer.param_names
    return [(p, module_names[p]) for g in optimizer.sub_groups for p in g.params]


# ---------------------------------------------------------------------------------------------
# 16-bit model

def save_16bit_model_stage3(engine, save_dir, save_filename):
    """Gathers module by module; global rank 0 writes the full 16-bit state dict. Needs
    stage3_gather_16bit_weights_on_model_save (else returns False, as DeepSpeed does)."""
    if not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        logger.warning("Did not save the model %s because "
                       "stage3_gather_16bit_weights_on_model_save is False",
                       os.path.join(save_dir, save_filename))
        return False
    module, state = engine.module, OrderedDict()
    engine.optimizer.coordinator.release_all()
    keep = engine.global_rank == 0
    copies = {}
    for prefix, submodule in module.named_modules():
        params = [(n, p) for n, p in submodule.named_parameters(recurse=False,
                                                                  remove_duplicate=False)]
        with GatheredParameters([p for _, p in params]):
            for name, param in params:
                if keep:
                    if id(param) not in copies:
                        copies[id(param)] = param.detach().to("cpu", copy=True)
                    state[f"{prefix}.{name}" if prefix else name] = copies[id(param)]
    if keep:
        persistent = module.state_dict(keep_vars=True)
        for name, buffer in module.named_buffers():
            if name in persistent:
                state[name] = buffer.detach().to("cpu", copy=True)
    path = os.path.join(save_dir, save_filename)

    def write():
        os.makedirs(save_dir, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    common.on_rank0_then_agree(engine, write, f"save {path}")
    return True
