"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

No rank ever holds the full [.., vocab] logits: three all-reduces of [..]-shaped tensors
(max, sum of exp, target logit) give the exact loss, and the gradient of each shard is
softmax - onehot restricted to that shard.

Two implementations of the same loss: eager (the default) makes one fp32 working copy of the
logits and updates it in place; fused (`compile_cross_entropy_kernels`, used by a compiled
model) keeps the logits as they are and runs two compiled kernels over them, one for the loss
and one for the gradient, each a single pass.
"""

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from megatron.mpu.initialize import (get_model_parallel_group, get_model_parallel_rank,
                                     get_model_parallel_world_size)
from megatron.mpu.utils import VocabUtility


def _all_reduce_(tensor, op):
    if get_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=get_model_parallel_group())
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    # Passes over the [*, v/p] logits are what cost time here, so the fp32 working copy is
    # made once and then updated in place.  (Mixed-dtype ops with out= are not vectorised
    # on CPU: a cast followed by in-place ops is about twice as fast.)

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        # vocab_parallel_logits: [*, v/p] in any float dtype; target: [*] global token ids.
        logits_max = torch.amax(vocab_parallel_logits, dim=-1).float()  # [*]
        _all_reduce_(logits_max, dist.ReduceOp.MAX)
        if vocab_parallel_logits.dtype == torch.float32:
            # A new tensor: the caller's logits are never modified.
            shifted = vocab_parallel_logits - logits_max.unsqueeze(-1)
        else:
            shifted = vocab_parallel_logits.float().sub_(logits_max.unsqueeze(-1))

        local_target, target_outside = _local_target(target, shifted.size(-1))
        predicted_logits = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted_logits.masked_fill_(target_outside, 0.0)
        _all_reduce_(predicted_logits, dist.ReduceOp.SUM)

        exp_logits = shifted.exp_()
        sum_exp_logits = _all_reduce_(exp_logits.sum(dim=-1), dist.ReduceOp.SUM)  # [*]
        loss = torch.log(sum_exp_logits) - predicted_logits

        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(exp_logits, sum_exp_logits, target_outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        exp_logits, sum_exp_logits, target_outside, local_target = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(target) = (exp - sum_exp * onehot) / sum_exp.
        # Computed in fp32 in the saved storage, then cast to the logits' dtype.
        on_this_rank = sum_exp_logits.masked_fill(target_outside, 0.0)
        exp_logits.scatter_add_(-1, local_target.unsqueeze(-1), -on_this_rank.unsqueeze(-1))
        scale = (grad_output / sum_exp_logits).unsqueeze(-1)  # [*, 1]
        return exp_logits.mul_(scale).to(ctx.input_dtype), None


def _local_target(target, partition_vocab_size):
    """(target as an index into this rank's vocabulary slice, 0 where it is outside; the
    [*] bool mask of targets outside this rank's slice)."""
    vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        partition_vocab_size, get_model_parallel_rank(), get_model_parallel_world_size())
    target_outside = (target < vocab_start) | (target >= vocab_end)  # [*]
    return (target - vocab_start).masked_fill_(target_outside, 0), target_outside


class CrossEntropyKernels(NamedTuple):
    """The fused loss's two passes over the [*, v/p] logits (see _loss_terms, _logits_grad)."""
    loss_terms: Callable
    logits_grad: Callable


def _loss_terms(logits, local_target, target_outside):
    """One pass over this rank's slice: (its max logit; the sum of exp(logit - that max);
    the target's logit, 0 where the target is on another rank), each [*] fp32."""
    logits = logits.float()
    local_max = logits.amax(dim=-1)
    sum_exp = (logits - local_max.unsqueeze(-1)).exp().sum(dim=-1)
    target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    return local_max, sum_exp, target_logit.masked_fill(target_outside, 0.0)


def _logits_grad(logits, log_sum_exp, local_target, target_outside, grad_output):
    """grad_output * (softmax - onehot(target)) over this rank's slice, in the logits' dtype;
    softmax = exp(logit - log_sum_exp), the log-sum-exp over the whole vocabulary."""
    softmax = (logits.float() - log_sum_exp.unsqueeze(-1)).exp()
    vocab = torch.arange(logits.size(-1), device=logits.device)
    onehot = (vocab == local_target.unsqueeze(-1)) & ~target_outside.unsqueeze(-1)
    grad = grad_output.unsqueeze(-1)
    return (softmax * grad - torch.where(onehot, grad, 0.0)).to(logits.dtype)


def compile_cross_entropy_kernels(*args, **kwargs):
    """CrossEntropyKernels through torch.compile (its arguments pass through)."""
    return CrossEntropyKernels(torch.compile(_loss_terms, *args, **kwargs),
                               torch.compile(_logits_grad, *args, **kwargs))


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    # Saves the logits themselves (16-bit under bf16/fp16) instead of an fp32 exp copy: the
    # gradient kernel recomputes the softmax in the same pass that writes the gradient. Each
    # rank sums exp relative to its own max, so max and sum take one pass; the sums are then
    # rescaled to the global max: sum_r exp(m_r - M) * s_r.

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, kernels):
        local_target, target_outside = _local_target(target, vocab_parallel_logits.size(-1))
        local_max, sum_exp, target_logit = kernels.loss_terms(
            vocab_parallel_logits, local_target, target_outside)  # [*] each
        global_max = _all_reduce_(local_max.clone(), dist.ReduceOp.MAX)
        sum_exp = _all_reduce_(sum_exp * (local_max - global_max).exp(), dist.ReduceOp.SUM)
        target_logit = _all_reduce_(target_logit, dist.ReduceOp.SUM)
        log_sum_exp = global_max + torch.log(sum_exp)
        ctx.kernels = kernels
        ctx.save_for_backward(vocab_parallel_logits, log_sum_exp, local_target, target_outside)
        return log_sum_exp - target_logit

    @staticmethod
    def backward(ctx, grad_output):
        return ctx.kernels.logits_grad(*ctx.saved_tensors, grad_output), None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, kernels=None):
    """Per-token loss, shaped like `target`, in fp32, from vocab-parallel logits.

    vocab_parallel_logits: [*, vocab / p] this rank's slice of the logits; target: [*] ids
    into the full vocabulary. kernels: CrossEntropyKernels for the fused form (None: eager).
    """
    if kernels is None:
        return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
    return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, kernels)
