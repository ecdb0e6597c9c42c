"""Pre-LayerNorm GPT-2 transformer layers, split across tensor-parallel ranks.

Activations are [b, s, h] (batch first): the QKV projection then views into the
[b, np, s, hn] layout that scaled_dot_product_attention wants without a copy, and its
output transposes back to [b, s, h] for free.  `config` is a `GPTConfig`; with
memory_centric_tiled_linear the four linears of a layer are tile grids
(megatron/model/tiling.py).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.model import causal_attention
from megatron.model.dropout import drop_unscaled, dropout, masks_in_graph
from megatron.model.tiling import column_parallel_linear, row_parallel_linear


class ParallelSelfAttention(nn.Module):
    """Causal self-attention; each tensor-parallel rank owns num_heads / p whole heads.

    query_key_value rows are ordered per head as [np, 3, hn] (Megatron checkpoint version
    2.0), so the column split gives each rank the Q, K and V of its own heads.
    """

    def __init__(self, config, init_method, output_layer_init_method):
        super().__init__()
        hidden_size = config.hidden_size
        self.head_dim = mpu.divide(hidden_size, config.num_attention_heads)
        self.num_heads_per_partition = mpu.divide(config.num_attention_heads,
                                                  mpu.get_model_parallel_world_size())
        self.attention_dropout = config.attention_dropout
        self.query_key_value = column_parallel_linear(
            config, "query_key_value", hidden_size, 3 * hidden_size, gather_output=False,
            init_method=init_method)
        self.dense = row_parallel_linear(
            config, "dense", hidden_size, hidden_size, input_is_parallel=True,
            init_method=output_layer_init_method)
        # A megatron.model.kv_cache.LayerKVCache while generating (attach_kv_cache).
        self.kv_cache = None

    def forward(self, hidden_states, allowed_mask):
        # hidden_states: [b, s, h]; allowed_mask: None (causal) or bool [b|1, 1, s, s],
        # True where a query may attend to a key.
        batch, seq, _ = hidden_states.shape
        mixed, _ = self.query_key_value(hidden_states)  # [b, s, np * 3 * hn]
        mixed = mixed.view(batch, seq, self.num_heads_per_partition, 3, self.head_dim)
        # Three strided views [b, np, s, hn]; SDPA reads them without a copy.
        query, key, value = (t.transpose(1, 2) for t in mixed.unbind(3))
        is_causal = allowed_mask is None
        if self.kv_cache is not None:  # decoding: also attend to the tokens cached earlier
            key, value, allowed_mask, is_causal = self.kv_cache.update(key, value)
            # CPU SDPA takes ~2x longer with a strided query; a decode step's is tiny.
            query = query.contiguous()
        dropout_p = self.attention_dropout if self.training else 0.0
        if dropout_p > 0 and not _attention_masks_in_graph(query):
            context = _attention_with_dropout(query, key, value, allowed_mask, is_causal,
                                              dropout_p)
        else:
            context = attention(query, key, value, allowed_mask, is_causal, dropout_p)
        # context: [b, np, s, hn]
        context = context.transpose(1, 2).reshape(batch, seq, -1)  # [b, s, np * hn]
        output, _ = self.dense(context)  # [b, s, h]
        return output


def _attention_masks_in_graph(query):
    """Whether attention dropout draws its masks inside the graph being compiled: on the CPU
    hashed with a per-rank stream (megatron.model.dropout); off it at tensor-parallel size 1,
    SDPA's own dropout from the default generator, which seeding, resume and recompute
    restore. With one rank there are no per-rank streams to keep apart, so the tracker's
    generator swap, which torch.compile cannot trace, is not needed."""
    return masks_in_graph(query) or (torch.compiler.is_compiling()
                                     and mpu.get_model_parallel_world_size() == 1)


# torch.compiler.disable, except that torch._dynamo (2-3 s to import on a slow CPU) is imported
# at the first call, not with this module: generation and the checkpoint tools never call it.
# Dynamo does not trace into the wrapper either (torch marks Optimizer.zero_grad the same way).
@torch._disable_dynamo
def _attention_with_dropout(query, key, value, allowed_mask, is_causal, dropout_p):
    """attention() under the model-parallel RNG tracker: each rank drops out its own heads,
    so it draws from a per-rank stream, not the replicated one. Eager even inside a compiled
    layer off the CPU at tensor-parallel size > 1, since torch.compile cannot trace the
    tracker's swap of the generator state (`_attention_masks_in_graph` says where it is not
    needed)."""
    with mpu.get_cuda_rng_tracker().fork():
        return attention(query, key, value, allowed_mask, is_causal, dropout_p)


def attention(query, key, value, allowed_mask, is_causal, dropout_p):
    """softmax(q kᵀ / sqrt(hn)) v over [b, np, s, hn], dropping out attention probabilities.

    scaled_dot_product_attention, except with dropout on CPU: there SDPA leaves its fused
    kernel for the math path and draws the dropout mask one element at a time. The same math
    is spelled out here with as few passes over the [s, s] scores as it takes: the scale and
    the mask (as an additive bias) go into the q kᵀ product, the softmax stays in the input
    dtype (torch's CPU kernel accumulates 16-bit inputs in fp32), dropout uses
    megatron.model.dropout's cheap mask and its 1 / (1 - p) scales the [s, hn] context instead
    of the probabilities. It keeps 5 bytes per score for backward in 16-bit (softmax output,
    mask, dropped probabilities), the 5·a·s²·b of the activation formula. About 4x faster than
    SDPA's math path here (docs/design/cpu-dropout-attention.md); in a compiled layer the
    mask is hashed inside the graph instead, and only its key is kept. Causal bf16 attention
    without dropout in a compiled layer on the CPU takes megatron.model.causal_attention (a
    faster backward).
    """
    if causal_attention.applies(query, is_causal, dropout_p):
        return causal_attention.causal_attention(query, key, value)
    if dropout_p == 0.0 or query.device.type != "cpu":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed_mask,
                                              dropout_p=dropout_p, is_causal=is_causal)
    scale = query.shape[-1] ** -0.5
    bias = _causal_bias(query.shape[-2], key.shape[-2], query.dtype) if is_causal \
        else _mask_bias(allowed_mask, query.dtype)
    if bias is not None and bias.dim() == 2:  # one bias for every head: a single kernel
        batch_heads = query.shape[:-2]
        scores = torch.baddbmm(bias, query.reshape(-1, *query.shape[-2:]),
                               key.reshape(-1, *key.shape[-2:]).transpose(1, 2), alpha=scale)
        scores = scores.view(*batch_heads, *scores.shape[-2:])
    else:
        scores = torch.matmul(query * scale, key.transpose(-1, -2))
        if bias is not None:
            scores.add_(bias)
    probs = torch.softmax(scores, dim=-1)
    dropped = drop_unscaled(probs, dropout_p, stream=1 + mpu.get_model_parallel_rank())
    context = torch.matmul(dropped, value)
    return context.mul_(1.0 / (1.0 - dropout_p))


_CAUSAL_BIASES = {}


def _causal_bias(queries, keys, dtype):
    """[queries, keys]: 0 where a query may attend (SDPA's causal mask, aligned to the top
    left), -inf elsewhere; cached, since every layer and step uses the same one. A compiled
    graph builds its own inside the graph instead: reading the cache would make the graph
    depend on what the cache holds, and recompile when it changes."""
    cached = not torch.compiler.is_compiling()
    bias = _CAUSAL_BIASES.get((queries, keys, dtype)) if cached else None
    if bias is None:
        bias = _mask_bias(torch.ones(queries, keys, dtype=torch.bool).tril(), dtype)
        if cached:
            _CAUSAL_BIASES[(queries, keys, dtype)] = bias
    return bias


def _mask_bias(allowed_mask, dtype):
    if allowed_mask is None:
        return None
    return torch.zeros(allowed_mask.shape, dtype=dtype,
                       device=allowed_mask.device).masked_fill_(~allowed_mask, float("-inf"))


class ParallelMLP(nn.Module):
    """h -> 4h (column split) -> GeLU -> h (row split): one all-reduce per MLP."""

    def __init__(self, config, init_method, output_layer_init_method):
        super().__init__()
        self.dense_h_to_4h = column_parallel_linear(
            config, "dense_h_to_4h", config.hidden_size, config.ffn_hidden_size,
            gather_output=False, init_method=init_method)
        self.dense_4h_to_h = row_parallel_linear(
            config, "dense_4h_to_h", config.ffn_hidden_size, config.hidden_size,
            input_is_parallel=True, init_method=output_layer_init_method)

    def forward(self, hidden_states):
        intermediate, _ = self.dense_h_to_4h(hidden_states)  # [b, s, 4h / p]
        output, _ = self.dense_4h_to_h(gelu(intermediate))
        return output  # [b, s, h]


_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)


def gelu(x):
    """GPT-2's GeLU, the tanh approximation 0.5·x·(1 + tanh(u)), u = sqrt(2/π)·(x + 0.044715·x³).

    Inside a compiled region it is spelled x·sigmoid(2u), the same function, computed in fp32
    like torch's kernel: inductor makes that one vectorised pass forward and one backward,
    which on CPU beat torch's tanh-GeLU kernels (whose tanh is slow). Eager keeps torch's
    kernel, the faster of the two there (docs/benchmarks.md, "Where a training step's time
    goes").
    """
    if not torch.compiler.is_compiling():
        return F.gelu(x, approximate="tanh")
    x32 = x.float()
    return (x32 * torch.sigmoid(_TWO_SQRT_2_OVER_PI * (x32 + 0.044715 * x32 * x32 * x32))
            ).to(x.dtype)


class ParallelTransformerLayer(nn.Module):
    """x + Dropout(Attention(LN(x))), then x + Dropout(MLP(LN(x)))."""

    def __init__(self, config, init_method, output_layer_init_method):
        super().__init__()
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.input_layernorm = nn.LayerNorm(h, eps=eps)
        self.attention = ParallelSelfAttention(config, init_method, output_layer_init_method)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=eps)
        self.mlp = ParallelMLP(config, init_method, output_layer_init_method)
        self.hidden_dropout = config.hidden_dropout

    def _dropout(self, tensor):
        return dropout(tensor, self.hidden_dropout, self.training)

    def forward(self, hidden_states, allowed_mask, half=None):
        # hidden_states: [b, s, h]. half: "attention" or "mlp" runs only that half
        # (--split-transformers checkpoints each on its own); through the module call, so a
        # compiled layer compiles the halves too.
        if half == "attention":
            return self.attention_block(hidden_states, allowed_mask)
        if half == "mlp":
            return self.mlp_block(hidden_states)
        return self.mlp_block(self.attention_block(hidden_states, allowed_mask))

    def attention_block(self, hidden_states, allowed_mask):
        attention_output = self.attention(self.input_layernorm(hidden_states), allowed_mask)
        return hidden_states + self._dropout(attention_output)

    def mlp_block(self, hidden_states):
        mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + self._dropout(mlp_output)


class ParallelTransformer(nn.Module):
    """A stack of layers and a final LayerNorm, with optional activation checkpointing; under
    pipeline parallelism, this stage's layers (and the LayerNorm on the last stage)."""

    def __init__(self, config, init_method, output_layer_init_method):
        super().__init__()
        self.checkpoint_activations = config.checkpoint_activations
        self.checkpoint_num_layers = config.checkpoint_num_layers
        # Checkpointed units: layers, or with split_transformers their halves (unit 2i is the
        # attention half of layer i, 2i+1 its MLP half); a chunk is checkpoint_num_layers units.
        self.split_transformers = config.split_transformers
        self.checkpoint_function = config.checkpoint_function or mpu.checkpoint
        # A pipeline stage keeps its own layers (numbered from 0 in its state dict, as
        # Megatron's stages are) but builds and drops the others, so the weight generator
        # draws the single-process model's stream: every pipeline layout starts from it.
        chunks = stage_layers(config.num_layers, mpu.get_pipeline_model_parallel_world_size(),
                              mpu.get_pipeline_model_parallel_rank(),
                              mpu.get_virtual_pipeline_model_parallel_world_size())
        kept = {number for chunk in chunks for number in chunk}
        layers = []
        for number in range(config.num_layers):
            layer = ParallelTransformerLayer(config, init_method, output_layer_init_method)
            if number in kept:
                layers.append(layer)
        self.layers = nn.ModuleList(layers)  # chunk after chunk, each in layer order
        self.layer_numbers = [number for chunk in chunks for number in chunk]  # in the model
        # [first, last) local layers of each model chunk (one chunk unless interleaved)
        ends = [sum(len(chunk) for chunk in chunks[:c + 1]) for c in range(len(chunks))]
        self.chunk_layers = [(end - len(chunk), end) for chunk, end in zip(chunks, ends)]
        # the last pipeline stage's (LayerNorm draws nothing from the generator)
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon) \
            if mpu.is_pipeline_last_stage(ignore_virtual=True) else None

    def _run_units(self, start, end):
        def run(hidden_states, allowed_mask):
            for unit in range(start, end):
                if not self.split_transformers:
                    hidden_states = self.layers[unit](hidden_states, allowed_mask)
                else:
                    hidden_states = self.layers[unit // 2](
                        hidden_states, allowed_mask, "mlp" if unit % 2 else "attention")
            return hidden_states
        return run

    def forward(self, hidden_states, attention_mask=None, chunk=0):
        # hidden_states: [b, s, h]; attention_mask: None (causal) or bool [b|1, 1, s, s] with
        # Megatron's convention True = masked.  SDPA's bool mask means the opposite.
        # chunk: the model chunk to run (interleaved pipeline schedule).
        allowed_mask = None if attention_mask is None else ~attention_mask
        per_layer = 2 if self.split_transformers else 1
        first, last = (n * per_layer for n in self.chunk_layers[chunk])
        if self.checkpoint_activations and self.training and torch.is_grad_enabled():
            for start in range(first, last, self.checkpoint_num_layers):
                end = min(start + self.checkpoint_num_layers, last)
                hidden_states = self.checkpoint_function(self._run_units(start, end),
                                                         hidden_states, allowed_mask)
        else:
            hidden_states = self._run_units(first, last)(hidden_states, allowed_mask)
        if self.final_layernorm is None or chunk != len(self.chunk_layers) - 1:
            return hidden_states  # a pipeline stage (or model chunk) before the last
        return self.final_layernorm(hidden_states)


def stage_layers(num_layers, stages, stage, chunks=1):
    """The layers pipeline stage `stage` of `stages` holds, one list of layer numbers per
    model chunk. One chunk: a contiguous run, as even as the count allows, the first
    num_layers % stages stages taking one layer more (the last stage also runs the output
    layer and the loss). `chunks` > 1 (interleaved 1F1B): num_layers splits evenly into
    chunks x stages virtual stages, and chunk c of stage s is virtual stage c x stages + s."""
    if chunks == 1:
        base, extra = divmod(num_layers, stages)
        first = stage * base + min(stage, extra)
        return [list(range(first, first + base + (1 if stage < extra else 0)))]
    per = num_layers // (stages * chunks)
    return [list(range((c * stages + stage) * per, (c * stages + stage + 1) * per))
            for c in range(chunks)]
