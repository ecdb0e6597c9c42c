"""The CUDA paths, checked against the CPU results: the ZeRO engine's stages and offload
(host masters fed from device gradients), and the GPT model compiled, recomputed and with
dropout under the model-parallel RNG tracker. Skipped without a CUDA device (CI has none);
run them where one is: `python -m pytest tests/test_cuda.py`."""

import pytest
import torch

from megatron import mpu
from megatron.model import GPT2Model
from tests.model.cases import tiny_config
from tests.zero import engine_cases as cases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 6
NVME = {"device": "nvme", "pipeline_read": True, "pipeline_write": True}
ZERO_VARIANTS = {  # name -> (stage, zero_optimization keys; "NVME" gets the test's folder)
    "stage 0": (0, {}),  # one rank: no gradient hooks, buckets handled after backward
    "stage 1": (1, {}),
    "stage 1, optimizer on cpu": (1, {"offload_optimizer": {"device": "cpu",
                                                            "pin_memory": True}}),
    "stage 2": (2, {}),
    "stage 2, optimizer on cpu": (2, {"offload_optimizer": {"device": "cpu",
                                                            "pin_memory": True}}),
    "stage 2, optimizer on nvme": (2, {"sub_group_size": 500, "offload_optimizer": NVME}),
    "stage 3": (3, {}),
    "stage 3, optimizer on cpu": (3, {"offload_optimizer": {"device": "cpu",
                                                            "pin_memory": True}}),
    "stage 3, optimizer and parameters on cpu": (3, {
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}}),
    "stage 3, optimizer and parameters on nvme": (3, {
        "sub_group_size": 500, "offload_optimizer": NVME,
        "offload_param": {"device": "nvme", "max_in_cpu": 0, "buffer_count": 3}}),
}


@pytest.mark.parametrize("variant", list(ZERO_VARIANTS))
def test_zero_on_cuda_matches_the_cpu_reference(variant, tmp_path):
    stage, options = ZERO_VARIANTS[variant]
    for section in ("offload_optimizer", "offload_param"):
        if options.get(section, {}).get("device") == "nvme":
            options = {**options, section: {**options[section], "nvme_path": str(tmp_path)}}
    engine = cases.make_engine(cases.ds_config(stage, **options))
    assert engine.device.type == "cuda"
    losses = cases.train_steps(engine, STEPS)
    engine.destroy()
    reference = cases.train_reference(STEPS)[0]
    assert max(abs(a - b) / b for a, b in zip(losses, reference)) < 1e-4, (losses, reference)


def _loss_and_grads(model, tokens, positions, seed=None):
    if seed is not None:
        mpu.model_parallel_cuda_manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, labels=tokens.roll(-1, dims=1)).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cuda_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT2Model(tiny_config(**overrides)).cuda()


def _inputs():
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
    return tokens, torch.arange(8, device="cuda").expand(2, 8)


def test_compiled_model_on_cuda_matches_eager():
    """On one GPU compile() makes the stack of layers one region (and compiles the loss)."""
    eager, compiled = _cuda_model(), _cuda_model()
    compiled.compile()
    assert [name for name, m in compiled.named_modules()
            if m._compiled_call_impl is not None] == ["language_model.transformer"]
    tokens, positions = _inputs()
    (loss_e, grads_e), (loss_c, grads_c) = (_loss_and_grads(m, tokens, positions)
                                            for m in (eager, compiled))
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("stage, regions", [(0, "the stack of layers as one region"),
                                           (1, "the stack of layers as one region"),
                                           (2, "each layer")])
def test_the_engine_keeps_a_region_per_layer_where_it_takes_gradients_per_layer(stage,
                                                                                 regions):
    """ZeRO stage 2 frees each gradient during backward: the engine's compile tells the model,
    which keeps a region per layer; at stages 0 and 1 the stack is one region."""
    model = _cuda_model()
    engine = cases.make_engine({**cases.ds_config(stage), "compile": {"enabled": True}},
                               model=model)
    assert model.compiled_regions == regions
    tokens, positions = _inputs()
    engine.backward(engine(tokens, positions, labels=tokens.roll(-1, dims=1)).mean())
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("compiled", [False, True])
def test_dropout_on_cuda_replays_under_recompute(compiled):
    """With dropout, recomputed layers draw the masks of the first forward (the tracker's
    CUDA states replayed), so gradients equal those without recompute."""
    dropout = dict(hidden_dropout=0.2, attention_dropout=0.2)
    plain = _cuda_model(**dropout)
    recomputed = _cuda_model(**dropout, checkpoint_activations=True)
    if compiled:  # the same regions, each layer, for both (recompute runs per layer)
        for model in (plain, recomputed):
            for layer in model.language_model.transformer.layers:
                layer.compile()
    tokens, positions = _inputs()
    loss_p, grads_p = _loss_and_grads(plain, tokens, positions, seed=7)
    loss_r, grads_r = _loss_and_grads(recomputed, tokens, positions, seed=7)
    plain.eval()
    with torch.no_grad():
        no_dropout = plain(tokens, positions, labels=tokens.roll(-1, dims=1)).mean()
    assert not torch.equal(no_dropout, loss_p)  # dropout did act
    torch.testing.assert_close(loss_r, loss_p, rtol=0, atol=0)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_compiled_stack_with_dropout_is_one_graph_and_reseeds():
    """At tensor-parallel size 1 attention dropout is SDPA's own inside the graph (no break:
    fullgraph), drawn from the default generator, so the same seed gives the same masks."""
    model = _cuda_model(hidden_dropout=0.2, attention_dropout=0.2)
    model.compile(fullgraph=True)
    tokens, positions = _inputs()
    first, second = (_loss_and_grads(model, tokens, positions, seed=7) for _ in range(2))
    other = _loss_and_grads(model, tokens, positions, seed=8)
    torch.testing.assert_close(second[0], first[0], rtol=0, atol=0)
    assert not torch.equal(other[0], first[0])


def test_read_later_gives_the_value_of_queued_work():
    from megatron.runtime.device import read_later
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda._sleep(10 ** 9)  # the GPU is still busy when read() is called
    total = (x @ x).sum()
    read = read_later(total)
    x = x @ x / 1024  # queued after the copy
    assert read() == total.item()


_SEEDED_BEFORE_CUDA = """
import torch
from zero.activation_checkpointing.rng_tracker import RNGStatesTracker, seed_model_parallel
tracker = RNGStatesTracker()
seed_model_parallel(tracker, 7, tensor_parallel_rank=1)  # CUDA not initialised yet
assert not torch.cuda.is_initialized()
default = torch.rand(4, device="cuda")
with tracker.fork():
    forked = torch.rand(4, device="cuda")
torch.cuda.manual_seed(7)
assert torch.equal(default, torch.rand(4, device="cuda")), "the default stream kept its seed"
torch.cuda.manual_seed(7 + 2718 + 1)
assert torch.equal(forked, torch.rand(4, device="cuda")), "the tracked stream has its own"
"""


_CUDA_STARTED_IN_A_FORK = """
import torch
from zero.activation_checkpointing.rng_tracker import RNGStatesTracker, seed_model_parallel
tracker = RNGStatesTracker()
seed_model_parallel(tracker, 7, tensor_parallel_rank=1)
with tracker.fork():
    torch.rand(4, device="cuda")  # CUDA starts here, drawing from the default generator
with tracker.fork():
    forked = torch.rand(4, device="cuda")
torch.cuda.manual_seed(7 + 2718 + 1)
assert torch.equal(forked, torch.rand(4, device="cuda")), "the stream is not the default's"
"""


@pytest.mark.parametrize("script", [_SEEDED_BEFORE_CUDA, _CUDA_STARTED_IN_A_FORK])
def test_a_stream_added_before_cuda_starts_gets_its_cuda_state_later(script):
    """Seeding before CUDA is initialised (as a CPU-first script does) neither initialises
    CUDA nor hands the tracked stream's seed to the default CUDA generator; CUDA started
    inside a fork does not make the stream a copy of the default generator."""
    _run_in_a_fresh_process(script)


def _run_in_a_fresh_process(script):
    """Runs `script` in a new Python (where CUDA has not started) from the repository root."""
    import subprocess
    import sys
    from pathlib import Path
    subprocess.run([sys.executable, "-c", script], check=True,
                   cwd=Path(__file__).resolve().parents[1])


_CONVERTED_FOR_A_NEW_RANK = """
import torch
from megatron.convert.reshard import FullCheckpoint, _tracker_states_for_rank
stream = "model-parallel-rng"
cpu_saved = {stream: {"cpu": torch.get_rng_state()}}
full = FullCheckpoint({}, 8, None, {"args": {"seed": 7}}, [cpu_saved])
states = _tracker_states_for_rank(full, 1)
assert set(states[stream]) == {"cpu"} and not torch.cuda.is_initialized(), \
    "a checkpoint saved on the CPU opened a CUDA context"
gpu_saved = {stream: {"cpu": torch.get_rng_state(), "cuda": torch.zeros(16, dtype=torch.uint8)}}
full = FullCheckpoint({}, 8, None, {"args": {"seed": 7}}, [gpu_saved])
states = _tracker_states_for_rank(full, 1)
torch.cuda.set_rng_state(states[stream]["cuda"])
drawn = torch.rand(4, device="cuda")
torch.cuda.manual_seed(7 + 2718 + 1)
assert torch.equal(drawn, torch.rand(4, device="cuda")), "the new rank's stream is not its own"
"""


def test_converting_to_a_new_tensor_parallel_rank_seeds_cuda_only_where_saved_on_a_gpu():
    """A rank that did not exist in the checkpoint gets a fresh dropout stream: a CUDA state
    seeded for that rank when the checkpoint was saved on a GPU, and none (and no CUDA
    context opened) when it was saved on the CPU."""
    _run_in_a_fresh_process(_CONVERTED_FOR_A_NEW_RANK)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("stage,offload", [(0, None), (2, None), (3, None), (2, "cpu")])
def test_the_optimizer_on_cuda_steps_on_the_unscaled_clipped_gradient(precision, stage,
                                                                     offload, monkeypatch):
    """Fused Adam on the GPU (or CPUAdam on offloaded masters) divides the loss scale and
    the clip out as it reads the gradients: the first moment is the clipped gradient's."""
    engine = cases.check_first_step_moment(precision, stage, offload, "fused AdamW", 0.05,
                                           monkeypatch)
    assert engine.device.type == "cuda"


def test_the_compiled_decode_step_on_cuda_replays_cuda_graphs_with_the_eager_tokens():
    """On a GPU the compiled one-token step runs as CUDA graphs (none skipped: the KV cache
    is written in place, not copied per replay) and gives the eager cache's greedy tokens,
    with one compile for two calls that share a cache size."""
    from torch._dynamo.utils import counters

    from megatron.inference.loading import build_model_from_weights
    from megatron.inference.text_generation import SamplingParams, TextGenerator
    from tests.convert.conftest import random_weights
    torch._dynamo.reset()
    counters.clear()
    model = build_model_from_weights(random_weights(positions=300), device=torch.device("cuda"))
    greedy = SamplingParams(greedy=True, out_seq_length=25)
    context = torch.randint(0, 301, (2, 7), generator=torch.Generator().manual_seed(2))
    compiled = TextGenerator(model, eod=300, vocab_size=301, compile=True)
    for prompt in (context, context[:, 3:]):
        eager, _ = TextGenerator(model, eod=300, vocab_size=301).generate(prompt, greedy)
        new, _ = compiled.generate(prompt, greedy)
        assert torch.equal(new, eager)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 1
