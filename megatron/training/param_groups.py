"""Megatron's optimizer parameter groups: no weight decay for biases and LayerNorm."""

import torch


def get_param_groups(model, weight_decay=0.01):
    """[decay group, no-decay group]: biases and LayerNorm parameters get no weight decay.

    A LayerNorm is any torch.nn.LayerNorm or a module whose class name ends in "LayerNorm"
    (custom or fused implementations). Empty groups are dropped; shared parameters counted once.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        is_layernorm = isinstance(module, torch.nn.LayerNorm) or \
            type(module).__name__.endswith("LayerNorm")
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if is_layernorm or name.endswith("bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
