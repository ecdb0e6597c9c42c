"""The DeepSpeed JSON's "compile" section: torch.compile of the engine's module, in place.

A module with a `compile` method of its own decides what is compiled (the GPT-2 model
compiles each transformer layer, or on a lone GPU its stack of layers as one region); when
that method takes `gradients_per_layer`, it is told whether the engine frees or offloads each
parameter's gradient during backward (ZeRO stage 2, optimizer offload), which one region
would hand out only at its end. Any other module is compiled whole by nn.Module.compile.
Either way parameter names and state-dict keys do not change. Compiling
happens at the first forward and backward; inductor caches what it builds on disk
(TORCHINDUCTOR_CACHE_DIR, by default under the system's temporary folder), so a second run of
the same shapes loads it instead of compiling again.
"""

import inspect
import logging
import os

logger = logging.getLogger("zero.engine")

# dynamo's timers that cover a whole compile: forward (with the joint graph) and the
# backward compiled at the first backward pass
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_module(module, config, rank):
    """Compile `module` as the "compile" section of `config` (a DeepSpeedConfig) asks;
    returns whether it did.

    ZeRO stage 3 keeps the module eager, said once: its forward hooks gather each
    submodule's parameters into new storage, so torch.compile recompiles at every layer until
    it reaches its recompile limit and then runs eagerly anyway, with warnings."""
    section, zero = config.compile, config.zero_optimization
    if not section.enabled:
        return False
    if zero.stage == 3:
        if rank == 0:
            logger.warning("compile: the model runs eagerly at ZeRO stage 3 (its module hooks "
                           "gather every parameter into new storage, which makes torch.compile "
                           "recompile at each layer); use stage 0-2 to compile")
        return False
    kwargs = dict(section.kwargs)
    if "gradients_per_layer" in inspect.signature(module.compile).parameters:
        kwargs["gradients_per_layer"] = takes_gradients_per_layer(zero)
    module.compile(backend=section.backend, **kwargs)
    return True


def takes_gradients_per_layer(zero):
    """Whether the engine moves each gradient out of the model during backward, given the
    "zero_optimization" section: stage 2 copies it into a bucket and frees it; optimizer
    offload (stages 1-2 here, since stage 3 does not compile) copies each bucket to the host."""
    return zero.stage == 2 or zero.offload_optimizer is not None


def compile_seconds():
    """Seconds torch.compile has spent compiling in this process (None if torch no longer
    keeps that count where this looks)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return None
    return sum(sum(compilation_time_metrics.get(name, ())) for name in _COMPILE_TIMERS)


def cache_dir():
    """Where inductor keeps compiled code between runs (looked up, not created)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.path.abspath(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        return default_cache_dir()
    except ImportError:
        return "torch's default cache folder"
