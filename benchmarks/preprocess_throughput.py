"""tools/preprocess_data.py throughput (MB/s) with 1 and 2 workers, next to a peer.

The peer is Hugging Face `tokenizers` (Rust) encoding the same documents with the same
vocab.json/merges.txt on one thread (skipped when not installed). Input: the default corpus
(data/webtext/data.json, made by scripts/pretrain_gpt2.sh) or --input.

    python benchmarks/preprocess_throughput.py [--quick] \
        [--input data.json --vocab-file ... --merge-file ...]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import REPO_ROOT, machine_description, markdown_table, update_docs_section


def run_preprocess(args, workers, out_dir):
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py"),
           "--input", args.input, "--output-prefix", os.path.join(out_dir, f"w{workers}"),
           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", args.vocab_file,
           "--merge-file", args.merge_file, "--append-eod", "--workers", str(workers)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def run_hf_tokenizers(args):
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        return None
    os.environ["RAYON_NUM_THREADS"] = "1"
    tokenizer = ByteLevelBPETokenizer(args.vocab_file, args.merge_file)
    start = time.perf_counter()
    with open(args.input, encoding="utf-8") as f:
        for line in f:
            tokenizer.encode(json.loads(line)["text"])
    return time.perf_counter() - start


def main():
    default_data = os.path.join(REPO_ROOT, "data")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", default=os.path.join(default_data, "webtext", "data.json"))
    parser.add_argument("--vocab-file",
                        default=os.path.join(default_data, "tokenizer", "vocab.json"))
    parser.add_argument("--merge-file",
                        default=os.path.join(default_data, "tokenizer", "merges.txt"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args()
    for path in (args.input, args.vocab_file, args.merge_file):
        if not os.path.exists(path):
            sys.exit(f"error: {path} is missing; run `bash scripts/pretrain_gpt2.sh` once (it "
                     "prepares the default corpus and tokenizer) or pass "
                     "--input/--vocab-file/--merge-file")
    repeats = 1 if args.quick else args.repeats
    megabytes = os.path.getsize(args.input) / 1e6
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        timings = {f"preprocess_data.py --workers {w}": statistics.median(
            run_preprocess(args, w, out_dir) for _ in range(repeats)) for w in (1, 2)}
    hf = [run_hf_tokenizers(args) for _ in range(repeats)]
    if hf[0] is not None:
        timings["HF tokenizers (Rust), 1 thread, encode only"] = statistics.median(hf)
    base = timings["preprocess_data.py --workers 1"]
    for name, seconds in timings.items():
        rows.append([name, f"{seconds:.2f}", f"{megabytes / seconds:.2f}", f"{base / seconds:.2f}"])
    table = markdown_table(["what", "seconds", "MB/s", "speed vs 1 worker"], rows)
    body = (f"## Preprocessing throughput (`benchmarks/preprocess_throughput.py`)\n\n"
            f"Machine: {machine_description()}.\n\nInput: {os.path.relpath(args.input, REPO_ROOT)} "
            f"({megabytes:.2f} MB), GPT-2 BPE with the trained vocab, `--append-eod`. Wall time of "
            f"the whole command (process start, tokenizing, writing, merging the parts), median "
            f"of {repeats}. The HF row encodes the same documents in one process and writes "
            f"nothing.\n\n{table}\n")
    print(body)
    if args.write_docs and not args.quick:
        update_docs_section("preprocess_throughput", body)


if __name__ == "__main__":
    main()
