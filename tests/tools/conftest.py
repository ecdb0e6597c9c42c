"""Fixtures of the tensor-parallel checkpoint tests (helpers: tests/tools/tp_checkpoints.py):
one tiny corpus, and the TP=2 checkpoints the tests convert, made once per session. The
helpers are imported by the fixtures, so other tests here do not load the trainer."""

import json
import random

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    from megatron.data.preprocessing import ConstantFactory, tokenize_loose_json
    from megatron.tokenizer import build_tokenizer
    from megatron.tokenizer.bpe_trainer import (count_pretokens, train_byte_level_bpe,
                                                write_gpt2_files)
    from tests.tools.tp_checkpoints import VOCAB_SIZE, WORDS
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(30, 90))) + "." for _ in range(150)]
    json_path = root / "data.json"
    json_path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    vocab, merges = write_gpt2_files(
        train_byte_level_bpe(count_pretokens(texts), vocab_size=VOCAB_SIZE), str(root / "tok"))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    assert tokenizer.vocab_size == VOCAB_SIZE
    prefix = str(root / "corpus")
    tokenize_loose_json(str(json_path), prefix, ConstantFactory(tokenizer), append_eod=True)
    return {"vocab": vocab, "merges": merges, "prefix": prefix + "_text_document"}


@pytest.fixture(scope="session")
def tp2_run(corpus, tmp_path_factory):
    """A TP=2 fp32 checkpoint at iteration 3 of 6 (model, Adam state, RNG), and the losses
    of iterations 4-6 when TP=2 resumes from it."""
    from tests.tools.tp_checkpoints import losses, pretrain_argv, pretrain_tp2
    root = tmp_path_factory.mktemp("tp2")
    save = str(root / "ckpt")
    pretrain_tp2(pretrain_argv(corpus, root / "first", "--save", save, "--exit-interval", "3"))
    pretrain_tp2(pretrain_argv(corpus, root / "tp2", "--load", save))
    return {"root": root, "save": save, "first": losses(root / "first"),
            "resumed": losses(root / "tp2")}


@pytest.fixture(scope="session")
def tp2_bf16_checkpoint(corpus, tmp_path_factory):
    """A TP=2 bf16 checkpoint: fp32 master weights in the optimizer state."""
    from tests.tools.tp_checkpoints import pretrain_argv, pretrain_tp2
    root = tmp_path_factory.mktemp("tp2_bf16")
    save = str(root / "ckpt")
    pretrain_tp2(pretrain_argv(corpus, root / "log", "--bf16", "--save", save, "--train-iters", "2"))
    return save
