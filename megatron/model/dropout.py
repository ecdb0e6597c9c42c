"""Dropout whose mask is cheap to draw on CPU.

torch's CPU dropout draws one Bernoulli sample per element, which costs more than the
attention it is applied to (and is paid again by every checkpoint recompute). Here one
full-range 64-bit draw (`random_(-2**63, None)`) gives four 16-bit uniform lanes, so a mask
costs a quarter of the draws and one compare over contiguous lanes: an element is dropped when
its lane is below round(p · 65536), i.e. with probability p rounded to a multiple of 1/65536
(0.1 -> 0.100006); kept elements are scaled by 1 / (1 - p) as torch does. The draws come from
the default CPU generator, so `torch.manual_seed`, the model-parallel RNG tracker and
checkpoint recompute (which restore that generator's state) replay the same masks.
Measurements: docs/design/cpu-dropout-attention.md.

On other devices (CUDA's dropout is a fused Philox kernel), for p outside (0, 1) and inside a
torch.compile'd region this is `torch.nn.functional.dropout`. Compiled, inductor draws the mask
inside the kernel that consumes it, from seeds it takes off the default generator at each
call, so seeding, resume and checkpoint recompute (which restores that generator) replay the
same masks there too; they are other masks than eager's.
"""

import torch
import torch.nn.functional as F

_LANES = 4  # 16-bit lanes per full-range int64 draw
_INT64_MIN = -2 ** 63


def dropout(tensor, p, training=True):
    if not training or p == 0.0:
        return tensor
    if tensor.device.type != "cpu" or not 0.0 < p < 1.0 or torch.compiler.is_compiling():
        return F.dropout(tensor, p, training=True)
    return _MaskedScale.apply(tensor, keep_mask(tensor.shape, p), 1.0 / (1.0 - p))


def keep_mask(shape, p):
    """A bool tensor of `shape`: True with probability 1 - p (p in multiples of 1/65536)."""
    numel = 1
    for size in shape:
        numel *= size
    draws = torch.empty((numel + _LANES - 1) // _LANES, dtype=torch.int64)
    draws.random_(_INT64_MIN, None)  # all 64 bits uniform
    lanes = draws.view(torch.int16)  # uniform over [-32768, 32767]
    threshold = round(p * 65536) - 32768
    return (lanes >= threshold)[:numel].view(shape)


def drop_unscaled(tensor, p):
    """CPU: `tensor` with elements dropped with probability p, the kept ones NOT scaled by
    1 / (1 - p): the caller scales something smaller instead (attention scales its [s, hn]
    context rather than its [s, s] probabilities). Backward keeps the 1-byte mask only."""
    return _MaskedScale.apply(tensor, keep_mask(tensor.shape, p), 1.0)


class _MaskedScale(torch.autograd.Function):
    """tensor * keep * scale, keeping only the 1-byte mask for backward (as torch does)."""

    @staticmethod
    def forward(ctx, tensor, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _mask_and_scale(tensor, keep, scale)

    @staticmethod
    def backward(ctx, grad):
        keep, = ctx.saved_tensors
        return _mask_and_scale(grad, keep, ctx.scale), None, None


_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _mask_and_scale(tensor, keep, scale):
    # Multiplying the float's bit pattern by the 0/1 mask bytes keeps or zeroes each element
    # exactly, 5x faster on CPU than tensor * keep, which first converts the bool mask to the
    # float dtype (bf16 0.5M elements: 0.25 against 1.25 ms). A dropped element becomes +0.0
    # even where it was negative, inf or NaN (x * 0 would give -0.0 or NaN): it contributes
    # nothing either way.
    bits = tensor.view(_SAME_WIDTH_INT[tensor.element_size()])
    out = bits.mul(keep.view(torch.uint8)).view(tensor.dtype)
    return out if scale == 1.0 else out.mul_(scale)
