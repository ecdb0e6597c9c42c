"""Dropout whose mask is cheap to draw on CPU.

torch's CPU dropout draws one Bernoulli sample per element from the default generator
(mt19937): ~9 ms for the 0.5M attention probabilities of 2 x 4 heads x 256² tokens, more than
the attention's matmuls, softmax and backward together. With activation checkpointing the
forward runs twice, so those draws are paid twice. Here one 64-bit draw (`random_()` on int64
yields 63 random bits) gives three 16-bit uniform lanes, so a mask costs a third of the draws
and a compare: an element is dropped when its lane is below round(p · 65536), i.e. with
probability p rounded to a multiple of 1/65536 (0.1 -> 0.100006); kept elements are scaled by
1 / (1 - p) as torch does. The draws come from the default CPU generator, so
`torch.manual_seed`, the model-parallel RNG tracker and checkpoint recompute (which restore
that generator's state) replay the same masks.

On other devices (CUDA's dropout is a fused Philox kernel) and for p outside (0, 1) this is
`torch.nn.functional.dropout`.
"""

import torch
import torch.nn.functional as F

_LANES = 3  # 16-bit lanes used per int64 draw (the fourth holds only 15 random bits)


def dropout(tensor, p, training=True):
    if not training or p == 0.0:
        return tensor
    if tensor.device.type != "cpu" or not 0.0 < p < 1.0:
        return F.dropout(tensor, p, training=True)
    return _MaskedScale.apply(tensor, keep_mask(tensor.shape, p), 1.0 / (1.0 - p))


def keep_mask(shape, p):
    """A bool tensor of `shape`: True with probability 1 - p (p in multiples of 1/65536)."""
    numel = 1
    for size in shape:
        numel *= size
    draws = torch.empty((numel + _LANES - 1) // _LANES, dtype=torch.int64).random_()
    lanes = draws.view(torch.int16).view(-1, 4)[:, :_LANES]  # uniform over [-32768, 32767]
    threshold = round(p * 65536) - 32768
    return (lanes >= threshold).reshape(-1)[:numel].view(shape)


class _MaskedScale(torch.autograd.Function):
    """tensor * keep * scale, keeping only the 1-byte mask for backward (as torch does)."""

    @staticmethod
    def forward(ctx, tensor, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return tensor.mul(keep).mul_(scale)

    @staticmethod
    def backward(ctx, grad):
        keep, = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None, None
