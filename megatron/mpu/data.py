"""Broadcast a batch from tensor-parallel rank 0 to the rest of its group.

Only one rank per tensor-parallel group reads data; the others receive it here, in two
broadcasts: the sizes of every tensor, then all tensors flattened into one.
"""

import torch
import torch.distributed as dist

from zero.comm.agreement import collective_device
from megatron.mpu.initialize import (get_model_parallel_group, get_model_parallel_rank,
                                     get_model_parallel_src_rank,
                                     get_model_parallel_world_size)

_MAX_DATA_DIM = 4


def _broadcast_sizes(keys, data, group, device):
    """{key: shape} of the source rank's tensors, known on every rank afterwards."""
    sizes = torch.zeros(len(keys) * _MAX_DATA_DIM, dtype=torch.long)
    if get_model_parallel_rank() == 0:
        for i, key in enumerate(keys):
            shape = data[key].shape
            assert len(shape) <= _MAX_DATA_DIM, \
                f"broadcast_data supports up to {_MAX_DATA_DIM} dims, {key!r} has {len(shape)}"
            sizes[i * _MAX_DATA_DIM: i * _MAX_DATA_DIM + len(shape)] = torch.tensor(shape)
    sizes = sizes.to(device)
    dist.broadcast(sizes, get_model_parallel_src_rank(), group=group)
    sizes = sizes.cpu().view(len(keys), _MAX_DATA_DIM).tolist()
    # Trailing zeros are padding (a real dim of size 0 would carry no data anyway).
    return {key: [d for d in row if d > 0] for key, row in zip(keys, sizes)}


def broadcast_data(keys, data, datatype):
    """{key: tensor} for `keys`, taken from `data` on tensor-parallel rank 0 and received
    on the other ranks of its group (whose `data` may be None).  All tensors must have
    dtype `datatype`.
    """
    if get_model_parallel_world_size() == 1 or get_model_parallel_rank() == 0:
        for key in keys:
            assert data[key].dtype == datatype, \
                f"{key!r} has dtype {data[key].dtype}, broadcast_data expected {datatype}"
    if get_model_parallel_world_size() == 1:
        return {key: data[key] for key in keys}
    group = get_model_parallel_group()
    device = collective_device(group)
    shapes = _broadcast_sizes(keys, data, group, device)
    numels = [torch.Size(shapes[key]).numel() for key in keys]
    if get_model_parallel_rank() == 0:
        flat = torch.cat([data[key].reshape(-1).to(device) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, get_model_parallel_src_rank(), group=group)
    return {key: piece.view(shapes[key])
            for key, piece in zip(keys, torch.split(flat, numels))}
