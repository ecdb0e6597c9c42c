"""tools/make_zeroshot_files.py: WikiText- and LAMBADA-style files from a loose-JSON corpus,
and a clear error for each bad input."""

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SPEC = importlib.util.spec_from_file_location(
    "make_zeroshot_files_tool", os.path.join(REPO, "tools", "make_zeroshot_files.py"))
tool = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tool)

WORDS = "the king spoke to his noble brother of war and peace in the land".split()


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "data.json"
    lines = [json.dumps({"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(80))})
             for i in range(5)]
    lines[1:1] = ["{not json", json.dumps({"body": "no text key"}), ""]
    path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe\n")
    return path


def test_writes_both_files_from_the_last_documents_and_counts_what_it_skipped(corpus,
                                                                              tmp_path,
                                                                              capsys):
    out = tmp_path / "zs"
    assert tool.main(["--input", str(corpus), "--output-dir", str(out),
                      "--num-documents", "2", "--passage-words", "20"]) == 0
    said = capsys.readouterr().out
    assert "(2 documents)" in said and "skipped 3 malformed lines" in said
    wiki = (out / "wiki.test.tokens").read_text()
    assert wiki.count(" = Document ") == 2
    passages = [json.loads(line)["text"] for line in (out / "lambada_test.jsonl").open()]
    assert passages and all(2 <= len(p.split()) <= 20 for p in passages)
    assert all(len(p.split()[-1]) >= 3 for p in passages)  # a real word to predict
    assert "none is held out" not in said
    assert tool.main(["--input", str(corpus), "--output-dir", str(out),
                      "--num-documents", "5"]) == 0
    assert " note: --num-documents 5 covers the whole corpus (5 documents): none is held out " \
           "from training" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--passage-words", "0"], "--passage-words must be at least 2, got 0"),  # looped forever
    (["--passage-words", "-5"], "--passage-words must be at least 2, got -5"),
    (["--num-documents", "0"], "--num-documents must be at least 1, got 0"),
    (["--max-passages", "0"], "--max-passages must be at least 1, got 0"),
    (["--passage-words", "100000"], "shorter than --passage-words 100000 (the longest has 80 "
                                    "words): no LAMBADA passage; give a smaller "
                                    "--passage-words or more --num-documents"),
])
def test_sizes_that_make_nothing_useful_are_refused(corpus, tmp_path, capsys, flags, message):
    assert tool.main(["--input", str(corpus), "--output-dir", str(tmp_path / "zs"),
                      *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.endswith(f"{message}\n"), err
    assert not (tmp_path / "zs").exists()


def test_no_passage_is_an_error_that_leaves_the_earlier_files(corpus, tmp_path, capsys):
    out = tmp_path / "zs"
    assert tool.main(["--input", str(corpus), "--output-dir", str(out)]) == 0
    before = {name: (out / name).read_text() for name in os.listdir(out)}
    assert before["lambada_test.jsonl"]
    short_words = tmp_path / "short_words.json"  # long enough, but no word to predict
    short_words.write_text(json.dumps({"text": "to be or so it is as an " * 20}) + "\n")
    cases = [(corpus, ["--passage-words", "81"], "shorter than --passage-words 81 (the longest "
                                                 "has 80 words): no LAMBADA passage"),
             (short_words, [], "no stretch of --passage-words 60 words in the last 1 documents "
                               f"of --input {short_words} ends, within its last half, on a word "
                               "of 3 or more letters (a target to predict): no LAMBADA passage")]
    for path, flags, message in cases:  # wrote an empty lambada_test.jsonl, exit code 0
        assert tool.main(["--input", str(path), "--output-dir", str(out), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    assert {name: (out / name).read_text() for name in os.listdir(out)} == before


def test_bad_paths_are_one_line_errors(corpus, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty.json").write_text("{not json\n\n")
    cases = [(["--input", str(tmp_path)], "is not a file"),
             (["--input", str(tmp_path / "empty.json")], "holds no {\"text\": ...} documents "
                                                         "(1 malformed lines)"),
             (["--output-dir", str(tmp_path / "afile")], "exists and is not a directory"),
             (["--output-dir", str(tmp_path / "afile" / "sub")], "cannot write to --output-dir")]
    for flags, message in cases:
        argv = {"--input": str(corpus), "--output-dir": str(tmp_path / "zs")}
        argv.update(dict(zip(flags[::2], flags[1::2])))
        assert tool.main([item for pair in argv.items() for item in pair]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
