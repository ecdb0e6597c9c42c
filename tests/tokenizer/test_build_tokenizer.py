import json
import re

import pytest

from megatron.errors import ConfigError, TokenizerError
from megatron.tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.tokenizer.gpt2_bpe import byte_symbols_in_vocab_order


def write_vocab(path, tokens):
    path.write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    return str(path)


@pytest.fixture
def good_vocab(tmp_path):
    return write_vocab(tmp_path / "vocab.json", byte_symbols_in_vocab_order() + ["he", "<|endoftext|>"])


@pytest.fixture
def good_merges(tmp_path):
    path = tmp_path / "merges.txt"
    path.write_text("#version: 0.2\nh e\n", encoding="utf-8")
    return str(path)


def test_builds_gpt2(good_vocab, good_merges):
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=good_vocab, merge_file=good_merges)
    assert tok.name == "GPT2BPETokenizer" and tok.vocab_size == 258 and tok.eod == 257
    assert tok.tokenize("he") == [256] and tok.detokenize([256, 257]) == "he<|endoftext|>"


@pytest.mark.parametrize(
    "vocab_content, expected",
    [
        ("{not json", r"vocab\.json.*not valid UTF-8 JSON.*train_tokenizer\.py"),
        ("[1, 2, 3]", r"vocab\.json.*must hold a non-empty JSON object.*found list"),
        ('{"a": 0, "b": 5}', r"vocab\.json.*ids must be the integers 0\.\.1.*'b': 5"),
        ('{"a": 0, "b": "1"}', r"vocab\.json.*ids must be the integers"),
    ],
)
def test_bad_vocab(tmp_path, good_merges, vocab_content, expected):
    (tmp_path / "vocab.json").write_text(vocab_content, encoding="utf-8")
    with pytest.raises(TokenizerError, match=expected):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=good_merges)


def test_missing_files(tmp_path, good_vocab, good_merges):
    with pytest.raises(TokenizerError, match=r"nope\.json.*--vocab-file.*does not exist.*train_tokenizer\.py"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"), merge_file=good_merges)
    with pytest.raises(TokenizerError, match=r"nope\.txt.*--merge-file.*does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=good_vocab, merge_file=str(tmp_path / "nope.txt"))
    with pytest.raises(TokenizerError, match="needs --vocab-file.*and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=good_vocab)
    with pytest.raises(TokenizerError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")


@pytest.mark.parametrize(
    "merges_content, expected",
    [
        ("#version: 0.2\nh e\nthree sym bols\n", r"merges\.txt' line 3: expected two symbols.*'three sym bols'"),
        ("h e\n#version: 0.2\n", r"merges\.txt' line 2: expected two symbols"),
        ("h  e\n", r"merges\.txt' line 1: expected two symbols"),
        ("h e\nx y\n", r"merges\.txt' line 2 \('x y'\) uses 'xy'.*not in vocab file.*do not belong together"),
    ],
)
def test_bad_merges(tmp_path, good_vocab, merges_content, expected):
    (tmp_path / "merges.txt").write_text(merges_content, encoding="utf-8")
    with pytest.raises(TokenizerError, match=expected):
        build_tokenizer("GPT2BPETokenizer", vocab_file=good_vocab, merge_file=str(tmp_path / "merges.txt"))


def test_vocab_without_eod(tmp_path, good_merges):
    vocab = write_vocab(tmp_path / "v.json", byte_symbols_in_vocab_order() + ["he"])
    with pytest.raises(TokenizerError, match=r"v\.json.*no '<\|endoftext\|>' token"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=good_merges)


def test_vocab_missing_a_byte_symbol_fails_when_that_byte_is_tokenized(tmp_path, good_merges):
    tokens = [s for s in byte_symbols_in_vocab_order() if s != "z"] + ["he", "<|endoftext|>"]
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=write_vocab(tmp_path / "v.json", tokens), merge_file=good_merges)
    assert tok.tokenize("he") == [255]
    with pytest.raises(TokenizerError, match="'z'.*all 256 byte symbols"):
        tok.tokenize("zebra")


def test_unknown_type():
    with pytest.raises(TokenizerError, match="unknown --tokenizer-type 'BertWordPieceLowerCase'.*GPT2BPETokenizer, SentencePieceTokenizer"):
        build_tokenizer("BertWordPieceLowerCase")


@pytest.mark.parametrize(
    "size, divisible_by, mp, expected",
    [(50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 4, 50688), (8192, 128, 1, 8192),
     (8193, 128, 1, 8320), (8192, 128, 8, 8192), (1000, 1, 1, 1000), (1000, 1, 3, 1002)],
)
def test_vocab_padding(size, divisible_by, mp, expected):
    padded = vocab_size_with_padding(size, divisible_by, mp)
    assert padded == expected and padded % (divisible_by * mp) == 0 and 0 <= padded - size < divisible_by * mp


def test_vocab_padding_rejects_bad_flags():
    with pytest.raises(ConfigError, match="--make-vocab-size-divisible-by"):
        vocab_size_with_padding(100, 0, 1)
    with pytest.raises(ConfigError, match="--model-parallel-size"):
        vocab_size_with_padding(100, 128, 0)


@pytest.mark.parametrize("tokenizer_type, files, says", [
    ("GPT2BPETokenizer", {"tokenizer_model": "m.model"},
     "--tokenizer-model m.model is a SentencePiece model, which --tokenizer-type "
     "GPT2BPETokenizer does not read: give --tokenizer-type SentencePieceTokenizer"),
    ("SentencePieceTokenizer", {"tokenizer_model": "m.model", "vocab_file": "v.json"},
     "--vocab-file: GPT2BPETokenizer's files, which --tokenizer-type SentencePieceTokenizer "
     "does not read"),
])
def test_a_file_the_tokenizer_does_not_read_is_an_error(good_vocab, good_merges,
                                                        tokenizer_type, files, says):
    """Given on a command line, not silently ignored: the trainer's flags (before anything
    is built) and preprocess_data.py's. A checkpoint that recorded both kinds of files still
    builds its tokenizer from its own kind's."""
    from tests.training.test_arguments import BASE
    from megatron.config import resolve_config
    from megatron.tokenizer import check_tokenizer_files
    if tokenizer_type == "GPT2BPETokenizer":
        files = dict(files, vocab_file=good_vocab, merge_file=good_merges)
        assert build_tokenizer(tokenizer_type, **files).vocab_size == 258
    with pytest.raises(TokenizerError, match=re.escape(says)):
        check_tokenizer_files(tokenizer_type, **files)
    argv = [a for i, a in enumerate(BASE) if not ({a, BASE[i - 1]} & {
        "--tokenizer-type", "--vocab-file", "--merge-file"})]
    argv += ["--tokenizer-type", tokenizer_type] + [
        item for key, value in files.items() for item in (f"--{key.replace('_', '-')}", value)]
    with pytest.raises(TokenizerError, match=re.escape(says)):
        resolve_config(argv, world_size=1)


def test_a_merges_file_that_does_not_make_the_vocab_is_an_error(tmp_path):
    """An empty (or truncated) merges.txt would tokenize byte by byte without a word: with
    most of the vocab's multi-byte tokens made by no merge, it is one error (a few tokens no
    merge makes, such as added <pad> <s>, are not)."""
    pairs = [("h", c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN"]  # 40 tokens
    vocab = write_vocab(tmp_path / "vocab.json", byte_symbols_in_vocab_order() +
                        [a + b for a, b in pairs] + ["<pad>", "<|endoftext|>"])
    merges = tmp_path / "merges.txt"
    for made in (0, 10):
        merges.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in pairs[:made]),
                          encoding="utf-8")
        with pytest.raises(TokenizerError, match=f"makes {made} of the 41 multi-byte tokens of "
                                                 "vocab file .*: it is truncated or another "
                                                 "vocabulary's"):
            build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(merges))
    merges.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in pairs[:25]),
                      encoding="utf-8")  # 16 of 41 made by none (<pad> among them): taken
    assert build_tokenizer("GPT2BPETokenizer", vocab_file=vocab,
                           merge_file=str(merges)).vocab_size == 298


def test_a_folder_given_for_a_tokenizer_file_names_the_file_to_give(tmp_path):
    with pytest.raises(TokenizerError, match=f"vocab file '{tmp_path}' \\(--vocab-file\\) is a "
                                             "folder: give the vocab.json in it"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path), merge_file="m.txt")
