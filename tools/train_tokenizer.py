r"""Train a tokenizer from loose-JSON corpora (one JSON object per line).

    python tools/train_tokenizer.py --input corpus.json --tokenizer-type GPT2BPETokenizer \
        --vocab-size 8192 --output-dir tokenizer/
    -> tokenizer/vocab.json + tokenizer/merges.txt   (--vocab-file / --merge-file)

    python tools/train_tokenizer.py --input corpus.json --tokenizer-type SentencePieceTokenizer \
        --vocab-size 8192 --output-dir tokenizer/
    -> tokenizer/tokenizer.model                      (--tokenizer-model)

Lines that are not JSON objects with a string under each --json-keys key are counted and
reported, never fatal.  Each key's text is one document.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import time  # noqa: E402

from megatron.cli import run_cli  # noqa: E402
from megatron.data.json_lines import MalformedLine, parse_record  # noqa: E402
from megatron.errors import ConfigError, DataError  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES, SentencePieceTokenizer  # noqa: E402
from megatron.tokenizer.bpe_trainer import count_pretokens, train_byte_level_bpe, write_gpt2_files  # noqa: E402
from megatron.tokenizer.sentencepiece_tokenizer import train_sentencepiece  # noqa: E402

MALFORMED_EXAMPLES_SHOWN = 5


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="loose-JSON files")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys whose text to train on")
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help="tokens in the vocab, <|endoftext|> included")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument(
        "--min-frequency", type=int, default=None,
        help="GPT2BPETokenizer only: stop merging when the best pair occurs fewer times "
             "(default 2)",
    )
    return parser.parse_args(argv)


def validate_args(args):
    for path in args.input:
        if not os.path.isfile(path):
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise DataError(f"--input file '{path}' {what}")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise ConfigError(f"--output-dir '{args.output_dir}' exists and is not a directory")
    if args.vocab_size < 1:
        raise ConfigError(f"--vocab-size must be positive, got {args.vocab_size}")
    if args.tokenizer_type == "GPT2BPETokenizer" and args.vocab_size < 257:
        raise ConfigError(f"--vocab-size {args.vocab_size} is too small: GPT2BPETokenizer needs "
                          "at least 257 (256 byte symbols + <|endoftext|>)")
    if args.tokenizer_type == "SentencePieceTokenizer" and args.min_frequency is not None:
        raise ConfigError("--min-frequency applies to GPT2BPETokenizer only; sentencepiece has no "
                          "such option")
    if args.min_frequency is not None and args.min_frequency < 1:
        raise ConfigError(f"--min-frequency must be >= 1, got {args.min_frequency}")
    try:  # when the flags are checked, not after training
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--output-dir '{args.output_dir}' cannot be made "
                          f"({error.strerror})") from None


class LooseJsonReader:
    """The texts under `json_keys` in loose-JSON files, counting documents and malformed lines."""

    def __init__(self, paths, json_keys):
        self.paths = paths
        self.json_keys = json_keys
        self.documents = 0
        self.text_bytes = 0
        self.malformed = 0
        self.malformed_examples = []

    def texts(self):
        for path in self.paths:
            with open(path, "rb") as f:
                for line_number, raw_line in enumerate(f, start=1):
                    if raw_line.strip():
                        yield from self._line_texts(path, line_number, raw_line)

    def _line_texts(self, path, line_number, raw_line):
        try:
            record = parse_record(raw_line, self.json_keys)
        except MalformedLine as e:
            return self._skip(path, line_number, str(e))
        texts = [record[k] for k in self.json_keys]
        self.documents += len(texts)
        self.text_bytes += sum(len(t.encode("utf-8")) for t in texts)
        return texts

    def _skip(self, path, line_number, reason):
        self.malformed += 1
        if len(self.malformed_examples) < MALFORMED_EXAMPLES_SHOWN:
            self.malformed_examples.append(f"{path}:{line_number} ({reason})")
        return []


def train_gpt2_bpe(reader, args):
    counts = count_pretokens(reader.texts())
    require_documents(reader)
    min_frequency = 2 if args.min_frequency is None else args.min_frequency
    model = train_byte_level_bpe(counts, args.vocab_size, min_frequency)
    paths = write_gpt2_files(model, args.output_dir)
    return len(model.vocab), paths


def train_sentencepiece_model(reader, args):
    # sentencepiece trains on sentences: feed the non-empty lines of every document.
    sentences = [line for text in reader.texts() for line in text.split("\n") if line]
    require_documents(reader)
    os.makedirs(args.output_dir, exist_ok=True)
    model_path = train_sentencepiece(sentences, args.vocab_size,
                                     os.path.join(args.output_dir, "tokenizer.model"))
    return SentencePieceTokenizer(model_path).vocab_size, (model_path,)


def require_documents(reader):
    if reader.documents == 0:
        raise DataError(
            f"no usable documents in {', '.join(reader.paths)}: each line must be a JSON object "
            f"with a string under --json-keys {' '.join(reader.json_keys)} "
            f"({reader.malformed} malformed lines)"
        )


def print_summary(reader, args, vocab_size, paths, seconds):
    print(f"read {reader.documents} documents ({reader.text_bytes / 1e6:.2f} MB of text) from "
          f"{len(args.input)} file(s)")
    if reader.malformed:
        examples = "; ".join(reader.malformed_examples)
        print(f"skipped {reader.malformed} malformed line(s): {examples}"
              + (" ..." if reader.malformed > len(reader.malformed_examples) else ""))
    else:
        print("skipped 0 malformed lines")
    note = "" if vocab_size == args.vocab_size else \
        f" (asked for {args.vocab_size}: the corpus has no more frequent pairs)"
    print(f"{args.tokenizer_type}: vocab size {vocab_size}{note}, trained in {seconds:.1f} s")
    print(f"wrote {', '.join(paths)}")


def train_tokenizer(args):
    made = not os.path.exists(args.output_dir)
    try:
        _train(args)
    except BaseException:  # a failed run leaves no empty folder it made
        if made and os.path.isdir(args.output_dir) and not os.listdir(args.output_dir):
            os.rmdir(args.output_dir)
        raise


def _train(args):
    validate_args(args)
    reader = LooseJsonReader(args.input, args.json_keys)
    start = time.perf_counter()
    train = train_gpt2_bpe if args.tokenizer_type == "GPT2BPETokenizer" \
        else train_sentencepiece_model
    names = ("vocab.json", "merges.txt") if args.tokenizer_type == "GPT2BPETokenizer" \
        else ("tokenizer.model",)
    before = {name: _read_or_none(os.path.join(args.output_dir, name)) for name in names}
    vocab_size, paths = train(reader, args)
    print_summary(reader, args, vocab_size, paths, time.perf_counter() - start)
    replaced = [name for name, old in before.items()
                if old is not None and old != _read_or_none(os.path.join(args.output_dir, name))]
    if replaced:
        print(f"note: this replaced a different {' and '.join(replaced)} in {args.output_dir}: "
              "data tokenized and checkpoints trained with the old tokenizer do not match the "
              "new one")


def _read_or_none(path):
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def main(argv=None):
    return run_cli(train_tokenizer, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
