import glob
import json
import math
import os
import time

import pytest
import torch

from megatron.training.metrics import TrainingLogger, format_train_line, mfu
from tests.dist_utils import run_distributed

RECORD = {"iteration": 20, "train_iters": 200, "consumed_samples": 640, "ms_per_iter": 91.2,
          "lr": 1.5e-4, "lm_loss": 6.912345, "loss_scale": 1.0, "grad_norm": 1.234,
          "tokens_per_s": 7012.4, "mfu": 0.413, "skipped_iters": 0}
EXPECTED_LINE = (" iteration       20/     200 | consumed samples          640 |"
                 " elapsed time per iteration (ms): 91.2 | learning rate: 1.500E-04 |"
                 " lm loss: 6.912345E+00 | loss scale: 1.0 | grad norm: 1.234 |"
                 " tokens/s: 7012 | MFU: 41.3% | skipped: 0 |")
JSON_KEYS = ["iteration", "consumed_samples", "lm_loss", "lr", "loss_scale", "grad_norm",
             "ms_per_iter", "tokens_per_s", "mfu", "skipped_iters"]


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_train_line_exact_format(tmp_path, capsys):
    logger = TrainingLogger(str(tmp_path), None, rank0=True)
    logger.log_train(dict(RECORD))
    logger.close()
    assert capsys.readouterr().out == EXPECTED_LINE + "\n"


def test_train_line_accepts_tensors_and_omits_missing_values():
    record = dict(RECORD, lm_loss=torch.tensor(6.912345), grad_norm=None, nan_iters=2)
    line = format_train_line(record)
    assert "grad norm" not in line and "lm loss: 6.912345E+00 |" in line
    assert line.endswith(" skipped: 0 | nan iterations: 2 |")


def test_jsonl_keys_values_and_append_mode(tmp_path, capsys):
    for iteration in (20, 40):
        logger = TrainingLogger(str(tmp_path), None, rank0=True)  # reopened: appends
        logger.log_train(dict(RECORD, iteration=iteration, nan_iters=1))
        logger.close()
    records = _lines(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [20, 40]
    assert list(records[0]) == JSON_KEYS + ["nan_iters"]
    assert records[0]["lm_loss"] == 6.912345 and records[0]["mfu"] == 0.413
    assert records[0]["consumed_samples"] == 640 and records[0]["skipped_iters"] == 0


def test_non_finite_values_become_null(tmp_path, capsys):
    logger = TrainingLogger(str(tmp_path), None, rank0=True)
    logger.log_train(dict(RECORD, lm_loss=float("nan"), grad_norm=None))
    logger.close()
    record = _lines(tmp_path / "metrics.jsonl")[0]
    assert record["lm_loss"] is None and record["grad_norm"] is None


def test_eval_block_and_record(tmp_path, capsys):
    logger = TrainingLogger(str(tmp_path), None, rank0=True)
    logger.log_eval(100, "valid", 5.1)
    logger.log_eval(100, "test", 25.0)
    logger.close()
    out = capsys.readouterr().out.splitlines()
    line = " validation loss at iteration 100 | lm loss value: 5.100000E+00 |" \
           " lm loss PPL: 1.640219E+02 |"
    assert out[:3] == ["-" * (len(line) + 1), line, "-" * (len(line) + 1)]
    assert out[4].startswith(" test loss at iteration 100 |")
    valid, test = _lines(tmp_path / "metrics.jsonl")
    assert valid == {"iteration": 100, "split": "valid", "loss": 5.1,
                     "ppl": pytest.approx(164.0219072999017)}
    assert test["ppl"] == pytest.approx(math.exp(20.0))  # loss capped at 20 for the PPL


def test_unwritable_log_dir_is_a_config_error(tmp_path):
    from megatron.errors import ConfigError
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="--log-dir"):
        TrainingLogger(str(blocker / "logs"), None, rank0=True)


def test_only_rank0_prints_and_writes(tmp_path, capsys):
    logger = TrainingLogger(str(tmp_path / "logs"), str(tmp_path / "tb"), rank0=False)
    logger.log_train(dict(RECORD))
    logger.log_eval(1, "valid", 1.0)
    logger.close()
    assert capsys.readouterr().out == ""
    assert not os.path.exists(tmp_path / "logs") and not os.path.exists(tmp_path / "tb")


def test_tensorboard_event_file_has_the_scalars(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logger = TrainingLogger(None, str(tmp_path), rank0=True)
    logger.log_train(dict(RECORD))
    logger.log_eval(20, "valid", 5.0)
    logger.close()
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm-loss", "learning-rate", "loss-scale", "grad-norm", "ms-per-iteration",
            "tokens-per-s", "mfu", "skipped-iterations", "lm-loss vs samples", "lm-loss-valid",
            "lm-loss-valid-ppl"} <= tags  # the log line's numbers, as the design says
    assert events.Scalars("ms-per-iteration")[0].value == pytest.approx(91.2)
    by_samples = events.Scalars("lm-loss vs samples")[0]
    assert by_samples.step == 640 and by_samples.value == pytest.approx(6.912345)
    assert events.Scalars("learning-rate")[0].step == 20


def test_missing_tensorboard_warns_once_and_continues(tmp_path, capsys, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    logger = TrainingLogger(str(tmp_path), str(tmp_path / "tb"), rank0=True)
    logger.log_train(dict(RECORD))
    logger.close()
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1 and "tensorboard" in out
    assert not logger.writes_tensorboard  # the end-of-run summary names no tensorboard dir
    assert len(_lines(tmp_path / "metrics.jsonl")) == 1


# ------------------------------------------- the timers line over ranks (--timing-log-option)

def _gather_known_times(rank, world_size):
    """Each option's fields from known times: rank r's forward takes 10 (r + 1) ms, only
    rank 0 timed the batch generator, no rank the optimizer."""
    from megatron.training.phase_times import gather_phase_ms
    local = {"forward": 10.0 * (rank + 1), "backward": 5.0 + rank}
    if rank == 0:
        local["batch generator"] = 1.5
    return {option: gather_phase_ms(local, option) for option in ("max", "minmax", "all")}


def test_phase_times_are_gathered_from_every_rank():
    """Two gloo ranks: every rank gets the same fields; phase_ms is the maximum over ranks, a
    phase a rank did not time is left out of its minimum and shown as None for it."""
    rank0, rank1 = run_distributed(_gather_known_times, 2)
    assert rank0 == rank1
    maxima = {"forward": 20.0, "backward": 6.0, "batch generator": 1.5}
    assert rank0["max"] == {"phase_ms": maxima}
    assert rank0["minmax"] == {"phase_ms": maxima, "phase_ms_min": {
        "forward": 10.0, "backward": 5.0, "batch generator": 1.5}}
    assert rank0["all"] == {"phase_ms": maxima, "phase_ms_by_rank": {
        "forward": [10.0, 20.0], "backward": [5.0, 6.0], "batch generator": [1.5, None]}}


def test_one_process_gathers_its_own_times():
    from megatron.training.phase_times import gather_phase_ms
    local = {"forward": 3.0, "optimizer": 1.0}
    assert gather_phase_ms(local, "minmax") == {"phase_ms": local, "phase_ms_min": local}
    assert gather_phase_ms(local, "all")["phase_ms_by_rank"] == {"forward": [3.0],
                                                                 "optimizer": [1.0]}


TIMED = {"phase_ms": {"forward": 20.0, "backward": 6.0, "batch generator": 1.5}}


@pytest.mark.parametrize("fields, expected", [
    ({}, [" max time across ranks (ms) | forward: 20.00 | backward: 6.00 | batch generator: "
          "1.50"]),
    ({"phase_ms_min": {"forward": 10.0, "backward": 5.0, "batch generator": 1.5}},
     [" (min, max) time across ranks (ms) | forward: (10.00, 20.00) | backward: (5.00, 6.00) "
      "| batch generator: (1.50, 1.50)"]),
    ({"phase_ms_by_rank": {"forward": [10.0, 20.0], "backward": [5.0, 6.0],
                           "batch generator": [1.5, None]}},
     [" times across ranks (ms):", "    forward | rank 0: 10.00 | rank 1: 20.00",
      "    backward | rank 0: 5.00 | rank 1: 6.00", "    batch generator | rank 0: 1.50"]),
], ids=["max", "minmax", "all"])
def test_timers_line_under_the_log_line_for_each_timing_log_option(tmp_path, capsys, fields,
                                                                   expected):
    logger = TrainingLogger(str(tmp_path), None, rank0=True)
    logger.log_train(dict(RECORD, **TIMED, **fields))
    logger.close()
    assert capsys.readouterr().out.splitlines() == [EXPECTED_LINE] + expected
    record = _lines(tmp_path / "metrics.jsonl")[0]
    assert {key: record[key] for key in record if key.startswith("phase_ms")} == \
        {**TIMED, **fields}


def test_mfu_helper():  # the FLOPs per token are the model's (megatron.model.flops_per_token)
    assert mfu(1000.0, 6e9, 1.2e13) == pytest.approx(0.5)
    assert mfu(1000.0, 6e9, 0) is None


def test_mfu_never_exceeds_100_percent_when_the_measured_peak_is_too_low(capsys):
    """A matmul peak below what training reaches (small models, full-attention FLOP count)
    raises the denominator to the rate reached, with one note."""
    import time
    from types import SimpleNamespace

    from megatron.training import loop

    records, printed = [], []
    config = SimpleNamespace(training=SimpleNamespace(global_batch_size=4, train_iters=10),
                             data=SimpleNamespace(seq_length=8),
                             logging=SimpleNamespace(phase_times=False, params_norm=False))
    ctx = SimpleNamespace(config=config, runtime=SimpleNamespace(
        device=torch.device("cpu"), print0=printed.append))
    backend = SimpleNamespace(report=lambda: {"lr": 1e-3, "loss_scale": 1.0})
    logger = SimpleNamespace(log_train=records.append)
    window = {"loss": 2.0, "iters": 1, "samples": 4, "start": time.perf_counter() - 1.0,
              "grad_norm": None, "peak": 1.0}  # 1 FLOP/s: anything beats it
    for iteration in (1, 2):
        loop._log_window(window, {"iteration": iteration, "consumed_train_samples": 4,
                                  "skipped_iters": 0}, backend, 1e6, ctx, logger, None,
                          SimpleNamespace(with_the_line=lambda iteration: {}))
        window.update(iters=1, samples=4, loss=2.0,
                      start=time.perf_counter() - 2.0)  # half the rate
    assert records[0]["mfu"] == pytest.approx(1.0) and records[1]["mfu"] == pytest.approx(0.5,
                                                                                          rel=0.05)
    assert len(printed) == 1 and "above the measured matmul peak" in printed[0]


def _compared_quickly(speeds):
    """A measure_matmul_flops that returns `speeds[dtype]` and checks that it was asked to
    compare dtypes (products of RATIO_SECONDS), not for a peak."""
    from megatron.runtime.device import RATIO_SECONDS

    def measure(device, dtype, min_seconds):
        assert min_seconds == RATIO_SECONDS
        return speeds[dtype]
    return measure


def test_faster_precision_note_names_the_fastest_measured_precision(monkeypatch):
    from megatron.runtime import device as device_mod
    cpu = torch.device("cpu")
    speeds = {torch.bfloat16: 170e9, torch.float16: 320e9, torch.float32: 330e9}
    monkeypatch.setattr(device_mod, "measure_matmul_flops", _compared_quickly(speeds))
    note = device_mod.faster_precision_note(cpu, torch.bfloat16)
    assert "fp32 (no --fp16/--bf16) is the fast path here, 1.9x bf16" in note
    assert "bf16 170, fp16 320, fp32 330" in note
    assert device_mod.faster_precision_note(cpu, torch.float16) is None  # within 1.5x
    assert device_mod.faster_precision_note(cpu, torch.float32) is None  # only 16-bit runs ask
    speeds.update({torch.float16: 2e9, torch.bfloat16: 900e9})  # AMX bf16, emulated fp16
    assert "--bf16 is the fast path here" in device_mod.faster_precision_note(cpu, torch.float16)


def test_comparing_dtypes_times_an_emulated_dtype_at_256_rows_and_is_no_peak(monkeypatch):
    """A dtype this CPU emulates (~1 GFLOP/s) is compared at 256 rows; the MFU's peak times
    it at 512, and is measured on its own, not taken from the quicker comparison."""
    from megatron.runtime import device as device_mod
    sizes = []

    def emulated_mm(a, b):  # 1 GFLOP/s
        sizes.append(a.shape[0])
        time.sleep(2 * a.shape[0] ** 3 / 1e9)

    monkeypatch.setattr(torch, "mm", emulated_mm)
    monkeypatch.setattr(device_mod, "_measured_peaks", {})
    cpu = torch.device("cpu")
    quick = device_mod.measure_matmul_flops(cpu, torch.float16,
                                            min_seconds=device_mod.RATIO_SECONDS)
    assert set(sizes) == {256} and quick == pytest.approx(1e9, rel=0.3)
    sizes.clear()
    peak = device_mod.peak_flops(cpu, torch.float16)
    assert sizes and sizes[-1] == 512, "the peak was taken from the quick measurement"
    assert peak == pytest.approx(1e9, rel=0.3)


@pytest.mark.parametrize("bf16, fp32, picked", [(170e9, 330e9, "fp32"), (900e9, 330e9, "bf16")])
def test_the_scripts_precision_probe_picks_the_faster_measured(monkeypatch, capsys, bf16, fp32,
                                                               picked):
    """What scripts/pretrain_gpt2.sh trains in when PRECISION is unset: no AMX (bf16 at half
    fp32's speed) -> fp32; AMX -> bf16. One line on stderr says why."""
    from megatron.runtime import precision_probe
    speeds = {torch.bfloat16: bf16, torch.float32: fp32}
    monkeypatch.setattr(precision_probe, "measure_matmul_flops", _compared_quickly(speeds))
    precision_probe.main()
    out, err = capsys.readouterr()
    assert out == f"{picked}\n"
    assert err == (f"[precision] {picked}, the faster here (matmul GFLOP/s on this cpu: bf16 "
                   f"{bf16 / 1e9:.0f}, fp32 {fp32 / 1e9:.0f}); PRECISION=bf16|fp16|fp32 or "
                   "--bf16/--fp16 choose\n")
