"""zero: a self-contained, DeepSpeed-compatible training engine (torch and numpy only).

`zero.initialize(...)` gives what `deepspeed.initialize(...)` gives; DeepSpeed JSON configs
and the `--deepspeed`/`--deepspeed_config` flags work unchanged. zero never imports megatron.

The names below are imported when first used, so that `zero.config.arguments` and
`zero.errors` (what a command line needs to be parsed) load without torch.
"""

import importlib

_EXPORTS = {
    "zero.config.arguments": ("add_config_arguments", "resolve_config_from_args"),
    "zero.config.deepspeed_config": ("DeepSpeedConfig",),
    "zero.errors": ("CallError", "CheckpointError", "ConfigError", "ZeroError"),
    "zero.optim.loss_scaler": ("DynamicLossScaler", "StaticLossScaler", "build_loss_scaler"),
    "zero.optim.lr_schedules": ("LRRangeTest", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
                                "build_lr_scheduler"),
    "zero.optim.optimizers": ("build_optimizer",),
    "zero.tiling": ("TiledLinear", "TiledLinearReturnBias"),
    "zero.stages.gathered_parameters": ("GatheredParameters",),
    "zero.stages.partition_parameters": ("Init", "register_external_parameter",
                                         "unregister_external_parameter"),
    "zero.engine": ("initialize",),
    "zero.comm.process_group": ("init_distributed",),
    "zero.checkpoint.zero_to_fp32": ("convert_zero_checkpoint_to_fp32_state_dict",
                                     "get_fp32_state_dict_from_zero_checkpoint",
                                     "load_state_dict_from_zero_checkpoint"),
}
# and `checkpointing`, deepspeed.checkpointing's name: a submodule (zero/checkpointing.py)
__all__ = sorted(name for names in _EXPORTS.values() for name in names) + ["checkpointing"]


def _load_everything():
    """The package as it is when all of it is imported: every export, and (as a side effect
    of those imports) the subpackages and modules they use as attributes."""
    for module, names in _EXPORTS.items():
        loaded = importlib.import_module(module)
        globals().update({name: getattr(loaded, name) for name in names})


def __getattr__(name):
    """The first use of any name but the command line's modules loads the whole package."""
    _load_everything()
    if name in globals():
        return globals()[name]
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as missing:
        if missing.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(__all__))
