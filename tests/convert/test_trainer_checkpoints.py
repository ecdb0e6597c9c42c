"""Conversions of real trainer checkpoints: HF weights continue pretraining, --deepspeed
checkpoints (ZeRO stages 1, 2 and 3, and stage 3 with tiled linears) convert to HF with the
same logits, a missing `latest`."""

import json
import os
import shutil

import pytest
import torch

import pretrain_gpt2
from megatron.convert.loaders import load_model_weights
from megatron.convert.savers import save_model_weights
from megatron.inference.loading import build_model_from_weights
from megatron.model.tiling import join_tiled_weights
from tests.convert.conftest import load_tool, random_weights
from tests.training.test_deepspeed import TINY, read_losses, stage_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

tool = load_tool("convert_checkpoint")


def _train(corpus, log_dir, *extra):
    argv = TINY + ["--batch-size", "4", "--data-path", corpus["prefix"], "--vocab-file",
                   corpus["vocab"], "--merge-file", corpus["merges"], "--log-dir", str(log_dir),
                   "--attention-dropout", "0", "--hidden-dropout", "0"] + [str(e) for e in extra]
    assert pretrain_gpt2.main(argv) == 0
    return read_losses(log_dir)


def test_hf_weights_continue_pretraining(corpus, tmp_path):
    """An HF GPT-2 (with the corpus's tokenizer files) -> Megatron -> 3 more iterations."""
    from megatron.tokenizer import build_tokenizer
    vocab_size = build_tokenizer("GPT2BPETokenizer", corpus["vocab"], corpus["merges"]).vocab_size
    weights = random_weights(num_layers=2, hidden_size=32, num_heads=4, vocab_size=vocab_size,
                             positions=32, tokenizer_type="GPT2BPETokenizer",
                             vocab_file=corpus["vocab"], merge_file=corpus["merges"])
    save_model_weights(weights, str(tmp_path / "hf"), "hf")
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "merges.txt",
                                                   "model.safetensors", "vocab.json"]
    assert tool.main(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "meg"),
                      "--saver", "megatron"]) == 0
    losses = _train(corpus, tmp_path / "log", "--train-iters", "3", "--load",
                    tmp_path / "meg", "--save", tmp_path / "trained",
                    "--make-vocab-size-divisible-by", "128")
    assert sorted(losses) == [1, 2, 3]
    assert losses[3][0] < losses[1][0]
    trained = load_model_weights(str(tmp_path / "trained"))
    assert trained.iteration == 3
    # It started from the HF weights: far closer to them than to a fresh initialisation.
    name = "language_model.transformer.layers.0.mlp.dense_h_to_4h.bias"
    start = weights.state_dict[name]
    assert (trained.state_dict[name] - start).abs().max() < 0.05 < start.abs().max()


@pytest.fixture(scope="module")
def deepspeed_checkpoints(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    saves = {}
    runs = {1: (1, []), 2: (2, []), 3: (3, []),
            "3-tiled": (3, ["--memory-centric-tiled-linear", "--tile-factor", "2"])}
    for name, (stage, extra) in runs.items():
        saves[name] = str(root / f"stage{name}")
        _train(corpus, root / f"log{name}", "--train-iters", "2", "--deepspeed",
               "--deepspeed_config", stage_config(root, stage), "--save", saves[name], *extra)
    return saves


@pytest.mark.parametrize("stage", [1, 2, 3, "3-tiled"])
def test_deepspeed_checkpoint_to_hf_has_the_same_logits(deepspeed_checkpoints, stage, tmp_path):
    from zero import get_fp32_state_dict_from_zero_checkpoint
    save = deepspeed_checkpoints[stage]
    assert tool.main(["--load-dir", save, "--save-dir", str(tmp_path / "hf"),
                      "--saver", "hf"]) == 0  # --loader detected: deepspeed
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    # tiled: the masters are per tile, the converted weights untiled
    consolidated = join_tiled_weights(get_fp32_state_dict_from_zero_checkpoint(save))
    weights = load_model_weights(save)
    assert weights.source_format == "deepspeed" and weights.iteration == 2
    for name, tensor in weights.state_dict.items():  # the trained fp32 masters, unpadded
        assert torch.equal(tensor, consolidated[name][:tensor.shape[0]]), name
    vocab = weights.vocab_size
    tokens = torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = build_model_from_weights(weights)(tokens, torch.arange(20).expand(2, 20))
        assert torch.allclose(ours[..., :vocab], hf(tokens).logits, atol=1e-5, rtol=0)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == vocab and config["eos_token_id"] is not None


def test_deepspeed_checkpoint_without_latest(deepspeed_checkpoints, tmp_path, capsys):
    copy = str(tmp_path / "copy")
    shutil.copytree(deepspeed_checkpoints[1], copy)
    os.remove(os.path.join(copy, "latest"))
    assert tool.main(["--load-dir", copy, "--save-dir", str(tmp_path / "hf"), "--saver", "hf",
                      "--loader", "deepspeed"]) == 2
    err = capsys.readouterr().err
    assert "no 'latest' file" in err and "global_step2" in err
