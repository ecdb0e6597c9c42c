"""Learning-rate schedules at points computed by hand from the formulas of DeepSpeed's deepspeed/runtime/lr_schedules.py."""

import math
import re

import pytest
import torch

from zero import CheckpointError, ConfigError, DeepSpeedConfig, build_lr_scheduler
from zero.optim.lr_schedules import LRRangeTest, WarmupCosineLR, WarmupDecayLR, WarmupLR


def make_optimizer(lrs=(0.2,)):
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def lrs_at(schedule, iterations):
    """{it: lr of group 0} after stepping to each `it` (in increasing order)."""
    found = {}
    for it in range(max(iterations) + 1):
        schedule.step()
        if it in iterations:
            found[it] = schedule.optimizer.param_groups[0]["lr"]
    return found


def test_warmup_lr_log():
    optimizer = make_optimizer()
    schedule = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    assert optimizer.param_groups[0]["lr"] == 0.0  # the constructor writes the start value
    got = lrs_at(schedule, [0, 1, 4, 9, 10, 50])
    expected = {0: 0.0, 1: 0.1 * math.log(2) / math.log(10), 4: 0.1 * math.log(5) / math.log(10),
                9: 0.1, 10: 0.1, 50: 0.1}
    assert got == pytest.approx(expected, rel=1e-12)


def test_warmup_lr_linear_and_floor_of_two_steps():
    schedule = WarmupLR(make_optimizer(), warmup_min_lr=0.01, warmup_max_lr=0.11,
                        warmup_num_steps=4, warmup_type="linear")
    assert lrs_at(schedule, [0, 1, 3, 4, 8]) == pytest.approx(
        {0: 0.01, 1: 0.035, 3: 0.085, 4: 0.11, 8: 0.11})
    floored = WarmupLR(make_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0,
                       warmup_num_steps=0, warmup_type="linear")
    assert floored.warmup_num_steps == 2
    assert lrs_at(floored, [0, 1, 2]) == pytest.approx({0: 0.0, 1: 0.5, 2: 1.0})


def test_warmup_decay_lr():
    # N = 4 (linear), T = 10: after warmup gamma = (10 - it) / 6
    schedule = WarmupDecayLR(make_optimizer(), total_num_steps=10, warmup_min_lr=0.0,
                             warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    assert lrs_at(schedule, [2, 4, 7, 10, 12]) == pytest.approx(
        {2: 0.05, 4: 0.1, 7: 0.05, 10: 0.0, 12: 0.0})


def test_warmup_cosine_lr():
    # base lr 0.2, N = 4, T = 12, warmup ratio 0.1 -> 1 (linear), then cosine to 0.05
    optimizer = make_optimizer([0.2])
    schedule = WarmupCosineLR(optimizer, total_num_steps=12, warmup_min_ratio=0.1,
                              warmup_num_steps=4, cos_min_ratio=0.05, warmup_type="linear")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02)

    def after_warmup(s):  # s = it - N + 1 of T - N = 8 decay steps
        return 0.2 * (0.05 + 0.95 * (1 + math.cos(math.pi * s / 8)) / 2)

    got = lrs_at(schedule, [0, 2, 4, 7, 11, 20])
    expected = {0: 0.02, 2: 0.2 * 0.55, 4: after_warmup(1), 7: 0.2 * 0.525, 11: 0.01, 20: 0.01}
    assert got == pytest.approx(expected, rel=1e-12)
    assert after_warmup(1) == pytest.approx(0.2 * 0.963843, rel=1e-6)


def test_warmup_cosine_log_warmup_and_per_group_base_lrs():
    schedule = WarmupCosineLR(make_optimizer([0.2, 0.4]), total_num_steps=12,
                              warmup_num_steps=4, warmup_min_ratio=0.1)
    schedule.step()
    schedule.step()  # it = 1: gamma = log 2 / log 4 = 0.5 -> ratio 0.55
    assert schedule.get_last_lr() == pytest.approx([0.11, 0.22])


def test_lr_range_test():
    schedule = LRRangeTest(make_optimizer(), lr_range_test_min_lr=0.01,
                           lr_range_test_step_size=4, lr_range_test_step_rate=2.0)
    assert schedule.get_last_lr() == [0.01]
    assert lrs_at(schedule, [0, 3, 7]) == pytest.approx({0: 0.015, 3: 0.03, 7: 0.05})
    stairs = LRRangeTest(make_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                         lr_range_test_step_rate=2.0, lr_range_test_staircase=True)
    assert lrs_at(stairs, [2, 3]) == pytest.approx({2: 0.01, 3: 0.03})


def test_per_group_lists():
    optimizer = make_optimizer([1.0, 1.0])
    schedule = WarmupLR(optimizer, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.21],
                        warmup_num_steps=2, warmup_type="linear")
    schedule.step()
    schedule.step()  # it = 1: half way
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.11])
    with pytest.raises(ConfigError, match="2 values but the optimizer has 1 param groups"):
        WarmupLR(make_optimizer(), warmup_min_lr=[0.0, 0.1])


def test_state_round_trip_and_explicit_step():
    first = WarmupDecayLR(make_optimizer(), total_num_steps=20, warmup_num_steps=5)
    for _ in range(7):
        first.step()
    state = first.state_dict()
    assert state == {"last_batch_iteration": 6}
    second = WarmupDecayLR(make_optimizer(), total_num_steps=20, warmup_num_steps=5)
    second.load_state_dict(state)
    assert second.get_last_lr() == first.get_last_lr()
    assert second.optimizer.param_groups[0]["lr"] == first.get_last_lr()[0]
    first.step()
    second.step()
    assert second.get_last_lr() == first.get_last_lr()
    second.step(last_batch_iteration=3)
    assert second.last_batch_iteration == 3
    megatrons = {"start_lr": 1e-3, "num_iters": 4, "warmup_iter": 0}  # AnnealingLR's state
    with pytest.raises(CheckpointError, match=re.escape(
            "the checkpoint's lr scheduler state was saved by another scheduler (its keys: "
            "num_iters, start_lr, warmup_iter), not by WarmupDecayLR, which keeps "
            "'last_batch_iteration': resume with the schedule it was saved with, or without its "
            "state (load_lr_scheduler_states=False; pretrain_gpt2.py: --no-load-optim)")):
        second.load_state_dict(megatrons)


@pytest.mark.parametrize("build", [
    lambda o: WarmupLR(o, warmup_type="cosine"),
    lambda o: WarmupLR(o, warmup_num_steps=2.5),
    lambda o: WarmupLR(o, warmup_max_lr="0.1"),
    lambda o: WarmupDecayLR(o, total_num_steps=5, warmup_num_steps=10),
    lambda o: WarmupCosineLR(o, total_num_steps=2, warmup_num_steps=2),
    lambda o: WarmupCosineLR(o, total_num_steps=0),
    lambda o: LRRangeTest(o, lr_range_test_step_size=0),
    lambda o: LRRangeTest(o, lr_range_test_staircase="yes"),
])
def test_bad_arguments(build):
    with pytest.raises(ConfigError):
        build(make_optimizer())


def config_with(scheduler):
    return DeepSpeedConfig({"train_batch_size": 1, "scheduler": scheduler})


def test_build_from_config():
    assert build_lr_scheduler(DeepSpeedConfig({"train_batch_size": 1}), make_optimizer()) is None
    schedule = build_lr_scheduler(config_with({"type": "warmupdecaylr", "params": {
        "total_num_steps": 10, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
        "warmup_type": "linear", "warmup_min_lr": "auto"}}), make_optimizer())
    assert isinstance(schedule, WarmupDecayLR)
    assert lrs_at(schedule, [7]) == pytest.approx({7: 0.05})


def test_torch_scheduler_fallback():
    optimizer = make_optimizer([0.8])
    schedule = build_lr_scheduler(config_with({"type": "StepLR", "params": {
        "step_size": 2, "gamma": 0.5}}), optimizer)
    assert isinstance(schedule, torch.optim.lr_scheduler.StepLR)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    assert schedule.get_last_lr() == pytest.approx([0.2])


@pytest.mark.parametrize("scheduler, piece", [
    ({"type": "OneCycle", "params": {}}, "not implemented"),
    ({"type": "WarmupDecay", "params": {}}, "did you mean \"WarmupDecayLR\""),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}, "total_num_steps"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}, "not \"auto\""),
    ({"type": "WarmupLR", "params": {"warmup_steps": 5}}, "did you mean 'warmup_num_steps'"),
    ({"type": "StepLR", "params": {}}, "step_size"),
    ({"type": "StepLR", "params": {"step_size": "x"}}, "fail when the StepLR schedule steps"),
    ({"type": "StepLR", "params": {"step_size": 1, "foo": 1}}, "unknown StepLR parameter"),
    ({"type": "ReduceLROnPlateau", "params": {}}, "unknown scheduler type"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 20}},
     "less than warmup_num_steps"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2,
                                           "cos_min_ratio": 2.0}},
     "'cos_min_ratio' is a fraction of the peak learning rate, from 0 to 1; got 2.0"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2,
                                           "warmup_min_ratio": -0.5}},
     "'warmup_min_ratio' is a fraction of the peak learning rate, from 0 to 1; got -0.5"),
])
def test_bad_scheduler_sections(scheduler, piece):
    with pytest.raises(ConfigError) as info:
        config_with(scheduler)
    assert piece in str(info.value)


def test_per_group_list_checked_against_the_real_optimizer():
    config = config_with({"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}})
    build_lr_scheduler(config, make_optimizer([1.0, 1.0]))
    with pytest.raises(ConfigError, match="param groups"):
        build_lr_scheduler(config, make_optimizer([1.0]))
