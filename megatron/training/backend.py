"""The one object the trainer trains, checkpoints and reports through.

Both trainers run on the zero engine: without --deepspeed it is ZeRO stage 0 configured from
the Megatron flags (plain data parallelism: fp32 master weights, loss scaling, clipping and a
bucketed all-reduce overlapped with backward), under --deepspeed whatever the DeepSpeed JSON
asks for. So there is one optimizer, loss-scaler and gradient-reduction stack. What differs
is chosen once, at start-up, by the backend class:

    MegatronBackend   Megatron's checkpoint layout (loaded at any TP x PP size); --DDP-impl torch
    ZeroBackend       DeepSpeed's checkpoint layout; zero.Init at ZeRO stage 3

The trainer calls `train_step`, `report`, `optimizer_scalars`, `weights_norm`, `save`, `load`,
`finish_load`, `checkpoint_tag` and uses `model` for forward passes; nothing else of the engine.
"""

import contextlib
import dataclasses
import functools

import math

import torch

from megatron import mpu
from megatron.checkpointing import deepspeed_layout, megatron_layout
from megatron.checkpointing.retention import DEEPSPEED_LAYOUT, MEGATRON_LAYOUT
from megatron.errors import CheckpointError
from megatron.runtime import device as device_mod
from megatron.training.learning_rates import AnnealingLR
from megatron.training.param_groups import get_param_groups

_CONFIG_WEIGHT_DECAY = object()  # marks the group whose decay the config's optimizer sets


class Backend:
    def __init__(self, engine, ctx):
        self.engine, self.ctx = engine, ctx
        # pipeline parallelism: this rank's stage runs the micro batches (1F1B)
        self.pipeline = None
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            from megatron.pipeline.schedules import PipelineStage
            self.pipeline = PipelineStage(engine, ctx)
        if ctx.config.logging.num_zeros_in_grad:
            engine.optimizer.count_zeros_in_grad()

    @property
    def model(self):
        """What forward steps call: the engine (it gathers ZeRO-3 parameters as it goes)."""
        return self.engine

    @property
    def compiled(self):
        """Whether the engine compiled the model (--compile, or the config's "compile")."""
        return self.engine.compiled

    @property
    def compiled_regions(self):
        """What --compile made compiled regions of, in words (the log line's)."""
        return getattr(self.module, "compiled_regions", None) or "the whole module"

    @property
    def compile_backend(self):
        return self.engine.config.compile.backend

    @property
    def module(self):
        """The model itself, without any wrapper."""
        return self.engine.module

    def train_step(self, forward_step, data_iterator, global_batch):
        """One global batch of `global_batch` samples (--global-batch-size, or the size the
        batch-size ramp has reached): per micro batch forward, backward (gradients reduced over data
        parallelism at the last one), then the optimizer step (unscale, skip on inf/nan,
        clip, step, loss-scale update) and the learning-rate schedule, in the engine.
        Returns (summed micro-batch losses on this rank, a device tensor: reading it waits
        for the step, so the caller reads it when it needs the number; update done, grad norm
        or None when the step was skipped).

        fp16 with a dynamic scale, before the run's first clean step: an overflow retries the
        same batches at the lowered scale instead of skipping them, so the run trains from
        its first batch whatever the initial scale (said once, with the scale found)."""
        engine, config = self.engine, self.ctx.config
        count = config.training.micro_batches_in(global_batch)
        if global_batch != engine.train_batch_size():
            engine.set_train_batch_size(global_batch)
        # a schedule in samples steps by the batch (Megatron-LM's increment)
        lr_kwargs = {"increment": global_batch} \
            if config.optimizer.schedule_unit == "samples" else None
        searching = engine.searching_initial_loss_scale
        batches = [next(data_iterator) for _ in range(count)] if searching else None
        first_scale, retries = engine.optimizer.cur_scale, 0
        while True:
            skipped_before = engine.skipped_steps
            source = iter(batches) if searching else data_iterator
            total = self._run_micro_batches(forward_step, source, count, lr_kwargs)
            updated = engine.skipped_steps == skipped_before
            if updated or not searching or not engine.retry_skipped_step():
                break
            retries += 1
        if retries:
            outcome = (f"found {_power_of_two(engine.optimizer.cur_scale)} by retrying that batch "
                       f"{retries} times (no step skipped)" if updated else
                       f"still overflowing after {retries} retries: the step was skipped")
            self.ctx.runtime.print0(f" fp16: the initial loss scale {_power_of_two(first_scale)} "
                                    f"overflowed on the first batch; {outcome}")
        return total, updated, engine.get_global_grad_norm() if updated else None

    def _run_micro_batches(self, forward_step, batches, count, lr_kwargs):
        """Forward and backward of `count` micro batches and the step after the last; their
        summed losses."""
        if self.pipeline is not None:
            total = self.pipeline.train_step(forward_step, batches, count, lr_kwargs)
            self._empty_cache(1)  # (the stages step inside their schedule)
            return total
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.runtime.device)
        for index in range(count):
            loss = forward_step(next(batches), self.engine, self.ctx)
            self.engine.backward(loss)
            if index == count - 1:
                self._empty_cache(1)
            self.engine.step(lr_kwargs=lr_kwargs)  # acts at the last micro batch only
            total += loss.detach().float()
        self._empty_cache(2)
        return total

    def _empty_cache(self, level):
        """--empty-unused-memory-level `level` or more: CUDA's unused cached memory goes back
        to the device (Megatron-LM's places: 1 before the optimizer step and after each
        evaluation batch, 2 after the step too)."""
        if self.ctx.config.training.empty_unused_memory_level >= level:
            device_mod.empty_cache(self.ctx.runtime.device)

    @torch.no_grad()
    def forward_only(self, forward_step, batches):
        """Summed losses of the micro batches `batches` (a list), without gradients."""
        if self.pipeline is not None:
            total = self.pipeline.forward_only(forward_step, iter(batches), len(batches)).item()
        else:
            total = sum(forward_step(batch, self.engine, self.ctx).float().item()
                        for batch in batches)
        self._empty_cache(1)
        return total

    def resume_notes(self):
        """What loading the checkpoint changed that the user should read (once)."""
        return tuple(getattr(self.engine.lr_scheduler, "resume_notes", ()))  # a JSON's has none

    def take_phase_times(self):
        """{phase: seconds} the engine spent in forward, backward and the optimizer step
        since the last call (its wall_clock_breakdown timers; empty when they are off)."""
        times = self.engine.monitor.take_times()
        if "step" in times:
            times["optimizer"] = times.pop("step")
        return times

    def optimizer_scalars(self):
        """The learning rate (what the schedule set, ours or the config's), the loss scale,
        and with --log-num-zeros-in-grad the last step's zeros in the gradient."""
        optimizer = self.engine.optimizer
        scalars = {"lr": optimizer.param_groups[0]["lr"], "loss_scale": optimizer.cur_scale}
        if optimizer.counts_zeros_in_grad:
            scalars["num_zeros_in_grad"] = optimizer.num_zeros_in_grad
        return scalars

    def report(self):
        """What the log line shows of the optimizer and of the pipeline: its bubble since the
        last report (a collective over the stages). Called on every rank."""
        record = self.optimizer_scalars()
        if self.pipeline is not None:
            record["pipeline_bubble"] = self.pipeline.bubble()
        return record

    def weights_norm(self):
        """The L2 norm of the trained weights over every parallel rank (--log-params-norm; a
        collective, called on every rank)."""
        return self.engine.optimizer.weights_norm()

    def optimizer_state_norms(self):
        """{name: value} of Adam's moments and the weights (--log-optimizer-states-to-
        tensorboard; a collective, called on every rank)."""
        return self.engine.optimizer.optimizer_state_norms()

    def finish_load(self):
        """After every rank's load() succeeded: the fp32 masters a load restored reach the
        model's weights (at ZeRO stages 1-2 an all-gather, so not before all ranks agree)."""
        self.engine.optimizer.publish_restored_masters()

    @classmethod
    def construction_context(cls, ctx):
        """The context the model is built in."""
        return contextlib.nullcontext()

    @classmethod
    def prepare_module(cls, module, ctx):
        """The model as the engine receives it."""
        return module


class MegatronBackend(Backend):
    """ZeRO stage 0 from the Megatron flags; Megatron's checkpoint layout."""

    layout = MEGATRON_LAYOUT

    @classmethod
    def prepare_module(cls, module, ctx):
        if ctx.config.parallel.DDP_impl != "torch" or mpu.get_data_parallel_world_size() == 1:
            return module
        from megatron.training.torch_ddp import wrap_torch_ddp
        return wrap_torch_ddp(module, mpu.get_data_parallel_group(),
                              ctx.config.parallel.ddp_bucket_size,
                              ctx.config.engine.ds_config.communication_data_type == "fp32")

    def save(self, iteration, train_state):
        megatron_layout.save_checkpoint(iteration, self.module, self.engine,
                                        self.ctx.config.checkpoint, self.ctx.run_args,
                                        train_state, self.ctx.runtime.device)

    def load(self):
        return _load_megatron_layout(self, self.ctx.config.checkpoint)

    @staticmethod
    def checkpoint_tag(iteration):
        return f"iter_{iteration:07d}"


class ZeroBackend(Backend):
    """The user's DeepSpeed JSON; DeepSpeed's checkpoint layout."""

    layout = DEEPSPEED_LAYOUT

    @classmethod
    def construction_context(cls, ctx):
        """ZeRO stage 3: zero.Init over the data-parallel group, so each rank keeps only its
        partition of every parameter from the moment the layer is built (Megatron-DeepSpeed's
        model_provider)."""
        import zero
        engine = ctx.config.engine
        return zero.Init(data_parallel_group=mpu.get_data_parallel_group(),
                         remote_device=engine.remote_device, pin_memory=engine.use_pin_memory,
                         config=engine.ds_config, enabled=engine.zero_stage == 3)

    @classmethod
    def prepare_module(cls, module, ctx):
        if ctx.config.engine.zero_stage == 3:
            # GPT2Model's forward multiplies by the word embeddings outside their module:
            # stage 3 must gather them for the whole model forward.
            import zero
            zero.register_external_parameter(
                module, module.language_model.embedding.word_embeddings.weight)
        return module

    def save(self, iteration, train_state):
        deepspeed_layout.save_checkpoint(iteration, self.engine, self.ctx.config.checkpoint,
                                         self.ctx.run_args, train_state, self.ctx.runtime.device)

    def load(self):
        checkpoint = self.ctx.config.checkpoint
        step = checkpoint.load_step
        if megatron_layout.holds_megatron_checkpoint(checkpoint.load, step) \
                and not deepspeed_layout.holds_deepspeed_checkpoint(checkpoint.load, step):
            # a checkpoint of the trainer without --deepspeed (or converted by the tools): its
            # weights go into the engine's module (at stage 3 a parameter at a time), its
            # per-parameter optimizer state into the partitions of any stage
            if checkpoint.finetune:  # weights only, even over its own --save
                checkpoint = dataclasses.replace(checkpoint, save=None)
            elif not checkpoint.no_load_optim and \
                    self.ctx.config.engine.ds_config.scheduler is not None:
                raise CheckpointError(
                    f"--load {checkpoint.load} holds a Megatron-layout checkpoint, whose "
                    "learning-rate schedule is Megatron's, and the DeepSpeed config's "
                    "'scheduler' section runs another: remove the section (the Megatron "
                    "flags set the schedule), or resume with --no-load-optim")
            return _load_megatron_layout(self, checkpoint)
        return deepspeed_layout.load_checkpoint(self.engine, checkpoint, self.ctx.run_args,
                                                self.ctx.runtime.device)

    checkpoint_tag = staticmethod(deepspeed_layout.checkpoint_tag)


def _load_megatron_layout(backend, checkpoint):
    """Resume (or fine-tune from) a Megatron-layout checkpoint, of another TP x PP size too
    (converted in memory as it loads)."""
    from megatron.convert.online import convert_for_this_rank
    ctx = backend.ctx
    state = megatron_layout.load_checkpoint(
        backend.module, backend.engine, checkpoint, ctx.run_args, ctx.runtime.device,
        convert=functools.partial(convert_for_this_rank, layers_per_virtual_stage=ctx.config
                                  .parallel.num_layers_per_virtual_pipeline_stage))
    if state is not None:
        backend.engine.restore_progress(state["iteration"], state["consumed_train_samples"],
                                        state["skipped_iters"])
    return state


def build_backend(ctx, model_provider):
    """Build the model (`model_provider(ctx)`) and the engine around it."""
    config = ctx.config
    cls = ZeroBackend if config.engine.deepspeed else MegatronBackend
    with cls.construction_context(ctx):
        module = model_provider(ctx)
    module.to(device=ctx.runtime.device, dtype=config.precision.torch_dtype)
    if ctx.runtime.is_rank0:
        n_local = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
        print(f" > parameters on tensor-parallel rank 0: {n_local:,}", flush=True)
        if config.optimizer.optimizer != "adam":
            _print_quantized_state_bytes(module, config.parallel.model_parallel_size,
                                         config.optimizer.optimizer)
    return cls(_initialize_engine(cls.prepare_module(module, ctx), config), ctx)


def _print_quantized_state_bytes(module, tp, name):
    from zero.optim.quantized_adam import QUANTIZED_ADAMS, state_bytes_per_param
    numels = [getattr(p, "ds_numel", p.numel()) * (tp if getattr(p, "model_parallel", False)
                                                    else 1)
              for p in module.parameters() if p.requires_grad]
    per_param, formula = state_bytes_per_param(numels, code=QUANTIZED_ADAMS[name].code)
    print(f" > optimizer state: {per_param:.2f} bytes/param ({formula}; fp32 Adam: 8)",
          flush=True)


def _initialize_engine(model, config):
    """zero.initialize with the client optimizer and schedule the trainer brings: AdamW over
    Megatron's parameter groups (unless the DeepSpeed JSON has an 'optimizer' section) and
    AnnealingLR (unless it has a 'scheduler' section)."""
    import zero
    import zero.ops
    ds_config, opt = config.engine.ds_config, config.optimizer
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else model
    if ds_config.optimizer is None:
        # --cpu-optimizer: Megatron-DeepSpeed's DeepSpeedCPUAdam (torch AdamW with
        # --cpu_torch_adam); under offload_optimizer the engine picks CPUAdam either way
        if opt.optimizer != "adam":
            from zero.optim.quantized_adam import QUANTIZED_ADAMS
            adam = QUANTIZED_ADAMS[opt.optimizer]
        elif opt.cpu_optimizer and not opt.cpu_torch_adam:
            adam = zero.ops.CPUAdam
        else:
            adam = torch.optim.AdamW
        optimizer = adam(get_param_groups(module, opt.weight_decay), lr=opt.lr,
                         betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
        parameters = None
    else:
        # The config's optimizer builds over our groups: its weight_decay applies to the decay
        # group, biases and LayerNorm keep 0.
        optimizer = None
        parameters = [{k: v for k, v in group.items() if v is not _CONFIG_WEIGHT_DECAY}
                      for group in get_param_groups(module, _CONFIG_WEIGHT_DECAY)]
    scheduler = None if ds_config.scheduler is not None \
        else functools.partial(_annealing_lr, config=opt,  # called with the engine's optimizer
                               global_batch=config.training.global_batch_size)
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer,
                                      model_parameters=parameters, lr_scheduler=scheduler,
                                      mpu=mpu, config=ds_config)
    return engine


def _annealing_lr(optimizer, config, global_batch):
    return AnnealingLR(optimizer, max_lr=config.lr, min_lr=config.min_lr,
                       warmup_steps=config.warmup_steps, decay_steps=config.lr_decay_steps,
                       decay_style=config.lr_decay_style,
                       use_checkpoint_lr_scheduler=config.use_checkpoint_lr_scheduler,
                       override_lr_scheduler=config.override_lr_scheduler,
                       follows_train_iters=config.schedule_follows_train_iters,
                       unit=config.schedule_unit, wsd_decay_steps=config.lr_wsd_decay_steps,
                       wsd_decay_style=config.lr_wsd_decay_style,
                       samples_per_step=global_batch if config.schedule_unit == "iterations"
                       else 1)


def _power_of_two(scale):
    exponent = math.log2(scale)
    return f"2^{exponent:.0f}" if exponent == int(exponent) else f"{scale:g}"
