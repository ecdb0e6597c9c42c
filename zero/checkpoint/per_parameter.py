"""Optimizer state one tensor per parameter, for checkpoint formats that keep it so
(Megatron's `model_optim_rng.pt`: a torch optimizer state per parameter, fp32 masters per
parameter): cut out of a stage 0 engine, and put back into an engine at any stage.

At stage 0 every rank holds one partition: a param group's fp32 master and its per-element
optimizer state (Adam's moments) are flat tensors in which parameter i occupies
[offset_i, offset_i + numel_i) (zero/stages/flat_buffers.py). These functions cut them into
per-parameter copies and put such copies back; the elements past the last parameter are
padding and stay zero.
"""

import torch

from zero.errors import CheckpointError
from zero.optim.quantized_state import TABLE as QUANTIZED_TABLE
from zero.optim.quantized_state import merge_tables, rename_table, restrict_table


def _check_single_partition(optimizer):
    if getattr(optimizer, "partition_count", None) != 1:
        raise CheckpointError("per-parameter optimizer states need ZeRO stage 0 (one partition "
                              "per rank); this engine partitions them over data parallelism")


def _torch_group_index(optimizer, group):
    """Which of the torch optimizer's param groups steps `group`'s master."""
    for k, torch_group in enumerate(optimizer.param_groups):
        if any(p is group.master for p in torch_group["params"]):
            return k
    raise CheckpointError("a ZeRO parameter group has no master in the torch optimizer")


def _slices(group):
    for param, offset, numel in zip(group.params, group.layout.offsets, group.layout.numels):
        yield param, slice(offset, offset + numel)


@torch.no_grad()
def per_parameter_state(optimizer):
    """(param_groups, per-group lists) of a stage 0 ZeroOptimizer.

    `param_groups` are the torch optimizer's hyper-parameters per group (its state_dict's,
    without "params"); each list holds one dict per parameter, in the group's order:
    {"param": the model parameter, "master": its fp32 master as a CPU tensor of its shape
    (None when the master is the fp32 parameter itself), "state": {"step": the group's step,
    each per-element state: a CPU tensor of the parameter's shape} ({} before the first step)}.
    """
    _check_single_partition(optimizer)
    base = optimizer.base_state_dict()
    groups, per_group = [], []
    for g, group in enumerate(optimizer.groups):
        torch_group = base["param_groups"][_torch_group_index(optimizer, group)]
        hyper = {k: v for k, v in torch_group.items() if k != "params"}
        saved = base["state"].get(torch_group["params"][0], {})
        master = None if group.master_is_flat else optimizer.master_partition(g)
        entries = []
        for i, (param, where) in enumerate(_slices(group)):
            state = {key: _per_param(value, where, param, group) for key, value in saved.items()}
            if QUANTIZED_TABLE in state:  # the runs of this parameter only
                state[QUANTIZED_TABLE] = restrict_table(state[QUANTIZED_TABLE],
                                                        optimizer.piece_name(g, i))
            entries.append({"param": param, "state": state,
                            "master": None if master is None else
                            master[where].to("cpu", copy=True).view_as(param)})
        groups.append(hyper)
        per_group.append(entries)
    return groups, per_group


def _per_param(value, where, param, group):
    if torch.is_tensor(value) and value.dim() == 1 and \
            value.numel() == group.layout.partition_numel:
        return value[where].to("cpu", copy=True).view(param.shape)
    return value.clone() if torch.is_tensor(value) else value


@torch.no_grad()
def load_per_parameter_state(optimizer, param_groups, per_group):
    """Restore a stage 0 ZeroOptimizer from what `per_parameter_state` returns.

    Each parameter's "master" may be None: its master is then rebuilt from the (already
    loaded) model weights. "state" may be {} for all parameters of a group (saved before the
    first step). Hyper-parameters come from `param_groups`; the torch implementation flags
    (fused, foreach, ...) stay this optimizer's.
    """
    _check_single_partition(optimizer)
    if [len(entries) for entries in per_group] != [len(g.params) for g in optimizer.groups]:
        raise CheckpointError(
            f"the optimizer state has parameter groups of sizes "
            f"{[len(entries) for entries in per_group]}, this model's are "
            f"{[len(g.params) for g in optimizer.groups]}")
    optimizer.refresh_masters_from_model()
    base = optimizer.base_state_dict()
    states, groups = {}, [dict(group) for group in base["param_groups"]]
    for g, (group, entries) in enumerate(zip(optimizer.groups, per_group)):
        k = _torch_group_index(optimizer, group)
        current = base["param_groups"][k]
        index = current["params"][0]
        groups[k] = {**param_groups[g], **{key: current[key] for key in _IMPL_FLAGS
                                           if key in current}, "params": current["params"]}
        target = optimizer.master_restore_target(g)
        state = {}
        for (param, where), entry in zip(_slices(group), entries):
            if entry.get("master") is not None:
                _check_shape(entry["master"], param, "fp32 master")
                target[where].copy_(entry["master"].reshape(-1))
            for key, value in (entry.get("state") or {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    _check_shape(value, param, f"optimizer state {key!r}")
                    flat = state.setdefault(key, torch.zeros(group.layout.partition_numel,
                                                             dtype=value.dtype))
                    flat[where].copy_(value.reshape(-1))
                elif key == QUANTIZED_TABLE:  # each parameter's runs, for the whole group
                    state[key] = merge_tables([state.get(key), value])
                else:
                    state.setdefault(key, value.clone() if torch.is_tensor(value) else value)
        if state:
            states[index] = state
    optimizer.load_saved_state({"state": states, "param_groups": groups}, None)
    optimizer.commit_restored_masters()


def restore_per_parameter_state(engine, param_groups, per_group, loss_scaler_state, where):
    """`load_per_parameter_state` for an engine at any stage: where the optimizer holds one
    partition (stages 0-2 on one rank, stage 0 on any) directly, else through the readers
    of zero/checkpoint/restore.py, which cut each parameter's part out for this rank.
    `where` names the checkpoint in errors."""
    from zero.checkpoint.restore import engine_names_per_group, restore_optimizer
    optimizer = engine.optimizer
    if getattr(optimizer, "partition_count", None) == 1 and \
            engine.zero_optimization_stage() != 3:
        load_per_parameter_state(optimizer, param_groups, per_group)
        if optimizer.loss_scaler is not None and loss_scaler_state is not None:
            optimizer.loss_scaler.load_state_dict(loss_scaler_state)
        return
    reader = PerParameterReader(engine_names_per_group(engine), param_groups, per_group,
                                loss_scaler_state, where)
    restore_optimizer(engine, reader)


class PerParameterReader:
    """Per-parameter optimizer state (`load_per_parameter_state`'s arguments: per group, in
    the group's order, {"state": ..., "master": fp32 tensor or None}) read as the readers of
    zero/checkpoint/whole_params.py read a ZeRO checkpoint. A None master: the loaded weights
    are the master."""

    def __init__(self, names_per_group, param_groups, per_group, loss_scaler, where):
        sizes = [len(entries) for entries in per_group]
        if sizes != [len(names) for names in names_per_group]:
            raise CheckpointError(f"the optimizer state has parameter groups of sizes {sizes}, "
                                  f"this model's are {[len(n) for n in names_per_group]}")
        self.ckpt_dir, self.param_groups, self.loss_scaler = where, param_groups, loss_scaler
        self._entries = {name: (g, entry) for g, (names, entries)
                         in enumerate(zip(names_per_group, per_group))
                         for name, entry in zip(names, entries)}

    def has(self, name):
        return name in self._entries

    def group_of(self, name):
        return self._entries[name][0]

    def _flat(self, name, tensor, numel, what):
        if tensor.numel() != numel:
            raise CheckpointError(f"{what} of {name} has {tensor.numel()} elements, the "
                                  f"parameter {numel}: the optimizer state does not fit the "
                                  "model")
        return tensor.reshape(-1)

    def master(self, name, numel):
        master = self._entries[name][1].get("master")
        return None if master is None else self._flat(name, master, numel, "the fp32 master")

    def _state(self, name):
        return self._entries[name][1].get("state") or {}

    def per_element_keys(self, name):
        return {key: value.dtype for key, value in self._state(name).items()
                if torch.is_tensor(value) and value.dim() > 0}

    def state(self, name, key, numel):
        return self._flat(name, self._state(name)[key], numel, f"optimizer state {key!r}")

    def scalar_state(self, name):
        return {key: value for key, value in self._state(name).items() if key != QUANTIZED_TABLE
                and not (torch.is_tensor(value) and value.dim() > 0)}

    def table(self, name, key):
        return rename_table(self._state(name).get(QUANTIZED_TABLE), key)


_IMPL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def _check_shape(tensor, param, what):
    if tensor.numel() != param.numel():
        raise CheckpointError(f"{what} of shape {tuple(tensor.shape)} does not fit the "
                              f"parameter of shape {tuple(param.shape)}")
