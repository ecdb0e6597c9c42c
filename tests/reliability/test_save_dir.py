"""One run per --save folder; what interrupted saves left behind is cleared at start-up."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron.checkpointing.save_dir import SaveDirLock, remove_leftovers
from megatron.errors import ConfigError
from tests.training.test_pretrain import run


def test_a_second_run_on_the_same_save_folder_refuses_naming_the_holder(corpus, tmp_path,
                                                                          capsys):
    save = tmp_path / "ckpt"
    other = SaveDirLock(str(save))
    other.acquire()  # another run holds the folder
    try:
        assert run(corpus, tmp_path, "--save", save, iters=2) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --save {save} is in use by another run (pid "
                              f"{os.getpid()} on ") and "Traceback" not in err
        assert not (save / "iter_0000002").exists()
    finally:
        other.release()
    assert run(corpus, tmp_path, "--save", save, iters=2) == 0  # released: free again
    assert (save / "iter_0000002").exists()


def test_the_lock_dies_with_its_process(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from megatron.checkpointing.save_dir import "
         "SaveDirLock; lock = SaveDirLock(sys.argv[1]); lock.acquire(); print('locked', flush=True); "
         "time.sleep(60)", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(ConfigError, match=f"in use by another run \\(pid {holder.pid} on"):
        SaveDirLock(str(tmp_path)).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = SaveDirLock(str(tmp_path))
    lock.acquire()  # no stale lock to clean up by hand
    lock.release()


def test_leftovers_of_interrupted_saves_are_removed_and_counted(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    (save / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    (save / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt.tmp.4242").write_bytes(
        b"x" * 2 ** 20)
    (save / "latest_checkpointed_iteration.txt.tmp.4242").write_text("2")
    (save / ".global_step4.partial").mkdir()
    (save / ".global_step4.partial" / "mp_rank_00_model_states.pt").write_bytes(b"y" * 1000)
    (save / ".iter_0000001.deleting").mkdir()
    (save / ".global_step3.old").mkdir()  # a cut-short re-save's original: the loader's
    (save / "global_step5").mkdir()
    (save / "global_step5" / "zero_pp_rank_0_mp_rank_00_optim_states.pt.tmp-77").write_bytes(
        b"z")
    assert remove_leftovers(str(save)) == (5, 2 ** 20 + 1 + 1000 + 1)
    assert sorted(p.name for p in save.iterdir()) == [".global_step3.old", "global_step5",
                                                      "iter_0000002"]
    assert not any((save / "iter_0000002" / "mp_rank_00").iterdir())
    (save / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt.tmp.99").write_bytes(b"x" * 10)
    assert run(corpus, tmp_path, "--save", save, iters=2) == 0
    out = capsys.readouterr().out
    assert f" removed 1 leftover(s) of interrupted saves from {save} (0.0 MiB)" in out
    assert "of another run" not in out  # the shells left are nobody's checkpoints


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir", "--log-dir"])
@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text("not a folder"), "is a file, not a folder"),
    (lambda p: (p.mkdir(), p.chmod(0o500)), "cannot be written"),
], ids=["file", "read-only"])
def test_an_unusable_output_folder_stops_before_anything_is_built(corpus, tmp_path, capsys,
                                                                  monkeypatch, make, message,
                                                                  flag):
    import megatron.training.pretrain as pretrain
    folder = tmp_path / "out"
    make(folder)
    if os.geteuid() == 0 and message == "cannot be written":
        pytest.skip("root writes into read-only folders")
    monkeypatch.setattr(pretrain, "build_backend", None)  # reaching the model would fail
    assert run(corpus, tmp_path, flag, folder, iters=2) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} {folder} ") and message in err
    assert "Traceback" not in err


def test_waiting_holder_lines_are_readable(tmp_path):
    lock = SaveDirLock(str(tmp_path))
    lock.acquire()
    text = (tmp_path / ".lock").read_text()
    lock.release()
    assert text.startswith(f"pid {os.getpid()} on ") and " since " in text
    assert time.strftime("%Y-") in text


def test_a_full_disk_is_one_error_and_keeps_the_last_checkpoint(corpus, tmp_path, capsys,
                                                               monkeypatch):
    import errno

    import megatron.checkpointing.files as files
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path, "--save", save, "--save-interval", 2, iters=2) == 0
    real_save = files.torch.save

    def full_disk(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(files.torch, "save", full_disk)
    assert run(corpus, tmp_path, "--save", save, "--load", save, "--save-interval", 2,
               iters=4) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: could not write {save}/iter_0000004/mp_rank_00/"
                          "model_optim_rng.pt: No space left on device. The last complete "
                          "checkpoint") and "Traceback" not in err
    assert err.rstrip().endswith("is intact; free space or write to another folder"), err
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not list(save.rglob("*.tmp.*"))
    monkeypatch.setattr(files.torch, "save", real_save)
    assert run(corpus, tmp_path, "--save", save, "--load", save, iters=4) == 0  # resumes


@pytest.mark.parametrize("layout, tracker", [([], "latest_checkpointed_iteration.txt"),
                                             (["--deepspeed"], "latest")])
def test_a_tracker_that_is_not_text_is_one_error(corpus, tmp_path, capsys, layout, tracker):
    load = tmp_path / "ckpt"
    load.mkdir()
    (load / tracker).write_bytes(b"\xff\xfe\x00\x81garbage")
    extra = ["--deepspeed", "--deepspeed_config", str(_stage1(tmp_path))] if layout else []
    assert run(corpus, tmp_path, "--load", load, *extra, iters=2) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and str(load) in err


def _stage1(tmp_path):
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    return path
