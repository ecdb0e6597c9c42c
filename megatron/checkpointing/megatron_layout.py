"""Megatron-layout checkpoints, saved atomically and resumed exactly.

Layout (one file per tensor-parallel rank, written by data-parallel rank 0 of each group):

    <save>/iter_0000200/mp_rank_00/model_optim_rng.pt
    <save>/latest_checkpointed_iteration.txt        # "200" (or "release")

Each file holds only plain containers and tensors, so `torch.load(..., weights_only=True)`
reads it.  The model is stored in Megatron 1.1.5's nested form
(`model['language_model']['embedding']['word_embeddings']['weight']`,
`model['language_model']['transformer']['layers.0.attention.query_key_value.weight']`), which
the usual converters understand; flat state dicts are accepted on load as well.

Under --deepspeed the zero engine writes DeepSpeed's layout instead (`<save>/global_step200/`,
`<save>/latest`), plus the same tracker file; see megatron/deepspeed_glue.py.

Atomicity: every file is written to a temporary name, fsynced and renamed; the tracker is
rewritten (the same way) only after every rank's file is complete.  A crash at any moment
leaves the previous checkpoint and tracker intact.
"""

import os
import random
import re

import numpy as np
import torch
import torch.distributed as dist

from megatron.runtime import device as device_mod
from megatron import mpu
from megatron.checkpointing.retention import MEGATRON_LAYOUT, prune_checkpoints
from megatron.errors import CheckpointError
from megatron.runtime.fault_injection import kill_point
from megatron.runtime.fault_injection import writer as fault_writer

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 2.0
# Flags that fix the shapes of the saved tensors; a checkpoint must agree on all of them.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "max_position_embeddings", "make_vocab_size_divisible_by",
                    "padded_vocab_size", "tokenizer_type", "model_parallel_size")


def get_checkpoint_name(checkpoints_path, iteration, mp_rank=None, release=False):
    directory = "release" if release else f"iter_{iteration:07d}"
    if mp_rank is None:
        mp_rank = mpu.get_model_parallel_rank()
    return os.path.join(checkpoints_path, directory, f"mp_rank_{mp_rank:02d}",
                        "model_optim_rng.pt")


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def read_tracker(checkpoints_path):
    """(iteration, release) named by the tracker file, or (None, False) if there is none."""
    path = get_checkpoint_tracker_filename(checkpoints_path)
    if not os.path.isfile(path):
        return None, False
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    try:
        return int(text), False
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number or 'release', "
                              f"found {text!r}; fix or delete the file") from None


# --------------------------------------------------------------------------- file helpers

def atomic_torch_save(obj, path):
    """torch.save to `path` so that `path` is either absent/old or complete, never partial."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        kill_point("save.file.tmp_opened")
        torch.save(obj, fault_writer(f, "save.file.tmp_half_written"))
        kill_point("save.file.tmp_written")
        f.flush()
        os.fsync(f.fileno())
    kill_point("save.file.tmp_synced")
    os.replace(tmp, path)
    kill_point("save.file.renamed")
    _fsync_dir(os.path.dirname(path))


def atomic_write_text(path, text, point=None):
    """Replace `path` by `text` atomically; `point` names the kill points on the way."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if point:
        kill_point(f"{point}.tmp_written")
    os.replace(tmp, path)
    if point:
        kill_point(f"{point}.renamed")
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(directory):
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safe_load(path):
    """Load a checkpoint file without executing pickled code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist") from None
    except Exception as exc:  # corrupt file or a pickle with code in it
        raise CheckpointError(f"cannot read checkpoint {path}: {load_failure_reason(exc)}. The "
                              "file is corrupt or not a plain-tensor checkpoint (refused: "
                              "only tensors and plain containers are unpickled)") from None


def load_failure_reason(exc):
    """One line out of torch.load's multi-paragraph error: what it refused, or the first line."""
    text = str(exc)
    refused = re.search(r"Unsupported global: GLOBAL [\w.]+|Unsupported operand \d+", text)
    if refused:
        return refused.group(0)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:300]


# ------------------------------------------------------------------- state dict formats

def to_nested_state_dict(flat):
    """Flat model keys -> Megatron 1.1.5 nested form (see module docstring)."""
    nested = {}
    for key, tensor in flat.items():
        parts = key.split(".")
        if parts[:2] == ["language_model", "transformer"]:
            nested.setdefault("language_model", {}).setdefault("transformer", {})[
                ".".join(parts[2:])] = tensor
            continue
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = tensor
    return nested


def to_flat_state_dict(nested, prefix=""):
    flat = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(to_flat_state_dict(value, name + "."))
        else:
            flat[name] = value
    return flat


def plain_args(args):
    """The Namespace as a dict of plain values (loadable with weights_only=True)."""
    plain = {}
    for key, value in vars(args).items():
        if value is None or isinstance(value, (bool, int, float, str)):
            plain[key] = value
        elif isinstance(value, (list, tuple)) and all(
                isinstance(v, (bool, int, float, str)) for v in value):
            plain[key] = list(value)
    return plain


# ------------------------------------------------------------------------- RNG states

def get_rng_states(device):
    np_state = np.random.get_state()
    version, py_state, gauss = random.getstate()
    return {
        "random_rng_state": {"version": version, "state": list(py_state), "gauss": gauss},
        "np_rng_state": {"algorithm": np_state[0],
                         "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                         "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                         "cached_gaussian": float(np_state[4])},
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device_mod.get_rng_state(device),
        "rng_tracker_states": mpu.get_cuda_rng_tracker().get_states(),
    }


def set_rng_states(states, device):
    py = states["random_rng_state"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = states["np_rng_state"]
    np.random.set_state((npst["algorithm"], npst["keys"].numpy().astype(np.uint32),
                         npst["pos"], npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(states["torch_rng_state"])
    device_mod.set_rng_state(device, states.get("cuda_rng_state"))
    mpu.get_cuda_rng_tracker().set_states(states["rng_tracker_states"])


# ------------------------------------------------------------------------- save / load

def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def save_checkpoint(iteration, model, optimizer, lr_scheduler, args, train_state, device):
    """Write this rank's shard (if DP rank 0), then atomically advance the tracker.

    Under --deepspeed `model` is the zero engine, which writes DeepSpeed's layout
    (megatron/deepspeed_glue.py); the tracker file is written as well.
    """
    if getattr(args, "deepspeed", False):
        from megatron import deepspeed_glue
        return deepspeed_glue.save_checkpoint(iteration, model, args, train_state, device)
    kill_point("save.start")
    if mpu.get_data_parallel_rank() == 0:
        state = {
            "iteration": iteration,
            "checkpoint_version": CHECKPOINT_VERSION,
            "args": plain_args(args),
            "model": to_nested_state_dict(_unwrap(model).state_dict()),
            "train_state": dict(train_state),
        }
        if not args.no_save_optim:
            state["optimizer"] = optimizer.state_dict()
            state["lr_scheduler"] = lr_scheduler.state_dict()
        if not args.no_save_rng:
            state.update(get_rng_states(device))
        atomic_torch_save(state, get_checkpoint_name(args.save, iteration))
    kill_point("save.files_done")
    _barrier()
    if dist.get_rank() == 0 if dist.is_initialized() else True:
        atomic_write_text(get_checkpoint_tracker_filename(args.save), str(iteration),
                          point="save.tracker")
        # Only now, with the new checkpoint complete and named, may older ones go.
        prune_checkpoints(args.save, getattr(args, "keep_last_n_checkpoints", None),
                          MEGATRON_LAYOUT)
    _barrier()
    kill_point("save.done")


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def check_checkpoint_args(saved_args, args, path):
    """Raise CheckpointError listing every shape-defining flag that differs."""
    differences = []
    for key in MODEL_SHAPE_ARGS:
        if key not in saved_args:
            continue
        ours = getattr(args, key, None)
        if key == "ffn_hidden_size":
            ours = ours or 4 * args.hidden_size
            saved = saved_args[key] or 4 * saved_args.get("hidden_size", args.hidden_size)
        else:
            saved = saved_args[key]
        if saved != ours:
            differences.append(f"--{key.replace('_', '-')}: checkpoint {saved}, flags {ours}")
    if differences:
        hint = ""
        if any(d.startswith("--model-parallel-size") for d in differences):
            hint = (" To change the tensor-parallel size of a checkpoint, convert it with "
                    "tools/merge_mp_partitions.py.")
        raise CheckpointError(f"checkpoint {path} was saved for a different model:\n  "
                              + "\n  ".join(differences) +
                              "\nUse the flags it was trained with, or --finetune from a "
                              "matching shape." + hint)


def load_checkpoint(model, optimizer, lr_scheduler, args, device):
    """Resume from args.load. Returns the train_state dict to continue from (or None).

    Under --deepspeed the zero engine (`model`) loads its own layout (deepspeed_glue.py).
    """
    if getattr(args, "deepspeed", False):
        from megatron import deepspeed_glue
        return deepspeed_glue.load_checkpoint(model, args, device)
    iteration, release = read_tracker(args.load)
    if iteration is None:
        if os.path.isdir(args.load) and os.listdir(args.load) and not resuming_own_save(args):
            raise CheckpointError(f"--load {args.load} has no {TRACKER_FILENAME}; point --load "
                                  "at a directory written by --save")
        return None  # nothing to resume: start from scratch (Megatron behaviour)
    path = get_checkpoint_name(args.load, iteration, release=release)
    directory = os.path.dirname(os.path.dirname(path))
    if not os.path.isfile(path):
        deepspeed_tag = os.path.join(args.load, f"global_step{iteration}")
        if os.path.isdir(deepspeed_tag):
            raise CheckpointError(
                f"--load {args.load} holds a --deepspeed checkpoint (DeepSpeed's layout: "
                f"{deepspeed_tag}), not Megatron's. Resume it with the --deepspeed "
                "--deepspeed_config flags it was trained with, or convert it first: python "
                f"tools/merge_mp_partitions.py --deepspeed --load {args.load} --save <dir>, "
                "then --load <dir> --no-load-optim")
        # Without our rank's file, the rank directories present tell the saved size.
        _check_model_parallel_size(args, directory, _count_rank_files(directory))
        raise CheckpointError(f"{get_checkpoint_tracker_filename(args.load)} names iteration "
                              f"{iteration}, but {path} is missing: the checkpoint is "
                              "incomplete. Resume from an earlier iteration or save again")
    state = safe_load(path)
    if "args" in state:
        _check_model_parallel_size(args, directory, state["args"].get("model_parallel_size"))
        check_checkpoint_args(state["args"], args, path)
    _load_model_weights(model, state, path)
    if args.finetune or release:
        return {"iteration": 0, "consumed_train_samples": 0}
    if not args.no_load_optim:
        from megatron.model.tiling import optimizer_state_tiling_mismatch
        mismatch = optimizer_state_tiling_mismatch(state.get("args", {}), args)
        if mismatch:
            raise CheckpointError(f"{path}: {mismatch}")
        for key in ("optimizer", "lr_scheduler"):
            if key not in state:
                raise CheckpointError(f"{path} has no {key} state (saved with --no-save-optim); "
                                      "load it with --no-load-optim or --finetune")
        optimizer.load_state_dict(state["optimizer"])
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if not args.no_load_rng:
        if "torch_rng_state" not in state:
            raise CheckpointError(f"{path} has no RNG state (saved with --no-save-rng); "
                                  "load it with --no-load-rng")
        set_rng_states(state, device)
    train_state = dict(state.get("train_state", {}))
    train_state["iteration"] = state.get("iteration", state.get("total_iters", iteration))
    train_state.setdefault("consumed_train_samples",
                           train_state["iteration"] * args.global_batch_size)
    return train_state


def resuming_own_save(args):
    """--load is --save: a job that restarts itself (torchrun --max-restarts, a requeued
    scheduler job). Before its first checkpoint the directory may already hold metrics.jsonl
    or an interrupted save; that is a fresh start, not a mistake."""
    return bool(args.save) and os.path.realpath(args.load) == os.path.realpath(args.save)


def _count_rank_files(directory):
    """How many tensor-parallel ranks wrote into an iteration directory (None if none)."""
    if not os.path.isdir(directory):
        return None
    ranks = [d for d in os.listdir(directory) if re.fullmatch(r"mp_rank_\d{2}", d) and
             os.path.isfile(os.path.join(directory, d, "model_optim_rng.pt"))]
    return len(ranks) or None


def _check_model_parallel_size(args, directory, saved_size):
    """A checkpoint saved at another TP size must be converted, not loaded: say how."""
    ours = args.model_parallel_size
    if saved_size is None or saved_size == ours:
        return
    converted = f"{os.path.normpath(args.load)}_mp{ours}"
    raise CheckpointError(
        f"checkpoint {directory} was saved with --model-parallel-size {saved_size}, but this "
        f"run uses --model-parallel-size {ours}. Convert it to the new size first:\n"
        f"  python tools/merge_mp_partitions.py --load {args.load} "
        f"--target-model-parallel-size {ours} --save {converted}\n"
        f"then resume with --load {converted} (or run with --model-parallel-size {saved_size})")


def _load_model_weights(model, state, path):
    flat = to_flat_state_dict(state["model"])
    module = _unwrap(model)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    wrong_shape = [f"{k}: checkpoint {tuple(flat[k].shape)}, model {tuple(expected[k].shape)}"
                   for k in expected if k in flat and flat[k].shape != expected[k].shape]
    if missing or unexpected or wrong_shape:
        lines = ([f"missing: {', '.join(missing[:8])}"] if missing else []) + \
                ([f"unexpected: {', '.join(unexpected[:8])}"] if unexpected else []) + \
                [f"shape {w}" for w in wrong_shape[:8]]
        raise CheckpointError(f"model weights in {path} do not fit the model built from the "
                              "flags:\n  " + "\n  ".join(lines))
    module.load_state_dict(flat)
