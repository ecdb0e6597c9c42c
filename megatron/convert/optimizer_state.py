"""The trainer's optimizer state, merged to full tensors and split again like the model.

What a Megatron-layout checkpoint holds as "optimizer" on each tensor-parallel rank
(megatron/checkpointing/optimizer_state.py writes it):

    {"optimizer": AdamW state_dict {"state": {index: {"step", "exp_avg", "exp_avg_sq"}},
                                    "param_groups": [{"params": [index, ...], "lr", ...}]},
                  (--optimizer adam8bit / adam4bit: codes and a table of scales in place of
                  exp_avg / exp_avg_sq, zero/optim/quantized_state.py; dequantised here)
     "fp32_from_fp16_params": [[fp32 master or None, one per param] per group],
     "grad_scaler": loss-scaler state or None}

Indices count parameters group by group.  The groups are [weight decay, no weight decay]
with empty ones dropped, each in model order (megatron/training/param_groups.py), so the key
map's weight-decay column names the parameter behind every index.  Adam moments and fp32
masters have their parameter's shape and are sharded like it; `step` is one scalar per
parameter, the same on every rank.  The number and order of parameters do not depend on the
tensor-parallel size, so the param_groups (hyper-parameters and indices) carry over unchanged.
"""

import copy
from dataclasses import dataclass
from typing import Any, List

import torch

from megatron.convert.deferred import Deferred
from megatron.convert.tp_layout import REPLICATED, merge_shards, parameter_layout, shard_of
from megatron.errors import CheckpointError
from zero.optim.quantized_state import decode_parameter_entry, is_quantized


@dataclass
class FullOptimizerState:
    param_groups: List[dict]          # rank 0's AdamW param_groups, indices included
    group_names: List[List[str]]      # the parameter name behind each index, group by group
    # merged as they are read (megatron/convert/deferred.py):
    moments: Deferred                 # name -> {"step": scalar, "exp_avg": full, ...} or None
    masters: Deferred                 # name -> full fp32 master (None: an fp32 param)
    grad_scaler: Any


def optimizer_group_names(model_names):
    """Parameter names of each optimizer group, in the trainer's order."""
    decay = [name for name in model_names if parameter_layout(name).weight_decay]
    no_decay = [name for name in model_names if not parameter_layout(name).weight_decay]
    return [group for group in (decay, no_decay) if group]


def merge_optimizer_states(states, models):
    """FullOptimizerState from each rank's saved optimizer state and flat model state dict."""
    group_names = optimizer_group_names(list(models[0]))
    param_groups = states[0]["optimizer"]["param_groups"]
    _check_groups(group_names, param_groups)
    # (group, position in it, state index) of each parameter
    where = {name: (group_index, position, index)
             for group_index, names in enumerate(group_names)
             for position, (name, index) in enumerate(zip(names, param_groups[group_index]
                                                          ["params"]))}
    saved_masters = [state.get("fp32_from_fp16_params") for state in states]

    def moments(name):
        per_rank = [state["optimizer"]["state"].get(where[name][2]) for state in states]
        return _merge_moments(name, per_rank, [model[name] for model in models])

    def master(name):
        group_index, position, _ = where[name]
        per_rank = [None if saved is None else saved[group_index][position]
                    for saved in saved_masters]
        return _merge_tensors(name, "fp32 master", per_rank, [model[name] for model in models],
                              check_replicas=True)
    return FullOptimizerState(param_groups, group_names, Deferred(where, moments),
                              Deferred(where, master), states[0].get("grad_scaler"))


def _check_groups(group_names, param_groups):
    expected = [len(names) for names in group_names]
    saved = [len(group["params"]) for group in param_groups]
    if expected != saved:
        raise CheckpointError(
            f"the optimizer state has parameter groups of sizes {saved}, but this trainer "
            f"groups the model's parameters as {expected} (weight decay, no weight decay); it "
            "was not saved by pretrain_gpt2.py. Convert a checkpoint saved with "
            "--no-save-optim, then resume with --no-load-optim")


def _merge_moments(name, per_rank, shard_models):
    """{"step": rank 0's, each parameter-shaped tensor: merged}, or None if never stepped.
    Quantised states (--optimizer adam8bit / adam4bit) are dequantised first: their blocks
    follow each shard, so they do not survive a different cut; the fp32 moments requantise
    at the first step after loading."""
    if per_rank[0] is None:
        return None
    try:
        per_rank = [decode_parameter_entry(s) if is_quantized(s) else s for s in per_rank]
    except ValueError as error:
        raise CheckpointError(f"the quantised optimizer state of {name}: {error}") from None
    merged = {}
    for key, value in per_rank[0].items():
        if torch.is_tensor(value) and value.dim() > 0:  # exp_avg, exp_avg_sq
            merged[key] = _merge_tensors(name, key, [s[key] for s in per_rank], shard_models,
                                         check_replicas=False)
        else:
            merged[key] = value  # the step count: the same on every rank
    return merged


def _merge_tensors(name, what, tensors, shard_models, check_replicas):
    """Merge one optimizer tensor per rank that is shaped like the parameter's shard."""
    if all(t is None for t in tensors):
        return None
    for rank, (tensor, param) in enumerate(zip(tensors, shard_models)):
        if tensor is None or tensor.shape != param.shape:
            shape = None if tensor is None else tuple(tensor.shape)
            raise CheckpointError(
                f"{what} of {name} on mp_rank_{rank:02d} has shape {shape}, but the parameter "
                f"has shape {tuple(param.shape)}: the optimizer state does not match the model")
    split = parameter_layout(name).split
    # Moments of replicated parameters agree in exact arithmetic; rank 0's are used.
    return merge_shards(f"{what} of {name}", tensors, split,
                        check_replicas=check_replicas and split == REPLICATED)


def map_optimizer_tensors(full, name, function):
    """Apply `function` to every parameter-shaped tensor of `name` (e.g. a vocab resize)."""
    full.masters.then(name, lambda master: None if master is None else function(master))
    full.moments.then(name, lambda moments: _map_moments(moments, function))


def _map_moments(moments, function):
    """`moments` with function applied to each parameter-shaped tensor, one at a time in place
    (so the old and new forms of only one tensor are alive at once)."""
    if moments is not None:
        for key, value in moments.items():
            if torch.is_tensor(value) and value.dim() > 0:
                moments[key] = function(value)
    return moments


def optimizer_state_of(full, num_partitions, rank, wanted=None):
    """The saved optimizer state dict of target rank `rank` among `num_partitions`; each full
    tensor is merged when it is cut (and dropped before the next). Parameters outside
    `wanted` (default: every parameter) get no state and a None master, and nothing of theirs is
    merged."""
    adam_state, masters = {}, []
    for group, names in zip(full.param_groups, full.group_names):
        masters.append([])
        for index, name in zip(group["params"], names):
            if wanted is not None and name not in wanted:
                masters[-1].append(None)
                continue
            split = parameter_layout(name).split
            moments = full.moments[name]
            if moments is not None:
                adam_state[index] = _moments_of(moments, split, num_partitions, rank)
            del moments
            master = full.masters[name]
            masters[-1].append(None if master is None else
                               shard_of(master, split, num_partitions, rank))
            del master
    return {"optimizer": {"state": adam_state, "param_groups": copy.deepcopy(full.param_groups)},
            "fp32_from_fp16_params": masters, "grad_scaler": copy.deepcopy(full.grad_scaler)}


def _moments_of(moments, split, num_partitions, rank):
    """{"step": ..., "exp_avg": shard, ...} of one rank."""
    return {key: shard_of(value, split, num_partitions, rank)
            if torch.is_tensor(value) and value.dim() > 0 else
            (value.clone() if torch.is_tensor(value) else value)
            for key, value in moments.items()}
