import random
from collections import Counter

import pytest
import regex

from megatron.tokenizer import GPT2BPETokenizer
from megatron.tokenizer.bpe_trainer import count_pretokens, train_byte_level_bpe, write_gpt2_files
from megatron.tokenizer.gpt2_bpe import bytes_to_unicode, byte_symbols_in_vocab_order

from .conftest import varied_text

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def naive_bpe_merges(texts, num_merges, min_frequency):
    """Reference: recount every pair from scratch before each merge; ties go to the smaller pair."""
    table = bytes_to_unicode()
    words = Counter()
    for text in texts:
        for pretoken in regex.findall(GPT2_PATTERN, text):
            words[tuple(table[b] for b in pretoken.encode("utf-8"))] += 1
    merges = []
    for _ in range(num_merges):
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < min_frequency:
            break
        merges.append((best, pairs[best]))
        words = Counter({_apply(word, best): count for word, count in words.items()})
    return merges


def _apply(word, pair):
    out, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def test_merges_are_the_most_frequent_pairs(training_texts):
    model = train_byte_level_bpe(count_pretokens(training_texts), vocab_size=400, min_frequency=2)
    reference = naive_bpe_merges(training_texts, len(model.merges), min_frequency=2)
    assert model.merges == [pair for pair, _ in reference]
    counts = [count for _, count in reference]
    assert counts[0] >= counts[-1] >= 2


def test_min_frequency_stops_training(training_texts):
    model = train_byte_level_bpe(count_pretokens(training_texts), vocab_size=5000, min_frequency=40)
    reference = naive_bpe_merges(training_texts, 5000, min_frequency=40)
    assert model.merges == [pair for pair, _ in reference]
    assert all(count >= 40 for _, count in reference)
    assert len(model.vocab) < 5000  # ran out of frequent pairs before reaching the asked size


def test_vocab_layout(training_texts):
    model = train_byte_level_bpe(count_pretokens(training_texts), vocab_size=500)
    assert len(model.vocab) == 500
    ids_to_tokens = sorted(model.vocab, key=model.vocab.get)
    assert ids_to_tokens[:256] == byte_symbols_in_vocab_order()
    assert ids_to_tokens[-1] == "<|endoftext|>" and model.vocab["<|endoftext|>"] == 499
    assert sorted(model.vocab.values()) == list(range(500))


def test_written_files_are_deterministic_and_load(tmp_path, training_texts):
    shuffled = list(training_texts)
    random.Random(0).shuffle(shuffled)
    paths = []
    for name, texts in (("a", training_texts), ("b", shuffled)):
        model = train_byte_level_bpe(count_pretokens(texts), vocab_size=450)
        paths.append(write_gpt2_files(model, str(tmp_path / name)))
    for file_a, file_b in zip(*paths):
        with open(file_a, "rb") as fa, open(file_b, "rb") as fb:
            assert fa.read() == fb.read()
    with open(paths[0][1], encoding="utf-8") as f:
        assert f.readline() == "#version: 0.2\n"
    tok = GPT2BPETokenizer(*paths[0])
    assert tok.eod == tok.vocab_size - 1 == 449
    text = varied_text(7, 5)
    assert tok.detokenize(tok.tokenize(text)) == text
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]  # no temp files left


def test_too_small_vocab_is_rejected():
    with pytest.raises(ValueError, match="at least 257"):
        train_byte_level_bpe(Counter({"ab": 3}), vocab_size=256)
