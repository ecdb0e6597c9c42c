import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.mpu import layers as layers_mod
from tests.mpu.cases import build_init_layers, det, shard


def _group(results, rank, tp):
    """Results of the ranks in `rank`'s tensor-parallel group, in TP-rank order."""
    first = rank // tp * tp
    return results[first:first + tp]


def _column_reference(full_weight, gather):
    x = det(3, 2, 6, seed=11).requires_grad_()
    w = full_weight.clone().requires_grad_()
    b = det(8, seed=13).requires_grad_()
    y = F.linear(x, w, b)
    y.backward(det(3, 2, 8, seed=12))
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("tp", [4, 2, 1])
@pytest.mark.parametrize("gather", [True, False])
def test_column_parallel_linear_matches_full_linear(dist_results, tp, gather):
    results = dist_results.get(tp, "column")
    for rank, out in enumerate(results):
        r, got = rank % tp, out[gather]
        full_weight = torch.cat([o[gather]["weight"] for o in _group(results, rank, tp)], dim=0)
        y, x_grad, w_grad, b_grad = _column_reference(full_weight, gather)
        torch.testing.assert_close(got["y"], y if gather else shard(y, 2, tp, r))
        assert got["bias_out"] is None
        torch.testing.assert_close(got["x_grad"], x_grad)
        torch.testing.assert_close(got["w_grad"], shard(w_grad, 0, tp, r))
        torch.testing.assert_close(got["b_grad"], shard(b_grad, 0, tp, r))
        assert got["tags"] == ((True, 0, 1), (True, 0, 1))


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_column_skip_bias_add_returns_the_bias(dist_results, tp):
    results = dist_results.get(tp, "column")
    for rank, out in enumerate(results):
        r = rank % tp
        full_weight = torch.cat([o["skip"]["weight"] for o in _group(results, rank, tp)])
        y = F.linear(det(3, 2, 6, seed=11), full_weight)
        torch.testing.assert_close(out["skip"]["y"], shard(y, 2, tp, r))
        torch.testing.assert_close(out["skip"]["bias_out"], shard(det(8, seed=13), 0, tp, r))


@pytest.mark.parametrize("tp", [4, 2, 1])
@pytest.mark.parametrize("parallel_input", [False, True])
def test_row_parallel_linear_matches_full_linear(dist_results, tp, parallel_input):
    results = dist_results.get(tp, "row")
    for rank, out in enumerate(results):
        r, got = rank % tp, out[parallel_input]
        full_weight = torch.cat([o[parallel_input]["weight"]
                                 for o in _group(results, rank, tp)], dim=1)
        x = det(3, 2, 8, seed=21).requires_grad_()
        w = full_weight.clone().requires_grad_()
        b = det(6, seed=23).requires_grad_()
        y = F.linear(x, w, b)
        y.backward(det(3, 2, 6, seed=22))
        torch.testing.assert_close(got["y"], y.detach())
        assert got["bias_out"] is None
        torch.testing.assert_close(got["x_grad"],
                                   shard(x.grad, 2, tp, r) if parallel_input else x.grad)
        torch.testing.assert_close(got["w_grad"], shard(w.grad, 1, tp, r))
        torch.testing.assert_close(got["b_grad"], b.grad)
        assert got["tags"] == ((True, 1, 1), (False, None, None))


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_row_skip_bias_add_returns_the_bias(dist_results, tp):
    results = dist_results.get(tp, "row")
    for rank, out in enumerate(results):
        full_weight = torch.cat([o["skip"]["weight"] for o in _group(results, rank, tp)], 1)
        torch.testing.assert_close(out["skip"]["y"], F.linear(det(3, 2, 8, seed=21),
                                                              full_weight))
        torch.testing.assert_close(out["skip"]["bias_out"], det(6, seed=23))


@pytest.mark.parametrize("tp", [4, 2])
def test_vocab_parallel_embedding_matches_full_embedding(dist_results, tp):
    results = dist_results.get(tp, "embedding")
    ids = torch.tensor([[0, 3, 4, 7], [8, 11, 12, 15], [15, 0, 5, 5]])
    for rank, out in enumerate(results):
        full = torch.cat([o["weight"] for o in _group(results, rank, tp)]).requires_grad_()
        y = F.embedding(ids, full)
        y.backward(det(3, 4, 4, seed=31))
        torch.testing.assert_close(out["y"], y.detach())
        torch.testing.assert_close(out["w_grad"], shard(full.grad, 0, tp, rank % tp))
        assert out["tags"] == (True, 0, 1)


def _expected_slice(full, dim, tp, rank, stride):
    block = full.size(dim) // (stride * tp)
    return torch.cat([full.narrow(dim, (k * tp + rank) * block, block) for k in range(stride)],
                     dim)


# (partition dim, stride) of each weight built by build_init_layers
INIT_LAYOUT = dict(qkv=(0, 3), column=(0, 1), row=(1, 1), row_strided=(1, 2),
                   embedding=(0, 1))


@pytest.mark.parametrize("tp", [4, 2])
def test_init_shards_are_slices_of_the_single_process_weights(dist_results, tp):
    full, after_full = build_init_layers()  # here: no process group, tensor-parallel size 1
    for rank, (weights, after) in enumerate(dist_results.get(tp, "init")):
        for name, (dim, stride) in INIT_LAYOUT.items():
            assert torch.equal(weights[name], _expected_slice(full[name], dim, tp,
                                                              rank % tp, stride)), name
        assert torch.equal(after, after_full), "ranks consumed the generator differently"


def test_init_slices_with_offline_overrides():
    full, _ = build_init_layers()
    try:
        mpu.set_model_parallel_world_size(2)
        mpu.set_model_parallel_rank(1)
        sharded, _ = build_init_layers()
    finally:
        mpu.destroy_model_parallel()
    for name, (dim, stride) in INIT_LAYOUT.items():
        assert torch.equal(sharded[name], _expected_slice(full[name], dim, 2, 1, stride)), name


def test_master_weight_is_generated_in_row_chunks(monkeypatch):
    monkeypatch.setattr(layers_mod, "_INIT_CHUNK_ELEMENTS", 8)
    shapes = []

    def record(tensor):
        shapes.append(tuple(tensor.shape))
        tensor.fill_(len(shapes))

    weight = torch.empty(10, 4)
    layers_mod.initialize_affine_weight(weight, (10, 4), 0, record)
    assert shapes == [(2, 4)] * 5
    assert torch.equal(weight[:, 0], torch.tensor([1., 1, 2, 2, 3, 3, 4, 4, 5, 5]))


def test_scaled_init_std():
    torch.manual_seed(0)
    t = torch.empty(200_000)
    mpu.scaled_init_method_normal(0.02, num_layers=8)(t)
    assert abs(t.std().item() - 0.02 / 4) < 1e-4
