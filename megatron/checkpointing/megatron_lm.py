"""Checkpoints saved by Megatron-LM itself (1.x to 3.x, before Megatron-core models) and by
Megatron-DeepSpeed without --deepspeed, read as this trainer's Megatron layout; and the
model-states files of Megatron-DeepSpeed's --deepspeed checkpoints, with or without pipeline
stages (`deepspeed_states_as_this_layout`, `deepspeed_pipeline_module` and the names its
PipelineModule gives parameters, for megatron/convert/deepspeed_source.py, which reads their
ZeRO files).

Their files are this layout's (iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt), but they pickle
their arguments (an argparse.Namespace, with two of Megatron's enums) and NumPy's RNG state,
which a weights-only load refuses: `safe_load` (files.py) allows those classes alone (the
enums read as their values), so no pickled code runs. The rest
differs by names and one ordering (megatron/checkpointing/checkpointing.py in Megatron-LM):

    language_model 'encoder' (2.x and later)   -> 'transformer'
    layers.N.self_attention.*                  -> layers.N.attention.*
    args tensor_model_parallel_size            -> model_parallel_size
    checkpoint_version 0 (or none): each query_key_value's rows are [3, heads, head size],
    1.0: [heads, head size, 3]                 -> 2.0's [heads, 3, head size], as this model's

A model this trainer does not build (SwiGLU, rotary positions, RMSNorm, untied output layer,
no biases, grouped-query attention, experts, Megatron-core's layer names, interleaved
pipeline chunks) is one error naming what differs. Its optimizer and RNG states are in
Megatron-LM's formats, which are not read: such a checkpoint is weights only (--finetune,
or --no-load-optim --no-load-rng).
"""

import argparse
import os
import re

import torch

from megatron.checkpointing.state_dicts import to_flat_state_dict
from megatron.errors import CheckpointError

SOURCE = "Megatron-LM"
MEGATRON_DEEPSPEED = "Megatron-DeepSpeed"  # saved_by of its --deepspeed checkpoints
# the args a foreign checkpoint records that this trainer's model needs to match; their
# absence means Megatron-LM's default
_NOT_BUILT = (
    ("swiglu", lambda v: v, "SwiGLU MLPs"),
    ("untie_embeddings_and_output_weights", lambda v: v, "an output layer untied from the "
                                                          "word embeddings"),
    ("use_rotary_position_embeddings", lambda v: v, "rotary position embeddings"),
    # (a string in Megatron-LM, an enum in Megatron-DeepSpeed, whose absolute is 2)
    ("position_embedding_type", lambda v: v not in (None, "learned_absolute", 2),
     "position embeddings other than learned absolute ones"),
    ("model_type", lambda v: v not in (None, 1), "an encoder-decoder model"),
    ("normalization", lambda v: v is not None and str(v).lower() != "layernorm",
     "a normalization other than LayerNorm"),  # (Megatron-DeepSpeed spells it layernorm)
    ("add_bias_linear", lambda v: v is False, "linear layers without biases"),
    ("group_query_attention", lambda v: v, "grouped-query attention"),
    ("num_experts", lambda v: v not in (None, 1, [1]), "mixture of experts"),
    ("apply_residual_connection_post_layernorm", lambda v: v, "the post-LayerNorm residual"),
    ("use_mcore_models", lambda v: v, "Megatron-core's model classes"),
    ("apply_layernorm_1p", lambda v: v, "LayerNorm weights stored zero-centred "
                                        "(--apply-layernorm-1p)"),
    ("add_position_embedding", lambda v: v is False, "no position embeddings"),
)


def numpy_globals():
    """What a weights-only load needs for NumPy's RNG state in a pickle: the array
    reconstructor (under both of its module names: NumPy 1 pickles name numpy.core, NumPy 2
    numpy._core), ndarray and dtype; none runs code."""
    import numpy
    multiarray = getattr(numpy, "_core", None) or numpy.core
    reconstruct = multiarray.multiarray._reconstruct
    return [numpy.ndarray, numpy.dtype, reconstruct,
            (reconstruct, "numpy.core.multiarray._reconstruct"),
            (reconstruct, "numpy._core.multiarray._reconstruct"),
            *{type(numpy.dtype(code)) for code in ("uint32", "float64", "int64")}]


class SavedEnum:
    """A member of one of Megatron's enums pickled in a checkpoint's arguments, read back as
    its value alone (Megatron's class is not imported)."""

    def __init__(self, value):
        self.value = value


# the enums Megatron-LM and Megatron-DeepSpeed keep in their arguments, where their forks
# define them
_ARGUMENT_ENUMS = tuple(f"{module}.{name}"
                        for module in ("megatron.model.enums", "megatron.enums",
                                       "megatron.core.enums")
                        for name in ("ModelType", "PositionEmbeddingType"))


def allowed_globals():
    return [argparse.Namespace, *numpy_globals(),
            *((SavedEnum, name) for name in _ARGUMENT_ENUMS)]


def as_this_layout(state, path):
    """A checkpoint file's contents in this trainer's layout: Megatron-LM's (args pickled as
    an argparse.Namespace) renamed and re-ordered, marked with state["saved_by"]; this
    trainer's own unchanged."""
    if not isinstance(state, dict) or not isinstance(state.get("args"), argparse.Namespace):
        return state
    args = _this_trainers_args(state["args"])
    _refuse_models_not_built(args, state, path)
    version = state.get("checkpoint_version", 0) or 0
    model = state.get("model")
    if not isinstance(model, dict) or "language_model" not in model:
        raise CheckpointError(f"{path} was saved by {SOURCE} but holds no "
                              "model['language_model']: not a GPT model checkpoint")
    # its optimizer, schedule and RNG states are in Megatron-LM's formats: not carried
    converted = {key: state[key] for key in ("iteration", "train_state") if key in state}
    converted.update(args=args, model=_renamed_model(model, args, version, path),
                     checkpoint_version=2.0, saved_by=SOURCE)
    return converted


def deepspeed_states_as_this_layout(states, path):
    """A DeepSpeed model-states file saved by Megatron-DeepSpeed (its client state's args
    pickled as an argparse.Namespace): args as this trainer's, the flat `module` renamed and
    re-ordered as `as_this_layout` does, marked with states["saved_by"]; this trainer's own
    unchanged. With pipeline stages its module is None: the weights are in layer files
    (`deepspeed_pipeline_module`)."""
    if not isinstance(states, dict) or not isinstance(states.get("args"), argparse.Namespace):
        return states
    args = _this_trainers_args(states["args"])
    # (since 2022 its module is nested, as its state_dict_for_save_checkpoint returns it)
    module = to_flat_state_dict(states["module"]) if isinstance(states.get("module"), dict) \
        else None
    nested = {"language_model": {"transformer": {}}}
    for key in module or ():
        if str(key).startswith("language_model.output_layer."):
            nested["language_model"]["output_layer"] = {}
    _refuse_models_not_built(args, {"model": nested}, path)
    version = states.get("checkpoint_version", 0) or 0
    converted = {key: value for key, value in states.items()
                 if key in ("iteration", "global_steps", "mp_world_size", "dp_world_size",
                            "lr_scheduler")}
    converted.update(args=args, checkpoint_version=2.0, saved_by=MEGATRON_DEEPSPEED,
                     module=None if module is None else
                     _renamed_module(module, args, version, path),
                     saved_checkpoint_version=version)
    return converted


def deepspeed_pipeline_module(tag_dir, tp_rank, states):
    """Tensor-parallel rank `tp_rank`'s whole module (all pipeline stages) of a Megatron-
    DeepSpeed checkpoint saved with pipeline stages, in this trainer's names. `states`: its
    first model-states file as `deepspeed_states_as_this_layout` returns it.

    DeepSpeed's PipelineModule saves each layer that has weights to
    layer_{index:02d}-model_{tp:02d}-model_states.pt, numbered by its place in GPTModelPipe's
    list, where functions (casts, transposes) take numbers too and the list changed between
    versions: so each file is known by its keys. In order: the embeddings, the transformer
    layers, the final LayerNorm. (The tied output layer has no file: its entry is a function
    of the embedding layer's module.)"""
    module = {}
    for index, prefix in deepspeed_pipeline_prefixes(tag_dir, tp_rank, states).items():
        state = torch.load(_layer_file(tag_dir, index, tp_rank), map_location="cpu",
                           weights_only=True)
        module.update({prefix + key: value for key, value in state.items()})
    return _renamed_module(module, states["args"], states["saved_checkpoint_version"], tag_dir)


def deepspeed_pipeline_prefixes(tag_dir, tp_rank, states):
    """{layer file index: the prefix its weights' names have in Megatron-DeepSpeed's module
    without pipeline stages} (see deepspeed_pipeline_module). The same index numbers the
    PipelineModule's parameters ("<index>.<name>"; the tied embeddings: "tied_modules.embed.")
    in the ZeRO files' param_shapes."""
    files = sorted((int(match.group(1)), os.path.join(tag_dir, name))
                   for name in os.listdir(tag_dir)
                   for match in [_LAYER_FILE.fullmatch(name)]
                   if match and int(match.group(2)) == tp_rank)
    if not files:
        raise CheckpointError(f"{tag_dir} was saved by Megatron-DeepSpeed with pipeline stages "
                              f"but has no layer_*-model_{tp_rank:02d}-model_states.pt files "
                              f"(tensor-parallel rank {tp_rank}'s weights): it is incomplete")
    prefixes, layers, seen = {}, 0, set()
    for index, path in files:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # its keys
        kind = _layer_file_kind(state, path)
        expected = ("the embeddings",) if not seen else \
            ("a transformer layer", "the final LayerNorm") \
            if "the final LayerNorm" not in seen else ("nothing (after the final LayerNorm)",)
        if kind not in expected:
            raise CheckpointError(f"{path} holds {kind} where {' or '.join(expected)} was "
                                  "expected: the layer files are not one GPT model's")
        seen.add(kind)
        if kind == "the embeddings":
            prefixes[index] = "language_model.embedding."
        elif kind == "a transformer layer":
            prefixes[index] = f"language_model.encoder.layers.{layers}."
            layers += 1
        else:
            prefixes[index] = "language_model.encoder.final_layernorm."
    num_layers = states["args"]["num_layers"]
    if "the final LayerNorm" not in seen or layers != num_layers:
        final = "" if "the final LayerNorm" in seen else " and no final LayerNorm"
        raise CheckpointError(f"{tag_dir} holds {layers} transformer layers{final} for "
                              f"tensor-parallel rank {tp_rank}, but its args say "
                              f"--num-layers {num_layers}: layer files are missing")
    return prefixes


def deepspeed_pipeline_parameter_name(name, prefixes):
    """A PipelineModule parameter's name ("tied_modules.embed.word_embeddings.weight",
    "3.self_attention.dense.weight") as Megatron-DeepSpeed's module without pipeline stages
    names it; None for a parameter of no layer file (an untied output layer)."""
    if name.startswith("tied_modules.embed."):
        return "language_model.embedding." + name[len("tied_modules.embed."):]
    index, _, rest = name.partition(".")
    return prefixes[int(index)] + rest if index.isdigit() and int(index) in prefixes else None


def _layer_file(tag_dir, index, tp_rank):
    return os.path.join(tag_dir, f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt")


_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")


def _layer_file_kind(state, path):
    keys = set(state) if isinstance(state, dict) else set()
    if keys == {"word_embeddings.weight", "position_embeddings.weight"}:
        return "the embeddings"
    if keys and all(key.startswith(_LAYER_PARTS) for key in keys):
        return "a transformer layer"
    if keys == {"weight", "bias"}:
        return "the final LayerNorm"
    _refuse_sequence_parallel_positions(keys, path)
    raise CheckpointError(f"{path} holds {sorted(keys)[:6]}: not a layer of the GPT model this "
                          "trainer builds (embeddings, transformer layers with LayerNorm, "
                          "attention and GeLU MLP, a final LayerNorm)")


_LAYER_PARTS = ("input_layernorm.", "self_attention.", "attention.",
                "post_attention_layernorm.", "mlp.dense_h_to_4h.", "mlp.dense_4h_to_h.")


def _refuse_sequence_parallel_positions(names, path):
    if any("position_embeddings.local_embeddings." in str(name) for name in names):
        raise CheckpointError(f"{path} was saved with Megatron-DeepSpeed's --sequence-parallel, "
                              "which cuts the position embeddings over the tensor-parallel "
                              "ranks (position_embeddings.local_embeddings): not joined here; "
                              "save it without --sequence-parallel")


class MegatronDeepSpeedTensors:
    """A Megatron-DeepSpeed checkpoint's flat tensors (its module's, its ZeRO partitions') as
    this trainer's: the names, and the QKV rows of checkpoint versions before 2.0."""

    def __init__(self, args, version, path):
        self.heads = args["num_attention_heads"] // args["model_parallel_size"]
        self.version, self.path = version, path

    @staticmethod
    def name(saved_name):
        return saved_name.replace("language_model.encoder.", "language_model.transformer.") \
            .replace(".self_attention.", ".attention.")

    def tensor(self, tensor, name):
        """Parameter `name`'s tensor (this trainer's name, its shape) in this trainer's row
        order."""
        return _qkv_in_version_2(tensor, name, self.heads, self.version, self.path)

    def module(self, module):
        _refuse_sequence_parallel_positions(module, self.path)
        return {self.name(key): self.tensor(tensor, self.name(key))
                for key, tensor in module.items()}


def _renamed_module(module, args, version, path):
    return MegatronDeepSpeedTensors(args, version, path).module(module)


def megatron_deepspeed_schedule(scheduler, args):
    """The learning-rate schedule state a Megatron-DeepSpeed checkpoint saved, as this
    trainer's AnnealingLR state (counted in iterations), or None where AnnealingLR does not
    run it: token-based lengths, a weight decay that changes over the run, a decay style
    other than linear, cosine, constant, inverse-square-root and WSD. Megatron-LM 1.1.5
    (DeepSpeed's fork) saved AnnealingLR's own keys, in iterations; Megatron-LM 2.x and later
    count samples (one iteration steps the schedule by the global batch) and decay toward
    min_lr (kept as "decay_formula": "2.x"; inverse-square-root counts samples here too), and
    later Megatron-LM's WSD from its args, under two sets of names (OptimizerParamScheduler's
    since 2023, 2.x's AnnealingLR's before). A run with --rampup-batch-size keeps its samples
    (its iterations held different numbers of them): it resumes under the same ramp."""
    from megatron.training.learning_rates import FRACTIONAL_WARMUP, STEP_UNIT
    if not isinstance(scheduler, dict):
        return None
    if "num_iters" in scheduler:  # 1.1.5's AnnealingLR: this trainer's keys and units
        return dict(scheduler)
    get = lambda *names: next((scheduler[n] for n in names if n in scheduler), None)  # noqa
    lengths = {key: get(*names) for key, names in (
        ("warmup_iter", ("lr_warmup_steps", "warmup_steps")),
        ("end_iter", ("lr_decay_steps", "decay_steps")),
        ("num_iters", ("num_steps",)))}
    style, batch = get("lr_decay_style", "decay_style"), args.get("global_batch_size")
    token_based = any(get(name) is not None for name in (
        "lr_decay_tokens", "lr_warmup_tokens", "decay_tokens", "warmup_tokens")) or \
        args.get("lr_decay_tokens") is not None or args.get("lr_warmup_tokens") is not None
    wsd = args.get("lr_wsd_decay_samples") or \
        (args.get("lr_wsd_decay_iters") or 0) * (batch or 0) or None  # (later Megatron-LM's)
    if token_based or style not in ("linear", "cosine", "constant", "inverse-square-root",
                                    "WSD") or (style == "WSD" and wsd is None) or not batch \
            or None in lengths.values() or get("max_lr") is None or get("min_lr") is None \
            or get("start_wd") != get("end_wd"):
        return None

    ramp = args.get("rampup_batch_size") is not None

    def iterations(samples):
        value = samples if ramp else samples / batch
        return round(value) if abs(value - round(value)) < 1e-9 else value

    return {"start_lr": get("max_lr"), "min_lr": get("min_lr"), "decay_style": style,
            **{key: iterations(value) for key, value in lengths.items()},
            "decay_formula": "2.x", FRACTIONAL_WARMUP: True,
            **({STEP_UNIT: "samples"} if ramp else {}),
            **({"wsd_decay_iter": iterations(wsd), "wsd_decay_style":
                args.get("lr_wsd_decay_style") or "exponential"} if style == "WSD" else {})}


def _this_trainers_args(namespace):
    """Megatron-LM's arguments as this trainer names them."""
    args = {key: value.value if isinstance(value, SavedEnum) else value
            for key, value in vars(namespace).items()}
    args.setdefault("model_parallel_size", args.get("tensor_model_parallel_size", 1))
    args.setdefault("pipeline_model_parallel_size", 1)
    if args.get("layernorm_epsilon") is None and args.get("norm_epsilon") is not None:
        args["layernorm_epsilon"] = args["norm_epsilon"]
    return args


def _refuse_models_not_built(args, state, path):
    what = [label for key, differs, label in _NOT_BUILT if differs(args.get(key))]
    chunks = sorted(key for key in state if key.startswith("model") and key[5:].isdigit())
    if chunks:
        what.append(f"interleaved pipeline chunks ({', '.join(chunks)}: "
                    "--num-layers-per-virtual-pipeline-stage)")
    model = state.get("model")
    if isinstance(model, dict) and ("decoder" in model or any(
            str(key).startswith(("decoder.", "embedding.")) for key in model)):
        what.append("Megatron-core's layer names (--use-mcore-models)")
    language_model = model.get("language_model", {}) if isinstance(model, dict) else {}
    if isinstance(language_model, dict) and "output_layer" in language_model:
        what.append("an output layer untied from the word embeddings")
    if what:
        raise CheckpointError(
            f"{path} was saved by {SOURCE} (or Megatron-DeepSpeed) for a model this trainer "
            "does not build: "
            f"{'; '.join(dict.fromkeys(what))}. This trainer builds GPT-2 (learned positions, "
            "LayerNorm, GeLU MLP with biases, tied embeddings); convert only such a model (a "
            "Megatron-core one first to the legacy format with Megatron-LM's "
            "tools/checkpoint/convert.py)")


def _renamed_model(model, args, version, path):
    renamed = {key: value for key, value in model.items()
               if key not in ("language_model", "word_embeddings_for_head")}
    # (word_embeddings_for_head: a last pipeline stage's copy of the tied word embeddings)
    language_model = dict(model["language_model"])
    positions = (language_model.get("embedding") or {}).get("position_embeddings") or {}
    _refuse_sequence_parallel_positions([f"position_embeddings.{key}" for key in positions],
                                        path)
    if "encoder" in language_model:
        language_model["transformer"] = language_model.pop("encoder")
    layers = language_model.get("transformer")
    if isinstance(layers, dict):
        heads = args["num_attention_heads"] // args["model_parallel_size"]
        language_model["transformer"] = {
            name: _qkv_in_version_2(tensor, name, heads, version, path)
            for name, tensor in ((key.replace(".self_attention.", ".attention."), value)
                                 for key, value in layers.items())}
    renamed["language_model"] = language_model
    return renamed


def _qkv_in_version_2(tensor, name, heads, version, path):
    """A query_key_value weight or bias of this tensor-parallel shard (`heads` heads) with
    its rows in checkpoint version 2.0's order [heads, 3, head size]."""
    if not name.endswith((".query_key_value.weight", ".query_key_value.bias")) or version >= 2:
        return tensor
    if version not in (0, 1):
        raise CheckpointError(f"{path}: checkpoint_version {version} is not one Megatron-LM "
                              "wrote (0, 1.0, 2.0, 3.0)")
    rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
    head_size = rows // (3 * heads)
    if version == 0:  # [3, heads, head size]
        ordered = tensor.reshape(3, heads, head_size, *rest).transpose(0, 1)
    else:  # 1.0: [heads, head size, 3]
        ordered = tensor.reshape(heads, head_size, 3, *rest).transpose(1, 2)
    return ordered.reshape(rows, *rest).contiguous()


def require_weights_only(state, checkpoint, path):
    """A Megatron-LM checkpoint resumed with its optimizer or RNG state: one error saying
    what to give instead (their formats are Megatron-LM's own)."""
    if state.get("saved_by") != SOURCE or checkpoint.finetune:
        return
    wanted = [flag for flag, skipped in (("--no-load-optim", checkpoint.no_load_optim),
                                         ("--no-load-rng", checkpoint.no_load_rng))
              if not skipped]
    if wanted:
        raise CheckpointError(
            f"{path} was saved by {SOURCE}, whose optimizer and RNG states are in its own "
            "formats, not read here: load its weights with --finetune (from iteration 0), or "
            f"add {' '.join(wanted)} to continue at its iteration {state.get('iteration')} "
            "with a fresh optimizer")
