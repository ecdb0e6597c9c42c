import io

import pytest
import torch

from megatron.errors import CheckpointError, ConfigError
from megatron.training.learning_rates import AnnealingLR

MAX_LR, MIN_LR, WARMUP, DECAY = 1.0, 0.05, 10, 110  # decay window = 100 steps after warmup


class _FakeOptimizer:
    def __init__(self, num_groups=2):
        self.param_groups = [{"lr": -1.0} for _ in range(num_groups)]


def _scheduler(style, optimizer=None, **kwargs):
    options = dict(max_lr=MAX_LR, min_lr=MIN_LR, warmup_steps=WARMUP, decay_steps=DECAY,
                   decay_style=style)
    options.update(kwargs)
    return AnnealingLR(optimizer or _FakeOptimizer(), **options)


def _lr_at(scheduler, step):
    scheduler.step(step - scheduler.num_steps)
    return scheduler.get_lr()


# Expected values computed by hand from Megatron 1.1.5's formula:
# ratio = (n - 10) / 100; linear 1-ratio, cosine (1+cos(pi*ratio))/2, exponential exp(-0.693*ratio).
@pytest.mark.parametrize("style,expected", [
    ("linear", {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.75, 60: 0.5, 100: 0.1, 105: 0.05, 110: 0.05,
                111: 0.05, 500: 0.05}),
    ("cosine", {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.8535533905932737, 60: 0.5, 110: 0.05,
                111: 0.05}),
    ("exponential", {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.8409273567242722,
                     60: 0.7071588192872713, 110: 0.5000735956957677, 111: 0.05}),
    ("constant", {0: 0.0, 5: 0.5, 10: 1.0, 60: 1.0, 110: 1.0, 111: 0.05}),
])
def test_schedule_values(style, expected):
    optimizer = _FakeOptimizer()
    scheduler = _scheduler(style, optimizer)
    for step, lr in sorted(expected.items()):
        assert _lr_at(scheduler, step) == pytest.approx(lr, abs=1e-12), (style, step)
        assert all(g["lr"] == pytest.approx(lr, abs=1e-12) for g in optimizer.param_groups)


# Later Megatron-LM's styles (its formula), by hand: warmup 10, decay 110, min 0.05, max 1.
# inverse-square-root: max(0.05, sqrt(10 / n)). WSD over the last 40 steps (from 70):
# min + 0.95 c(r), r = (n - 70) / 40; at n = 80 r = 0.25, at n = 90 r = 0.5.
@pytest.mark.parametrize("style,wsd,expected", [
    ("inverse-square-root", None, {5: 0.5, 10: 1.0, 40: 0.5, 1000 // 9: 0.05, 250: 0.05}),
    ("WSD", "exponential", {5: 0.5, 10: 1.0, 70: 1.0, 80: 0.05 + 0.95 * (2 * 0.5 ** 0.25 - 1),
                            90: 0.05 + 0.95 * (2 * 0.5 ** 0.5 - 1), 110: 0.05, 111: 0.05}),
    ("WSD", "linear", {70: 1.0, 80: 0.05 + 0.95 * 0.75, 90: 0.05 + 0.95 * 0.5, 110: 0.05}),
    ("WSD", "cosine", {70: 1.0, 90: 0.05 + 0.95 * 0.5, 110: 0.05}),
    ("WSD", "minus_sqrt", {70: 1.0, 80: 0.05 + 0.95 * 0.5, 110: 0.05}),
])
def test_later_megatron_lm_styles(style, wsd, expected):
    options = {} if wsd is None else dict(wsd_decay_steps=40, wsd_decay_style=wsd)
    scheduler = _scheduler(style, **options)
    for step, lr in sorted(expected.items()):
        assert _lr_at(scheduler, step) == pytest.approx(lr, abs=1e-12), (style, wsd, step)
    # a resume keeps WSD's decay, and checks it against the flags
    state = scheduler.state_dict()
    again = _scheduler(style, **options)
    again.load_state_dict(state)
    assert again.get_lr() == scheduler.get_lr()
    if wsd is not None:
        other = _scheduler(style, wsd_decay_steps=20, wsd_decay_style=wsd,
                           use_checkpoint_lr_scheduler=False)
        with pytest.raises(ConfigError, match="the checkpoint has --lr-wsd-decay-iters = 40 but "
                                              "the command line gives 20"):
            other.load_state_dict(state)


def test_wsd_needs_a_decay_within_the_schedule():
    """(As Megatron-LM, a decay that starts inside the warmup is taken: the lr then drops
    from the warmup's value.)"""
    for steps, style in ((None, "linear"), (0, "linear"), (111, "linear"), (40, "square")):
        with pytest.raises(ConfigError, match="--lr-decay-style WSD decays over its last"):
            _scheduler("WSD", wsd_decay_steps=steps, wsd_decay_style=style)
    scheduler = _scheduler("WSD", wsd_decay_steps=110, wsd_decay_style="linear")
    assert _lr_at(scheduler, 10) == 1.0  # the warmup's end
    assert _lr_at(scheduler, 11) == pytest.approx(0.05 + 0.95 * (1 - 11 / 110), abs=1e-12)


def test_no_warmup_starts_at_max_lr():
    scheduler = _scheduler("linear", warmup_steps=0, decay_steps=100)
    assert scheduler.get_lr() == 1.0
    assert _lr_at(scheduler, 50) == pytest.approx(0.5)


def test_increment_counts_several_steps():
    scheduler = _scheduler("linear")
    scheduler.step(increment=60)
    assert scheduler.num_steps == 60
    assert scheduler.get_lr() == pytest.approx(0.5)


def test_a_deepspeed_schedulers_state_names_its_section():
    with pytest.raises(CheckpointError, match="not written by AnnealingLR .*, but by the "
                                              "'scheduler' section of the DeepSpeed config it "
                                              "was trained with: add that section back"):
        _scheduler("cosine").load_state_dict({"last_batch_iteration": 5})
    with pytest.raises(CheckpointError, match=r"not written by AnnealingLR \(--lr-decay-style's "
                                              r"schedule\). Load it with --no-load-optim$"):
        _scheduler("cosine").load_state_dict({"lr": 1.0})


def test_state_dict_round_trip_resumes_identically():
    first = _scheduler("cosine")
    for _ in range(37):
        first.step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    optimizer = _FakeOptimizer()
    second = _scheduler("cosine", optimizer, use_checkpoint_lr_scheduler=False)
    second.load_state_dict(state)
    assert second.num_steps == 37
    assert optimizer.param_groups[0]["lr"] == first.get_lr()
    for _ in range(80):
        first.step()
        second.step()
        assert second.get_lr() == first.get_lr()


def test_checkpoint_values_win_with_use_checkpoint_flag():
    saved = _scheduler("linear", max_lr=2.0)
    saved.step(60)
    resumed = _scheduler("cosine", max_lr=1.0, use_checkpoint_lr_scheduler=True)
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.max_lr, resumed.decay_style) == (2.0, "linear")
    assert resumed.get_lr() == pytest.approx(1.0)  # 2.0 * (1 - 0.5)
    assert resumed.resume_notes == [  # Megatron's " > using checkpoint value ..." lines
        "learning-rate schedule: --lr 2.0, the checkpoint's (--use-checkpoint-lr-scheduler), "
        "not 1.0",
        "learning-rate schedule: --lr-decay-style 'linear', the checkpoint's "
        "(--use-checkpoint-lr-scheduler), not 'cosine'"]


def test_command_line_values_win_with_override_flag():
    saved = _scheduler("linear", max_lr=2.0)
    saved.step(60)
    resumed = _scheduler("linear", max_lr=1.0, use_checkpoint_lr_scheduler=False,
                         override_lr_scheduler=True)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.num_steps == 60
    assert resumed.get_lr() == pytest.approx(0.5)
    assert resumed.resume_notes == [
        "learning-rate schedule: --lr 1.0, the command line's (--override-lr-scheduler), "
        "not 2.0"]


def test_conflict_without_flags_is_a_config_error():
    saved = _scheduler("linear", max_lr=2.0)
    resumed = _scheduler("linear", max_lr=1.0, use_checkpoint_lr_scheduler=False)
    with pytest.raises(ConfigError, match="--lr.*--override-lr-scheduler"):
        resumed.load_state_dict(saved.state_dict())


def test_loads_megatron_2_key_names():
    resumed = _scheduler("linear", use_checkpoint_lr_scheduler=False)
    resumed.load_state_dict({"max_lr": MAX_LR, "min_lr": MIN_LR, "warmup_steps": WARMUP,
                             "decay_steps": DECAY, "decay_style": "linear", "num_steps": 60})
    assert resumed.get_lr() == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs,match", [
    ({"decay_style": "step"}, "--lr-decay-style"),
    ({"min_lr": 2.0}, "--min-lr"),
    ({"decay_steps": 0, "warmup_steps": 0}, "--lr-decay-iters"),
    ({"warmup_steps": 200}, "warmup"),
    ({"override_lr_scheduler": True}, "--override-lr-scheduler"),
])
def test_bad_settings_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _scheduler(kwargs.pop("decay_style", "linear"), **kwargs)


def test_lengths_derived_from_train_iters_follow_a_longer_run():
    """A finished 100-step run resumed for 300: the decay and warmup that --train-iters
    implied take the new length, from the loaded step on, and a note says so."""
    saved = _scheduler("cosine", warmup_steps=10, decay_steps=100)
    saved.step(100)
    resumed = _scheduler("cosine", warmup_steps=30, decay_steps=300,
                         use_checkpoint_lr_scheduler=False,
                         follows_train_iters=("end_iter", "warmup_iter"))
    resumed.load_state_dict(saved.state_dict())
    fresh = _scheduler("cosine", warmup_steps=30, decay_steps=300)
    fresh.step(100)
    assert (resumed.num_steps, resumed.decay_steps, resumed.warmup_steps) == (100, 300, 30)
    assert resumed.get_lr() == fresh.get_lr()
    note, = resumed.resume_notes
    assert "warmup steps 10 -> 30, decay steps 100 -> 300; resuming at step 100" in note
    kept = _scheduler("cosine", warmup_steps=30, decay_steps=300,
                      use_checkpoint_lr_scheduler=True,
                      follows_train_iters=("end_iter", "warmup_iter"))
    kept.load_state_dict(saved.state_dict())
    assert (kept.decay_steps, kept.warmup_steps) == (100, 10)
    assert kept.resume_notes == [
        "learning-rate schedule: --warmup / --warmup-iters 10, the checkpoint's "
        "(--use-checkpoint-lr-scheduler), not 30",
        "learning-rate schedule: --lr-decay-iters 100, the checkpoint's "
        "(--use-checkpoint-lr-scheduler), not 300"]


def test_a_length_the_user_set_still_must_agree():
    saved = _scheduler("cosine", warmup_steps=10, decay_steps=100)
    resumed = _scheduler("cosine", warmup_steps=10, decay_steps=300,
                         use_checkpoint_lr_scheduler=False, follows_train_iters=("warmup_iter",))
    with pytest.raises(ConfigError, match="--lr-decay-iters = 100 but the command line gives 300"):
        resumed.load_state_dict(saved.state_dict())


def test_a_fractional_warmup_is_megatrons():
    """--warmup 0.01 of 150 iterations is 1.5 warmup steps in Megatron-LM (not 1): the first
    step runs at 1/1.5 of the peak, the decay window starts at 1.5."""
    scheduler = _scheduler("linear", warmup_steps=1.5, decay_steps=21)
    assert _lr_at(scheduler, 1) == pytest.approx(MAX_LR / 1.5)
    assert _lr_at(scheduler, 2) == pytest.approx(MAX_LR * (1 - 0.5 / 19.5))
    resumed = _scheduler("linear", warmup_steps=1.5, decay_steps=21)
    resumed.load_state_dict(scheduler.state_dict())
    assert (resumed.warmup_steps, resumed.get_lr(), resumed.resume_notes) == \
        (1.5, scheduler.get_lr(), [])


def test_a_checkpoint_with_the_fraction_cut_to_whole_steps_keeps_its_warmup():
    """Before keeping Megatron's fraction this trainer saved int(0.015 * 100) = 1 (and no
    "fractional_warmup" key): such a run resumes with the warmup it was trained with, and
    says so, unless --override-lr-scheduler; another value, or a state saved since, is
    still the mismatch error."""
    saved = _scheduler("linear", warmup_steps=1, decay_steps=100)
    saved.step(5)
    newer = saved.state_dict()
    with pytest.raises(ConfigError, match="gives 1.5"):
        _scheduler("linear", warmup_steps=1.5, decay_steps=100,
                   use_checkpoint_lr_scheduler=False).load_state_dict(newer)
    overridden = _scheduler("linear", warmup_steps=1.5, decay_steps=100,
                            use_checkpoint_lr_scheduler=False, override_lr_scheduler=True)
    overridden.load_state_dict({k: v for k, v in newer.items() if k != "fractional_warmup"})
    assert overridden.warmup_steps == 1.5
    saved = {k: v for k, v in newer.items() if k != "fractional_warmup"}  # as saved before
    resumed = _scheduler("linear", warmup_steps=1.5, decay_steps=100,
                         use_checkpoint_lr_scheduler=False, follows_train_iters=("warmup_iter",))
    resumed.load_state_dict(saved)
    assert (resumed.warmup_steps, resumed.get_lr()) == (1, _lr_at(_scheduler(
        "linear", warmup_steps=1, decay_steps=100), 5))
    assert resumed.resume_notes == [
        "learning-rate schedule: the checkpoint's warmup is 1 iterations, --warmup's 1.5 cut "
        "to whole iterations by the trainer that saved it; the run keeps its warmup"]
    other = _scheduler("linear", warmup_steps=2.5, decay_steps=100,
                       use_checkpoint_lr_scheduler=False)
    with pytest.raises(ConfigError, match="--warmup / --warmup-iters = 1 but the command line "
                                          "gives 2.5"):
        other.load_state_dict(saved)


def test_a_warmup_computed_another_way_is_the_same_warmup():
    """0.001 x 100 iterations is 0.1; a converted checkpoint's (0.001 x 100 x 24) / 24 is
    0.09999999999999999: the same schedule, not a mismatch."""
    saved = _scheduler("linear", warmup_steps=0.09999999999999999, decay_steps=100)
    resumed = _scheduler("linear", warmup_steps=0.1, decay_steps=100,
                         use_checkpoint_lr_scheduler=False)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.resume_notes == []


@pytest.mark.parametrize("style, expected", [
    ("linear", {10: 1.0, 60: 0.525, 110: 0.05, 111: 0.05}),
    ("cosine", {10: 1.0, 60: 0.525, 110: 0.05, 111: 0.05}),
    ("constant", {10: 1.0, 110: 1.0, 500: 1.0}),
])
def test_a_converted_megatron_deepspeed_schedule_keeps_its_formula(style, expected):
    """Megatron-LM 2.x decays toward min_lr (min + (max - min) x coefficient) and holds a
    constant lr for good; a state that says so keeps that formula, and saves it again."""
    state = {**_scheduler(style).state_dict(), "decay_formula": "2.x"}
    resumed = _scheduler(style, use_checkpoint_lr_scheduler=False)
    resumed.load_state_dict(state)
    for step, lr in expected.items():
        assert _lr_at(resumed, step) == pytest.approx(lr, abs=1e-12), step
    assert resumed.state_dict()["decay_formula"] == "2.x"
    assert "Megatron-LM 2.x's decay, toward --min-lr" in resumed.resume_notes[0]
