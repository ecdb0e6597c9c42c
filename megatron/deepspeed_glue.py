"""The trainer's side of `--deepspeed`: build the zero engine, step it, checkpoint through it.

It follows Megatron-DeepSpeed's pretrain_gpt2.py / training.py:

    setup   the model as usual (already in the config's dtype) -> client AdamW over Megatron's
            param groups (no decay on biases and LayerNorm) unless the config has an
            'optimizer' section, client AnnealingLR unless it has a 'scheduler' section ->
            zero.initialize(model, optimizer, lr_scheduler, mpu=megatron.mpu, config=dict)
    step    per micro batch: loss = forward_step(batch, engine); engine.backward(loss);
            engine.step().  The engine divides by the accumulation steps, reduces gradients
            over the data-parallel group, unscales, clips and steps at the last micro batch.
    save    engine.save_checkpoint(save, tag="global_step{N}", client_state=iteration, data
            position, args, RNG), then Megatron's latest_checkpointed_iteration.txt
    load    engine.load_checkpoint(load) (the tag in <load>/latest), then the client state

The model is never wrapped in megatron.distributed's data parallel: the engine reduces the
gradients, and a second reduction would count them twice.
"""

import functools
import os

import torch
import torch.distributed as dist

from megatron.checkpointing import megatron_layout as checkpointing
from megatron import mpu
from megatron.checkpointing.retention import DEEPSPEED_LAYOUT, prune_checkpoints
from megatron.errors import CheckpointError
from megatron.training.learning_rates import AnnealingLR
from megatron.training.optimizer import get_param_groups

_CONFIG_WEIGHT_DECAY = object()  # marks the group whose decay the config's optimizer sets


def zero_stage(args):
    section = args.deepspeed_config_dict.get("zero_optimization") or {}
    return int(section.get("stage", 0))


def model_construction_context(args):
    """ZeRO stage 3: zero.Init over the data-parallel group, so each rank keeps only its
    partition of every parameter from the moment the layer is built (Megatron-DeepSpeed's
    model_provider). Other stages: nothing."""
    import zero
    return zero.Init(data_parallel_group=mpu.get_data_parallel_group(),
                     remote_device=args.remote_device, pin_memory=args.use_pin_memory,
                     config_dict_or_path=args.deepspeed_config_dict,
                     enabled=zero_stage(args) == 3)


def _register_tied_output_embedding(module):
    """GPT2Model's forward multiplies by the word embeddings outside their module: stage 3
    must gather them for the whole model forward."""
    import zero
    language_model = getattr(module, "language_model", None)
    embedding = getattr(language_model, "embedding", None)
    if embedding is not None:
        zero.register_external_parameter(module, embedding.word_embeddings.weight)


def setup_engine(module, args):
    """-> (engine, engine.optimizer, lr scheduler) for `module` under args.deepspeed_config_dict."""
    import zero
    import zero.ops
    config = args.deepspeed_config_dict
    if config.get("optimizer") is None:
        # --cpu-optimizer: Megatron-DeepSpeed's DeepSpeedCPUAdam (torch AdamW with
        # --cpu_torch_adam); under offload_optimizer the engine picks CPUAdam either way
        adam = zero.ops.CPUAdam if getattr(args, "cpu_optimizer", False) \
            and not getattr(args, "cpu_torch_adam", False) else torch.optim.AdamW
        optimizer = adam(get_param_groups(module, args.weight_decay), lr=args.lr,
                         betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
        parameters = None
    else:
        # The config's optimizer builds over our groups: its weight_decay applies to the decay
        # group, biases and LayerNorm keep 0.
        optimizer = None
        parameters = [{k: v for k, v in group.items() if v is not _CONFIG_WEIGHT_DECAY}
                      for group in get_param_groups(module, _CONFIG_WEIGHT_DECAY)]
    scheduler = None if config.get("scheduler") is not None \
        else functools.partial(_annealing_lr, args=args)  # called with the engine's optimizer
    if zero_stage(args) == 3:
        _register_tied_output_embedding(module)
    engine, optimizer, _, lr_scheduler = zero.initialize(
        model=module, optimizer=optimizer, model_parameters=parameters, lr_scheduler=scheduler,
        mpu=mpu, config=config)
    return engine, optimizer, lr_scheduler


def _annealing_lr(optimizer, args):
    return AnnealingLR(optimizer, max_lr=args.lr, min_lr=args.min_lr,
                       warmup_steps=args.warmup_iters, decay_steps=args.lr_decay_iters,
                       decay_style=args.lr_decay_style,
                       use_checkpoint_lr_scheduler=args.use_checkpoint_lr_scheduler,
                       override_lr_scheduler=args.override_lr_scheduler)


def train_step(forward_step_func, data_iterator, engine, ctx):
    """One global batch through the engine. Returns (summed micro-batch losses on this rank,
    update done, grad norm or None when the step was skipped)."""
    skipped_before = engine.skipped_steps
    total = torch.zeros((), dtype=torch.float32, device=ctx.runtime.device)
    for _ in range(ctx.args.num_micro_batches):
        loss = forward_step_func(next(data_iterator), engine, ctx)
        engine.backward(loss)
        engine.step()  # acts at the last micro batch only
        total += loss.detach().float()
    updated = engine.skipped_steps == skipped_before
    return total.item(), updated, engine.get_global_grad_norm() if updated else None


def checkpoint_tag(iteration):
    return f"global_step{iteration}"


def save_checkpoint(iteration, engine, args, train_state, device):
    """DeepSpeed's layout through the engine (every rank), then Megatron's tracker, as
    Megatron-DeepSpeed's save_ds_checkpoint does."""
    client_state = {
        "iteration": iteration,
        "consumed_train_samples": train_state["consumed_train_samples"],
        "train_state": dict(train_state),
        "checkpoint_version": checkpointing.CHECKPOINT_VERSION,
        "args": checkpointing.plain_args(args),
    }
    if not args.no_save_rng:
        client_state.update(checkpointing.get_rng_states(device))
    engine.save_checkpoint(args.save, tag=checkpoint_tag(iteration), client_state=client_state)
    if not dist.is_initialized() or dist.get_rank() == 0:
        checkpointing.atomic_write_text(checkpointing.get_checkpoint_tracker_filename(args.save),
                                        str(iteration), point="save.tracker")
        # After `latest` and the tracker name the new checkpoint: older ones may go.
        prune_checkpoints(args.save, args.keep_last_n_checkpoints, DEEPSPEED_LAYOUT)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def load_checkpoint(engine, args, device):
    """Resume from args.load (the tag its `latest` names). Returns the train_state to continue
    from, or None when there is nothing to resume."""
    from zero.checkpoint.layout import model_states_name, read_latest
    tag = read_latest(args.load)
    if tag is None:
        _explain_missing_latest(args.load, args)
        return None
    states_name = model_states_name(mpu.get_model_parallel_rank())
    if zero_stage(args) == 3:  # one model states file per DP rank
        from zero.checkpoint.stage3 import model_states_name as stage3_states_name
        states_name = stage3_states_name(0, mpu.get_model_parallel_rank())
    _check_saved_args(os.path.join(args.load, tag, states_name), args)
    fresh_optimizer = args.no_load_optim or args.finetune
    path, client_state = engine.load_checkpoint(
        args.load, tag=tag, load_optimizer_states=not fresh_optimizer,
        load_lr_scheduler_states=not fresh_optimizer, load_module_only=args.finetune)
    if args.finetune:
        return {"iteration": 0, "consumed_train_samples": 0, "skipped_iters": 0}
    if not args.no_load_rng:
        if "torch_rng_state" not in client_state:
            raise CheckpointError(f"{path} has no RNG state (saved with --no-save-rng); load it "
                                  "with --no-load-rng")
        checkpointing.set_rng_states(client_state, device)
    train_state = dict(client_state.get("train_state", {}))
    train_state["iteration"] = int(client_state.get("iteration", engine.global_steps))
    train_state["consumed_train_samples"] = int(client_state.get(
        "consumed_train_samples", engine.global_samples))
    train_state["skipped_iters"] = engine.skipped_steps
    return train_state


def _explain_missing_latest(load_dir, args):
    if os.path.isfile(checkpointing.get_checkpoint_tracker_filename(load_dir)):
        raise CheckpointError(
            f"--load {load_dir} holds a Megatron-layout checkpoint "
            f"({checkpointing.TRACKER_FILENAME}, iter_*/) but no DeepSpeed 'latest' file: it was "
            "saved without --deepspeed. Resume it without --deepspeed, or start this run from "
            "its weights with a fresh --save directory")
    if os.path.isdir(load_dir) and os.listdir(load_dir) and \
            not checkpointing.resuming_own_save(args):
        raise CheckpointError(f"--load {load_dir} has no 'latest' file; point --load at a "
                              "directory written by --save with --deepspeed")


def _check_saved_args(model_states_path, args):
    """Shape-defining flags must match the checkpoint's: say which differ before loading."""
    if not os.path.isfile(model_states_path):
        return  # the engine names what is missing
    try:
        states = torch.load(model_states_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {model_states_path}: "
                              f"{checkpointing.load_failure_reason(exc)}. The file is corrupt "
                              "or not a plain-tensor checkpoint") from None
    if isinstance(states.get("args"), dict):
        checkpointing.check_checkpoint_args(states["args"], args, model_states_path)
