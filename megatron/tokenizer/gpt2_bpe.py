"""GPT-2 byte-level BPE, reading OpenAI's `vocab.json` + `merges.txt` file formats.

Text is split into pre-tokens by GPT-2's regex, each pre-token's UTF-8 bytes are mapped to
printable unicode symbols (so every byte string is a string of vocab symbols), and then adjacent
symbols are merged by merge rank until no ranked pair is left.  Every id this produces equals
the id the reference GPT-2 tokenizer produces from the same two files.

`<|endoftext|>` inside text is NOT treated specially (same as GPT-2 and Megatron): it is split
like any other text.  Corpus tools append `eod` by id between documents instead.
"""

import functools
import json
import os
from itertools import chain, repeat

import regex

from megatron.errors import TokenizerError

EOD_TOKEN = "<|endoftext|>"

# OpenAI's GPT-2 pre-tokenization pattern: contractions, letters, numbers, other symbols, each
# optionally with one leading space; whitespace runs leave their last space to the next word.
PRETOKENIZE_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

DEFAULT_CACHE_SIZE = 1 << 16
_NO_RANK = float("inf")

HOW_TO_GET_FILES = (
    "Use GPT-2's vocab.json and merges.txt, or build a pair from your corpus with "
    "`python tools/train_tokenizer.py --input corpus.json --tokenizer-type GPT2BPETokenizer "
    "--output-dir DIR` and pass --vocab-file DIR/vocab.json --merge-file DIR/merges.txt."
)


@functools.lru_cache(maxsize=None)
def bytes_to_unicode():
    """Byte value -> printable unicode symbol, GPT-2's table.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, NBSP, soft
    hyphen) map to chr(256 + n) in byte order, so no symbol is whitespace or a control char.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_symbols_in_vocab_order():
    """The 256 byte symbols sorted by code point: the order of ids 0-255 in GPT-2's vocab.json."""
    return sorted(bytes_to_unicode().values())


# Decoding bytes as latin-1 gives chr(b) for each byte b, so this {b: symbol} table lets
# str.translate map a whole pre-token to its byte symbols in one C call.
_LATIN1_TO_SYMBOL = dict(bytes_to_unicode())


def word_to_symbols(word):
    """A pre-token's UTF-8 bytes as a string of byte symbols (one symbol per byte)."""
    return word.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_SYMBOL)


def _is_not_a_file(path, name):
    if os.path.isdir(path):
        return f"is a folder: give the {name} in it ({os.path.join(path, name)})"
    return "does not exist"


def load_vocab(vocab_file):
    """vocab.json -> {symbol string: id}, with ids exactly 0..N-1."""
    if not os.path.isfile(vocab_file):
        raise TokenizerError(f"vocab file '{vocab_file}' (--vocab-file) "
                             f"{_is_not_a_file(vocab_file, 'vocab.json')}. {HOW_TO_GET_FILES}")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(
            f"vocab file '{vocab_file}' (--vocab-file) is not valid UTF-8 JSON: {e}. "
            f"It must be a JSON object mapping each token string to its id. {HOW_TO_GET_FILES}"
        ) from None
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(
            f"vocab file '{vocab_file}' (--vocab-file) must hold a non-empty JSON object "
            f"{{token: id}}, found {type(vocab).__name__}. {HOW_TO_GET_FILES}"
        )
    bad = [(t, i) for t, i in vocab.items() if type(i) is not int or not 0 <= i < len(vocab)]
    if bad or len(set(vocab.values())) != len(vocab):
        detail = f"e.g. {bad[0][0]!r}: {bad[0][1]!r}" if bad else "some ids appear twice"
        raise TokenizerError(
            f"vocab file '{vocab_file}' (--vocab-file): ids must be the integers "
            f"0..{len(vocab) - 1}, each used once; {detail}. Is this really a GPT-2 style "
            "vocab.json?"
        )
    return vocab


def load_merges(merge_file, vocab, vocab_file):
    """merges.txt -> {(left, right): rank}, checking every merge against the vocab."""
    if not os.path.isfile(merge_file):
        raise TokenizerError(f"merge file '{merge_file}' (--merge-file) "
                             f"{_is_not_a_file(merge_file, 'merges.txt')}. {HOW_TO_GET_FILES}")
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"merge file '{merge_file}' (--merge-file) is not UTF-8 text: "
                             f"{e}") from None
    ranks = {}
    merge_index = 0
    for line_number, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if not line or (line_number == 1 and line.startswith("#version")):
            continue
        pair = tuple(line.split(" "))
        if len(pair) != 2 or not all(pair) or line.startswith("#version"):
            raise TokenizerError(
                f"merge file '{merge_file}' line {line_number}: expected two symbols separated "
                f"by one space, got {line[:80]!r}. Only an optional first line may start with "
                f"'#version'. {HOW_TO_GET_FILES}"
            )
        missing = [s for s in (*pair, pair[0] + pair[1]) if s not in vocab]
        if missing:
            raise TokenizerError(
                f"merge file '{merge_file}' line {line_number} ({line!r}) uses {missing[0]!r}, "
                f"which is not in vocab file '{vocab_file}': the two files do not belong together. "
                f"Pass the vocab.json and merges.txt that were written together."
            )
        # A repeated merge keeps its later position, as in OpenAI's dict(zip(merges, range(n))).
        ranks[pair] = merge_index
        merge_index += 1
    return ranks


def _require_merges_that_make_the_vocab(vocab, merge_ranks, vocab_file, merge_file):
    """Each token beyond the 256 bytes and the special <|...|> tokens is some merge's result;
    a merges file that makes fewer than half of them is truncated or another vocab's (an
    empty one would tokenize byte by byte, without a word)."""
    made = {left + right for left, right in merge_ranks}
    byte_symbols = set(bytes_to_unicode().values())
    built = [token for token in vocab if len(token) > 1 and token not in byte_symbols
             and not (token.startswith("<|") and token.endswith("|>"))]
    unmade = sum(token not in made for token in built)
    if unmade > max(16, len(built) / 2):  # (a few added tokens, e.g. <pad> <s>, are no sign)
        raise TokenizerError(
            f"merge file '{merge_file}' ({len(merge_ranks)} merges) makes "
            f"{len(built) - unmade} of the {len(built)} multi-byte tokens of vocab file "
            f"'{vocab_file}': it is truncated or another vocabulary's. Pass the vocab.json and "
            f"merges.txt that were written together. {HOW_TO_GET_FILES}")


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE with Megatron's tokenizer interface."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file, merge_file, cache_size=DEFAULT_CACHE_SIZE):
        vocab = load_vocab(vocab_file)
        merge_ranks = load_merges(merge_file, vocab, vocab_file)
        _require_merges_that_make_the_vocab(vocab, merge_ranks, vocab_file, merge_file)
        if EOD_TOKEN not in vocab:
            raise TokenizerError(
                f"vocab file '{vocab_file}' has no '{EOD_TOKEN}' token, which GPT-2 models use "
                f"as the end-of-document id. {HOW_TO_GET_FILES}"
            )
        self._setup(vocab, merge_ranks, cache_size)

    def _setup(self, vocab, merge_ranks, cache_size):
        self.vocab = vocab
        self.inv_vocab = {i: token for token, i in vocab.items()}
        self.eod = vocab[EOD_TOKEN]
        self._merge_ranks = merge_ranks
        self._pair_of_rank = {rank: pair for pair, rank in merge_ranks.items()}
        self._cache_size = cache_size
        # Pre-tokens repeat a lot (" the", ","): memoise their ids. Bounded, so tokenizing a
        # large corpus does not grow memory without limit; lru_cache's C code keeps hits cheap.
        self._pretoken_ids = functools.lru_cache(maxsize=cache_size)(self._bpe_ids)
        byte_of_symbol = {s: b for b, s in bytes_to_unicode().items()}
        self._id_to_bytes = [self._token_bytes(self.inv_vocab[i], byte_of_symbol)
                             for i in range(len(vocab))]

    @staticmethod
    def _token_bytes(token, byte_of_symbol):
        if all(s in byte_of_symbol for s in token):
            return bytes(byte_of_symbol[s] for s in token)
        return token.encode("utf-8")  # an added token written as plain text

    @property
    def vocab_size(self):
        return len(self.vocab)

    def tokenize(self, text):
        """text -> ids."""
        return list(chain.from_iterable(map(self._pretoken_ids, PRETOKENIZE_PATTERN.findall(text))))

    def detokenize(self, ids):
        """ids (list, numpy array or tensor) -> text; bytes that are not valid UTF-8 become
        U+FFFD."""
        ids = [int(i) for i in ids]
        if ids and not (0 <= min(ids) and max(ids) < len(self._id_to_bytes)):
            bad = next(i for i in ids if not 0 <= i < len(self._id_to_bytes))
            raise TokenizerError(
                f"cannot detokenize id {bad}: the tokenizer has ids "
                f"0..{len(self._id_to_bytes) - 1} (ids in the padded part of the model's vocab "
                "have no text)"
            )
        return b"".join([self._id_to_bytes[i] for i in ids]).decode("utf-8", errors="replace")

    def cache_info(self):
        """Hits, misses and size of the pre-token cache (functools.lru_cache's CacheInfo)."""
        return self._pretoken_ids.cache_info()

    def _bpe_ids(self, pretoken):
        symbols = self._merge(list(word_to_symbols(pretoken)))
        try:
            return tuple([self.vocab[s] for s in symbols])
        except KeyError as e:
            raise TokenizerError(
                f"the symbol {e.args[0]!r} (from text {pretoken!r}) has no id in the vocab file: "
                f"a byte-level vocab.json must contain all 256 byte symbols"
            ) from None

    def _merge(self, symbols):
        """Merge the lowest-ranked adjacent pair everywhere, repeatedly (OpenAI's algorithm)."""
        ranks = self._merge_ranks
        while len(symbols) > 1:
            # map(ranks.get, pairs, repeat(inf)) looks the ranks up in C, without a Python lambda.
            best_rank = min(map(ranks.get, zip(symbols, symbols[1:]), repeat(_NO_RANK)))
            if best_rank == _NO_RANK:
                break
            first, second = self._pair_of_rank[best_rank]
            merged = []
            i, last = 0, len(symbols) - 1
            while i <= last:
                if i < last and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    # Pickling (e.g. to spawned data workers): send the parsed tables, rebuild the cache.
    def __getstate__(self):
        return {"vocab": self.vocab, "merge_ranks": self._merge_ranks,
                "cache_size": self._cache_size}

    def __setstate__(self, state):
        self._setup(state["vocab"], state["merge_ranks"], state["cache_size"])
