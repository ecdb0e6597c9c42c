"""--memory-centric-tiled-linear: the transformer's linears as grids of tiles (ZeRO-Infinity).

`TiledColumnParallelLinear` / `TiledRowParallelLinear` compute exactly what
`mpu.ColumnParallelLinear` / `mpu.RowParallelLinear` compute, but hold this rank's weight shard
A_r^T as a `zero.TiledLinearReturnBias` grid of tiles, each its own submodule, so that ZeRO
stage 3 gathers one tile at a time.

Why the tensor-parallel split is outside the tiling (not one parallel linear per tile, as
DeepSpeed's Megatron does): with a ColumnParallelLinear per tile, rank r would hold slice r of
every tile, which interleaves the [heads, 3, head_dim] rows of the QKV projection so a rank no
longer owns whole heads, and a RowParallelLinear per tile would all-reduce once per tile.
Tiling the local shard keeps every rank's layout, and its one all-reduce, as in the untiled
model, so a tiled model computes the same function at any tensor-parallel size.

Same weights as untiled, without building the untiled layer: the tiles are made row band by
row band (`mpu.ShardRows`) from the master weight drawn from the seeded generator the way the
untiled mpu layer draws it, so the RNG stream and every value match the untiled model while
at most one band of this rank's shard exists outside the tiles (under zero.Init each band's
tiles are partitioned as soon as they are built).

Checkpoints keep the untiled keys (`...query_key_value.weight`, `.bias`): state_dict() joins
the tiles and load_state_dict() cuts an untiled weight into them, so tiled and untiled
checkpoints load into either model and the checkpoint tools keep working.
"""

import re

import torch
import torch.nn.functional as F
from torch import nn
from zero.tiling import TiledLinearReturnBias, partition_uniform

from megatron import mpu


class LocalLinearTile(nn.Module):
    """One tile: Y = X W^T (+ b), Megatron's (output, bias) convention, no communication.

    `weight` holds its values ([out_features, in_features], fp32); the bias starts at zero,
    as the mpu layers' biases do.
    """

    def __init__(self, in_features, out_features, bias=True, skip_bias_add=False,
                 weight=None):
        super().__init__()
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(weight if weight is not None else
                                   torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, input_):
        if self.skip_bias_add:
            return F.linear(input_, self.weight), self.bias
        return F.linear(input_, self.weight, self.bias), None


class _TilesFromShard:
    """`linear_cls` for zero.TiledLinear: makes each tile, in the row-major order TiledLinear
    asks for them, from the rows of this rank's shard that `shard` (mpu.ShardRows) hands out.
    Its cuts are TiledLinear's (zero.tiling.partition_uniform)."""

    def __init__(self, shard, rows, columns, in_splits, out_splits, **tile_kwargs):
        self.shard, self.tile_kwargs = shard, tile_kwargs
        self.row_starts = partition_uniform(rows, out_splits)
        self.col_starts = partition_uniform(columns, in_splits)
        self.in_splits, self.made, self.band = in_splits, 0, None

    def __call__(self, in_features, out_features, bias=True):
        o, i = divmod(self.made, self.in_splits)
        if i == 0:  # the first tile of a band of output rows
            self.band = self.shard.take(self.row_starts[o], self.row_starts[o] + out_features)
        col = self.col_starts[i]
        self.made += 1
        return LocalLinearTile(in_features, out_features, bias=bias,
                               weight=self.band[:, col:col + in_features].clone(),
                               **self.tile_kwargs)


def _tag_params(tiled, is_parallel, partition_dim, bias_is_parallel):
    for _, _, tile in tiled.tiles():
        mpu.set_model_parallel_attributes(tile.weight, is_parallel, partition_dim=partition_dim)
        if tile.bias is not None:
            mpu.set_model_parallel_attributes(tile.bias, bias_is_parallel, partition_dim=0)


class _UntiledStateDictMixin:
    """state_dict()/load_state_dict() in the untiled keys: `<prefix>weight` (and the bias)."""

    def _register_untiled_state_dict_hooks(self):
        self.register_state_dict_post_hook(_join_tiles_in_state_dict)
        self.register_load_state_dict_pre_hook(_cut_untiled_weight_into_tiles)

    def _tile_key(self, o, i, name):
        return f"tiled.linears.{o}.{i}.{name}"


def _join_grid(tile, out_splits, in_splits):
    """(weight, bias or None) of a tile grid, `tile(o, i, name)` giving a tile's tensor (None
    where it has none): each row of tiles is joined along the input, the rows along the
    output; the biases are those of each row's last tile."""
    weight = torch.cat([torch.cat([tile(o, i, "weight") for i in range(in_splits)], dim=1)
                        for o in range(out_splits)], dim=0)
    biases = [tile(o, in_splits - 1, "bias") for o in range(out_splits)]
    return weight, torch.cat(biases, dim=0) if all(b is not None for b in biases) else None


def _join_tiles_in_state_dict(module, state_dict, prefix, local_metadata):
    tiled = module.tiled
    weight, bias = _join_grid(
        lambda o, i, name: state_dict.pop(prefix + module._tile_key(o, i, name), None),
        tiled.out_splits, tiled.in_splits)
    # Re-insert a bias the wrapper owns (row parallel) after the weight: Megatron's key order.
    own_bias = state_dict.pop(prefix + "bias", None)
    state_dict[prefix + "weight"] = weight.detach()
    if bias is not None or own_bias is not None:
        state_dict[prefix + "bias"] = (bias if bias is not None else own_bias).detach()


def _cut_untiled_weight_into_tiles(module, state_dict, prefix, local_metadata, strict,
                                   missing_keys, unexpected_keys, error_msgs):
    tiled = module.tiled
    weight = state_dict.get(prefix + "weight")
    if weight is None:
        return  # tile keys given directly, or missing: load_state_dict reports it
    expected = (tiled.out_features, tiled.in_features)
    if tuple(weight.shape) != expected:
        error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape "
                          f"{tuple(weight.shape)}, the tiled layer's shard is {expected}")
        return
    del state_dict[prefix + "weight"]
    bias = state_dict.pop(prefix + "bias", None) if tiled.use_bias else None
    for o, i, _ in tiled.tiles():
        rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
        state_dict[prefix + module._tile_key(o, i, "weight")] = weight[rows, cols]
        if bias is not None and i == tiled.in_splits - 1:
            state_dict[prefix + module._tile_key(o, i, "bias")] = bias[rows]


_TILE_KEY = re.compile(r"^(?P<prefix>.*)tiled\.linears\.(?P<o>\d+)\.(?P<i>\d+)\."
                       r"(?P<name>weight|bias)$")


def join_tiled_weights(state_dict):
    """A flat {name: tensor} (e.g. the fp32 weights ZeRO stage 3 consolidates per parameter)
    with every tiled layer's `<prefix>tiled.linears.<o>.<i>.weight|bias` joined into the
    untiled `<prefix>weight` / `<prefix>bias`, as the tiled modules' state_dict() does; other
    entries unchanged, in their order."""
    tiles = {}  # prefix -> {(o, i, name): tensor}
    result = {}
    for key, tensor in state_dict.items():
        match = _TILE_KEY.match(key)
        if match is None:
            result[key] = tensor
            continue
        prefix = match["prefix"]
        if prefix not in tiles:
            tiles[prefix] = {}
            result[prefix + "weight"] = None  # keep the layer where its first tile was
        tiles[prefix][int(match["o"]), int(match["i"]), match["name"]] = tensor
    for prefix, parts in tiles.items():
        weight, bias = _join_grid(lambda o, i, name: parts.get((o, i, name)),
                                  1 + max(o for o, _, _ in parts),
                                  1 + max(i for _, i, _ in parts))
        result[prefix + "weight"] = weight
        if bias is not None:
            result[prefix + "bias"] = bias
    return result


class TiledColumnParallelLinear(_UntiledStateDictMixin, nn.Module):
    """ColumnParallelLinear (Y = XA, A = [A_1, ..., A_p]) with A_r^T held as a tile grid:
    this rank's shard [output_size / p, input_size] as out_splits x in_splits tiles."""

    def __init__(self, input_size, output_size, in_splits, out_splits, bias=True,
                 gather_output=True, init_method=mpu.init_method_normal(0.02),
                 skip_bias_add=False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        rows = mpu.divide(output_size, mpu.get_model_parallel_world_size())
        shard = mpu.ShardRows((output_size, input_size), 0, init_method)
        self.tiled = TiledLinearReturnBias(
            input_size, rows, bias=bias, in_splits=in_splits, out_splits=out_splits,
            linear_cls=_TilesFromShard(shard, rows, input_size, in_splits, out_splits,
                                       skip_bias_add=skip_bias_add))
        shard.finish()
        _tag_params(self.tiled, True, partition_dim=0, bias_is_parallel=True)
        self._register_untiled_state_dict_hooks()

    def forward(self, input_):
        """Y_r = X A_r + b_r (all-gathered with gather_output); returns (Y, b_r if
        skip_bias_add else None)."""
        input_parallel = mpu.copy_to_model_parallel_region(input_)
        output_parallel, bias = self.tiled(input_parallel)
        if self.gather_output:
            return mpu.gather_from_model_parallel_region(output_parallel), bias
        return output_parallel, bias


class TiledRowParallelLinear(_UntiledStateDictMixin, nn.Module):
    """RowParallelLinear (Y = sum_r X_r A_r + b) with A_r^T [output_size, input_size / p] held
    as a tile grid; the replicated bias stays whole and is added once after the all-reduce."""

    def __init__(self, input_size, output_size, in_splits, out_splits, bias=True,
                 input_is_parallel=False, init_method=mpu.init_method_normal(0.02),
                 skip_bias_add=False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        columns = mpu.divide(input_size, mpu.get_model_parallel_world_size())
        shard = mpu.ShardRows((output_size, input_size), 1, init_method)
        self.tiled = TiledLinearReturnBias(
            columns, output_size, bias=False, in_splits=in_splits, out_splits=out_splits,
            linear_cls=_TilesFromShard(shard, output_size, columns, in_splits, out_splits))
        shard.finish()
        _tag_params(self.tiled, True, partition_dim=1, bias_is_parallel=False)
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
        if self.bias is not None:
            mpu.set_model_parallel_attributes(self.bias, False)  # replicated on every rank
        self._register_untiled_state_dict_hooks()

    def forward(self, input_):
        """Y = sum_r X_r A_r + b; returns (Y, b if skip_bias_add else None)."""
        parallel = mpu.get_model_parallel_world_size() > 1
        if parallel and not self.input_is_parallel:
            input_ = mpu.scatter_to_model_parallel_region(input_)
        output, _ = self.tiled(input_)
        if parallel:
            output = mpu.reduce_from_model_parallel_region(output)
        if self.bias is None or self.skip_bias_add:
            return output, self.bias if self.skip_bias_add else None
        return output + self.bias, None


# (in_splits, out_splits) of each linear of a transformer layer for --tile-factor F, as
# DeepSpeed's Megatron (DSE-Z3) tiles them.
def tile_grid(tile_factor):
    f = tile_factor
    return {"query_key_value": (f, 3 * f), "dense": (f, f),
            "dense_h_to_4h": (f, 4 * f), "dense_4h_to_h": (4 * f, f)}


def column_parallel_linear(config, name, input_size, output_size, **kwargs):
    """The transformer's column-parallel linear `name`: tiled under
    config.memory_centric_tiled_linear, else mpu's."""
    if not config.memory_centric_tiled_linear:
        return mpu.ColumnParallelLinear(input_size, output_size, **kwargs)
    return TiledColumnParallelLinear(input_size, output_size,
                                     *tile_grid(config.tile_factor)[name], **kwargs)


def row_parallel_linear(config, name, input_size, output_size, **kwargs):
    """The transformer's row-parallel linear `name` (see column_parallel_linear)."""
    if not config.memory_centric_tiled_linear:
        return mpu.RowParallelLinear(input_size, output_size, **kwargs)
    return TiledRowParallelLinear(input_size, output_size, *tile_grid(config.tile_factor)[name],
                                  **kwargs)
