"""GPT-2 architecture (no optimizer, I/O or logging).

The names below are imported when first used, so that `megatron.model.shape` (the named
sizes and the shape checks the trainer's config runs) loads without torch.
"""

import importlib

_EXPORTS = {
    "megatron.model.gpt2_model": ("GPT2Model", "GPTConfig", "flops_per_token", "num_parameters"),
    "megatron.model.language_model": ("parallel_lm_logits",),
    "megatron.model.shape": ("MODEL_SIZES",),
    "megatron.model.utils": ("get_ltor_masks_and_position_ids",
                             "param_groups_for_weight_decay"),
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
