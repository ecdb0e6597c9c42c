import json
import pickle

import numpy as np
import pytest

from megatron.errors import TokenizerError
from megatron.tokenizer import GPT2BPETokenizer
from megatron.tokenizer.gpt2_bpe import bytes_to_unicode, byte_symbols_in_vocab_order

from .conftest import UNICODE_SNIPPETS, varied_text


def write_files(tmp_path, merges, extra_tokens=("<|endoftext|>",)):
    """vocab = 256 byte symbols (GPT-2 order), then each merge's result, then extra_tokens."""
    tokens = byte_symbols_in_vocab_order() + [a + b for a, b in merges] + list(extra_tokens)
    vocab_file, merge_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    merge_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return str(vocab_file), str(merge_file)


def test_byte_table_matches_gpt2():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    # Known entries of GPT-2's vocab.json: space is 'Ġ' (id 220), newline 'Ċ', 'h' is id 71.
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("!")] == "!"
    order = byte_symbols_in_vocab_order()
    assert order.index("Ġ") == 220 and order.index("h") == 71 and order.index("!") == 0


def test_hand_computed_ids(tmp_path):
    merges = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("l", "l"), ("ll", "o"), ("a", "a")]
    tok = GPT2BPETokenizer(*write_files(tmp_path, merges))
    he, gt, gthe, ll, llo, aa = range(256, 262)
    # "hello": h e l l o -> he l l o -> he ll o -> he llo.  " the": Ġ t h e -> Ġ t he -> Ġt he -> Ġthe.
    # " world" has no merges: its bytes in GPT-2 order (Ġ=220 w=86 o=78 r=81 l=75 d=67).
    assert tok.tokenize("hello the world") == [he, llo, gthe, 220, 86, 78, 81, 75, 67]
    # Overlapping pairs merge left to right: "aaa" -> aa a.
    assert tok.tokenize("aaa") == [aa, ord("a") - 33]
    assert tok.eod == 262 and tok.vocab_size == 263 and tok.inv_vocab[gthe] == "Ġthe"


@pytest.mark.parametrize("text", UNICODE_SNIPPETS + ["", " ", "\n", "🦄 unseen ꙮ chars", "a" * 3000])
def test_round_trip(gpt2_files, text):
    tok = GPT2BPETokenizer(*gpt2_files)
    ids = tok.tokenize(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == text


def test_ids_equal_reference_tokenizer(gpt2_files):
    tokenizers = pytest.importorskip("tokenizers")
    reference = tokenizers.ByteLevelBPETokenizer(*gpt2_files)  # add_prefix_space=False
    ours = GPT2BPETokenizer(*gpt2_files)
    held_out = [varied_text(seed, 30) for seed in (101, 102, 103)] + UNICODE_SNIPPETS
    for text in held_out + ["".join(held_out)]:
        assert ours.tokenize(text) == reference.encode(text).ids, text[:60]


def test_cache_is_bounded_and_does_not_change_ids(gpt2_files):
    small = GPT2BPETokenizer(*gpt2_files, cache_size=8)
    large = GPT2BPETokenizer(*gpt2_files)
    text = " ".join(f"word{i} x{i * 7}" for i in range(500))
    assert small.tokenize(text) == large.tokenize(text)
    assert small.cache_info().currsize <= 8
    assert large.cache_info().currsize > 8


def test_pickle_and_array_ids(gpt2_files):
    tok = GPT2BPETokenizer(*gpt2_files)
    clone = pickle.loads(pickle.dumps(tok))
    text = UNICODE_SNIPPETS[3]
    assert clone.tokenize(text) == tok.tokenize(text)
    assert clone.detokenize(np.array(tok.tokenize(text), dtype=np.int64)) == text


def test_detokenize_partial_utf8_and_bad_ids(gpt2_files):
    tok = GPT2BPETokenizer(*gpt2_files)
    first_byte_of_e_acute = byte_symbols_in_vocab_order().index(bytes_to_unicode()[0xC3])
    assert tok.detokenize([first_byte_of_e_acute]) == "\ufffd"
    for bad in (tok.vocab_size, -1):
        with pytest.raises(TokenizerError, match=f"id {bad}"):
            tok.detokenize([0, bad])


def test_version_line_optional_and_crlf(tmp_path):
    vocab_file, merge_file = write_files(tmp_path, [("h", "e")])
    with open(merge_file, "w", newline="") as f:
        f.write("h e\r\n")
    assert GPT2BPETokenizer(vocab_file, merge_file).tokenize("he") == [256]
