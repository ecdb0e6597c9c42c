import io

import pytest
import torch

from megatron.errors import ConfigError
from megatron.loss_scaler import ConstantLossScaler, DynamicLossScaler


def _run(scaler, overflows):
    """Apply a sequence of found_inf flags; return the scale after each update."""
    scales = []
    for found_inf in overflows:
        scaler.update(found_inf)
        scales.append(scaler.scale)
    return scales


def test_hysteresis_two_halves_on_second_overflow():
    scaler = DynamicLossScaler(initial_scale=1024.0, hysteresis=2, growth_interval=100)
    assert _run(scaler, [True]) == [1024.0]           # hysteresis used up, scale kept
    assert _run(scaler, [True]) == [512.0]            # second overflow backs off
    assert _run(scaler, [True, True]) == [256.0, 128.0]  # until it grows again, every one does


def test_clean_steps_between_overflows_do_not_restore_hysteresis():
    scaler = DynamicLossScaler(initial_scale=1024.0, hysteresis=2, growth_interval=10)
    assert _run(scaler, [True, False, False, True]) == [1024.0, 1024.0, 1024.0, 512.0]


def test_growth_after_window_of_clean_steps_resets_hysteresis():
    scaler = DynamicLossScaler(initial_scale=8.0, hysteresis=2, growth_interval=3)
    assert _run(scaler, [True, True]) == [8.0, 4.0]
    assert _run(scaler, [False, False, False]) == [4.0, 4.0, 8.0]  # grows on the 3rd clean step
    assert _run(scaler, [False, False, False]) == [8.0, 8.0, 16.0]
    assert _run(scaler, [True]) == [16.0]            # hysteresis is back to 2
    assert _run(scaler, [False, False, True]) == [16.0, 16.0, 8.0]  # window restarted at overflow


def test_hysteresis_one_backs_off_immediately_and_min_scale_floors():
    scaler = DynamicLossScaler(initial_scale=4.0, min_scale=1.5, hysteresis=1, growth_interval=5)
    assert _run(scaler, [True, True, True]) == [2.0, 1.5, 1.5]


def test_custom_factors():
    scaler = DynamicLossScaler(initial_scale=100.0, growth_factor=4.0, backoff_factor=0.25,
                               hysteresis=1, growth_interval=2)
    assert _run(scaler, [True, False, False]) == [25.0, 25.0, 100.0]


def test_state_round_trip_continues_identically():
    pattern = [False, True, False, False, True, True, False, False, False, False, True, False]
    reference = DynamicLossScaler(initial_scale=2.0 ** 10, hysteresis=2, growth_interval=3)
    expected = _run(reference, pattern * 2)

    first = DynamicLossScaler(initial_scale=2.0 ** 10, hysteresis=2, growth_interval=3)
    head = _run(first, pattern + pattern[:5])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = DynamicLossScaler(initial_scale=2.0 ** 10, hysteresis=2, growth_interval=3)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert head + _run(resumed, pattern[5:]) == expected


def test_constant_scaler_never_changes():
    scaler = ConstantLossScaler(128.0)
    assert _run(scaler, [True, False, True]) == [128.0] * 3
    scaler.load_state_dict({"scale": 7.0})
    assert scaler.scale == 128.0


def test_dynamic_loads_a_static_scalers_state():
    scaler = DynamicLossScaler(initial_scale=2.0 ** 16, hysteresis=2)
    scaler.load_state_dict(ConstantLossScaler(64.0).state_dict())
    assert _run(scaler, [True, True]) == [64.0, 32.0]


@pytest.mark.parametrize("make", [
    lambda: ConstantLossScaler(0.0),
    lambda: DynamicLossScaler(min_scale=0.0),
    lambda: DynamicLossScaler(growth_interval=0),
    lambda: DynamicLossScaler(hysteresis=0),
])
def test_bad_settings_raise_config_error(make):
    with pytest.raises(ConfigError):
        make()
