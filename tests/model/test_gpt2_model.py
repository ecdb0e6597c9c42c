import pytest
import torch

from megatron import mpu
from megatron.errors import ConfigError
from megatron.model import (MODEL_SIZES, GPT2Model, GPTConfig, flops_per_token,
                            num_parameters, param_groups_for_weight_decay)
from tests.model.cases import tiny_config


def _inputs(batch=2, seq=8, vocab=64):
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return tokens, torch.arange(seq).expand(batch, seq)


def test_shapes_and_dtypes():
    torch.manual_seed(0)
    model = GPT2Model(tiny_config())
    tokens, positions = _inputs()
    logits = model(tokens, positions)
    assert logits.shape == (2, 8, 64)
    losses = model(tokens, positions, labels=tokens)
    assert losses.shape == (2, 8) and losses.dtype == torch.float32


def test_megatron_state_dict_keys():
    model = GPT2Model(tiny_config(num_layers=1))
    prefix = "language_model.transformer.layers.0."
    expected = ["language_model.embedding.word_embeddings.weight",
                "language_model.embedding.position_embeddings.weight"]
    for module in ("input_layernorm", "attention.query_key_value", "attention.dense",
                   "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
        expected += [f"{prefix}{module}.weight", f"{prefix}{module}.bias"]
    expected += ["language_model.transformer.final_layernorm.weight",
                 "language_model.transformer.final_layernorm.bias"]
    assert list(model.state_dict()) == expected
    assert model.state_dict()[prefix + "attention.query_key_value.weight"].shape == (96, 32)


@pytest.mark.parametrize("overrides", [{}, dict(ffn_hidden_size=48, num_layers=3)])
def test_parameter_count_matches_analytic(overrides):
    config = tiny_config(**overrides)
    model = GPT2Model(config)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)


def test_named_sizes_have_the_published_parameter_counts():
    # Hugging Face gpt2 / gpt2-medium / gpt2-large / gpt2-xl (vocab 50257, 1024 positions).
    published = {"gpt2-124m": 124_439_808, "gpt2-345m": 354_823_168,
                 "gpt2-774m": 774_030_080, "gpt2-1.5b": 1_557_611_200}
    for name, count in published.items():
        config = GPTConfig.from_size(name, vocab_size=50257, max_position_embeddings=1024)
        assert num_parameters(config) == count, name
    assert {"gpt2-tiny", "gpt2-small-test"} <= set(MODEL_SIZES)
    with pytest.raises(ConfigError, match="gpt2-124m"):
        GPTConfig.from_size("gpt2-huge", 50304, 1024)


def test_flops_per_token_matches_megatron_formula():
    # Narayanan et al. 2021: 72 B s L h^2 (1 + s / 6h + V / 12hL) per iteration (f = 4h).
    config = GPTConfig.from_size("gpt2-345m", vocab_size=50304, max_position_embeddings=1024)
    s, h, layers, v = 1024, 1024, 24, 50304
    megatron = 72 * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))
    assert flops_per_token(config, s) * s == pytest.approx(megatron, rel=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_attention_heads=5), "--num-attention-heads 5 must divide --hidden-size 32"),
    (dict(checkpoint_activations=True, checkpoint_num_layers=3, num_layers=4),
     "--checkpoint-num-layers 3 must divide --num-layers 4"),
    (dict(hidden_dropout=1.0), "--hidden-dropout"),
    (dict(vocab_size=0), "the vocab size must be a positive integer"),
    (dict(params_dtype=torch.int32), "params_dtype"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**kwargs)


def test_tensor_parallel_divisibility_is_checked_against_the_model_parallel_size():
    config = tiny_config(vocab_size=66, num_attention_heads=4)
    with pytest.raises(ConfigError, match="--model-parallel-size 4 must divide the padded "
                                          "vocab size 66"):
        config.validate(model_parallel_size=4)
    with pytest.raises(ConfigError, match="--model-parallel-size 8 must divide "
                                          "--num-attention-heads 4"):
        tiny_config(vocab_size=64).validate(model_parallel_size=8)
    try:  # GPT2Model checks against the live tensor-parallel size
        mpu.set_model_parallel_world_size(4)
        with pytest.raises(ConfigError, match="vocab size 66"):
            GPT2Model(config)
    finally:
        mpu.destroy_model_parallel()


def test_weight_decay_groups():
    model = GPT2Model(tiny_config(num_layers=1))
    decay, no_decay = param_groups_for_weight_decay(model)
    assert no_decay["weight_decay"] == 0.0 and "weight_decay" not in decay
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert no_decay_names == {n for n in names.values() if n.endswith("bias")
                              or "layernorm" in n}
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    assert len(decay["params"]) == 6  # 2 embeddings + 4 linear weights


def test_init_distribution():
    torch.manual_seed(0)
    model = GPT2Model(GPTConfig(num_layers=8, hidden_size=64, num_attention_heads=4,
                                vocab_size=256, max_position_embeddings=32))
    layer = model.language_model.transformer.layers[0]
    assert abs(layer.mlp.dense_h_to_4h.weight.std().item() - 0.02) < 2e-3
    assert abs(layer.mlp.dense_4h_to_h.weight.std().item() - 0.02 / 4) < 5e-4
    assert abs(layer.attention.dense.weight.std().item() - 0.02 / 4) < 5e-4
    assert torch.all(layer.attention.query_key_value.bias == 0)
    assert torch.all(layer.input_layernorm.weight == 1)


def test_bf16_params():
    model = GPT2Model(tiny_config(params_dtype=torch.bfloat16))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.language_model.transformer.layers[0].attention.dense.weight.model_parallel
    tokens, positions = _inputs()
    losses = model(tokens, positions, labels=tokens)
    assert losses.dtype == torch.float32 and torch.isfinite(losses).all()


def test_attention_is_causal():
    model = GPT2Model(tiny_config()).eval()
    tokens, positions = _inputs()
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens, positions), model(changed, positions)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_checkpoint_activations_gradients_equal_with_dropout():
    grads = []
    for checkpoint_activations in (False, True):
        torch.manual_seed(3)
        mpu.model_parallel_cuda_manual_seed(3)
        model = GPT2Model(tiny_config(num_layers=4, hidden_dropout=0.3, attention_dropout=0.3,
                                      checkpoint_activations=checkpoint_activations,
                                      checkpoint_num_layers=2))
        tokens, positions = _inputs()
        model(tokens, positions, labels=tokens).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT2Model(tiny_config(hidden_size=64, num_layers=2))
    tokens, positions = _inputs(batch=4, seq=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(100):
        loss = model(tokens, positions, labels=tokens.roll(-1, dims=1)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5


def test_compile_keeps_the_state_dict_and_the_function():
    """GPT2Model.compile compiles each layer in place (the same state-dict keys); loss and
    gradients equal eager's to fp32 rounding (the compiled GeLU is spelled with a sigmoid)."""
    torch.manual_seed(0)
    eager = GPT2Model(tiny_config())
    compiled = GPT2Model(tiny_config())
    compiled.load_state_dict(eager.state_dict())
    compiled.compile()
    assert list(compiled.state_dict()) == list(eager.state_dict())
    tokens, positions = _inputs()
    losses = []
    for model in (eager, compiled):
        loss = model(tokens, positions, labels=tokens.roll(-1, dims=1)).mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_fullgraph_compile_of_layers_that_must_break_is_a_config_error(monkeypatch):
    """Attention dropout breaks a compiled layer only off the CPU at tensor-parallel size > 1
    (there it runs eagerly under the RNG tracker); on the CPU its masks are hashed inside the
    layer's one graph, at size 1 off the CPU they are SDPA's own."""
    GPT2Model(tiny_config(attention_dropout=0.1)).to("meta").compile(fullgraph=True)
    model = GPT2Model(tiny_config(attention_dropout=0.1)).to("meta")
    monkeypatch.setattr(mpu, "get_model_parallel_world_size", lambda: 2)
    with pytest.raises(ConfigError, match="attention dropout off the CPU at tensor-parallel"):
        model.compile(fullgraph=True)


def _compiled_regions(model):
    """The modules of `model` that nn.Module.compile compiled."""
    return [name for name, module in model.named_modules()
            if module._compiled_call_impl is not None]


@pytest.mark.parametrize("where, regions", [
    ("cpu", ["language_model.transformer.layers.0", "language_model.transformer.layers.1"]),
    ("meta", ["language_model.transformer"]),  # a device other than the CPU
    ("meta, two data-parallel ranks", ["language_model.transformer.layers.0",
                                       "language_model.transformer.layers.1"]),
    ("meta, activation checkpointing", ["language_model.transformer.layers.0",
                                        "language_model.transformer.layers.1"]),
    ("meta, gradients per layer", ["language_model.transformer.layers.0",
                                   "language_model.transformer.layers.1"]),
])
def test_the_stack_is_one_region_on_a_lone_gpu(where, regions, monkeypatch):
    """compile() makes each layer a region, except off the CPU with one rank of every kind,
    no recompute and no engine freeing or offloading gradients layer by layer (ZeRO stage
    2, optimizer offload; the engine says so): there the stack of layers is one."""
    config = tiny_config(checkpoint_activations="checkpointing" in where)
    model = GPT2Model(config).to(where.split(",")[0])
    if "data-parallel" in where:
        monkeypatch.setattr(mpu, "get_data_parallel_world_size", lambda: 2)
    model.compile(gradients_per_layer="gradients" in where)
    assert _compiled_regions(model) == regions
    assert model.compiled_regions == ("each layer" if len(regions) > 1 else
                                      "the stack of layers as one region")


def test_the_stack_compiles_as_one_graph_with_dropout():
    """The stack as one region traces whole, dropout included (fullgraph: no break), with
    each layer's code traced once per layer; without dropout it computes what eager does."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    model = GPT2Model(tiny_config(attention_dropout=0.1, hidden_dropout=0.1))
    model.language_model.transformer.compile(backend=recording_backend, fullgraph=True)
    tokens, positions = _inputs()
    model(tokens, positions, labels=tokens).mean().backward()
    assert len(graphs) == 1
    traced = [node.target for node in graphs[0].graph.nodes]
    assert sum(target is torch.nn.functional.layer_norm for target in traced) == 2 * 2 + 1
    torch.manual_seed(0)
    eager = GPT2Model(tiny_config())
    compiled = GPT2Model(tiny_config())
    compiled.load_state_dict(eager.state_dict())
    compiled.language_model.transformer.compile()
    losses = [m(tokens, positions, labels=tokens).mean() for m in (eager, compiled)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)


def test_cpu_layers_with_dropout_compile_whole():
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    model = GPT2Model(tiny_config(attention_dropout=0.1, hidden_dropout=0.1))
    model.compile(backend=recording_backend, fullgraph=True)
    tokens, positions = _inputs()
    model(tokens, positions, labels=tokens).mean().backward()
    assert len(graphs) == 1  # one graph, shared by both layers, with both dropouts in it


@pytest.mark.parametrize("split_transformers", [False, True])
def test_every_layer_call_goes_through_the_compiled_code(split_transformers):
    """With a backend that records what it is given: every layer, or with
    --split-transformers each half, is traced (none bypasses the compiled module call), and
    the recorded graphs compute what eager does."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    config = tiny_config(num_layers=2, checkpoint_activations=split_transformers,
                         split_transformers=split_transformers)
    torch.manual_seed(0)
    eager = GPT2Model(config)
    compiled = GPT2Model(config)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(backend=recording_backend)
    tokens, positions = _inputs()
    losses = [model(tokens, positions, labels=tokens).mean() for model in (eager, compiled)]
    torch.testing.assert_close(losses[1], losses[0])
    traced = [node.target for graph in graphs for node in graph.graph.nodes]
    layer_norms = sum(target is torch.nn.functional.layer_norm for target in traced)
    assert layer_norms == 2, traced  # the two LayerNorms of a layer, traced once for all layers


def test_compiled_loss_is_mpus_cross_entropy():
    """Off the CPU at tensor-parallel size 1, compile() compiles the loss too (on the CPU
    mpu's chunked loss is as fast); it gives mpu's per-token losses and logit gradients."""
    on_cpu = GPT2Model(tiny_config())
    on_cpu.compile()
    assert on_cpu._compiled_loss is None
    model = GPT2Model(tiny_config()).to("meta")  # a device other than the CPU
    model.compile()
    assert model._compiled_loss is not None
    generator = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(2, 8, 64, generator=generator)).bfloat16()
    labels = torch.randint(0, 64, (2, 8), generator=generator)
    results = []
    for loss_fn in (mpu.vocab_parallel_cross_entropy, model._compiled_loss):
        x = logits.clone().requires_grad_()
        loss = loss_fn(x, labels)
        (loss * torch.linspace(0.5, 1.5, 16).view(2, 8)).sum().backward()
        results.append((loss, x.grad))
    assert results[1][0].dtype == torch.float32 and results[1][0].shape == labels.shape
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-2, atol=1e-3)
