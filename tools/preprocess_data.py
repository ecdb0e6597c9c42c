"""Tokenize a loose-JSON corpus into Megatron mmap `.bin/.idx` files for `--data-path`.

    python tools/preprocess_data.py --input data/webtext/data.json --output-prefix data/my-gpt2 \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \
        --merge-file gpt2-merges.txt --append-eod --workers 4

writes data/my-gpt2_text_document.bin/.idx; pass `--data-path data/my-gpt2_text_document`.
Lines that are not JSON objects with a string under every --json-keys key (bad UTF-8, bad or
too deeply nested JSON, a missing key) are skipped and counted; the final report names the
first few by line number. --strict stops at the first one instead.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.preprocessing import (TokenizerFactory, format_summary,  # noqa: E402
                                         tokenize_loose_json)
from megatron.cli import run_cli  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES, check_tokenizer_files  # noqa: E402


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="loose JSON file, one object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each JSON object; one output per key")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="outputs are {prefix}_{key}_document.bin/.idx")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                       help="only Megatron's mmap MMIDIDX format is written")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="processes, each tokenizing one contiguous part of the input")
    group.add_argument("--strict", action="store_true",
                       help="stop at the first malformed line instead of skipping it")
    group.add_argument("--log-interval", type=int, default=100,
                       help="print a progress line every this many documents (on a "
                            "terminal with tqdm installed: a progress bar instead)")
    return parser.parse_args(argv)


def run(args):
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    if args.log_interval < 1:
        raise ConfigError(f"--log-interval must be at least 1, got {args.log_interval}")
    _check_output_prefix(args.output_prefix, args.json_keys)
    check_tokenizer_files(args.tokenizer_type, args.vocab_file, args.merge_file,
                          args.tokenizer_model)
    factory = TokenizerFactory(args.tokenizer_type, args.vocab_file, args.merge_file,
                               args.tokenizer_model)
    start = time.perf_counter()
    outputs, stats = tokenize_loose_json(args.input, args.output_prefix, factory,
                                         json_keys=args.json_keys, append_eod=args.append_eod,
                                         workers=args.workers, log_interval=args.log_interval,
                                         strict=args.strict)
    print(format_summary(outputs, stats, time.perf_counter() - start), flush=True)
    return outputs, stats


def _check_output_prefix(prefix, json_keys):
    """The outputs are `{prefix}_{key}_document`: a prefix that already ends in that suffix
    would name them `x_text_document_text_document`."""
    for key in json_keys:
        suffix = f"_{key}_document"
        if prefix.endswith(suffix):
            raise ConfigError(f"--output-prefix {prefix} ends in {suffix}, which is appended to "
                              f"it (the outputs would be {prefix}{suffix}.bin/.idx); give "
                              f"--output-prefix {prefix[:-len(suffix)]}")


def main(argv=None):
    return run_cli(lambda: run(get_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
