import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from tests.mpu.cases import det, shard


def _full_model_grads(weights):
    """The single-process model of cases.case_grads, built from the gathered weights."""
    column_w, row_w = weights
    params = [column_w.clone(), det(8, seed=91), row_w.clone(), det(6, seed=92),
              det(6, seed=93), torch.zeros(6)]
    for p in params:
        p.requires_grad_()
    hidden = F.linear(det(5, 6, seed=94), params[0], params[1])
    out = F.linear(F.gelu(hidden), params[2], params[3])
    normed = F.layer_norm(out, (6,), params[4], params[5])
    (normed * det(5, 6, seed=95)).sum().backward()
    return params


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_clip_grad_norm_matches_torch_on_the_full_model(dist_results, tp):
    results = dist_results.get(tp, "grads")
    for rank, out in enumerate(results):
        r, group = rank % tp, results[rank // tp * tp: rank // tp * tp + tp]
        full_column = torch.cat([o["weights"][0] for o in group], dim=0)
        full_row = torch.cat([o["weights"][2] for o in group], dim=1)
        params = _full_model_grads((full_column, full_row))
        grads = [p.grad.clone() for p in params]
        expected = {"l2": torch.cat([g.flatten() for g in grads]).norm(2).item(),
                    "inf": max(g.abs().max().item() for g in grads),
                    "l1": sum(g.abs().sum().item() for g in grads)}
        for kind, value in expected.items():
            assert out["norms"][kind] == pytest.approx(value, rel=1e-5), kind
        returned = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
        assert out["returned"] == pytest.approx(returned.item(), rel=1e-5)
        assert returned.item() > 0.5, "the case must actually clip"
        local_views = [shard(params[0].grad, 0, tp, r), shard(params[1].grad, 0, tp, r),
                       shard(params[2].grad, 1, tp, r), params[3].grad, params[4].grad,
                       params[5].grad]
        for got, want in zip(out["clipped"], local_views):
            torch.testing.assert_close(got, want)


def test_single_process_matches_torch_with_mixed_dtypes():
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4)),
              torch.nn.Parameter(torch.randn(6).to(torch.bfloat16)),
              torch.nn.Parameter(torch.randn(2))]
    for p in params[:3]:
        p.grad = torch.randn_like(p) * 3
    reference = [p.detach().clone().float().requires_grad_() for p in params[:3]]
    for ref, p in zip(reference, params):
        ref.grad = p.grad.float().clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0).item()
    assert mpu.clip_grad_norm(params, max_norm=1.0) == pytest.approx(expected, rel=1e-5)
    for ref, p in zip(reference, params):
        torch.testing.assert_close(p.grad.float(), ref.grad, atol=1e-2, rtol=1e-2)
    assert params[3].grad is None


def test_no_clipping_below_max_norm():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([0.3, 0.4, 0.0])
    assert mpu.clip_grad_norm([p], max_norm=1.0) == pytest.approx(0.5)
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4, 0.0]))
    assert mpu.get_grad_norm(p, norm_type=float("inf")) == pytest.approx(0.4)
