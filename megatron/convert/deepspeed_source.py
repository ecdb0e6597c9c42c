"""Read a `pretrain_gpt2.py --deepspeed` checkpoint (DeepSpeed's layout) as Megatron shards.

    <load>/latest                                   the tag, e.g. global_step200
    <load>/<tag>/mp_rank_{mp:02d}_model_states.pt   module, args, iteration, RNG (client state)
    <load>/<tag>/zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt   the same, ZeRO stage 3
                                                    (module: empty placeholders)
    <load>/<tag>/*zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   fp32 partitions
    <load>/<tag>/layer_{i:02d}-model_{tp:02d}-model_states.pt   with pipeline stages: the
                                                    module, layer by layer (mp counts stages
                                                    x TP + TP rank then; Megatron-DeepSpeed
                                                    numbers its layers otherwise: read by
                                                    megatron_lm.deepspeed_pipeline_module)

Per tensor-parallel rank the fp32 weights are consolidated over the data-parallel partitions
by zero's own `get_fp32_state_dict_from_zero_checkpoint` (any ZeRO stage, any DP size) and
cast to the dtype the model was trained in (with pipeline stages, per stage, and the stages
joined); the result is that rank's Megatron `model_optim_rng.pt` content (iteration, args,
train_state, RNG, and the optimizer state: fp32 masters and Adam moments read parameter by
parameter from ZeRO's partitions by zero.checkpoint.whole_params), which megatron/convert
then merges and re-splits to any TP x PP size, so the converted checkpoint resumes with its
optimizer. The one reader of this layout: tools/merge_mp_partitions.py --deepspeed and
tools/convert_checkpoint.py --loader deepspeed (and so the generation and evaluation tools)
all come through here. A model trained with --memory-centric-tiled-linear under stage 3 has
its fp32 masters per tile; they are joined into the untiled weights every Megatron checkpoint
holds, and its optimizer state (per tile too) is not carried: it resumes with
`--no-load-optim`.
"""

import os

import torch
from zero.checkpoint.files import optim_files

from megatron.checkpointing.files import safe_load
from megatron.checkpointing.megatron_lm import (MegatronDeepSpeedTensors, allowed_globals,
                                                deepspeed_pipeline_module,
                                                deepspeed_pipeline_parameter_name,
                                                deepspeed_pipeline_prefixes,
                                                deepspeed_states_as_this_layout,
                                                megatron_deepspeed_schedule)
from megatron.checkpointing.megatron_layout import CHECKPOINT_VERSION, read_tracker
from megatron.checkpointing.state_dicts import to_nested_state_dict
from megatron.convert.checkpoint_files import ShardedCheckpoint, inside_a_checkpoint
from megatron.convert.joined_stages import JoinedStages
from megatron.convert.optimizer_state import optimizer_group_names
from megatron.convert.pipeline_layout import join_stages, stage_layer_numbers, with_stages
from megatron.errors import CheckpointError
from megatron.model.gpt2_model import pipeline_layer_slots
from megatron.model.tiling import join_tiled_weights

# what Megatron-DeepSpeed's param groups say besides the optimizer's hyperparameters
_MEGATRON_DEEPSPEED_GROUP_KEYS = ("name", "wd_mult", "lr_mult")
_CLIENT_KEYS = ("iteration", "consumed_train_samples", "train_state", "random_rng_state",
                "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")


def _tag(load_dir, iteration):
    """The tag to read: global_step<iteration>, else the one `latest` names."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"the checkpoint folder {load_dir} is not a directory")
    if iteration is not None:
        return f"global_step{iteration}"
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest) and os.path.isfile(os.path.join(load_dir, "config.json")):
        raise CheckpointError(f"{load_dir} is a Hugging Face model folder (config.json), not "
                              "a --deepspeed checkpoint: drop --deepspeed (the tools read it "
                              "as it is)")
    if not os.path.isfile(latest):
        hint = inside_a_checkpoint(load_dir)
        if hint:
            raise CheckpointError(hint)
        tags = _saved_tags(load_dir)
        if not tags and read_tracker(load_dir)[0] is not None:
            raise CheckpointError(f"{load_dir} holds a Megatron-layout checkpoint (written "
                                  "without --deepspeed): read it without --deepspeed "
                                  "(convert_checkpoint.py: --loader megatron)")
        raise CheckpointError(f"{load_dir} has no 'latest' file naming the DeepSpeed tag to "
                              f"read (tags here: {', '.join(tags) or 'none'}): it was not "
                              "saved with --deepspeed, or its tracker is lost; write the tag "
                              f"into it, e.g. `echo {tags[-1] if tags else 'global_step100'} > "
                              f"{latest}` (tools/merge_mp_partitions.py also takes --iteration)")
    with open(latest) as f:
        return f.read().strip()


def _saved_tags(load_dir):
    return sorted(d for d in os.listdir(load_dir)
                  if any(os.path.isfile(os.path.join(load_dir, d, name))
                         for name in _model_states_names(0)))


def _model_states_names(mp_rank):
    """Where TP rank `mp_rank`'s client state is: stages 0-2, then stage 3 (DP rank 0's)."""
    return (f"mp_rank_{mp_rank:02d}_model_states.pt",
            f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt")


def read_deepspeed_checkpoint(load_dir, iteration=None, fp32_weights=False,
                              with_optimizer=True):
    """ShardedCheckpoint (one Megatron shard per TP rank) from a --deepspeed checkpoint.

    The weights are the consolidated fp32 masters, cast to the dtype the model was trained
    in (a Megatron checkpoint's `model`), or kept in fp32 with `fp32_weights` (for
    converters, which lose nothing that way). Not `with_optimizer`: the weights alone (for
    generation, evaluation and Hugging Face's format; the Adam moments, twice the fp32
    weights, are not read)."""
    from zero.errors import CheckpointError as ZeroCheckpointError
    from zero.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    tag = _tag(load_dir, iteration)
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"{tag_dir} does not exist; saved steps here: "
                              f"{', '.join(_saved_tags(load_dir)) or 'none'}")
    first = _model_states(tag_dir, 0)
    size = int(first["args"].get("model_parallel_size", first.get("mp_world_size", 1)))
    stages = int(first["args"].get("pipeline_model_parallel_size", 1))

    foreign = first.get("saved_by")
    iteration = int(first.get("iteration", first["global_steps"]))
    if foreign and first["module"] is None:  # Megatron-DeepSpeed's pipeline: its layer files
        shards = [_megatron_deepspeed_pipeline_shard(tag_dir, tp_rank, size, stages, first,
                                                     fp32_weights, with_optimizer)
                  for tp_rank in range(size)]
        return ShardedCheckpoint(load_dir, iteration, False, shards, stages)

    def shard_of(mp_rank, tp_rank, stage):
        """The Megatron file contents of one file of DeepSpeed's model-parallel rank
        `mp_rank` (stage x TP + TP rank)."""
        states = first if mp_rank == 0 else _model_states(tag_dir, mp_rank, size * stages)
        if foreign:
            if not optim_files(tag_dir, mp_rank):  # ZeRO stage 0: DeepSpeed's FP16_Optimizer
                return _module_weights_only(states)  # state, not read
            return _megatron_deepspeed_shard(load_dir, tag, mp_rank, size, states,
                                             fp32_weights, with_optimizer)
        try:
            fp32 = get_fp32_state_dict_from_zero_checkpoint(load_dir, tag=tag, mp_rank=mp_rank)
        except ZeroCheckpointError as e:
            raise CheckpointError(str(e)) from None
        fp32 = join_tiled_weights(fp32)
        module = states["module"] if states["module"] is not None else \
            _stage_module(tag_dir, states["args"], stages, stage, tp_rank)
        model = {name: _master(fp32, name, tensor, fp32_weights, tag_dir)
                 for name, tensor in module.items()}
        shard = {key: states[key] for key in _CLIENT_KEYS if key in states}
        shard.update(checkpoint_version=CHECKPOINT_VERSION, args=dict(states["args"]),
                     model=to_nested_state_dict(model))
        # (with pipeline stages each stage's ZeRO files hold its own parameters, named as the
        # stage's module names them; join_stages renumbers them with the layers)
        optimizer = _optimizer_entry(_open_zero_files(tag_dir, mp_rank, size * stages), model,
                                     module, tag_dir) if with_optimizer else None
        if optimizer is not None:
            shard["optimizer"] = optimizer
        if states.get("lr_scheduler") is not None:
            shard["lr_scheduler"] = states["lr_scheduler"]
        return shard

    shards = []
    for tp_rank in range(size):
        files = [shard_of(stage * size + tp_rank, tp_rank, stage) for stage in range(stages)]
        shards.append(files[0] if stages == 1 else join_stages(files))
    return ShardedCheckpoint(load_dir, iteration, False, shards, stages)


def _module_weights_only(states):
    """A Megatron-DeepSpeed checkpoint's shard without ZeRO partitions: the weights of its
    module (the dtype it trained in), no optimizer or RNG state."""
    return {"iteration": states.get("iteration", states.get("global_steps", 0)),
            "checkpoint_version": CHECKPOINT_VERSION, "args": dict(states["args"]),
            "model": to_nested_state_dict(dict(states["module"])),
            "saved_by": states["saved_by"]}


def _megatron_deepspeed_shard(load_dir, tag, mp_rank, size, states, fp32_weights,
                              with_optimizer):
    """A Megatron-DeepSpeed ZeRO (stage 1-3) checkpoint's shard: the fp32 masters and the
    optimizer state from DeepSpeed's files (its pickled classes read as stand-ins, no code
    run), renamed and re-ordered as its module is; its learning-rate schedule where this
    trainer's runs it (megatron_deepspeed_schedule). Its RNG states are not carried."""
    from zero.checkpoint.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint,
                                              load_zero_file)
    from zero.errors import CheckpointError as ZeroCheckpointError
    tag_dir, args = os.path.join(load_dir, tag), states["args"]
    tensors = MegatronDeepSpeedTensors(args, states["saved_checkpoint_version"], tag_dir)
    try:
        with torch.serialization.safe_globals(allowed_globals()):  # its pickled args
            fp32 = get_fp32_state_dict_from_zero_checkpoint(load_dir, tag=tag,
                                                            mp_rank=mp_rank)
            fp32 = tensors.module(fp32)
            module = states["module"]
            model = {name: _master(fp32, name, tensor, fp32_weights, tag_dir)
                     for name, tensor in module.items()}
            optimizer = _optimizer_entry(_open_zero_files(tag_dir, mp_rank, size,
                                                          load=load_zero_file),
                                         model, module, tag_dir, tensors=tensors) \
                if with_optimizer else None
    except ZeroCheckpointError as e:
        raise CheckpointError(str(e)) from None
    return _megatron_deepspeed_state(states, model, optimizer)


def _megatron_deepspeed_pipeline_shard(tag_dir, tp_rank, size, stages, first, fp32_weights,
                                       with_optimizer):
    """Tensor-parallel rank `tp_rank`'s shard of a Megatron-DeepSpeed checkpoint with pipeline
    stages (its layer files joined: deepspeed_pipeline_module), with each stage's fp32 masters
    and optimizer state from its ZeRO files joined in the whole model's names (JoinedStages);
    the weights only where a stage has no ZeRO files (stage 0: DeepSpeed's FP16_Optimizer)."""
    from zero.checkpoint.zero_to_fp32 import load_zero_file
    from zero.errors import CheckpointError as ZeroCheckpointError
    states = dict(first, args=with_stages(first["args"], 1, None),
                  module=deepspeed_pipeline_module(tag_dir, tp_rank, first))
    ranks = [stage * size + tp_rank for stage in range(stages)]  # DeepSpeed's mp_rank
    lacking = [mp_rank for mp_rank in ranks if not optim_files(tag_dir, mp_rank)]
    if len(lacking) == len(ranks):
        return _module_weights_only(states)
    if lacking:
        raise CheckpointError(f"{tag_dir} has ZeRO optimizer files for some pipeline stages but "
                              f"none for model-parallel rank(s) {lacking} "
                              f"(*zero_pp_rank_*_mp_rank_{lacking[0]:02d}_optim_states.pt): "
                              "the checkpoint is incomplete; copy the missing files")
    prefixes = deepspeed_pipeline_prefixes(tag_dir, tp_rank, first)
    tensors = MegatronDeepSpeedTensors(first["args"], first["saved_checkpoint_version"], tag_dir)
    module = states["module"]
    try:
        with torch.serialization.safe_globals(allowed_globals()):  # its pickled args
            saved = JoinedStages(
                [_open_zero_files(tag_dir, mp_rank, size * stages, load=load_zero_file)
                 for mp_rank in ranks],
                lambda name: deepspeed_pipeline_parameter_name(name, prefixes), tag_dir)
            theirs = {tensors.name(name): name for name in saved.names()}
            fp32 = {name: tensors.tensor(saved.master(theirs[name], tensor.numel())
                                         .view(tensor.shape), name)
                    for name, tensor in module.items() if name in theirs}
            model = {name: _master(fp32, name, tensor, fp32_weights, tag_dir)
                     for name, tensor in module.items()}
            optimizer = _optimizer_entry(saved, model, module, tag_dir, tensors=tensors) \
                if with_optimizer else None
    except ZeroCheckpointError as e:
        raise CheckpointError(str(e)) from None
    return _megatron_deepspeed_state(states, model, optimizer)


def _megatron_deepspeed_state(states, model, optimizer):
    """The shard of a Megatron-DeepSpeed checkpoint with ZeRO files: its weights (`model`),
    optimizer state, and learning-rate schedule where this trainer's runs it
    (megatron_deepspeed_schedule). Its RNG states are not carried."""
    args = states["args"]
    shard = _module_weights_only(states)
    shard["model"] = to_nested_state_dict(model)
    if optimizer is not None:
        shard["optimizer"] = optimizer
    schedule = megatron_deepspeed_schedule(states.get("lr_scheduler"), args)
    if schedule is not None:
        shard["lr_scheduler"] = schedule
    if args.get("consumed_train_samples") is not None:
        shard["train_state"] = {"consumed_train_samples": int(args["consumed_train_samples"])}
    return shard


def _open_zero_files(tag_dir, mp_rank, size, load=None):
    """Model-parallel rank `mp_rank`'s (of `size`: TP x pipeline stages) ZeRO files, read a
    parameter at a time (zero/checkpoint/whole_params.py)."""
    from zero.checkpoint.whole_params import open_saved
    from zero.errors import CheckpointError as ZeroCheckpointError
    try:
        return open_saved(tag_dir, mp_rank, size, load=load)
    except ZeroCheckpointError as e:
        raise CheckpointError(str(e)) from None


def _optimizer_entry(saved, model, module, tag_dir, tensors=None):
    """The optimizer state of one model-parallel rank in the Megatron layout's per-parameter
    form (megatron/checkpointing/optimizer_state.py), read parameter by parameter from the
    ZeRO files of any stage and DP size (`saved`: a reader of zero/checkpoint/whole_params.py,
    or JoinedStages); None when the ZeRO state is not per parameter of this model (a model
    trained with tiled linears keeps it per tile). `model`: the weights (their shapes),
    `module`: the saved module (the dtype trained in; at stage 3 its parameters are empty
    placeholders). A Megatron-DeepSpeed checkpoint's: `tensors` (MegatronDeepSpeedTensors)
    renames and re-orders."""
    from zero.optim.quantized_state import TABLE
    theirs = {name: name for name in saved.names()} if tensors is None else \
        {tensors.name(name): name for name in saved.names()}
    ours = (lambda tensor, name: tensor) if tensors is None else tensors.tensor
    group_names = optimizer_group_names(list(model))
    if not all(name in theirs for names in group_names for name in names):
        return None
    state, param_groups, masters, next_index = {}, [], [], 0
    for names in group_names:
        saved_groups = {saved.group_of(theirs[name]) for name in names}
        if len(saved_groups) != 1:
            raise CheckpointError(f"{tag_dir}: the ZeRO optimizer's param groups are not the "
                                  "trainer's (weight decay, no weight decay); it was not saved "
                                  "by pretrain_gpt2.py --deepspeed")
        hyper = saved.param_groups[saved_groups.pop()]
        indices, group_masters = [], []
        for name in names:
            index, shape, next_index = next_index, model[name].shape, next_index + 1
            numel = model[name].numel()
            entry = dict(saved.scalar_state(theirs[name]))
            for key in saved.per_element_keys(theirs[name]):
                entry[key] = ours(saved.state(theirs[name], key, numel).view(shape), name)
            if entry and "step" not in entry and "step" in hyper:
                # apex's FusedAdam (Megatron-DeepSpeed's on CUDA) counts in the param group
                entry["step"] = torch.tensor(float(hyper["step"]))
            table = saved.table(theirs[name], name)
            if table is not None:
                entry[TABLE] = table
            if entry:  # (nothing before the first step)
                state[index] = entry
            group_masters.append(None if module[name].dtype == torch.float32 else
                                 ours(saved.master(theirs[name], numel).view(shape), name))
            indices.append(index)
        param_groups.append({**{k: v for k, v in hyper.items()
                                if k not in ("params", "step",
                                             *_MEGATRON_DEEPSPEED_GROUP_KEYS)},
                             "params": indices})
        masters.append(group_masters)
    return {"optimizer": {"state": state, "param_groups": param_groups},
            "fp32_from_fp16_params": masters, "grad_scaler": saved.loss_scaler}


def _stage_module(tag_dir, args, stages, stage, tp_rank):
    """A pipeline stage's module state (its names, layers numbered from 0) from DeepSpeed's
    layer files (megatron.model.gpt2_model.pipeline_layer_slots)."""
    module = {}
    for layer, prefix in pipeline_layer_slots(args["num_layers"],
                                              stage_layer_numbers(args, stages, stage),
                                              stage == 0, stage == stages - 1):
        path = os.path.join(tag_dir, f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt")
        if not os.path.isfile(path):
            raise CheckpointError(f"{tag_dir} has no {os.path.basename(path)}: the pipeline "
                                  "checkpoint is incomplete")
        state = torch.load(path, map_location="cpu", weights_only=True)
        module.update({prefix + key: tensor for key, tensor in state.items()})
    return module


def _master(fp32, name, tensor, keep_fp32, tag_dir):
    if name not in fp32:  # not trained (no ZeRO partition): the module's own copy
        if tensor.numel() == 0:  # a stage 3 placeholder: the values were in the partitions
            raise CheckpointError(f"{tag_dir}: no fp32 weights for {name} in the ZeRO "
                                  "partitions, and the module holds only a stage 3 "
                                  "placeholder; the checkpoint is incomplete")
        return tensor
    return fp32[name] if keep_fp32 else fp32[name].to(tensor.dtype)


def _model_states(tag_dir, mp_rank, size=None):
    names = _model_states_names(mp_rank)
    path = next((os.path.join(tag_dir, name) for name in names
                 if os.path.isfile(os.path.join(tag_dir, name))), None)
    if path is None:
        saved = f" was saved with model_parallel_size {size} but" if size else ""
        raise CheckpointError(f"{tag_dir}{saved} has no {names[0]} (or {names[1]}, stage 3): "
                              "the checkpoint is incomplete (not saved by pretrain_gpt2.py "
                              "--deepspeed, or a rank's files are missing). Copy the missing "
                              "rank files, or convert another step")
    # a damaged file: one error naming it and why; Megatron-DeepSpeed's: renamed
    states = deepspeed_states_as_this_layout(safe_load(path, mmap=True), path)
    if not isinstance(states.get("args"), dict) or "module" not in states:
        raise CheckpointError(f"{path} has no 'args'/'module': it was not saved by "
                              "pretrain_gpt2.py --deepspeed and cannot be converted")
    return states
