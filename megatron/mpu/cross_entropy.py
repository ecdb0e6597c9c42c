"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

No rank ever holds the full [.., vocab] logits: three all-reduces of [..]-shaped tensors
(max, sum of exp, target logit) give the exact loss, and the gradient of each shard is
softmax - onehot restricted to that shard.
"""

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

        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            shifted.size(-1), get_model_parallel_rank(), get_model_parallel_world_size())
        target_outside = (target < vocab_start) | (target >= vocab_end)  # [*]
        local_target = (target - vocab_start).masked_fill_(target_outside, 0)
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


def vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    """Per-token loss, shaped like `target`, in fp32, from vocab-parallel logits.

    vocab_parallel_logits: [*, vocab / p] this rank's slice of the logits; target: [*] ids
    into the full vocabulary.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
