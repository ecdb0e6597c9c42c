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


@pytest.mark.parametrize("case", ["cross_entropy", "fused_cross_entropy"])
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


@pytest.fixture(scope="module")
def compiled_kernels():
    return mpu.compile_cross_entropy_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_fused_form_matches_the_eager_one(compiled_kernels, dtype):
    """Loss and gradient of the compiled kernels agree with the eager form (fp32 to rounding;
    bf16 gradients to their own rounding), and the logits are left as they were."""
    target = torch.tensor([[0, 1, 10, 3, 3], [9, 8, 7, 6, 5], [0, 0, 0, 0, 0], [10, 10, 2, 1, 4]])
    grad_output = det(4, 5, seed=2)
    results = []
    for kernels in (None, compiled_kernels):
        logits = det(4, 5, 11, seed=1, scale=5.0).to(dtype).requires_grad_()
        before = logits.detach().clone()
        loss = mpu.vocab_parallel_cross_entropy(logits, target, kernels)
        loss.backward(grad_output)
        assert torch.equal(logits.detach(), before)
        assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
        results.append((loss.detach(), logits.grad.float()))
    (loss, grad), (fused_loss, fused_grad) = results
    torch.testing.assert_close(fused_loss, loss)
    tolerance = {} if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(fused_grad, grad, **tolerance)


def test_compiled_fused_form_is_stable_with_large_logits(compiled_kernels):
    logits = torch.tensor([[1000.0, 0.0, -1000.0]], requires_grad=True)
    loss = mpu.vocab_parallel_cross_entropy(logits, torch.tensor([1]), compiled_kernels)
    torch.testing.assert_close(loss, torch.tensor([1000.0]))
    loss.backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[1.0, -1.0, 0.0]]))
