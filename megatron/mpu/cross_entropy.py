"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

No rank ever holds the full [.., vocab] logits: three all-reduces of [..]-shaped tensors
(max, sum of exp, target logit) give the exact loss, and the gradient of each shard is
softmax - onehot restricted to that shard.

Passes over the [*, v/p] logits are what cost time here. Two ways to take them, by what
measured faster on the CPU:
  * fp32 logits (and any logits off the CPU): one fp32 working copy, updated in place and
    kept for backward, whose exp it reuses (_VocabParallelCrossEntropy);
  * 16-bit logits on the CPU: an fp32 copy of the whole tensor costs more than the arithmetic
    (it does not fit in the cache), so both directions walk the logits in chunks of rows
    whose fp32 working copy does, and backward recomputes the softmax from the saved 16-bit
    logits instead of keeping an fp32 copy (_ChunkedVocabParallelCrossEntropy; faster in bf16
    and half the memory kept for backward: docs/benchmarks.md). Each rank sums exp relative to its
    own max, so max and sum take one pass; the sums are then rescaled to the global max M:
    sum_r exp(m_r - M) s_r.
"""

import torch
import torch.distributed as dist

from megatron.mpu.initialize import (get_model_parallel_group, get_model_parallel_rank,
                                     get_model_parallel_world_size)
from megatron.mpu.utils import VocabUtility

_CPU_CHUNK_ELEMENTS = 1 << 19  # a 2 MiB fp32 working copy per chunk of rows


def _all_reduce_(tensor, op):
    if get_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=get_model_parallel_group())
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    # The fp32 working copy is made once and then updated in place. (Mixed-dtype ops with
    # out= are not vectorised on CPU: a cast followed by in-place ops is about twice as fast.)

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


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        local_target, target_outside = _local_target(target, vocab_parallel_logits.size(-1))
        local_max, sum_exp, target_logit = _loss_terms(vocab_parallel_logits, local_target,
                                                       target_outside)  # [*] fp32 each
        global_max = _all_reduce_(local_max.clone(), dist.ReduceOp.MAX)
        sum_exp = _all_reduce_(sum_exp.mul_((local_max - global_max).exp_()),
                               dist.ReduceOp.SUM)
        target_logit = _all_reduce_(target_logit, dist.ReduceOp.SUM)
        log_sum_exp = global_max.add_(sum_exp.log_())
        ctx.save_for_backward(vocab_parallel_logits, log_sum_exp, local_target, target_outside)
        return log_sum_exp - target_logit

    @staticmethod
    def backward(ctx, grad_output):
        return _logits_grad(*ctx.saved_tensors, grad_output), None


def _local_target(target, partition_vocab_size):
    """(target as an index into this rank's vocabulary slice, 0 where it is outside; the
    [*] bool mask of targets outside this rank's slice)."""
    vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        partition_vocab_size, get_model_parallel_rank(), get_model_parallel_world_size())
    target_outside = (target < vocab_start) | (target >= vocab_end)  # [*]
    return (target - vocab_start).masked_fill_(target_outside, 0), target_outside


def _row_chunks(logits):
    """(logits as [n, v/p] rows, the row ranges of its chunks)."""
    rows = logits.reshape(-1, logits.size(-1))
    per_chunk = max(1, _CPU_CHUNK_ELEMENTS // max(1, rows.size(1)))
    return rows, [(start, min(start + per_chunk, rows.size(0)))
                  for start in range(0, rows.size(0), per_chunk)]


def _fp32_copy(tensor):
    """A new fp32 tensor (.float() of an fp32 tensor is the tensor itself, which the in-place
    arithmetic here must not touch)."""
    return tensor.to(torch.float32, copy=True)


def _loss_terms(logits, local_target, target_outside):
    """One pass over this rank's slice: (its max logit; the sum of exp(logit - that max);
    the target's logit, 0 where the target is on another rank), each [*] fp32."""
    rows, chunks = _row_chunks(logits)
    local_max, sum_exp, target_logit = (torch.empty(rows.size(0), device=rows.device)
                                        for _ in range(3))
    index = local_target.reshape(-1, 1)
    for start, end in chunks:
        chunk = _fp32_copy(rows[start:end])
        chunk_max = chunk.amax(dim=-1)
        local_max[start:end] = chunk_max
        target_logit[start:end] = chunk.gather(-1, index[start:end]).squeeze(-1)
        sum_exp[start:end] = chunk.sub_(chunk_max.unsqueeze(-1)).exp_().sum(dim=-1)
    target_logit.masked_fill_(target_outside.reshape(-1), 0.0)
    return tuple(t.view(local_target.shape) for t in (local_max, sum_exp, target_logit))


def _logits_grad(logits, log_sum_exp, local_target, target_outside, grad_output):
    """grad_output * (softmax - onehot(target)) over this rank's slice, in the logits'
    dtype; softmax = exp(logit - log_sum_exp), the log-sum-exp over the whole vocabulary."""
    rows, chunks = _row_chunks(logits)
    grad = torch.empty_like(rows)
    lse, index = log_sum_exp.reshape(-1, 1), local_target.reshape(-1, 1)
    scale = grad_output.reshape(-1, 1).float()
    at_target = scale.neg().masked_fill_(target_outside.reshape(-1, 1), 0.0)  # the -onehot
    for start, end in chunks:
        chunk = _fp32_copy(rows[start:end]).sub_(lse[start:end]).exp_().mul_(scale[start:end])
        grad[start:end] = chunk.scatter_add_(-1, index[start:end], at_target[start:end])
    return grad.view(logits.shape)


def vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    """Per-token loss, shaped like `target`, in fp32, from vocab-parallel logits.

    vocab_parallel_logits: [*, vocab / p] this rank's slice of the logits; target: [*] ids
    into the full vocabulary.
    """
    chunked = vocab_parallel_logits.device.type == "cpu" and \
        vocab_parallel_logits.dtype in (torch.bfloat16, torch.float16)
    function = _ChunkedVocabParallelCrossEntropy if chunked else _VocabParallelCrossEntropy
    return function.apply(vocab_parallel_logits, target)
