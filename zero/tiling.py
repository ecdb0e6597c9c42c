"""Memory-centric tiling (ZeRO-Infinity): a linear layer cut into a grid of smaller linears.

`TiledLinear(in_features, out_features, ...)` computes the same Y = XA^T + b as one
`torch.nn.Linear`, but its weight is held by an `out_splits x in_splits` grid of tiles, each
its own submodule (`self.linears[o][i]`).  Under ZeRO stage 3 the parameter hooks fire per
submodule, so only one tile's parameters are gathered at a time and the peak working memory of
a huge layer shrinks to one tile.

Tile [o][i] maps input slice i to output slice o; output slice o is the sum over i of its
tiles, and only the last input tile of each output row owns a bias, so the bias is added once.
Split points follow DeepSpeed's `partition_uniform`: chunk sizes differ by at most one and the
first `n % parts` chunks are the larger ones.

`linear_cls` may be any module class called as `linear_cls(in_i, out_o, bias=..., **kwargs)`,
e.g. Megatron's ColumnParallelLinear / RowParallelLinear (zero does not import megatron; the
kwargs pass through).  Those return `(output, bias)` tuples: use `TiledLinearReturnBias`.
"""

import torch
from torch import nn

from zero.stages.gathered_parameters import GatheredParameters


def partition_uniform(num_items, num_parts):
    """CSR-style boundaries [0, ..., num_items] of `num_parts` near-equal chunks."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def _check_splits(splits, features, name):
    if not isinstance(splits, int) or not 1 <= splits <= features:
        raise RuntimeError(f"{name} splits must be in range [1, {name}_features]: got "
                           f"{name}_splits={splits}, {name}_features={features}")


class TiledLinear(nn.Module):
    """A linear layer computed by an out_splits x in_splits grid of `linear_cls` tiles.

    forward(input_) with input_ [..., in_features] (or, with input_is_already_split, a
    sequence of in_splits tensors [..., in_i]) returns [..., out_features], or with
    combine_out_splits=False the list of out_splits tensors [..., out_o].
    """

    def __init__(self, in_features, out_features, bias=True, in_splits=1, out_splits=1,
                 input_is_already_split=False, combine_out_splits=True,
                 linear_cls=nn.Linear, init_linear=None, **kwargs):
        super().__init__()
        _check_splits(in_splits, in_features, "in")
        _check_splits(out_splits, out_features, "out")
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        # Each row of tiles is built inside its ModuleList's constructor, so under zero.Init
        # a row's tiles are partitioned as soon as the row exists: one row is whole at a time.
        self.linears = nn.ModuleList()
        for o in range(out_splits):
            out_size = self.out_parts[o + 1] - self.out_parts[o]
            self.linears.append(nn.ModuleList(
                # Only the last input tile of each output row adds the bias.
                linear_cls(self.in_parts[i + 1] - self.in_parts[i], out_size,
                           bias=bias if i == in_splits - 1 else False, **kwargs)
                for i in range(in_splits)))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_):
        inputs = self._split_input(input_)
        outputs = [self._reduce_local_output(
            [self.linears[o][i](inputs[i]) for i in range(self.in_splits)])
            for o in range(self.out_splits)]
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_input(self, input_):
        if self.in_splits == 1:
            if self.input_is_already_split:
                if not (isinstance(input_, (list, tuple)) and len(input_) == 1):
                    raise ValueError("input_is_already_split with in_splits=1 expects a "
                                     "sequence holding one tensor")
                return list(input_)
            return [input_]
        if self.input_is_already_split:
            if not isinstance(input_, (list, tuple)) or len(input_) != self.in_splits:
                got = len(input_) if isinstance(input_, (list, tuple)) else type(input_).__name__
                raise ValueError(f"input_is_already_split expects a sequence of "
                                 f"{self.in_splits} tensors, got {got}")
            return list(input_)
        if input_.shape[-1] != self.in_features:
            raise ValueError(f"input's last dim is {input_.shape[-1]}, TiledLinear expects "
                             f"in_features={self.in_features}")
        sizes = [b - a for a, b in zip(self.in_parts[:-1], self.in_parts[1:])]
        return list(torch.split(input_, sizes, dim=-1))  # views, no copies

    def _reduce_local_output(self, terms):
        """Sum the input tiles' contributions to one output slice."""
        for term in terms:
            if isinstance(term, tuple):
                raise TypeError("linear_cls returns (output, bias) tuples (Megatron style); "
                                "use TiledLinearReturnBias")
        if len(terms) == 1:
            return terms[0]
        # Clone first so the in-place adds never write into a tensor a tile may have kept.
        total = terms[0].clone()
        for term in terms[1:]:
            total.add_(term)
        return total

    def _combine_output_splits(self, outputs):
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def tiles(self):
        """(o, i, tile) for every tile, row by row."""
        for o, row in enumerate(self.linears):
            for i, tile in enumerate(row):
                yield o, i, tile

    @torch.no_grad()
    def copy_params_from(self, other):
        """Copy the weight (and bias) of an untiled linear with the same shape into the tiles.

        `other.weight` is [out_features, in_features]; tile [o][i] receives the block
        rows out_parts[o]:out_parts[o+1], columns in_parts[i]:in_parts[i+1].  Under ZeRO
        stage 3 (a collective then) the source is gathered whole for the copy when zero.Init
        partitioned it, each tile is gathered for the copy, and rank 0's values are kept.
        """
        other_bias = getattr(other, "bias", None)
        with GatheredParameters([p for p in (other.weight, other_bias) if p is not None]):
            self._copy_whole_params_from(other.weight, other_bias)

    def _copy_whole_params_from(self, weight, bias):
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"copy_params_from: weight of shape {tuple(weight.shape)}, "
                             f"expected (out_features, in_features) = {expected}")
        if (bias is not None) != self.use_bias:
            raise ValueError(f"copy_params_from: source {'has' if bias is not None else 'has no'}"
                             f" bias but this TiledLinear was built with bias={self.use_bias}")
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"copy_params_from: bias of shape {tuple(bias.shape)}, "
                             f"expected ({self.out_features},)")
        for o, i, tile in self.tiles():
            rows = slice(self.out_parts[o], self.out_parts[o + 1])
            cols = slice(self.in_parts[i], self.in_parts[i + 1])
            tile_bias = getattr(tile, "bias", None)
            params = [tile.weight] + ([tile_bias] if tile_bias is not None else [])
            with GatheredParameters(params, modifier_rank=0):
                tile.weight.copy_(weight[rows, cols])
                if tile_bias is not None:
                    tile_bias.copy_(bias[rows])


class TiledLinearReturnBias(TiledLinear):
    """TiledLinear over Megatron-style tiles that return (output, bias), e.g. skip_bias_add.

    Returns (output, bias): the tiles' outputs summed and concatenated as in TiledLinear, and
    the concatenation of the biases the tiles returned (None if none returned one).
    """

    def _reduce_local_output(self, terms):
        tensors, bias = [], None
        for term in terms:
            if not isinstance(term, tuple) or len(term) != 2:
                raise TypeError("TiledLinearReturnBias expects linear_cls to return "
                                f"(output, bias) tuples, got {type(term).__name__}")
            tensors.append(term[0])
            if term[1] is not None:
                bias = term[1]
        return super()._reduce_local_output(tensors), bias

    def _combine_output_splits(self, outputs):
        tensors = [tensor for tensor, _ in outputs]
        biases = [bias for _, bias in outputs if bias is not None]
        tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-1)
        if not biases:
            return tensor, None
        return tensor, (biases[0] if len(biases) == 1 else torch.cat(biases, dim=-1))
