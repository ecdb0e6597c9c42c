"""`zero.initialize` and the engine it returns: what `deepspeed.initialize` gives.

    engine, optimizer, _, scheduler = zero.initialize(model=model, config="ds_config.json",
                                                      model_parameters=model.parameters())
    for batch in batches:                   # one micro-batch per call
        loss = engine(batch)
        engine.backward(loss)               # / gradient_accumulation_steps, x loss scale
        engine.step()                       # acts at accumulation boundaries only
    engine.save_checkpoint("checkpoints")   # DeepSpeed's layout; zero_to_fp32.py alongside

Data parallelism is over `mpu.get_data_parallel_group()` when an `mpu` (Megatron's) is given,
else over the whole world. The optimizer is always a partitioning one (zero/stages/build.py
picks it: stage 0 is plain data parallelism over the same flat buffers); fp16 and bf16 keep
fp32 master weights in it. A model wrapped in torch's DistributedDataParallel reduces its own
gradients (stage 0 only); the engine then keeps the step.

How `zero_optimization` keys act here: `stage`, `reduce_bucket_size`, `overlap_comm`,
`reduce_scatter` (false: all-reduce each bucket, keep this rank's chunk),
`ignore_unused_parameters` and `load_from_fp32_weights` as in DeepSpeed. Four need no switch:
every bucket is already split evenly over all ranks (what `round_robin_gradients` arranges),
gradients always go through contiguous buckets (`contiguous_gradients`), parameters are
all-gathered per reduce bucket in one collective each (`allgather_partitions`,
`allgather_bucket_size`, which DeepSpeed also ignores when all_gather_into_tensor exists), and
every checkpoint loads at any data-parallel size (`elastic_checkpoint`). `offload_optimizer`
(cpu or nvme, stages 1-3) keeps the masters and optimizer state on the host
(zero/offload/host_masters.py). Stage 3 (parameters partitioned too, gathered by module hooks)
is zero/stages/stage3.py, with zero/stages/partition_parameters.py (`zero.Init`,
`zero.GatheredParameters`). The top-level `communication_data_type` "fp32" all-reduces 16-bit
gradients in fp32 at stage 0; `data_types.grad_accum_dtype` "fp32" (bf16's default there)
also sums the micro batches' gradients in fp32, in the masters' gradients. `compile`
{"enabled": true} compiles the module in place (zero/compiler.py).
"""

import contextlib
import logging
import operator
import os

import torch
import torch.distributed as dist

from zero.checkpoint import layout as ckpt
from zero.config.arguments import apply_mpi_environment, resolve_config_from_args
from zero.comm.agreement import parameters_fingerprint, require_agreement
from zero.comm.communicator import Communicator
from zero.comm.process_group import init_distributed
from zero.compiler import compile_module
from zero.config.deepspeed_config import DeepSpeedConfig
from zero.data_loader import micro_batch_loader
from zero.errors import ConfigError, ZeroError
from zero.host_memory import tune_host_allocator
from zero.monitor import Monitor
from zero.optim.lr_schedules import engine_lr_scheduler
from zero.optim.optimizers import build_optimizer, check_zero_supported
from zero.stages.build import build_zero_optimizer

logger = logging.getLogger("zero.engine")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None):
    """-> (engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)."""
    if model is None:
        raise ZeroError("zero.initialize requires a model (model=...)")
    if not isinstance(model, torch.nn.Module):
        raise ZeroError(f"zero.initialize: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if config is not None and config_params is not None:
        raise ConfigError("zero.initialize got both config= and config_params= (an alias of "
                          "config); pass only config=")
    source = resolve_config_from_args(args, config if config is not None else config_params)
    if args is not None and getattr(args, "deepspeed_mpi", False):
        apply_mpi_environment()
    init_distributed(dist_init_required=dist_init_required)
    engine = DeepSpeedEngine(model, source, optimizer=optimizer,
                             model_parameters=model_parameters, training_data=training_data,
                             lr_scheduler=lr_scheduler, mpu=mpu, collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


class DeepSpeedEngine(torch.nn.Module):
    """Wraps `model` for data-parallel training with ZeRO stages 0-3 (see module docstring)."""

    def __init__(self, model, config, optimizer=None, model_parameters=None, training_data=None,
                 lr_scheduler=None, mpu=None, collate_fn=None):
        super().__init__()
        # A torch DistributedDataParallel model reduces its own gradients (stage 0 only): the
        # engine keeps the wrapped module for everything else (parameters, checkpoints).
        self._ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
            else None
        self.module = model.module if self._ddp is not None else model
        self.mpu = mpu
        self._set_parallel_groups(mpu)
        self.config = config if isinstance(config, DeepSpeedConfig) \
            else DeepSpeedConfig(config, self.dp_world_size)
        if self.config.dp_world_size != self.dp_world_size:
            raise ConfigError(f"the DeepSpeedConfig was built for {self.config.dp_world_size} "
                              f"data-parallel ranks, but this run has {self.dp_world_size}")
        self._check_supported_features()
        self.global_steps = self.global_samples = self.skipped_steps = 0
        self._micro_steps = self._step_start = 0  # _step_start: micro_steps when the step began
        self._backwards = 0  # backward passes since then (no_sync's count, without step())
        # (train_batch_size, gradient_accumulation_steps): the config's until
        # set_train_batch_size changes them
        self._batch = (self.config.train_batch_size, self.config.gradient_accumulation_steps)
        self._step_applied = False  # the last step() updated the weights
        self._boundary_override = None  # set_gradient_accumulation_boundary's, if any
        self._inside_no_sync = False
        self.device = self._place_module()
        self.compiled = compile_module(self.module, self.config, self.global_rank)
        warning = tune_host_allocator(self.device, self.config.zero_optimization)
        if warning and self.global_rank == 0:
            logger.warning(warning)
        base_optimizer = self._base_optimizer(optimizer, model_parameters)
        self._check_data_parallel_ranks_agree(base_optimizer)
        self.optimizer = build_zero_optimizer(self, base_optimizer,
                                              module_reduces_gradients=self._ddp is not None)
        self._broadcast_from_first_dp_rank()
        self._load_hooks = self._follow_weight_loads()
        # (over the torch optimizer, whose param_groups the ZeroOptimizer steps)
        self.lr_scheduler = engine_lr_scheduler(self.config, self.optimizer.optimizer,
                                                lr_scheduler)
        self.training_dataloader = micro_batch_loader(
            training_data, collate_fn, self.train_micro_batch_size_per_gpu(),
            self.dataloader_drop_last(), self.dp_world_size, self.dp_rank)
        self.monitor = Monitor(self.config, self.global_rank)

    # ----- setup -----

    def _set_parallel_groups(self, mpu):
        initialized = dist.is_initialized()
        self.global_rank = dist.get_rank() if initialized else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.pp_comm = None  # the pipeline's stages: they share one norm and overflow
        self.pp_rank, self.pp_world_size = 0, 1
        if mpu is None:
            self.dp_comm, self.mp_comm, self.mp_rank, self.mp_world_size = \
                Communicator(None), None, 0, 1
        else:
            stages = getattr(mpu, "get_pipeline_model_parallel_world_size", lambda: 1)()
            if stages > 1:
                self.pp_comm = Communicator(mpu.get_pipeline_model_parallel_group())
                self.pp_rank = mpu.get_pipeline_model_parallel_rank()
                self.pp_world_size = stages
            self.dp_comm = Communicator(mpu.get_data_parallel_group())
            self.mp_rank = mpu.get_model_parallel_rank()
            self.mp_world_size = mpu.get_model_parallel_world_size()
            self.mp_comm = Communicator(mpu.get_model_parallel_group()) \
                if self.mp_world_size > 1 else None
        self.dp_world_size = self.dp_comm.world_size
        self.dp_rank = self.dp_comm.rank
        # DeepSpeed's model-parallel rank over pipeline stages and tensor slices (its
        # PipelineParallelGrid): what checkpoint files are named by
        self.checkpoint_rank = self.pp_rank * self.mp_world_size + self.mp_rank
        self.checkpoint_world_size = self.pp_world_size * self.mp_world_size

    def _check_data_parallel_ranks_agree(self, base_optimizer):
        """Ranks given different configs or models would hang in, or crash out of, their
        first collective, or drift apart silently: said before any collective."""
        hyper = [{k: v for k, v in group.items() if k != "params"}
                 for group in base_optimizer.param_groups]
        require_agreement({**self.config.settings_ranks_share(),
                           "the optimizer's param groups": hyper,
                           "the model's parameters (names, shapes, dtypes)":
                           parameters_fingerprint(self.module)}, self.dp_comm,
                          "zero.initialize: the data-parallel ranks must agree on what they train")

    def _check_supported_features(self):
        zero = self.config.zero_optimization
        if not zero.contiguous_gradients and zero.stage == 2:
            logger.info("zero_optimization.contiguous_gradients=false: stage 2 always reduces "
                        "through contiguous bucket buffers here; results are the same")

    def _place_module(self):
        """Move to this rank's GPU (if any) and cast to fp16/bf16, as DeepSpeed does."""
        device = torch.device("cpu")
        if torch.cuda.is_available() and (not dist.is_initialized()
                                          or dist.get_backend() == "nccl"):
            device = torch.device("cuda", torch.cuda.current_device())
            self.module.to(device)
        if self.config.fp16.enabled:
            self.module.half()
        elif self.config.bf16.enabled:
            self.module.bfloat16()
        return device

    def _base_optimizer(self, client_optimizer, model_parameters):
        if model_parameters is None:
            if not any(p.requires_grad for p in self.module.parameters()):
                logger.warning("zero.initialize: the model has no trainable parameters (every "
                               "one has requires_grad=False): it evaluates, backward() fails")
            model_parameters = self.module.parameters()
        else:
            model_parameters = list(model_parameters)  # a generator is read once: keep it
            if not model_parameters:
                raise ZeroError("zero.initialize: model_parameters is empty (a generator "
                                "already used up?); pass model.parameters() or leave it out")
        if client_optimizer is None:
            base = build_optimizer(self.config, model_parameters)
        else:
            if self.config.optimizer is not None:
                logger.warning("an optimizer was passed to initialize(); the config's "
                               "'optimizer' section (%s) is not used", self.config.optimizer.type)
            if not (hasattr(client_optimizer, "param_groups") or callable(client_optimizer)):
                raise ZeroError("zero.initialize: optimizer must be a torch.optim.Optimizer or "
                                "a callable that builds one from the parameters, got "
                                f"{type(client_optimizer).__name__} (name a type in the "
                                "config's 'optimizer' section instead)")
            base = client_optimizer if isinstance(client_optimizer, torch.optim.Optimizer) \
                else client_optimizer(model_parameters)
            if not hasattr(base, "param_groups"):
                raise ZeroError(f"zero.initialize: the optimizer callable returned "
                                f"{type(base).__name__}, not an optimizer")
        check_zero_supported(base, self.config)
        return base

    @torch.no_grad()
    def _broadcast_from_first_dp_rank(self):
        """Every data-parallel rank starts from DP rank 0's weights and buffers."""
        if self.dp_world_size == 1 or self.zero_optimization_stage() == 3:
            return  # (stage 3 partitions DP rank 0's values: zero/stages/build.py)
        flat_ptrs = set()
        for group in self.optimizer.groups:
            self.dp_comm.broadcast(group.flat)
            flat_ptrs.update(p.data_ptr() for p in group.params)
        for tensor in list(self.module.parameters()) + list(self.module.buffers()):
            if tensor.data_ptr() not in flat_ptrs:
                self.dp_comm.broadcast(tensor.data)
        self.optimizer.refresh_masters_from_model()

    def _follow_weight_loads(self):
        """Stages 0-2: weights loaded into the module after initialize (load_state_dict of the
        module, of any submodule or of the engine) reach the fp32 masters, which a step would
        otherwise copy back over them. A load that replaces parameters (assign=True) would
        leave the optimizer stepping tensors the module no longer uses: refused."""
        if self.zero_optimization_stage() == 3:
            return []
        known = {id(param) for param in self.module.parameters()}

        def loaded(module, _incompatible_keys):
            replaced = [name for name, param in module.named_parameters(recurse=False)
                        if id(param) not in known]
            if replaced:
                raise ZeroError(f"load_state_dict replaced the parameter(s) {replaced} of "
                                f"{type(module).__name__} (assign=True?); the ZeRO optimizer "
                                "holds the ones it replaced. Load without assign=True")
            self.optimizer.follow_loaded_weights()
        return [module.register_load_state_dict_post_hook(loaded)
                for module in self.module.modules()]

    # ----- training -----

    def forward(self, *inputs, **kwargs):
        with self.monitor.timed("forward"), self._forward_context():
            if self._ddp is None:
                return self.module(*inputs, **kwargs)
            # DDP decides in forward whether this backward all-reduces: at the boundary only
            self._ddp.require_backward_grad_sync = self.is_gradient_accumulation_boundary() \
                and not self._inside_no_sync
            return self._ddp(*inputs, **kwargs)

    def _forward_context(self):
        """Stage 3: autograd keeps re-gatherable references to saved parameters."""
        context = getattr(self.optimizer, "forward_context", None)
        return context() if context is not None else contextlib.nullcontext()

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True, *, grad=None,
                 reduce_gradients=None):
        """Backward of `loss` / gradient_accumulation_steps (x the loss scale); reduces the
        gradients over data parallel on the last micro-step (every micro-step in stage 2).
        The positional arguments are DeepSpeed's (`retain_graph` as in torch's backward).

        `grad`: a pipeline stage before the last backpropagates its output `loss` with the
        gradient the next stage sent, which already carries the loss scale and the division
        by the accumulation steps. `reduce_gradients`: a schedule that runs several backward
        passes per micro-step (model chunks) says which one reduces (stages 0 and 1)."""
        if grad is None:
            self.monitor.record_loss(loss)
            if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
                loss = loss / self.gradient_accumulation_steps()
        if reduce_gradients is None:
            reduce_gradients = self.is_gradient_accumulation_boundary() \
                and not self._inside_no_sync
        with self.monitor.timed("backward"):
            self.optimizer.backward(loss, reduce_gradients=reduce_gradients, grad=grad,
                                    retain_graph=retain_graph)
        self._backwards += 1
        return loss

    def is_gradient_accumulation_boundary(self):
        if self._boundary_override is not None:
            return self._boundary_override
        return self._micro_steps - self._step_start + 1 >= self.gradient_accumulation_steps()

    @property
    def micro_steps(self):
        return self._micro_steps

    @micro_steps.setter
    def micro_steps(self, value):
        """DeepSpeed's counter, which loops may set themselves: the current step then began at
        its last multiple of the accumulation steps, as DeepSpeed's boundary rule has it."""
        self._micro_steps = value
        self._step_start = value - value % self.gradient_accumulation_steps()

    def set_gradient_accumulation_boundary(self, is_boundary):
        """Override the micro-step count's answer (DeepSpeed's API, for loops that decide
        themselves which backward ends a step): set it before each forward/backward, True
        for the last one."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients without reducing them over data
        parallel; the first reducing backward after it (at the accumulation boundary) reduces
        them all. As DeepSpeed's: stages 0 and 1 only, no step() inside, not nested."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise ZeroError(f"no_sync() needs ZeRO stage 0 or 1: stage {stage} partitions the "
                            "gradients, which reduces them in every backward")
        if self._inside_no_sync:
            raise ZeroError("no_sync() is already active: it does not nest")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def was_step_applied(self):
        """Whether the last step() updated the weights: False between accumulation boundaries
        and for a step skipped on inf/nan gradients (fp16 overflow)."""
        return self._step_applied

    def step(self, lr_kwargs=None):
        """At an accumulation boundary: optimizer step (skipped on fp16 overflow), lr schedule
        (its step() takes `lr_kwargs`), counters. Call it after every backward."""
        if self._inside_no_sync:
            raise ZeroError("step() inside no_sync(): leave it and backpropagate the "
                            "accumulation boundary's micro-batch first, which reduces the "
                            "gradients")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            with self.monitor.timed("step"):
                applied = self.optimizer.step()
            if applied and self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            if not applied:
                self.skipped_steps += 1
            self._step_applied = bool(applied)
            self.optimizer.zero_grad()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.monitor.report(self)
        self._micro_steps += 1
        if boundary:
            self._step_start, self._backwards = self._micro_steps, 0

    def set_train_batch_size(self, train_batch_size):
        """DeepSpeed's: another global batch, by the number of micro batches a step takes
        (the micro batch stays). Between steps (Megatron-LM's batch-size ramp calls it before
        each iteration)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        size = None if isinstance(train_batch_size, bool) else _as_int(train_batch_size)
        if size is None or size <= 0 or size % per_step:
            raise ValueError(f"set_train_batch_size({train_batch_size!r}): the global batch must "
                             f"be a positive multiple of the micro batch x data-parallel size "
                             f"({self.train_micro_batch_size_per_gpu()} x {self.dp_world_size} "
                             f"= {per_step})")
        if self._backwards or self._micro_steps != self._step_start:
            raise ZeroError(f"set_train_batch_size() inside a step, after "
                            f"{max(self._backwards, self._micro_steps - self._step_start)} of "
                            "its micro batches' backward passes: call it before a step's "
                            "first forward")
        self._batch = (size, size // per_step)

    def zero_grad(self):
        self.optimizer.zero_grad()
        self._backwards = 0  # (their gradients are gone)

    @property
    def searching_initial_loss_scale(self):
        """fp16 with a dynamic scale and no step recorded yet: an overflow may be retried."""
        scaler = getattr(self.optimizer, "loss_scaler", None)
        return scaler is not None and scaler.searching_initial_scale

    def retry_skipped_step(self):
        """After a step skipped for fp16 overflow while the loss scaler is still looking for
        its first scale: take back the step's counters so the caller can run the same batches
        again at the lowered scale. False (nothing changed) when a retry is not worthwhile."""
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if scaler is None or not scaler.forget_overflow_step():
            return False
        self.skipped_steps -= 1
        self.global_steps -= 1
        self.global_samples -= self.train_batch_size()
        self._micro_steps -= self.gradient_accumulation_steps()
        self._step_start, self._backwards = self._micro_steps, 0
        return True

    def restore_progress(self, global_steps, global_samples, skipped_steps):
        """Set the step counters, e.g. from a checkpoint of another layout than DeepSpeed's
        (whose loads restore them themselves). Resuming happens at a step boundary."""
        self.global_steps, self.global_samples = int(global_steps), int(global_samples)
        self.skipped_steps = int(skipped_steps)
        self._micro_steps = self.global_steps * self.gradient_accumulation_steps()
        self._step_start, self._backwards = self._micro_steps, 0

    def destroy(self):
        """Remove the gradient hooks and whatever the optimizer keeps outside memory (NVMe swap
        files). The hooks live in C++, so garbage collection alone would not free the engine."""
        self.optimizer.remove_hooks()
        for handle in self._load_hooks:
            handle.remove()
        self._load_hooks = []
        close = getattr(self.optimizer, "close", None)
        if close is not None:
            close()

    # ----- queries (DeepSpeed's names) -----

    def train_batch_size(self):
        return self._batch[0]

    def train_micro_batch_size_per_gpu(self):
        return self.config.train_micro_batch_size_per_gpu

    def dataloader_drop_last(self):
        return self.config.dataloader_drop_last

    def gradient_accumulation_steps(self):
        return self._batch[1]

    def zero_optimization_stage(self):
        return self.config.zero_optimization.stage

    def fp16_enabled(self):
        return self.config.fp16.enabled

    def bfloat16_enabled(self):
        return self.config.bf16.enabled

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return self.optimizer.global_grad_norm

    @property
    def cur_scale(self):
        return self.optimizer.cur_scale

    @property
    def loss_scale(self):
        return self.optimizer.loss_scale

    # ----- checkpoints (zero/checkpoint/layout.py) -----

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        """Must be called on every rank. Returns True."""
        return ckpt.save_checkpoint(self, save_dir, tag, client_state or {}, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, *, agree=True):
        """-> (path, client_state); (None, None) when there is no tag and no `latest` file.
        The positional arguments are DeepSpeed's. `load_module_strict=False` loads the
        weights the checkpoint has for this model (others keep their values), as torch's
        load_state_dict(strict=False); the optimizer state, if loaded, must still fit.
        `agree=False`: a caller that has every rank agree on its whole load (the trainer)
        publishes the restored masters itself (zero/checkpoint/layout.py)."""
        return ckpt.load_checkpoint(self, load_dir, tag, module_strict=load_module_strict,
                                    optimizer_states=load_optimizer_states,
                                    lr_scheduler_states=load_lr_scheduler_states,
                                    module_only=load_module_only, agree=agree)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin"):
        return ckpt.save_16bit_model(self, save_dir, save_filename)

    save_fp16_model = save_16bit_model


def _as_int(value):
    """An int (numpy's and 0-dim tensors' too, through __index__), else None."""
    try:
        return operator.index(value)
    except TypeError:
        return None
