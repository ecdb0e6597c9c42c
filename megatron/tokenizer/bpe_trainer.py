"""Train a GPT-2 byte-level BPE (vocab.json + merges.txt) from raw text.

1. Split every text with GPT-2's pre-tokenization regex and count the distinct pre-tokens.
2. Start each pre-token as its UTF-8 byte symbols; count every adjacent symbol pair, weighted
   by how often the pre-token occurs.
3. Repeatedly merge the most frequent pair.  Only the words that contain it are rewritten, and
   only the counts of pairs they gain or lose change, so the cost of a merge is the size of the
   words it touches, not of the corpus.

Ties between equally frequent pairs go to the pair whose (left, right) vocab strings sort first,
so the same counts always give the same files, whatever order the texts came in.
"""

import heapq
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass

from megatron.tokenizer.file_utils import atomic_write_bytes
from megatron.tokenizer.gpt2_bpe import (EOD_TOKEN, PRETOKENIZE_PATTERN,
                                         byte_symbols_in_vocab_order, word_to_symbols)

NUM_BYTE_SYMBOLS = 256
MERGES_VERSION_LINE = "#version: 0.2"


@dataclass
class BPEModel:
    vocab: dict  # token string -> id: 256 byte symbols, learned tokens, then EOD_TOKEN last
    merges: list  # [(left, right)] in the order they were learned (= merge rank)


def count_pretokens(texts):
    """Count GPT-2 pre-tokens over an iterable of texts."""
    counts = Counter()
    for text in texts:
        counts.update(PRETOKENIZE_PATTERN.findall(text))
    return counts


def train_byte_level_bpe(pretoken_counts, vocab_size, min_frequency=2):
    """Learn merges until the vocab (with `<|endoftext|>`) has `vocab_size` tokens.

    Stops earlier when no pair occurs at least `min_frequency` times; the returned vocab is then
    smaller than asked for.
    """
    if vocab_size < NUM_BYTE_SYMBOLS + 1:
        raise ValueError(f"vocab_size must be at least {NUM_BYTE_SYMBOLS + 1} (256 bytes + end of "
                         "document)")
    id_to_token = byte_symbols_in_vocab_order()
    token_to_id = {token: i for i, token in enumerate(id_to_token)}
    words, freqs = _initial_words(pretoken_counts, token_to_id)
    state = _PairState(words, freqs, id_to_token)
    merges = []
    while len(id_to_token) < vocab_size - 1:
        pair = state.pop_most_frequent(min_frequency)
        if pair is None:
            break
        left, right = id_to_token[pair[0]], id_to_token[pair[1]]
        merged = left + right
        # Two different merges can spell the same string ("a"+"bc", "ab"+"c"): one vocab entry.
        if merged not in token_to_id:
            token_to_id[merged] = len(id_to_token)
            id_to_token.append(merged)
        merges.append((left, right))
        state.merge(pair, token_to_id[merged])
    vocab = dict(token_to_id)
    vocab[EOD_TOKEN] = len(vocab)
    return BPEModel(vocab=vocab, merges=merges)


def _initial_words(pretoken_counts, token_to_id):
    words, freqs = [], []
    for pretoken, count in pretoken_counts.items():
        symbols = [token_to_id[s] for s in word_to_symbols(pretoken)]
        if len(symbols) > 1:  # a single symbol has no pair to merge
            words.append(symbols)
            freqs.append(count)
    return words, freqs


class _PairState:
    """Pair counts, which words hold each pair, and a max-heap of (count, tie-break) entries.

    The heap is lazy: when a pair's count changes a fresh entry is pushed, and entries whose count
    no longer matches are dropped when they surface.
    """

    def __init__(self, words, freqs, id_to_token):
        self.words = words
        self.freqs = freqs
        self.id_to_token = id_to_token
        self.counts = defaultdict(int)
        self.words_with_pair = defaultdict(set)
        for w, symbols in enumerate(words):
            for pair in zip(symbols, symbols[1:]):
                self.counts[pair] += freqs[w]
                self.words_with_pair[pair].add(w)
        self.heap = [self._heap_entry(pair, count) for pair, count in self.counts.items()]
        heapq.heapify(self.heap)

    def _heap_entry(self, pair, count):
        return (-count, self.id_to_token[pair[0]], self.id_to_token[pair[1]], pair)

    def pop_most_frequent(self, min_frequency):
        while self.heap:
            negative_count, _, _, pair = self.heap[0]
            if self.counts.get(pair, 0) != -negative_count:
                heapq.heappop(self.heap)  # stale entry
                continue
            if -negative_count < max(min_frequency, 1):
                return None
            heapq.heappop(self.heap)
            return pair
        return None

    def merge(self, pair, new_id):
        """Replace `pair` by `new_id` in every word holding it; update counts by the difference."""
        first, second = pair
        delta = defaultdict(int)
        for w in self.words_with_pair.pop(pair):
            old = self.words[w]
            new = _merge_word(old, first, second, new_id)
            if len(new) == len(old):
                continue  # the word lost this pair in an earlier merge
            freq = self.freqs[w]
            for p in zip(old, old[1:]):
                delta[p] -= freq
            for p in zip(new, new[1:]):
                delta[p] += freq
                self.words_with_pair[p].add(w)
            self.words[w] = new
        for p, change in delta.items():
            if change:
                count = self.counts[p] + change
                self.counts[p] = count
                if count > 0:
                    heapq.heappush(self.heap, self._heap_entry(p, count))
        self.counts.pop(pair, None)


def _merge_word(symbols, first, second, new_id):
    """Left-to-right, non-overlapping replacement of (first, second) by new_id."""
    merged = []
    i, last = 0, len(symbols) - 1
    while i <= last:
        if i < last and symbols[i] == first and symbols[i + 1] == second:
            merged.append(new_id)
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def write_gpt2_files(model, output_dir):
    """Write `vocab.json` and `merges.txt` (GPT-2 formats) atomically; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    vocab_path = os.path.join(output_dir, "vocab.json")
    merges_path = os.path.join(output_dir, "merges.txt")
    merges_text = "\n".join([MERGES_VERSION_LINE] + [f"{a} {b}" for a, b in model.merges]) + "\n"
    atomic_write_bytes(merges_path, merges_text.encode("utf-8"))
    atomic_write_bytes(vocab_path, json.dumps(model.vocab, ensure_ascii=False).encode("utf-8"))
    return vocab_path, merges_path
