"""What the stage 0-2 (zero/checkpoint/layout.py) and stage 3 (zero/checkpoint/stage3.py)
checkpoint files share: their names, the entries every stage writes alike, plain-tensor
reads, the report of a non-strict load, and the agreement of all ranks on a file operation."""

import errno
import logging
import os
import re
import zipfile
from collections import OrderedDict
from mmap import MAP_PRIVATE

import torch

from zero.checkpoint.partitions import DS_VERSION
from zero.comm.agreement import any_rank_failed
from zero.errors import CheckpointError

logger = logging.getLogger("zero.checkpoint")


def model_states_name(mp_rank):
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def stage3_model_states_name(dp_rank, mp_rank):
    """Stage 3 writes one model states file per data-parallel rank."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def layer_states_name(layer, tp_rank):
    """A pipeline module's layer file (DeepSpeed's PipelineModule.ckpt_layer_path)."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def optim_states_name(dp_rank, mp_rank, bf16=False):
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def engine_counters(engine):
    """The model-states entries every ZeRO stage writes the same way (DeepSpeed's keys)."""
    return {
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "dp_world_size": engine.dp_world_size,
        "mp_world_size": engine.checkpoint_world_size,
        "ds_config": engine.config.raw,
        "ds_version": DS_VERSION,
    }


def module_state_on_cpu(module):
    """module.state_dict() as compact CPU copies; tied tensors stay one tensor."""
    copies, state = {}, OrderedDict()
    for name, tensor in module.state_dict().items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", copy=True)
        state[name] = copies[key]
    return state


def shared_params(module):
    """{alias name: name it is stored under} for parameters registered under several names."""
    first, shared = {}, {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param in first:
            shared[name] = first[param]
        else:
            first[param] = name
    return shared


def report_skipped_keys(missing, unexpected, path):
    """A non-strict load (load_module_strict=False): say which weights it left out."""
    for names, what in ((missing, f"not in {path}: they keep their values"),
                        (unexpected, f"in {path} but not in the model: skipped")):
        if names:
            shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
            logger.warning("load_module_strict=False: %d weight(s) %s (%s)", len(names), what,
                           shown)


def fsync_dir(directory):
    """Make a directory's entries (files created or renamed in it) durable: a rename is on
    disk only once its directory is synced."""
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_plain(path, mmap=False):
    """torch.load of a checkpoint file onto the CPU, refusing pickled code (weights_only).
    With `mmap` its tensors are mapped from the file, privately whatever the process-wide
    default (writing to them never reaches the file), and read as they are used: pages the
    kernel can drop again. Files in torch's legacy format (before 1.6, not zip) cannot be
    mapped and are read whole. torch's own exceptions pass through."""
    if mmap and zipfile.is_zipfile(path):
        with torch.serialization.set_default_mmap_options(MAP_PRIVATE):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return torch.load(path, map_location="cpu", weights_only=True)


def torch_load(path, mmap=False):
    try:
        return load_plain(path, mmap)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 -- truncated files, pickled classes, ...
        reason, kind = load_failure(e)
        why = {PICKLED_CODE: "The file holds pickled classes, refused: it was not written by "
                             "zero (DeepSpeed's own files pickle classes; convert them with "
                             "DeepSpeed's zero_to_fp32.py)",
               UNREADABLE: "Check its permissions and the file system"}.get(kind, DAMAGED_ADVICE)
        raise CheckpointError(f"cannot read {path}: {reason}. {why}") from None


PICKLED_CODE, UNREADABLE, DAMAGED = "pickled code", "unreadable", "damaged"
DAMAGED_ADVICE = "The file is damaged (a copy cut short?): copy it again, or load another iteration"


def load_failure(exc):
    """(one line out of torch.load's multi-paragraph error, what it means): PICKLED_CODE (a
    global the safe unpickler refused), UNREADABLE (permissions, I/O) or DAMAGED (cut short,
    random bytes, not a torch checkpoint)."""
    text = str(exc)
    refused = re.search(r"(?i)unsupported global:?(?: GLOBAL)? ([\w.]+)", text)
    if refused:  # (torch words a blocked module's callable "Trying to load unsupported ...")
        return f"Unsupported global: GLOBAL {refused.group(1)}", PICKLED_CODE
    if isinstance(exc, OSError) and exc.errno not in (None, errno.EINVAL):
        return _first_line(text, exc), UNREADABLE  # permissions, I/O, a stale NFS handle, ...
    # the rest says where the reading broke: a zip cut short inside its data (EINVAL, "failed
    # reading zip archive"), bytes that are no pickle ("Unsupported operand", an IndexError or
    # UnicodeDecodeError out of the unpickler)
    return (f"it is truncated or not a torch checkpoint ({type(exc).__name__}: "
            f"{_first_line(text, exc)[:120]})"), DAMAGED


def _first_line(text, exc):
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first if len(first) <= 300 else first[:first.rfind(" ", 0, 300)] + " ..."


def optim_files(ckpt_dir, mp_rank):
    pattern = re.compile(rf"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_{mp_rank:02d}_?optim_states\.pt$")
    found = {}
    for name in os.listdir(ckpt_dir):
        match = pattern.match(name)
        if match:
            found[int(match.group(2))] = os.path.join(ckpt_dir, name)
    return [found[r] for r in sorted(found)]


def try_(action):
    try:
        action()
        return None
    except Exception as e:  # noqa: BLE001 -- re-raised after every rank has heard of it
        return e


def on_rank0_then_agree(engine, action, what):
    error = try_(action) if engine.global_rank == 0 else None
    all_agree(engine, error, what)


def all_agree(engine, error, what):
    """Every rank learns whether any rank failed, so no rank waits forever or goes on alone."""
    failed = any_rank_failed(error is not None)
    if isinstance(error, OSError):
        raise CheckpointError(f"could not {what}: {error}") from None
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"could not {what}: another rank failed (see its error)")
