"""Gradient norm and clipping that see the whole model across tensor-parallel ranks.

A tensor-parallel parameter holds a different shard on every rank, so its gradient counts on
every rank; a replicated parameter (LayerNorm, row-parallel bias, position embedding) holds
the same gradient everywhere and counts once (on tensor-parallel rank 0).  The partial sums
are all-reduced over the tensor-parallel group (MAX for the inf-norm), so every rank gets the
norm of the full, unsharded gradient.  Gradients are assumed already averaged over data
parallel ranks.
"""

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from zero.comm.agreement import collective_device
from megatron.mpu.initialize import (get_model_parallel_group, get_model_parallel_rank,
                                     get_model_parallel_world_size)


def _grads_by_device_and_dtype(grads):
    groups = defaultdict(list)
    for grad in grads:
        groups[(grad.device, grad.dtype)].append(grad)
    return groups.values()


def _local_norm_contribution(grads, norm_type):
    """sum |g|^p over `grads` (max |g| for p = inf) as an fp32 tensor."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    partials = []
    for group in _grads_by_device_and_dtype(grads):
        norms = torch._foreach_norm(group, norm_type, dtype=torch.float32)
        norms = torch.stack(norms)
        partials.append(norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum())
    device = partials[0].device  # combine across devices on the first one
    partials = torch.stack([p.to(device) for p in partials])
    return partials.max() if math.isinf(norm_type) else partials.sum()


def get_grad_norm(parameters, norm_type=2):
    """The norm of the full model's gradient (a float), identical on every rank."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    count_replicated = get_model_parallel_rank() == 0
    grads = [p.grad for p in parameters if p.grad is not None
             and (getattr(p, "model_parallel", False) or count_replicated)]
    total = _local_norm_contribution(grads, norm_type)
    if get_model_parallel_world_size() > 1:
        total = total.to(collective_device(get_model_parallel_group()))
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=get_model_parallel_group())
    if math.isinf(norm_type):
        return total.item()
    return total.item() ** (1.0 / norm_type)


def clip_grad_norm(parameters, max_norm, norm_type=2):
    """Scale gradients in place so their global norm is at most `max_norm`; return the norm.

    The returned norm is the one before clipping, like torch.nn.utils.clip_grad_norm_.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    total_norm = get_grad_norm(parameters, norm_type)
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1.0:
        for group in _grads_by_device_and_dtype([p.grad for p in parameters]):
            torch._foreach_mul_(group, clip_coef)
    return total_norm
