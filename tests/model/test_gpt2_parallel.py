"""GPT-2 at tensor-parallel size 2 (2 gloo processes) against the same model in one process."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model import cases
from tests.mpu.cases import from_bytes

TP = 2


@pytest.fixture(scope="module")
def parallel():
    return [from_bytes(data) for data in run_distributed(cases.worker, TP)]


@pytest.fixture(scope="module")
def single():
    return cases.run_all(), cases.build_model(11)


def _expected_shard(full, param, rank):
    """The slice of a single-process tensor that a tensor-parallel rank holds."""
    if not getattr(param, "model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    block = full.size(dim) // (stride * TP)
    return torch.cat([full.narrow(dim, (k * TP + rank) * block, block) for k in range(stride)],
                     dim)


def test_init_shards_equal_slices_bit_for_bit(parallel, single):
    reference, model = single
    params = dict(model.named_parameters())
    for rank, out in enumerate(parallel):
        assert out["run"]["weights"].keys() == reference["weights"].keys()
        for name, shard in out["run"]["weights"].items():
            expected = _expected_shard(reference["weights"][name], params[name], rank)
            assert torch.equal(shard, expected), name


@pytest.mark.parametrize("variant", ["run", "checkpointed"])
@pytest.mark.parametrize("masks", ["plain", "reset"])
def test_loss_logits_and_grads_equal_single_process(parallel, single, variant, masks):
    reference, model = single
    reference = reference[masks]
    params = dict(model.named_parameters())
    for rank, out in enumerate(parallel):
        got = out[variant][masks]
        torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["logits"], reference["logits"], rtol=1e-5, atol=1e-5)
        for name, grad in got["grads"].items():
            expected = _expected_shard(reference["grads"][name], params[name], rank)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5, msg=name)


def test_checkpointing_with_dropout_keeps_gradients_bit_for_bit(parallel):
    for out in parallel:
        plain, checkpointed = out["dropout_plain"], out["dropout_checkpointed"]
        assert torch.equal(plain["losses"], checkpointed["losses"])
        assert not torch.allclose(plain["losses"], plain["eval_losses"]), "dropout is off"
        for name, grad in plain["grads"].items():
            assert torch.equal(grad, checkpointed["grads"][name]), name
