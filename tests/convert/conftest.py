"""Shared pieces of the conversion / generation / evaluation tests."""

import importlib.util
import os

import pytest
import torch

from megatron.convert.loaders import ModelWeights
from megatron.convert.tp_layout import WORD_EMBEDDINGS
from megatron.model import GPT2Model, GPTConfig
from tests.training.conftest import corpus  # noqa: F401  (the shared tiny BPE corpus)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_weights(num_layers=2, hidden_size=48, num_heads=6, vocab_size=301, positions=40,
                   ffn_hidden_size=None, eps=1e-5, seed=0, **extra_args):
    """ModelWeights of a randomly initialised GPT-2 (biases and LayerNorms randomised too,
    so a wrong transpose or permutation cannot hide behind zeros and ones)."""
    torch.manual_seed(seed)
    config = GPTConfig(num_layers=num_layers, hidden_size=hidden_size,
                       num_attention_heads=num_heads, vocab_size=vocab_size,
                       max_position_embeddings=positions, ffn_hidden_size=ffn_hidden_size,
                       layernorm_epsilon=eps, hidden_dropout=0.0, attention_dropout=0.0)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in GPT2Model(config).state_dict().items()}
    state[WORD_EMBEDDINGS] = state[WORD_EMBEDDINGS][:vocab_size].clone()
    args = dict(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_heads,
                ffn_hidden_size=config.ffn_hidden_size, max_position_embeddings=positions,
                layernorm_epsilon=eps, orig_vocab_size=vocab_size,
                make_vocab_size_divisible_by=8, **extra_args)
    return ModelWeights(state, args, "test")


def tokenized_weights(corpus_files, **shape):
    """(random_weights of a 2-layer model on the shared tiny BPE corpus's tokenizer, that
    tokenizer): what the tools need to run from --load alone."""
    from megatron.tokenizer import build_tokenizer
    tokenizer = build_tokenizer("GPT2BPETokenizer", corpus_files["vocab"],
                                corpus_files["merges"])
    weights = random_weights(num_layers=2, vocab_size=tokenizer.vocab_size,
                             tokenizer_type="GPT2BPETokenizer", vocab_file=corpus_files["vocab"],
                             merge_file=corpus_files["merges"], **shape)
    return weights, tokenizer


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool(name):
    """tools/<name>.py as a module (tools/ is not a package), to call its main(argv)."""
    spec = importlib.util.spec_from_file_location(f"{name}_tool",
                                                  os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
