"""zero.initialize and the engine's API: what it returns, accumulation, errors, monitoring."""

import copy
import glob

import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from zero.errors import ConfigError, ZeroError
from zero.stages.stage1_2 import ZeroOptimizer


def _config(**overrides):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 1}}
    config.update(overrides)
    return config


def _batch(step=0, size=4):
    return cases.global_batch(step, size)


def test_initialize_returns_engine_optimizer_loader_and_scheduler():
    config = _config(scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                                "warmup_max_lr": 1e-2,
                                                                "warmup_num_steps": 4,
                                                                "warmup_type": "linear"}})
    engine, optimizer, loader, scheduler = zero.initialize(model=cases.make_model(),
                                                           config=config)
    assert isinstance(engine, torch.nn.Module) and optimizer is engine.optimizer
    assert isinstance(optimizer, ZeroOptimizer) and loader is None
    assert scheduler is engine.lr_scheduler and engine.get_lr() == [0.0]
    assert optimizer.param_groups[0]["fused"] is True  # fused Adam on the flat partition
    for step in range(2):
        engine.backward(engine(*_batch(step)))
        engine.step()
    assert engine.get_lr() == [pytest.approx(1e-2 * 1 / 4)]  # it = 1 after two steps
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (4, 4, 1)


def test_client_optimizer_and_scheduler_callables():
    model = cases.make_model()
    config = _config()
    del config["optimizer"]
    engine, optimizer, _, scheduler = zero.initialize(
        model=model, config=config,
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.5),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1))
    engine.backward(engine(*_batch()))
    engine.step()
    assert engine.get_lr() == [pytest.approx(0.05)]
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)


def test_accumulation_boundary_and_counters():
    engine, *_ = zero.initialize(model=cases.make_model(),
                                 config=_config(gradient_accumulation_steps=3))
    weight = engine.module.fc1.weight
    start = weight.detach().clone()
    pattern = []
    for micro in range(6):
        pattern.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(*_batch(micro)))
        engine.step()
        if micro < 2:
            assert torch.equal(weight, start)  # no update before the boundary
    assert pattern == [False, False, True] * 2
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (2, 24, 6)
    assert not torch.equal(weight, start)


def test_gradient_accumulation_equals_one_big_batch():
    """GAS=4 x micro 2 gives the update of one batch of 8: loss / GAS, grads summed."""
    config = _config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4,
                     gradient_clipping=0.5)
    engine, *_ = zero.initialize(model=cases.make_model(), config=config)
    tokens, labels = _batch(0, 8)
    for i in range(4):
        engine.backward(engine(tokens[2 * i:2 * i + 2], labels[2 * i:2 * i + 2]))
        engine.step()
    reference = cases.make_model()
    reference(tokens, labels).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1).step()
    assert engine.get_global_grad_norm() == pytest.approx(norm.item(), rel=1e-5)
    for (name, param), ref in zip(engine.module.named_parameters(), reference.parameters()):
        assert torch.allclose(param, ref, atol=1e-6), name


def test_config_and_argument_errors_are_zero_errors(tmp_path):
    model = cases.make_model()
    with pytest.raises(ZeroError, match="requires a model"):
        zero.initialize(config=_config())
    with pytest.raises(ZeroError, match="model must be a torch.nn.Module, got function"):
        zero.initialize(model=lambda x: x, config=_config())
    with pytest.raises(ZeroError, match="optimizer must be a torch.optim.Optimizer or a "
                                        "callable that builds one from the parameters, got str"):
        zero.initialize(model=model, config=_config(), optimizer="Adam")
    with pytest.raises(ZeroError, match="the optimizer callable returned NoneType, not an optimizer"):
        zero.initialize(model=model, config=_config(), optimizer=lambda params: None)
    for scheduler, kind in (("WarmupLR", "str"), (lambda optimizer: None, "NoneType")):
        with pytest.raises(ZeroError, match=f"lr_scheduler must be a schedule .* got {kind}"):
            zero.initialize(model=model, config=_config(), lr_scheduler=scheduler)
    with pytest.raises(ConfigError, match="stage"):  # stages are 0-3
        zero.initialize(model=model, config=_config(zero_optimization={"stage": 4}))
    with pytest.raises(ConfigError, match="offload_optimizer' needs ZeRO stage 1, 2 or 3"):
        zero.initialize(model=model, config=_config(zero_optimization={
            "stage": 0, "offload_optimizer": {"device": "cpu"}}))
    with pytest.raises(ConfigError, match="reduce_bucket_sise"):
        zero.initialize(model=model, config=_config(zero_optimization={
            "stage": 2, "reduce_bucket_sise": 10}))
    args = type("Args", (), {"deepspeed_config": str(tmp_path / "ds.json")})()
    with pytest.raises(ConfigError, match="given twice"):
        zero.initialize(args=args, model=model, config=_config())
    with pytest.raises(ConfigError, match="RMSprop"):
        zero.initialize(model=model, config=_config(), optimizer=torch.optim.RMSprop(
            model.parameters(), lr=1e-3))
    engine, *_ = zero.initialize(model=model, config=_config(zero_allow_untested_optimizer=True),
                                 optimizer=torch.optim.RMSprop(model.parameters(), lr=1e-3))
    engine.backward(engine(*_batch()))
    engine.step()


def test_config_from_json_file_and_args(tmp_path):
    path = tmp_path / "ds_config.json"
    import json
    path.write_text(json.dumps(_config()))
    parser = zero.add_config_arguments(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, *_ = zero.initialize(args=args, model=cases.make_model())
    assert engine.train_batch_size() == 4 and engine.zero_optimization_stage() == 1


def test_unused_parameters():
    model = cases.make_model()
    model.unused = torch.nn.Linear(2, 2)
    config = _config(zero_optimization={"stage": 2, "ignore_unused_parameters": False})
    engine, *_ = zero.initialize(model=copy.deepcopy(model), config=config)
    with pytest.raises(ZeroError, match="received no gradient"):
        engine.backward(engine(*_batch()))
    config["zero_optimization"]["ignore_unused_parameters"] = True
    engine, *_ = zero.initialize(model=model, config=config)
    before = model.unused.weight.detach().clone()
    engine.backward(engine(*_batch()))
    engine.step()
    assert torch.equal(model.unused.weight, before * (1 - 1e-2 * 0.1))  # decay only


def test_training_data_gives_a_loader_of_micro_batches():
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0))
    _, _, loader, _ = zero.initialize(model=cases.make_model(), config=_config(),
                                      training_data=dataset)
    sizes = [len(batch[0]) for batch in loader]
    assert sizes == [4, 4, 2]
    _, _, loader, _ = zero.initialize(model=cases.make_model(),
                                      config={**_config(), "dataloader_drop_last": True},
                                      training_data=dataset)
    assert [len(batch[0]) for batch in loader] == [4, 4]  # the short one left out

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.arange(10.0))
    _, _, loader, _ = zero.initialize(model=cases.make_model(), config=_config(),
                                      training_data=Stream())  # on one rank: read in order
    assert [batch.tolist() for batch in loader][0] == [0.0, 1.0, 2.0, 3.0]


def test_a_zero_init_model_below_stage_3_and_empty_model_parameters_are_refused(caplog):
    with zero.Init():
        partitioned = cases.make_model()
    with pytest.raises(ConfigError, match="built under zero.Init.*stage 1"):
        zero.initialize(model=partitioned, config=_config())
    model = cases.make_model()
    used_up = model.parameters()
    list(used_up)
    with pytest.raises(ZeroError, match="model_parameters is empty"):
        zero.initialize(model=model, model_parameters=used_up, config=_config())
    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(),
                                 config=_config())  # a generator: read once, kept
    assert sum(len(g["params"]) for g in engine.optimizer.optimizer.param_groups) > 0
    frozen = cases.make_model().requires_grad_(False)  # (evaluation only: said, not refused)
    with caplog.at_level("WARNING", logger="zero.engine"):
        zero.initialize(model=frozen, config=_config())
    assert "the model has no trainable parameters (every one has requires_grad=False): it " \
        "evaluates, backward() fails" in caplog.text


def test_progress_lines_and_tensorboard(tmp_path, capsys):
    config = _config(steps_per_print=2, wall_clock_breakdown=True,
                     tensorboard={"enabled": True, "output_path": str(tmp_path),
                                  "job_name": "job"})
    engine, *_ = zero.initialize(model=cases.make_model(), config=config)
    for step in range(4):
        engine.backward(engine(*_batch(step)))
        engine.step()
    out = capsys.readouterr().out
    assert "[zero] step=2, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]" in out
    assert "step=4" in out and "forward:" in out and "backward:" in out and "step:" in out
    assert glob.glob(str(tmp_path / "job" / "events.out.tfevents.*"))


def test_train_eval_and_zero_grad_reach_the_module():
    engine, *_ = zero.initialize(model=cases.make_model(),
                                 config=_config(zero_optimization={"stage": 0}))
    engine.eval()
    assert not engine.module.training
    engine.train()
    engine.backward(engine(*_batch()))
    assert engine.module.fc1.weight.grad.abs().sum() > 0  # stage 0 keeps readable grads
    engine.zero_grad()
    assert engine.module.fc1.weight.grad is None  # released, as DeepSpeed's zero_grad does


class _WideLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2048, 1024)

    def forward(self, x):
        return self.linear(x).pow(2).mean()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_global_grad_norm_is_exact_for_large_flat_gradients(stage):
    """2M gradient elements of very different sizes: one fp32 reduction over the flat buffer
    (torch.linalg.vector_norm on CPU) reports a norm ~1e-4 low; the engine's must be the
    float64 norm to 1e-6."""
    torch.manual_seed(0)
    model = _WideLinear()
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.0}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = zero.initialize(model=model, config=config)
    x = torch.randn(1, 2048) * torch.rand(1, 2048) ** 4 * 100
    engine.backward(engine(x))
    engine.step()
    reference(x).backward()
    exact = sum(float(p.grad.double().pow(2).sum()) for p in reference.parameters()) ** 0.5
    assert engine.get_global_grad_norm() == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("stage,offload,optimizer", [
    (0, None, "fused AdamW"), (1, None, "fused AdamW"), (2, None, "fused AdamW"),
    (3, None, "fused AdamW"), (2, "cpu", "fused AdamW"), (3, "cpu", "fused AdamW"),
    (1, None, "foreach AdamW"), (0, None, "SGD"), (2, None, "SGD")])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_the_optimizer_steps_on_the_unscaled_clipped_gradient(precision, stage, offload,
                                                             optimizer, clip, monkeypatch):
    """Adam hardly changes its step when every gradient is scaled alike, so losses alone do
    not show a wrong loss scale or clip: the first step's moment does (engine_cases)."""
    cases.check_first_step_moment(precision, stage, offload, optimizer, clip, monkeypatch)


def test_a_state_saved_under_offload_steps_with_fused_adam_after_loading(tmp_path):
    """CPUAdam's param groups choose no torch implementation; loaded into a run without
    offload they must still get fused Adam (which takes the step's divisor in its kernel)."""
    offloaded, *_ = zero.initialize(model=cases.make_model(), config=_config(
        zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}))
    offloaded.backward(offloaded(*_batch()))
    offloaded.step()
    offloaded.save_checkpoint(str(tmp_path))
    engine, *_ = zero.initialize(model=cases.make_model(), config=_config())
    engine.load_checkpoint(str(tmp_path))
    assert [group["fused"] for group in engine.optimizer.param_groups] == [True]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_backward_takes_deepspeeds_positional_arguments(stage):
    """backward(loss, retain_graph=False, scale_wrt_gas=True) as DeepSpeed's: a second
    positional argument keeps the graph (it used to turn off the division by the
    accumulation steps), and a kept graph backpropagates again: twice the gradient."""
    def update(twice):  # plain SGD at lr 1: the update is minus the gradient
        config = _config(zero_optimization={"stage": stage}, zero_allow_untested_optimizer=True,
                         optimizer={"type": "SGD", "params": {"lr": 1.0}})
        engine, *_ = zero.initialize(model=cases.make_model(), config=config)
        before = _module_weights(engine)
        loss = engine(*_batch())
        engine.backward(loss, True)
        if twice:
            engine.backward(loss)
        engine.step()
        return {name: w - before[name] for name, w in _module_weights(engine).items()}
    once, twice = update(False), update(True)
    assert any(delta.abs().max() > 0 for delta in once.values())
    for name in once:
        assert torch.allclose(twice[name], 2 * once[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("stage,precision,offload", [
    (1, "fp32", "cpu"), (1, "bf16", "cpu"), (2, "fp16", None), (2, "fp32", None),
    (3, "fp32", None)])
def test_loss_backward_instead_of_engine_backward_is_an_error(stage, precision, offload):
    """loss.backward() skips what engine.backward does (divide by the accumulation steps,
    apply the fp16 loss scale, reduce over data parallel): where gradient hooks run (stages 2
    and 3, offloaded masters, several ranks: tests/zero/test_stage1_2.py) that backward
    stops. (At stages 0 and 1 on one rank there are no hooks: gradients in param.grad at the
    step are taken as set by hand, tests/training/test_optimizer_step.py.)"""
    zero_options = {"stage": stage}
    if offload:
        zero_options["offload_optimizer"] = {"device": offload}
    config = _config(zero_optimization=zero_options)
    if precision != "fp32":
        config[precision] = {"enabled": True}
    model = cases.make_model()
    if precision != "fp32":
        model = model.to(torch.float16 if precision == "fp16" else torch.bfloat16)
    engine, *_ = zero.initialize(model=model, config=config)
    loss = engine(*_batch())
    with pytest.raises(ZeroError, match=r"outside engine.backward .*engine.backward\(loss\)"):
        loss.backward()


def _engine_at_lr_zero(stage, precision, offload=None):
    """A step leaves the weights as they are: what the fp32 masters hold is what it writes."""
    zero_options = {"stage": stage}
    if offload:
        zero_options["offload_optimizer"] = {"device": offload}
    config = _config(zero_optimization=zero_options,
                     optimizer={"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}})
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = zero.initialize(model=cases.make_model(), config=config)
    return engine


@pytest.mark.parametrize("stage,precision,offload", [
    (0, "bf16", None), (1, "bf16", None), (2, "fp16", None), (1, "fp32", "cpu"),
    (0, "fp32", None)])
def test_weights_loaded_after_initialize_reach_the_fp32_masters(stage, precision, offload,
                                                                 tmp_path):
    """Weights loaded into the module after initialize (of the module, a submodule or the
    engine) are what the next step starts from and what a checkpoint saves: the fp32 masters
    take them, where they used to copy the old weights back over them at the step."""
    other = {name: value.clone() for name, value in cases.make_model(seed=7).state_dict().items()}

    def loaded_weights(load):
        engine = _engine_at_lr_zero(stage, precision, offload)
        engine.backward(engine(*_batch()))
        engine.step()
        load(engine)
        wanted = {name: value.to(next(engine.module.parameters()).dtype)
                  for name, value in other.items()}
        engine.backward(engine(*_batch(1)))
        engine.step()
        return engine, wanted

    fc1 = {"weight": other["fc1.weight"], "bias": other["fc1.bias"]}
    for load, names in ((lambda e: e.module.load_state_dict(other), list(other)),
                        (lambda e: e.load_state_dict({f"module.{k}": v
                                                      for k, v in other.items()}), list(other)),
                        (lambda e: e.module.fc1.load_state_dict(fc1), ["fc1.weight", "fc1.bias"])):
        engine, wanted = loaded_weights(load)
        after = engine.module.state_dict()
        assert all(torch.equal(after[name], wanted[name]) for name in names)

    engine = _engine_at_lr_zero(stage, precision, offload)
    engine.module.load_state_dict(other)  # then a save, without a step between
    engine.save_checkpoint(str(tmp_path))
    fresh = _engine_at_lr_zero(stage, precision, offload)
    fresh.load_checkpoint(str(tmp_path))
    fresh.backward(fresh(*_batch()))
    fresh.step()
    assert all(torch.equal(value, wanted[name])
               for name, value in fresh.module.state_dict().items() if name in wanted)


def test_a_load_that_replaces_parameters_is_refused():
    engine = _engine_at_lr_zero(1, "bf16")
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(ZeroError, match="replaced the parameter.*assign=True"):
        engine.module.load_state_dict(weights, assign=True)
    engine.destroy()  # the hooks go with the engine: the module is the user's again
    assert not any(module._load_state_dict_post_hooks for module in engine.module.modules())


def test_was_step_applied_step_lr_kwargs_and_a_boundary_set_by_hand():
    """DeepSpeed's was_step_applied(), step(lr_kwargs) and set_gradient_accumulation_boundary."""
    config = _config(gradient_accumulation_steps=2,
                     scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                               "warmup_max_lr": 1e-2,
                                                               "warmup_num_steps": 100,
                                                               "warmup_type": "linear"}})
    engine, *_ = zero.initialize(model=cases.make_model(), config=config)
    applied = []
    for micro in range(2):
        engine.backward(engine(*_batch(micro)))
        engine.step(lr_kwargs={"last_batch_iteration": 50})
        applied.append(engine.was_step_applied())
    assert applied == [False, True]
    assert engine.get_lr() == [pytest.approx(5e-3)]  # warmup at iteration 50 of 100
    engine.set_gradient_accumulation_boundary(True)  # every micro-step ends a step now
    engine.backward(engine(*_batch(2)))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 2


def test_no_sync_is_refused_where_it_cannot_apply():
    engine, *_ = zero.initialize(model=cases.make_model(),
                                 config=_config(zero_optimization={"stage": 2}))
    with pytest.raises(ZeroError, match="no_sync.*stage 0 or 1"):
        with engine.no_sync():
            pass
    engine, *_ = zero.initialize(model=cases.make_model(), config=_config())
    with engine.no_sync():
        engine.backward(engine(*_batch()))
        with pytest.raises(ZeroError, match="does not nest"):
            with engine.no_sync():
                pass
        with pytest.raises(ZeroError, match="step\\(\\) inside no_sync"):
            engine.step()


def _module_weights(engine):
    params = dict(engine.module.named_parameters())
    with zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().clone() for name, p in params.items()}


def _engine_with_what_rank_1_was_given(rank, world_size, change):
    config, model = cases.ds_config(2, gas=2), cases.make_model()
    if rank == 1 and change == "gas":
        config = cases.ds_config(2, gas=4)
    if rank == 1 and change == "lr":
        config = {**config, "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}}
    elif change == "lr":
        config = {**config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if rank == 1 and change == "model":
        model.head = torch.nn.Linear(model.head.in_features, model.head.out_features + 1)
    try:
        if change == "lr":
            zero.initialize(model=model, config=config)
        elif change == "tensor lr":  # 1e-3 and 1.0004e-3 both print as tensor(0.0010)
            lr = torch.tensor(1.0004e-3 if rank == 1 else 1e-3)
            zero.initialize(model=model, config=config, optimizer=torch.optim.AdamW(
                model.parameters(), lr=lr, foreach=False))
        else:
            cases.make_engine(config, model=model)
    except ConfigError as e:
        return str(e)
    return "initialized"


@pytest.mark.parametrize("change, differs", [
    ("gas", "gradient_accumulation_steps (rank 0: 2, rank 1: 4)"),
    ("lr", "the optimizer's param groups (rank 0: [{'lr': 0.001"),
    ("model", "the model's parameters (names, shapes, dtypes) (rank 0: "),
    ("tensor lr", "the optimizer's param groups (rank 0: [{'lr': 0.00100000004749"),
])
def test_ranks_given_different_configs_or_models_are_told_at_initialize(change, differs):
    """A per-rank difference (an environment variable read into the config, say) hung in,
    or crashed out of, the first collective, or (another lr) trained apart without a word."""
    for message in run_distributed(_engine_with_what_rank_1_was_given, 2, args=(change,)):
        assert message.startswith("zero.initialize: the data-parallel ranks must agree on "
                                   "what they train, but these differ: "), message
        assert differs in message, message
