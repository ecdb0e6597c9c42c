"""zero.ops.CPUAdam against torch.optim.AdamW / Adam and the uncorrected Adam formula."""

import pytest
import torch

from zero.ops import CPUAdam, adam_update
from zero.optim.quantized_adam import Adam4bit, Adam8bit

N, STEPS, LR, WD = 1037, 10, 1e-2, 0.1  # odd size: exercises the kernel's remainder path


def _grads():
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(N, generator=generator) for _ in range(STEPS)]


def _train(optimizer_factory, grads, dtype=torch.float32):
    param = torch.linspace(-1, 1, N, dtype=dtype).requires_grad_()
    optimizer = optimizer_factory([param])
    for grad in grads:
        param.grad = grad.to(dtype)
        optimizer.step()
    return param.detach().float(), optimizer


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_adamw_and_adam(adamw_mode):
    grads = _grads()
    ours, _ = _train(lambda p: CPUAdam(p, lr=LR, weight_decay=WD, adamw_mode=adamw_mode), grads)
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam  # Adam: L2 decay
    theirs, _ = _train(lambda p: torch_class(p, lr=LR, weight_decay=WD, foreach=False), grads)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_without_bias_correction_matches_the_formula(adamw_mode):
    grads = _grads()
    ours, _ = _train(lambda p: CPUAdam(p, lr=LR, weight_decay=WD, adamw_mode=adamw_mode,
                                       bias_correction=False), grads)
    param = torch.linspace(-1, 1, N, dtype=torch.float64)
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    for grad in grads:
        grad = grad.double()
        if adamw_mode:
            param *= 1 - LR * WD
        else:
            grad = grad + WD * param
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        param -= LR * m / (v.sqrt() + 1e-8)
    torch.testing.assert_close(ours, param.float(), rtol=1e-5, atol=1e-6)


def test_state_has_torch_adamw_layout_and_round_trips():
    grads = _grads()
    ours, optimizer = _train(lambda p: CPUAdam(p, lr=LR), grads[:5])
    state = optimizer.state_dict()
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(state["state"][0]["step"]) == 5
    resumed = ours.clone().requires_grad_()
    again = CPUAdam([resumed], lr=LR)
    again.load_state_dict(state)
    straight, _ = _train(lambda p: CPUAdam(p, lr=LR), grads)
    for grad in grads[5:]:
        resumed.grad = grad
        again.step()
    assert torch.equal(resumed.detach(), straight)


def test_tiles_with_copy_equal_one_call():
    generator = torch.Generator().manual_seed(3)
    p, g = torch.randn(5000, generator=generator), torch.randn(5000, generator=generator)
    copies = torch.zeros(5000, dtype=torch.bfloat16)
    results = []
    for on_tile in (None, lambda lo, hi, t: copies[lo:hi].copy_(t)):
        param, m, v = p.clone(), torch.zeros(5000), torch.zeros(5000)
        adam_update(param, g, m, v, torch.tensor(1.0), lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=WD, on_tile=on_tile, tile_numel=1024)
        results.append(param)
    assert torch.equal(results[0], results[1])
    assert torch.equal(copies, results[1].bfloat16())


def test_bf16_params_update_in_fp32():
    grads = _grads()
    ours, optimizer = _train(lambda p: CPUAdam(p, lr=LR), grads, dtype=torch.bfloat16)
    reference, _ = _train(lambda p: torch.optim.AdamW(p, lr=LR), grads)
    assert optimizer.state_for(optimizer.param_groups[0]["params"][0])["exp_avg"].dtype == \
        torch.float32
    torch.testing.assert_close(ours, reference, rtol=0, atol=0.02)  # bf16 rounding per step


def test_from_torch_keeps_the_param_group_dicts():
    param = torch.zeros(3, requires_grad=True)
    adamw = torch.optim.AdamW([param], lr=0.5, betas=(0.8, 0.9), weight_decay=0.2)
    converted = CPUAdam.from_torch(adamw)
    assert converted.param_groups[0] is adamw.param_groups[0]
    assert converted.param_groups[0]["adamw_mode"] is True
    assert CPUAdam.from_torch(torch.optim.Adam([param]))
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam.from_torch(torch.optim.Adam([torch.zeros(1, requires_grad=True)], amsgrad=True))


def test_bad_arguments_are_refused():
    param = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam(param, amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        CPUAdam(param, betas=(0.9, 1.0))


@pytest.mark.parametrize("optimizer", [CPUAdam, Adam8bit, Adam4bit])
@pytest.mark.parametrize("argument, value, message", [
    ("lr", -1, "invalid lr -1 (must be a number >= 0)"),
    ("lr", "1e-3", "invalid lr '1e-3' (must be a number >= 0)"),
    ("eps", float("nan"), "invalid eps nan (must be a number >= 0)"),
    ("weight_decay", -0.1, "invalid weight_decay -0.1 (must be a number >= 0)"),
    ("betas", (0.9, 1.5), "invalid betas (0.9, 1.5) (two numbers in [0, 1))"),
    ("betas", (0.9, 0.99, 0.999), "invalid betas (0.9, 0.99, 0.999) (two numbers in [0, 1))"),
])
def test_each_adam_names_the_hyperparameter_it_refuses(optimizer, argument, value, message):
    with pytest.raises(ValueError) as info:
        optimizer([torch.zeros(2, requires_grad=True)], **{argument: value})
    assert str(info.value) == f"{optimizer.__name__}: {message}"


def test_from_torch_refuses_other_optimizers():
    param = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(TypeError, match="Adam or AdamW"):
        CPUAdam.from_torch(torch.optim.SGD(param, lr=0.1))
