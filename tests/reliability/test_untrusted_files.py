"""Files we read may come from anywhere: a pickle that would run code is refused with a clear
error (Megatron layout, DeepSpeed layout, zero_to_fp32), and no reader in megatron/, zero/ or
tools/ unpickles without torch's weights_only guard."""

import mmap
import os
import random
import re
from pathlib import Path

import pytest
import torch

import pretrain_gpt2
from megatron.checkpointing.files import safe_load
from megatron.errors import CheckpointError
from tests.reliability.harness import trainer_argv
from zero.checkpoint.files import torch_load as zero_load
from zero.errors import CheckpointError as ZeroCheckpointError
from zero.checkpoint.zero_to_fp32 import main as zero_to_fp32_main

REPO = Path(__file__).resolve().parents[2]


class _RunsCode:
    """Unpickling this calls os.system: what a booby-trapped checkpoint does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _booby_trapped(path, marker):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.zeros(2)}, "payload": _RunsCode(marker)}, path)
    return path


def test_megatron_layout_refuses_code(corpus, tmp_path, capsys):
    marker = tmp_path / "pwned"
    save = tmp_path / "ckpt"
    _booby_trapped(save / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", marker)
    (save / "latest_checkpointed_iteration.txt").write_text("1")
    for mapped in (False, True):  # conversion maps the files it reads
        with pytest.raises(CheckpointError, match="The file holds pickled code, refused: only "
                                                  "tensors and plain containers are unpickled"):
            safe_load(save / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt",
                      mmap=mapped)
    assert pretrain_gpt2.main(trainer_argv(corpus, tmp_path / "log", 2, "--load", save)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: cannot read checkpoint ") and "model_optim_rng.pt" in err
    assert not marker.exists()
    # a file cut short (a copy interrupted) anywhere, or random bytes, is said to be damaged,
    # not to hold code nor to need other permissions
    torch.save({"model": {"w": torch.zeros(8000)}}, tmp_path / "whole.pt")
    data = (tmp_path / "whole.pt").read_bytes()
    for damaged in [data[:cut] for cut in (0, 500, 3000, 10000, len(data) // 2, len(data) - 30)] \
            + [random.Random(seed).randbytes(20000) for seed in range(8)]:
        (tmp_path / "cut.pt").write_bytes(damaged)
        for mapped in (False, True):
            with pytest.raises(CheckpointError, match=r": it is truncated or not a torch "
                                                      r"checkpoint \(\w+: .*\)\. The file is "
                                                      r"damaged \(a copy cut short\?\): copy "
                                                      r"it again"):
                safe_load(tmp_path / "cut.pt", mmap=mapped)
        with pytest.raises(ZeroCheckpointError, match=r"not a torch checkpoint \(.*\)\. The "
                                                      r"file is damaged"):
            zero_load(str(tmp_path / "cut.pt"))


def test_deepspeed_layout_and_zero_to_fp32_refuse_code(tmp_path, capsys):
    marker = tmp_path / "pwned"
    tag_dir = tmp_path / "ckpt" / "global_step1"
    states = _booby_trapped(tag_dir / "mp_rank_00_model_states.pt", marker)
    _booby_trapped(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    with pytest.raises(ZeroCheckpointError, match="cannot read .*mp_rank_00_model_states.pt"):
        zero_load(str(states))
    assert zero_to_fp32_main([str(tmp_path / "ckpt"), str(tmp_path / "out.bin")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read ") and "pickled classes" in err
    assert not marker.exists() and not (tmp_path / "out.bin").exists()


def test_deepspeed_layout_through_the_trainer_refuses_code(corpus, tmp_path, capsys):
    marker = tmp_path / "pwned"
    save = tmp_path / "ckpt"
    _booby_trapped(save / "global_step1" / "mp_rank_00_model_states.pt", marker)
    (save / "latest").write_text("global_step1")
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 1}}')
    argv = trainer_argv(corpus, tmp_path / "log", 2, "--load", save, "--deepspeed",
                        "--deepspeed_config", config)
    assert pretrain_gpt2.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: cannot read checkpoint ") and "model_states.pt" in err
    assert not marker.exists()


_UNSAFE = [(re.compile(r"\bpickle\.loads?\(|\bcPickle\b|\bdill\b"), "pickle"),
           (re.compile(r"allow_pickle\s*=\s*True"), "np.load(allow_pickle=True)")]


def test_no_reader_unpickles_without_weights_only():
    """Every torch.load in megatron/, zero/, tools/ passes weights_only=True (or goes through
    a helper that does); no pickle.load, no np.load(allow_pickle=True)."""
    problems = []
    for path in [REPO / "pretrain_gpt2.py", *sorted((REPO / "megatron").rglob("*.py")),
                 *sorted((REPO / "zero").rglob("*.py")), *sorted((REPO / "tools").rglob("*.py"))]:
        text = path.read_text()
        for match in re.finditer(r"torch\.load\(", text):
            call = text[match.start():text.find(")\n", match.start()) + 1]
            if "weights_only=True" not in call:
                problems.append(f"{path.relative_to(REPO)}: {call.splitlines()[0]}")
        for pattern, what in _UNSAFE:
            if pattern.search(text):
                problems.append(f"{path.relative_to(REPO)}: {what}")
    assert not problems, "\n".join(problems)


def _is_mapped(path):
    return any(line.rstrip().endswith(str(path)) for line in open("/proc/self/maps"))


@pytest.mark.parametrize("zip_format", [True, False])
def test_a_mapped_read_never_writes_the_file(tmp_path, zip_format):
    """Conversion reads checkpoint files memory-mapped (safe_load(mmap=True)) and works on
    what it read in place: the file stays as saved, even where the process-wide default of
    torch.load's mappings is shared. A file in torch's legacy format (not zip, which cannot
    be mapped) is read whole instead."""
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {"w": torch.arange(4.0)}}, path,
               _use_new_zipfile_serialization=zip_format)
    saved = path.read_bytes()
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        loaded = safe_load(path, mmap=True)
    assert _is_mapped(path) == zip_format
    loaded["model"]["w"].mul_(-1).add_(7)
    assert loaded["model"]["w"].tolist() == [7.0, 6.0, 5.0, 4.0]
    assert path.read_bytes() == saved
    assert safe_load(path)["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_file_system_failure_is_not_called_damage():
    """Only what says the bytes are wrong is 'damaged, copy it again'; a stale NFS handle, no
    permission or an I/O error keep their own words (the file may be whole)."""
    import errno

    from zero.checkpoint.files import DAMAGED, UNREADABLE, load_failure
    for code in (errno.ESTALE, errno.EACCES, errno.EIO, errno.EMFILE):
        reason, kind = load_failure(OSError(code, os.strerror(code)))
        assert kind == UNREADABLE and os.strerror(code) in reason
    reason, kind = load_failure(OSError(errno.EINVAL, "Invalid argument"))
    assert kind == DAMAGED and reason.startswith("it is truncated or not a torch checkpoint")
