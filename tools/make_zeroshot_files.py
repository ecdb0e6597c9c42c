"""Derive small WikiText-format and LAMBADA-format evaluation files from a loose-JSON corpus.

    python tools/make_zeroshot_files.py --input data/webtext/data.json --output-dir data/zeroshot
    # -> data/zeroshot/wiki.test.tokens, data/zeroshot/lambada_test.jsonl

For trying scripts/evaluate_zeroshot_gpt2.sh on a machine without the real WikiText-103 and
LAMBADA files.  The documents are the LAST --num-documents of the corpus: with the default
training run's --split 949,50,1 they are its held-out (validation/test) documents.
  * wiki.test.tokens: WikiText's word-level style: " = Document N = " headings, punctuation
    split off by spaces, hyphens inside words as " @-@ ".
  * lambada_test.jsonl: {"text": passage} lines, each passage --passage-words words ending
    at a word of at least 3 letters (the word to predict), punctuation after it dropped.
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.data.json_lines import MalformedLine, parse_record  # noqa: E402

_PUNCTUATION = re.compile(r"([,.;:!?()\[\]\"])")
_INNER_HYPHEN = re.compile(r"(?<=\w)-(?=\w)")


def wikitext_line(line):
    line = _INNER_HYPHEN.sub(" @-@ ", line)
    line = _PUNCTUATION.sub(r" \1 ", line)
    return " " + " ".join(line.split()) + " \n"


def wikitext_document(number, text):
    lines = [f" = Document {number} = \n", " \n"]
    lines += [wikitext_line(line) for line in text.splitlines() if line.strip()]
    return "".join(lines) + " \n"


def lambada_passages(text, passage_words):
    words = text.split()
    passages, start = [], 0
    while start + passage_words <= len(words):
        chunk = words[start:start + passage_words]
        while chunk and len(re.sub(r"\W", "", chunk[-1])) < 3:
            chunk.pop()  # end on a real word, as LAMBADA's targets are
        if len(chunk) > passage_words // 2:
            chunk[-1] = re.sub(r"\W+$", "", chunk[-1])
            passages.append(" ".join(chunk))
        start += passage_words
    return passages


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--input", required=True, help="loose JSON: one {\"text\": ...} a line")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-documents", type=int, default=8)
    parser.add_argument("--passage-words", type=int, default=60,
                        help="words per LAMBADA passage (at least 2: a context and a target)")
    parser.add_argument("--max-passages", type=int, default=100)
    args = parser.parse_args(argv)
    for flag, value, least in (("--num-documents", args.num_documents, 1),
                               ("--passage-words", args.passage_words, 2),
                               ("--max-passages", args.max_passages, 1)):
        if value < least:
            return _error(f"{flag} must be at least {least}, got {value}")
    if not os.path.isfile(args.input):
        return _error(f"--input {args.input} is not a file")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        return _error(f"--output-dir {args.output_dir} exists and is not a directory")
    texts, malformed = _read_texts(args.input)
    if not texts:
        return _error(f"--input {args.input} holds no {{\"text\": ...}} documents "
                      f"({malformed} malformed lines)")
    if args.num_documents >= len(texts):  # the stand-ins are the training text itself
        print(f" note: --num-documents {args.num_documents} covers the whole corpus "
              f"({len(texts)} documents): none is held out from training, so the scores are "
              "on text the model trained on; give fewer")
    held_out = texts[-args.num_documents:]
    passages = [p for t in held_out for p in lambada_passages(t, args.passage_words)]
    if not passages:  # before anything is written over an earlier pair of files
        longest = max(len(t.split()) for t in held_out)
        if longest < args.passage_words:
            return _error(f"the last {len(held_out)} documents of --input {args.input} are "
                          f"shorter than --passage-words {args.passage_words} (the longest has "
                          f"{longest} words): no LAMBADA passage; give a smaller "
                          "--passage-words or more --num-documents")
        return _error(f"no stretch of --passage-words {args.passage_words} words in the last "
                      f"{len(held_out)} documents of --input {args.input} ends, within its last "
                      "half, on a word of 3 or more letters (a target to predict): no LAMBADA "
                      "passage; give other --passage-words or more --num-documents")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        wiki_path = os.path.join(args.output_dir, "wiki.test.tokens")
        with open(wiki_path, "w", encoding="utf-8") as f:
            f.write(" \n" + "".join(wikitext_document(i + 1, t) for i, t in enumerate(held_out)))
        lambada_path = os.path.join(args.output_dir, "lambada_test.jsonl")
        with open(lambada_path, "w", encoding="utf-8") as f:
            for passage in passages[:args.max_passages]:
                f.write(json.dumps({"text": passage}) + "\n")
    except OSError as error:
        return _error(f"cannot write to --output-dir {args.output_dir}: {error.strerror}")
    skipped = f"; skipped {malformed} malformed lines" if malformed else ""
    print(f" wrote {wiki_path} ({len(held_out)} documents) and {lambada_path} "
          f"({min(len(passages), args.max_passages)} passages){skipped}")
    return 0


def _read_texts(path):
    """(texts of the file's loose-JSON lines, count of malformed ones), as preprocessing reads
    them: blank lines and empty texts ignored, lines without a "text" string skipped and
    counted."""
    texts, malformed = [], 0
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                text = parse_record(line, ("text",))["text"]
            except MalformedLine:
                malformed += 1
                continue
            if text.strip():
                texts.append(text)
    return texts, malformed


def _error(message):
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
