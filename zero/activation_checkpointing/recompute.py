"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`).

    from zero import checkpointing
    checkpointing.configure(mpu, deepspeed_config="ds_config.json")  # or keyword options
    checkpointing.model_parallel_cuda_manual_seed(seed)
    hidden = checkpointing.checkpoint(layer_chunk, hidden, mask)

`checkpoint(function, *args)` runs `function` without keeping its activations and runs it
again in backward. Only the inputs are kept, and how is configured:

    partition_activations   each tensor-parallel rank keeps 1/TP of every floating input
                            (inputs between layers are replicated over the TP group); they are
                            all-gathered before recompute. With TP = 1 this changes nothing.
    checkpoint_in_cpu       kept inputs live in host memory (pinned when on CUDA)
    contiguous_checkpointing   kept inputs are rows of one preallocated buffer per argument
                            position, sized by num_checkpoints (required)
    synchronize             device synchronize at the entry and exit of every checkpoint
    profile                 measure forward / recompute / backward time of every checkpoint and
                            print them (rank 0) after each backward pass

The CPU, device and tracked RNG states are captured at forward and restored for the
recompute, so dropout draws identical masks and the gradients equal those without
checkpointing bit for bit. It is a reentrant autograd.Function, as DeepSpeed's is: at least one
input must require grad (else parameter gradients inside would be lost), and
`torch.autograd.grad` cannot go through it.

`mpu_` is anything with Megatron's mpu functions (get_model_parallel_rank/world_size/group, or
the get_tensor_model_parallel_* spellings); None means no tensor parallelism.
"""

import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from zero.activation_checkpointing.storage import (ContiguousBuffers, Stashed, StoragePlan, stash,
                                                   unstash)
from zero.errors import ConfigError
from zero.activation_checkpointing.rng_tracker import (  # noqa: F401
    MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker,
                              get_rng_states, seed_model_parallel, set_rng_states)

_OPTION_KEYS = {  # configure() argument -> activation_checkpointing key
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}


@dataclass
class CheckpointingOptions:
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: Optional[int] = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


@dataclass
class _State:
    configured: bool = False
    mpu: Optional[object] = None
    options: CheckpointingOptions = field(default_factory=CheckpointingOptions)
    buffers: Optional[ContiguousBuffers] = None
    live: int = 0  # checkpoints whose backward has not run yet
    next_index: int = 0  # forward order within the current forward/backward; contiguous slot
    profile: dict = field(default_factory=dict)  # index -> {"forward": ms, ...}
    last_profile: list = field(default_factory=list)


_STATE = _State()
_RNG_TRACKER = CudaRNGStatesTracker()


def configure(mpu_, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None):
    """Set the options: all off, then the config's activation_checkpointing section (a dict,
    a path to a JSON file, or a DeepSpeedConfig), then the arguments that are not None."""
    options = _options_from_config(deepspeed_config)
    given = dict(partition_activations=partition_activations,
                 contiguous_checkpointing=contiguous_checkpointing,
                 num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu,
                 synchronize=synchronize, profile=profile)
    for name, value in given.items():
        if value is not None:
            setattr(options, name, value)
    _check_options(options)
    _STATE.configured, _STATE.mpu, _STATE.options = True, mpu_, options
    _STATE.buffers = ContiguousBuffers(options.num_checkpoints) \
        if options.contiguous_checkpointing else None
    _start_new_pass()


def _options_from_config(deepspeed_config):
    options = CheckpointingOptions()
    if deepspeed_config is None:
        return options
    section = getattr(deepspeed_config, "activation_checkpointing", None)
    if section is None:
        from zero.config.deepspeed_config import load_config_dict
        from zero.config.parsing import parse_section
        from zero.config.sections import ActivationCheckpointingConfig
        raw, source = load_config_dict(deepspeed_config)
        section = parse_section(ActivationCheckpointingConfig,
                                raw.get("activation_checkpointing") or {}, source,
                                "activation_checkpointing")
    for name, key in _OPTION_KEYS.items():
        setattr(options, name, getattr(section, key))
    return options


def _check_options(options):
    n = options.num_checkpoints
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"activation checkpointing: num_checkpoints "
                          f"('number_checkpoints') must be a positive integer, got {n!r}")
    if options.contiguous_checkpointing and n is None:
        raise ConfigError("activation checkpointing: contiguous checkpointing "
                          "('contiguous_memory_optimization') preallocates one buffer row per "
                          "checkpoint and needs num_checkpoints ('number_checkpoints'): the "
                          "number of checkpoints in one forward, e.g. layers / "
                          "checkpoint-num-layers")


def is_configured():
    return _STATE.configured


def get_options():
    """The options in force (a copy)."""
    return CheckpointingOptions(**vars(_STATE.options))


def unconfigure():
    """Back to the state before configure() (our extension: tests build and tear down)."""
    global _STATE
    _STATE = _State()


def reset():
    """Forget checkpoints whose backward will never run (e.g. forwards under grad in eval),
    so the contiguous buffer rows can be handed out again."""
    _start_new_pass()


def _start_new_pass():
    _STATE.live, _STATE.next_index, _STATE.profile = 0, 0, {}


def get_cuda_rng_tracker():
    """The process-wide tracker whose streams checkpoint() replays."""
    return _RNG_TRACKER


def model_parallel_cuda_manual_seed(seed):
    """Default generators: `seed`; tracked "model-parallel-rng": seed + 2718 + TP rank."""
    seed_model_parallel(_RNG_TRACKER, seed, _tensor_parallel()[0])


def _tensor_parallel():
    """(rank, size, group) of the tensor-parallel group of the configured mpu."""
    mpu = _STATE.mpu
    if mpu is None:
        return 0, 1, None
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        if hasattr(mpu, prefix + "rank"):
            size = getattr(mpu, prefix + "world_size")()
            if size == 1:  # no group needed (and a single process may have none)
                return 0, 1, None
            return getattr(mpu, prefix + "rank")(), size, getattr(mpu, prefix + "group")()
    raise TypeError(f"mpu {mpu!r} has neither get_model_parallel_rank nor "
                    "get_tensor_model_parallel_rank")


def _storage_plan():
    tp_rank, tp_size, tp_group = _tensor_parallel()
    options = _STATE.options
    return StoragePlan(partition=options.partition_activations and tp_size > 1,
                       tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                       to_cpu=options.checkpoint_in_cpu, buffers=_STATE.buffers)


def checkpoint(function, *args):
    """function(*args) now without keeping its activations; recomputed in backward."""
    tensors = [a for a in args if torch.is_tensor(a)]
    if not torch.is_grad_enabled():  # nothing will run backward: nothing to keep
        return function(*args)
    if not any(t.requires_grad for t in tensors):
        warnings.warn("zero.checkpointing.checkpoint: no input requires grad, so gradients of "
                      "the parameters inside the checkpoint will be None")
    outputs = CheckpointFunction.apply(function, *args)
    return outputs


class CheckpointFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, run_function, *args):
        options, plan = _STATE.options, _storage_plan()
        index = _STATE.next_index
        if options.contiguous_checkpointing and index >= options.num_checkpoints:
            raise RuntimeError(
                f"contiguous activation checkpointing: checkpoint {index + 1} in one forward, "
                f"but num_checkpoints ('number_checkpoints') is {options.num_checkpoints}; "
                "raise it, or call zero.checkpointing.reset() after forwards without backward")
        _STATE.next_index, _STATE.live = index + 1, _STATE.live + 1
        device = next((a.device for a in args if torch.is_tensor(a)), torch.device("cpu"))
        _synchronize(options.synchronize or options.profile, device)
        start = time.perf_counter()
        ctx.run_function, ctx.index, ctx.plan, ctx.device = run_function, index, plan, device
        ctx.rng_states, ctx.tracker_states = get_rng_states(), _RNG_TRACKER.get_states()
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.layout, kept = [], []
        for position, arg in enumerate(args):
            if torch.is_tensor(arg):
                stashed = stash(arg, position, index, plan)
                kept.append(stashed.kept)
                stashed.kept = None  # ctx.saved_tensors holds it (and saved-tensor hooks see it)
                ctx.layout.append(stashed)
            else:
                ctx.layout.append(arg)
        ctx.save_for_backward(*kept)
        single = torch.is_tensor(outputs)
        for out in ((outputs,) if single else outputs):
            if torch.is_tensor(out) and not out.is_floating_point():
                ctx.mark_non_differentiable(out)
        _synchronize(options.synchronize or options.profile, device)
        _record(index, "forward", start)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad() or with an "
                               "`inputs` argument to .backward(); use .backward()")
        options = _STATE.options
        _synchronize(options.synchronize or options.profile, ctx.device)
        start = time.perf_counter()
        kept = iter(ctx.saved_tensors)
        inputs = []
        for item in ctx.layout:
            if isinstance(item, Stashed):
                item.kept = next(kept)
                inputs.append(unstash(item, ctx.plan))
                item.kept = None
            else:
                inputs.append(item)
        after_forward, after_tracker = get_rng_states(), _RNG_TRACKER.get_states()
        set_rng_states(ctx.rng_states)
        _RNG_TRACKER.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            set_rng_states(after_forward)
            _RNG_TRACKER.set_states(after_tracker)
        _synchronize(options.profile, ctx.device)
        start = _record(ctx.index, "recompute", start)
        outputs = (outputs,) if torch.is_tensor(outputs) else outputs
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _synchronize(options.synchronize or options.profile, ctx.device)
        _record(ctx.index, "backward", start)
        _finish_checkpoint()
        input_grads = tuple(i.grad if torch.is_tensor(i) else None for i in inputs)
        return (None,) + input_grads


def _synchronize(enabled, device):
    """A device barrier (CUDA); CPU kernels are synchronous already."""
    if enabled and device.type == "cuda":
        torch.cuda.synchronize(device)


def _record(index, phase, start):
    """Store the milliseconds since `start` when profiling; return now."""
    now = time.perf_counter()
    if _STATE.options.profile:
        _STATE.profile.setdefault(index, {})[phase] = (now - start) * 1e3
    return now


def _finish_checkpoint():
    """One more backward done; after the last of a pass, report and start a new pass."""
    _STATE.live = max(_STATE.live - 1, 0)
    if _STATE.live:
        return
    if _STATE.options.profile:
        _STATE.last_profile = [dict(index=i, **_STATE.profile[i]) for i in sorted(_STATE.profile)]
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(format_profile(_STATE.last_profile), flush=True)
    _start_new_pass()


def last_profile():
    """[{index, forward, recompute, backward} in ms] of the last completed backward pass."""
    return list(_STATE.last_profile)


def format_profile(records):
    cells = " | ".join(f"{r['index']}: {r.get('forward', 0):.2f}/{r.get('recompute', 0):.2f}/"
                       f"{r.get('backward', 0):.2f}" for r in records)
    return f" activation checkpoint times (ms, forward/recompute/backward): {cells}"
