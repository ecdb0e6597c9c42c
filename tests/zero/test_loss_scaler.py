"""Loss scaler behaviour against sequences worked out by hand from the rules of DeepSpeed's deepspeed/runtime/fp16/loss_scaler.py."""

import io

import pytest
import torch

from zero import ConfigError, DeepSpeedConfig, ZeroError
from zero.errors import CheckpointError
from zero.optim.loss_scaler import (DynamicLossScaler, StaticLossScaler, build_loss_scaler,
                              has_inf_or_nan, inf_or_nan_flag)


def run(scaler, overflows):
    """(scale, hysteresis) after each update_scale."""
    trace = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        trace.append((scaler.cur_scale, scaler.cur_hysteresis))
    return trace


def test_overflow_with_hysteresis_then_growth_after_window():
    # hysteresis 2, window 3. Overflows at iterations 0, 1, 7, 9.
    # it0: hysteresis 2 -> 1, scale kept.   it1: hysteresis used up -> 16/2 = 8.
    # it2..: stable = it - 1 - 1 = 0, 1, 2, 3 -> grows at it5 (stable 3 % 3 == 0), refills 2.
    # it7: hysteresis 2 -> 1.   it8: stable 0.   it9: halves to 8.
    scaler = DynamicLossScaler(init_scale=16, scale_window=3, delayed_shift=2)
    overflows = [True, True, False, False, False, False, False, True, False, True]
    expected = [(16, 1), (8, 1), (8, 1), (8, 1), (8, 1), (16, 2), (16, 2), (16, 1), (16, 1),
                (8, 1)]
    assert run(scaler, overflows) == expected
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (10, 9)


def test_growth_from_the_start_needs_window_clean_steps_then_one_more():
    # stable = cur_iter - (-1) - 1 = cur_iter: doubles at cur_iter 2 and 4 with window 2
    scaler = DynamicLossScaler(init_scale=4, scale_window=2)
    assert [s for s, _ in run(scaler, [False] * 5)] == [4, 4, 8, 8, 16]


def test_no_hysteresis_halves_on_every_overflow_and_stops_at_min():
    scaler = DynamicLossScaler(init_scale=8, min_scale=3, delayed_shift=1)
    assert [s for s, _ in run(scaler, [True, True, True, True])] == [4, 3, 3, 3]
    assert scaler.loss_scale == 3


def test_raise_at_min_scale():
    scaler = DynamicLossScaler(init_scale=2, min_scale=1, raise_error_at_min_scale=True)
    scaler.update_scale(True)
    assert scaler.cur_scale == 1
    with pytest.raises(ZeroError, match="already at its minimum"):
        scaler.update_scale(True)


def test_hysteresis_is_only_used_up_by_overflows_without_refill():
    # without consecutive_hysteresis, overflow / clean / overflow halves at the second one
    plain = DynamicLossScaler(init_scale=64, scale_window=100, delayed_shift=2)
    assert run(plain, [True, False, True]) == [(64, 1), (64, 1), (32, 1)]
    # with it, every clean step refills, so isolated overflows never halve
    refilled = DynamicLossScaler(init_scale=64, scale_window=100, delayed_shift=2,
                                 consecutive_hysteresis=True)
    assert run(refilled, [True, False, True, False, True]) == \
        [(64, 1), (64, 2), (64, 1), (64, 2), (64, 1)]
    assert run(refilled, [True]) == [(32, 1)]  # two in a row do halve


def test_only_the_first_step_overflow_can_be_retried():
    # hysteresis 2: the first retry only spends hysteresis, then each halves the scale
    scaler = DynamicLossScaler(init_scale=16, min_scale=2, delayed_shift=2)
    assert scaler.searching_initial_scale
    scales = []
    while True:
        scaler.update_scale(True)
        if not scaler.forget_overflow_step():
            break
        assert scaler.searching_initial_scale and scaler.cur_iter == 0
        scales.append(scaler.cur_scale)
    assert scales == [16, 8, 4, 2]  # stops at min_scale with hysteresis used up
    assert scaler.cur_iter == 1 and not scaler.searching_initial_scale
    fresh = DynamicLossScaler(init_scale=16, min_scale=2)
    fresh.update_scale(True)
    assert fresh.forget_overflow_step()
    fresh.update_scale(False)  # the retry was clean: no more searching, later overflows skip
    assert fresh.cur_scale == 8 and fresh.cur_iter == 1 and not fresh.searching_initial_scale
    fresh.update_scale(True)
    assert not fresh.forget_overflow_step() and fresh.cur_iter == 2
    assert not StaticLossScaler(8).searching_initial_scale


def test_custom_scale_factor():
    scaler = DynamicLossScaler(init_scale=81, scale_factor=3.0, scale_window=1)
    assert [s for s, _ in run(scaler, [True, False, False])] == [27, 27, 81]


def test_state_round_trip_continues_identically():
    flags = [True, False, False, True, True, False, False, False, False, True, False, False]
    original = DynamicLossScaler(init_scale=2 ** 10, scale_window=2, delayed_shift=2)
    run(original, flags[:5])
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # plain numbers only
    resumed = DynamicLossScaler(init_scale=2 ** 10, scale_window=2, delayed_shift=2)
    resumed.load_state_dict(state)
    assert run(resumed, flags[5:]) == run(original, flags[5:])


def test_static_scaler():
    scaler = StaticLossScaler(128)
    scaler.update_scale(True)
    assert scaler.cur_scale == scaler.loss_scale == 128.0 and not scaler.dynamic
    assert scaler.scale_loss(torch.tensor(2.0)).item() == 256.0
    scaler.load_state_dict({"dynamic": True, "cur_scale": 4.0})  # the config's scale wins
    assert scaler.cur_scale == 128.0
    for bad in (0, -1, float("inf"), True, "8"):
        with pytest.raises(ConfigError):
            StaticLossScaler(bad)


def test_bad_dynamic_arguments_and_bad_state():
    for kwargs in ({"scale_window": 0}, {"min_scale": 0}, {"delayed_shift": 0},
                   {"scale_factor": 1.0}, {"init_scale": -1}):
        with pytest.raises(ConfigError):
            DynamicLossScaler(**kwargs)
    with pytest.raises(CheckpointError):
        DynamicLossScaler().load_state_dict({"dynamic": True, "cur_scale": 2.0})


def config_with_fp16(**fp16):
    return DeepSpeedConfig({"train_batch_size": 1, "fp16": fp16})


def test_build_loss_scaler_from_config():
    assert build_loss_scaler(config_with_fp16(enabled=False)) is None
    assert build_loss_scaler(DeepSpeedConfig({"train_batch_size": 1,
                                              "bf16": {"enabled": True}})) is None
    static = build_loss_scaler(config_with_fp16(enabled=True, loss_scale=4096))
    assert isinstance(static, StaticLossScaler) and static.cur_scale == 4096
    dynamic = build_loss_scaler(config_with_fp16(enabled=True, initial_scale_power=12,
                                                 loss_scale_window=50, hysteresis=3,
                                                 min_loss_scale=0.5,
                                                 consecutive_hysteresis=True))
    assert dynamic.dynamic and dynamic.cur_scale == 4096
    assert (dynamic.scale_window, dynamic.delayed_shift, dynamic.min_scale) == (50, 3, 0.5)
    assert dynamic.consecutive_hysteresis and dynamic.raise_error_at_min_scale
    default = build_loss_scaler(config_with_fp16(enabled=True))
    assert (default.cur_scale, default.delayed_shift, default.scale_window) == (2 ** 16, 2, 1000)


def test_inf_or_nan_detection():
    finite = [torch.ones(3), None, torch.zeros(2, 2, dtype=torch.float16)]
    assert not has_inf_or_nan(finite) and not has_inf_or_nan([])
    assert has_inf_or_nan(finite + [torch.tensor([1.0, float("inf")])])
    assert has_inf_or_nan([torch.tensor([float("nan")], dtype=torch.bfloat16)])
    assert has_inf_or_nan(torch.tensor([-float("inf")]))
    flag = inf_or_nan_flag([torch.ones(1), torch.tensor([float("nan")])])
    assert flag.dtype == torch.float32 and flag.item() == 1.0
    # an fp16 overflow of a large finite value is what the check exists for
    assert has_inf_or_nan([torch.tensor([60000.0], dtype=torch.float16) * 2])
