"""The optimizer step of ZeRO stage 0 (the trainer's stack without --deepspeed) against AdamW
written out in float64: fp32, bf16 and fp16 (fp32 master weights), clipping, skipped steps
on inf/nan, loss-scale back-off."""

import math

import pytest
import torch

import zero
from megatron.training.param_groups import get_param_groups

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


class FusedLayerNorm(torch.nn.Module):  # a custom LayerNorm, recognised by its class name
    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.shift = torch.nn.Parameter(torch.zeros(width))


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(5, 4)
        self.dense = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.custom_norm = FusedLayerNorm(3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.tied = self.embedding  # the same weight reached twice

    def forward(self, tokens):
        x = self.custom_norm.weight * self.norm(self.dense(self.embedding(tokens))) \
            + self.custom_norm.shift
        return self.head(x) @ self.tied.weight.t()  # [n, 5]


NO_DECAY = {"dense.bias", "norm.weight", "norm.bias", "custom_norm.weight", "custom_norm.shift"}


def _engine(model, clip=0.0, precision=None, **fp16):
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": clip}
    if precision is not None:
        config[precision] = {"enabled": True, **fp16}
    optimizer = torch.optim.AdamW(get_param_groups(model, WD), lr=LR, betas=BETAS, eps=EPS)
    engine, *_ = zero.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return TinyModel().to(dtype)


def _set_grads(model, step):
    """Deterministic gradients that differ per step and per parameter, set by hand as a user
    would (the step adopts them into the engine's gradient buffers)."""
    grads = {}
    for index, (name, param) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(1000 * step + index)
        param.grad = torch.randn(param.shape, generator=g).to(param.dtype)
        grads[name] = param.grad.double()
    return grads


class ReferenceAdamW:
    """AdamW written out in float64, the independent reference for every step test."""

    def __init__(self, params, no_decay):
        self.params = {n: p.detach().double().clone() for n, p in params.items()}
        self.no_decay = no_decay
        self.m = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.v = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.t = 0

    def step(self, grads, clip=0.0):
        total = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        coef = clip / (total + 1e-6) if clip > 0 and clip / (total + 1e-6) < 1 else 1.0
        self.t += 1
        b1, b2 = BETAS
        for name, p in self.params.items():
            g = grads[name] * coef
            self.m[name] = b1 * self.m[name] + (1 - b1) * g
            self.v[name] = b2 * self.v[name] + (1 - b2) * g * g
            m_hat = self.m[name] / (1 - b1 ** self.t)
            v_hat = self.v[name] / (1 - b2 ** self.t)
            wd = 0.0 if name in self.no_decay else WD
            p.mul_(1 - LR * wd).sub_(LR * m_hat / (v_hat.sqrt() + EPS))
        return total


def _masters(engine):
    """{name: fp32 master} of each parameter."""
    names = {p: n for n, p in engine.module.named_parameters()}
    return {names[p]: group.master[offset:offset + p.numel()].view_as(p)
            for group in engine.optimizer.groups
            for p, offset in zip(group.params, group.layout.offsets)}


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_fp32_step_matches_reference_adamw(clip):
    engine = _engine(_model(), clip)
    reference = ReferenceAdamW(dict(engine.module.named_parameters()), NO_DECAY)
    for step in range(3):
        expected_norm = reference.step(_set_grads(engine.module, step), clip)
        engine.step()
        assert engine.skipped_steps == 0
        assert engine.get_global_grad_norm() == pytest.approx(expected_norm, rel=1e-5)
    for name, param in engine.module.named_parameters():
        torch.testing.assert_close(param.double(), reference.params[name], atol=1e-6, rtol=0)
    assert all(p.grad is None for p in engine.module.parameters())  # released by the step


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_nan_gradient_skips_the_step(precision):
    engine = _engine(_model(), 1.0, precision)
    before = [p.detach().clone() for p in engine.module.parameters()]
    _set_grads(engine.module, 0)
    engine.module.dense.weight.grad[0, 0] = float("nan")
    engine.step()
    assert engine.skipped_steps == 1 and engine.get_global_grad_norm() != \
        engine.get_global_grad_norm()  # nan
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert engine.optimizer.optimizer.state_dict()["state"] == {}  # AdamW never ran


def test_bf16_masters_hold_the_precision_model_params_are_their_cast():
    engine = _engine(_model(), precision="bf16")
    assert engine.loss_scale == 1.0
    reference = ReferenceAdamW(dict(engine.module.named_parameters()), NO_DECAY)
    for step in range(3):
        reference.step(_set_grads(engine.module, step))  # the bf16 values the engine sees
        engine.step()
    masters = _masters(engine)
    for name, param in engine.module.named_parameters():
        assert masters[name].dtype == torch.float32 and param.dtype == torch.bfloat16
        assert torch.equal(param, masters[name].to(torch.bfloat16))
        torch.testing.assert_close(masters[name].double(), reference.params[name], atol=1e-6,
                                   rtol=0)


def test_bf16_masters_accumulate_updates_too_small_for_bf16():
    model = torch.nn.Linear(4, 4, bias=False)
    torch.nn.init.ones_(model.weight)
    engine, *_ = zero.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0),
        config={"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}})
    for _ in range(50):  # each update (1e-4) is below bf16's spacing at 1.0 (2**-7)
        model.weight.grad = torch.ones_like(model.weight)
        engine.step()
    master = _masters(engine)["weight"]
    assert master[0, 0].item() == pytest.approx(1 - 50e-4, abs=1e-6)
    assert torch.equal(model.weight, master.to(torch.bfloat16))


def test_fp16_scaled_backward_unscales_and_matches_reference():
    engine = _engine(_model(), precision="fp16", initial_scale_power=6)  # scale 64
    model = engine.module
    reference = ReferenceAdamW(dict(model.named_parameters()), NO_DECAY)
    engine.backward(engine(torch.tensor([0, 3, 1, 4])).float().square().mean())
    grads = {n: p.grad.double() / 64.0 for n, p in model.named_parameters()}
    reference.step(grads)
    engine.step()
    assert engine.skipped_steps == 0
    expected_norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    assert engine.get_global_grad_norm() == pytest.approx(expected_norm, rel=1e-4)
    masters = _masters(engine)
    for name, param in model.named_parameters():
        assert torch.equal(param, masters[name].to(torch.float16))
        torch.testing.assert_close(param.double(), reference.params[name], atol=2e-3, rtol=0)


def test_fp16_inf_gradient_skips_and_backs_off_the_scale():
    engine = _engine(_model(), 1.0, "fp16", initial_scale_power=16, hysteresis=2)
    model = engine.module
    before = [p.detach().clone() for p in model.parameters()]
    masters_before = {n: m.clone() for n, m in _masters(engine).items()}
    for expected_scale in (2.0 ** 16, 2.0 ** 15):  # hysteresis 2: the second one halves
        _set_grads(model, 0)
        model.head.weight.grad[1, 2] = float("inf")
        engine.step()
        assert engine.loss_scale == expected_scale
    assert engine.skipped_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(masters_before[n], m) for n, m in _masters(engine).items())
    _set_grads(model, 1)
    engine.step()
    assert engine.skipped_steps == 2


def test_clipping_matches_torch_clip_grad_norm():
    engine = _engine(_model(), clip=1.0)
    copy = _model()
    grads = _set_grads(engine.module, 0)
    for name, param in copy.named_parameters():
        param.grad = grads[name].float() * 3
        dict(engine.module.named_parameters())[name].grad.mul_(3)
    theirs = torch.nn.utils.clip_grad_norm_(copy.parameters(), 1.0).item()
    engine.step()
    assert engine.get_global_grad_norm() == pytest.approx(theirs, rel=1e-6)


def test_param_groups_split_biases_and_layernorms():
    model = _model()
    groups = get_param_groups(model, weight_decay=0.3)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [g["weight_decay"] for g in groups] == [0.3, 0.0]
    assert {names[id(p)] for p in groups[0]["params"]} == {"embedding.weight", "dense.weight",
                                                            "head.weight"}
    assert {names[id(p)] for p in groups[1]["params"]} == NO_DECAY
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_param_groups_drop_empty_group():
    groups = get_param_groups(torch.nn.Linear(3, 3, bias=False), weight_decay=0.1)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
