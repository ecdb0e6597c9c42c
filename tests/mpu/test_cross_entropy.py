import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from tests.mpu.cases import det, shard


def _reference(logits, target, grad_output):
    logits = logits.clone().requires_grad_()
    loss = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(),
                           reduction="none").view(target.shape)
    loss.backward(grad_output)
    return loss.detach(), logits.grad


@pytest.mark.parametrize("case", ["cross_entropy", "chunked_cross_entropy"])
@pytest.mark.parametrize("tp", [4, 2, 1])
def test_vocab_parallel_cross_entropy_matches_full(dist_results, tp, case):
    target = torch.tensor([[0, 5, 15], [8, 4, 12]])
    loss, grad = _reference(det(2, 3, 16, seed=50, scale=3.0), target, det(2, 3, seed=51))
    for rank, out in enumerate(dist_results.get(tp, case)):
        torch.testing.assert_close(out["loss"], loss)
        torch.testing.assert_close(out["grad"], shard(grad, 2, tp, rank % tp))
        assert out["unchanged"], "the caller's logits were modified"


def test_single_process_fp32_and_input_untouched():
    logits = det(4, 5, 11, seed=1, scale=5.0).requires_grad_()
    before = logits.detach().clone()
    target = torch.tensor([[0, 1, 10, 3, 3], [9, 8, 7, 6, 5], [0, 0, 0, 0, 0],
                           [10, 10, 2, 1, 4]])
    loss = mpu.vocab_parallel_cross_entropy(logits, target)
    assert loss.shape == target.shape and loss.dtype == torch.float32
    assert torch.equal(logits.detach(), before)
    loss.backward(det(4, 5, seed=2))
    ref_loss, ref_grad = _reference(before, target, det(4, 5, seed=2))
    torch.testing.assert_close(loss.detach(), ref_loss)
    torch.testing.assert_close(logits.grad, ref_grad)


def test_bf16_logits_give_fp32_loss_and_bf16_grad():
    logits = det(3, 7, seed=3, scale=4.0).to(torch.bfloat16).requires_grad_()
    target = torch.tensor([0, 6, 2])
    loss = mpu.vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    ref_loss, ref_grad = _reference(logits.detach().float(), target, torch.ones(3))
    torch.testing.assert_close(loss.detach(), ref_loss)
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_grad, atol=1e-2, rtol=1e-2)


def test_large_logits_are_stable():
    logits = torch.tensor([[1000.0, 0.0, -1000.0]], requires_grad=True)
    loss = mpu.vocab_parallel_cross_entropy(logits, torch.tensor([1]))
    torch.testing.assert_close(loss, torch.tensor([1000.0]))


def test_large_logits_give_a_stable_gradient():
    logits = torch.tensor([[1000.0, 0.0, -1000.0]], requires_grad=True)
    mpu.vocab_parallel_cross_entropy(logits, torch.tensor([1])).sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[1.0, -1.0, 0.0]]))


def test_the_chunked_form_matches_the_fp32_one_for_bf16_logits(monkeypatch):
    """bf16 logits take the chunked form: any chunking gives the same result bit for bit
    (every row is computed alone), and it matches the in-place form on the same logits."""
    from megatron.mpu import cross_entropy
    target = torch.tensor([[0, 1, 10, 3, 3], [9, 8, 7, 6, 5], [0, 0, 0, 0, 0], [10, 10, 2, 1, 4]])
    logits = det(4, 5, 11, seed=1, scale=5.0).to(torch.bfloat16)
    results = []
    for elements, function in ((1, None), (22, None), (1 << 19, None),  # 1, 2, all 20 rows
                               (1 << 19, cross_entropy._VocabParallelCrossEntropy.apply)):
        monkeypatch.setattr(cross_entropy, "_CPU_CHUNK_ELEMENTS", elements)
        leaf = logits.clone().requires_grad_()
        loss = (function or mpu.vocab_parallel_cross_entropy)(leaf, target)
        loss.backward(det(4, 5, seed=2))
        assert torch.equal(leaf.detach(), logits)
        results.append((loss.detach(), leaf.grad))
    for loss, grad in results[1:3]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
    torch.testing.assert_close(results[0][0], results[3][0])
    torch.testing.assert_close(results[0][1].float(), results[3][1].float(), atol=1e-2,
                               rtol=1e-2)
