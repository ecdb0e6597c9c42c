"""Worker side of the tiling tests: tiled layers and a tiled GPT-2 at tensor-parallel size 2.

The parent builds the same things at tensor-parallel size 1 (untiled) and compares.
"""

import torch

import zero
from megatron import mpu
from tests.model import cases

# Sizes of the stand-alone tiled layers: divisible by TP 2 and by the tile counts below.
IN, OUT = 8, 12
COLUMN_GRID = (2, 3)  # (in_splits, out_splits)
ROW_GRID = (3, 2)


def layer_input(width):
    return torch.randn(2, 3, width, generator=torch.Generator().manual_seed(3))


def upstream(width):
    return torch.randn(2, 3, width, generator=torch.Generator().manual_seed(4))


def tiled_parallel_layers():
    """zero.TiledLinearReturnBias with mpu Column/RowParallelLinear tiles, seeded the same way
    at every tensor-parallel size (mpu's layout-independent init)."""
    torch.manual_seed(21)
    column = zero.TiledLinearReturnBias(IN, OUT, in_splits=COLUMN_GRID[0],
                                        out_splits=COLUMN_GRID[1],
                                        linear_cls=mpu.ColumnParallelLinear, gather_output=True)
    row = zero.TiledLinearReturnBias(OUT, IN, in_splits=ROW_GRID[0], out_splits=ROW_GRID[1],
                                     linear_cls=mpu.RowParallelLinear, input_is_parallel=False)
    return column, row


def run_tiled_parallel_layers():
    """Output and input gradient of column tiles followed by row tiles."""
    column, row = tiled_parallel_layers()
    x = layer_input(IN).requires_grad_(True)
    hidden, _ = column(x)
    out, _ = row(torch.tanh(hidden))
    out.backward(upstream(IN))
    return dict(out=out.detach(), input_grad=x.grad.clone())


def run_tiled_model(tile_factor):
    """A tiled GPT-2: its (untiled-key) state dict, losses and logits."""
    model = cases.build_model(11, memory_centric_tiled_linear=True, tile_factor=tile_factor)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    result = cases.loss_and_grads(model, reset=False)
    untiled = cases.build_model(99)  # other weights, then the tiled model's state dict
    untiled.load_state_dict(state)
    untiled_logits = cases.loss_and_grads(untiled, reset=False)["logits"]
    return dict(weights=state, losses=result["losses"], logits=result["logits"],
                untiled_logits=untiled_logits)


def worker(rank, world_size):
    mpu.initialize_model_parallel(world_size)
    return dict(layers=run_tiled_parallel_layers(), model=run_tiled_model(tile_factor=2))
