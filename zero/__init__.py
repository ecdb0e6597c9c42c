"""zero: a self-contained, DeepSpeed-compatible training engine (torch and numpy only).

`zero.initialize(...)` gives what `deepspeed.initialize(...)` gives; DeepSpeed JSON configs
and the `--deepspeed`/`--deepspeed_config` flags work unchanged. zero never imports megatron.

The names below are imported when first used, so that `zero.config` and `zero.errors` (what a
command line needs to be checked) load without torch.
"""

import importlib

_EXPORTS = {
    "zero.config.arguments": ("add_config_arguments", "resolve_config_from_args"),
    "zero.config.deepspeed_config": ("DeepSpeedConfig",),
    "zero.errors": ("CheckpointError", "ConfigError", "ZeroError"),
    "zero.optim.loss_scaler": ("DynamicLossScaler", "StaticLossScaler", "build_loss_scaler"),
    "zero.optim.lr_schedules": ("LRRangeTest", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
                                "build_lr_scheduler"),
    "zero.optim.optimizers": ("build_optimizer",),
    "zero.tiling": ("TiledLinear", "TiledLinearReturnBias"),
    "zero.stages.partition_parameters": ("GatheredParameters", "Init",
                                         "register_external_parameter",
                                         "unregister_external_parameter"),
    "zero.engine": ("initialize",),
    "zero.checkpoint.zero_to_fp32": ("convert_zero_checkpoint_to_fp32_state_dict",
                                     "get_fp32_state_dict_from_zero_checkpoint",
                                     "load_state_dict_from_zero_checkpoint"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
# deepspeed.checkpointing's name for the activation-checkpointing package
_ALIASES = {"checkpointing": "zero.activation_checkpointing"}
__all__ = sorted(_HOME) + sorted(_ALIASES)


def __getattr__(name):
    """An exported name, an alias, or a submodule (`zero.stages` after `import zero`)."""
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    elif name in _ALIASES:
        value = importlib.import_module(_ALIASES[name])
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as missing:
            if missing.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
