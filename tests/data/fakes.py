"""Small stand-in tokenizers with the interface of `megatron.tokenizer.build_tokenizer`."""

import json

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder


class ByteTokenizer:
    """One token per UTF-8 byte; eod is 256."""

    vocab_size = 257
    eod = 256

    def tokenize(self, text):
        return list(text.encode("utf-8"))

    def detokenize(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class ShiftedByteTokenizer(ByteTokenizer):
    """Same vocab size and eod as ByteTokenizer but different ids: must not share a cache."""

    def tokenize(self, text):
        return [(b + 1) % 256 for b in text.encode("utf-8")]


class WideTokenizer(ByteTokenizer):
    """A vocabulary too large for uint16: token ids above 65535."""

    vocab_size = 70000
    eod = 69999

    def tokenize(self, text):
        return [66000 + b for b in text.encode("utf-8")]


def write_loose_json(path, records, raw_lines=()):
    """One JSON object per line, then any raw (possibly malformed) byte lines."""
    with open(path, "wb") as f:
        for record in records:
            f.write(json.dumps(record).encode("utf-8") + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")
    return str(path)


def write_token_dataset(prefix, documents, dtype=np.uint16):
    """An indexed dataset holding `documents` (lists of ids), one item per document."""
    prefix = str(prefix)
    with MMapIndexedDatasetBuilder(prefix + ".bin", dtype) as builder:
        for doc in documents:
            builder.add_item(np.asarray(doc))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


class ExplodingTokenizer(ByteTokenizer):
    """Fails on a document containing BOOM, like a tokenizer bug would."""

    def tokenize(self, text):
        if "BOOM" in text:
            raise ValueError("tokenizer bug")
        return super().tokenize(text)


class FakeTokenizerFactory:
    """Drop-in for preprocessing.TokenizerFactory that builds a ByteTokenizer (picklable)."""

    def __init__(self, tokenizer_type, vocab_file=None, merge_file=None, tokenizer_model=None):
        self.tokenizer_type = tokenizer_type

    def __call__(self):
        return ByteTokenizer()
