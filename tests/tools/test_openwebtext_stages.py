"""tools/openwebtext stage by stage: exactly what each keeps and drops, for 1 and 2 workers."""

import json
import os
import subprocess
import sys

import pytest

from tests.tools import owt_corpus
from tools.openwebtext import (blacklist_urls, cleanup_dataset, find_duplicates,
                               group_duplicates_url, merge_jsons, remove_group_duplicates,
                               shuffle_jsons)
from tools.openwebtext.cleanup_dataset import count_tokens_up_to
from tools.openwebtext.external import dedup_lines, shuffle_lines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ns = __import__("argparse").Namespace


def urls_of(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["url"] for line in f]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    return owt_corpus.write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """(merged.json path, expected numbers): merge_jsons over the planted pages."""
    root = tmp_path_factory.mktemp("owt")
    expected = owt_corpus.write_pages(root / "pages")
    output = root / "merged.json"
    report = merge_jsons.run(ns(json_path=[str(root / "pages")], output_file=str(output),
                                workers=2, bucket_mb=64.0))
    return output, expected, report


def test_blacklist_urls_drops_each_reason_and_keeps_order(tmp_path):
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "1.txt").write_bytes(b"\n".join([
        b"https://news.example.com/story/1", b"http://a.co/x", b"https://imgur.com/gallery/a",
        b"https://m.youtube.com/watch?v=1", b"https://blog.example.org/photo.JPG",
        b"ftp://files.example.com/readme", b"https://bad_host.example/x",
        b"https://news.example.com/story/1", b"https://spam.example.net/page",
        b"https://ok.example.net/caf\xff", b"https://caf\xc3\xa9.example.fr/menu", b""]))
    (tmp_path / "lists" / "2.txt").write_text("https://news.example.com/story/2\n"
                                              "https://ok.example.net/a b\n")
    (tmp_path / "domains.txt").write_text("# mine\nspam.example.net\n")
    out = tmp_path / "clean.txt"
    reports = []
    for workers in (1, 2):
        reports.append(blacklist_urls.run(ns(
            inputs=[str(tmp_path / "lists")], output=str(out), workers=workers,
            domain_blacklist=[str(tmp_path / "domains.txt")], extension_blacklist=[],
            no_default_blacklists=False, min_length=13, bucket_mb=0.0001)))
        assert out.read_text(encoding="utf-8").splitlines() == [
            "https://news.example.com/story/1", "https://café.example.fr/menu",
            "https://news.example.com/story/2"]
    assert reports[0].to_json()["dropped"] == reports[1].to_json()["dropped"] == {
        "domain blacklist": 3, "duplicate": 1, "extension blacklist": 1,
        "malformed: invalid UTF-8": 1, "malformed: invalid host name": 1,
        "malformed: not an http(s) URL": 1, "malformed: whitespace inside the URL": 1,
        "too short (<= 13 characters)": 1}
    assert reports[0].read == 13 and reports[0].kept == 3


def test_merge_jsons_counts_malformed_lines_and_repeated_urls(merged):
    output, expected, report = merged
    assert report.read == expected["merge_read"] and report.kept == expected["merge_kept"]
    assert dict(report.dropped) == expected["merge_dropped"]
    assert len(report.examples) == 3 and all(e[0].endswith(("a.json", "b.jsonl"))
                                             for e in report.examples)
    assert urls_of(output)[:2] == ["https://site.example/en/0", "https://site.example/en/1"]
    assert not [n for n in os.listdir(output.parent) if "tmp" in n]


@pytest.mark.parametrize("workers", [1, 2])
def test_cleanup_repairs_and_drops_short_and_foreign(merged, tokenizer_files, tmp_path, workers):
    source, expected, _ = merged
    vocab, merges = tokenizer_files
    output = tmp_path / "cleaned.json"
    report = cleanup_dataset.run(ns(
        input=str(source), output=str(output), min_tokens=owt_corpus.MIN_TOKENS,
        language=["en"], language_chars=2000, langdetect_seed=0,
        tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges,
        tokenizer_model=None, workers=workers))
    assert dict(report.dropped) == expected["cleanup_dropped"]
    texts = {json.loads(line)["url"]: json.loads(line)["text"] for line in open(output)}
    assert list(texts) == [u for u in urls_of(source) if u.rsplit("/", 1)[1]
                           not in ("de", "fr", "short")]
    assert "the café " in texts["https://site.example/mojibake"]  # ftfy undid the mojibake


def test_count_tokens_up_to_is_exact_across_chunk_cuts(tokenizer_files):
    from megatron.tokenizer import build_tokenizer
    tokenizer = build_tokenizer("GPT2BPETokenizer", *tokenizer_files)
    for text in [owt_corpus.english(7, sentences=40), "word  " * 300 + "end",
                 owt_corpus.GERMAN * 5, "x" * 2000 + " y" * 10]:
        full = len(tokenizer.tokenize(text))
        assert count_tokens_up_to(text, tokenizer, 10 ** 6) == full
        assert count_tokens_up_to(text, tokenizer, 16) >= min(16, full)


def test_near_duplicates_found_grouped_and_removed(merged, tmp_path):
    source, expected, _ = merged
    pairs_path, groups_path = tmp_path / "pairs.jsonl", tmp_path / "groups.jsonl"
    report = find_duplicates.run(ns(input=str(source), output=str(pairs_path), threshold=0.8,
                                    lsh_threshold=None, shingle_size=5, num_perm=128,
                                    minhash_seed=1, workers=2))
    pairs = [json.loads(line) for line in open(pairs_path)]
    found = {frozenset((p["url"], p["duplicate"])) for p in pairs}
    base, (copy1, copy2) = "https://site.example/en/0", expected["near_duplicates"]
    assert found == {frozenset((base, copy1)), frozenset((base, copy2)),
                     frozenset((copy1, copy2))}
    assert all(0.8 <= p["jaccard"] < 1.0 and p["index"] < p["duplicate_index"] for p in pairs)
    assert report.read == report.kept == expected["merge_kept"]
    group_report = group_duplicates_url.run(ns(input=str(pairs_path), output=str(groups_path),
                                               threshold=0.8))
    assert [json.loads(line) for line in open(groups_path)] == [[base, copy1, copy2]]
    assert group_report.notes["groups"] == 1
    deduped = tmp_path / "deduped.json"
    report = remove_group_duplicates.run(ns(groups=str(groups_path), input=str(source),
                                            output=str(deduped), workers=2))
    assert dict(report.dropped) == {"near-duplicate": 2}
    assert urls_of(deduped) == [u for u in urls_of(source) if u not in (copy1, copy2)]


def test_stricter_group_threshold_splits_groups(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(p) for p in [
        {"url": "a", "duplicate": "b", "jaccard": 0.95, "index": 0, "duplicate_index": 3},
        {"url": "b", "duplicate": "c", "jaccard": 0.85, "index": 3, "duplicate_index": 5},
        {"url": "d", "duplicate": "e", "jaccard": 0.99, "index": 1, "duplicate_index": 2},
    ]) + "\nnot json\n")
    out = tmp_path / "groups.jsonl"
    report = group_duplicates_url.run(ns(input=str(pairs), output=str(out), threshold=0.8))
    assert [json.loads(x) for x in open(out)] == [["a", "b", "c"], ["d", "e"]]
    assert report.to_json()["dropped"] == {"malformed: not a find_duplicates.py pair": 1}
    group_duplicates_url.run(ns(input=str(pairs), output=str(out), threshold=0.9))
    assert [json.loads(x) for x in open(out)] == [["a", "b"], ["d", "e"]]


def test_external_dedup_and_shuffle_across_many_buckets(tmp_path):
    source = tmp_path / "lines.txt"
    lines = [f"line {i % 70}\n".encode() for i in range(200)]
    source.write_bytes(b"".join(lines))
    out = tmp_path / "dedup.txt"
    dropped = dedup_lines(str(source), str(out), lambda line: line, bucket_bytes=100)
    assert dropped == 130 and out.read_bytes() == b"".join(lines[:70])
    shuffled = []
    for workers in (1, 2):
        target = tmp_path / f"shuffled{workers}.txt"
        shuffle_lines(str(source), str(target), seed=3, workers=workers, bucket_bytes=300)
        shuffled.append(target.read_bytes().splitlines(keepends=True))
    assert shuffled[0] == shuffled[1] != lines and sorted(shuffled[0]) == sorted(lines)
    report = shuffle_jsons.run(ns(input=str(source), output=str(tmp_path / "s.txt"), seed=4,
                                  bucket_mb=1.0, workers=1))
    assert report.read == report.kept == 200


def _upper_case_filter():
    return lambda line: (None, "has x") if b"x" in line else (line.upper(), None)


def _dying_filter():
    def line_filter(line):
        if line.startswith(b"die"):
            os._exit(3)  # a worker killed mid-segment (e.g. for memory)
        return line, None
    return line_filter


def test_many_segments_keep_order_and_a_dead_worker_is_an_error(tmp_path):
    from tools.openwebtext.streaming import run_line_filter
    source = tmp_path / "in.txt"
    source.write_bytes(b"".join(b"line %d%s\n" % (i, b" x" if i % 7 == 0 else b"")
                                for i in range(500)))
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}.txt"
        report = run_line_filter("upper", [str(source)], str(out), _upper_case_filter,
                                 workers=workers, segment_bytes=300)  # ~20 segments
        outputs.append(out.read_bytes())
        assert report.read == 500 and dict(report.dropped) == {"has x": 72}
    assert outputs[0] == outputs[1] and outputs[0].startswith(b"LINE 1\nLINE 2\n")
    source.write_bytes(b"ok\n" * 50 + b"die\n" + b"ok\n" * 50)
    with pytest.raises(RuntimeError, match="worker process died"):
        run_line_filter("dies", [str(source)], str(tmp_path / "never.txt"), _dying_filter,
                        workers=2, segment_bytes=64)
    assert not (tmp_path / "never.txt").exists()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_lsh_bands_find_shared_buckets_and_link_huge_ones_linearly(tmp_path):
    import numpy as np
    from tools.openwebtext.lsh_bands import candidate_pairs, write_band_keys
    hashvalues = np.random.RandomState(0).randint(0, 2 ** 32, (300, 24), dtype=np.int64)
    hashvalues[200] = hashvalues[3]                  # identical signatures
    hashvalues[250, :4] = hashvalues[3, :4]          # shares band 0 only
    hashvalues[100:160] = hashvalues[99]             # a 61-document bucket
    chunks = np.array_split(hashvalues.astype(np.uint32), 7)  # keys written chunk by chunk
    pairs = candidate_pairs(write_band_keys(chunks, 6, 4, str(tmp_path / "keys")))
    assert {(3, 200), (3, 250), (200, 250)} <= pairs
    big = {p for p in pairs if 99 <= p[0] < 160}
    assert len(big) == 60 + 59 and all(a < b for a, b in big)  # star + chain, not 1830 pairs
    assert len(pairs) == 3 + len(big)


@pytest.mark.parametrize("argv, message", [
    (["blacklist_urls.py", "/nonexistent/urls", "--output", "x"], "does not exist"),
    (["find_duplicates.py", "IN", "out", "--threshold", "1.5"], "--threshold must lie"),
    (["merge_jsons.py", "--json-path", "EMPTY", "--output-file", "o"], "no input files"),
    (["cleanup_dataset.py", "IN", "out", "--vocab-file", "/nonexistent/v.json",
      "--merge-file", "/nonexistent/m.txt"], "v.json"),
    (["shuffle_jsons.py", "IN", "out", "--workers", "0"], "--workers"),
], ids=["missing-urls", "bad-threshold", "no-pages", "missing-vocab", "zero-workers"])
def test_bad_inputs_are_one_line_errors(tmp_path, argv, message):
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "IN").write_text('{"text": "a", "url": "u"}\n')
    script, *rest = argv
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "openwebtext", script),
                             *rest], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("script, files, message", [
    ("group_duplicates_url.py", ["CORPUS", "groups.jsonl"],
     "error: stage group_duplicates_url kept none of the 3 lines it read"),
    ("remove_group_duplicates.py", ["CORPUS", "GROUPS", "out.json"],
     "error: stage remove_group_duplicates kept none of the"),
], ids=["corpus-as-pairs", "swapped-groups-and-input"])
def test_a_stage_run_alone_that_keeps_nothing_is_an_error(tmp_path, script, files, message):
    """Run alone (not by run_pipeline.py), a stage that dropped every line it read exits 2
    with the reason, instead of 0 with an empty output."""
    (tmp_path / "CORPUS").write_text("".join(
        json.dumps({"text": f"page {i}", "url": f"http://x/{i}"}) + "\n" for i in range(3)))
    (tmp_path / "GROUPS").write_text(json.dumps(["http://x/0", "http://x/1"]) + "\n")
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "openwebtext", script),
                             *files], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(message) and "given in the order the usage names them" in last


def test_pages_without_urls_stop_at_merge_with_the_reason(tmp_path):
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "p.jsonl").write_text(
        "".join(json.dumps({"text": f"page {i}"}) + "\n" for i in range(5)))
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "openwebtext", "run_pipeline.py"),
         "--pages", str(tmp_path / "pages"), "--work-dir", str(tmp_path / "w"),
         "--skip-preprocess", "--min-tokens", "0", "--language", "any"],
        capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: stage merge_jsons kept none of the 5 lines it read (5 dropped as "
        "\"malformed: no string under 'url'\"); every page needs a \"url\" string (pages "
        "downloaded twice are dropped by it): give each line one")
    assert not (tmp_path / "w" / "cleaned.json").exists()
    assert not (tmp_path / "w" / ".stages" / "merge_jsons.json").exists()  # reruns, fixed


def test_outputs_inside_the_pages_folder_are_refused(tmp_path):
    (tmp_path / "pages").mkdir()
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "openwebtext", "run_pipeline.py"),
         "--pages", str(tmp_path / "pages"), "--work-dir", str(tmp_path / "pages" / "w"),
         "--skip-preprocess", "--min-tokens", "0"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: --work-dir {tmp_path / 'pages' / 'w'} is inside "
                                    f"--pages {tmp_path / 'pages'}: the next run would read")


def test_missing_tokenizer_files_stop_the_pipeline_before_its_first_stage(tmp_path):
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "p.json").write_text('{"text": "a page", "url": "https://a.b/c"}\n')
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "openwebtext", "run_pipeline.py"),
         "--pages", str(tmp_path / "pages"), "--work-dir", str(tmp_path / "w")],
        capture_output=True, text=True)
    assert result.returncode == 2 and "needs --vocab-file" in result.stderr
    assert "[merge_jsons] running" not in result.stdout


def test_language_codes_are_langdetect_codes_in_any_case():
    assert cleanup_dataset._languages(["EN", "zh-CN"]) == {"en", "zh-cn"}
    assert cleanup_dataset._languages(["ANY"]) is None
    from megatron.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--language english: not a language langdetect "
                                          r"detects; it detects af, ar, .*en, .*\(or give 'any'\)"):
        cleanup_dataset._languages(["en", "english"])


def test_page_folders_are_read_with_subfolders_and_compressed_pages_are_named(tmp_path, capsys):
    import gzip
    from megatron.errors import DataError
    from tools.openwebtext.streaming import input_files
    pages = tmp_path / "pages"
    (pages / "sub").mkdir(parents=True)
    (pages / "sub" / ".hidden").mkdir()
    for name in ("a.json", "sub/b.jsonl", ".swap.json", "sub/.hidden/c.json"):
        (pages / name).write_text('{"text": "t", "url": "u"}\n')
    (pages / "d.json.gz").write_bytes(gzip.compress(b'{"text": "t", "url": "v"}\n'))
    assert input_files([str(pages)], (".json", ".jsonl")) == [str(pages / "a.json"),
                                                              str(pages / "sub" / "b.jsonl")]
    assert capsys.readouterr().err == (f"note: skipped 1 file(s) that are not *.json, *.jsonl: "
                                       f"{pages / 'd.json.gz'}; decompress the compressed ones "
                                       "first\n")
    with pytest.raises(DataError, match=r"d.json.gz is gzip-compressed: decompress it first"):
        input_files([str(pages / "d.json.gz")])
