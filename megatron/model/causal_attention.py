"""Causal attention for compiled bf16 layers on the CPU: SDPA's flash forward, a fused backward.

torch's CPU flash-attention backward is slow in bf16 (several times its forward, and slower
than its own fp32 backward). At GPT-2's sequence lengths the scores of one layer fit in memory
easily, so the backward here recomputes them from q and k and the saved log-sum-exp, with five
batched matmuls and elementwise work that inductor fuses into a few passes: about half the time
of SDPA's forward + backward (docs/benchmarks.md). Forward is SDPA's flash kernel, which keeps
only its output and the [b, np, s] log-sum-exp for backward, as SDPA does.

The recomputed scores are bf16 products (torch's CPU bmm has no fp32 output for bf16 inputs),
so they differ from the forward's fp32 ones by bf16 rounding. The backward is therefore the
exact gradient of the softmax of the rounded scores, the attention Megatron's own bf16 path
computes: the probabilities are renormalised over each row and the softmax gradient uses their
own row sums, so the two stay consistent (the forward's log-sum-exp only shifts the exponent).
Larger problems than a cap keep SDPA: the backward holds a few [b, np, s, s] tensors.

Only worth it under torch.compile (eager, the unfused backward is slower than SDPA's), so
`transformer.attention` takes it inside a compiled layer only.
"""

import torch
from torch.autograd.function import once_differentiable

MAX_SCORES = 1 << 25  # b * np * s * s: 128 MiB per fp32 score tensor of the backward


def applies(query, is_causal, dropout_p):
    """Whether causal_attention takes this call: bf16 on the CPU, causal, no dropout, at most
    MAX_SCORES scores, inside a compiled region."""
    scores = query.shape[:-2].numel() * query.shape[-2] ** 2
    return (is_causal and dropout_p == 0.0 and query.dtype == torch.bfloat16
            and query.device.type == "cpu" and scores <= MAX_SCORES
            and torch.compiler.is_compiling())


def causal_attention(query, key, value):
    """softmax(q kᵀ / sqrt(hn) + causal mask) v over [b, np, s, hn] (the same as
    scaled_dot_product_attention(q, k, v, is_causal=True))."""
    return _CausalAttention.apply(query, key, value)


class _CausalAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query, key, value):
        output, log_sum_exp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, True)[:2]
        if log_sum_exp.shape != query.shape[:-1]:
            raise RuntimeError(f"flash attention's log-sum-exp is {tuple(log_sum_exp.shape)}, "
                               f"expected {tuple(query.shape[:-1])}")
        ctx.save_for_backward(query, key, value, log_sum_exp)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        query, key, value, log_sum_exp = ctx.saved_tensors
        scale = query.shape[-1] ** -0.5
        queries, keys = query.shape[-2], key.shape[-2]
        allowed = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril()
        scores = torch.matmul(query, key.transpose(-1, -2)).float()  # [b, np, s, s]
        unnormalised = torch.where(
            allowed, torch.exp(scores * scale - log_sum_exp.unsqueeze(-1)), 0.0)
        probs = unnormalised / unnormalised.sum(-1, keepdim=True)
        grad_value = torch.matmul(probs.to(value.dtype).transpose(-1, -2), grad_output)
        grad_probs = torch.matmul(grad_output, value.transpose(-1, -2)).float()
        # softmax backward: dS = P · (dP - rowsum(P · dP))
        row_dot = (probs * grad_probs).sum(-1, keepdim=True)
        grad_scores = (probs * (grad_probs - row_dot) * scale).to(query.dtype)
        grad_query = torch.matmul(grad_scores, key)
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), query)
        return grad_query, grad_key, grad_value
