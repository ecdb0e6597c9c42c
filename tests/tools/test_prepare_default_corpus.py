"""tools/prepare_default_corpus.py: scenes become loose-JSON documents; the real download is slow."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAY = """THE TRAGEDY OF TESTING

by William Shakespeare

ACT I.

SCENE 1. A room.

FIRST.
To test, or not to test.

SCENE 2. Another room.

SECOND.
That is the question.
"""


def test_scenes_become_documents(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "testing_gut.txt").write_text(PLAY)
    (texts / "sonnets_gut.txt").write_text("\n\n".join(["When forty winters " * 40] * 60))
    (texts / "ignored_gut_f.txt").write_text("not a *_gut.txt file")
    out = tmp_path / "webtext" / "data.json"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_default_corpus.py"),
                    "--input-dir", str(texts), "--output", str(out)], check=True)
    docs = [json.loads(line) for line in open(out)]
    play = [d for d in docs if "testing" in d["url"]]
    # An act heading travels with the first scene of the act.
    assert [d["text"].splitlines()[0] for d in play] == \
        ["THE TRAGEDY OF TESTING", "ACT I.", "SCENE 2. Another room."]
    assert "SCENE 1. A room." in play[1]["text"] and "To test" in play[1]["text"]
    sonnets = [d for d in docs if "sonnets" in d["url"]]
    assert len(sonnets) > 1 and all(len(d["text"]) <= 20_000 for d in sonnets)
    assert not any("ignored" in d["url"] for d in docs)
    assert not list(out.parent.glob("*.tmp*"))


@pytest.mark.slow
def test_default_script_from_nothing(tmp_path):
    """bash scripts/pretrain_gpt2.sh on an empty DATA_DIR: downloads, tokenizes, trains."""
    env = dict(os.environ, DATA_DIR=str(tmp_path / "data"), CHECKPOINT_DIR=str(tmp_path / "ckpt"),
               RUN_DIR=str(tmp_path / "run"), TRAIN_ITERS="4", NLAYERS="2", NHIDDEN="64",
               NHEADS="4", SEQ_LEN="64", MICRO_BATCH="4", VOCAB_SIZE="1024", LOG_INTERVAL="1",
               EVAL_ITERS="1")
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "pretrain_gpt2.sh")],
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "data" / "webtext" / "data.json").exists()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert "metrics.jsonl" in result.stdout and "iteration        4/       4" in result.stdout


def _prepare(*argv):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_default_corpus.py"),
                           *argv], capture_output=True, text=True)


def test_bad_paths_are_one_error_line(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "testing_gut.txt").write_text(PLAY)
    folder = tmp_path / "webtext"
    folder.mkdir()
    result = _prepare("--input-dir", str(texts), "--output", str(folder))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: --output {folder} is a folder; give the corpus file's path" in result.stderr
    assert not list(tmp_path.rglob("*.tmp*"))
    result = _prepare("--input-dir", str(tmp_path / "nowhere"), "--output", str(folder / "d.json"))
    assert result.returncode == 2
    assert f"error: --input-dir {tmp_path / 'nowhere'} is not a folder" in result.stderr
    result = _prepare("--input-dir", str(folder), "--output", str(folder / "d.json"))
    assert result.returncode == 2 and f"error: no *_gut.txt texts in {folder}" in result.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_output_folder_is_one_error_line(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "testing_gut.txt").write_text(PLAY)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    result = _prepare("--input-dir", str(texts), "--output", str(locked / "data.json"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: Permission denied: " in result.stderr and str(locked) in result.stderr
