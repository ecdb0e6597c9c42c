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

On other devices (CUDA's dropout is a fused Philox kernel) and for p outside (0, 1) this is
`torch.nn.functional.dropout`. Inside a torch.compile'd region on the CPU, where inductor's
own random numbers cost ~10 ns an element, the mask is a counter-based hash instead
(`hashed_keep_mask`): one seed drawn from the default generator per mask, hashed with each
element's index, in integer ops inductor fuses into the kernel that consumes the mask. So
seeding, resume and checkpoint recompute (which restore that generator) replay the same masks
there too; they are other masks than eager's. A `stream` keeps per-rank masks apart without
swapping generators: attention dropout hashes in its tensor-parallel rank, as the tracker's
per-rank generator gives each rank its own masks in eager.
"""

import math

import torch
import torch.nn.functional as F

_LANES = 4  # 16-bit lanes per full-range int64 draw
_INT64_MIN = -2 ** 63


def dropout(tensor, p, training=True):
    if not training or p == 0.0:
        return tensor
    if tensor.device.type != "cpu" or not 0.0 < p < 1.0:
        return F.dropout(tensor, p, training=True)
    if masks_in_graph(tensor):
        return _hashed_dropout(tensor, p, 1.0 / (1.0 - p), stream=0)
    return _MaskedScale.apply(tensor, keep_mask(tensor.shape, p), 1.0 / (1.0 - p))


def masks_in_graph(tensor):
    """Whether dropout masks on `tensor` are hashed inside the graph being compiled (CPU)
    rather than drawn from a generator."""
    return torch.compiler.is_compiling() and tensor.device.type == "cpu"


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


_MASK32 = 0xFFFFFFFF
# A 32-bit xorshift-multiply hash (one of those found by Chris Wellons' "hash prospector"):
# a bijection of [0, 2**32). Both multipliers are below 2**30, so on int64 tensors holding
# 32-bit values no product overflows.
_HASH_ROUNDS = ((15, 0x2C1B3C6D), (12, 0x297A2D39))
_HASH_LAST_SHIFT = 15


def _hash32(x):
    """The hash of x in [0, 2**32): an int64 tensor elementwise, or a Python int."""
    for shift, multiplier in _HASH_ROUNDS:
        x = ((x ^ (x >> shift)) * multiplier) & _MASK32
    return x ^ (x >> _HASH_LAST_SHIFT)


def hashed_keep_mask(shape, p, key):
    """A bool tensor of `shape`, True with probability 1 - p (p in multiples of 1/65536):
    element i is kept when the top 16 bits of hash(hash(i) ^ key) reach round(p · 65536),
    with i's high 32 bits, past 2**32 elements, hashed in as well."""
    numel = math.prod(shape)
    index = torch.arange(numel, device=key.device).view(shape)
    mixed = _hash32(index & _MASK32) ^ key
    if numel > _MASK32 + 1:
        mixed = mixed ^ _hash32(index >> 32)
    return (_hash32(mixed) >> 16) >= round(p * 65536)


def _hashed_dropout(tensor, p, scale, stream):
    """Compiled code's dropout (`masks_in_graph`): key = hash(seed ^ hash(stream)), the seed
    one 31-bit draw from the default generator."""
    seed = torch.randint(0, 2 ** 31, (), device=tensor.device)
    return _HashedMaskedScale.apply(tensor, _hash32(seed ^ _hash32(stream)), p, scale)


def drop_unscaled(tensor, p, stream):
    """CPU: `tensor` with elements dropped with probability p, the kept ones NOT scaled by
    1 / (1 - p): the caller scales something smaller instead (attention scales its [s, hn]
    context rather than its [s, s] probabilities). Backward keeps the 1-byte mask only (in a
    compiled graph, the mask's key). `stream`: the hashed masks' stream inside a compiled
    graph (see the module docstring); eager draws from whichever generator is current."""
    if masks_in_graph(tensor):
        return _hashed_dropout(tensor, p, 1.0, stream)
    return _MaskedScale.apply(tensor, keep_mask(tensor.shape, p), 1.0)


class _HashedMaskedScale(torch.autograd.Function):
    """where(keep, tensor · scale, 0) with keep = hashed_keep_mask(key). Backward keeps only
    the key and hashes the mask again, inside the kernel that takes the gradient: inductor
    writes a bool mask out of its 64-bit hash lanes slowly (3-4x the hash itself), and a
    saved mask would also cost a byte per element. `key ^ 0` makes backward's hash a node of
    its own; otherwise the joint graph's common-subexpression pass merges it with forward's
    and the partitioner saves the mask after all."""

    @staticmethod
    def forward(ctx, tensor, key, p, scale):
        ctx.save_for_backward(key)
        ctx.p, ctx.scale = p, scale
        return _where_kept(tensor, key, p, scale)

    @staticmethod
    def backward(ctx, grad):
        key, = ctx.saved_tensors
        return _where_kept(grad, key ^ 0, ctx.p, ctx.scale), None, None, None


def _where_kept(tensor, key, p, scale):
    return torch.where(hashed_keep_mask(tensor.shape, p, key), tensor * scale, 0.0)


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
