import io
import math

import pytest
import torch

from megatron.errors import CheckpointError
from megatron.loss_scaler import DynamicLossScaler
from megatron.training.optimizer import build_optimizer, clip_grad_norm_fp32, get_param_groups

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


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return TinyModel().to(dtype)


def _build(model, dtype, clip_grad=0.0, **kwargs):
    return build_optimizer(model, lr=LR, weight_decay=WD, adam_beta1=BETAS[0],
                           adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=clip_grad,
                           params_dtype=dtype, **kwargs)


def _set_grads(model, step, dtype=None):
    """Deterministic gradients that differ per step and per parameter."""
    grads = {}
    for index, (name, param) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(1000 * step + index)
        grad = torch.randn(param.shape, generator=g)
        param.grad = grad.to(dtype or param.dtype)
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


NO_DECAY = {"dense.bias", "norm.weight", "norm.bias", "custom_norm.weight", "custom_norm.shift"}


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


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_fp32_step_matches_reference_adamw(clip):
    model = _model()
    optimizer = _build(model, torch.float32, clip_grad=clip)
    reference = ReferenceAdamW(dict(model.named_parameters()), NO_DECAY)
    for step in range(3):
        grads = _set_grads(model, step)
        expected_norm = reference.step(grads, clip)
        updated, grad_norm, _ = optimizer.step()
        assert updated and grad_norm == pytest.approx(expected_norm, rel=1e-5)
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.double(), reference.params[name], atol=1e-6, rtol=0)
    assert all(p.grad is None for p in model.parameters())


def test_fp32_has_no_masters_and_unit_loss_scale():
    model = _model()
    optimizer = _build(model, torch.float32)
    inner = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert inner == {id(p) for p in model.parameters()}
    loss = torch.tensor(3.0)
    assert optimizer.loss_scale == 1.0 and optimizer.scale_loss(loss) is loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_gradient_skips_step_without_scaler(dtype):
    model = _model(dtype)
    optimizer = _build(model, dtype, clip_grad=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    _set_grads(model, 0)
    model.dense.weight.grad[0, 0] = float("nan")
    assert optimizer.step() == (False, None, None)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert optimizer.optimizer.state_dict()["state"] == {}  # AdamW never ran


def test_bf16_masters_hold_the_precision_model_params_are_their_cast():
    model = _model(torch.bfloat16)
    optimizer = _build(model, torch.bfloat16)
    assert optimizer.loss_scale == 1.0
    reference = ReferenceAdamW(dict(model.named_parameters()), NO_DECAY)
    for step in range(3):
        grads = _set_grads(model, step)  # bf16 grads; the reference sees the same values
        reference.step(grads)
        assert optimizer.step()[0]
    masters = {id(p): m for ps, ms in zip(optimizer.model_groups, optimizer.master_groups)
               for p, m in zip(ps, ms)}
    for name, param in model.named_parameters():
        master = masters[id(param)]
        assert master.dtype == torch.float32 and param.dtype == torch.bfloat16
        assert torch.equal(param, master.to(torch.bfloat16))
        torch.testing.assert_close(master.double(), reference.params[name], atol=1e-6, rtol=0)


def test_bf16_masters_accumulate_updates_too_small_for_bf16():
    model = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    torch.nn.init.ones_(model.weight)
    optimizer = build_optimizer(model, lr=1e-4, weight_decay=0.0, adam_beta1=0.9,
                                adam_beta2=0.999, adam_eps=1e-8, clip_grad=0.0,
                                params_dtype=torch.bfloat16)
    for _ in range(50):  # each update (1e-4) is below bf16's spacing at 1.0 (2**-7)
        model.weight.grad = torch.ones_like(model.weight)
        optimizer.step()
    master = optimizer.master_groups[0][0]
    assert master[0, 0].item() == pytest.approx(1 - 50e-4, abs=1e-6)
    assert torch.equal(model.weight, master.to(torch.bfloat16))


def test_fp16_scaled_backward_unscales_and_matches_reference():
    model = _model(torch.float16)
    optimizer = _build(model, torch.float16, loss_scaler=DynamicLossScaler(initial_scale=64.0))
    reference = ReferenceAdamW(dict(model.named_parameters()), NO_DECAY)
    tokens = torch.tensor([0, 3, 1, 4])
    loss = model(tokens).float().square().mean()
    optimizer.scale_loss(loss).backward()
    grads = {n: p.grad.double() / 64.0 for n, p in model.named_parameters()}
    reference.step(grads)
    updated, grad_norm, _ = optimizer.step()
    assert updated
    expected_norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    assert grad_norm == pytest.approx(expected_norm, rel=1e-4)
    for ps, ms in zip(optimizer.model_groups, optimizer.master_groups):
        for param, master in zip(ps, ms):
            assert torch.equal(param, master.to(torch.float16))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.double(), reference.params[name], atol=2e-3, rtol=0)


def test_fp16_inf_gradient_skips_and_backs_off_the_scale():
    model = _model(torch.float16)
    scaler = DynamicLossScaler(initial_scale=2.0 ** 16, hysteresis=2)
    optimizer = _build(model, torch.float16, clip_grad=1.0, loss_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    masters_before = [m.clone() for ms in optimizer.master_groups for m in ms]
    for expected_scale in (2.0 ** 16, 2.0 ** 15):
        _set_grads(model, 0)
        model.head.weight.grad[1, 2] = float("inf")
        assert optimizer.step() == (False, None, None)
        assert optimizer.loss_scale == expected_scale
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    masters_after = [m for ms in optimizer.master_groups for m in ms]
    assert all(torch.equal(a, b) for a, b in zip(masters_before, masters_after))
    _set_grads(model, 1)
    assert optimizer.step()[0]


def test_fp16_defaults_to_dynamic_scaling():
    optimizer = _build(_model(torch.float16), torch.float16)
    assert optimizer.loss_scale == 2.0 ** 32
    assert optimizer.scale_loss(torch.tensor(1.5)).item() == 1.5 * 2.0 ** 32


def test_grad_norm_fn_gets_fp32_masters_with_attributes_and_inf_when_not_clipping():
    model = _model(torch.bfloat16)
    model.dense.weight.tensor_model_parallel = True
    calls = []

    def fake_norm(params, max_norm):
        calls.append(([p.grad.dtype for p in params], max_norm,
                      [getattr(p, "tensor_model_parallel", False) for p in params]))
        return 1.25

    optimizer = _build(model, torch.bfloat16, clip_grad=0.0, grad_norm_fn=fake_norm)
    _set_grads(model, 0)
    assert optimizer.step() == (True, 1.25, None)
    dtypes, max_norm, tp_flags = calls[0]
    assert set(dtypes) == {torch.float32} and max_norm == math.inf
    assert sum(tp_flags) == 1


def test_default_clip_matches_torch_clip_grad_norm():
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    ours = clip_grad_norm_fp32(params, 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(copies, 1.0).item()
    assert ours == pytest.approx(theirs, rel=1e-6)
    for p, c in zip(params, copies):
        torch.testing.assert_close(p.grad, c.grad)
    assert clip_grad_norm_fp32(params, math.inf) == pytest.approx(1.0, rel=1e-5)


def _train(model, optimizer, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad()
        loss = model(torch.tensor([step % 5, 2, 4, 1])).float().square().mean()
        optimizer.scale_loss(loss).backward()
        optimizer.step()


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_dict_loads_weights_only_and_resumes_exactly(dtype):
    scaler = (lambda: DynamicLossScaler(initial_scale=2.0 ** 8, growth_interval=2)) \
        if dtype == torch.float16 else (lambda: None)
    model = _model(dtype)
    optimizer = _build(model, dtype, clip_grad=1.0, loss_scaler=scaler())
    _train(model, optimizer, 3)
    saved_model = _save_load(model.state_dict())
    saved_optimizer = _save_load(optimizer.state_dict())
    _train(model, optimizer, 3, first_step=3)

    resumed_model = _model(dtype, seed=1)
    resumed_model.load_state_dict(saved_model)
    resumed = _build(resumed_model, dtype, clip_grad=1.0, loss_scaler=scaler())
    resumed.load_state_dict(saved_optimizer)
    _train(resumed_model, resumed, 3, first_step=3)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    for ms, rs in zip(optimizer.master_groups, resumed.master_groups):
        assert all(torch.equal(a, b) for a, b in zip(ms, rs))
    assert resumed.loss_scale == optimizer.loss_scale


def test_fp16_checkpoint_resumed_in_fp32_takes_the_masters():
    model = _model(torch.float16)
    optimizer = _build(model, torch.float16, loss_scaler=DynamicLossScaler(initial_scale=256.0))
    _train(model, optimizer, 2)
    state = _save_load(optimizer.state_dict())
    fp32_model = _model(torch.float32, seed=3)
    fp32_optimizer = _build(fp32_model, torch.float32)
    fp32_optimizer.load_state_dict(state)
    fp32_params = [p for ps in fp32_optimizer.model_groups for p in ps]
    masters = [m for ms in optimizer.master_groups for m in ms]
    assert len(fp32_params) == len(masters)
    for param, master in zip(fp32_params, masters):
        assert torch.equal(param, master)


def test_optimizer_state_for_another_model_is_a_checkpoint_error():
    model = _model()
    optimizer = _build(model, torch.float32)
    _train(model, optimizer, 1)
    other = _build(torch.nn.Linear(3, 3), torch.float32)
    with pytest.raises(CheckpointError, match="--no-load-optim"):
        other.load_state_dict(optimizer.state_dict())


def _all_reduced_norm(params, max_norm):
    """A stand-in for the tensor-parallel norm: every rank holds a shard of the gradient."""
    import torch.distributed as dist
    local = sum(float(p.grad.double().square().sum()) for p in params)
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    return math.sqrt(total.item())


def _skip_decision_on_rank(rank, world_size):
    model = _model(torch.bfloat16)
    optimizer = _build(model, torch.bfloat16, clip_grad=1.0, grad_norm_fn=_all_reduced_norm)
    _set_grads(model, 0)
    if rank == 1:  # only one shard overflows
        model.dense.weight.grad[0, 0] = float("inf")
    first = optimizer.step()
    _set_grads(model, 1)
    second = optimizer.step()
    return first[0], second[0]


@pytest.mark.slow  # spawns two processes (~10-20 s on 2 busy cores)
def test_skip_decision_agrees_across_model_parallel_ranks():
    from tests.dist_utils import run_distributed
    assert run_distributed(_skip_decision_on_rank, world_size=2) == [(False, True)] * 2
