import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from megatron.tokenizer import build_tokenizer

from .conftest import UNICODE_SNIPPETS, varied_text

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO_ROOT, "tools", "train_tokenizer.py")


def run_tool(*args, cwd):
    return subprocess.run([sys.executable, TOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def write_corpus(path):
    lines = [json.dumps({"text": varied_text(seed, 25), "url": f"u{seed}"}) for seed in range(4)]
    lines.insert(2, '{"text": "unterminated')  # malformed JSON
    lines.insert(3, json.dumps({"body": "no text key"}))  # valid JSON, missing key
    lines.insert(4, "")  # blank lines are not documents and not malformed
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8") + b"\xff\xfe bad utf-8\n")
    return str(path)


def test_gpt2_bpe_from_tiny_corpus(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.json")
    out = tmp_path / "tok"
    # Run from another directory: the tool must find the repo on its own.
    result = run_tool("--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-size", "400",
                      "--output-dir", str(out), cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "read 4 documents" in result.stdout
    assert "skipped 3 malformed line(s)" in result.stdout
    assert "corpus.json:3 (invalid JSON (Unterminated string" in result.stdout
    assert "corpus.json:4 (no string under 'text' (no such key" in result.stdout
    assert "vocab size 400" in result.stdout
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(out / "vocab.json"), merge_file=str(out / "merges.txt"))
    assert tok.vocab_size == 400 and tok.eod == 399
    assert tok.detokenize(tok.tokenize(UNICODE_SNIPPETS[1])) == UNICODE_SNIPPETS[1]


def test_sentencepiece_from_tiny_corpus(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.json")
    # As documented: `python tools/train_tokenizer.py ...` from the repo root.
    result = subprocess.run(
        [sys.executable, "tools/train_tokenizer.py", "--input", corpus, "--tokenizer-type", "SentencePieceTokenizer",
         "--vocab-size", "600", "--output-dir", str(tmp_path / "sp")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "skipped 3 malformed line(s)" in result.stdout
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp" / "tokenizer.model"))
    assert tok.vocab_size == 600 and tok.inv_vocab[tok.eod] == "<|endoftext|>"


def load_tool_module():
    spec = importlib.util.spec_from_file_location("train_tokenizer_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_input_exits_2_without_traceback(tmp_path):
    result = run_tool("--input", str(tmp_path / "missing.json"), "--tokenizer-type", "GPT2BPETokenizer",
                      "--output-dir", str(tmp_path / "out"), cwd=REPO_ROOT)
    assert result.returncode == 2
    assert result.stderr == f"error: --input file '{tmp_path / 'missing.json'}' does not exist\n"


def test_user_errors_exit_2_with_message(tmp_path, capsys):
    tool = load_tool_module()
    corpus = write_corpus(tmp_path / "corpus.json")
    empty = tmp_path / "empty.json"
    empty.write_text('{"body": "x"}\n', encoding="utf-8")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("", encoding="utf-8")
    out = ["--output-dir", str(tmp_path / "out")]
    cases = [
        (["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-size", "100", *out], "--vocab-size 100 is too small"),
        (["--input", corpus, "--tokenizer-type", "SentencePieceTokenizer", "--min-frequency", "3", *out], "--min-frequency applies to GPT2BPETokenizer only"),
        (["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--min-frequency", "0", *out], "--min-frequency must be >= 1"),
        (["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--output-dir", str(not_a_dir)], "exists and is not a directory"),
        (["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--output-dir", str(not_a_dir / "sub")], "cannot be made"),
        (["--input", str(tmp_path), "--tokenizer-type", "GPT2BPETokenizer", *out], "is a directory"),
        (["--input", str(empty), "--tokenizer-type", "GPT2BPETokenizer", *out], "no usable documents in .*empty.json.*1 malformed"),
        (["--input", corpus, "--tokenizer-type", "SentencePieceTokenizer", "--vocab-size", "100000", *out], "Vocabulary size too high"),
        (["--input", corpus, "--tokenizer-type", "SentencePieceTokenizer", "--vocab-size", "0", *out], "--vocab-size must be positive, got 0"),
    ]
    for args, message in cases:
        assert tool.main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and re.search(message, err), (message, err)
    assert not (tmp_path / "out").exists()  # a failed run leaves no folder it made
    with pytest.raises(SystemExit):  # no abbreviations: --vocab is not --vocab-size
        tool.parse_args(["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab",
                         "300", *out])
    assert "unrecognized arguments: --vocab" in capsys.readouterr().err
    help_text = tool.parse_args.__globals__["__doc__"]
    assert "GPT2BPETokenizer \\\n        --vocab-size 8192" in help_text  # one command a line


def test_retraining_into_a_tokenizers_folder_says_when_it_replaced_a_different_one(tmp_path,
                                                                                 capsys):
    tool = load_tool_module()
    corpus = write_corpus(tmp_path / "corpus.json")
    argv = ["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--output-dir",
            str(tmp_path / "tok")]
    assert tool.main(argv + ["--vocab-size", "300"]) == 0
    assert tool.main(argv + ["--vocab-size", "300"]) == 0  # the same files again: no note
    assert "note:" not in capsys.readouterr().out
    assert tool.main(argv + ["--vocab-size", "320"]) == 0
    assert "note: this replaced a different vocab.json and merges.txt" in capsys.readouterr().out
