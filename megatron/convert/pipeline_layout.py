"""Pipeline stages of a Megatron-layout checkpoint joined into one model, and split again.

A stage's file (`mp_rank_TT_PPP/model_optim_rng.pt`) holds its own transformer layers
numbered from 0, the embeddings on stage 0 and the final LayerNorm on the last stage, and an
optimizer state over its own parameters (indices group by group: weight decay, no weight
decay, each in model order). Joining renumbers each stage's layers to their place in the
model (`stage_layers`: as the trainer cuts them, interleaved model chunks included) and
orders the parameters as the model does, which gives exactly the file a single-stage run
saves; splitting is the inverse. Everything else
in a file (iteration, args, schedule, loss scale) is the same on every stage; the RNG states
of stage 0 are kept, and every stage of a split gets them (a --load that converts reseeds the
later stages' dropout streams). Quantised optimizer states
(--optimizer adam8bit / adam4bit) move as their decoded moments.
"""

import copy
import re

from megatron.checkpointing.state_dicts import to_flat_state_dict, to_nested_state_dict
from megatron.convert.tp_layout import parameter_layout
from megatron.errors import CheckpointError
from megatron.model.transformer import stage_layers
from zero.optim.quantized_state import decode_parameter_entry, is_quantized

_LAYER = re.compile(r"^(language_model\.transformer\.layers\.)(\d+)(\..*)$")


def _group_kinds(names):
    """The optimizer groups of a model with these parameter names, as (kind, names): kind True
    for the weight-decay group; empty groups are dropped, as the trainer drops them."""
    decay = [n for n in names if parameter_layout(n).weight_decay]
    rest = [n for n in names if not parameter_layout(n).weight_decay]
    return [(kind, group) for kind, group in ((True, decay), (False, rest)) if group]


def _per_name(optimizer, names):
    """{name: (adam entry or None, fp32 master or None)} and {kind: hyper-parameters} of one
    file's optimizer entry."""
    inner = optimizer["optimizer"]
    masters = optimizer.get("fp32_from_fp16_params")
    entries, hypers = {}, {}
    for g, (kind, group) in enumerate(_group_kinds(names)):
        saved = inner["param_groups"][g]
        if len(saved["params"]) != len(group):
            raise CheckpointError(f"an optimizer group holds {len(saved['params'])} parameters "
                                  f"where the stage's model has {len(group)}: the file was not "
                                  "saved by pretrain_gpt2.py")
        hypers[kind] = {k: v for k, v in saved.items() if k != "params"}
        for position, (name, index) in enumerate(zip(group, saved["params"])):
            master = None if masters is None else masters[g][position]
            entry = inner["state"].get(index, inner["state"].get(str(index)))
            if entry is not None and is_quantized(entry):
                # a quantised entry's table names its parameter by index: moving it to
                # another index moves AdamW's moments instead (requantised at the next step)
                entry = decode_parameter_entry(entry)
            entries[name] = (entry, master)
    return entries, hypers


def _optimizer_for(names, entries, hypers, template):
    """A Megatron optimizer entry over `names` (model order) from per-name entries."""
    state, groups, masters, index = {}, [], [], 0
    for kind, group in _group_kinds(names):
        indices = []
        for name in group:
            entry, _ = entries[name]
            if entry is not None:
                state[index] = entry
            indices.append(index)
            index += 1
        groups.append(dict(hypers[kind], params=indices))
        masters.append([entries[name][1] for name in group])
    out = {k: copy.deepcopy(v) for k, v in template.items()
           if k not in ("optimizer", "fp32_from_fp16_params")}
    out["optimizer"] = {"state": state, "param_groups": groups}
    out["fp32_from_fp16_params"] = masters if template.get("fp32_from_fp16_params") \
        is not None else None
    return out


def stage_layer_numbers(args, stages, stage):
    """The layer numbers, in local order, a stage of a checkpoint with these args holds."""
    per_virtual = args.get("num_layers_per_virtual_pipeline_stage")
    chunks = 1 if not per_virtual else args["num_layers"] // (per_virtual * stages)
    return [n for chunk in stage_layers(args["num_layers"], stages, stage, chunks)
            for n in chunk]


def _renumbered(flat, numbers):
    """Layer keys renumbered by `numbers` (old number -> new), other keys unchanged; order
    kept."""
    out = {}
    for key, value in flat.items():
        match = _LAYER.match(key)
        out[f"{match.group(1)}{numbers[int(match.group(2))]}{match.group(3)}" if match
            else key] = value
    return out


def join_stages(stages):
    """One file's contents (pipeline_model_parallel_size 1) from the files of stages 0..P-1 of
    one tensor-parallel rank."""
    flat = {}
    per_name, hypers = {}, {}
    with_optimizer = ["optimizer" in stage for stage in stages]
    if any(with_optimizer) and not all(with_optimizer):
        raise CheckpointError("some pipeline stages have optimizer state and others not: the "
                              "files come from different saves")
    for number, stage in enumerate(stages):
        stage_flat = to_flat_state_dict(stage["model"])
        layers = {int(m.group(2)) for m in map(_LAYER.match, stage_flat) if m}
        if layers != set(range(len(layers))):
            raise CheckpointError(f"pipeline stage {number} holds layers {sorted(layers)}, not "
                                  "0..n-1: it was not saved by a pipeline stage")
        numbers = stage_layer_numbers(stages[0]["args"], len(stages), number)
        if len(numbers) != len(layers):
            raise CheckpointError(f"pipeline stage {number} holds {len(layers)} layers, but its "
                                  f"args give it {len(numbers)}")
        renumbered = _renumbered(stage_flat, numbers)
        if all(with_optimizer):
            entries, stage_hypers = _per_name(stage["optimizer"], list(stage_flat))
            per_name.update({new: entries[old] for old, new in zip(stage_flat, renumbered)})
            for kind, hyper in stage_hypers.items():
                hypers.setdefault(kind, hyper)
        flat.update(renumbered)
    joined = {k: v for k, v in stages[0].items() if k not in ("model", "optimizer")}
    joined["args"] = with_stages(stages[0]["args"], 1, None)
    flat = _in_model_order(flat)
    joined["model"] = to_nested_state_dict(flat)
    if all(with_optimizer):
        joined["optimizer"] = _optimizer_for(list(flat), per_name, hypers,
                                             stages[0]["optimizer"])
    return joined


def with_stages(args, stages, layers_per_virtual_stage):
    """`args` recording a layout of `stages` stages (and model chunks of that many layers)."""
    args = dict(args, pipeline_model_parallel_size=stages)
    if layers_per_virtual_stage is not None or "num_layers_per_virtual_pipeline_stage" in args:
        args["num_layers_per_virtual_pipeline_stage"] = layers_per_virtual_stage
    return args


def _in_model_order(flat):
    """Embeddings, layers by number, the rest (the final LayerNorm): the module's order."""
    def rank(key):
        match = _LAYER.match(key)
        if match:
            return (1, int(match.group(2)))
        return (0, 0) if key.startswith("language_model.embedding.") else (2, 0)
    return {key: flat[key] for key in sorted(flat, key=rank)}  # sorted() is stable


def split_stages(whole, stages, layers_per_virtual_stage=None):
    """The files of `stages` pipeline stages (each holding num_layers / (stages x
    `layers_per_virtual_stage`) model chunks when given) from one file of
    pipeline_model_parallel_size 1."""
    return _split(whole, stages, range(stages), layers_per_virtual_stage)


def stage_file(whole, stages, stage, layers_per_virtual_stage=None):
    """The file of pipeline stage `stage` alone (as split_stages gives it). Only that stage's
    parameters are read: `whole` may hold None for every other (a rank converting as it
    loads cuts only its own stage's, `stage_parameter_names`)."""
    return _split(whole, stages, [stage], layers_per_virtual_stage)[0]


def stage_parameter_names(names, args, stages, stage, layers_per_virtual_stage=None):
    """The parameters, of a single-stage model's flat `names`, that pipeline stage `stage`
    of `stages` holds."""
    numbers = set(stage_layer_numbers(with_stages(args, stages, layers_per_virtual_stage),
                                      stages, stage))
    return [name for name in names if _held_by_stage(name, numbers, stage, stages)]


def _held_by_stage(name, layer_numbers, stage, stages):
    match = _LAYER.match(name)
    if match:
        return int(match.group(2)) in layer_numbers
    if name.startswith("language_model.embedding."):
        return stage == 0
    return stage == stages - 1  # the final LayerNorm


def _split(whole, stages, wanted, layers_per_virtual_stage):
    flat = to_flat_state_dict(whole["model"])
    num_layers = len({int(m.group(2)) for m in map(_LAYER.match, flat) if m})
    if stages > num_layers:
        raise CheckpointError(f"{stages} pipeline stages need at least as many layers; the "
                              f"checkpoint has {num_layers}")
    args = with_stages(whole["args"], stages, layers_per_virtual_stage)
    if stages == 1:
        return [dict(whole, args=args)]
    entries = hypers = None
    if "optimizer" in whole:
        entries, hypers = _per_name(whole["optimizer"], list(flat))
    files = []
    for stage in wanted:
        numbers = stage_layer_numbers(args, stages, stage)
        local_number = {n: i for i, n in enumerate(numbers)}
        mine = {key: value for key, value in flat.items()
                if _held_by_stage(key, local_number, stage, stages)}
        local = _renumbered(mine, local_number)  # a stage's layers ascend: order kept
        out = {k: v for k, v in whole.items() if k not in ("model", "optimizer")}
        out["args"] = dict(args)
        out["model"] = to_nested_state_dict(local)
        if entries is not None:
            out["optimizer"] = _optimizer_for(
                list(local), {new: entries[old] for old, new in zip(mine, local)}, hypers,
                whole["optimizer"])
        files.append(out)
    return files
