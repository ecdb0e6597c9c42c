"""Summing micro batches' 16-bit gradients in fp32 at ZeRO stage 0 ('data_types.
grad_accum_dtype', bf16's default there): against the float64 sum of the same bf16 gradients,
on one rank and over two data-parallel ranks (reduced in fp32), with two losses at the step,
hand-set gradients, and the combinations the config refuses."""

import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from zero.errors import ConfigError, ZeroError

WIDTH, MICRO = 64, 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, WIDTH)).to(torch.bfloat16)


def _micro_batch(index):
    generator = torch.Generator().manual_seed(100 + index)
    return torch.randn(MICRO, WIDTH, generator=generator).to(torch.bfloat16)


def _loss(model, batch):
    return model(batch).float().pow(2).mean()


def _bf16_grads(indices, divisor):
    """Each micro batch's bf16 gradients of loss / divisor (what the engine's backward makes),
    summed in float64: {name: tensor}."""
    model, total = _model(), {}
    for index in indices:
        model.zero_grad()
        (_loss(model, _micro_batch(index)) / divisor).backward()
        for name, param in model.named_parameters():
            total[name] = total.get(name, 0) + param.grad.double()
    return total


def _config(gas, precision="bf16", **extra):
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def _step_grads(engine):
    """Run the step; return {name: the fp32 master's gradient it used (copied as its norm is
    taken, before Adam)}."""
    optimizer, seen = engine.optimizer, {}
    names = {param: name for name, param in engine.module.named_parameters()}
    norm = optimizer._reduced_grad_norm_sq

    def capture():
        for group in optimizer.groups:
            for param, offset, numel in zip(group.params, group.layout.offsets,
                                            group.layout.numels):
                grad = group.master.grad[offset:offset + numel].view(param.shape)
                seen[names[param]] = grad.clone()
        return norm()
    optimizer._reduced_grad_norm_sq = capture
    engine.step()
    optimizer._reduced_grad_norm_sq = norm
    return seen


def _accumulate(engine, indices):
    """Backward of each micro batch and the steps between (not at a boundary: nothing), up to
    the last backward."""
    for index in indices:
        engine.backward(_loss(engine, _micro_batch(index)))
        if index != indices[-1]:
            engine.step()


def _worst_error(found, expected):
    return max(((found[n].double() - expected[n]).abs().max() / expected[n].abs().max()).item()
               for n in expected)


@pytest.mark.parametrize("data_types, summed_in_fp32", [
    ({}, True),  # bf16's default at stage 0
    ({"data_types": {"grad_accum_dtype": "fp32"}}, True),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, False),
])
def test_micro_batches_are_summed_in_the_dtype_asked_for(data_types, summed_in_fp32):
    gas = 16
    engine, *_ = zero.initialize(model=_model(), config=_config(gas, **data_types))
    assert engine.optimizer.settings.fp32_accumulation == summed_in_fp32
    _accumulate(engine, list(range(gas)))
    error = _worst_error(_step_grads(engine), _bf16_grads(range(gas), gas))
    if summed_in_fp32:
        assert error < 1e-6, error  # fp32 rounding of exact bf16 addends
    else:
        assert 1e-4 < error < 2e-2, error  # bf16 rounding at each of the 15 additions


def _dp2_master_grads(rank, world_size):
    engine, *_ = zero.initialize(model=_model(), config=_config(4))
    _accumulate(engine, [4 * rank + i for i in range(4)])
    return _step_grads(engine)


def test_two_data_parallel_ranks_reduce_the_fp32_sums():
    expected = {name: grad / 2 for name, grad in _bf16_grads(range(8), 4).items()}  # the mean
    for found in run_distributed(_dp2_master_grads, 2):
        assert _worst_error(found, expected) < 1e-6


def _two_losses_at_the_step(rank, world_size):
    """Micro batches 0-1 accumulate, then two losses are backpropagated at the boundary."""
    engine, *_ = zero.initialize(model=_model(), config=_config(3))
    base = 10 * rank
    engine.backward(_loss(engine, _micro_batch(base)))
    engine.step()
    engine.backward(_loss(engine, _micro_batch(base + 1)))
    engine.step()
    for index in (base + 2, base + 3):  # both reduce: the step's boundary
        engine.backward(_loss(engine, _micro_batch(index)))
    grads = _step_grads(engine)
    engine, *_ = zero.initialize(model=_model(), config=_config(1))
    engine.backward(_loss(engine, _micro_batch(base)))  # reduces: a boundary
    with pytest.raises(ZeroError, match="reduce_gradients=False after one that reduced"), \
            engine.no_sync():
        engine.backward(_loss(engine, _micro_batch(base)))
    return grads


def test_two_losses_backpropagated_at_the_step_add_their_gradients():
    expected = {name: grad / 2 for name, grad in
                _bf16_grads([0, 1, 2, 3, 10, 11, 12, 13], 3).items()}
    for found in run_distributed(_two_losses_at_the_step, 2):
        assert _worst_error(found, expected) < 1e-6


def _one_rank_two_losses():
    engine, *_ = zero.initialize(model=_model(), config=_config(3))
    _accumulate(engine, [0, 1, 2])
    engine.backward(_loss(engine, _micro_batch(3)))  # a second loss at the boundary
    return _step_grads(engine)


def test_one_rank_sums_two_losses_at_the_step_too():
    found = _one_rank_two_losses()
    assert _worst_error(found, _bf16_grads([0, 1, 2, 3], 3)) < 1e-2  # the last two: bf16
    # (on one rank the boundary's losses are summed in param.grad, read at the step)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gradients_edited_after_backward_reach_the_step_on_one_rank(precision):
    """Nothing is reduced on one rank, so the last micro batch's gradients join the fp32 sum
    at the step, as param.grad holds them then: zeroed by hand after backward, nothing
    moves."""
    config = _config(2, precision=precision)
    config["optimizer"]["params"]["weight_decay"] = 0.0
    model = _model() if precision == "bf16" else _model().half()
    engine, *_ = zero.initialize(model=model, config=config)
    assert engine.optimizer.settings.fp32_accumulation == (precision == "bf16")
    dtype = next(engine.module.parameters()).dtype
    engine.backward(_loss(engine, _micro_batch(0).to(dtype)).detach().requires_grad_())
    engine.step()  # (a micro batch that gave no parameter a gradient)
    engine.backward(_loss(engine, _micro_batch(1).to(dtype)))
    for param in engine.module.parameters():
        param.grad.zero_()
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))


def test_gradients_set_by_hand_reach_the_masters():
    config = _config(1)
    config["optimizer"]["params"]["weight_decay"] = 0.0  # only a gradient moves a weight
    engine, *_ = zero.initialize(model=_model(), config=config)
    for param in engine.module.parameters():
        param.grad = torch.full_like(param, 0.5)
    before = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.step()
    for name, param in engine.module.named_parameters():
        assert not torch.equal(param.detach().float(), before[name]), name  # Adam moved it


@pytest.mark.parametrize("precision, stage, dtype, message", [
    ("bf16", 1, "fp32", r"'data_types.grad_accum_dtype' 'fp32' with bf16 parameters at ZeRO "
                        r"stage 1: gradients are summed in the parameters' dtype \(bf16\)"),
    ("bf16", 2, "bf16", r"'bf16' with bf16 parameters at ZeRO stage 2: gradients are summed "
                        r"in fp32"),
    ("fp32", 0, "bf16", r"'bf16' with fp32 parameters at ZeRO stage 0: gradients are summed "
                        r"in fp32, the parameters' dtype"),
])
def test_a_dtype_the_stage_does_not_sum_in_is_refused(precision, stage, dtype, message):
    config = _config(1, precision=precision, data_types={"grad_accum_dtype": dtype})
    config["zero_optimization"]["stage"] = stage
    with pytest.raises(ConfigError, match=message):
        zero.initialize(model=_model().float() if precision == "fp32" else _model(),
                        config=config)


def test_fp16_sums_in_fp16_unless_asked():
    fp16 = _config(1, precision="fp16")
    engine, *_ = zero.initialize(model=_model().half(), config=fp16)
    assert not engine.optimizer.settings.fp32_accumulation
    engine, *_ = zero.initialize(model=_model().half(),
                                 config={**fp16, "data_types": {"grad_accum_dtype": "fp32"}})
    assert engine.optimizer.settings.fp32_accumulation


def test_a_long_16bit_tensor_adds_into_fp32_in_chunks():
    """add_into widens a CPU 16-bit source a chunk at a time: every chunk lands, the last
    short one too."""
    from zero.stages.bucket_reduction import add_into
    source = torch.randn(2_500_003).to(torch.bfloat16)
    target = torch.randn(2_500_003)
    expected = target + source.float()
    add_into(target, source)
    assert torch.equal(target, expected)


def test_a_16bit_communication_dtype_keeps_bf16_sums_unless_fp32_is_asked_for():
    """communication_data_type "bf16" asks for bf16 reductions: the default sums follow it;
    "fp32" sums with it are one error (fp32 sums are reduced in fp32)."""
    config = _config(1, communication_data_type="bf16")
    engine, *_ = zero.initialize(model=_model(), config=config)
    assert not engine.optimizer.settings.fp32_accumulation
    with pytest.raises(ConfigError, match="'data_types.grad_accum_dtype' \"fp32\" and "
                                          "'communication_data_type' 'bf16'"):
        zero.initialize(model=_model(), config={**config,
                                                "data_types": {"grad_accum_dtype": "fp32"}})


def _outside_gradient():
    """An fp32 gradient for the first layer's weight summed outside the engine (the pipeline's
    tied output layer's): values bf16 cannot hold."""
    return torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / 3


def _with_outside_gradient(gas, name, data_types=None):
    """The second step's gradients with the outside one added to parameter `name` before its
    last backward (lr 0: the first step leaves the weights as they were)."""
    config = _config(gas, **(data_types or {}))
    config["optimizer"]["params"].update(lr=0.0)
    engine, *_ = zero.initialize(model=_model(), config=config)
    for index in range(gas):  # a first step, whose sums must not reach the second's
        engine.backward(_loss(engine, _micro_batch(index)))
        engine.step()
    for index in range(gas - 1):
        engine.backward(_loss(engine, _micro_batch(index)))
        engine.step()  # (not the boundary)
    param = dict(engine.module.named_parameters())[name]
    engine.optimizer.add_to_gradient(param, _outside_gradient())
    engine.backward(_loss(engine, _micro_batch(gas - 1)))
    return _step_grads(engine)


def _plus_outside(expected, name="0.weight", divisor=1):
    expected = dict(expected)
    expected[name] = expected[name] + _outside_gradient().double() / divisor
    return expected


@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("name", ["0.weight", "2.weight"])  # the first, a later parameter
def test_a_gradient_added_from_outside_joins_the_fp32_sums_unrounded(gas, name):
    expected = _plus_outside(_bf16_grads(range(gas), gas), name)
    assert _worst_error(_with_outside_gradient(gas, name), expected) < 1e-6
    # summed in bf16, it is added in bf16, with the rounding that brings
    found = _with_outside_gradient(gas, name, {"data_types": {"grad_accum_dtype": "bf16"}})
    assert 1e-4 < _worst_error(found, expected) < 2e-2


def _dp2_with_outside_gradient(rank, world_size):
    engine, *_ = zero.initialize(model=_model(), config=_config(2))
    engine.backward(_loss(engine, _micro_batch(2 * rank)))
    engine.step()
    engine.optimizer.add_to_gradient(engine.module[0].weight, _outside_gradient())
    engine.backward(_loss(engine, _micro_batch(2 * rank + 1)))
    return _step_grads(engine)


def test_a_gradient_added_from_outside_is_reduced_with_the_sums():
    expected = _plus_outside({name: grad / 2 for name, grad in _bf16_grads(range(4), 2).items()})
    for found in run_distributed(_dp2_with_outside_gradient, 2):
        assert _worst_error(found, expected) < 1e-6


def test_adding_to_a_parameter_the_optimizer_does_not_train_is_refused():
    engine, *_ = zero.initialize(model=_model(), config=_config(1))
    with pytest.raises(ZeroError, match="not one this optimizer trains"):
        engine.optimizer.add_to_gradient(torch.nn.Parameter(torch.zeros(2)), torch.zeros(2))
