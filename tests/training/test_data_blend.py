"""pretrain_gpt2.py on a blend of two datasets (`--data-path 0.3 A 0.7 B`): it trains, resumes
bit for bit, says how the splits blend, and notes a resume under other weights."""

import glob
import os
import shutil

import pretrain_gpt2
from tests.training.test_pretrain import TINY, losses


def _copy_of(prefix, new_prefix):
    """The dataset under another prefix (with its tokenization record): a second dataset."""
    for path in glob.glob(prefix + ".*"):
        shutil.copy(path, new_prefix + path[len(prefix):])
    return new_prefix


def _run(corpus, tmp_path, data_path, *extra, log_dir="run", tiny=TINY):
    """pretrain_gpt2.py on `data_path` (--data-path's values, or the flags themselves when
    they start with --)."""
    data = data_path if data_path[0].startswith("--") else ["--data-path", *data_path]
    argv = tiny + ["--batch-size", "4", "--train-iters", "6", *data, "--vocab-file",
                   corpus["vocab"], "--merge-file", corpus["merges"], "--log-dir",
                   str(tmp_path / log_dir)]
    return pretrain_gpt2.main(argv + list(extra))


def test_a_blend_trains_and_resumes_exactly(corpus, tmp_path, capsys):
    a = corpus["prefix"]
    b = _copy_of(a, str(tmp_path / "copy_text_document"))
    blend = ["0.3", a, "0.7", b]
    assert _run(corpus, tmp_path, blend, log_dir="full") == 0
    out = capsys.readouterr().out
    assert f" > train blend: {a} 30.0% (7 samples), {b} 70.0% (17 samples)" in out
    save = str(tmp_path / "ckpt")
    assert _run(corpus, tmp_path, blend, "--save", save, "--exit-interval", "3",
                log_dir="split") == 0
    assert _run(corpus, tmp_path, blend, "--save", save, "--load", save, log_dir="split") == 0
    assert losses(tmp_path, "full") == losses(tmp_path, "split")
    assert sorted(losses(tmp_path, "full")) == list(range(1, 7))
    capsys.readouterr()
    other = ["0.5", a, "0.5", b]
    assert _run(corpus, tmp_path, other, "--load", save, "--train-iters", "7",
                log_dir="other") == 0
    assert (f"--data-path 0.5 {a} 0.5 {b} (the checkpoint's: 0.3 {a} 0.7 {b}): training "
            "continues at the checkpoint's count of consumed samples, in another order") \
        in capsys.readouterr().out
    # a length whose samples span other epochs of a dataset reorders its samples: said
    assert _run(corpus, tmp_path, blend, "--load", save, "--train-iters", "200",
                "--exit-interval", "7", log_dir="longer") == 0
    assert "now span 1, 2 epochs of its datasets' documents (the checkpoint's run: 1, 1)" \
        in capsys.readouterr().out
    # the one-prefix form of before blends resumes with no note
    assert _run(corpus, tmp_path, [a], "--save", str(tmp_path / "one"), "--exit-interval", "3",
                log_dir="one") == 0
    capsys.readouterr()
    assert _run(corpus, tmp_path, ["1", a], "--load", str(tmp_path / "one"), "--save",
                str(tmp_path / "one"), log_dir="one") == 0
    assert "another order" not in capsys.readouterr().out
    assert os.path.exists(tmp_path / "one" / "iter_0000006")


def test_each_split_trains_and_validates_on_its_own_datasets(corpus, tmp_path, capsys):
    """--train-data-path (a blend) and --valid-data-path: no --split; validation runs on its
    own dataset, and resuming is exact."""
    a = corpus["prefix"]
    b = _copy_of(a, str(tmp_path / "copy_text_document"))
    valid = _copy_of(a, str(tmp_path / "valid_text_document"))
    tiny = [arg for i, arg in enumerate(TINY) if "--split" not in TINY[max(i - 1, 0):i + 1]]
    flags = ["--train-data-path", "0.5", a, "0.5", b, "--valid-data-path", valid,
             "--eval-interval", "3", "--eval-iters", "2"]
    assert _run(corpus, tmp_path, flags, log_dir="full", tiny=tiny) == 0
    out = capsys.readouterr().out
    assert f" > {valid}: 200 documents, all valid" in out
    assert "validation loss at iteration 3" in out and "test loss" not in out
    save = str(tmp_path / "ckpt")
    assert _run(corpus, tmp_path, flags, "--save", save, "--exit-interval", "3",
                log_dir="split", tiny=tiny) == 0
    assert _run(corpus, tmp_path, flags, "--save", save, "--load", save, log_dir="split",
                tiny=tiny) == 0
    assert losses(tmp_path, "full") == losses(tmp_path, "split")
