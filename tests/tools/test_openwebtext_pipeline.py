"""tools/openwebtext/run_pipeline.py end to end, resumable stages, and pre-built index maps
that a `--train-data webtext` training run then uses as they are."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.tools import owt_corpus

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPELINE = os.path.join(REPO, "tools", "openwebtext", "run_pipeline.py")
STAGES = ["merge_jsons", "cleanup_dataset", "find_duplicates", "group_duplicates",
          "remove_duplicates", "shuffle", "preprocess"]


def pipeline_argv(root, vocab, merges, *extra):
    return [sys.executable, PIPELINE, "--pages", str(root / "pages"), "--work-dir",
            str(root / "work"), "--output-json", str(root / "data" / "webtext" / "data.json"),
            "--vocab-file", vocab, "--merge-file", merges, "--min-tokens",
            str(owt_corpus.MIN_TOKENS), "--workers", "2", "--seed", "7", *extra]


def run_pipeline(argv):
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def stage_status(stdout):
    return {line.split()[0]: line.split()[1] for line in stdout.splitlines()
            if line.split() and line.split()[0] in (
                "merge_jsons", "cleanup_dataset", "find_duplicates", "group_duplicates_url",
                "remove_group_duplicates", "shuffle_jsons", "preprocess")
            and len(line.split()) > 2 and line.split()[1] in ("ran", "skipped")}


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    owt_corpus.write_pages(root / "pages")
    vocab, merges = owt_corpus.write_tokenizer(root / "tok")
    argv = pipeline_argv(root, vocab, merges)
    return root, argv, run_pipeline(argv), (vocab, merges)


def test_pipeline_keeps_exactly_the_planted_survivors(pipeline_run):
    from megatron.data.indexed_dataset import MMapIndexedDataset
    root, _, stdout, _ = pipeline_run
    with open(root / "data" / "webtext" / "data.json") as f:
        urls = [json.loads(line)["url"] for line in f]
    assert sorted(urls) == sorted(owt_corpus.SURVIVORS) and urls != owt_corpus.SURVIVORS
    assert set(stage_status(stdout).values()) == {"ran"}
    table = stdout[stdout.index("stage "):]
    assert "near-duplicate: 2" in table and "language de: 1; language fr: 1" in table
    assert "malformed: invalid JSON: 1" in table
    dataset = MMapIndexedDataset(str(root / "work" / "webtext_text_document"))
    assert len(dataset) == len(owt_corpus.SURVIVORS)
    for stage in STAGES:
        marker = json.load(open(root / "work" / ".stages" / f"{stage}.json"))
        assert marker["report"]["kept"] > 0


def test_rerun_skips_finished_stages_and_changed_settings_rerun_the_rest(pipeline_run):
    root, argv, _, _ = pipeline_run
    before = os.stat(root / "work" / "cleaned.json").st_mtime_ns
    assert set(stage_status(run_pipeline(argv)).values()) == {"skipped"}
    status = stage_status(run_pipeline(argv[:-1] + ["8"]))  # another shuffle seed
    assert [status[s] for s in ("merge_jsons", "cleanup_dataset", "find_duplicates")] == \
        ["skipped"] * 3
    assert status["shuffle_jsons"] == status["preprocess"] == "ran"
    assert os.stat(root / "work" / "cleaned.json").st_mtime_ns == before


def test_a_stage_killed_midway_runs_again(pipeline_run, tmp_path):
    root, _, _, (vocab, merges) = pipeline_run
    owt_corpus.write_pages(tmp_path / "pages")
    with open(tmp_path / "pages" / "more.json", "w") as f:  # enough to kill cleanup midway
        for i in range(150):
            f.write(json.dumps({"text": owt_corpus.english(100 + i, 30),
                                "url": f"https://more.example/{i}"}) + "\n")
    argv = pipeline_argv(tmp_path, vocab, merges)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, start_new_session=True)
    markers = tmp_path / "work" / ".stages"
    deadline = time.time() + 120
    # Kill as soon as cleanup has opened its (temporary) output: it is then midway.
    while not list((tmp_path / "work").glob(".cleaned.json.tmp.*")) and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)  # the driver and its cleanup workers
    process.wait()
    assert (markers / "merge_jsons.json").exists()
    assert not (markers / "cleanup_dataset.json").exists()
    assert not (tmp_path / "work" / "cleaned.json").exists()  # no partial output under its name
    status = stage_status(run_pipeline(argv))
    assert status["merge_jsons"] == "skipped"
    assert all(status[s] == "ran" for s in ("cleanup_dataset", "find_duplicates", "preprocess"))
    with open(tmp_path / "data" / "webtext" / "data.json") as f:
        assert len(f.readlines()) == len(owt_corpus.SURVIVORS) + 150
    assert [n for n in os.listdir(tmp_path / "work") if n != ".stages" and
            (n.startswith(".") or "tmp" in n)] == []  # the killed run's temporaries are gone


def test_prebuilt_index_maps_are_used_by_train_data_webtext(pipeline_run, tmp_path,
                                                            monkeypatch, capsys):
    """build_index_maps.py with the job's flags; the job then neither re-tokenizes the
    corpus nor rebuilds the maps (mtimes unchanged, no 'built' log line)."""
    import shutil
    import pretrain_gpt2
    from tools import build_index_maps
    root, _, _, (vocab, merges) = pipeline_run
    data_root = tmp_path / "data"
    shutil.copytree(root / "data", data_root)
    monkeypatch.setenv("MEGATRON_DATA_DIR", str(data_root))
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--lr", "1e-3",
             "--batch-size", "2", "--train-iters", "3", "--eval-interval", "1000",
             "--eval-iters", "1", "--split", "4,1,1", "--num-workers", "0", "--threads", "1",
             "--train-data", "webtext", "--vocab-file", vocab, "--merge-file", merges]
    assert build_index_maps.main(flags + ["--world-size", "1"]) == 0
    built = capsys.readouterr().out
    assert "> built train index maps" in built and "> tokenizing" in built
    files = sorted((data_root / "webtext").iterdir())
    maps = [f for f in files if "_indexmap_" in f.name]
    assert len(maps) == 9  # train, valid, test x doc/sample/shuffle
    mtimes = {f: f.stat().st_mtime_ns for f in files}
    assert pretrain_gpt2.main(flags) == 0
    out = capsys.readouterr().out
    assert "> built" not in out and "> tokenizing" not in out and "iteration        3/" in out
    assert {f: f.stat().st_mtime_ns for f in files} == mtimes


def test_bad_pipeline_flags_are_one_line_errors(tmp_path):
    result = subprocess.run([sys.executable, PIPELINE, "--pages", str(tmp_path / "none"),
                             "--work-dir", str(tmp_path / "w"), "--vocab-file", "v", "--merge-file",
                             "m", "--threshold", "0"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: --threshold")
