"""zero.activation_checkpointing.recompute: DeepSpeed's activation checkpointing API on its own (no megatron)."""

import json

import pytest
import torch
import torch.nn.functional as F

from zero import ConfigError, checkpointing


@pytest.fixture(autouse=True)
def fresh_state():
    checkpointing.unconfigure()
    yield
    checkpointing.unconfigure()


def _block(x, w):
    """Dropout on the default stream and on the tracked stream, like a transformer layer."""
    h = F.dropout(torch.tanh(x @ w), 0.5, training=True)
    with checkpointing.get_cuda_rng_tracker().fork():
        h = F.dropout(h @ w, 0.5, training=True)
    return h.sin()


def _grads(use_checkpoint, layers=3, rng_seed=7):
    torch.manual_seed(0)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(layers)]
    x = torch.randn(6, 8, requires_grad=True)
    checkpointing.model_parallel_cuda_manual_seed(rng_seed)
    h = x
    for w in weights:
        h = checkpointing.checkpoint(_block, h, w) if use_checkpoint else _block(h, w)
    h.sum().backward()
    return [x.grad] + [w.grad for w in weights] + [torch.rand(2)]


@pytest.mark.parametrize("options", [
    {}, {"checkpoint_in_cpu": True, "synchronize": True},
    {"contiguous_checkpointing": True, "num_checkpoints": 3, "partition_activations": True}])
def test_gradients_and_rng_streams_equal_plain_backward(options):
    checkpointing.configure(None, **options)
    plain, checkpointed = _grads(False), _grads(True)
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)
    assert not torch.equal(plain[1], _grads(False, rng_seed=8)[1]), "dropout must act"


def test_configure_reads_the_section_and_arguments_win(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True,
        "contiguous_memory_optimization": True, "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True, "profile": True}}))
    checkpointing.configure(None, deepspeed_config=str(path), profile=False)
    assert checkpointing.is_configured()
    assert checkpointing.get_options() == checkpointing.CheckpointingOptions(
        partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4,
        checkpoint_in_cpu=True, synchronize=True, profile=False)
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {}})
    assert checkpointing.get_options() == checkpointing.CheckpointingOptions()


@pytest.mark.parametrize("kwargs, message", [
    (dict(contiguous_checkpointing=True), "needs num_checkpoints"),
    (dict(num_checkpoints=0), "positive integer"),
    (dict(deepspeed_config={"activation_checkpointing": {"partition_activation": True}}),
     "partition_activations"),
    (dict(deepspeed_config={"activation_checkpointing": {
        "contiguous_memory_optimization": True}}), "needs num_checkpoints"),
])
def test_bad_options_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        checkpointing.configure(None, **kwargs)
    assert not checkpointing.is_configured()


def test_model_parallel_seed_streams():
    checkpointing.model_parallel_cuda_manual_seed(1234)
    with checkpointing.get_cuda_rng_tracker().fork():
        tracked = torch.rand(3)
    default = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(default, torch.rand(3))
    torch.manual_seed(1234 + 2718 + 0)
    assert torch.equal(tracked, torch.rand(3))


def test_contiguous_buffer_overflow_and_reset():
    checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    checkpointing.checkpoint(torch.matmul, x, w)
    checkpointing.checkpoint(torch.matmul, x, w)
    with pytest.raises(RuntimeError, match="num_checkpoints"):
        checkpointing.checkpoint(torch.matmul, x, w)
    checkpointing.reset()  # the graphs above are dropped without backward
    out = checkpointing.checkpoint(torch.matmul, x, w)
    out.sum().backward()
    assert torch.equal(w.grad, x.sum(0, keepdim=True).t().expand(8, 8))


def test_profile_measures_every_checkpoint(capsys):
    checkpointing.configure(None, profile=True)
    _grads(True, layers=3)
    records = checkpointing.last_profile()
    assert [r["index"] for r in records] == [0, 1, 2]
    for record in records:
        assert record["forward"] > 0 and record["recompute"] > 0 and record["backward"] > 0
    assert "activation checkpoint times (ms, forward/recompute/backward): 0: " in \
        capsys.readouterr().out


def test_autograd_grad_is_refused():
    checkpointing.configure(None)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    out = checkpointing.checkpoint(torch.matmul, x, w)
    with pytest.raises(RuntimeError, match="not compatible with .grad"):
        torch.autograd.grad(out.sum(), [x])


def test_without_grad_runs_plainly_and_warns_without_inputs_needing_grad():
    checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=1)
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    with torch.no_grad():
        for _ in range(3):  # no buffer rows used: nothing will run backward
            checkpointing.checkpoint(torch.matmul, x, w)
    with pytest.warns(UserWarning, match="no input requires grad"):
        checkpointing.checkpoint(torch.matmul, x, w.detach())
