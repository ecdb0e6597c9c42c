"""pretrain(): build everything from the flags, then train, evaluate and checkpoint.

Data flow of one iteration (global batch G = micro batch b x data-parallel size d x A):

    A micro batches -> forward_step -> loss / A -> backward  (gradients accumulate; the
        last backward also launches the bucketed data-parallel all-reduces, --DDP-impl)
    finish the gradient all-reduce (mean over the data-parallel group)
    optimizer.step(): unscale, skip on inf/nan, clip (tensor-parallel aware norm), Adam
    lr_scheduler.step()

Under --deepspeed the zero engine does the last three lines (megatron/deepspeed_glue.py):
per micro batch `engine.backward(loss); engine.step()`.
"""

import contextlib
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.checkpointing import megatron_layout as checkpointing
from megatron import mpu
from megatron.runtime import device as device_mod
from megatron.distributed import wrap_data_parallel
from megatron.runtime.fault_tolerance import TrainingGuards
from megatron.runtime.initialize import Runtime, destroy, initialize_megatron
from megatron.training.learning_rates import AnnealingLR
from megatron.training.metrics import TrainingLogger, mfu
from megatron.training.optimizer import build_optimizer
from megatron.tokenizer import build_tokenizer, vocab_size_with_padding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainContext:
    """What forward_step and the providers may read: flags, tokenizer, where we run."""
    args: object
    tokenizer: object
    runtime: Runtime


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func, args):
    """Megatron's entry: providers build datasets and the model; forward_step returns a loss.

    - `model_provider(ctx) -> nn.Module`
    - `train_valid_test_datasets_provider(ctx, [n_train, n_valid, n_test]) -> (ds, ds, ds)`
    - `forward_step_func(batch, model, ctx) -> scalar loss` (mean over counted tokens)
    """
    runtime = initialize_megatron(args)
    logger = guards = None
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file,
                                    args.tokenizer_model)
        args.orig_vocab_size = tokenizer.vocab_size  # saved in checkpoints for converters
        args.padded_vocab_size = vocab_size_with_padding(
            tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.model_parallel_size)
        ctx = TrainContext(args, tokenizer, runtime)
        model, optimizer, lr_scheduler = setup_model_and_optimizer(model_provider, ctx)
        train_state = {"iteration": 0, "consumed_train_samples": 0, "skipped_iters": 0}
        if args.load:
            loaded = checkpointing.load_checkpoint(model, optimizer, lr_scheduler, args,
                                                   runtime.device)
            if loaded:
                train_state.update(loaded)
                _print0(runtime, f" loaded checkpoint from {args.load} at iteration "
                                 f"{train_state['iteration']}")
        datasets = train_valid_test_datasets_provider(ctx, _num_samples(args))
        logger = TrainingLogger(args.log_dir, args.tensorboard_dir, runtime.is_rank0)
        guards = TrainingGuards(args, runtime, train_state)  # signals, NaN streaks, dead peers
        with guards.explaining_failures():
            saved_at = train(forward_step_func, model, optimizer, lr_scheduler, datasets, ctx,
                             train_state, logger, guards)
        if train_state["iteration"] >= args.train_iters:
            for split, dataset in (("valid", datasets[1]), ("test", datasets[2])):
                if dataset is not None and args.eval_iters > 0:
                    loss = evaluate(forward_step_func, model, dataset, ctx)
                    logger.log_eval(train_state["iteration"], split, loss)
        if args.save and saved_at != train_state["iteration"]:
            checkpointing.save_checkpoint(train_state["iteration"], model, optimizer,
                                          lr_scheduler, args, train_state, runtime.device)
        _print_summary(ctx, train_state)
        return train_state
    finally:
        if logger is not None:
            logger.close()
        if guards is not None:
            guards.close()
        destroy()


def _print0(runtime, message):
    if runtime.is_rank0:
        print(message, flush=True)


def _num_samples(args):
    """Samples each split must provide: train for every iteration, valid/test for eval."""
    evaluations = args.train_iters // args.eval_interval + 1
    return [args.train_iters * args.global_batch_size,
            args.eval_iters * args.global_batch_size * (1 if evaluations else 0),
            args.eval_iters * args.global_batch_size]


# Public for tools/build_index_maps.py: maps built ahead of a job must carry the sample counts
# (and so the cache file names) this trainer asks for.
num_samples_per_split = _num_samples


def setup_model_and_optimizer(model_provider, ctx):
    args = ctx.args
    if args.deepspeed:  # ZeRO stage 3: built under zero.Init, partitioned as it is built
        from megatron.deepspeed_glue import model_construction_context
        with model_construction_context(args):
            module = model_provider(ctx)
    else:
        module = model_provider(ctx)
    module.to(device=ctx.runtime.device, dtype=DTYPES[args.params_dtype])
    if args.deepspeed:  # the zero engine reduces gradients: no data-parallel wrapper here
        from megatron.deepspeed_glue import setup_engine
        model, optimizer, lr_scheduler = setup_engine(module, args)
        _print_parameter_count(ctx, module)
        return model, optimizer, lr_scheduler
    # Wrap before the optimizer copies weights: torch's DDP broadcasts rank 0's on creation.
    model = wrap_data_parallel(module, args.DDP_impl, mpu.get_data_parallel_group(),
                               args.ddp_bucket_size, args.fp32_allreduce)
    optimizer = build_optimizer(
        module, lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        params_dtype=DTYPES[args.params_dtype], loss_scaler=_loss_scaler(args),
        grad_norm_fn=mpu.clip_grad_norm)
    lr_scheduler = AnnealingLR(
        optimizer, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_iters,
        decay_steps=args.lr_decay_iters, decay_style=args.lr_decay_style,
        use_checkpoint_lr_scheduler=args.use_checkpoint_lr_scheduler,
        override_lr_scheduler=args.override_lr_scheduler)
    _print_parameter_count(ctx, module)
    return model, optimizer, lr_scheduler


def _print_parameter_count(ctx, module):
    if ctx.runtime.is_rank0:
        n_local = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
        print(f" > parameters on tensor-parallel rank 0: {n_local:,}", flush=True)


def _loss_scaler(args):
    if not args.fp16:
        return None
    from megatron.loss_scaler import ConstantLossScaler, DynamicLossScaler
    if args.loss_scale:
        return ConstantLossScaler(args.loss_scale)
    return DynamicLossScaler(initial_scale=args.initial_loss_scale, min_scale=args.min_scale,
                             growth_interval=args.loss_scale_window,
                             hysteresis=args.hysteresis)


def _data_iterator(dataset, consumed_samples, args):
    from megatron.data.samplers import build_pretraining_data_loader
    loader = build_pretraining_data_loader(
        dataset, consumed_samples, args.batch_size, mpu.get_data_parallel_rank(),
        mpu.get_data_parallel_world_size(), args.num_workers)
    return iter(loader)


def _average_over_data_parallel(value, device):
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    if mpu.get_data_parallel_world_size() > 1:
        dist.all_reduce(tensor, group=mpu.get_data_parallel_group())
        tensor /= mpu.get_data_parallel_world_size()
    return tensor.item()


def train_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler, ctx):
    """One iteration over a global batch. Returns (mean loss, update done, grad norm)."""
    args = ctx.args
    if args.deepspeed:  # the engine steps its optimizer and lr schedule itself
        from megatron.deepspeed_glue import train_step as engine_step
        total, updated, grad_norm = engine_step(forward_step_func, data_iterator, model, ctx)
    else:
        total, updated, grad_norm = _megatron_step(forward_step_func, data_iterator, model,
                                                   optimizer, lr_scheduler, ctx)
    mean_loss = _average_over_data_parallel(total / args.num_micro_batches, ctx.runtime.device)
    return mean_loss, updated, grad_norm


def _megatron_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler, ctx):
    """Returns (summed micro-batch losses on this rank, update done, grad norm)."""
    args = ctx.args
    optimizer.zero_grad()
    total = torch.zeros((), dtype=torch.float32, device=ctx.runtime.device)
    for i in range(args.num_micro_batches):
        last = i == args.num_micro_batches - 1
        with contextlib.nullcontext() if last else model.no_sync():  # accumulate locally
            loss = forward_step_func(next(data_iterator), model, ctx)
            optimizer.scale_loss(loss / args.num_micro_batches).backward()
        total += loss.detach().float()
    model.finish_gradient_synchronization()
    updated, grad_norm, _ = optimizer.step()
    if updated:
        lr_scheduler.step()
    return total.item(), updated, grad_norm


@torch.no_grad()
def evaluate(forward_step_func, model, dataset, ctx):
    """Mean loss over --eval-iters global batches, always the same leading batches."""
    args = ctx.args
    model.eval()
    iterator = _data_iterator(dataset, 0, args)
    total, count = 0.0, 0
    for _ in range(args.eval_iters):
        for _ in range(args.num_micro_batches):
            try:
                batch = next(iterator)
            except StopIteration:
                break
            total += forward_step_func(batch, model, ctx).float().item()
            count += 1
    model.train()
    return _average_over_data_parallel(total / max(count, 1), ctx.runtime.device)


def train(forward_step_func, model, optimizer, lr_scheduler, datasets, ctx, state, logger,
          guards):
    """The loop. Returns the iteration of the last checkpoint written (or None)."""
    args, runtime = ctx.args, ctx.runtime
    train_forward_step = guards.wrap_forward_step(forward_step_func)  # test fault hooks
    model.train()
    iterator = _data_iterator(datasets[0], state["consumed_train_samples"], args)
    flops_per_sample = _flops_per_sample(ctx)
    peak = device_mod.peak_flops(runtime.device, DTYPES[args.params_dtype]) * runtime.world_size
    window = {"loss": 0.0, "iters": 0, "start": time.perf_counter(), "grad_norm": None}
    saved_at = None
    while state["iteration"] < args.train_iters:
        guards.before_iteration(state["iteration"] + 1)
        loss, updated, grad_norm = train_step(train_forward_step, iterator, model, optimizer,
                                              lr_scheduler, ctx)
        state["iteration"] += 1
        state["consumed_train_samples"] += args.global_batch_size
        state["skipped_iters"] += 0 if updated else 1
        window["loss"] += loss
        window["iters"] += 1
        window["grad_norm"] = grad_norm
        iteration = state["iteration"]
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            _log_window(window, state, optimizer, lr_scheduler, flops_per_sample, peak, ctx,
                        logger)
        guards.after_iteration(iteration, loss)  # counts NaN losses; stops a long streak
        if datasets[1] is not None and args.eval_iters > 0 and \
                iteration % args.eval_interval == 0 and iteration != args.train_iters:
            eval_start = time.perf_counter()
            logger.log_eval(iteration, "valid",
                            evaluate(forward_step_func, model, datasets[1], ctx))
            window["start"] += time.perf_counter() - eval_start  # keep eval out of ms/iter
        exiting = args.exit_interval and iteration % args.exit_interval == 0
        stop_reason = guards.stop_reason()  # SIGTERM or time limit, agreed by all ranks
        if args.save and (iteration % args.save_interval == 0 or exiting or stop_reason):
            checkpointing.save_checkpoint(iteration, model, optimizer, lr_scheduler, args,
                                          state, runtime.device)
            saved_at = iteration
        if exiting:
            _print0(runtime, f" exiting at iteration {iteration} (--exit-interval)")
            break
        if stop_reason:
            _print0(runtime, f" exiting at iteration {iteration}: {stop_reason}"
                             + (", checkpoint saved" if args.save else ""))
            break
    return saved_at


def _flops_per_sample(ctx):
    from megatron.model import GPTConfig, flops_per_token
    args = ctx.args
    config = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads,
                       vocab_size=args.padded_vocab_size,
                       max_position_embeddings=args.max_position_embeddings,
                       ffn_hidden_size=args.ffn_hidden_size)
    factor = 4 if args.checkpoint_activations else 3  # recompute adds one more forward
    return flops_per_token(config, args.seq_length) * args.seq_length * factor / 3


def _log_window(window, state, optimizer, lr_scheduler, flops_per_sample, peak, ctx, logger):
    args, runtime = ctx.args, ctx.runtime
    device_mod.synchronize(runtime.device)
    elapsed = time.perf_counter() - window["start"]
    seconds_per_iter = elapsed / window["iters"]
    samples_per_s = args.global_batch_size / seconds_per_iter
    logger.log_train({
        "iteration": state["iteration"], "train_iters": args.train_iters,
        "consumed_samples": state["consumed_train_samples"],
        "ms_per_iter": seconds_per_iter * 1000.0,
        "lr": optimizer.param_groups[0]["lr"],  # what the schedule set (ours or the config's)
        "lm_loss": window["loss"] / window["iters"], "loss_scale": optimizer.loss_scale,
        "grad_norm": window["grad_norm"],
        "tokens_per_s": samples_per_s * args.seq_length,
        "mfu": mfu(samples_per_s, flops_per_sample, peak),
        "skipped_iters": state["skipped_iters"],
    })
    window.update(loss=0.0, iters=0, start=time.perf_counter())


def _print_summary(ctx, state):
    args = ctx.args
    if not ctx.runtime.is_rank0:
        return
    lines = [f" training finished at iteration {state['iteration']}"]
    if args.save:
        tag = f"global_step{state['iteration']}" if args.deepspeed \
            else f"iter_{state['iteration']:07d}"
        lines.append(f" checkpoint:   {os.path.abspath(args.save)} ({tag})")
    if args.log_dir:
        lines.append(f" metrics:      {os.path.abspath(os.path.join(args.log_dir, 'metrics.jsonl'))}")
    if args.tensorboard_dir:
        lines.append(f" tensorboard:  tensorboard --logdir {os.path.abspath(args.tensorboard_dir)}")
    print("\n".join(lines), flush=True)
