"""Tensor-parallel embedding and linear layers.

Weights are initialised independently of the parallel layout: the full ("master") weight is
defined as generated in fixed row chunks from the global CPU generator, in the same order on
every rank, and each rank keeps only its slice.  A shard at tensor-parallel size p is thus
bit for bit the slice of the tensor a single process would build, and memory stays at one
chunk.  Initialisation runs on CPU in fp32; the caller moves and casts the module.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.mpu.initialize import get_model_parallel_rank, get_model_parallel_world_size
from megatron.mpu.mappings import (copy_to_model_parallel_region,
                                   gather_from_model_parallel_region,
                                   reduce_from_model_parallel_region,
                                   scatter_to_model_parallel_region)
from megatron.mpu.utils import VocabUtility, divide

# Chunks of the master weight hold at most this many elements (whole rows of dim 0).
_INIT_CHUNK_ELEMENTS = 2 ** 22


def init_method_normal(std):
    """Fill a tensor in place from N(0, std).

    Init methods must be element-wise (not depend on the tensor's shape, as xavier does):
    they are applied to row chunks of the master weight.
    """
    def init_(tensor):
        return nn.init.normal_(tensor, mean=0.0, std=std)
    return init_


def scaled_init_method_normal(std, num_layers):
    """N(0, std / sqrt(2 * num_layers)) for the projections that feed the residual stream."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def set_model_parallel_attributes(param, is_parallel, partition_dim=0, stride=1):
    """Tag a parameter so that grad-norm, checkpoint merge and ZeRO know how it is split."""
    param.model_parallel = is_parallel
    if is_parallel:
        param.partition_dim = partition_dim
        param.partition_stride = stride


def _fp32_cpu_empty(*shape):
    return torch.empty(*shape, dtype=torch.float32, device="cpu")


def _local_indices(full_size, partition_dim_rank, world_size, stride):
    """Indices of the master weight's partition dim that this rank keeps, ascending.

    The dim is cut into stride * world_size blocks; rank r keeps blocks r, r + p, r + 2p, ...
    (stride > 1 interleaves, e.g. to keep Q, K and V blocks together on a rank).
    """
    block = divide(full_size, stride * world_size)
    starts = [(k * world_size + partition_dim_rank) * block for k in range(stride)]
    return torch.cat([torch.arange(s, s + block) for s in starts])


def _master_weight_chunks(full_shape, init_method):
    """Yield (row_start, row_end, chunk): the master weight, generated chunk by chunk.

    Chunks are whole rows of dim 0 with at most 2**22 elements, so their boundaries depend
    on the full shape only, never on the parallel layout.
    """
    row_elements = max(1, math.prod(full_shape[1:]))
    rows_per_chunk = max(1, _INIT_CHUNK_ELEMENTS // row_elements)
    for row_start in range(0, full_shape[0], rows_per_chunk):
        row_end = min(row_start + rows_per_chunk, full_shape[0])
        chunk = torch.empty((row_end - row_start,) + tuple(full_shape[1:]), dtype=torch.float32)
        init_method(chunk)
        yield row_start, row_end, chunk


def _check_init_target(weight):
    assert weight.dtype == torch.float32 and weight.device.type == "cpu", \
        "initialise on CPU in fp32, then move and cast the module"


@torch.no_grad()
def initialize_affine_weight(weight, full_shape, partition_dim, init_method, stride=1):
    """Fill `weight` with this rank's slice of the master weight of shape `full_shape`.

    Every rank generates every chunk of the master weight on the global CPU generator, so
    all ranks consume the RNG identically whatever their layout, and keeps its own slice.
    """
    _check_init_target(weight)
    keep = _local_indices(full_shape[partition_dim], get_model_parallel_rank(),
                          get_model_parallel_world_size(), stride)
    for row_start, row_end, chunk in _master_weight_chunks(full_shape, init_method):
        if partition_dim == 0:
            in_chunk = (keep >= row_start) & (keep < row_end)
            positions = in_chunk.nonzero().squeeze(1)
            weight.index_copy_(0, positions, chunk.index_select(0, keep[positions] - row_start))
        else:
            weight[row_start:row_end] = chunk.index_select(partition_dim, keep)


class ShardRows:
    """This rank's shard of a master weight, handed out band of rows by band of rows.

    The master weight is generated chunk by chunk exactly as `initialize_affine_weight`
    generates it (the same stream of the global CPU generator), so a layer built in pieces
    (tiles) holds the same values as the whole layer would, without ever holding its whole
    shard: `take(lo, hi)` returns shard rows [lo, hi) ([hi - lo, shard columns]); ranges
    come in increasing order; `finish()` draws what is left, so the generator ends where
    `initialize_affine_weight` leaves it.
    """

    def __init__(self, full_shape, partition_dim, init_method, stride=1):
        keep = _local_indices(full_shape[partition_dim], get_model_parallel_rank(),
                              get_model_parallel_world_size(), stride)
        # shard row j is full row `rows[j]`; its columns are `columns` (None: all)
        self.rows = keep if partition_dim == 0 else torch.arange(full_shape[0])
        self.columns = keep if partition_dim == 1 else None
        self.width = len(keep) if partition_dim == 1 else math.prod(full_shape[1:])
        self._chunks = _master_weight_chunks(full_shape, init_method)
        self._chunk = (0, 0, None)  # (first row, end row, values) of the current chunk

    @torch.no_grad()
    def take(self, lo, hi):
        full_rows = self.rows[lo:hi]
        out = torch.empty(hi - lo, self.width, dtype=torch.float32)
        done = 0
        while done < len(full_rows):
            start, end, chunk = self._chunk
            if full_rows[done] >= end:
                self._chunk = next(self._chunks)
                continue
            n = int(torch.searchsorted(full_rows[done:], end))  # rows inside this chunk
            values = chunk.reshape(end - start, -1).index_select(
                0, full_rows[done:done + n] - start)
            if self.columns is not None:
                values = values.index_select(1, self.columns)
            out[done:done + n] = values
            done += n
        return out

    def finish(self):
        for _ in self._chunks:
            pass


@torch.no_grad()
def initialize_replicated_weight(weight, init_method):
    """Fill a weight that every rank holds in full, generated in the same chunks."""
    _check_init_target(weight)
    for row_start, row_end, chunk in _master_weight_chunks(tuple(weight.shape), init_method):
        weight[row_start:row_end] = chunk


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split across tensor-parallel ranks.

    Each rank looks up the ids in its vocab range, writes zeros for the others, and the
    all-reduce assembles the full embedding.
    """

    def __init__(self, num_embeddings, embedding_dim, init_method=init_method_normal(0.02)):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        world_size = get_model_parallel_world_size()
        self.vocab_start_index, self.vocab_end_index = \
            VocabUtility.vocab_range_from_global_vocab_size(
                num_embeddings, get_model_parallel_rank(), world_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(_fp32_cpu_empty(self.num_embeddings_per_partition,
                                                   embedding_dim))
        initialize_affine_weight(self.weight, (num_embeddings, embedding_dim), 0, init_method)
        set_model_parallel_attributes(self.weight, True, partition_dim=0, stride=1)

    def forward(self, input_):
        if get_model_parallel_world_size() == 1:
            return F.embedding(input_, self.weight)
        # Ids outside this rank's range look up row 0 and are zeroed afterwards.
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill_(outside, 0)
        output_parallel = F.embedding(local_ids, self.weight)  # [*ids.shape, h]
        output_parallel.masked_fill_(outside.unsqueeze(-1), 0.0)
        return reduce_from_model_parallel_region(output_parallel)


class ColumnParallelLinear(nn.Module):
    """Y = XA + b, with A split along its second dimension: A = [A_1, ..., A_p].

    The weight is stored as A^T, [output_size / p, input_size].  With gather_output the
    output is all-gathered to [.., output_size], otherwise each rank keeps Y_i = XA_i.
    With skip_bias_add the bias is returned instead of added, for a later fused add.
    """

    def __init__(self, input_size, output_size, bias=True, gather_output=True,
                 init_method=init_method_normal(0.02), stride=1, skip_bias_add=False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.output_size_per_partition = divide(output_size, get_model_parallel_world_size())
        self.weight = nn.Parameter(_fp32_cpu_empty(self.output_size_per_partition, input_size))
        initialize_affine_weight(self.weight, (output_size, input_size), 0, init_method, stride)
        set_model_parallel_attributes(self.weight, True, partition_dim=0, stride=stride)
        if bias:
            self.bias = nn.Parameter(_fp32_cpu_empty(self.output_size_per_partition).zero_())
            set_model_parallel_attributes(self.bias, True, partition_dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        """Y = XA + b; returns (Y, b if skip_bias_add else None)."""
        input_parallel = copy_to_model_parallel_region(input_)
        bias = None if self.skip_bias_add else self.bias
        output_parallel = F.linear(input_parallel, self.weight, bias)
        if self.gather_output:
            output = gather_from_model_parallel_region(output_parallel)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Y = XA + b, with A split along its first dimension and X along its second:

             | A_1 |
        A =  | ... |      X = [X_1, ..., X_p]      Y = sum_i X_i A_i + b
             | A_p |

    The weight is stored as A^T, [output_size, input_size / p].  The bias is replicated and
    added once, after the all-reduce.  With input_is_parallel the input is already X_i.
    """

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False,
                 init_method=init_method_normal(0.02), stride=1, skip_bias_add=False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.input_size_per_partition = divide(input_size, get_model_parallel_world_size())
        self.weight = nn.Parameter(_fp32_cpu_empty(output_size, self.input_size_per_partition))
        initialize_affine_weight(self.weight, (output_size, input_size), 1, init_method, stride)
        set_model_parallel_attributes(self.weight, True, partition_dim=1, stride=stride)
        if bias:
            self.bias = nn.Parameter(_fp32_cpu_empty(output_size).zero_())
            set_model_parallel_attributes(self.bias, False)  # replicated on every rank
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        """Y = XA + b; returns (Y, b if skip_bias_add else None)."""
        add_bias = self.bias is not None and not self.skip_bias_add
        returned_bias = self.bias if self.skip_bias_add else None
        if get_model_parallel_world_size() == 1:
            # Nothing to reduce: let F.linear fuse the bias add.
            return F.linear(input_, self.weight, self.bias if add_bias else None), returned_bias
        input_parallel = input_ if self.input_is_parallel else \
            scatter_to_model_parallel_region(input_)
        output = reduce_from_model_parallel_region(F.linear(input_parallel, self.weight))
        return (output + self.bias if add_bias else output), returned_bias
