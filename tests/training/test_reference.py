"""The trainer against a plain PyTorch loop: same model, same data, torch.optim.AdamW,
torch.nn.utils.clip_grad_norm_, the learning-rate schedule written out here, gradient
accumulation by summing micro-batch losses. The trainer's whole step stack (the zero engine
at stage 0: flat buffers, fp32 masters, fused Adam, its clipping and schedule) must give the
same losses."""

import json
import math

import pytest
import torch

import pretrain_gpt2
from megatron.config import resolve_config
from megatron.gpt2 import forward_step, train_valid_test_datasets_provider
from megatron.model import GPT2Model
from megatron.runtime.initialize import destroy, initialize_megatron
from megatron.tokenizer import build_tokenizer
from megatron.training.loop import _data_iterator
from megatron.training.param_groups import get_param_groups
from megatron.training.pretrain import TrainContext, model_config, num_samples_per_split
from tests.training.test_deepspeed import NO_DROPOUT, trainer_argv

ITERS, LR, MIN_LR, WARMUP = 6, 3e-3, 3e-4, 2


def _lr(steps_taken):
    """Linear warmup over WARMUP steps, then cosine from LR to MIN_LR at step ITERS."""
    if steps_taken <= WARMUP:
        return LR * steps_taken / WARMUP
    ratio = (steps_taken - WARMUP) / (ITERS - WARMUP)
    return max(MIN_LR, LR * 0.5 * (1 + math.cos(math.pi * ratio)))


def _plain_pytorch_losses(argv, clip):
    config = resolve_config(argv, world_size=1)
    runtime = initialize_megatron(config.parallel)  # seeds as the trainer does
    try:
        data = config.data
        tokenizer = build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file)
        ctx = TrainContext(config, tokenizer, runtime, model_config(config, tokenizer.vocab_size))
        model = GPT2Model(ctx.model_config)
        optimizer = torch.optim.AdamW(get_param_groups(model, config.optimizer.weight_decay),
                                      lr=LR, betas=(0.9, 0.999), eps=1e-8)
        train, _, _ = train_valid_test_datasets_provider(ctx, num_samples_per_split(config))
        batches = _data_iterator(train, 0, ctx)
        micro = config.training.num_micro_batches
        losses = []
        for step in range(ITERS):
            for group in optimizer.param_groups:
                group["lr"] = _lr(step)
            total = 0.0
            for _ in range(micro):
                loss = forward_step(next(batches), model, ctx)
                (loss / micro).backward()
                total += loss.item() / micro
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total)
        return losses
    finally:
        destroy()


@pytest.mark.parametrize("clip", [1.0, 0.05], ids=["clip-1.0", "clip-0.05"])
def test_trainer_matches_a_plain_pytorch_loop(corpus, tmp_path, clip):
    argv = trainer_argv(corpus, tmp_path / "log", ITERS, *NO_DROPOUT, "--lr", LR, "--min-lr",
                        MIN_LR, "--warmup-iters", WARMUP, "--lr-decay-style", "cosine",
                        "--clip-grad", clip, "--global-batch-size", 8,
                        "--tokenizer-type", "GPT2BPETokenizer")
    assert pretrain_gpt2.main(argv) == 0
    with open(tmp_path / "log" / "metrics.jsonl") as f:
        trainer = [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]
    plain = _plain_pytorch_losses(argv, clip)
    assert len(trainer) == len(plain) == ITERS
    assert trainer == pytest.approx(plain, rel=2e-6)
    assert plain[-1] < plain[0] - 0.1  # it trains
