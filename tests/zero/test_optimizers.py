"""Optimizers from the `optimizer` section of a DeepSpeed config."""

import pytest
import torch

from zero import ConfigError, DeepSpeedConfig
from zero.optim.optimizers import build_optimizer, check_zero_supported


def config_with(optimizer, **top):
    return DeepSpeedConfig({"train_batch_size": 1, "optimizer": optimizer, **top})


def build(optimizer_section, parameters=None):
    parameters = parameters or [torch.nn.Parameter(torch.ones(1))]
    return build_optimizer(config_with(optimizer_section), parameters)


def one_step(optimizer_section, grad=0.5):
    """Value of a scalar parameter (1.0) after one step with gradient `grad`."""
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = build(optimizer_section, [param])
    param.grad = torch.full((1,), grad)
    optimizer.step()
    return param.item()


def test_adam_defaults_follow_fused_adam():
    optimizer = build({"type": "Adam"})
    assert type(optimizer) is torch.optim.AdamW  # adam_w_mode defaults to true
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
        (1e-3, (0.9, 0.999), 1e-8, 0.0)  # FusedAdam's weight_decay default is 0, torch's 0.01


def test_adam_weight_decay_modes_by_hand():
    # p = 1, g = 0.5, lr = 0.1, wd = 0.1. After one Adam step the normalised update is
    # m_hat / (sqrt(v_hat) + eps) = 1 (up to eps), whatever the gradient.
    # decoupled (AdamW): p = 1 - lr*wd*1 - lr*1 = 0.89
    # L2 (adam_w_mode false): g' = 0.5 + 0.1 * 1, update still 1, so p = 1 - 0.1 = 0.9
    params = {"lr": 0.1, "weight_decay": 0.1}
    assert one_step({"type": "Adam", "params": params}) == pytest.approx(0.89, abs=1e-6)
    assert one_step({"type": "AdamW", "params": params}) == pytest.approx(0.89, abs=1e-6)
    l2 = one_step({"type": "Adam", "params": {**params, "adam_w_mode": False}})
    assert l2 == pytest.approx(0.9, abs=1e-6)


def test_adam_w_mode_false_builds_torch_adam():
    optimizer = build({"type": "adam", "params": {"adam_w_mode": False, "betas": [0.9, 0.95]}})
    assert type(optimizer) is torch.optim.Adam
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)


def test_torch_adam_uses_torch_defaults():
    optimizer = build({"type": "AdamW", "params": {"torch_adam": True}})
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    foreach = build({"type": "Adam", "params": {"torch_adam": True, "foreach": False}})
    assert foreach.param_groups[0]["foreach"] is False


def test_sgd_adagrad_and_torch_names():
    sgd = build({"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}})
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["momentum"] == 0.9
    assert type(build({"type": "Adagrad", "params": {"lr": 0.1}})) is torch.optim.Adagrad
    assert type(build({"type": "RMSprop", "params": {"lr": 0.1}})) is torch.optim.RMSprop


def test_quantized_adam_names():
    from zero.optim.quantized_adam import Adam4bit, Adam8bit
    for name, cls in (("Adam8bit", Adam8bit), ("adamw8bit", Adam8bit), ("ADAM4BIT", Adam4bit),
                      ("AdamW4bit", Adam4bit)):
        optimizer = build({"type": name, "params": {"lr": 0.1, "weight_decay": 0.01}})
        assert type(optimizer) is cls and optimizer.param_groups[0]["weight_decay"] == 0.01


def test_sgd_step_by_hand():
    assert one_step({"type": "SGD", "params": {"lr": 0.1}}, grad=0.5) == pytest.approx(0.95)


def test_param_groups_pass_through():
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    optimizer = build({"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.1}},
                      [{"params": [a]}, {"params": [b], "weight_decay": 0.0}])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("section, piece", [
    ({"type": "Adam", "params": {"lr": 1e-4, "max_grad_norm": 1.0}},
     "'max_grad_norm' is not supported as an optimizer parameter"),
    ({"type": "Lamb", "params": {}}, "needs DeepSpeed's fused kernels"),
    ({"type": "OneBitAdam"}, "needs DeepSpeed's 1-bit compressed communication"),
    ({"type": "Foo"}, "Supported: Adam, AdamW, Adam8bit (AdamW8bit), Adam4bit (AdamW4bit), "
                      "Adagrad, or SGD or another torch.optim class by its exact name (e.g. "
                      "RMSprop; under ZeRO these need \"zero_allow_untested_optimizer\": true, "
                      "as in DeepSpeed)"),
    ({"type": "Lamb", "params": {}}, "\"zero_allow_untested_optimizer\": true"),
    ({"type": "Adam4bit", "params": {"min_8bit_numel": 10}}, "did you mean 'min_4bit_numel'"),
    ({"type": "AdamW8bit", "params": {"amsgrad": True}}, "unknown optimizer parameter"),
    ({"type": "Adam4bit", "params": {"betas": [0.9, 1.5]}},
     "'optimizer.params.betas' must be two numbers in [0, 1), e.g. [0.9, 0.999], got [0.9, 1.5]"),
    ({"type": "Adam8bit", "params": {"eps": 0}}, "'optimizer.params.eps' must be a number > 0"),
    ({"type": "rmsprop"}, "did you mean \"RMSprop\""),
    ({"type": "Optimizer"}, "unknown optimizer type"),
    ({"type": "Adam", "params": {"weight_decy": 0.1}}, "did you mean 'weight_decay'"),
    ({"type": "Adam", "params": {"foreach": True}}, "unknown optimizer parameter"),
    ({"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.9]}}, "'optimizer.params.betas'"),
    ({"type": "Adam", "params": {"bias_correction": False}}, "bias_correction"),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, "contradicts"),
    ({"type": "Adam", "params": {"adam_w_mode": "yes"}}, "must be true or false"),
    ({"type": "Adam", "params": {"lr": -0.1}}, "'optimizer.params.lr' must be a number >= 0"),
    ({"type": "Adam", "params": {"betas": [0.9, 1.5]}}, "'optimizer.params.betas' must be two"),
    ({"type": "Adam", "params": {"betas": []}}, "'optimizer.params.betas' must be two"),
    ({"type": "Adam", "params": {"betas": [0.9, 0.99, 0.5]}}, "got [0.9, 0.99, 0.5]"),
    ({"type": "Adam", "params": {"betas": 0.9}}, "'optimizer.params.betas' must be two"),
    ({"type": "Adam", "params": {"lr": "0.1"}}, "'optimizer.params.lr' must be a number >= 0, "
                                                "got \"0.1\""),
    ({"type": "AdamW", "params": {"eps": 0}}, "'optimizer.params.eps' must be a number > 0, "
                                              "got 0"),
    ({"type": "AdamW", "params": {"weight_decay": -1, "torch_adam": True}},
     "'optimizer.params.weight_decay' must be a number >= 0"),
    ({"type": "FusedAdam"}, "(a DeepSpeed class, not a config type); did you mean \"Adam\"?"),
    ({"type": 3}, "'optimizer.type' must be a string"),
])
def test_bad_optimizer_sections_fail_when_parsed(section, piece):
    with pytest.raises(ConfigError) as info:
        config_with(section)
    assert piece in str(info.value)


def test_auto_params_take_the_default():
    optimizer = build({"type": "Adam", "params": {"lr": "auto", "weight_decay": "auto"}})
    assert optimizer.param_groups[0]["lr"] == 1e-3


def test_no_section_and_empty_model():
    with pytest.raises(ConfigError, match="no 'optimizer' section"):
        build_optimizer(DeepSpeedConfig({"train_batch_size": 1}), [torch.nn.Parameter(
            torch.ones(1))])
    with pytest.raises(ConfigError, match="empty parameter list"):
        build_optimizer(config_with({"type": "Adam"}), [])


def test_untested_optimizer_rule_under_zero():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])
    stage2 = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        check_zero_supported(sgd, stage2)
    check_zero_supported(adam, stage2)
    check_zero_supported(sgd, DeepSpeedConfig({"train_batch_size": 1}))
    check_zero_supported(sgd, DeepSpeedConfig({"train_batch_size": 1,
                                               "zero_optimization": {"stage": 2},
                                               "zero_allow_untested_optimizer": True}))
