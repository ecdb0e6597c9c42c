"""The optimizer entry of a Megatron-layout checkpoint, to and from the zero engine at stage 0.

    {"optimizer": {"state": {index: {"step", "exp_avg", "exp_avg_sq"}},
                   "param_groups": [{"params": [index, ...], "lr", "betas", ...}]},
                  (--optimizer adam8bit / adam4bit: per-element codes and the parameter's
                  table of scales instead of the moments, zero/optim/quantized_state.py)
     "fp32_from_fp16_params": [[fp32 master or None, one per parameter] per group],
     "grad_scaler": the loss scaler's state, or None}

Indices count parameters group by group, groups as `megatron.training.param_groups` makes
them; tensors have their parameter's shape (megatron/convert/optimizer_state.py reshards
them). An fp32 parameter has no separate master (None). The engine keeps the same numbers
in flat per-group tensors; zero.checkpoint.per_parameter cuts them out (at stage 0) and puts
them back (at any stage: a --deepspeed run resumes a Megatron-layout checkpoint).
"""

from zero.checkpoint.per_parameter import per_parameter_state, restore_per_parameter_state
from zero.checkpoint.restore import engine_names_per_group
from zero.errors import CheckpointError as ZeroCheckpointError

from megatron.errors import CheckpointError


def megatron_optimizer_state(engine):
    """This rank's optimizer entry (plain containers and CPU tensors)."""
    param_groups, per_group = per_parameter_state(engine.optimizer)
    state, groups, masters, index = {}, [], [], 0
    for hyper, entries in zip(param_groups, per_group):
        indices = []
        for entry in entries:
            if entry["state"]:
                state[index] = entry["state"]
            indices.append(index)
            index += 1
        groups.append(dict(hyper, params=indices))
        masters.append([entry["master"] for entry in entries])
    scaler = engine.optimizer.loss_scaler
    return {"optimizer": {"state": state, "param_groups": groups},
            "fp32_from_fp16_params": masters,
            "grad_scaler": scaler.state_dict() if scaler is not None else None}


def load_megatron_optimizer_state(engine, saved, path, fp32_weights=None):
    """Restore the engine's optimizer (moments, fp32 masters, loss scale) from `saved`.
    `fp32_weights` ({id(parameter): tensor}) are the masters of parameters that `saved`
    has none for (fp32 in the checkpoint's run, 16-bit in this one)."""
    if not isinstance(saved, dict) or "optimizer" not in saved:
        raise CheckpointError(f"{path}: the optimizer state has no 'optimizer' entry: it was "
                              "not saved by this trainer. Load with --no-load-optim")
    inner, masters = saved["optimizer"], saved.get("fp32_from_fp16_params")
    state = inner.get("state", {})
    per_group, param_groups = [], []
    for g, group in enumerate(inner.get("param_groups", [])):
        indices = group["params"]
        group_masters = masters[g] if masters is not None and g < len(masters) else None
        if group_masters is not None and len(group_masters) != len(indices):
            raise CheckpointError(f"{path}: the fp32 master weights are grouped differently "
                                  "from the optimizer state; load with --no-load-optim")
        per_group.append([{"state": state.get(index, state.get(str(index), {})),
                           "master": None if group_masters is None else group_masters[i]}
                          for i, index in enumerate(indices)])
        param_groups.append({k: v for k, v in group.items() if k != "params"})
    params = dict(engine.module.named_parameters())
    for names, entries in zip(engine_names_per_group(engine), per_group):
        for name, entry in zip(names, entries):
            if entry["master"] is None and id(params[name]) in (fp32_weights or {}):
                entry["master"] = fp32_weights[id(params[name])]
    scaler = None if saved.get("grad_scaler") is None else \
        loss_scaler_state(saved["grad_scaler"])
    try:
        restore_per_parameter_state(engine, param_groups, per_group, scaler, path)
    except ZeroCheckpointError as error:
        raise CheckpointError(f"{path}: {error}. Load with --no-load-optim, or use the flags the "
                              "checkpoint was trained with") from None


def loss_scaler_state(saved):
    """The zero loss scaler's state for what a checkpoint holds. Checkpoints of this trainer
    before it ran on the zero engine hold {"scale", "growth_tracker", "hysteresis_tracker"}
    (clean steps since the last overflow or growth, overflows left before a back-off)."""
    if "cur_scale" in saved:
        return saved
    if "growth_tracker" not in saved:  # a static scale
        return {"dynamic": False, "cur_scale": float(saved["scale"])}
    return {"dynamic": True, "cur_scale": float(saved["scale"]),
            "cur_iter": int(saved["growth_tracker"]), "last_overflow_iter": -1,
            "cur_hysteresis": int(saved["hysteresis_tracker"])}
