"""megatron/model/dropout.py and the CPU attention-with-dropout path of the transformer."""

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.model.dropout import (_where_kept, drop_unscaled, dropout, hashed_keep_mask,
                                   keep_mask)
from megatron.model.transformer import attention


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_drops_with_probability_p(p):
    torch.manual_seed(0)
    n = 300_001  # not a multiple of the four lanes per draw
    dropped = 1.0 - keep_mask((n,), p).float().mean().item()
    assert abs(dropped - round(p * 65536) / 65536) < 4 * (p * (1 - p) / n) ** 0.5


def test_mask_lanes_are_uniform_and_independent_of_each_other():
    torch.manual_seed(1)
    keep = keep_mask((4 * 200_000,), 0.5).view(-1, 4).float()
    for lane in range(4):  # every 16 bits of a draw are random, the sign lane too
        assert abs(keep[:, lane].mean().item() - 0.5) < 0.005
    for a in range(4):
        for b in range(a + 1, 4):  # both kept: 1/4 when independent
            assert abs((keep[:, a] * keep[:, b]).mean().item() - 0.25) < 0.005


def test_dropout_scales_kept_elements_and_replays_under_the_same_seed():
    x = torch.randn(64, 33, dtype=torch.bfloat16, requires_grad=True)
    torch.manual_seed(5)
    out = dropout(x, 0.2)
    torch.manual_seed(5)
    keep = keep_mask(x.shape, 0.2)
    assert torch.equal(out, x.detach().mul(keep).mul_(1 / 0.8))
    assert out.dtype == torch.bfloat16
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, torch.ones_like(x).mul(keep).mul_(1 / 0.8))
    torch.manual_seed(5)
    assert torch.equal(dropout(x, 0.2), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dropout_keeps_elements_bit_for_bit_and_zeroes_dropped_ones_of_any_value(dtype):
    # The mask multiplies the float's bit pattern: kept elements must come out as they went
    # in (times the scale), dropped ones as +0.0 even when negative, inf or NaN.
    x = torch.randn(7, 40, dtype=dtype).t()  # strided
    torch.manual_seed(9)
    keep = keep_mask(x.shape, 0.5)
    dropped = (~keep).nonzero()[:4].unbind(1)
    x[dropped] = torch.tensor([float("nan"), float("inf"), -float("inf"), -1.0], dtype=dtype)
    torch.manual_seed(9)
    out = dropout(x, 0.5)
    expected = torch.where(keep, x * 2.0, torch.zeros((), dtype=dtype))
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


def test_dropout_keeps_only_a_one_byte_mask_for_backward():
    x = torch.randn(1000, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        dropout(x, 0.3)
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.bool, 1000)]


def test_no_dropout_outside_training_and_torch_dropout_at_the_edges():
    x = torch.randn(10)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros(10))


def _qkv(seq=16, heads=2, dim=8):
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(2, heads, seq, dim, generator=generator, requires_grad=True)
            for _ in range(3)]


def test_attention_without_dropout_is_sdpa():
    q, k, v = _qkv()
    assert torch.equal(attention(q, k, v, None, True, 0.0),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_attention_with_dropout_is_the_math_with_the_cheap_mask(causal):
    q, k, v = _qkv()
    allowed = None if causal else torch.rand(2, 1, 16, 16, generator=torch.Generator()
                                             .manual_seed(4)) > 0.3
    allowed = allowed if causal else allowed | torch.eye(16, dtype=torch.bool)
    torch.manual_seed(9)
    out = attention(q, k, v, allowed, causal, 0.25)
    torch.manual_seed(9)
    keep = keep_mask((2, 2, 16, 16), 0.25)
    mask = torch.ones(16, 16, dtype=torch.bool).tril() if causal else allowed
    scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf"))
    expected = (scores.softmax(-1) * keep / 0.75) @ v
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    # with every element kept it is SDPA's result
    full = torch.matmul(torch.softmax(scores, -1), v)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else allowed,
                                               is_causal=causal)
    torch.testing.assert_close(full, reference, rtol=1e-5, atol=1e-6)


def test_bf16_attention_with_dropout_tracks_the_fp32_math():
    q, k, v = (t.detach() for t in _qkv())
    torch.manual_seed(3)
    out = attention(*(t.bfloat16() for t in (q, k, v)), None, True, 0.1)
    torch.manual_seed(3)
    keep = keep_mask((2, 2, 16, 16), 0.1)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf"))
    expected = (scores.softmax(-1) * keep / 0.9) @ v
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)


# Compiled code on the CPU hashes its masks (megatron.model.dropout.hashed_keep_mask).

@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_hashed_mask_drops_with_probability_p(p):
    n = 300_001
    dropped = 1.0 - hashed_keep_mask((n,), p, torch.tensor(12345)).float().mean().item()
    assert abs(dropped - round(p * 65536) / 65536) < 4 * (p * (1 - p) / n) ** 0.5


def test_hashed_masks_are_independent_of_neighbours_and_of_other_keys():
    n = 400_000
    masks = [hashed_keep_mask((n,), 0.5, torch.tensor(key)).float()
             for key in (7, 6, 7 | 2 ** 31)]
    tolerance = 4 * (0.25 * 0.75 / n) ** 0.5
    for mask in masks:
        assert abs(mask.mean().item() - 0.5) < tolerance
        for lag in (1, 2, 16, 384):  # both kept: 1/4 when independent
            assert abs((mask[lag:] * mask[:-lag]).mean().item() - 0.25) < tolerance, lag
    for a, b in ((0, 1), (0, 2), (1, 2)):  # keys one bit apart: 7 and 6, 7 and 7 | 2**31
        assert abs((masks[a] * masks[b]).mean().item() - 0.25) < tolerance


def test_compiled_dropout_replays_under_the_same_seed_and_keeps_only_the_key():
    compiled = torch.compile(lambda t: dropout(t, 0.2))
    x = torch.randn(64, 96, requires_grad=True)
    torch.manual_seed(5)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = compiled(x)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.02
    assert torch.equal(out[kept], (x * 1.25)[kept].detach())
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, kept.float() * 1.25)
    assert all(t.numel() <= 1 for t in saved), [t.shape for t in saved]  # no mask kept
    torch.manual_seed(5)
    assert torch.equal(compiled(x), out)
    assert not torch.equal(compiled(x), out)  # the generator moved on: a new mask


def test_compiled_attention_masks_are_their_own_per_stream():
    """Attention dropout hashes its tensor-parallel rank in as the stream: ranks given the
    same seed still drop different probabilities, as the RNG tracker's per-rank generators
    do in eager."""
    compiled = torch.compile(drop_unscaled, dynamic=False)  # in a model, p and the stream
    # are constants of the graph, never symbols
    probs = torch.rand(4, 2, 32, 32)
    masks = []
    for stream in (1, 2):
        torch.manual_seed(3)
        masks.append(compiled(probs, 0.5, stream) != 0)
    torch.manual_seed(3)
    assert torch.equal(compiled(probs, 0.5, 1) != 0, masks[0])
    agreement = (masks[0] == masks[1]).float().mean().item()
    assert abs(agreement - 0.5) < 0.05  # independent masks agree half the time at p = 0.5


def test_compiled_hash_is_the_eager_hash():
    """Inductor's vectorised int64 code (and its scalar tail) computes eager torch's masks."""
    key = torch.tensor(0x5EED1234)
    ones = torch.ones(3, 1001)  # rows not a multiple of the vector width
    compiled = torch.compile(_where_kept, dynamic=False)
    assert torch.equal(compiled(ones, key, 0.3, 1.0) != 0, hashed_keep_mask(ones.shape, 0.3, key))


def test_compiled_masks_follow_tensor_parallelism(monkeypatch):
    """In one compiled graph on two tensor-parallel ranks with the same seed: the hidden
    dropout masks are the same (the hidden states are replicated), the attention masks are
    not (each rank's heads are its own)."""
    q, k, v = (t.detach() for t in _qkv())
    hidden = torch.randn(16, 24)

    def layer_dropouts():
        return attention(q, k, v, None, True, 0.5), dropout(hidden, 0.5)
    results = []
    for rank in (0, 1):
        monkeypatch.setattr(mpu, "get_model_parallel_rank", lambda: rank)
        torch._dynamo.reset()
        torch.manual_seed(2)
        results.append(torch.compile(layer_dropouts, dynamic=False)())
    (attention_0, hidden_0), (attention_1, hidden_1) = results
    assert torch.equal(hidden_0, hidden_1)
    assert not torch.equal(attention_0, attention_1)


def test_tracked_attention_dropout_runs_eagerly_inside_compiled_code(monkeypatch):
    """The tracker's generator swap cannot be traced: compiled code calls it as an eager
    function (a graph break), drawing the same mask as an eager call."""
    import torch._dynamo

    from megatron.model.transformer import _attention_with_dropout
    from zero.activation_checkpointing.rng_tracker import RNGStatesTracker
    q, k, v = (t.detach() for t in _qkv())

    def tracked(q, k, v):
        return _attention_with_dropout(q * 1, k, v, None, True, 0.25) + 1

    outputs = []
    for run in (tracked, torch.compile(tracked, backend="eager")):
        tracker = RNGStatesTracker()
        tracker.add("model-parallel-rng", 77)
        monkeypatch.setattr(mpu, "get_cuda_rng_tracker", lambda: tracker)
        outputs.append(run(q, k, v))
    assert torch.equal(outputs[0], outputs[1])
    torch._dynamo.reset()
    assert torch._dynamo.explain(tracked)(q, k, v).graph_break_count == 1
    torch._dynamo.reset()
