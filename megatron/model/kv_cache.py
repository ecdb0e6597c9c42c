"""Key/value cache for incremental decoding (text generation).

Each attention layer keeps the keys and values of the tokens it has already seen in buffers
preallocated for the longest sequence, [b, np, max_len, hn] (np: this tensor-parallel rank's
heads), so a decoding step writes one position and allocates nothing for the cache.  A step
then costs one token's matmuls plus attention over the cached positions, instead of a
forward pass over the whole sequence.

    cache = KVCache.for_model(model, batch_size=1, max_len=256)
    with attach_kv_cache(model, cache):
        logits = model(prompt, positions_0_to_n)        # fills positions 0..n-1
        logits = model(next_token, position_n)          # attends to 0..n
    cache.reset()                                       # next sequence

The caller passes position ids that continue from `cache.length` (GPT-2's learned position
embeddings need them) and no attention mask: causality over cached + new tokens is the
cache's job (`LayerKVCache.update`).

Fixed-shape decoding (`cache.at_slot()`, then `cache.advance()` after each one-token step):
the new key and value go to the position held in a tensor, and attention spans the whole
buffer with the positions not yet written masked out. Every step then has the same shapes and
no Python-side length, so torch.compile compiles the decode step once per cache size instead
of once per length.
"""

import contextlib

import torch

from megatron import mpu


class LayerKVCache:
    """One layer's keys and values: [b, np, max_len, hn] each, filled up to `length`."""

    def __init__(self, keys, values, slot, slots):
        self.keys, self.values = keys, values
        self.length = 0
        # Fixed-shape decoding: the [1] position the next token is written at (shared by every
        # layer), and 0..max_len-1 to mask the positions after it.
        self.slot, self.slots = slot, slots
        self.fixed_shape = False

    def update(self, key, value):
        """Append key/value [b, np, s, hn]; returns (keys, values, allowed_mask, is_causal)
        over every cached position, for scaled_dot_product_attention."""
        if self.fixed_shape:
            return self._update_at_slot(key, value)
        start, new = self.length, key.shape[2]
        end = start + new
        if end > self.keys.shape[2]:
            raise ValueError(f"KV cache holds {self.keys.shape[2]} positions; "
                             f"{start} + {new} do not fit")
        self.keys[:, :, start:end].copy_(key)
        self.values[:, :, start:end].copy_(value)
        self.length = end
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        if start == 0:
            return keys, values, None, new > 1  # a prompt: plain causal attention
        if new == 1:
            return keys, values, None, False    # one new token sees everything cached
        # Several new tokens after cached ones: query i may see keys up to start + i.
        query_positions = torch.arange(start, end, device=key.device).unsqueeze(1)
        allowed = torch.arange(end, device=key.device).unsqueeze(0) <= query_positions
        return keys, values, allowed, False     # allowed: [s, start + s], True = attend

    def _update_at_slot(self, key, value):
        # one new token [b, np, 1, hn] at position `slot`; it sees every position up to it
        self.keys.index_copy_(2, self.slot, key)
        self.values.index_copy_(2, self.slot, value)
        allowed = (self.slots <= self.slot).view(1, 1, 1, -1)
        return self.keys, self.values, allowed, False


class KVCache:
    """The LayerKVCache of every layer of a model, advanced together."""

    def __init__(self, num_layers, batch_size, num_heads, max_len, head_dim,
                 dtype=torch.float32, device="cpu"):
        shape = (batch_size, num_heads, max_len, head_dim)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)
        # zeros, not empty: fixed-shape steps read masked positions too, and 0 x NaN is NaN
        self.layers = [LayerKVCache(torch.zeros(shape, dtype=dtype, device=device),
                                    torch.zeros(shape, dtype=dtype, device=device),
                                    self.slot, self.slots)
                       for _ in range(num_layers)]
        self.max_len = max_len
        self.batch_size = batch_size

    @classmethod
    def for_model(cls, model, batch_size, max_len):
        config = model.config
        weight = model.language_model.embedding.position_embeddings.weight
        heads = config.num_attention_heads // mpu.get_model_parallel_world_size()
        return cls(config.num_layers, batch_size, heads, max_len,
                   config.hidden_size // config.num_attention_heads, weight.dtype,
                   weight.device)

    def mark_static_addresses(self):
        """For a decode step compiled with CUDA graphs: the cache keeps its tensors for its
        whole life, so the graph may read and write them where they are (unmarked, a step
        that writes into its inputs is run without CUDA graphs)."""
        for tensor in (self.slot, self.slots, *(t for layer in self.layers
                                                for t in (layer.keys, layer.values))):
            torch._dynamo.mark_static_address(tensor)

    @property
    def length(self):
        return self.layers[0].length

    def reset(self):
        for layer in self.layers:
            layer.length = 0
            layer.fixed_shape = False

    def at_slot(self):
        """Switch to fixed-shape one-token steps, writing at the current length."""
        if self.length >= self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; all are filled")
        self.slot.fill_(self.length)
        for layer in self.layers:
            layer.fixed_shape = True

    def advance(self):
        """After a fixed-shape step: the token at `slot` is cached; the next goes after it."""
        for layer in self.layers:
            layer.length += 1
        self.slot.add_(1)


@contextlib.contextmanager
def attach_kv_cache(model, cache):
    """Make each self-attention layer of `model` read and extend its cache while inside."""
    from megatron.model.transformer import ParallelSelfAttention
    attentions = [m for m in model.modules() if isinstance(m, ParallelSelfAttention)]
    if len(attentions) != len(cache.layers):
        raise ValueError(f"cache has {len(cache.layers)} layers, model {len(attentions)}")
    for attention, layer_cache in zip(attentions, cache.layers):
        attention.kv_cache = layer_cache
    try:
        yield cache
    finally:
        for attention in attentions:
            attention.kv_cache = None
