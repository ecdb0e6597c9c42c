"""Later Megatron-LM's --lr-decay-style WSD (with --lr-wsd-decay-iters/-samples and
--lr-wsd-decay-style) and inverse-square-root through the trainer: the flags, each mistake
as one error, the learning rates a run logs, and an exact resume."""

import json
import math

import pytest

from megatron.config import resolve_config
from megatron.errors import ConfigError
from tests.training.test_pretrain import run

_BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--batch-size", "2", "--lr", "1e-3", "--data-path", "x",
         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m",
         "--train-iters", "100"]


def _parse(*flags):
    return resolve_config(_BASE + list(flags), world_size=1)


def test_wsd_flags_resolve():
    optimizer = _parse("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "20",
                       "--lr-wsd-decay-style", "cosine").optimizer
    assert (optimizer.lr_decay_style, optimizer.lr_wsd_decay_steps,
            optimizer.lr_wsd_decay_style) == ("WSD", 20, "cosine")
    in_samples = _parse("--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "40")
    assert in_samples.optimizer.lr_wsd_decay_steps == 20  # 40 samples of a global batch of 2
    assert _parse("--lr-decay-style", "inverse-square-root").optimizer.lr_wsd_decay_steps is None


@pytest.mark.parametrize("flags, match", [
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs the length of its decay, the last "
                                  "steps of the schedule: --lr-wsd-decay-iters N"),
    (["--lr-wsd-decay-iters", "5"], "--lr-wsd-decay-iters has no effect without --lr-decay-style "
                                    "WSD"),
    (["--lr-wsd-decay-style", "linear"], "--lr-wsd-decay-style has no effect without"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "101"],
     r"--lr-wsd-decay-iters 101: WSD's decay must be positive and within the schedule's 100 "
     r"iterations \(--lr-decay-iters\)"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "400"],
     r"^--lr-wsd-decay-samples 400 \(200 iterations\): WSD's decay must"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "0"], "must be positive"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5", "--lr-wsd-decay-samples", "10"],
     "--lr-wsd-decay-samples and --lr-wsd-decay-iters both set the decay's length"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-style", "square", "--lr-wsd-decay-iters", "5"],
     "argument --lr-wsd-decay-style: invalid choice: 'square'"),
])
def test_a_wrong_wsd_is_one_error(flags, match):
    with pytest.raises(ConfigError, match=match):
        _parse(*flags)


def test_a_deepspeed_scheduler_section_replaces_wsd(tmp_path):
    """The JSON's 'scheduler' sets the lr: WSD's flags are not needed, and said not used."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "scheduler": {
        "type": "WarmupLR", "params": {"warmup_num_steps": 2}}}))
    parsed = _parse("--deepspeed", "--deepspeed_config", str(config), "--lr-decay-style", "WSD",
                    "--lr-wsd-decay-iters", "5")
    assert parsed.optimizer.lr_wsd_decay_steps is None
    assert any("--lr-decay-style, --lr-wsd-decay-iters not used: the 'scheduler' section" in note
               for note in parsed.notes), parsed.notes


def _logged(tmp_path, log_dir):
    with open(tmp_path / log_dir / "metrics.jsonl") as f:
        return {r["iteration"]: (r["lr"], r["lm_loss"]) for r in map(json.loads, f)
                if "lm_loss" in r}


def test_a_wsd_run_logs_megatrons_rates_and_resumes_exactly(corpus, tmp_path):
    """6 iterations, warmup 2 (TINY's), WSD's linear decay over the last 3: the lr after
    iteration n is 3e-3 n/2 in the warmup, 3e-3 until 3, then 3e-4 + 2.7e-3 (1 - (n-3)/3)."""
    wsd = ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3", "--lr-wsd-decay-style",
           "linear"]
    assert run(corpus, tmp_path, *wsd, log_dir="full") == 0
    full = _logged(tmp_path, "full")
    expected = {1: 1.5e-3, 2: 3e-3, 3: 3e-3, 4: 3e-4 + 2.7e-3 * 2 / 3,
                5: 3e-4 + 2.7e-3 / 3, 6: 3e-4}
    assert {n: lr for n, (lr, _) in full.items()} == pytest.approx(expected, rel=1e-12)
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, *wsd, "--save", save, "--exit-interval", "3",
               log_dir="split") == 0
    assert run(corpus, tmp_path, *wsd, "--save", save, "--load", save, log_dir="split") == 0
    assert _logged(tmp_path, "split") == full


def test_an_inverse_square_root_run_logs_megatrons_rates(corpus, tmp_path):
    """Later Megatron-LM counts samples: sqrt(max(warmup, 1) / max(n, 1)) in samples, which
    without a warmup is 1 / sqrt(4 n) at a global batch of 4, not 1 / sqrt(n)."""
    assert run(corpus, tmp_path, "--lr-decay-style", "inverse-square-root", iters=4) == 0
    rates = {n: lr for n, (lr, _) in _logged(tmp_path, "run").items()}
    assert rates == pytest.approx({1: 1.5e-3, 2: 3e-3, 3: 3e-3 * math.sqrt(2 / 3),
                                   4: 3e-3 * math.sqrt(2 / 4)}, rel=1e-12)
    assert run(corpus, tmp_path, "--lr-decay-style", "inverse-square-root", "--warmup-iters",
               "0", iters=3, log_dir="no_warmup") == 0
    rates = {n: lr for n, (lr, _) in _logged(tmp_path, "no_warmup").items()}
    assert rates == pytest.approx({n: 3e-3 / math.sqrt(4 * n) for n in (1, 2, 3)}, rel=1e-12)


def test_inverse_square_root_counts_each_step_at_its_own_batch_across_a_resume():
    """Resumed at another global batch, the count goes on from the samples seen (Megatron-LM
    counts samples), not from the new batch times the steps."""
    from megatron.training.learning_rates import AnnealingLR

    class Groups:
        param_groups = [{"lr": 0.0}]

    def schedule(batch):
        return AnnealingLR(Groups(), max_lr=1e-3, min_lr=0.0, warmup_steps=0, decay_steps=8,
                           decay_style="inverse-square-root", samples_per_step=batch)
    at_16 = schedule(16)
    at_16.step(4)
    assert at_16.get_lr() == pytest.approx(1e-3 / math.sqrt(64), rel=1e-12)
    at_32 = schedule(32)
    at_32.load_state_dict(at_16.state_dict())
    at_32.step()
    assert at_32.get_lr() == pytest.approx(1e-3 / math.sqrt(64 + 32), rel=1e-12)
    older = at_16.state_dict()
    del older["num_samples"]  # a checkpoint saved before the count was kept
    at_32.load_state_dict(older)
    assert at_32.get_lr() == pytest.approx(1e-3 / math.sqrt(4 * 32), rel=1e-12)
