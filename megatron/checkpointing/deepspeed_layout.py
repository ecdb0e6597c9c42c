"""--deepspeed checkpoints: DeepSpeed's layout written by the zero engine, plus the trainer's
client state and Megatron's tracker file, as Megatron-DeepSpeed's save_ds_checkpoint does.

    <save>/global_step200/...           the engine's files (zero.checkpoint.layout)
    <save>/latest                       "global_step200"
    <save>/latest_checkpointed_iteration.txt   "200" (Megatron's tracker, for the tools)

The client state holds the iteration, the data position, the run's args and the RNG states.
"""

import argparse
import os

from zero.checkpoint.files import load_plain, model_states_name, stage3_model_states_name
from zero.checkpoint.layout import read_latest
from zero.checkpoint.whole_params import saved_stage

from megatron.checkpointing.files import atomic_write_text, barrier, is_global_rank0, safe_load
from megatron.checkpointing.megatron_layout import (CHECKPOINT_VERSION, finetunes,
                                                    get_checkpoint_tracker_filename,
                                                    resuming_own_save)
from megatron.checkpointing.resume_checks import (check_checkpoint_args,
                                                  optimizer_state_tiling_mismatch)
from megatron.checkpointing.retention import DEEPSPEED_LAYOUT, publish_checkpoint
from megatron.checkpointing.rng import get_rng_states, set_rng_states
from megatron.errors import CheckpointError


def checkpoint_tag(iteration):
    return f"global_step{iteration}"


def tag_to_load(load_dir, step=None):
    """The tag of the checkpoint to load: iteration `step`'s (--ckpt-step) when given, else
    the one `latest` names (None: none)."""
    return checkpoint_tag(step) if step is not None else read_latest(load_dir)


def save_checkpoint(iteration, engine, checkpoint, run_args, train_state, device):
    """DeepSpeed's layout through the engine (every rank), then Megatron's tracker."""
    client_state = {
        "iteration": iteration,
        "consumed_train_samples": train_state["consumed_train_samples"],
        "train_state": dict(train_state),
        "checkpoint_version": CHECKPOINT_VERSION,
        "args": dict(run_args),
    }
    if not checkpoint.no_save_rng:
        client_state.update(get_rng_states(device))
    engine.save_checkpoint(checkpoint.save, tag=checkpoint_tag(iteration),
                           client_state=client_state)
    if is_global_rank0():
        atomic_write_text(get_checkpoint_tracker_filename(checkpoint.save), str(iteration),
                          point="save.tracker")
        # the engine wrote `latest`; Megatron's tracker names the new checkpoint too
        publish_checkpoint(checkpoint.save, checkpoint_tag(iteration), None,
                           train_state["run_id"], checkpoint.keep_last_n_checkpoints,
                           DEEPSPEED_LAYOUT)
    barrier()


def load_checkpoint(engine, checkpoint, run_args, device):
    """Resume from checkpoint.load (iteration checkpoint.load_step's tag, or the one its
    `latest` names). Returns the train_state to
    continue from, or None when there is nothing to resume."""
    load_dir = checkpoint.load
    tag = tag_to_load(load_dir, checkpoint.load_step)
    if tag is None:
        _explain_missing_latest(checkpoint)
        return None
    # Every model states file records the run's args: read the first one's, which a
    # checkpoint of any layout has, so that every rank makes the same checks (a rank whose
    # own file is missing, at another layout, would otherwise fail differently).
    # stage 3 writes one model states file per DP rank, stages 0-2 one per model-parallel rank
    saved_layout = saved_stage(os.path.join(load_dir, tag), 0)
    states_name = stage3_model_states_name(0, 0) if saved_layout == 3 else model_states_name(0)
    states_path = os.path.join(load_dir, tag, states_name)
    finetune = finetunes(checkpoint, _saved_args(states_path), tag)
    fresh_optimizer = checkpoint.no_load_optim or finetune
    _check_saved_args(states_path, run_args, fresh_optimizer)
    if not finetune:
        _say_another_zero_stage(states_path, engine.zero_optimization_stage(),
                                fresh_optimizer)
    path, client_state = engine.load_checkpoint(  # (the trainer agrees over its whole load)
        load_dir, tag=tag, load_optimizer_states=not fresh_optimizer,
        load_lr_scheduler_states=not fresh_optimizer, load_module_only=finetune, agree=False)
    if finetune:
        return {"iteration": 0, "consumed_train_samples": 0, "skipped_iters": 0}
    if not checkpoint.no_load_rng:
        set_rng_states(client_state, device, path)
    train_state = dict(client_state.get("train_state", {}))
    train_state["iteration"] = int(client_state.get("iteration", engine.global_steps))
    train_state["consumed_train_samples"] = int(client_state.get(
        "consumed_train_samples", engine.global_samples))
    train_state["skipped_iters"] = engine.skipped_steps
    train_state.setdefault("run_id", "")  # written before checkpoints carried their run
    return train_state


def holds_deepspeed_checkpoint(load_dir, step=None):
    if step is not None:
        return os.path.isdir(os.path.join(load_dir, checkpoint_tag(step)))
    return bool(load_dir) and read_latest(load_dir) is not None


def _explain_missing_latest(checkpoint):
    load_dir = checkpoint.load  # (a Megatron-layout checkpoint is loaded by that layout's code)
    if os.path.isdir(load_dir) and os.listdir(load_dir) and not resuming_own_save(checkpoint):
        raise CheckpointError(f"--load {load_dir} has no 'latest' file; point --load at a "
                              "directory written by --save with --deepspeed")


def _say_another_zero_stage(model_states_path, stage, fresh_optimizer):
    """Either family of ZeRO stages resumes the other's checkpoint (zero.checkpoint.
    whole_params): say so, since the files stay in the saved stage's layout until this run
    saves."""
    saved = _saved_zero_stage(model_states_path)
    if saved is None or saved == stage or not is_global_rank0():
        return
    moved = "fp32 master weights" if fresh_optimizer else "fp32 master weights and optimizer state"
    print(f" note: {os.path.dirname(model_states_path)} was saved at ZeRO stage {saved}; this "
          f"run's stage {stage} takes its {moved}, re-partitioned", flush=True)


def _saved_zero_stage(model_states_path):
    if not os.path.isfile(model_states_path):
        return None
    config = load_plain(model_states_path, mmap=True).get("ds_config") or {}
    section = config.get("zero_optimization") if isinstance(config, dict) else None
    if isinstance(section, bool):  # DeepSpeed's deprecated spelling: true is stage 1
        return int(section)
    return section.get("stage", 0) if isinstance(section, dict) else 0


def _saved_args(model_states_path):
    """The args a model states file records ({} when it has none or is missing: the engine
    names what is missing)."""
    if not os.path.isfile(model_states_path):
        return {}
    states = safe_load(model_states_path, mmap=True)  # (damaged: one error naming why)
    args = states.get("args") if isinstance(states, dict) else None
    if isinstance(args, argparse.Namespace):  # Megatron-DeepSpeed's
        checkpoint = os.path.dirname(os.path.dirname(model_states_path))
        raise CheckpointError(
            f"{model_states_path} was saved by Megatron-DeepSpeed, whose DeepSpeed files this "
            "engine does not resume: convert it with tools/merge_mp_partitions.py --deepspeed "
            f"--load {checkpoint} --save DIR (its ZeRO optimizer state too), then --load DIR "
            "--no-load-rng")
    return args if isinstance(args, dict) else {}


def _check_saved_args(model_states_path, run_args, fresh_optimizer):
    """Shape-defining flags must match the checkpoint's, and the tiling flags too unless the
    optimizer starts fresh: say which differ before loading."""
    saved_args = _saved_args(model_states_path)
    if saved_args:
        check_checkpoint_args(saved_args, run_args, model_states_path)
        mismatch = None if fresh_optimizer else \
            optimizer_state_tiling_mismatch(saved_args, run_args)
        if mismatch:
            raise CheckpointError(f"{os.path.dirname(model_states_path)}: {mismatch}")
