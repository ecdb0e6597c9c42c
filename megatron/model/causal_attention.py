"""Causal attention for compiled bf16 layers on the CPU: SDPA's flash forward, a fused backward.

torch's CPU flash-attention backward is slow in bf16 (several times its forward, and slower
than its own fp32 backward). At GPT-2's sequence lengths the scores of one layer fit in memory
easily, so the backward here recomputes them from q and k and the saved log-sum-exp, with five
batched matmuls and elementwise work that inductor fuses into a few passes: about half the time
of SDPA's forward + backward (docs/benchmarks.md). Forward is SDPA's flash kernel, which keeps
only its output and the [b, np, s] log-sum-exp for backward, as SDPA does. Scores, softmax and
the softmax gradient are computed in fp32 from the bf16 products, as the flash kernel does.

Only worth it under torch.compile (eager, the unfused backward is slower than SDPA's), so
`transformer.attention` takes it inside a compiled layer only.
"""

import torch


def applies(query, is_causal, dropout_p):
    """Whether causal_attention takes this call: bf16 on the CPU, causal, no dropout, inside
    a compiled region."""
    return (is_causal and dropout_p == 0.0 and query.dtype == torch.bfloat16
            and query.device.type == "cpu" and torch.compiler.is_compiling())


def causal_attention(query, key, value):
    """softmax(q kᵀ / sqrt(hn) + causal mask) v over [b, np, s, hn] (the same as
    scaled_dot_product_attention(q, k, v, is_causal=True))."""
    return _CausalAttention.apply(query, key, value)


class _CausalAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query, key, value):
        output, log_sum_exp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, True)[:2]
        ctx.save_for_backward(query, key, value, output, log_sum_exp)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, log_sum_exp = ctx.saved_tensors
        scale = query.shape[-1] ** -0.5
        queries, keys = query.shape[-2], key.shape[-2]
        allowed = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril()
        scores = torch.matmul(query, key.transpose(-1, -2)).float()  # [b, np, s, s]
        probs = torch.where(allowed, torch.exp(scores * scale - log_sum_exp.unsqueeze(-1)), 0.0)
        grad_value = torch.matmul(probs.to(value.dtype).transpose(-1, -2), grad_output)
        grad_probs = torch.matmul(grad_output, value.transpose(-1, -2)).float()
        # softmax backward: dS = P · (dP - rowsum(dO · O)), rowsum(P · dP) = rowsum(dO · O)
        row_dot = (grad_output.float() * output.float()).sum(-1, keepdim=True)
        grad_scores = (probs * (grad_probs - row_dot) * scale).to(query.dtype)
        grad_query = torch.matmul(grad_scores, key)
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), query)
        return grad_query, grad_key, grad_value
