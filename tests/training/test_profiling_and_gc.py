"""Megatron-LM's --profile (torch.profiler over iterations --profile-step-start + 1 to
--profile-step-end on --profile-ranks) and --manual-gc (Python's collector off while training,
collections at fixed iterations and around evaluation) and --empty-unused-memory-level."""

import gc
import gzip
import json
import re

import pytest

import pretrain_gpt2
from megatron.config.sections import ProfilerConfig
from megatron.errors import ConfigError
from tests.training.test_arguments import parse
from tests.training.test_batch_rampup import _common


def test_profile_flags_resolve_to_the_iterations_and_ranks(tmp_path):
    assert parse().profiler == ProfilerConfig()
    config = parse("--profile", "--tensorboard-dir", str(tmp_path), "--profile-step-start", "2",
                   "--profile-step-end", "4", "--profile-ranks", "1", "0", "1", world_size=2)
    assert config.profiler == ProfilerConfig(profile=True, profile_first=3, profile_last=4,
                                             profile_ranks=(0, 1), profile_with_stack=False,
                                             profile_trace_dir=str(tmp_path))
    full = parse("--profile", "pt-full", "--save", str(tmp_path)).profiler  # Megatron-DeepSpeed
    assert full.profile_with_stack and full.profile_trace_dir == str(tmp_path)
    assert (full.profile_first, full.profile_last) == (11, 12)  # Megatron-LM's defaults
    assert parse("--profile", "--log-dir", "logs").profiler.profile_trace_dir == "logs"
    late = parse("--profile", "--save", "s", "--profile-step-start", "8",
                 "--profile-step-end", "20")  # a 10-iteration run
    assert " note: --profile-step-end 20 is after the run's last iteration 10: iterations 9 " \
           "to 10 are profiled" in late.notes
    config = parse("--manual-gc", "--manual-gc-interval", "5", "--no-manual-gc-eval")
    training = config.training
    assert (training.manual_gc, training.manual_gc_interval, training.manual_gc_eval) == \
        (True, 5, False)
    assert not parse().training.manual_gc
    assert any("--use-pytorch-profiler asks for what this trainer always does" in note
               for note in parse("--use-pytorch-profiler").notes)


@pytest.mark.parametrize("flags, world_size, message", [
    (["--profile"], 1, "--profile writes a trace: give --tensorboard-dir (or --log-dir or "
                       "--save) for it"),
    (["--profile-step-start", "3"], 1, "--profile-step-start does nothing without --profile"),
    (["--profile-ranks", "0", "--profile-step-end", "3"], 1,
     "--profile-step-end, --profile-ranks do nothing without --profile"),
    (["--profile", "--save", "s", "--profile-step-start", "5", "--profile-step-end", "5"], 1,
     "--profile-step-end 5 must be after --profile-step-start 5"),
    (["--profile", "--save", "s", "--profile-step-start", "-1"], 1,
     "--profile-step-start must be 0 or more, got -1"),
    (["--profile", "--save", "s", "--profile-ranks", "0", "2", "-1"], 2,
     "--profile-ranks 2 -1: not a rank of this job (ranks 0 to 1)"),
    (["--profile", "nsys", "--save", "s"], 1, "argument --profile: invalid choice: 'nsys'"),
    (["--profile_steps", "2,3"], 1, "S,E of a run that starts at iteration K is "
                                    "--profile-step-start K+S-1 --profile-step-end K+E"),
    (["--manual-gc-interval", "2"], 1, "--manual-gc-interval does nothing without --manual-gc"),
    (["--no-manual-gc-eval"], 1, "--no-manual-gc-eval does nothing without --manual-gc"),
    (["--manual-gc", "--manual-gc-interval", "-1"], 1,
     "--manual-gc-interval must be 0 (never during training) or more, got -1"),
])
def test_wrong_profile_and_gc_flags_are_one_error(flags, world_size, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(*flags, world_size=world_size)


def test_the_trainer_profiles_the_iterations_asked_for(corpus, tmp_path, capsys):
    argv = _common(corpus) + ["--batch-size", "2", "--train-iters", "4", "--profile",
                              "--profile-step-start", "1", "--profile-step-end", "3",
                              "--log-dir", str(tmp_path)]
    assert pretrain_gpt2.main(argv) == 0
    out = capsys.readouterr().out
    trace = tmp_path / "rank0.iterations_2-3.pt.trace.json.gz"
    assert f" rank 0: profiled iterations 2 to 3 (the profiler slows them): trace in {trace}" \
        in out
    table = out.split("top ops by self CPU time, ms per iteration:\n", 1)[1].splitlines()
    rows = [line for line in table if re.match(r" +[0-9.]+ +[0-9.]+%  \S", line)]
    # (on a busy machine a Python-side range such as Optimizer.step may rank first)
    assert 1 <= len(rows) <= 8 and any("aten::" in row for row in rows), table
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    names = {event.get("name") for event in events}
    assert "aten::mm" in names or "aten::addmm" in names
    # the two profiled iterations' optimizer steps, not the others'
    assert sum(1 for name in names if name and name.startswith("Optimizer.step")) == 1
    assert sum(1 for event in events
               if str(event.get("name", "")).startswith("Optimizer.step")) == 2


def test_a_run_past_the_profiled_iterations_says_so(corpus, tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    common = _common(corpus) + ["--batch-size", "2", "--save", save, "--load", save]
    assert pretrain_gpt2.main(common + ["--train-iters", "2"]) == 0
    capsys.readouterr()
    assert pretrain_gpt2.main(common + ["--train-iters", "3", "--profile", "--profile-step-start",
                                        "0", "--profile-step-end", "1"]) == 0
    assert " rank 0: nothing to profile: this run starts after iteration 2, past " \
           "--profile-step-end 1" in capsys.readouterr().out
    assert not list((tmp_path / "ckpt").glob("*.pt.trace.json.gz"))


def test_manual_gc_collects_at_the_interval_and_around_evaluation(corpus, tmp_path):
    collections = []  # (generation) of each collection while the automatic collector is off

    def seen(phase, info):
        if phase == "start" and not gc.isenabled():
            collections.append(info["generation"])

    common = _common(corpus)
    common[common.index("--eval-interval") + 1] = "1"
    argv = common + ["--batch-size", "2", "--train-iters", "4", "--manual-gc",
                     "--manual-gc-interval", "2"]
    enabled_before = gc.isenabled()
    gc.callbacks.append(seen)
    try:
        assert pretrain_gpt2.main(argv) == 0
    finally:
        gc.callbacks.remove(seen)
    assert gc.isenabled() == enabled_before
    # start; evaluation after iterations 1, 2, 3 (before: all, after: generation 0); the
    # interval after iterations 2 and 4
    assert collections == [2, 2, 0, 2, 0, 2, 2, 0, 2], collections


def test_the_profiler_starts_inside_its_range_and_ends_where_training_does(tmp_path, capsys):
    import types

    import torch

    from megatron.training.profiling import IterationProfiler
    config = ProfilerConfig(profile=True, profile_first=3, profile_last=6, profile_ranks=(0,),
                            profile_trace_dir=str(tmp_path))
    here = types.SimpleNamespace(rank=0, device=torch.device("cpu"))
    resumed = IterationProfiler(config, here, start_iteration=3)  # resumed inside the range
    for iteration in (4, 5):  # then --exit-interval 5
        resumed.before_iteration(iteration)
        torch.ones(64, 64) @ torch.ones(64, 64)
        resumed.after_iteration(iteration)
    resumed.close(5)
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.iterations_4-5.pt.trace.json.gz"]
    assert "aten::mm" in capsys.readouterr().out
    failed = IterationProfiler(config, here, start_iteration=0)
    failed.before_iteration(3)
    failed.abandon()  # training raised: nothing written
    failed.close(3)
    elsewhere = IterationProfiler(config, types.SimpleNamespace(rank=1, device=here.device), 0)
    elsewhere.before_iteration(3)
    elsewhere.after_iteration(6)
    assert len(list(tmp_path.iterdir())) == 1 and elsewhere.running is None


def test_the_collector_is_back_on_after_training_fails(corpus, monkeypatch, capsys):
    monkeypatch.setenv("MEGATRON_FAULT_NAN_AT", "1,2")
    argv = _common(corpus) + ["--batch-size", "2", "--train-iters", "4", "--manual-gc",
                              "--max-nan-iterations", "2"]
    assert gc.isenabled()
    assert pretrain_gpt2.main(argv) == 2
    assert "the loss was NaN or inf for 2 consecutive iterations" in capsys.readouterr().err
    assert gc.isenabled()


@pytest.mark.parametrize("level, per_iteration", [(0, 0), (1, 1), (2, 2)])
def test_unused_memory_is_emptied_at_each_level(corpus, monkeypatch, capsys, level,
                                               per_iteration):
    """--empty-unused-memory-level (Megatron-LM's): 1 empties CUDA's cache once per iteration
    (before the optimizer step) and after each evaluation batch, 2 after the step too. On the
    CPU the call does nothing, and a note says so."""
    from megatron.runtime import device
    calls = []
    monkeypatch.setattr(device, "empty_cache", lambda where: calls.append(where.type))
    common = _common(corpus)
    common[common.index("--eval-interval") + 1] = "2"
    assert pretrain_gpt2.main(common + ["--batch-size", "2", "--global-batch-size", "4",
                                        "--train-iters", "3", "--eval-iters", "2",
                                        "--empty-unused-memory-level", str(level)]) == 0
    evaluation_batches = 3 * 2  # validation after iterations 2 and 3, test after 3
    assert calls == ["cpu"] * (3 * per_iteration + (evaluation_batches if level else 0))
    said = f" note: --empty-unused-memory-level {level} empties CUDA's caching allocator; " \
           "this run is on the CPU, where it does nothing"
    assert (said in capsys.readouterr().out) == (level > 0)
    with pytest.raises(ConfigError, match="--empty-unused-memory-level: invalid choice: 3 "
                                          r"\(choose from 0, 1, 2\)"):
        parse("--empty-unused-memory-level", "3")
