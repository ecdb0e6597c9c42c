"""The block-wise codes of Adam8bit and Adam4bit, and the row kernels that step with them
(zero/optim/quantized_adam.py says how blocks follow the original parameters).

Both codes compand a block's values by its absmax `s` so small values keep precision:

    8 bits, blocks of 256 (one byte per element):
      first moment m (signed):   q = round(127 sign(x) sqrt|x/s|),  x = s (q/127)|q/127|
      second moment v:           q = round(255 (x/s)^(1/4)),        x = s ((q/255)^2)^2
    4 bits, blocks of 128 (two elements per byte):
      m:                         q = round(7 sign(x) sqrt|x/s|),    x = s (q/7)|q/7|
      v, without a zero:         q = max(0, round(16 (x/s)^(1/4)) - 1), x = s ((q+1)/16)^4

The 4-bit second moment has no code for zero (Li et al. 2023, "Memory Efficient Optimizers
with 4-bit States": a v rounded to zero turns m / sqrt(v) into a huge update); its smallest
value is s/65536. Division, square root, products and rounding are correctly rounded on every
SIMD path and the code points sit far from rounding boundaries, so requantising a dequantised
value gives the same code: a checkpoint that holds the dequantised moments resumes exactly.

A kernel steps rows of one block each (one scale per row): dequantise, AdamW, the rows' new
absmax, requantise. The kernels go through torch.compile (one pass over memory for whole
blocks; dynamic in the number of rows), or run eagerly where compiling fails.
"""

from dataclasses import dataclass

import torch

# elements per pass: eager passes make fp32 temporaries of this size, so they stay small; a
# compiled pass makes none (only the first step after a load does: 8 B per element)
EAGER_CHUNK = 1 << 20
COMPILED_CHUNK = 1 << 24


def _safe(scale):
    """The scale with zero and subnormal values raised to the smallest normal float, so its
    reciprocal stays finite (a zero block quantises to zeros; m of a rarely seen embedding row
    decays into subnormals)."""
    return scale.clamp(min=torch.finfo(torch.float32).tiny)


def _signed_ratio_code(x, scale, top):
    """round(top · sign(x) · sqrt|x / scale|) as float: the signed code of both widths."""
    ratio = x * (1 / _safe(scale)).unsqueeze(-1)  # one division per row, not per element
    return (ratio.abs().sqrt() * top).round().mul(ratio.sign())


def _fourth_root_ratio(x, scale):
    """(x / scale)^(1/4) for non-negative x, written on sqrt(x), which the AdamW update
    computes anyway (a compiled step computes it once)."""
    return (x.sqrt() * (1 / _safe(scale).sqrt()).unsqueeze(-1)).sqrt()


# ------------------------------------------------------------------------------ 8 bits

def quantize_signed(x, scale):
    """int8 codes of `x` [..., 256] with per-row absmax `scale` [...]."""
    return _signed_ratio_code(x, scale, 127).to(torch.int8)


def dequantize_signed(codes, scale):
    y = codes.float() * (1 / 127)
    return (y * y.abs()) * scale.unsqueeze(-1)


def quantize_unsigned(x, scale):
    """uint8 codes of non-negative `x` [..., 256] with per-row max `scale` [...]."""
    return (_fourth_root_ratio(x, scale) * 255).round().to(torch.uint8)


def dequantize_unsigned(codes, scale):
    y = codes.float() * (1 / 255)
    y = y * y
    return (y * y) * scale.unsqueeze(-1)


# ------------------------------------------------------------------------------ 4 bits
# Codes are nibbles 0..15, two per byte: byte j of a block's row holds element j in its low
# half and element j + block/2 in its high half (halves of the row, not neighbours, so packing
# and unpacking read and write contiguous runs and vectorise). The signed code q in -7..7 is
# stored as q + 8.

def _pack(low, high):
    return low | (high << 4)


def pack_nibbles(nibbles):
    """uint8 [..., 2n] of values 0..15 -> uint8 [..., n]."""
    return _pack(*nibbles.chunk(2, dim=-1))


def unpack_nibbles(packed):
    """uint8 [..., n] -> uint8 [..., 2n] of values 0..15."""
    return torch.cat((packed & 15, packed >> 4), dim=-1)


def _nibble_m4(x, scale):
    return (_signed_ratio_code(x, scale, 7) + 8).to(torch.uint8)


def _value_m4(nibbles, scale):
    y = (nibbles.float() - 8) * (1 / 7)
    return (y * y.abs()) * scale.unsqueeze(-1)


def _nibble_v4(x, scale):
    return (_fourth_root_ratio(x, scale) * 16).round().sub(1).clamp(0, 15).to(torch.uint8)


def _value_v4(nibbles, scale):
    y = (nibbles.float() + 1) * (1 / 16)
    y = y * y
    return (y * y) * scale.unsqueeze(-1)


def quantize_signed4(x, scale):
    """Packed 4-bit codes of `x` [..., 128] with per-row absmax `scale` [...]."""
    return pack_nibbles(_nibble_m4(x, scale))


def dequantize_signed4(packed, scale):
    return _value_m4(unpack_nibbles(packed), scale)


def quantize_unsigned4(x, scale):
    """Packed zero-free 4-bit codes of non-negative `x` [..., 128] with per-row max `scale`."""
    return pack_nibbles(_nibble_v4(x, scale))


def dequantize_unsigned4(packed, scale):
    return _value_v4(unpack_nibbles(packed), scale)


def _step_and_quantize_4bit(param, grad, m_codes, m_scale, v_codes, v_scale, hyper):
    """The in-place step of whole 4-bit blocks, written on the two halves of each row (the
    low and the high nibbles): every expression is then elementwise on [rows, block/2], so
    the compiler fuses it into one pass instead of materialising fp32 moments to pack them."""
    half = param.shape[-1] // 2
    updates = []
    for nibble, columns in ((lambda c: c & 15, slice(0, half)),
                            (lambda c: c >> 4, slice(half, None))):
        updates.append(adamw_update(param[:, columns], grad[:, columns],
                                    _value_m4(nibble(m_codes), m_scale),
                                    _value_v4(nibble(v_codes), v_scale), hyper))
    (param_low, m_low, v_low), (param_high, m_high, v_high) = updates
    param.copy_(torch.cat((param_low, param_high), dim=-1))
    # torch.maximum propagates a NaN, as amax over the whole row does
    new_m_scale = torch.maximum(m_low.abs().amax(1), m_high.abs().amax(1))
    new_v_scale = torch.maximum(v_low.amax(1), v_high.amax(1))
    m_codes.copy_(_pack(_nibble_m4(m_low, new_m_scale), _nibble_m4(m_high, new_m_scale)))
    v_codes.copy_(_pack(_nibble_v4(v_low, new_v_scale), _nibble_v4(v_high, new_v_scale)))
    m_scale.copy_(new_m_scale)
    v_scale.copy_(new_v_scale)


# ------------------------------------------------------------------------------ the formats

@dataclass(frozen=True)
class Code:
    """One storage format of the two moments."""
    name: str
    block: int                # elements per block (one scale each)
    per_element: bool         # codes indexed like the elements (8 bits), else one row of
                              # bytes per block ("slot"; 4 bits: block / 2 bytes)
    m_dtype: torch.dtype
    quantize_m: object
    dequantize_m: object
    quantize_v: object
    dequantize_v: object
    value_m: object           # dequantise codes one element per byte (unpacked), as
    value_v: object           # checkpoints hold them
    pad_m: int = 0            # the byte a padded row position holds: codes of m = 0 and of
    pad_v: int = 0            # the smallest v, which never raise a block's absmax
    fused_step: object = None  # a step_and_quantize written for the compiler (else generic)

    @property
    def row_bytes(self):
        return self.block if self.per_element else self.block // 2

    @property
    def bytes_per_element(self):
        """Bytes of both moments' codes per element."""
        return 2 * self.row_bytes / self.block


EIGHT_BIT = Code("8-bit", 256, True, torch.int8, quantize_signed, dequantize_signed,
                 quantize_unsigned, dequantize_unsigned, dequantize_signed,
                 dequantize_unsigned)
FOUR_BIT = Code("4-bit", 128, False, torch.uint8, quantize_signed4, dequantize_signed4,
                quantize_unsigned4, dequantize_unsigned4, _value_m4, _value_v4,
                pad_m=0x88, pad_v=0x00, fused_step=_step_and_quantize_4bit)
CODES = {code.name: code for code in (EIGHT_BIT, FOUR_BIT)}


# ------------------------------------------------------------------------------ the kernels

def adamw_update(param, grad, m, v, hyper):
    """One AdamW update: (new param, new m, new v) in fp32. hyper = [lr, beta1, beta2, eps,
    weight decay, bias correction 1, bias correction 2], a tensor, so a compiled kernel
    takes every step's values without recompiling."""
    lr, beta1, beta2, eps, weight_decay, correction1, correction2 = hyper.unbind()
    grad = grad.float()
    m = m * beta1 + grad * (1 - beta1)
    v = v * beta2 + (grad * grad) * (1 - beta2)
    update = m / (v.sqrt() * (1 / correction2.sqrt()) + eps)
    return param.float() * (1 - lr * weight_decay) - update * (lr / correction1), m, v


def _row_functions(code):
    """The eager row kernels of one code: (step and quantize in place, step, step from fp32
    moments, quantize)."""

    def step(param, grad, m_codes, m_scale, v_codes, v_scale, hyper):
        """Dequantise, update `param` rows in place; the updated fp32 (m, v)."""
        new_param, m, v = adamw_update(param, grad, code.dequantize_m(m_codes, m_scale),
                                       code.dequantize_v(v_codes, v_scale), hyper)
        param.copy_(new_param)
        return m, v

    def step_from(param, grad, m, v, hyper):
        """`step` from fp32 moments (a loaded checkpoint's)."""
        new_param, m, v = adamw_update(param, grad, m, v, hyper)
        param.copy_(new_param)
        return m, v

    def quantize(m, v, m_scale, v_scale):
        return code.quantize_m(m, m_scale), code.quantize_v(v, v_scale)

    def step_and_quantize(param, grad, m_codes, m_scale, v_codes, v_scale, hyper):
        """The whole step of whole blocks that no other piece shares, all in place: one pass
        over memory when compiled."""
        m, v = step(param, grad, m_codes, m_scale, v_codes, v_scale, hyper)
        new_m_scale, new_v_scale = m.abs().amax(1), v.amax(1)
        m_codes.copy_(code.quantize_m(m, new_m_scale))
        v_codes.copy_(code.quantize_v(v, new_v_scale))
        m_scale.copy_(new_m_scale)
        v_scale.copy_(new_v_scale)

    return code.fused_step or step_and_quantize, step, step_from, quantize


@dataclass(frozen=True)
class RowKernels:
    step_and_quantize: object
    step: object
    step_from: object
    quantize: object
    chunk: int = EAGER_CHUNK


_EAGER = {}
_COMPILED = {}  # filled on first use: compiling costs seconds, and not every run needs it


def row_kernels(code, compiled):
    if code.name not in _EAGER:
        _EAGER[code.name] = RowKernels(*_row_functions(code))
    if not compiled:
        return _EAGER[code.name]
    if code.name not in _COMPILED:
        _COMPILED[code.name] = compile_kernels(code)
    return _COMPILED[code.name]


def compile_kernels(code):
    """The row kernels through torch.compile (dynamic in the number of rows), or eager with
    one line saying why when this machine cannot compile (no C++ compiler, say)."""
    # inductor decides whether a kernel runs on the OpenMP threads from the sizes of the
    # call that compiled it, and keeps that choice for every later size: the two-row
    # warm-up below would give one-thread kernels (measured: 2x slower on 2 cores).
    # dynamic_threads makes every kernel parallel and leaves small calls to OpenMP.
    options = {"cpp.dynamic_threads": True}
    try:
        kernels = RowKernels(*(torch.compile(fn, dynamic=True, options=options)
                               for fn in _row_functions(code)), chunk=COMPILED_CHUNK)
        rows = torch.zeros(2, code.block)  # compile now, so a failure shows here, not mid-step
        codes = torch.zeros(2, code.row_bytes, dtype=torch.uint8)
        hyper = torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001])
        kernels.step_and_quantize(rows.clone(), rows, codes.to(code.m_dtype), torch.zeros(2),
                                  codes.clone(), torch.zeros(2), hyper)
        return kernels
    except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
        print(f" note: the {code.name} Adam runs its step eagerly (torch.compile failed: "
              f"{str(error).splitlines()[0][:120]})", flush=True)
        return row_kernels(code, compiled=False)
