"""The logging flags: Megatron's timers line (--timing-log-level, --timing-log-option) and
what TensorBoard gets (--log-timers-to-tensorboard, --tensorboard-log-interval, the
--log-*-to-tensorboard flags, --log-params-norm)."""

import pytest

from megatron.config.sections import TensorboardScalars
from megatron.errors import ConfigError
from tests.training.test_arguments import parse


def test_timing_log_level_turns_on_the_engines_phase_timers(tmp_path):
    assert not parse().logging.phase_times
    timed = parse("--timing-log-level", "1", "--log-timers-to-tensorboard", "--tensorboard-dir",
                  str(tmp_path))
    assert timed.logging.phase_times and timed.logging.tensorboard.phase_times
    assert timed.engine.ds_config.wall_clock_breakdown
    alone = parse("--log-timers-to-tensorboard", "--tensorboard-dir", str(tmp_path))
    assert alone.logging.phase_times  # as in Megatron-LM 2.x, whose timers always print
    with pytest.raises(ConfigError, match="^--log-timers-to-tensorboard needs "
                                          "--tensorboard-dir"):
        parse("--timing-log-level", "1", "--log-timers-to-tensorboard")


def test_megatron_logging_flags_choose_what_tensorboard_gets(tmp_path):
    default = parse("--tensorboard-dir", str(tmp_path)).logging
    assert default.tensorboard == TensorboardScalars() and not default.params_norm
    assert default.tensorboard.log_interval is None  # with the log line
    flags = parse("--tensorboard-dir", str(tmp_path), "--tensorboard-log-interval", "5",
                  "--tensorboard-queue-size", "1", "--log-batch-size-to-tensorboard",
                  "--log-world-size-to-tensorboard", "--log-memory-to-tensorboard",
                  "--no-log-learning-rate-to-tensorboard", "--no-log-loss-scale-to-tensorboard",
                  "--log-params-norm").logging
    assert flags.tensorboard == TensorboardScalars(
        log_interval=5, queue_size=1, learning_rate=False, loss_scale=False, batch_size=True,
        world_size=True, memory=True)
    assert flags.params_norm
    assert parse("--log-params-norm").logging.params_norm  # the line and metrics.jsonl
    assert parse("--tensorboard-dir", str(tmp_path), "--log-optimizer-states-to-tensorboard",
                 "--optimizer", "adam8bit").logging.tensorboard.optimizer_states


@pytest.mark.parametrize("flags, message", [
    (["--tensorboard-queue-size", "1", "--log-batch-size-to-tensorboard"],
     "^--tensorboard-queue-size, --log-batch-size-to-tensorboard need --tensorboard-dir"),
    (["--no-log-loss-scale-to-tensorboard"],
     "^--no-log-loss-scale-to-tensorboard needs --tensorboard-dir"),
    (["--log-optimizer-states-to-tensorboard"],
     "^--log-optimizer-states-to-tensorboard needs --tensorboard-dir"),
    (["--tensorboard-dir", "tb", "--tensorboard-log-interval", "0"],
     "^--tensorboard-log-interval must be at least 1, got 0"),
    (["--tensorboard-dir", "tb", "--tensorboard-queue-size", "-1"],
     "^--tensorboard-queue-size must be at least 1, got -1"),
])
def test_bad_tensorboard_flags_are_one_error(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse(*flags)


def test_timing_log_option_chooses_how_the_timers_show_the_ranks():
    """Megatron-LM's choices and default; without the timers it does nothing, which a note
    says (Megatron-LM is silent: its level 0 has no timers to show)."""
    assert parse().logging.timing_log_option == "minmax" and parse().notes == ()
    for option in ("max", "minmax", "all"):
        timed = parse("--timing-log-level", "1", "--timing-log-option", option)
        assert timed.logging.timing_log_option == option and timed.notes == ()
    assert parse("--timing-log-option", "all").notes == (
        " note: --timing-log-option all does nothing without the timers: --timing-log-level 1 "
        "turns them on",)
    with pytest.raises(ConfigError, match=r"^argument --timing-log-option: invalid choice: "
                                          r"'sum' \(choose from 'max', 'minmax', 'all'\)"):
        parse("--timing-log-option", "sum")


def test_optimizer_states_of_an_optimizer_without_adams_moments_are_one_error(tmp_path):
    from tests.training.test_deepspeed import write_config
    config = write_config(tmp_path, train_micro_batch_size_per_gpu=4,
                          optimizer={"type": "SGD", "params": {"lr": 0.1}})
    with pytest.raises(ConfigError, match="^--log-optimizer-states-to-tensorboard writes "
                                          "Adam's moments .* optimizer 'SGD' keeps none"):
        parse("--deepspeed", "--deepspeed_config", str(config), "--tensorboard-dir",
              str(tmp_path), "--log-optimizer-states-to-tensorboard")
