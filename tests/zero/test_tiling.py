"""zero.TiledLinear / TiledLinearReturnBias against one torch.nn.Linear (single process)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero
from zero.tiling import partition_uniform

IN, OUT = 10, 14  # not divisible by most split counts: uneven tiles are exercised too


def _reference(bias=True):
    torch.manual_seed(0)
    return nn.Linear(IN, OUT, bias=bias)


def _input():
    return torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _tile_grads(tiled):
    """The tiles' weight/bias grads assembled into untiled [OUT, IN] / [OUT] tensors."""
    weight = torch.cat([torch.cat([t.weight.grad for t in row], dim=1)
                        for row in tiled.linears], dim=0)
    biases = [row[-1].bias.grad for row in tiled.linears if row[-1].bias is not None]
    return weight, (torch.cat(biases) if biases else None)


def _forward_backward(module, x, upstream):
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(upstream)
    return out.detach(), x.grad.clone()


def test_partition_uniform_matches_deepspeed_boundaries():
    assert partition_uniform(10, 3) == [0, 4, 7, 10]  # the first n % parts chunks are larger
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(5, 5) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("in_splits,out_splits", [(1, 1), (2, 1), (1, 3), (3, 2), (4, 5),
                                                  (IN, OUT)])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_linear_forward_and_grads(in_splits, out_splits, bias):
    reference = _reference(bias)
    tiled = zero.TiledLinear(IN, OUT, bias=bias, in_splits=in_splits, out_splits=out_splits,
                             init_linear=reference)
    upstream = torch.randn(3, 5, OUT, generator=torch.Generator().manual_seed(2))
    x_ref, x_tiled = _input(), _input()
    out_ref, dx_ref = _forward_backward(reference, x_ref, upstream)
    out_tiled, dx_tiled = _forward_backward(tiled, x_tiled, upstream)
    torch.testing.assert_close(out_tiled, out_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_tiled, dx_ref, rtol=1e-6, atol=1e-6)
    dweight, dbias = _tile_grads(tiled)
    torch.testing.assert_close(dweight, reference.weight.grad, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(dbias, reference.bias.grad, rtol=1e-6, atol=1e-6)
        # The bias lives only in the last input tile of each output row: added once.
        assert all(t.bias is None for row in tiled.linears for t in row[:-1])


def test_each_tile_is_its_own_submodule():
    tiled = zero.TiledLinear(IN, OUT, in_splits=2, out_splits=3)
    tiles = [m for m in tiled.modules() if isinstance(m, nn.Linear)]
    assert len(tiles) == 6
    assert [tuple(t.weight.shape) for t in tiles[:2]] == [(5, 5), (5, 5)]
    assert [tuple(t.weight.shape) for t in tiles[-2:]] == [(4, 5), (4, 5)]


def test_input_is_already_split():
    reference = _reference()
    tiled = zero.TiledLinear(IN, OUT, in_splits=3, out_splits=2, input_is_already_split=True,
                             init_linear=reference)
    x = _input().detach()
    pieces = torch.split(x, [4, 3, 3], dim=-1)
    torch.testing.assert_close(tiled(list(pieces)), reference(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="sequence of 3 tensors, got 2"):
        tiled(list(pieces[:2]))


def test_combine_out_splits_false_returns_the_output_slices():
    reference = _reference()
    tiled = zero.TiledLinear(IN, OUT, in_splits=2, out_splits=3, combine_out_splits=False,
                             init_linear=reference)
    x = _input().detach()
    outputs = tiled(x)
    assert isinstance(outputs, list) and [o.shape[-1] for o in outputs] == [5, 5, 4]
    expected = torch.split(reference(x), [5, 5, 4], dim=-1)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


class SkipBiasLinear(nn.Module):
    """A Megatron-style linear: returns (X W^T, b) for a later fused bias add."""

    def __init__(self, in_features, out_features, bias=True, scale=1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.scale = scale  # a pass-through kwarg

    def forward(self, x):
        return F.linear(x, self.weight) * self.scale, self.bias


@pytest.mark.parametrize("combine", [True, False])
def test_return_bias_with_megatron_style_tiles(combine):
    reference = _reference()
    tiled = zero.TiledLinearReturnBias(IN, OUT, in_splits=2, out_splits=3,
                                       combine_out_splits=combine, linear_cls=SkipBiasLinear,
                                       init_linear=reference, scale=1.0)
    x = _input().detach()
    result = tiled(x)
    if not combine:
        assert len(result) == 3
        result = (torch.cat([t for t, _ in result], -1), torch.cat([b for _, b in result]))
    output, bias = result
    torch.testing.assert_close(output, F.linear(x, reference.weight), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bias, reference.bias)


def test_return_bias_without_bias_returns_none():
    tiled = zero.TiledLinearReturnBias(IN, OUT, bias=False, in_splits=2, out_splits=2,
                                       linear_cls=SkipBiasLinear)
    output, bias = tiled(_input().detach())
    assert bias is None and output.shape == (3, 5, OUT)


def test_tuple_returning_tiles_need_return_bias():
    tiled = zero.TiledLinear(IN, OUT, in_splits=2, linear_cls=SkipBiasLinear)
    with pytest.raises(TypeError, match="use TiledLinearReturnBias"):
        tiled(_input().detach())


@pytest.mark.parametrize("kwargs,message", [
    (dict(in_splits=0), r"in splits must be in range \[1, in_features\]"),
    (dict(in_splits=IN + 1), r"in splits must be in range \[1, in_features\]"),
    (dict(out_splits=OUT + 1), r"out splits must be in range \[1, out_features\]"),
])
def test_bad_splits(kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        zero.TiledLinear(IN, OUT, **kwargs)


def test_copy_params_from_checks_shapes_and_bias():
    tiled = zero.TiledLinear(IN, OUT, in_splits=2, out_splits=2)
    with pytest.raises(ValueError, match=r"weight of shape \(14, 9\), expected .* \(14, 10\)"):
        tiled.copy_params_from(nn.Linear(9, OUT))
    with pytest.raises(ValueError, match="has no bias but this TiledLinear was built with "
                                         "bias=True"):
        tiled.copy_params_from(nn.Linear(IN, OUT, bias=False))


def test_wrong_input_width_is_reported():
    tiled = zero.TiledLinear(IN, OUT, in_splits=2)
    with pytest.raises(ValueError, match="last dim is 9, TiledLinear expects in_features=10"):
        tiled(torch.zeros(2, 9))


def test_under_zero_init_one_row_of_tiles_is_whole_at_a_time():
    """Each row of tiles is partitioned as soon as it is built: building a tile never finds
    tiles of an earlier row still whole (the memory tiling exists to save)."""
    built, whole_when_built = [], []

    class CountingTile(nn.Linear):
        def __init__(self, *args, **kwargs):
            whole_when_built.append(sum(not zero.stages.partition_parameters.is_zero_param(
                t.weight) for t in built))
            super().__init__(*args, **kwargs)
            built.append(self)

    with zero.Init():
        tiled = zero.TiledLinear(IN, OUT, in_splits=2, out_splits=3, linear_cls=CountingTile)
    assert len(built) == 6 and max(whole_when_built) == 1  # only its own row's first tile
    assert all(zero.stages.partition_parameters.is_zero_param(t.weight) for t in built)
    with zero.GatheredParameters(list(tiled.parameters())):
        assert all(t.weight.shape == (t.out_features, t.in_features) for t in built)
