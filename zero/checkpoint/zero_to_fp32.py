#!/usr/bin/env python
"""Consolidate a ZeRO checkpoint's fp32 master weights into one plain state dict.

    python zero_to_fp32.py <checkpoint_dir> <output_file_or_dir> [-t TAG]

`checkpoint_dir` is the folder holding `latest` (the save_dir); the tag defaults to its
content. The output is `torch.save` of {name: fp32 tensor}; given a directory, the file is
`<dir>/pytorch_model.bin`. Needs torch only, so it runs where the checkpoint was copied to.

Reads DeepSpeed's layout (the files DeepSpeed's own zero_to_fp32.py reads) as zero's engine
writes it:
- stage 1/2: each `*_optim_states.pt` holds, per param group, one rank's contiguous slice of
  the flat fp32 group (`single_partition_of_fp32_groups`); rank slices concatenated in rank
  order are the params of `param_shapes` packed in order.
- stage 3: each rank holds `fp32_flat_groups`; every param is split into ceil(numel / world)
  pieces, one per rank, at the same offset on every rank.
- stage 0: the model states hold the whole fp32 group (16-bit training) or the module is fp32.
Files are memory-mapped and each param is copied out on its own, so memory stays at the size
of the result plus one param.
"""

import argparse
import glob
import math
import os
import re
import sys
from collections import OrderedDict

import torch

try:
    from zero.errors import CheckpointError
except ImportError:  # run standalone from a checkpoint folder
    class CheckpointError(Exception):
        """A checkpoint that is missing, incomplete, or not in the expected layout."""


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None,
                                             exclude_frozen_parameters=False, mp_rank=None):
    """{name: fp32 CPU tensor} for the model saved in `checkpoint_dir` (tag or `latest`).

    `mp_rank`: consolidate the files of this tensor-parallel rank only (checkpoints saved with
    tensor parallelism hold one set per TP rank; DeepSpeed's script refuses those)."""
    ckpt_dir = _tag_dir(checkpoint_dir, tag)
    only = "*" if mp_rank is None else f"*mp_rank_{int(mp_rank):02d}"
    optim_files = _sorted_by_rank(glob.glob(os.path.join(ckpt_dir, f"{only}_optim_states.pt")))
    model_files = _sorted_by_rank(glob.glob(os.path.join(ckpt_dir, f"{only}_model_states.pt")))
    if not model_files:
        raise CheckpointError(f"no *_model_states.pt in {ckpt_dir}: not a ZeRO checkpoint")
    tp_ranks = [f for f in model_files if re.match(r"mp_rank_\d+_model_states\.pt$",
                                                   os.path.basename(f))]
    if len(tp_ranks) > 1:
        raise CheckpointError(f"{ckpt_dir} holds {len(tp_ranks)} model-parallel ranks "
                              "(tensor slices x pipeline stages, mp_rank_*); this script "
                              "consolidates data-parallel partitions only. Merge them with a "
                              "model-specific tool: for this trainer's GPT-2, "
                              "tools/convert_checkpoint.py --loader deepspeed (to one file or a "
                              "Hugging Face folder) or tools/merge_mp_partitions.py --deepspeed "
                              "(to a Megatron-layout checkpoint)")
    model_states = load_zero_file(model_files[0])
    if not optim_files:
        state_dict = _stage0_params(model_states, ckpt_dir)
    else:
        optim = [load_zero_file(f)["optimizer_state_dict"] for f in optim_files]
        stage = saved_zero_stage(optim[0], optim_files[0])
        world = max(_as_list(optim[0]["partition_count"]))
        if len(optim) != world:
            why = ("the checkpoint is incomplete: a rank's files were not written or not "
                   "copied" if len(optim) < world else "files of another save are mixed in")
            raise CheckpointError(f"expected {world} *_optim_states.pt files in {ckpt_dir} (one "
                                  f"per data-parallel rank that saved it), found {len(optim)}: "
                                  f"{why}")
        if stage <= 2:
            slices = [[o["single_partition_of_fp32_groups"][g] for o in optim]
                      for g in range(len(model_states["param_shapes"]))]
            state_dict = _unpack_groups(model_states["param_shapes"], slices, world)
        else:
            state_dict = _stage3_params(model_files, optim, world)
    if not exclude_frozen_parameters:
        state_dict.update(_frozen_params(model_states, model_files, stage3=_is_stage3(optim_files)))
    for name in model_states.get("buffer_names", []):
        state_dict[name] = model_states["module"][name].float()
    for alias, target in model_states.get("shared_params", {}).items():
        if target in state_dict:
            state_dict[alias] = state_dict[target]
    return state_dict


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Loads the consolidated fp32 weights into `model` (moved to CPU); returns the model."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_path, tag=None,
                                               exclude_frozen_parameters=False):
    """Writes the consolidated state dict to `output_path` (a file, or a directory ->
    `pytorch_model.bin` inside it). Returns the file written."""
    if os.path.isdir(output_path) or output_path.endswith(os.sep):
        os.makedirs(output_path, exist_ok=True)
        output_path = os.path.join(output_path, "pytorch_model.bin")
    _check_writable(output_path)  # before the minutes of reading
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                          exclude_frozen_parameters)
    tmp = f"{output_path}.tmp-{os.getpid()}"
    try:
        torch.save(state_dict, tmp)
        os.replace(tmp, output_path)
    finally:
        if os.path.exists(tmp):  # a failed or interrupted write leaves nothing behind
            os.remove(tmp)
    return output_path


def _check_writable(output_path):
    folder = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(folder):
        raise CheckpointError(f"the output's folder {folder} does not exist: make it, or give "
                              "an output path in an existing folder")
    if not os.access(folder, os.W_OK):
        raise CheckpointError(f"the output's folder {folder} is not writable by this user: "
                              "give another output path")


# ---------------------------------------------------------------------------------------------

def _tag_dir(checkpoint_dir, tag):
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a folder: give the folder a ZeRO "
                              "checkpoint was saved to (the one holding 'latest')")
    tags = _saved_tags(checkpoint_dir)
    named_by = "-t"
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise CheckpointError(_why_no_latest(checkpoint_dir, tags))
        with open(latest, errors="replace") as f:
            tag, named_by = f.read(1000).strip(), f"{latest}"
    ckpt_dir = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint folder {ckpt_dir} (named by {named_by}) does not "
                              f"exist; saved tags here: {', '.join(tags) or 'none'}")
    return ckpt_dir


def _saved_tags(checkpoint_dir):
    return sorted(name for name in os.listdir(checkpoint_dir)
                  if glob.glob(os.path.join(checkpoint_dir, name, "*_model_states.pt")))


def _why_no_latest(checkpoint_dir, tags):
    if glob.glob(os.path.join(checkpoint_dir, "*_model_states.pt")):
        above = os.path.dirname(os.path.abspath(checkpoint_dir))
        return (f"{checkpoint_dir} is one tag of a checkpoint: give the folder above it, "
                f"{above} (with -t {os.path.basename(os.path.abspath(checkpoint_dir))})")
    if tags:
        return (f"{checkpoint_dir} has no 'latest' file naming the tag to read: give it with "
                f"-t (saved tags here: {', '.join(tags)})")
    if os.path.isfile(os.path.join(checkpoint_dir, "latest_checkpointed_iteration.txt")):
        return (f"{checkpoint_dir} holds a Megatron-layout checkpoint (latest_checkpointed_"
                "iteration.txt), not a ZeRO one: its weights are already whole per "
                "tensor-parallel rank (tools/convert_checkpoint.py reads them)")
    return (f"{checkpoint_dir} holds no ZeRO checkpoint (no 'latest' file, no tag folder with "
            "*_model_states.pt): give the folder a run saved to with --deepspeed")


def _sorted_by_rank(paths):
    def key(path):  # natural order: zero_pp_rank_10 after zero_pp_rank_9
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path))]
    return sorted(paths, key=key)


def load_zero_file(path):
    """A checkpoint file, memory-mapped, without running pickled code: zero's own, or one
    DeepSpeed wrote (its classes as stand-ins, see below)."""
    try:
        foreign = [name for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                   if name.startswith("deepspeed.")]
        if not foreign:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        # Written by DeepSpeed itself: its loss scaler, ZeroStageEnum and fragment addresses
        # are pickled classes. Stand-ins that only record their arguments take their place
        # (no DeepSpeed code runs, and none is needed), then enums become their values.
        with torch.serialization.safe_globals([(_Foreign, name) for name in foreign]):
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return _without_foreign(loaded)
    except Exception as e:  # noqa: BLE001
        reason = re.search(r"Unsupported global: GLOBAL [\w.]+", str(e))  # torch's is long
        reason = reason.group(0) if reason else (str(e).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(f"cannot read {path}: {reason}. The file is damaged or holds "
                              "pickled classes other than DeepSpeed's") from None


class _Foreign:
    """Stand-in for a pickled DeepSpeed object: keeps constructor arguments and state."""

    def __new__(cls, *args):  # pickle calls either cls(*args) or cls.__new__(cls, *args)
        instance = super().__new__(cls)
        instance.args, instance.state = args, None
        return instance

    def __init__(self, *args):
        pass

    def __setstate__(self, state):
        self.state = state


# the state of DeepSpeed's loss scalers (deepspeed/runtime/fp16/loss_scaler.py) that zero's
# loss scalers keep, under the same names
_LOSS_SCALER_KEYS = ("dynamic", "cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis",
                     "scale_factor", "scale_window", "min_scale", "delayed_shift",
                     "consecutive_hysteresis")


def loss_scaler_state(saved):
    """A saved "loss_scaler" as zero's loss scalers' state dict: zero's own as it is, the
    stand-in of DeepSpeed's pickled LossScaler / DynamicLossScaler as its plain values."""
    if not isinstance(saved, _Foreign) or not isinstance(saved.state, dict):
        return saved
    state = {key: saved.state[key] for key in _LOSS_SCALER_KEYS if key in saved.state}
    state["dynamic"] = bool(state.get("dynamic", False))
    return state


def _without_foreign(value):
    """Stand-ins built from one plain argument (int enums such as ZeroStageEnum) -> that value."""
    if isinstance(value, _Foreign):
        return value.args[0] if len(value.args) == 1 and value.state is None else value
    if isinstance(value, dict):
        return type(value)((k, _without_foreign(v)) for k, v in value.items()) \
            if isinstance(value, OrderedDict) \
            else {k: _without_foreign(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_foreign(v) for v in value]
    return value


def _as_list(value):
    return value if isinstance(value, (list, tuple)) else [value]


def saved_zero_stage(optimizer_state, path):
    """The ZeRO stage an optimizer states file was written at. DeepSpeed's BF16_Optimizer
    (bf16 with fp32 gradient accumulation at stage 0-1) records none: its fp32 partitions are
    stage 1's (one contiguous slice of each flat group per rank)."""
    stage = optimizer_state.get("zero_stage")
    if stage is None and "single_partition_of_fp32_groups" in optimizer_state:
        return 1
    if stage is None:
        raise CheckpointError(f"{path} records no ZeRO stage and no fp32 partitions: not a "
                              "ZeRO optimizer states file")
    return int(stage)


def _is_stage3(optim_files):
    return bool(optim_files) and \
        "fp32_flat_groups" in load_zero_file(optim_files[0])["optimizer_state_dict"]


class _Concat:
    """Reads ranges of the virtual concatenation of tensors without building it."""

    def __init__(self, tensors):
        self.tensors = [t.reshape(-1) for t in tensors]
        self.starts = [0]
        for t in self.tensors:
            self.starts.append(self.starts[-1] + t.numel())

    @property
    def numel(self):
        return self.starts[-1]

    def read(self, lo, hi):
        pieces = []
        for t, start, end in zip(self.tensors, self.starts, self.starts[1:]):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                pieces.append(t.narrow(0, a - start, b - a))
        return torch.cat(pieces).float() if pieces else torch.empty(0)


def _unpack_groups(param_shapes, slices, world):
    """Stage <= 2: params packed in order in each group's rank slices."""
    state_dict = OrderedDict()
    for shapes, group_slices in zip(param_shapes, slices):
        flat, offset = _Concat(group_slices), 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            state_dict[name] = flat.read(offset, offset + numel).view(shape).clone()
            offset += numel
        align = 2 * world
        if math.ceil(offset / align) != math.ceil(flat.numel / align):
            raise CheckpointError(f"consumed {offset} numels out of {flat.numel} - the "
                                  "param_shapes do not match the saved fp32 partitions")
    return state_dict


def _stage3_params(model_files, optim, world):
    """Stage 3: each param is ceil(numel / world) elements on every rank, at one offset."""
    param_shapes = OrderedDict()
    for shapes in load_zero_file(model_files[0])["param_shapes"]:
        param_shapes.update(shapes)
    flats = [_Concat(_as_list(o["fp32_flat_groups"])) for o in optim]
    state_dict, offset = OrderedDict(), 0
    for name, shape in param_shapes.items():
        numel = math.prod(shape)
        per_rank = math.ceil(numel / world)
        pieces = [flat.read(offset, offset + per_rank) for flat in flats]
        state_dict[name] = torch.cat(pieces)[:numel].view(shape).clone()
        offset += per_rank
    if offset * world != sum(flat.numel for flat in flats):
        raise CheckpointError(f"consumed {offset * world} numels out of "
                              f"{sum(flat.numel for flat in flats)} - stage 3 partitions do "
                              "not match param_shapes")
    return state_dict


def _stage0_params(model_states, ckpt_dir):
    """No optim files: 16-bit stage 0 keeps the fp32 group in `optimizer`; fp32 stage 0 trains
    the module's own fp32 weights. Otherwise (saved without optimizer state, or copied without
    the optim-states files) the module's weights are all there is, rounded if 16-bit: said in
    one note on stderr, since the result is no longer the exact fp32 masters."""
    optimizer = model_states.get("optimizer") or {}
    if "single_partition_of_fp32_groups" in optimizer:
        slices = [[t] for t in optimizer["single_partition_of_fp32_groups"]]
        return _unpack_groups(model_states["param_shapes"], slices, 1)
    state_dict = OrderedDict()
    rounded = set()
    for shapes in model_states.get("param_shapes", []):
        for name in shapes:
            weight = model_states["module"][name]
            if weight.dtype != torch.float32:
                rounded.add(str(weight.dtype).replace("torch.", ""))
            state_dict[name] = weight.float().clone()
    if not state_dict:
        raise CheckpointError("the checkpoint holds neither optim-states files nor fp32 groups")
    if rounded:
        print(f"note: {ckpt_dir} holds no *_optim_states.pt files (saved without the optimizer "
              f"state, or copied without them), so the weights are the model states' "
              f"{'/'.join(sorted(rounded))} copies, not the fp32 master weights; copy the "
              "optim-states files too for those", file=sys.stderr, flush=True)
    return state_dict


def _frozen_params(model_states, model_files, stage3):
    shapes = model_states.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    if not stage3:
        fragments = model_states["frozen_param_fragments"]
        return {name: fragments[name].float().clone() for name in shapes}
    per_rank = [load_zero_file(f)["frozen_param_fragments"] for f in model_files]
    result = {}
    for name, shape in shapes.items():
        full = torch.cat([frags[name].reshape(-1) for frags in per_rank])
        result[name] = full[:math.prod(shape)].view(shape).float().clone()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("checkpoint_dir", help="the save_dir holding 'latest' and the tags")
    parser.add_argument("output_path", help="output file, or a directory for pytorch_model.bin")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out parameters with requires_grad=False")
    args = parser.parse_args(argv)
    try:
        path = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_path,
                                                          args.tag, args.exclude_frozen_parameters)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # torch.save's writer failing while Ctrl-C unwinds
        if not isinstance(e.__context__, KeyboardInterrupt):
            raise
        print("interrupted", file=sys.stderr)
        return 130
    print(f"saved fp32 state dict to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
