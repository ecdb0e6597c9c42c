"""Repair, language-filter and length-filter a loose JSON corpus of {"text", "url"} documents.

    python tools/openwebtext/cleanup_dataset.py merged.json cleaned.json \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        [--min-tokens 128] [--language en] [--workers 4]

Per document, the first failing check names the reason it is dropped:
  1. malformed line (not UTF-8, not JSON, no string "text"/"url"),
  2. empty after `ftfy.fix_text` (mojibake, HTML entities, broken quotes... repaired),
  3. fewer than --min-tokens tokens of the chosen tokenizer (the one training will use),
  4. language (langdetect, seeded so it is deterministic) not among --language
     (`--language any` keeps every language).
Kept documents carry the repaired text.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.data.preprocessing import TokenizerFactory  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES  # noqa: E402
from tools.openwebtext.streaming import (MALFORMED, Malformed, dump_json_line,  # noqa: E402
                                         input_files, parse_json_record, run_line_filter,
                                         stage_main)

_CHUNK_CHARS_PER_TOKEN = 8  # chunk size per wanted token; ample for any real BPE vocabulary


def count_tokens_up_to(text, tokenizer, limit):
    """min(tokens of `text`, about `limit`): tokenizes only as much text as it needs.

    The text is cut only before a space that follows a non-space character and precedes a
    non-space character.  GPT-2's pre-tokenizer never joins across such a cut (a pre-token
    holds a space only as its first character or in a run of spaces), so the tokens of the
    pieces add up exactly to the tokens of the whole.
    """
    chunk = max(limit, 1) * _CHUNK_CHARS_PER_TOKEN
    count, start = 0, 0
    while start < len(text) and count < limit:
        end = _safe_cut(text, start + chunk)
        count += len(tokenizer.tokenize(text[start:end]))
        start = end
    return count


def _safe_cut(text, target):
    if target >= len(text):
        return len(text)
    cut = text.find(" ", target)
    while cut != -1 and not (text[cut - 1] != " " and not text[cut - 1].isspace() and
                             cut + 1 < len(text) and not text[cut + 1].isspace()):
        cut = text.find(" ", cut + 1)
    return len(text) if cut == -1 else cut


class CleanupFilter:
    """line -> (cleaned JSON line, None) | (None, reason).  Built once per worker."""

    def __init__(self, tokenizer, min_tokens, languages, seed, language_chars):
        import ftfy
        self.fix_text = ftfy.fix_text
        self.tokenizer, self.min_tokens = tokenizer, min_tokens
        self.languages, self.language_chars = languages, language_chars
        if languages is not None:
            from langdetect import DetectorFactory, LangDetectException, detect
            DetectorFactory.seed = seed  # langdetect samples n-grams at random
            self.detect, self.detect_error = detect, LangDetectException

    def __call__(self, line):
        record = parse_json_record(line, ("text", "url"))
        text = self.fix_text(record["text"])
        if not text.strip():
            return None, "empty text"
        try:
            if self.min_tokens and \
                    count_tokens_up_to(text, self.tokenizer, self.min_tokens) < self.min_tokens:
                return None, f"fewer than {self.min_tokens} tokens"
        except UnicodeEncodeError:
            raise Malformed(f"{MALFORMED}: a lone UTF-16 surrogate in the text") from None
        if self.languages is not None:
            language = self._language(text)
            if language not in self.languages:
                return None, f"language {language}"
        record["text"] = text
        return dump_json_line(record), None

    def _language(self, text):
        try:
            return self.detect(text[:self.language_chars])
        except self.detect_error:
            return "unknown"  # no letters to go by (numbers, symbols)


class CleanupFilterFactory:
    """Builds the filter inside each worker; pickles for spawned workers."""

    def __init__(self, tokenizer_factory, min_tokens, languages, seed, language_chars):
        self.tokenizer_factory, self.min_tokens = tokenizer_factory, min_tokens
        self.languages, self.seed, self.language_chars = languages, seed, language_chars

    def __call__(self):
        tokenizer = self.tokenizer_factory() if self.min_tokens else None
        return CleanupFilter(tokenizer, self.min_tokens, self.languages, self.seed,
                             self.language_chars)


def _load_libraries_once(factory):
    """Import ftfy and load langdetect's language profiles (a second or more) here, so that
    forked workers inherit them instead of each loading its own."""
    import ftfy  # noqa: F401
    if factory.languages is not None:
        from langdetect.detector_factory import init_factory
        init_factory()


def add_tokenizer_args(parser):
    group = parser.add_argument_group("tokenizer (for --min-tokens; use training's)")
    group.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")


def add_cleanup_args(parser):
    group = parser.add_argument_group("cleanup")
    group.add_argument("--min-tokens", type=int, default=128,
                       help="drop documents with fewer tokens (0: no length filter)")
    group.add_argument("--language", nargs="+", default=["en"],
                       help="langdetect codes to keep (en, de, fr, zh-cn, ...) or 'any'")
    group.add_argument("--language-chars", type=int, default=2000,
                       help="detect the language on this many leading characters")
    group.add_argument("--langdetect-seed", type=int, default=0,
                       help="seed of langdetect's n-gram sampling (fixed: same input, same "
                            "result)")
    add_tokenizer_args(parser)


def _languages(codes):
    """The --language codes as langdetect spells them (lower case), None for 'any'; a code
    langdetect never returns would silently drop every document."""
    codes = [code.lower() for code in codes]
    if codes == ["any"]:
        return None
    import langdetect
    profiles = os.path.join(os.path.dirname(langdetect.__file__), "profiles")
    known = sorted(os.listdir(profiles)) if os.path.isdir(profiles) else None
    unknown = [code for code in codes if known is not None and code not in known]
    if unknown:
        raise ConfigError(f"--language {' '.join(unknown)}: not a language langdetect detects; "
                          f"it detects {', '.join(known)} (or give 'any')")
    return frozenset(codes)


def make_cleanup_factory(args):
    if args.min_tokens < 0:
        raise ConfigError(f"--min-tokens must be >= 0, got {args.min_tokens}")
    if args.language_chars < 1:
        raise ConfigError(f"--language-chars must be >= 1, got {args.language_chars}")
    languages = _languages(args.language)
    tokenizer_factory = TokenizerFactory(args.tokenizer_type, args.vocab_file, args.merge_file,
                                         args.tokenizer_model)
    if args.min_tokens:
        tokenizer_factory()  # a missing vocab file is reported now, not once per worker
    return CleanupFilterFactory(tokenizer_factory, args.min_tokens, languages,
                                args.langdetect_seed, args.language_chars)


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input", help="loose JSON, one {\"text\", \"url\"} object per line")
    parser.add_argument("output", help="cleaned loose JSON to write")
    add_cleanup_args(parser)
    parser.add_argument("--workers", type=int, default=1)
    return parser.parse_args(argv)


def run(args, stream=None):
    factory = make_cleanup_factory(args)
    _load_libraries_once(factory)
    return run_line_filter("cleanup_dataset", input_files([args.input]), args.output, factory,
                           args.workers, stream)


def main(argv=None):
    return stage_main(run, get_args, argv)


if __name__ == "__main__":
    sys.exit(main())
