"""--memory-centric-tiled-linear: tiled layers and a tiled GPT-2 compute what untiled ones do.

Single process (tensor-parallel size 1) and 2 gloo processes (tensor-parallel size 2), each
compared with the untiled single-process result.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.errors import ConfigError
from megatron.model import GPT2Model
from megatron.model.tiling import (TiledColumnParallelLinear, TiledRowParallelLinear,
                                   join_tiled_weights)
from tests.dist_utils import run_distributed
from tests.model import cases, tiling_cases

TP = 2


@pytest.fixture(scope="module")
def parallel():
    return run_distributed(tiling_cases.worker, TP)


@pytest.fixture(scope="module")
def untiled_reference():
    model = cases.build_model(11)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return model, weights, cases.loss_and_grads(model, reset=False)


def _full_weight(tiled):
    return torch.cat([torch.cat([t.weight for t in row], dim=1) for row in tiled.linears], 0)


def _full_bias(tiled):
    return torch.cat([row[-1].bias for row in tiled.linears])


def test_parallel_tiles_at_tp2_equal_one_untiled_linear(parallel):
    # At tensor-parallel size 1 the tiles hold whole blocks: assemble the untiled matrices.
    column, row = tiling_cases.tiled_parallel_layers()
    x = tiling_cases.layer_input(tiling_cases.IN).requires_grad_(True)
    with torch.no_grad():
        w_col, b_col, w_row, b_row = (_full_weight(column), _full_bias(column),
                                      _full_weight(row), _full_bias(row))
    out = F.linear(torch.tanh(F.linear(x, w_col, b_col)), w_row, b_row)
    out.backward(tiling_cases.upstream(tiling_cases.IN))
    for result in parallel:
        torch.testing.assert_close(result["layers"]["out"], out.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["layers"]["input_grad"], x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tile_factor", [1, 2, 4])
def test_tiled_model_starts_from_the_untiled_weights(untiled_reference, tile_factor):
    _, weights, reference = untiled_reference
    rng_after_untiled = torch.get_rng_state()
    model = cases.build_model(11, memory_centric_tiled_linear=True, tile_factor=tile_factor)
    # Same generator stream: whatever is drawn after the model is drawn identically too.
    assert torch.equal(torch.get_rng_state(), rng_after_untiled)
    state = model.state_dict()
    assert list(state) == list(weights)  # checkpoints keep the untiled keys and order
    for key, value in weights.items():
        assert torch.equal(state[key], value), key
    result = cases.loss_and_grads(model, reset=True)
    expected = cases.loss_and_grads(cases.build_model(11), reset=True)
    torch.testing.assert_close(result["losses"], expected["losses"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["logits"], expected["logits"], rtol=1e-5, atol=1e-6)


def test_tiled_model_has_the_tile_grid_of_the_tile_factor():
    model = cases.build_model(11, memory_centric_tiled_linear=True, tile_factor=2)
    layer = model.language_model.transformer.layers[0]
    grids = {name: (m.tiled.in_splits, m.tiled.out_splits) for name, m in
             [("qkv", layer.attention.query_key_value), ("dense", layer.attention.dense),
              ("h_to_4h", layer.mlp.dense_h_to_4h), ("4h_to_h", layer.mlp.dense_4h_to_h)]}
    assert grids == {"qkv": (2, 6), "dense": (2, 2), "h_to_4h": (2, 8), "4h_to_h": (8, 2)}
    assert isinstance(layer.attention.query_key_value, TiledColumnParallelLinear)
    assert isinstance(layer.mlp.dense_4h_to_h, TiledRowParallelLinear)
    # Tile weights carry mpu's tags (gradient norm and ZeRO rely on them).
    for name, param in model.named_parameters():
        if ".tiled." in name:
            assert param.model_parallel is True, name
            assert param.partition_dim == (1 if "dense" in name and "h_to_4h" not in name
                                           else 0), name
    assert layer.mlp.dense_4h_to_h.bias.model_parallel is False  # replicated


def test_untiled_checkpoint_loads_into_tiled_model_and_back(untiled_reference):
    model, weights, reference = untiled_reference
    tiled = cases.build_model(5, memory_centric_tiled_linear=True, tile_factor=2)
    tiled.load_state_dict(weights)
    torch.testing.assert_close(cases.loss_and_grads(tiled, reset=False)["logits"],
                               reference["logits"], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="size mismatch for .*query_key_value.weight"):
        bad = dict(weights)
        key = next(k for k in bad if k.endswith("query_key_value.weight"))
        bad[key] = bad[key][:-1]
        tiled.load_state_dict(bad)


def test_join_tiled_weights_gives_the_untiled_state_dict(untiled_reference):
    # What ZeRO stage 3 consolidates (per-tile parameters, by name) joined back into the keys
    # of a Megatron checkpoint, as the tiled model's own state_dict() writes them.
    _, weights, _ = untiled_reference
    tiled = cases.build_model(5, memory_centric_tiled_linear=True, tile_factor=2)
    tiled.load_state_dict(weights)
    per_tile = {name: p.detach() for name, p in tiled.named_parameters()}
    assert any(".tiled.linears.1.1." in name for name in per_tile)
    joined = join_tiled_weights(per_tile)
    assert sorted(joined) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(joined[name], tensor), name


def test_tiled_model_at_tp2_equals_untiled_single_process(parallel, untiled_reference):
    model, weights, reference = untiled_reference
    params = dict(model.named_parameters())
    for rank, result in enumerate(parallel):
        out = result["model"]
        assert list(out["weights"]) == list(weights)
        for name, shard in out["weights"].items():
            param = params[name]
            if getattr(param, "model_parallel", False):
                size = weights[name].size(param.partition_dim) // TP
                expected = weights[name].narrow(param.partition_dim, rank * size, size)
            else:
                expected = weights[name]
            assert torch.equal(shard, expected), name
        torch.testing.assert_close(out["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["logits"], reference["logits"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["untiled_logits"], reference["logits"], rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("overrides,message", [
    (dict(tile_factor=3), r"--hidden-size .* = 32 is not divisible by 3 tiles \(32 % 3 = 2\)"),
    (dict(tile_factor=0), "--tile-factor must be a positive integer"),
    (dict(tile_factor=2, ffn_hidden_size=36),
     r"h->4h output ffn-hidden / model-parallel-size = 36 is not divisible by 8 tiles"),
])
def test_bad_tile_factor(overrides, message):
    with pytest.raises(ConfigError, match=message):
        GPT2Model(cases.tiny_config(memory_centric_tiled_linear=True, **overrides))
