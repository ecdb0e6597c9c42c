"""The 8-bit code and the row kernels of Adam8bit (zero/optim/adam8bit.py, which says what
the code is and how blocks follow the original parameters).

A kernel steps rows of BLOCK elements, each row one block with its own scale: dequantise,
AdamW, the blocks' new absmax, requantise. The kernels go through torch.compile (one pass over
memory for whole blocks; dynamic in the number of rows), or run eagerly where compiling fails.
"""

from dataclasses import dataclass

import torch

BLOCK = 256
# elements per pass: eager passes make fp32 temporaries of this size, so they stay small; a
# compiled pass makes none (only the first step after a load does: 8 B per element)
EAGER_CHUNK = BLOCK * 4096
COMPILED_CHUNK = BLOCK * 65536


# ------------------------------------------------------------------------------ the code

def quantize_signed(x, scale):
    """int8 codes of `x` [..., B] with per-row absmax `scale` [...]."""
    ratio = x * (1 / _safe(scale)).unsqueeze(-1)  # one division per row, not per element
    return (ratio.abs().sqrt() * 127).round().mul(ratio.sign()).to(torch.int8)


def dequantize_signed(codes, scale):
    y = codes.float() * (1 / 127)
    return (y * y.abs()) * scale.unsqueeze(-1)


def quantize_unsigned(x, scale):
    """uint8 codes of non-negative `x` [..., B] with per-row max `scale` [...]. Written on
    sqrt(x), which the AdamW update computes anyway (a compiled step computes it once)."""
    ratio = x.sqrt() * (1 / _safe(scale).sqrt()).unsqueeze(-1)
    return (ratio.sqrt() * 255).round().to(torch.uint8)


def dequantize_unsigned(codes, scale):
    y = codes.float() * (1 / 255)
    y = y * y
    return (y * y) * scale.unsqueeze(-1)


def _safe(scale):
    """The scale with zero and subnormal values raised to the smallest normal float, so its
    reciprocal stays finite (a zero block quantises to zeros; m of a rarely seen embedding row
    decays into subnormals)."""
    return scale.clamp(min=torch.finfo(torch.float32).tiny)


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


def _step_rows(param, grad, m_codes, m_scale, v_codes, v_scale, hyper):
    """Dequantise, update `param` rows in place; the updated fp32 (m, v)."""
    new_param, m, v = adamw_update(param, grad, dequantize_signed(m_codes, m_scale),
                             dequantize_unsigned(v_codes, v_scale), hyper)
    param.copy_(new_param)
    return m, v


def _step_rows_from(param, grad, m, v, hyper):
    """_step_rows from fp32 moments (a loaded checkpoint's)."""
    new_param, m, v = adamw_update(param, grad, m, v, hyper)
    param.copy_(new_param)
    return m, v


def _quantize_rows(m, v, m_scale, v_scale):
    return quantize_signed(m, m_scale), quantize_unsigned(v, v_scale)


def _step_and_quantize_rows(param, grad, m_codes, m_scale, v_codes, v_scale, hyper):
    """The whole step of whole blocks that no other piece shares, all in place: one pass
    over memory when compiled."""
    m, v = _step_rows(param, grad, m_codes, m_scale, v_codes, v_scale, hyper)
    new_m_scale, new_v_scale = m.abs().amax(1), v.amax(1)
    m_codes.copy_(quantize_signed(m, new_m_scale))
    v_codes.copy_(quantize_unsigned(v, new_v_scale))
    m_scale.copy_(new_m_scale)
    v_scale.copy_(new_v_scale)


@dataclass(frozen=True)
class RowKernels:
    step_and_quantize: object
    step: object
    step_from: object
    quantize: object
    chunk: int = EAGER_CHUNK


EAGER_KERNELS = RowKernels(_step_and_quantize_rows, _step_rows, _step_rows_from, _quantize_rows)
_COMPILED = []  # filled on first use: compiling costs seconds, and not every run needs it


def row_kernels(compiled):
    if not compiled:
        return EAGER_KERNELS
    if not _COMPILED:
        _COMPILED.append(compile_kernels())
    return _COMPILED[0]


def compile_kernels():
    """The row kernels through torch.compile (dynamic in the number of rows), or eager with
    one line saying why when this machine cannot compile (no C++ compiler, say)."""
    # inductor decides whether a kernel runs on the OpenMP threads from the sizes of the
    # call that compiled it, and keeps that choice for every later size: the two-row
    # warm-up below would give one-thread kernels (measured: 2x slower on 2 cores).
    # dynamic_threads makes every kernel parallel and leaves small calls to OpenMP.
    options = {"cpp.dynamic_threads": True}
    try:
        kernels = RowKernels(*(torch.compile(fn, dynamic=True, options=options) for fn in (
            _step_and_quantize_rows, _step_rows, _step_rows_from, _quantize_rows)),
            chunk=COMPILED_CHUNK)
        rows = torch.zeros(2, BLOCK)  # compile now, so a failure shows here, not mid-step
        hyper = torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001])
        kernels.step_and_quantize(rows.clone(), rows, rows.to(torch.int8), torch.zeros(2),
                                  rows.to(torch.uint8), torch.zeros(2), hyper)
        return kernels
    except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
        print(f" note: Adam8bit runs its step eagerly (torch.compile failed: "
              f"{str(error).splitlines()[0][:120]})", flush=True)
        return EAGER_KERNELS
