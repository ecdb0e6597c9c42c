import importlib.util
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.json_lines import MalformedLine, parse_record
from megatron.data.progress import Progress
from megatron.data.preprocessing import (ConstantFactory, split_line_ranges,
                                         tokenize_loose_json)
from megatron.errors import DataError
from tests.data.fakes import (ByteTokenizer, ExplodingTokenizer, FakeTokenizerFactory,
                              write_loose_json)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")

MALFORMED = [b'{"text": "unterminated', b'\xff\xfe{"text": "bad utf8"}', b'{"title": "no text"}',
             b'{"text": 17}', b'["a", "list"]', b'{"text": "lone \\ud800 surrogate"}',
             b'[' * 100_000 + b']' * 100_000,  # deeper than Python's JSON parser recurses
             b'{"text": "huge number", "n": ' + b'9' * 5000 + b'}']  # > int str digits limit


def _load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _corpus(tmp_path, num_docs=60):
    texts = [f"document {i}: " + "héllo wörld " * (i % 7) + "end" for i in range(num_docs)]
    records = [{"text": t, "id": i} for i, t in enumerate(texts)]
    # Put the malformed, empty and blank lines in the middle so every worker range sees some.
    lines = [json.dumps(r).encode() for r in records]
    middle = len(lines) // 2
    lines[middle:middle] = MALFORMED + [b'{"text": ""}', b"   "]
    path = tmp_path / "corpus.json"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path), texts


def _run_tool(tool, argv, monkeypatch):
    monkeypatch.setattr(tool, "TokenizerFactory", FakeTokenizerFactory)
    return tool.run(tool.get_args(argv))


def test_workers_give_byte_identical_output_and_count_bad_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Progress, "_make_bar", lambda self: None)  # plain lines, even with tqdm
    tool = _load_tool()
    corpus, texts = _corpus(tmp_path)
    outputs = {}
    for workers in (1, 2, 3):
        prefix = str(tmp_path / f"w{workers}" / "out")
        out, stats = _run_tool(tool, ["--input", corpus, "--output-prefix", prefix,
                                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                      "v", "--merge-file", "m", "--append-eod",
                                      "--workers", str(workers), "--log-interval", "10"],
                               monkeypatch)
        assert out == {"text": prefix + "_text_document"}
        assert (stats.documents, stats.malformed, stats.empty) == (60, 8, 1)
        assert stats.bytes_read == os.path.getsize(corpus)
        outputs[workers] = [open(out["text"] + ext, "rb").read() for ext in (".bin", ".idx")]
        assert sorted(os.listdir(tmp_path / f"w{workers}")) == [
            "out_text_document.bin", "out_text_document.idx",
            "out_text_document.source.json"]  # partials cleaned up
    assert outputs[1] == outputs[2] == outputs[3]
    ds = MMapIndexedDataset(str(tmp_path / "w2" / "out_text_document"))
    assert ds.dtype == np.uint16 and len(ds) == 60
    for doc, text in zip(ds, texts):
        assert list(doc) == list(text.encode("utf-8")) + [256]
    captured = capsys.readouterr()
    assert "docs/s" in captured.err and "MB/s" in captured.err
    assert "done: 60 documents" in captured.out and "8 malformed lines skipped" in captured.out
    assert "1 empty documents skipped" in captured.out and "MB/s" in captured.out
    # the first five, by line number (the malformed lines are lines 31-38 of the corpus)
    assert "  line 31: invalid JSON (Unterminated string" in captured.out
    assert "  line 32: invalid UTF-8 (byte 0 of the line)" in captured.out
    assert "  line 35: not a JSON object (a list)" in captured.out
    assert "line 36:" not in captured.out and "... and 3 more malformed lines" in captured.out


@pytest.mark.parametrize("workers", [1, 2])
def test_strict_stops_at_the_first_malformed_line_with_its_number(tmp_path, workers):
    corpus, _ = _corpus(tmp_path)
    with pytest.raises(DataError, match=r"corpus.json line 31: invalid JSON \(Unterminated.*"
                                        r"--strict stops at the first malformed line"):
        tokenize_loose_json(corpus, str(tmp_path / "o"), ConstantFactory(ByteTokenizer()),
                            workers=workers, strict=True, stream=io.StringIO())
    assert sorted(os.listdir(tmp_path)) == ["corpus.json"]  # nothing half-written left


@pytest.mark.parametrize("line, reason", [
    (b'[' * 100_000, "invalid JSON (nested too deeply to parse)"),
    (b'{"text": 1' + b'0' * 5000 + b'}', "invalid JSON (Exceeds the limit"),
    (b'{"text": "a"', "invalid JSON (Expecting ',' delimiter"),
    (b'\xc3\x28', "invalid UTF-8 (byte 0 of the line)"),
    (b'"just a string"', "not a JSON object (a str)"),
    (b'{"text": null}', "no string under 'text' (a NoneType)"),
])
def test_every_unreadable_line_is_one_reason(line, reason):
    with pytest.raises(MalformedLine) as caught:
        parse_record(line, ("text",))
    assert str(caught.value).startswith(reason)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_worker_start_methods_agree(tmp_path, monkeypatch, start_method):
    import multiprocessing
    import megatron.data.preprocessing as preprocessing
    monkeypatch.setattr(preprocessing, "_process_context",
                        lambda: multiprocessing.get_context(start_method))
    corpus, texts = _corpus(tmp_path, num_docs=20)
    one, _ = tokenize_loose_json(corpus, str(tmp_path / "one"), ConstantFactory(ByteTokenizer()),
                                 append_eod=True, stream=io.StringIO())
    two, stats = tokenize_loose_json(corpus, str(tmp_path / "two"),
                                     ConstantFactory(ByteTokenizer()), append_eod=True, workers=2,
                                     stream=io.StringIO())
    assert (stats.documents, stats.malformed, stats.empty) == (20, 8, 1)
    for ext in (".bin", ".idx"):
        assert open(one["text"] + ext, "rb").read() == open(two["text"] + ext, "rb").read()


def test_one_output_per_json_key_without_eod(tmp_path):
    corpus = write_loose_json(tmp_path / "c.json", [{"text": "ab", "title": "T"},
                                                    {"text": "c", "title": "UV"}])
    out, stats = tokenize_loose_json(corpus, str(tmp_path / "o"), ConstantFactory(ByteTokenizer()),
                                     json_keys=["text", "title"], stream=io.StringIO())
    assert stats.tokens == 3 and stats.documents == 2
    assert [list(x) for x in MMapIndexedDataset(out["text"])] == [[97, 98], [99]]
    assert [list(x) for x in MMapIndexedDataset(out["title"])] == [[84], [85, 86]]


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 50])
def test_split_line_ranges_cover_the_file_at_line_starts(tmp_path, parts):
    lines = [b"x" * n for n in (0, 5, 1, 30, 2, 2, 9, 0, 4)]
    path = tmp_path / "f.txt"
    path.write_bytes(b"\n".join(lines) + b"\n")
    data = path.read_bytes()
    line_starts = {0} | {i + 1 for i, c in enumerate(data) if c == ord("\n")}
    ranges = split_line_ranges(str(path), parts)
    assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == len(data)
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c and a <= b
    assert all(a in line_starts for a, _ in ranges)


def test_worker_failure_raises_and_leaves_no_files(tmp_path):
    corpus = write_loose_json(tmp_path / "c.json", [{"text": "fine"}] * 20 + [{"text": "BOOM"}])
    out_dir = tmp_path / "out"
    with pytest.raises(RuntimeError, match="tokenizer bug"):
        tokenize_loose_json(corpus, str(out_dir / "o"), ConstantFactory(ExplodingTokenizer()),
                            workers=2, stream=io.StringIO())
    assert os.listdir(out_dir) == []
    with pytest.raises(ValueError, match="tokenizer bug"):
        tokenize_loose_json(corpus, str(out_dir / "o"), ConstantFactory(ExplodingTokenizer()),
                            workers=1, stream=io.StringIO())
    assert os.listdir(out_dir) == []


def test_missing_input_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        tokenize_loose_json(str(tmp_path / "nope.json"), str(tmp_path / "o"),
                            ConstantFactory(ByteTokenizer()))


def test_cli_prints_error_without_traceback(tmp_path):
    base = [sys.executable, TOOL, "--output-prefix", str(tmp_path / "o")]
    corpus = write_loose_json(tmp_path / "c.json", [{"text": "x"}])
    result = subprocess.run(base + ["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --tokenizer-type GPT2BPETokenizer needs --vocab-file")
    assert "Traceback" not in result.stderr
    result = subprocess.run(base + ["--input", str(tmp_path / "missing.json"), "--tokenizer-type",
                                    "SentencePieceTokenizer", "--tokenizer-model", "m.model"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "missing.json: no such file" in result.stderr


def test_plain_progress_prints_every_log_interval_off_a_terminal():
    stream = io.StringIO()  # a log file: plain lines, even with tqdm installed
    progress = Progress(total_bytes=1000, log_interval=10, stream=stream)
    for _ in range(7):
        progress.update(4, 100)  # 28 documents: crosses 10 and 20
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("processed 12 documents (") and "MB/s, 30.0% of input)" in lines[0]
    assert "docs/s" in lines[1]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_tqdm_progress_shows_rates_on_a_terminal():
    pytest.importorskip("tqdm")
    stream = _Terminal()
    progress = Progress(total_bytes=2_000_000, log_interval=10, stream=stream)
    progress.update(5, 2_000_000)
    progress.close()
    assert "5 docs" in stream.getvalue() and "docs/s" in stream.getvalue()
    assert "2.00M/2.00M" in stream.getvalue()


def _write_tiny_gpt2_files(directory):
    """A byte-level vocab (256 byte symbols, two merges, <|endoftext|>) written by hand."""
    from megatron.tokenizer.gpt2_bpe import bytes_to_unicode
    symbols = [bytes_to_unicode()[b] for b in range(256)]
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({"Ġt": 256, "he": 257, "<|endoftext|>": 258})
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\nĠ t\nh e\n")
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def test_cli_with_the_real_gpt2_tokenizer(tmp_path):
    pytest.importorskip("megatron.tokenizer")
    from megatron.tokenizer import build_tokenizer
    vocab, merges = _write_tiny_gpt2_files(tmp_path)
    texts = [f"the {i} then ß the end" for i in range(30)]
    corpus = write_loose_json(tmp_path / "c.json", [{"text": t} for t in texts],
                              raw_lines=[b"{oops"])
    results = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        result = subprocess.run(
            [sys.executable, TOOL, "--input", corpus, "--output-prefix", prefix,
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file",
             merges, "--append-eod", "--workers", str(workers), "--dataset-impl", "mmap"],
            capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, result.stderr
        assert "done: 30 documents" in result.stdout and "1 malformed" in result.stdout
        results[workers] = [open(prefix + "_text_document" + ext, "rb").read()
                            for ext in (".bin", ".idx")]
    assert results[1] == results[2]
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ds = MMapIndexedDataset(str(tmp_path / "w2_text_document"))
    assert [list(d) for d in ds] == [tokenizer.tokenize(t) + [258] for t in texts]
    assert 256 in ds[0] and 257 in ds[0]  # the merges were applied


def test_an_input_without_documents_is_an_error_and_leaves_no_dataset(tmp_path, monkeypatch):
    tool = _load_tool()
    corpus = tmp_path / "bad.json"
    corpus.write_bytes(b'{"body": "no text key"}\n{not json\n\n')
    prefix = str(tmp_path / "out" / "x")
    with pytest.raises(DataError, match=r"holds no usable documents \(2 malformed lines, 0 "
                                        r"empty documents; line 1: no string under 'text'"):
        _run_tool(tool, ["--input", str(corpus), "--output-prefix", prefix, "--tokenizer-type",
                         "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m"],
                  monkeypatch)
    assert os.listdir(tmp_path / "out") == []


def test_the_output_prefix_may_name_a_folder_and_must_be_makeable(tmp_path, monkeypatch):
    tool = _load_tool()
    corpus, _ = _corpus(tmp_path, num_docs=3)
    argv = ["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v",
            "--merge-file", "m"]
    out, _ = _run_tool(tool, argv + ["--output-prefix", str(tmp_path / "new") + "/"],
                       monkeypatch)  # a trailing slash: files named _text_document in it
    assert out == {"text": str(tmp_path / "new") + "/_text_document"}
    assert os.path.isfile(out["text"] + ".bin")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match="--output-prefix .*afile/x: cannot make the folder"):
        _run_tool(tool, argv + ["--output-prefix", str(tmp_path / "afile" / "x")], monkeypatch)


def test_a_folder_given_as_input_says_so(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"--input .*: a directory \(expected a loose JSON file"):
        _run_tool(_load_tool(), ["--input", str(tmp_path), "--output-prefix",
                                 str(tmp_path / "x"), "--tokenizer-type", "GPT2BPETokenizer",
                                 "--vocab-file", "v", "--merge-file", "m"], monkeypatch)


def test_an_output_prefix_ending_in_the_appended_suffix_is_refused(tmp_path, monkeypatch):
    from megatron.errors import ConfigError
    corpus, _ = _corpus(tmp_path, num_docs=3)
    with pytest.raises(ConfigError, match=r"--output-prefix .*/x_text_document ends in "
                                          r"_text_document, which is appended to it .*; give "
                                          r"--output-prefix .*/x$"):
        _run_tool(_load_tool(), ["--input", corpus, "--output-prefix",
                                 str(tmp_path / "x_text_document"), "--tokenizer-type",
                                 "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m"],
                  monkeypatch)
    assert not list(tmp_path.glob("x_*"))


def test_compressed_piped_and_twice_keyed_inputs_are_one_error(tmp_path):
    import gzip
    corpus = write_loose_json(tmp_path / "c.json", [{"text": "x"}])
    packed = tmp_path / "c.json.gz"
    packed.write_bytes(gzip.compress(open(corpus, "rb").read()))
    make = ConstantFactory(ByteTokenizer())
    with pytest.raises(DataError, match=r"c.json.gz is gzip-compressed: decompress it to a file"):
        tokenize_loose_json(str(packed), str(tmp_path / "o"), make)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"pipe: not a regular file \(a pipe or a device\?\)"):
        tokenize_loose_json(str(fifo), str(tmp_path / "o"), make)
    with pytest.raises(DataError, match="--json-keys text text names a key twice"):
        tokenize_loose_json(corpus, str(tmp_path / "o"), make, json_keys=("text", "text"))
    assert not list(tmp_path.glob("o_*"))


def test_a_byte_order_mark_does_not_cost_a_document(tmp_path):
    corpus = tmp_path / "bom.json"
    corpus.write_bytes(b'\xef\xbb\xbf{"text": "one"}\n\xef\xbb\xbf{"text": "two"}\n')
    outputs, stats = tokenize_loose_json(str(corpus), str(tmp_path / "o"),
                                         ConstantFactory(ByteTokenizer()), stream=io.StringIO())
    assert stats.documents == 2 and stats.malformed == 0
    assert [bytes(d.astype(np.uint8)) for d in MMapIndexedDataset(outputs["text"])] == \
        [b"one", b"two"]


def test_what_a_killed_run_left_is_removed_and_a_live_runs_is_kept(tmp_path):
    corpus = write_loose_json(tmp_path / "c.json", [{"text": "x"}])
    prefix = str(tmp_path / "o_text_document")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    for leftover in (f"{prefix}.bin.tmp.{dead}", f"{prefix}.idx.tmp.{dead}",
                     f"{prefix}.bin.tmp.{os.getppid()}"):
        open(leftover, "wb").close()
    os.makedirs(f"{prefix}.parts.{dead}/inner")
    stream = io.StringIO()
    tokenize_loose_json(corpus, str(tmp_path / "o"), ConstantFactory(ByteTokenizer()),
                        stream=stream)
    assert sorted(os.listdir(tmp_path)) == sorted([
        "c.json", "o_text_document.bin", "o_text_document.idx", "o_text_document.source.json",
        f"o_text_document.bin.tmp.{os.getppid()}"])  # a live process's: kept
    assert "note: removed 3 temporary file(s) an interrupted earlier run left: " in \
        stream.getvalue()


def test_an_empty_input_says_it_is_empty(tmp_path):
    (tmp_path / "empty.json").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty.json is empty; it must be loose JSON"):
        tokenize_loose_json(str(tmp_path / "empty.json"), str(tmp_path / "o"),
                            ConstantFactory(ByteTokenizer()))
