"""Tokenizers with Megatron's interface.

Every tokenizer has `name` (its --tokenizer-type), `vocab_size` (unpadded), `vocab` (str -> id),
`inv_vocab` (id -> str), `tokenize(text) -> list[int]`, `detokenize(ids) -> str` and `eod`
(the end-of-document id that corpus tools append between documents).
"""

from megatron.errors import ConfigError, TokenizerError
from megatron.tokenizer.gpt2_bpe import EOD_TOKEN, GPT2BPETokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer")

__all__ = [
    "EOD_TOKEN",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "check_tokenizer_files",
    "vocab_size_with_padding",
]


def check_tokenizer_files(tokenizer_type, vocab_file=None, merge_file=None,
                          tokenizer_model=None):
    """A tokenizer file given on a command line that the chosen tokenizer does not read is a
    mistake, not a no-op (pass only what the user typed: a checkpoint may record both)."""
    if tokenizer_type == "GPT2BPETokenizer" and tokenizer_model:
        raise TokenizerError(f"--tokenizer-model {tokenizer_model} is a SentencePiece model, "
                             "which --tokenizer-type GPT2BPETokenizer does not read: give "
                             "--tokenizer-type SentencePieceTokenizer, or drop "
                             "--tokenizer-model")
    given = [flag for flag, value in (("--vocab-file", vocab_file),
                                      ("--merge-file", merge_file)) if value]
    if tokenizer_type == "SentencePieceTokenizer" and given:
        raise TokenizerError(f"{' and '.join(given)}: GPT2BPETokenizer's files, which "
                             "--tokenizer-type SentencePieceTokenizer does not read (it reads "
                             "--tokenizer-model); drop them")


def build_tokenizer(tokenizer_type, vocab_file=None, merge_file=None, tokenizer_model=None):
    """The tokenizer named by --tokenizer-type, from the files its flags name (the other
    kind's files are not read: a checkpoint may record both)."""
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise TokenizerError(
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and "
                "--merge-file (merges.txt); build a pair with `python tools/train_tokenizer.py "
                "--input corpus.json --tokenizer-type GPT2BPETokenizer --output-dir DIR` or use "
                "GPT-2's own files"
            )
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise TokenizerError(
                "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model (a sentencepiece "
                ".model file); build one with `python tools/train_tokenizer.py --input corpus.json "
                "--tokenizer-type SentencePieceTokenizer --output-dir DIR`"
            )
        return SentencePieceTokenizer(tokenizer_model)
    raise TokenizerError(
        f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
    )


def vocab_size_with_padding(orig_vocab_size, make_vocab_size_divisible_by, model_parallel_size):
    """Round the vocab up to a multiple of divisible_by * mp, so each tensor-parallel shard of the
    embedding gets an equal, matmul-friendly number of rows (GPT-2: 50257 -> 50304 at 128 x 1)."""
    if make_vocab_size_divisible_by < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by must be >= 1, got "
                          f"{make_vocab_size_divisible_by}")
    if model_parallel_size < 1:
        raise ConfigError(f"--model-parallel-size must be >= 1, got {model_parallel_size}")
    multiple = make_vocab_size_divisible_by * model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple
