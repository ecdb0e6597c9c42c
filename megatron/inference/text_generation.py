"""Sampling from a GPT-2, with a KV cache (default) or recomputing the whole prefix (--recompute).

Per step: logits of the last position -> greedy argmax, or / temperature -> top-k / top-p
filter -> softmax -> multinomial.  Generation stops at the end-of-document token or after
`out_seq_length` new tokens, and never runs past the model's position embeddings.

Tensor parallelism: every rank of a TP group runs the same forward on its heads/columns and
sees the same all-gathered logits; the token is chosen on the group's first rank and
broadcast, so ranks cannot drift apart through sampling.
"""

import contextlib
from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.model import parallel_lm_logits
from megatron.model.kv_cache import KVCache, attach_kv_cache


@dataclass
class SamplingParams:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    out_seq_length: int = 256


def top_k_top_p_filter(logits, top_k=0, top_p=0.0):
    """logits [b, v] with everything outside the top k / the top-p nucleus set to -inf.

    top-p keeps the smallest set of most likely tokens whose probability reaches p (the token
    that crosses p is kept), as Megatron's top_k_logits does.
    """
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p > 0.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
        remove = cumulative > top_p
        remove[..., 1:] = remove[..., :-1].clone()  # shift right: keep the crossing token
        remove[..., 0] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def choose_tokens(logits, params):
    """Next token ids [b] from last-position logits [b, v] (fp32)."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    # Shifted so the largest is 0, and divided by at least the dtype's smallest normal number:
    # a tiny temperature then samples the argmax (its limit), where the logits divided
    # overflowed to inf (or the temperature rounded to 0) and softmax gave NaN
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)
    logits = top_k_top_p_filter(shifted / temperature, params.top_k, params.top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1).squeeze(1)


_CACHE_QUANTUM = 256  # compiled decoding: cache sizes are multiples of this


class TextGenerator:
    """Generates continuations for a GPT2Model built with parallel_output=False."""

    def __init__(self, model, eod, vocab_size, use_cache=True, compile=False, max_length=None):
        """compile: torch.compile the one-token decode step over a fixed-shape KV cache (the
        cache holds a multiple of 256 positions, so a few sizes cover every prompt).
        max_length: prompt + new tokens at most (Megatron's --seq-length); at most, and by
        default, the model's position embeddings."""
        if compile and not use_cache:
            raise ValueError("compiling the decode step needs the KV cache (drop --recompute)")
        model_positions = model.config.max_position_embeddings
        if max_length is not None and not 1 < max_length <= model_positions:
            raise ValueError(f"max_length {max_length} must be in 2..{model_positions} (the "
                             "model's positions)")
        self.model = model
        self.eod = eod
        self.vocab_size = vocab_size  # logits of padding rows are never sampled
        self.use_cache = use_cache
        self.max_length = model_positions if max_length is None else max_length
        # On a GPU a one-token step is a few hundred small kernels whose launches take longer
        # than their work: CUDA graphs ("reduce-overhead") replay them in one launch. Not yet
        # under tensor parallelism (NCCL all-reduces captured in a graph are untested here).
        self._cuda_graphs = compile and _model_device(model).type == "cuda" \
            and mpu.get_model_parallel_world_size() == 1
        self._decode_step = None if not compile else torch.compile(
            self._last_logits, dynamic=False,
            mode="reduce-overhead" if self._cuda_graphs else None)
        self._kept_caches = {}  # compiled: (batch, positions) -> the cache calls reuse

    def _cache_for(self, batch, positions):
        if self._decode_step is None:
            return KVCache.for_model(self.model, batch, positions)
        capacity = min(self.max_length, -(-positions // _CACHE_QUANTUM) * _CACHE_QUANTUM)
        kept = self._kept_caches.get((batch, capacity))
        if kept is None:
            # a new cache is a new input to the compiled step: one compile per size. A CUDA
            # graph is recorded for the cache's addresses, so there each size keeps its cache
            # (at most max_length / 256 of them); elsewhere only the last one is kept.
            if not self._cuda_graphs:
                self._kept_caches.clear()
            kept = self._kept_caches[batch, capacity] = KVCache.for_model(
                self.model, batch, capacity)
            if self._cuda_graphs:
                kept.mark_static_addresses()
        kept.reset()
        return kept

    def _last_logits(self, tokens, positions):
        # tokens, positions [b, s] -> fp32 logits [b, vocab] of the last position only
        hidden = self.model.language_model(tokens, positions)[:, -1]  # [b, h]
        weight = self.model.language_model.embedding.word_embeddings.weight
        logits = parallel_lm_logits(hidden, weight, parallel_output=False)
        return logits[:, :self.vocab_size].float()

    @torch.inference_mode()
    def generate(self, context_tokens, params):
        """context_tokens [b, n] (same length per row) -> (new tokens [b, m], finished [b])."""
        context_tokens = context_tokens.to(_model_device(self.model))
        batch, length = context_tokens.shape
        if length < 1:
            raise ValueError("the context needs at least one token")
        max_new = max(0, min(params.out_seq_length, self.max_length - length))
        device = context_tokens.device
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        generated = torch.full((batch, max_new), self.eod, dtype=torch.long, device=device)
        if max_new == 0:
            return generated[:, :0], finished
        # With the cache each step feeds only the newest token; without it, the whole prefix.
        cache = self._cache_for(batch, length + max_new) if self.use_cache else None
        attached = contextlib.nullcontext() if cache is None \
            else attach_kv_cache(self.model, cache)
        # Position ids of every step, made once: [b, length + max_new].
        positions = torch.arange(length + max_new, device=device).unsqueeze(0).expand(batch, -1)
        read_every = _finished_read_every(device)
        with attached:
            logits = self._last_logits(context_tokens, positions[:, :length])
            for step in range(max_new):
                tokens = self._broadcast(choose_tokens(logits, params))
                tokens = torch.where(finished, self.eod, tokens)  # finished rows pad with eod
                generated[:, step] = tokens
                finished |= tokens == self.eod
                if step + 1 == max_new or ((step + 1) % read_every == 0
                                           and bool(finished.all())):
                    break
                if cache is not None:
                    position = positions[:, length + step:length + step + 1]
                    logits = self._decode(cache, tokens.unsqueeze(1), position)
                else:
                    prefix = torch.cat([context_tokens, generated[:, :step + 1]], dim=1)
                    logits = self._last_logits(prefix, positions[:, :prefix.shape[1]])
        return _until_all_finished(generated[:, :step + 1], finished, self.eod), finished

    def _decode(self, cache, tokens, position):
        """Logits after one new token per row, through the cache."""
        if self._decode_step is None:
            return self._last_logits(tokens, position)
        cache.at_slot()
        if self._cuda_graphs:
            # a new step: the last replay's outputs (logits already turned into tokens) may
            # be overwritten by this one
            torch.compiler.cudagraph_mark_step_begin()
        logits = self._decode_step(tokens, position.clone())  # same storage offset each step
        cache.advance()
        return logits

    def _broadcast(self, tokens):
        if mpu.get_model_parallel_world_size() > 1:
            dist.broadcast(tokens, mpu.get_model_parallel_src_rank(),
                           group=mpu.get_model_parallel_group())
        return tokens


def _finished_read_every(device):
    """Steps between reads of whether every row has finished. Off the CPU a read waits until
    the step has run, so the host cannot queue the next step meanwhile: it is read every 8
    steps there (a batch that finished runs up to 7 steps of eod padding). The tokens are
    those of a read every step; sampling draws for the padding steps too, so the random
    stream after a call is further on."""
    return 1 if device.type == "cpu" else 8


def _until_all_finished(generated, finished, eod):
    """generated [b, m] without the steps after the last row's eod (steps taken before the
    finished flags were read: every row of them is eod padding)."""
    if generated.shape[0] == 0 or not bool(finished.all()):
        return generated
    last = int((generated == eod).int().argmax(dim=1).max())  # each row's first eod
    return generated[:, :last + 1]


def _model_device(model):
    return model.language_model.embedding.word_embeddings.weight.device


def generate_text(generator, tokenizer, prompt, params) -> dict:
    """{"context", "text", "length", "finished"} for one prompt ('' starts from eod)."""
    ids: List[int] = tokenizer.tokenize(prompt) if prompt else [tokenizer.eod]
    # Keep room for at least one new token; a longer prompt keeps its last tokens.
    truncated = len(ids) > generator.max_length - 1
    ids = ids[-(generator.max_length - 1):]
    context = torch.tensor([ids], dtype=torch.long)
    new, finished = generator.generate(context, params)
    tokens = [t for t in new[0].tolist() if t != tokenizer.eod]
    result = {"context": prompt, "text": tokenizer.detokenize(tokens), "length": len(tokens),
              "finished": bool(finished[0])}
    if truncated:
        result["context_truncated_to_tokens"] = len(ids)
    return result
