import pytest
import torch

from megatron import mpu
from tests.mpu.cases import det, shard


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_paired_mappings_forward_and_backward(dist_results, tp):
    results = dist_results.get(tp, "mappings")
    for rank, out in enumerate(results):
        r = rank % tp
        group = range(rank // tp * tp, rank // tp * tp + tp)  # global ranks of my TP group
        # copy: identity forward, backward sums the gradients of the group
        y, grad = out["copy"]
        torch.testing.assert_close(y, det(4, 8, seed=1))
        torch.testing.assert_close(grad, sum(det(4, 8, seed=100 + g % tp) for g in group))
        # reduce: sum forward, identity backward
        y, grad = out["reduce"]
        torch.testing.assert_close(y, sum(det(4, 8, seed=200 + g % tp) for g in group))
        torch.testing.assert_close(grad, det(4, 8, seed=2))
        # scatter: own slice forward, backward gathers every rank's gradient
        y, grad = out["scatter"]
        torch.testing.assert_close(y, shard(det(4, 8, seed=3), 1, tp, r))
        torch.testing.assert_close(
            grad, torch.cat([det(4, 8 // tp, seed=300 + g % tp) for g in group], dim=1))
        # gather: concatenation forward, own slice of the gradient backward
        y, grad = out["gather"]
        torch.testing.assert_close(
            y, torch.cat([det(4, 8 // tp, seed=400 + g % tp) for g in group], dim=1))
        torch.testing.assert_close(grad, shard(det(4, 8, seed=4), 1, tp, r))


def test_mappings_are_identities_without_model_parallel():
    x = torch.randn(3, 4, requires_grad=True)
    for op in (mpu.copy_to_model_parallel_region, mpu.reduce_from_model_parallel_region,
               mpu.scatter_to_model_parallel_region, mpu.gather_from_model_parallel_region):
        assert op(x) is x
