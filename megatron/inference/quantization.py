"""Quantised weights for inference: `--quantize int8 | int8-dynamic | int4`.

    int8          int8 weights, one scale per output channel (absmax / 127); the matmul takes
                  bf16 (or fp16) activations and scales (torch._weight_int8pack_mm; on the CPU
                  its fp32 path is 5-10x slower, so fp32 activations are rounded to bf16)
    int8-dynamic  the same int8 weights, and each call quantises its activations to int8 too
                  with one scale per call (torch's fbgemm/x86 dynamic quantised linear; CPU
                  only), so a row's result depends on the other rows of the call
    int4          int4 weights with a scale and a zero point per group of --quantize-group-size
                  input features (torch._weight_int4pack_mm_for_cpu, bf16 activations as
                  int8's); the tied word embedding, which is also the LM head, stays int8

Every ColumnParallelLinear / RowParallelLinear weight and the word embedding are replaced by
a QuantizedWeight: an object that implements `__torch_function__` for `F.linear` and
`F.embedding`, so the model code runs unchanged.  Scales follow the original parameter, not
the tensor-parallel shard (a row's absmax is reduced over the TP group; int4 groups never
straddle shards), so a TP=2 run holds the weights of TP=1 (int8-dynamic's activation
scales are per rank, as its input slices are).  torch's kernels are CPU kernels
here; on another device the weights are dequantised at each call (memory saved, not time).
"""

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron import mpu
from megatron.errors import ConfigError

SCHEMES = ("int8", "int8-dynamic", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 CPU kernel takes
INT4_ROW_MULTIPLE = 16  # the int4 CPU kernel packs output rows in blocks of 16


@dataclass(frozen=True)
class QuantizationConfig:
    scheme: str
    group_size: int = 128  # int4 only


def add_quantization_arguments(parser):
    g = parser.add_argument_group("quantised weights")
    g.add_argument("--quantize", choices=SCHEMES, default=None,
                   help="int8: int8 weights per output channel; int8-dynamic: int8 weights "
                        "and activations (CPU); int4: int4 weights per group (default: off)")
    g.add_argument("--quantize-group-size", type=int, default=None,
                   choices=INT4_GROUP_SIZES, help="input features per int4 scale (default 128)")
    return parser


def quantization_config(args):
    """The frozen QuantizationConfig of the flags (None without --quantize)."""
    if args.quantize_group_size is not None and args.quantize != "int4":
        raise ConfigError("--quantize-group-size applies to --quantize int4")
    if not args.quantize:
        return None
    return QuantizationConfig(args.quantize, args.quantize_group_size or 128)


# ---- quantise / dequantise (plain tensors; the round trip is what the tests bound) ----

def quantize_int8_rows(weight, row_absmax=None):
    """weight [n, k] -> (int8 codes [n, k], fp32 scale [n]); w ~= codes * scale[:, None].
    row_absmax (the whole row's, when the row is split across ranks) sets the scale."""
    weight = weight.float()
    absmax = weight.abs().amax(dim=1) if row_absmax is None else row_absmax
    scale = absmax / 127.0
    codes = torch.round(weight / scale.clamp(min=1e-30)[:, None]).clamp_(-127, 127)
    return codes.to(torch.int8), scale


def dequantize_int8_rows(codes, scale, dtype=torch.float32):
    return (codes.to(torch.float32) * scale[:, None]).to(dtype)


def quantize_int4_groups(weight, group_size):
    """weight [n, k] -> (codes 0..15 as uint8 [n, k], scale [n, k/g], minimum [n, k/g]);
    w ~= codes * scale + minimum within each group of g input features (asymmetric, so
    groups whose values are all of one sign use all 16 levels)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low) / 15.0
    codes = torch.round((groups - low[..., None]) / scale.clamp(min=1e-30)[..., None])
    return codes.clamp_(0, 15).to(torch.uint8).reshape(n, k), scale, low


def dequantize_int4_groups(codes, scale, minimum, dtype=torch.float32):
    n, k = codes.shape
    groups = codes.reshape(n, scale.shape[1], -1).to(torch.float32)
    return (groups * scale[..., None] + minimum[..., None]).reshape(n, k).to(dtype)


# ---- weights that F.linear / F.embedding run on ----

class QuantizedWeight:
    """Stands where a layer's weight Parameter was.  Each scheme's subclass gives
    linear(x, bias) and nbytes; only the word embedding is ever looked up (embedding())."""

    def __init__(self, shape, device, dtype):
        self.shape, self.device, self.dtype = torch.Size(shape), device, dtype

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return weight.linear(x, bias)
        if func is F.embedding and kwargs.get("max_norm") is None:  # a plain row lookup
            return args[1].embedding(args[0])
        raise TypeError(f"{getattr(func, '__name__', func)} is not defined on a quantised "
                        f"weight ({cls.__name__}); only F.linear and F.embedding are")

    def embedding(self, ids):
        raise TypeError(f"{type(self).__name__} is a linear weight; it is never looked up")

    def _in_dtype(self, name, dtype):
        """Attribute `name` in `dtype`, cast once: torch's kernels take their scales in the
        activations' dtype."""
        casts = self.__dict__.setdefault("_casts", {})
        if (name, dtype) not in casts:
            casts[name, dtype] = getattr(self, name).to(dtype)
        return casts[name, dtype]

    def _finish(self, out, x, bias):
        """The kernel's [n, out] result as x's shape and dtype, plus the bias."""
        out = out.reshape(*x.shape[:-1], self.shape[0]).to(x.dtype)
        return out if bias is None else out + bias


def _flat(x):
    return x.reshape(-1, x.shape[-1])


class Int8Weight(QuantizedWeight):
    """int8 codes + one scale per output row; the matmul dequantises inside torch's kernel."""

    def __init__(self, codes, scale, dtype, use_kernel=True):
        super().__init__(codes.shape, codes.device, dtype)
        self.codes, self.scale = codes, scale
        self.use_kernel = use_kernel and codes.device.type == "cpu"

    @property
    def nbytes(self):
        return self.codes.nbytes + self.scale.nbytes

    def linear(self, x, bias):
        if not self.use_kernel:
            return F.linear(x, dequantize_int8_rows(self.codes, self.scale, x.dtype), bias)
        # The CPU kernel's fp32 path is scalar (5-10x slower than its bf16 path): run fp32
        # activations through it in bf16, accumulating in fp32 inside the kernel.
        dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
        out = torch._weight_int8pack_mm(_flat(x).to(dtype), self.codes,
                                        self._in_dtype("scale", dtype))
        return self._finish(out, x, bias)

    def embedding(self, ids):
        return self.codes[ids].to(self.dtype) * self.scale[ids, None].to(self.dtype)


class Int8DynamicWeight(QuantizedWeight):
    """int8 codes prepacked for torch's dynamic quantised linear (int8 x int8 -> int32), which
    quantises each call's activations with one scale per call (reduce_range, as torch's
    quantize_dynamic does on x86).  keep_rows keeps the codes too, for embedding lookups."""

    def __init__(self, codes, scale, dtype, keep_rows=False):
        super().__init__(codes.shape, codes.device, dtype)
        with warnings.catch_warnings():  # quantised tensors are only the packing's input
            warnings.simplefilter("ignore", UserWarning)
            per_channel = torch.quantize_per_channel(
                dequantize_int8_rows(codes, scale), scale.double().clamp(min=1e-30),
                torch.zeros(codes.shape[0], dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(per_channel, None)
        self._packed_bytes = codes.nbytes + scale.nbytes
        self.rows = Int8Weight(codes, scale, dtype) if keep_rows else None

    @property
    def nbytes(self):
        return self._packed_bytes + (self.rows.nbytes if self.rows is not None else 0)

    def linear(self, x, bias):
        out = torch.ops.quantized.linear_dynamic(_flat(x).float(), self.packed, True)
        return self._finish(out, x, bias)

    def embedding(self, ids):
        if self.rows is None:
            return super().embedding(ids)
        return self.rows.embedding(ids)


class Int4Weight(QuantizedWeight):
    """int4 codes packed by torch for its CPU kernel, with [k/g, n, 2] scales and zeros;
    elsewhere two codes per byte, dequantised at each call."""

    def __init__(self, codes, scale, minimum, group_size, dtype, use_kernel=True):
        super().__init__(codes.shape, codes.device, dtype)
        self.group_size = group_size
        self.use_kernel = use_kernel and codes.device.type == "cpu"
        if self.use_kernel:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            # The kernel computes (code - 8) * scale + zero, so zero = minimum + 8 * scale.
            self.scales_and_zeros = torch.stack([scale, minimum + 8 * scale], dim=-1) \
                .transpose(0, 1).contiguous()
        else:
            self.packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
            self.scale, self.minimum = scale, minimum

    @property
    def nbytes(self):
        scales = self.scales_and_zeros.nbytes if self.use_kernel \
            else self.scale.nbytes + self.minimum.nbytes
        return self.packed.nbytes + scales

    def linear(self, x, bias):
        if not self.use_kernel:
            codes = torch.stack([self.packed & 15, self.packed >> 4], dim=-1).flatten(1)
            weight = dequantize_int4_groups(codes, self.scale, self.minimum, x.dtype)
            return F.linear(x, weight, bias)
        dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
        out = torch._weight_int4pack_mm_for_cpu(_flat(x).to(dtype).contiguous(), self.packed,
                                               self.group_size,
                                               self._in_dtype("scales_and_zeros", dtype))
        return self._finish(out, x, bias)


# ---- the model ----

@dataclass(frozen=True)
class QuantizationReport:
    scheme: str
    layers: int  # linear layers quantised (the word embedding besides)
    bytes_before: int  # this rank's weights in the layers quantised
    bytes_after: int

    def line(self):
        mb = 2 ** 20
        return (f" --quantize {self.scheme}: {self.layers} linear layers and the word "
                f"embedding (the LM head): {self.bytes_before / mb:.1f} MB -> "
                f"{self.bytes_after / mb:.1f} MB per rank")


def _parallel_linears(model):
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (mpu.ColumnParallelLinear, mpu.RowParallelLinear))]


def check_quantizable(model, config):
    """ConfigError if `config` cannot be applied to this model on this device (before a tool
    spends time on the unquantised model)."""
    if config.scheme == "int8-dynamic" and not _has_dynamic_int8(model):
        raise ConfigError("--quantize int8-dynamic runs torch's CPU int8 kernels: give "
                          "--device cpu, or use --quantize int8 on this device")
    if config.scheme == "int4":
        _check_int4_shapes(_parallel_linears(model), config.group_size)


def quantize_model(model, config, use_kernels=True):
    """Replace, in place, every parallel linear weight and the word embedding of a GPT2Model
    by its quantised form; returns a QuantizationReport."""
    check_quantizable(model, config)
    linears = _parallel_linears(model)
    before = after = 0
    for _, module in linears:
        weight = module.weight.detach()
        before += weight.nbytes
        quantized = _quantize_linear(weight, config, _row_absmax(module, weight), use_kernels)
        after += quantized.nbytes
        _replace_weight(module, quantized)
    embedding = model.language_model.embedding.word_embeddings
    weight = embedding.weight.detach()
    before += weight.nbytes
    codes, scale = quantize_int8_rows(weight)
    if config.scheme == "int8-dynamic":
        quantized = Int8DynamicWeight(codes, scale, weight.dtype, keep_rows=True)
    else:
        quantized = Int8Weight(codes, scale, weight.dtype, use_kernels)
    after += quantized.nbytes
    _replace_weight(embedding, quantized)
    return QuantizationReport(config.scheme, len(linears), before, after)


def _quantize_linear(weight, config, row_absmax, use_kernels):
    if config.scheme == "int4":
        codes, scale, minimum = quantize_int4_groups(weight, config.group_size)
        return Int4Weight(codes, scale, minimum, config.group_size, weight.dtype, use_kernels)
    codes, scale = quantize_int8_rows(weight, row_absmax)
    if config.scheme == "int8-dynamic":
        return Int8DynamicWeight(codes, scale, weight.dtype)
    return Int8Weight(codes, scale, weight.dtype, use_kernels)


def _row_absmax(module, weight):
    """A RowParallelLinear's rows are split across the TP group: their absmax is the max over
    the shards, so every TP size gets the scales of the whole row."""
    if not isinstance(module, mpu.RowParallelLinear) or mpu.get_model_parallel_world_size() == 1:
        return None
    absmax = weight.float().abs().amax(dim=1)
    dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    return absmax


def _replace_weight(module, quantized):
    del module._parameters["weight"]
    module.weight = quantized  # a plain attribute: not a parameter, not in state_dict()


def _check_int4_shapes(linears, group_size):
    for name, module in linears:
        rows, features = module.weight.shape
        if features % group_size:
            fits = [g for g in INT4_GROUP_SIZES if features % g == 0]
            hint = (f"--quantize-group-size {' or '.join(map(str, fits))} fits"
                    if fits else "no int4 group size fits; use --quantize int8")
            raise ConfigError(f"--quantize int4: {name} has {features} input features per "
                              f"rank, not a multiple of --quantize-group-size {group_size}; "
                              f"{hint}")
        if rows % INT4_ROW_MULTIPLE:
            raise ConfigError(f"--quantize int4: {name} has {rows} output features per rank; "
                              f"torch's int4 kernel needs a multiple of {INT4_ROW_MULTIPLE}. "
                              "Use --quantize int8")


def _has_dynamic_int8(model):
    weight = model.language_model.embedding.word_embeddings.weight
    return weight.device.type == "cpu" and hasattr(torch.ops.quantized, "linear_dynamic")
