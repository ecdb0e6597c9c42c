"""megatron/model/causal_attention.py: the compiled bf16 CPU attention with its own backward.

Compiled with the aot_eager backend: AOTAutograd traces the custom backward as inductor's
input would be, without inductor's compile time; the arithmetic is the same ops.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.model import GPT2Model, causal_attention
from tests.model.cases import tiny_config


def _forward_backward(function, dtype, scale=1.0, seq=40, heads=3, head_dim=16):
    """Output and the gradient of q, k and v (as the layer's one [b, s, np, 3, hn] tensor
    of strided views), for a fixed upstream gradient; both in fp32. `scale` multiplies the
    inputs: scores grow with its square, and so does their bf16 rounding."""
    generator = torch.Generator().manual_seed(0)
    mixed = (scale * torch.randn(2, seq, heads, 3, head_dim, generator=generator)).to(dtype)
    mixed.requires_grad_()
    query, key, value = (t.transpose(1, 2) for t in mixed.unbind(3))
    output = function(query, key, value)
    grad = torch.randn(output.shape, generator=generator).to(dtype)
    output.backward(grad)
    return output.float(), mixed.grad.float()


def _sdpa(query, key, value):
    return F.scaled_dot_product_attention(query, key, value, is_causal=True)


@torch.compile(backend="aot_eager", dynamic=False)
def _compiled_causal_attention(query, key, value):
    assert causal_attention.applies(query, True, 0.0)
    return causal_attention.causal_attention(query, key, value)


@torch.compile(backend="inductor", dynamic=False)
def _inductor_causal_attention(query, key, value):
    return causal_attention.causal_attention(query, key, value)


@pytest.mark.parametrize("scale", [1.0, 3.0])  # scaled scores ~1 and ~10 (peaked rows)
def test_it_is_causal_attention_as_accurate_as_sdpa_in_bf16(scale):
    reference = _forward_backward(_sdpa, torch.float32, scale)
    sdpa_bf16 = _forward_backward(_sdpa, torch.bfloat16, scale)
    ours = _forward_backward(_compiled_causal_attention, torch.bfloat16, scale)
    for name, ref, theirs, mine in zip(("output", "gradient"), reference, sdpa_bf16, ours):
        sdpa_error = (theirs - ref).abs().max().item()
        our_error = (mine - ref).abs().max().item()
        assert our_error <= 1.5 * sdpa_error + 1e-3, (name, our_error, sdpa_error)
    # the forward is SDPA's own kernel
    assert torch.equal(ours[0], sdpa_bf16[0])


def test_inductors_fused_backward_computes_what_the_traced_ops_do():
    traced = _forward_backward(_compiled_causal_attention, torch.bfloat16, 3.0)
    fused = _forward_backward(_inductor_causal_attention, torch.bfloat16, 3.0)
    torch.testing.assert_close(fused[1], traced[1], rtol=0.02, atol=0.02 * traced[1].abs().max().item())


@pytest.mark.parametrize("dtype, causal, dropout_p", [
    (torch.float32, True, 0.0), (torch.float16, True, 0.0), (torch.bfloat16, False, 0.0),
    (torch.bfloat16, True, 0.1)])
def test_it_applies_only_to_compiled_causal_bf16_without_dropout(dtype, causal, dropout_p):
    query = torch.zeros(1, 1, 4, 8, dtype=dtype)
    assert not causal_attention.applies(query, causal, dropout_p)
    seen = []
    torch.compile(lambda q: seen.append(causal_attention.applies(q, causal, dropout_p)) or q,
                  backend="eager")(query)
    assert seen == [False]


def test_it_leaves_eager_calls_and_problems_over_the_cap_to_sdpa(monkeypatch):
    query = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)  # 2 x 4 x 4 = 32 scores
    assert not causal_attention.applies(query, True, 0.0)  # eager: SDPA's backward is faster
    seen = []
    compiled = torch.compile(lambda q: seen.append(causal_attention.applies(q, True, 0.0)) or q,
                             backend="eager", dynamic=False)
    compiled(query)
    monkeypatch.setattr(causal_attention, "MAX_SCORES", 31)
    torch._dynamo.reset()
    compiled(query)
    assert seen == [True, False]


def test_a_compiled_bf16_model_takes_it_and_trains_as_eager_does(monkeypatch):
    taken = []
    original = causal_attention.causal_attention
    monkeypatch.setattr(causal_attention, "causal_attention",
                        lambda *args: taken.append(True) or original(*args))
    torch.manual_seed(0)
    eager = GPT2Model(tiny_config()).bfloat16()
    compiled = GPT2Model(tiny_config()).bfloat16()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(backend="aot_eager")
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    losses = []
    for model in (eager, compiled):
        loss = model(tokens, positions, labels=tokens.roll(-1, dims=1)).mean()
        loss.backward()
        losses.append(loss.item())
    assert taken  # traced into each compiled layer
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        scale = a.grad.float().abs().max().item()
        assert (b.grad.float() - a.grad.float()).abs().max().item() <= 0.05 * scale + 1e-3, name
