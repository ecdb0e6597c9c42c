"""The tied word embeddings under pipeline parallelism in bf16: the last stage's copy sums the
output layer's gradients over the micro batches in fp32 where the engine sums in fp32 (bf16's
default at stage 0), and the first stage adds that sum to the embedding's fp32 sums unrounded;
summed in bf16 (asked for), both are bf16 sums. Two gloo ranks, one per stage, against the
float64 sums of the same bf16 gradients."""

import types

import pytest
import torch

import zero
from tests.dist_utils import run_distributed

VOCAB, HIDDEN, MICRO_BATCHES = 96, 16, 8


class _Embedding(torch.nn.Module):
    """The first stage: the word embeddings, where GPT2Model keeps them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(VOCAB, HIDDEN).to(torch.bfloat16)
        self.language_model = torch.nn.Module()
        self.language_model.embedding = torch.nn.Module()
        self.language_model.embedding.word_embeddings = embedding
        self.config = types.SimpleNamespace(vocab_size=VOCAB, hidden_size=HIDDEN)

    def forward(self, tokens):
        return self.language_model.embedding.word_embeddings(tokens).float().pow(2).mean()


def _tokens(index):
    return torch.randint(VOCAB, (4, 8), generator=torch.Generator().manual_seed(index))


def _hidden(index):
    generator = torch.Generator().manual_seed(1000 + index)
    return torch.randn(32, HIDDEN, generator=generator).to(torch.bfloat16)


def _config(grad_accum_dtype):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICRO_BATCHES,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 0},
            "data_types": {"grad_accum_dtype": grad_accum_dtype},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _two_stages(rank, world_size, grad_accum_dtype):
    """Stage 0 trains the embeddings over the micro batches; stage 1 multiplies hidden states
    by its copy. Returns stage 0's fp32 master gradient at the step and each side's float64
    sum of its bf16 gradients."""
    from megatron import mpu
    from megatron.pipeline.tied_embeddings import TiedEmbeddings
    mpu.initialize_model_parallel(1, pipeline_model_parallel_size=2)
    model = _Embedding()
    engine, *_ = zero.initialize(model=model, config=_config(grad_accum_dtype), mpu=mpu)
    tied = TiedEmbeddings(model if rank == 0 else types.SimpleNamespace(config=model.config),
                          engine.optimizer, torch.device("cpu"), torch.bfloat16)
    tied.sync_weights()
    own = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    if rank == 1:
        for index in range(MICRO_BATCHES):
            _output_loss(index, tied.weight).backward()
            own += _bf16_grad(_output_loss, index, tied.weight)
            tied.collect_grad()
        tied.send_grad()
        for _ in range(MICRO_BATCHES):
            engine.step()  # (every stage steps: the global norm is taken over both)
        return None, own
    seen = {}
    norm = engine.optimizer._reduced_grad_norm_sq

    def capture():
        seen["grad"] = engine.optimizer.groups[0].master.grad.view(VOCAB, HIDDEN).clone()
        return norm()
    engine.optimizer._reduced_grad_norm_sq = capture
    weight = model.language_model.embedding.word_embeddings.weight
    for index in range(MICRO_BATCHES):
        if index == MICRO_BATCHES - 1:
            tied.receive_grad()  # as the schedule does, before the last backward
        engine.backward(engine(_tokens(index)))
        own += _bf16_grad(_embedding_loss_per_micro_batch, index, weight)
        engine.step()
    return seen["grad"], own


def _output_loss(index, weight):
    logits = _hidden(index) @ weight.t()
    return logits.float().pow(2).mean() / MICRO_BATCHES


def _embedding_loss_per_micro_batch(index, weight):
    """The loss stage 0's engine backpropagates (divided by the micro batches)."""
    loss = torch.nn.functional.embedding(_tokens(index), weight).float().pow(2).mean()
    return loss / MICRO_BATCHES


def _bf16_grad(loss, index, weight):
    """Micro batch `index`'s bf16 gradient of `loss` (recomputed on a copy of `weight`)."""
    copy = weight.detach().clone().requires_grad_()
    loss(index, copy).backward()
    return copy.grad.double()


@pytest.mark.parametrize("grad_accum_dtype, bounds", [("fp32", (0, 1e-6)),
                                                      ("bf16", (1e-4, 2e-2))])
def test_the_output_layers_gradient_joins_the_embeddings_sum_in_the_engines_dtype(
        grad_accum_dtype, bounds):
    (found, embedding_sum), (_, output_sum) = run_distributed(_two_stages, 2,
                                                              args=(grad_accum_dtype,))
    expected = embedding_sum + output_sum
    error = ((found.double() - expected).abs().max() / expected.abs().max()).item()
    assert bounds[0] <= error < bounds[1], error
