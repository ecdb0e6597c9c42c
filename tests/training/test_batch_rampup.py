"""--rampup-batch-size START INCREMENT SAMPLES (Megatron-LM's batch-size ramp): the rule, the
run's length, the schedule in samples, the trainer's batches at one and two data-parallel
ranks, at ZeRO stage 2 and with pipeline stages, exact resume, and each wrong input."""

import json
import random

import pytest

import pretrain_gpt2
from megatron.config import resolve_config
from megatron.config.batch_rampup import BatchRampup
from megatron.errors import ConfigError
from tests.dist_utils import free_port, run_distributed
from tests.tools.tp_checkpoints import pretrain_worker


def _megatron_batch(start, increment, samples, final, consumed):
    """Megatron-LM's RampupBatchsizeNumMicroBatches.update, written out."""
    per_increment = samples / ((final - start) / increment)
    if consumed > samples:
        return final
    return start + int(consumed / per_increment) * increment


def _megatron_iterations(start, increment, samples, final, train_samples):
    """Megatron-LM's update_train_iters under a ramp: one iteration at a time."""
    iterations = consumed = 0
    while consumed <= samples:
        consumed += _megatron_batch(start, increment, samples, final, consumed)
        iterations += 1
    return iterations + (train_samples - consumed) // final, consumed


def test_the_ramp_is_megatrons_rule():
    ramp = BatchRampup(start=4, increment=4, samples=16, final=12)  # 8 samples an increment
    assert [ramp.global_batch_at(c) for c in (0, 4, 7, 8, 15, 16, 17, 10 ** 9)] == \
        [4, 4, 4, 8, 8, 12, 12, 12]
    assert ramp.ramp == (4, 28)  # batches 4, 4, 8, 12
    assert ramp.iterations_for(60) == 6 and ramp.samples_after(6) == 52
    assert [ramp.samples_after(i) for i in range(5)] == [0, 4, 8, 16, 28]
    assert ramp.first_size_not_a_multiple_of(4) is None
    assert ramp.first_size_not_a_multiple_of(8) == 4
    assert BatchRampup(8, 4, 16, 16).first_size_not_a_multiple_of(8) == 12
    rng = random.Random(0)
    for _ in range(300):
        per_step = rng.choice([1, 2, 8])
        start = per_step * rng.randint(1, 20)
        increment = per_step * rng.randint(1, 8)
        final = start + increment * rng.randint(1, 30)
        samples = rng.randint(1, 20000)
        ramp = BatchRampup(start, increment, samples, final)
        train_samples = samples + rng.randint(final, 50 * final)
        iterations, consumed = _megatron_iterations(start, increment, samples, final,
                                                    train_samples)
        assert ramp.ramp[1] == consumed
        assert ramp.iterations_for(train_samples) == iterations
        for c in rng.sample(range(samples + 2 * final), 20):
            assert ramp.global_batch_at(c) == _megatron_batch(start, increment, samples, final, c)


def test_a_long_ramp_is_counted_without_stepping_through_it():
    """A billion iterations of batch 1, then one of 2 (Megatron's loop would take minutes)."""
    ramp = BatchRampup(start=1, increment=1, samples=10 ** 9, final=2)
    assert ramp.ramp == (10 ** 9 + 1, 10 ** 9 + 2)
    assert ramp.iterations_for(10 ** 9 + 100) == 10 ** 9 + 1 + 49


_BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--batch-size", "2", "--lr", "1e-3", "--data-path", "x",
         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m"]


def _parse(*flags, world_size=1):
    return resolve_config(_BASE + list(flags), world_size=world_size)


def test_flags_resolve_to_a_ramp_and_a_schedule_in_samples():
    config = _parse("--rampup-batch-size", "4", "4", "16", "--global-batch-size", "12",
                    "--train-samples", "60", "--lr-warmup-samples", "8")
    training, optimizer = config.training, config.optimizer
    assert training.rampup == BatchRampup(4, 4, 16, 12) and training.train_iters == 6
    assert [training.global_batch_at(c) for c in (0, 8, 16, 28)] == [4, 8, 12, 12]
    assert [training.micro_batches_in(training.global_batch_at(c)) for c in (0, 8, 16)] == \
        [2, 4, 6]
    assert training.samples_after(6) == 52
    assert (optimizer.schedule_unit, optimizer.lr_decay_steps, optimizer.warmup_steps) == \
        ("samples", 60, 8)
    assert " note: --rampup-batch-size 4 4 16: the global batch grows from 4 by 4 to 12 over " \
           "the first 4 iterations (28 samples); --train-samples 60 is 6 iterations, and the " \
           "learning-rate schedule counts samples" in config.notes
    assert config.as_flat_dict()["rampup_batch_size"] == [4, 4, 16]
    twice = _parse("--rampup-batch-size", "2", "2", "16", *_RAMP, "--train-samples", "60")
    assert " note: --rampup-batch-size 2 2 16, then --rampup-batch-size 4 4 16: the last one " \
           "is used" in twice.notes and twice.training.rampup == training.rampup
    fraction = _parse("--rampup-batch-size", "4", "4", "16", "--global-batch-size", "12",
                      "--train-samples", "60", "--lr-decay-samples", "50", "--warmup", "0.1")
    assert (fraction.optimizer.lr_decay_steps, fraction.optimizer.warmup_steps) == (50, 5)
    assert " note: --lr-decay-samples 50 ends the linear schedule before --train-samples 60: " \
           "samples 51-60 run at --min-lr 0 (Megatron's rule, for every --lr-decay-style); " \
           "leave --lr-decay-samples out to schedule over the whole run" in fraction.notes
    constant = _parse("--global-batch-size", "12", "--train-samples", "60")
    assert constant.training.rampup is None and constant.optimizer.schedule_unit == "iterations"
    assert constant.training.global_batch_at(0) == 12 and constant.training.samples_after(5) == 60


_RAMP = ["--rampup-batch-size", "4", "4", "16", "--global-batch-size", "12"]


@pytest.mark.parametrize("flags, world_size, match", [
    (["--rampup-batch-size", "4", "4"], 1, "argument --rampup-batch-size: expected 3 arguments"),
    (["--rampup-batch-size", "4", "x", "16"], 1, "argument --rampup-batch-size: invalid int "
                                                  "value: 'x'"),
    (["--rampup-batch-size", "0", "4", "16", "--global-batch-size", "12", "--train-samples",
      "60"], 1, "the start batch, the increment and the ramp's samples must be positive"),
    (["--rampup-batch-size", "4", "4", "-1", "--global-batch-size", "12", "--train-samples",
      "60"], 1, "must be positive"),
    (["--rampup-batch-size", "-2", "2", "16", "--global-batch-size", "12", "--train-samples",
      "60"], 1, "--rampup-batch-size -2 2 16: the start batch, the increment and the ramp's "
                "samples must be positive"),
    (["--rampup-batch-size", "2", "2", "16", "--train-samples", "60"], 1,
     r"starts at 2 samples, not below the global batch 2 \(--batch-size x data-parallel size; "
     r"--global-batch-size sets another\)"),
    (["--rampup-batch-size", "12", "4", "16", "--global-batch-size", "12", "--train-samples",
      "60"], 1, "starts at 12 samples, not below --global-batch-size 12: there is nothing to "
                "ramp up to"),
    (["--rampup-batch-size", "4", "6", "16", "--global-batch-size", "12", "--train-samples",
      "60"], 1, r"the ramp from 4 to --global-batch-size 12 is not a whole number of "
                r"increments of 6 \(\(12 - 4\) % 6 = 2\)"),
    (["--rampup-batch-size", "2", "2", "16", "--global-batch-size", "12", "--train-samples",
      "60"], 2, r"the ramp's global batch of 2 samples is not a whole number of micro batches: "
                r"--batch-size 2 x data-parallel size 2 = 4 \(2 % 4 = 2\); make the start and "
                r"the increment multiples of 4"),
    (["--rampup-batch-size", "4", "2", "100", "--global-batch-size", "10", "--train-samples",
      "200"], 2, r"--global-batch-size 10 is not divisible by --batch-size 2 x data-parallel "
                 r"size 2 = 4"),
    (_RAMP + ["--train-iters", "6"], 1, "--rampup-batch-size changes the samples of an "
                                         "iteration, so lengths are given in samples: "
                                         "--train-samples, not --train-iters"),
    (_RAMP + ["--train-samples", "60", "--lr-decay-iters", "5"], 1,
     "--lr-decay-samples, not --lr-decay-iters"),
    (_RAMP + ["--train-samples", "60", "--warmup-iters", "1"], 1,
     "--lr-warmup-samples, not --warmup-iters"),
    (_RAMP + ["--train-tokens", "6000"], 1, "--train-samples, not --train-tokens"),
    (_RAMP, 1, "--rampup-batch-size needs the run's length in samples: --train-samples"),
    (_RAMP + ["--train-samples", "20"], 1, r"--train-samples 20 ends inside the batch-size ramp, "
                                            r"which takes 4 iterations and 28 samples \(from 4 "
                                            r"to 12\); give at least that many \(the launch "
                                            r"scripts: TRAIN_ITERS=3 or more"),
    (_RAMP + ["--train-samples", "60", "--lr-warmup-samples", "8", "--warmup", "0.1"], 1,
     "--lr-warmup-samples and --warmup both set the warmup"),
    (_RAMP + ["--train-samples", "60", "--lr-warmup-samples", "80"], 1,
     r"the warmup \(80 samples, from --lr-warmup-samples 80\) must lie between 0 and the "
     r"decay's end \(60 samples, from --train-samples 60\)"),
])
def test_a_wrong_ramp_is_one_error(flags, world_size, match):
    with pytest.raises(ConfigError, match=match):
        _parse(*flags, world_size=world_size)


def test_a_deepspeed_scheduler_section_is_refused_under_a_ramp(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_batch_size": 12, "train_micro_batch_size_per_gpu": 2,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}))
    with pytest.raises(ConfigError, match="--rampup-batch-size changes the samples of an "
                                          "optimizer step, which the DeepSpeed config's "
                                          "'scheduler' section counts"):
        _parse(*_RAMP, "--train-samples", "60", "--deepspeed", "--deepspeed_config",
               str(config))


def test_the_interleaved_pipeline_needs_every_ramp_size_in_groups_of_its_stages():
    pipeline = ["--num-layers", "4", "--global-batch-size", "16", "--train-samples", "80",
                "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                "1"]
    with pytest.raises(ConfigError, match=r"but a step has 1 \(1 % 2 = 1\); make "
                                          r"--global-batch-size and --rampup-batch-size a "
                                          r"multiple of 4"):
        _parse("--rampup-batch-size", "2", "2", "16", *pipeline, world_size=2)
    assert _parse("--rampup-batch-size", "4", "4", "16", *pipeline, world_size=2).training.rampup


def test_a_ramp_that_starts_below_the_pipeline_stages_says_what_those_steps_idle():
    config = _parse("--pipeline-model-parallel-size", "4", "--num-layers", "4",
                    "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "32",
                    "--train-samples", "160", world_size=4)
    note, = [n for n in config.notes if "idles" in n]
    assert "--rampup-batch-size starts at 2 micro batch(es) per step over 4 pipeline stages: " \
        "each stage idles 60% of those steps ((P-1)/(m+P-1)), less as the batch grows (27% once " \
        "a step has 8)" in note


# ------------------------------------------------------------------------------ the trainer

def _common(corpus):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--lr", "3e-3",
            "--min-lr", "3e-4", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
            "--num-workers", "0", "--split", "90,9,1", "--threads", "1",
            "--data-path", corpus["prefix"], "--vocab-file", corpus["vocab"],
            "--merge-file", corpus["merges"]]


def _records(tmp_path, log_dir):
    with open(tmp_path / log_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "lm_loss" in r]


def _ramp_run(corpus, tmp_path, log_dir, *extra, batch_size="4"):
    argv = _common(corpus) + ["--batch-size", batch_size, *_RAMP, "--train-samples", "60",
                              "--lr-decay-style", "linear", "--lr-warmup-samples", "8",
                              "--log-dir", str(tmp_path / log_dir), *extra]
    return pretrain_gpt2.main(argv)


def _expected_lr(samples, max_lr=3e-3, min_lr=3e-4, warmup=8, decay=60):
    """Megatron-LM 1.1.5's linear schedule over samples (independent of AnnealingLR)."""
    if samples <= warmup:
        return max_lr * samples / warmup
    return max(max_lr * (1 - (samples - warmup) / (decay - warmup)), min_lr)


def test_the_trainer_runs_the_ramps_batches_and_schedule(corpus, tmp_path, capsys):
    assert _ramp_run(corpus, tmp_path, "ramp") == 0
    out = capsys.readouterr().out
    assert "global batch size:     4 |" in out and "global batch size:    12 |" in out
    records = _records(tmp_path, "ramp")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["batch_size"] for r in records] == [4, 4, 8, 12, 12, 12]
    assert [r["consumed_samples"] for r in records] == [4, 8, 16, 28, 40, 52]
    for record in records:
        assert record["lr"] == pytest.approx(_expected_lr(record["consumed_samples"]),
                                             rel=1e-12)
    # iteration 1 is the first 4 samples as one micro batch: its loss and gradient norm are
    # those of a run at a constant batch of 4
    argv = _common(corpus) + ["--batch-size", "4", "--train-iters", "1", "--lr-decay-style",
                              "constant", "--warmup", "0", "--log-dir", str(tmp_path / "four")]
    assert pretrain_gpt2.main(argv) == 0
    assert _records(tmp_path, "four")[0]["lm_loss"] == records[0]["lm_loss"]
    assert _records(tmp_path, "four")[0]["grad_norm"] == records[0]["grad_norm"]


@pytest.mark.parametrize("layout", ["megatron", "deepspeed"])
def test_a_ramp_resumes_exactly_in_the_middle_and_counts_samples(corpus, tmp_path, capsys,
                                                                 layout):
    flags = []
    if layout == "deepspeed":
        config = tmp_path / "ds.json"
        config.write_text(json.dumps({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4,
                                      "gradient_clipping": 1.0,
                                      "zero_optimization": {"stage": 1}}))
        flags = ["--deepspeed", "--deepspeed_config", str(config)]
    assert _ramp_run(corpus, tmp_path, "full", *flags) == 0
    save = str(tmp_path / "ckpt")
    assert _ramp_run(corpus, tmp_path, "split", "--save", save, "--exit-interval", "3",
                     *flags) == 0
    assert _ramp_run(corpus, tmp_path, "split", "--save", save, "--load", save, *flags) == 0
    full, split = _records(tmp_path, "full"), _records(tmp_path, "split")
    assert [(r["lm_loss"], r["lr"], r["batch_size"]) for r in full] == \
        [(r["lm_loss"], r["lr"], r["batch_size"]) for r in split]
    capsys.readouterr()
    assert _ramp_run(corpus, tmp_path, "again", "--load", save, *flags) == 0
    assert " nothing to train: the checkpoint is at iteration 6, and --train-samples makes 6 " \
           "iterations under the batch-size ramp; raise --train-samples" \
        in capsys.readouterr().out
    # another ramp: its iterations would not end at --train-samples (also when the checkpoint
    # is past them: raising --train-samples would not help)
    for samples in ("120", "40"):
        other = _common(corpus) + ["--batch-size", "4", "--rampup-batch-size", "4", "4", "8",
                                   "--global-batch-size", "12", "--train-samples", samples,
                                   "--lr-decay-style", "linear", "--lr-warmup-samples", "8",
                                   "--log-dir", str(tmp_path / "other"), "--load", save, *flags]
        capsys.readouterr()
        assert pretrain_gpt2.main(other) == 2
        assert "error: the checkpoint consumed 52 samples in 6 iterations, where " \
               "--rampup-batch-size 4 4 8 to --global-batch-size 12 consumes 60: it was " \
               "trained with another ramp or global batch" in capsys.readouterr().err
    # the schedule counts samples: a resume without the ramp is one error that says so
    argv = _common(corpus) + ["--batch-size", "4", "--global-batch-size", "12",
                              "--train-iters", "8", "--load", save,
                              "--log-dir", str(tmp_path / "no_ramp"), *flags]
    capsys.readouterr()
    assert pretrain_gpt2.main(argv) == 2
    assert "the checkpoint's learning-rate schedule counts samples (it was trained with " \
           "--rampup-batch-size), this run's counts iterations: resume with " \
           "--rampup-batch-size, or train on from its weights with --finetune" \
        in capsys.readouterr().err
    # with a fresh schedule, the run says where its constant batches end
    assert pretrain_gpt2.main(argv + ["--no-load-optim"]) == 0
    assert " note: the checkpoint consumed 52 samples in 6 iterations, not 72 (6 x " \
           "--global-batch-size 12; it was trained with another global batch or a ramp): this " \
           "run counts on from iteration 6 to 8, so it ends at 76 samples" \
        in capsys.readouterr().out


def test_dp2_at_zero_stage_2_and_two_pipeline_stages_match_one_process(corpus, tmp_path):
    """The same ramp (micro batch 2) on two data-parallel ranks at ZeRO stage 2 under
    --deepspeed, and over two pipeline stages: the batches and losses of one process."""
    assert _ramp_run(corpus, tmp_path, "one", batch_size="2") == 0
    one = [(r["lm_loss"], r["batch_size"]) for r in _records(tmp_path, "one")]
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2,
                                     "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}))
    layouts = {"dp2_zero2": ["--deepspeed", "--deepspeed_config", str(ds_config)],
               "pp2": ["--pipeline-model-parallel-size", "2"]}
    for name, flags in layouts.items():
        argv = _common(corpus) + ["--batch-size", "2", *_RAMP, "--train-samples", "60",
                                  "--lr-decay-style", "linear", "--lr-warmup-samples", "8",
                                  "--log-dir", str(tmp_path / name), *flags]
        assert run_distributed(pretrain_worker, 2, args=(argv, free_port())) == [0, 0], name
        got = [(r["lm_loss"], r["batch_size"]) for r in _records(tmp_path, name)]
        assert [b for _, b in got] == [b for _, b in one], name
        assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in one],
                                                          rel=1e-5), name


def test_a_checkpoint_without_a_train_state_resumes_at_the_samples_it_consumed():
    """Megatron-LM's own checkpoints record the samples in their args; without them, the
    ramp's batches up to the checkpoint's iteration (not iterations x the final batch)."""
    from megatron.checkpointing.megatron_layout import _samples_before
    ramp = {"rampup_batch_size": [4, 4, 16], "global_batch_size": 12}
    assert _samples_before({"args": {"consumed_train_samples": 8}}, 2, ramp) == 8
    assert _samples_before({"args": {}}, 3, ramp) == 16
    assert _samples_before({}, 3, {"rampup_batch_size": None, "global_batch_size": 12}) == 36


def test_a_resume_at_a_smaller_global_batch_that_runs_out_of_samples_stops_before_training(
        corpus, tmp_path, capsys):
    """A blend's train split holds exactly the samples its run asks for: a checkpoint trained
    at a larger --global-batch-size has consumed more of it than this run's batches would
    have, so its last iterations would find no samples (a StopIteration traceback then)."""
    import shutil
    second = str(tmp_path / "copy_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus["prefix"] + suffix, second + suffix)
    data = ["--data-path", "0.5", corpus["prefix"], "0.5", second]
    save = str(tmp_path / "ckpt")
    common = _common(corpus) + data + ["--batch-size", "4", "--train-iters", "4"]
    assert pretrain_gpt2.main(common + ["--global-batch-size", "8", "--exit-interval", "2",
                                        "--save", save, "--log-dir", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert pretrain_gpt2.main(common + ["--global-batch-size", "4", "--load", save,
                                        "--log-dir", str(tmp_path / "b")]) == 2
    assert "error: the checkpoint consumed 16 samples in 2 iterations (at another " \
           "--global-batch-size than this run's 4), so the 2 iterations ahead need samples up " \
           "to 24, but the train split holds 16, built for this run's batches from the start: " \
           "resume with the checkpoint's --global-batch-size" in capsys.readouterr().err
