"""Megatron-layout checkpoints, saved atomically and resumed exactly.

Layout (one file per tensor-parallel rank and pipeline stage, written by data-parallel rank
0 of each):

    <save>/iter_0000200/mp_rank_00/model_optim_rng.pt
    <save>/iter_0000200/mp_rank_00_001/model_optim_rng.pt   # with pipeline stages: TT_PPP
    <save>/latest_checkpointed_iteration.txt        # "200" (or "release")

A stage's file holds its own layers, numbered from 0 as Megatron's stages number them, the
embeddings on the first stage and the final LayerNorm on the last.

Each file holds only plain containers and tensors, so `torch.load(..., weights_only=True)`
reads it.  The model is stored in Megatron 1.1.5's nested form
(`model['language_model']['embedding']['word_embeddings']['weight']`,
`model['language_model']['transformer']['layers.0.attention.query_key_value.weight']`), which
the usual converters understand; flat state dicts are accepted on load as well.

The trainer runs on the zero engine at ZeRO stage 0 here too; its flat optimizer state is
saved one tensor per parameter (megatron/checkpointing/optimizer_state.py). Under --deepspeed
DeepSpeed's layout is written instead (megatron/checkpointing/deepspeed_layout.py).

Atomicity: every file is written to a temporary name, fsynced and renamed; the tracker is
rewritten (the same way) only after every rank's file is complete.  A crash at any moment
leaves the previous checkpoint and tracker intact.
"""

import os

import torch

from megatron import mpu
from megatron.checkpointing.files import (atomic_torch_save, barrier,
                                          is_global_rank0, safe_load)
from megatron.checkpointing.megatron_lm import (MEGATRON_DEEPSPEED, as_this_layout,
                                                require_weights_only)
from megatron.checkpointing.optimizer_state import (load_megatron_optimizer_state,
                                                    megatron_optimizer_state)
from megatron.checkpointing.resume_checks import (check_checkpoint_args,
                                                  check_model_parallel_size,
                                                  explain_missing_file,
                                                  optimizer_state_tiling_mismatch)
from megatron.checkpointing.retention import MEGATRON_LAYOUT, publish_checkpoint
from megatron.checkpointing.state_dicts import to_flat_state_dict, to_nested_state_dict
from megatron.checkpointing.rng import get_rng_states, set_rng_states
from megatron.errors import CheckpointError
from megatron.runtime.fault_injection import kill_point
from megatron.training.learning_rates import AnnealingLR

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 2.0
# Flags that fix the shapes of the saved tensors; a checkpoint must agree on all of them.
def get_checkpoint_name(checkpoints_path, iteration, mp_rank=None, release=False,
                        pp_rank=None, pipeline_parallel=None):
    """<path>/iter_<iteration>/mp_rank_TT/model_optim_rng.pt, or mp_rank_TT_PPP with
    pipeline stages (Megatron's names). Ranks and whether stages exist default to this
    process's."""
    directory = "release" if release else f"iter_{iteration:07d}"
    if mp_rank is None:
        mp_rank = mpu.get_model_parallel_rank()
    if pipeline_parallel is None:
        pipeline_parallel = mpu.get_pipeline_model_parallel_world_size() > 1
    if pp_rank is None:
        pp_rank = mpu.get_pipeline_model_parallel_rank()
    folder = f"mp_rank_{mp_rank:02d}" + (f"_{pp_rank:03d}" if pipeline_parallel else "")
    return os.path.join(checkpoints_path, directory, folder, "model_optim_rng.pt")


def first_rank_checkpoint_name(checkpoints_path, iteration, release=False):
    """The file of tensor-parallel rank 0 (of pipeline stage 0, when the checkpoint has
    stages): where a checkpoint's args are read from."""
    plain = get_checkpoint_name(checkpoints_path, iteration, 0, release, pipeline_parallel=False)
    staged = get_checkpoint_name(checkpoints_path, iteration, 0, release, pp_rank=0,
                                 pipeline_parallel=True)
    return staged if not os.path.isfile(plain) and os.path.isfile(staged) else plain


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def read_tracker(checkpoints_path):
    """(iteration, release) named by the tracker file, or (None, False) if there is none."""
    path = get_checkpoint_tracker_filename(checkpoints_path)
    if not os.path.isfile(path):
        return None, False
    with open(path, errors="replace") as f:  # bytes that are not text: the error below
        text = f.read(200).strip()
    if text == "release":
        return 0, True
    try:
        return int(text), False
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number or 'release', "
                              f"found {text!r}; fix or delete the file") from None


def iteration_to_load(checkpoints_path, step=None):
    """(iteration, release) of the checkpoint to load: `step` (--ckpt-step) when given, else
    the one the tracker names ((None, False): none)."""
    return (step, False) if step is not None else read_tracker(checkpoints_path)


# ------------------------------------------------------------------------- save / load

def save_checkpoint(iteration, module, engine, checkpoint, run_args, train_state, device):
    """Write this rank's file (data-parallel rank 0 of each tensor-parallel group), then
    atomically advance the tracker. `checkpoint` is the config's CheckpointConfig, `run_args`
    the flat args dict the file records."""
    kill_point("save.start")
    if mpu.get_data_parallel_rank() == 0:
        state = {
            "iteration": iteration,
            "checkpoint_version": CHECKPOINT_VERSION,
            "args": dict(run_args),
            "model": to_nested_state_dict(module.state_dict()),
            "train_state": dict(train_state),
        }
        if not checkpoint.no_save_optim:
            state["optimizer"] = megatron_optimizer_state(engine)
            state["lr_scheduler"] = engine.lr_scheduler.state_dict()
        if not checkpoint.no_save_rng:
            state.update(get_rng_states(device))
        atomic_torch_save(state, get_checkpoint_name(checkpoint.save, iteration))
    kill_point("save.files_done")
    barrier()
    if is_global_rank0():
        publish_checkpoint(checkpoint.save, f"iter_{iteration:07d}", str(iteration),
                           train_state["run_id"], checkpoint.keep_last_n_checkpoints,
                           MEGATRON_LAYOUT)
    barrier()
    kill_point("save.done")


def load_checkpoint(module, engine, checkpoint, run_args, device, convert=None):
    """Resume from checkpoint.load (iteration checkpoint.load_step, or the tracker's). Returns
    the train_state dict to continue from, or None when there is nothing to resume.

    `convert(load_dir, step)`: (this rank's file contents, a note) for a checkpoint saved at
    another tensor-parallel or pipeline size, None when it has this run's layout
    (megatron.convert.online.convert_for_this_rank); without it such a checkpoint is an error
    that names the conversion tool. The note is printed once."""
    load_dir = checkpoint.load
    iteration, release = iteration_to_load(load_dir, checkpoint.load_step)
    if iteration is None:
        if os.path.isdir(load_dir) and os.listdir(load_dir) and \
                not resuming_own_save(checkpoint):
            raise CheckpointError(f"--load {load_dir} has no {TRACKER_FILENAME}; point --load "
                                  "at a directory written by --save")
        return None  # nothing to resume: start from scratch (Megatron behaviour)
    path = get_checkpoint_name(load_dir, iteration, release=release)
    directory = os.path.dirname(os.path.dirname(path))
    converted = convert(load_dir, checkpoint.load_step) if convert is not None else None
    if converted is not None:
        state, note = converted
        if is_global_rank0():
            print(f" note: {note}", flush=True)
    else:
        if not os.path.isfile(path):
            named_by = get_checkpoint_tracker_filename(load_dir) \
                if checkpoint.load_step is None else f"--ckpt-step {checkpoint.load_step}"
            explain_missing_file(load_dir, iteration, path, directory, run_args, named_by)
        state = as_this_layout(safe_load(path), path)
    require_weights_only(state, checkpoint, path)
    if "args" in state:
        check_model_parallel_size(load_dir, run_args, directory,
                                   state["args"].get("model_parallel_size"))
        check_checkpoint_args(state["args"], run_args, path)
    weights = _load_model_weights(module, state, path)
    engine.optimizer.refresh_masters_from_model()  # 16-bit weights: the fp32 masters follow
    if finetunes(checkpoint, state.get("args", {}), f"iteration {iteration}") or release:
        return {"iteration": 0, "consumed_train_samples": 0, "skipped_iters": 0}
    if not checkpoint.no_load_optim:
        _load_optimizer(engine, state, run_args, path, _fp32_weights_by_param(module, weights))
    if not checkpoint.no_load_rng:
        set_rng_states(state, device, path)
        if converted is not None:  # every stage got stage 0's states: give them their own
            from megatron.runtime.initialize import seed_pipeline_stage
            seed_pipeline_stage(run_args.get("seed", 1234) + state.get("iteration", 0), device)
    train_state = dict(state.get("train_state", {}))
    train_state["iteration"] = state.get("iteration", state.get("total_iters", iteration))
    train_state.setdefault("consumed_train_samples",
                           _samples_before(state, train_state["iteration"], run_args))
    train_state.setdefault("skipped_iters", 0)
    train_state.setdefault("run_id", "")  # written before checkpoints carried their run
    return train_state


def _samples_before(state, iteration, run_args):
    """The samples consumed before `iteration` by a checkpoint without a train state
    (Megatron-LM's own, or converted from one): what its args recorded (Megatron-LM's
    consumed_train_samples), else this run's global batches up to it (a ramp's included)."""
    recorded = state.get("args", {}).get("consumed_train_samples")
    if recorded is not None:
        return int(recorded)
    ramp = run_args.get("rampup_batch_size")
    if ramp is None:
        return iteration * run_args["global_batch_size"]
    from megatron.config.batch_rampup import BatchRampup
    return BatchRampup(*ramp, final=run_args["global_batch_size"]).samples_after(iteration)


def _fp32_weights_by_param(module, weights):
    """{id(parameter): its fp32 weight in the checkpoint} for the 16-bit parameters whose
    checkpoint weight is fp32 (a checkpoint of an fp32 run, resumed in bf16 or fp16): their
    masters are those weights, not the weights rounded to 16 bits and back."""
    return {id(param): weights[name] for name, param in module.named_parameters()
            if param.dtype != torch.float32 and name in weights  # tiles: untiled names saved
            and weights[name].dtype == torch.float32}


def _load_optimizer(engine, state, run_args, path, fp32_weights):
    mismatch = optimizer_state_tiling_mismatch(state.get("args", {}), run_args)
    if mismatch:
        raise CheckpointError(f"{path}: {mismatch}")
    saved_args = state.get("args") or {}
    from_megatron_deepspeed = state.get("saved_by") == MEGATRON_DEEPSPEED
    why = "saved with --no-save-optim" if saved_args.get("no_save_optim") else \
        "converted from a Megatron-DeepSpeed checkpoint without ZeRO partitions (stage 0), " \
        "whose optimizer state is not carried" \
        if from_megatron_deepspeed else \
        "converted from a --deepspeed checkpoint with tiled linears, whose optimizer " \
        "state tools/merge_mp_partitions.py does not carry" \
        if saved_args.get("deepspeed") else \
        "written without it"
    if "optimizer" not in state:
        raise CheckpointError(f"{path} has no optimizer state ({why}); load it with "
                              "--no-load-optim or --finetune")
    scheduler = engine.lr_scheduler
    ours = isinstance(scheduler, AnnealingLR)  # (not a DeepSpeed JSON's 'scheduler')
    if "lr_scheduler" not in state and not (from_megatron_deepspeed and ours
                                             and scheduler.override_lr_scheduler):
        raise CheckpointError(
            f"{path} has no lr_scheduler state ({why}); load it with --no-load-optim or "
            "--finetune" if not from_megatron_deepspeed else
            f"{path} has no lr_scheduler state: it was converted from Megatron-DeepSpeed, "
            "whose schedule (token-based lengths, a weight decay that changes over the run, "
            "or a decay style this trainer lacks) this trainer does not run. "
            + ("Pass --override-lr-scheduler to continue the command line's schedule from the "
               "checkpoint's iteration, or --no-load-optim" if ours else
               "Resume it with --no-load-optim"))
    load_megatron_optimizer_state(engine, state["optimizer"], path, fp32_weights)
    if "lr_scheduler" in state:
        scheduler.load_state_dict(state["lr_scheduler"])
    else:  # (a schedule in samples, under --rampup-batch-size, steps by them)
        scheduler.step(state["iteration"] if scheduler.unit == "iterations" else
                       _samples_before(state, state["iteration"], run_args))
        scheduler.resume_notes.append(
            f"learning-rate schedule: the command line's, from iteration {state['iteration']} "
            "(--override-lr-scheduler; the checkpoint's Megatron-DeepSpeed schedule is not "
            "one this trainer runs)")


def holds_megatron_checkpoint(load_dir, step=None):
    if step is not None:
        return os.path.isdir(os.path.join(load_dir, f"iter_{step:07d}"))
    return bool(load_dir) and os.path.isfile(get_checkpoint_tracker_filename(load_dir))


def finetunes(checkpoint, saved_args, which):
    """Whether this load is --finetune's (the weights alone, everything else fresh). Not when
    --load is the run's own --save and its checkpoint was written by a --finetune run: that
    is the fine-tuning job restarting (a requeue, torchrun's restart), which resumes (said)."""
    if not checkpoint.finetune:
        return False
    if resuming_own_save(checkpoint) and saved_args.get("finetune"):
        if is_global_rank0():
            print(f" note: --finetune with --load = --save: {checkpoint.load} holds this "
                  f"fine-tuning's own checkpoint ({which}), so the run resumes "
                  "it (give --save another folder to fine-tune afresh)", flush=True)
        return False
    return True


def resuming_own_save(checkpoint):
    """--load is --save: a job that restarts itself (torchrun --max-restarts, a requeued
    scheduler job). Before its first checkpoint the directory may already hold metrics.jsonl
    or an interrupted save; that is a fresh start, not a mistake."""
    return bool(checkpoint.save) and \
        os.path.realpath(checkpoint.load) == os.path.realpath(checkpoint.save)


def _load_model_weights(module, state, path):
    flat = to_flat_state_dict(state["model"])
    partitioned = any(hasattr(p, "ds_id") for p in module.parameters())
    if partitioned and any(".tiled." in name for name, _ in module.named_parameters()):
        # a tile's state-dict entry joins tiles that stage 3 holds as empty placeholders
        raise CheckpointError(f"the weights of {path} cannot be loaded into the tiled layers "
                              "(--memory-centric-tiled-linear) of a ZeRO stage 3 model: "
                              "fine-tune untiled at stage 3, or tiled at stages 0-2")
    expected = _full_shapes(module)
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    wrong_shape = [f"{k}: checkpoint {tuple(flat[k].shape)}, model {tuple(expected[k])}"
                   for k in expected if k in flat and flat[k].shape != expected[k]]
    if missing or unexpected or wrong_shape:
        lines = ([f"missing: {', '.join(missing[:8])}"] if missing else []) + \
                ([f"unexpected: {', '.join(unexpected[:8])}"] if unexpected else []) + \
                [f"shape {w}" for w in wrong_shape[:8]]
        raise CheckpointError(f"model weights in {path} do not fit the model built from the "
                              "flags:\n  " + "\n  ".join(lines))
    if partitioned:
        _load_partitioned(module, flat)
    else:
        module.load_state_dict(flat)
    return flat


def _full_shapes(module):
    """{state-dict key: shape} of the full tensors, also for parameters ZeRO stage 3 keeps
    partitioned (whose state_dict() entries are empty placeholders)."""
    shapes = {key: tensor.shape for key, tensor in module.state_dict().items()}
    for name, param in module.named_parameters():
        if name in shapes and hasattr(param, "ds_shape"):
            shapes[name] = param.ds_shape
    return shapes


@torch.no_grad()
def _load_partitioned(module, flat):
    """Load `flat` into a module whose parameters ZeRO stage 3 partitions: each rank read the
    whole file, so it cuts its own piece of each parameter (no collective, never the whole
    model in the module); the engine's fp32 masters follow."""
    from zero.stages.partition_parameters import is_zero_param, write_full_value
    for name, param in module.named_parameters():
        if is_zero_param(param):
            write_full_value(param, flat[name])
        else:
            param.copy_(flat[name])
    for name, buffer in module.named_buffers():
        if name in flat:
            buffer.copy_(flat[name])
