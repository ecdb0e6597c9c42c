"""Megatron <-> Hugging Face GPT-2: logits equal transformers', round trips are exact, and
bad inputs get clear errors (tools/convert_checkpoint.py)."""

import importlib.util
import json
import os
import shutil

import pytest
import torch

from megatron.checkpointing.files import safe_load
from megatron.checkpointing.state_dicts import to_flat_state_dict
from megatron.convert.loaders import load_model_weights
from megatron.convert.savers import save_model_weights
from megatron.convert.tp_layout import WORD_EMBEDDINGS
from megatron.errors import CheckpointError
from megatron.inference.loading import build_model_from_weights
from tests.convert.conftest import load_tool, random_weights, tokenized_weights

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint_tool", os.path.join(REPO, "tools", "convert_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()

SHAPES = [
    # layers, hidden, heads, vocab (needs padding to a multiple of 8), positions, ffn, eps
    dict(num_layers=2, hidden_size=48, num_heads=6, vocab_size=301, positions=40),
    dict(num_layers=1, hidden_size=32, num_heads=2, vocab_size=128, positions=16,
         ffn_hidden_size=80, eps=1e-6),
    dict(num_layers=3, hidden_size=40, num_heads=5, vocab_size=257, positions=24, seed=3),
]


def _tokens(vocab, positions, seed=1):
    return torch.randint(0, vocab, (2, positions - 3), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers_both_directions(shape, tmp_path):
    weights = random_weights(**shape)
    save_model_weights(weights, str(tmp_path / "hf"), "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = _tokens(shape["vocab_size"], shape["positions"])
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    ours = build_model_from_weights(weights)  # pads the vocab to a multiple of 8
    assert ours.config.vocab_size % 8 == 0
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens, positions)[..., :shape["vocab_size"]]
        back = build_model_from_weights(load_model_weights(str(tmp_path / "hf")))
        got_back = back(tokens, positions)[..., :shape["vocab_size"]]
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    assert torch.allclose(got_back, expected, atol=1e-5, rtol=0)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["layer_norm_epsilon"] == shape.get("eps", 1e-5)
    assert config["n_positions"] == shape["positions"]


def _tool(*argv):
    return tool.main([str(a) for a in argv])


def test_round_trip_megatron_tp2_to_hf_to_megatron_tp1_is_exact(tmp_path):
    weights = random_weights()
    save_model_weights(weights, str(tmp_path / "tp2"), "megatron", target_tp=2)
    assert _tool("--load-dir", tmp_path / "tp2", "--save-dir", tmp_path / "hf",
                 "--saver", "hf") == 0
    assert _tool("--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "tp1",
                 "--saver", "megatron") == 0
    shard = safe_load(str(tmp_path / "tp1" / "release" / "mp_rank_00" / "model_optim_rng.pt"))
    state = to_flat_state_dict(shard["model"])
    assert set(state) == set(weights.state_dict)
    # HF's folder holds no make_vocab_size_divisible_by: Megatron's default 128 applies.
    assert shard["args"]["padded_vocab_size"] == 384 == state[WORD_EMBEDDINGS].shape[0]
    assert not state[WORD_EMBEDDINGS][301:].any()  # padding rows are zeros
    for name, tensor in weights.state_dict.items():
        got = state[name][:301] if name == WORD_EMBEDDINGS else state[name]
        assert torch.equal(got, tensor), name
    tp2 = [safe_load(str(tmp_path / "tp2" / "release" / f"mp_rank_{r:02d}" /
                         "model_optim_rng.pt")) for r in (0, 1)]
    assert tp2[0]["args"]["padded_vocab_size"] == 304  # 301 -> multiple of 8 x 2


def test_megatron_tp_change_through_the_tool_keeps_logits(tmp_path, capsys):
    weights = random_weights(seed=4)
    save_model_weights(weights, str(tmp_path / "tp1"), "megatron")
    assert _tool("--load-dir", tmp_path / "tp1", "--save-dir", tmp_path / "tp2", "--saver",
                 "megatron", "--target-tensor-parallel-size", "2") == 0
    said = capsys.readouterr().out  # launched with as many processes as the layout needs
    assert (f" continue pretraining with: torchrun --nproc_per_node 2 pretrain_gpt2.py --load "
            f"{tmp_path / 'tp2'} --model-parallel-size 2 --tokenizer-type") in said
    assert "training starts at iteration 0 with a fresh optimizer" in said
    again = load_model_weights(str(tmp_path / "tp2"))
    assert again.args["orig_vocab_size"] == 301
    for name, tensor in weights.state_dict.items():
        assert torch.equal(again.state_dict[name], tensor), name


# --------------------------------------------------------------------------- bad inputs

def test_hf_config_of_another_architecture(tmp_path, capsys):
    weights = random_weights()
    save_model_weights(weights, str(tmp_path / "hf"), "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert _tool("--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out",
                 "--saver", "megatron") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model_type 'llama'" in err and "gpt2" in err
    assert not (tmp_path / "out").exists()


def test_unknown_source_format_lists_the_formats(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.npz").write_bytes(b"123")
    assert _tool("--load-dir", tmp_path / "src", "--save-dir", tmp_path / "out",
                 "--saver", "hf") == 2
    err = capsys.readouterr().err
    for name in ("megatron", "deepspeed", "hf", "config.json", "latest"):
        assert name in err


def test_missing_tensor_parallel_rank(tmp_path, capsys):
    save_model_weights(random_weights(), str(tmp_path / "tp2"), "megatron", target_tp=2)
    shutil.rmtree(tmp_path / "tp2" / "release" / "mp_rank_01")
    assert _tool("--load-dir", tmp_path / "tp2", "--save-dir", tmp_path / "out",
                 "--saver", "hf") == 2
    err = capsys.readouterr().err
    assert "mp_rank_01/model_optim_rng.pt is missing" in err


def test_missing_megatron_tracker(tmp_path, capsys):
    save_model_weights(random_weights(), str(tmp_path / "ckpt"), "megatron")
    os.remove(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
    assert _tool("--load-dir", tmp_path / "ckpt", "--save-dir", tmp_path / "out",
                 "--saver", "hf") == 2
    assert "latest_checkpointed_iteration.txt" in capsys.readouterr().err


def test_tokenizer_files_that_cannot_be_the_checkpoints_are_refused(corpus, tmp_path, capsys):
    """A given file that is not there (not 'the checkpoint records'), both kinds at once, or
    the other kind than the checkpoint's tokenizer (it would be copied and never read)."""
    from tests.convert.conftest import tokenized_weights
    weights, _ = tokenized_weights(corpus)  # a GPT-2 BPE model
    save_model_weights(weights, str(tmp_path / "ckpt"), "megatron")
    base = ["--load-dir", tmp_path / "ckpt", "--save-dir", tmp_path / "out", "--saver", "hf"]
    for extra, message in (
            (["--tokenizer-model", tmp_path / "x.model"], f"--tokenizer-model {tmp_path}/x.model "
                                                          "does not exist"),
            (["--tokenizer-model", corpus["vocab"], "--vocab-file", corpus["vocab"]],
             "--tokenizer-model (SentencePiece) and --vocab-file/--merge-file (GPT-2 BPE) are "
             "two tokenizers"),
            (["--tokenizer-model", corpus["vocab"]], "the checkpoint was trained with a "
                                                     "GPT2BPETokenizer: give its --vocab-file and "
                                                     "--merge-file, not --tokenizer-model")):
        assert _tool(*base, *extra) == 2
        assert capsys.readouterr().err.startswith(f"error: {message}")
    assert not (tmp_path / "out").exists()


def test_save_dir_must_be_new(tmp_path, capsys):
    save_model_weights(random_weights(), str(tmp_path / "ckpt"), "megatron")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    assert _tool("--load-dir", tmp_path / "ckpt", "--save-dir", tmp_path / "busy",
                 "--saver", "hf") == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert os.listdir(tmp_path / "busy") == ["keep.txt"]


def test_untied_hf_output_layer_is_refused(tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    save_model_weights(random_weights(), str(tmp_path / "hf"), "hf")
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    state["lm_head.weight"] = torch.randn_like(state["transformer.wte.weight"])
    save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    assert _tool("--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out",
                 "--saver", "megatron") == 2
    assert "does not tie" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    ({"n_embd": 60}, "config.json and the weights do not match"),  # the weights' hidden: 48
    ({"vocab_size": 500}, "transformer.wte.weight is [301, 48], but config.json (vocab_size "
                          "500"),
    ({"n_positions": 8}, "transformer.wpe.weight is"),
    ({"n_inner": 64}, "transformer.h.0.mlp.c_fc.weight is [48, 192]"),
    ({"n_head": 5}, "n_head 5 does not divide n_embd 48 (48 % 5 = 3)"),
    ({"n_layer": 0}, "sizes must be positive integers"),
    ({"n_embd": None, "n_inner": 0}, "config.json sets {'n_embd': None, 'n_inner': 0}"),
])
def test_a_config_json_that_does_not_fit_its_weights_is_refused(tmp_path, capsys, edit,
                                                                message):
    save_model_weights(random_weights(), str(tmp_path / "hf"), "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **edit}))
    assert _tool("--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out",
                 "--saver", "megatron") == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    ("config.json", "config.json is not valid JSON"),
    ("model.safetensors", "model.safetensors cannot be read"),
])
def test_a_truncated_hf_file_is_a_clear_error(tmp_path, capsys, damage, message):
    save_model_weights(random_weights(), str(tmp_path / "hf"), "hf")
    path = tmp_path / "hf" / damage
    path.write_bytes(path.read_bytes()[:20])
    assert _tool("--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out",
                 "--saver", "megatron") == 2
    assert message in capsys.readouterr().err


def test_a_save_dir_that_cannot_be_made_fails_before_the_checkpoint_is_read(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert _tool("--load-dir", tmp_path / "no-checkpoint", "--save-dir",
                 tmp_path / "afile" / "out", "--saver", "hf") == 2
    assert f"cannot be made: {tmp_path / 'afile'} is a file" in capsys.readouterr().err


def _padded_hf_folder(corpus, folder, extra_rows=24, tokenizer_files=True):
    """An HF GPT-2 whose embedding has `extra_rows` rows past its tokenizer's vocabulary (a
    model trained with the vocabulary padded, as 50257 tokens in 50304 rows)."""
    weights, tokenizer = tokenized_weights(corpus, hidden_size=32, num_heads=4, positions=24)
    embedding = weights.state_dict[WORD_EMBEDDINGS]
    weights.state_dict[WORD_EMBEDDINGS] = torch.cat([embedding,
                                                     torch.randn(extra_rows, 32)])
    weights.args["orig_vocab_size"] = tokenizer.vocab_size + extra_rows
    if not tokenizer_files:
        weights.args["tokenizer_type"] = None
    save_model_weights(weights, str(folder), "hf")
    return embedding, tokenizer.vocab_size


def test_rows_past_an_hf_models_tokenizer_are_read_as_padding(corpus, tmp_path, capsys):
    embedding, vocab = _padded_hf_folder(corpus, tmp_path / "hf")
    weights = load_model_weights(str(tmp_path / "hf"))
    assert weights.vocab_size == weights.args["orig_vocab_size"] == vocab
    assert torch.equal(weights.state_dict[WORD_EMBEDDINGS], embedding)
    note, = weights.notes
    assert f"vocab_size {vocab + 24} is 24 rows more than the {vocab} tokens" in note
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = _tokens(vocab, 24)
    with torch.no_grad():
        expected = hf(tokens).logits[..., :vocab]
        got = build_model_from_weights(weights)(tokens, torch.arange(tokens.shape[1]))
    assert torch.allclose(got[..., :vocab], expected, atol=1e-5, rtol=0)
    # Converted, then read back with the tokenizer files given (refused before: the
    # checkpoint recorded the padded rows as the tokenizer's size).
    assert _tool("--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "meg",
                 "--saver", "megatron") == 0
    assert f"note: config.json's vocab_size {vocab + 24}" in capsys.readouterr().out
    assert _tool("--load-dir", tmp_path / "meg", "--save-dir", tmp_path / "hf2", "--saver",
                 "hf", "--vocab-file", corpus["vocab"], "--merge-file", corpus["merges"]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["vocab_size"] == vocab


def test_tokenizer_files_given_for_an_hf_folder_without_them_decide_its_vocab(corpus,
                                                                              tmp_path):
    embedding, vocab = _padded_hf_folder(corpus, tmp_path / "hf", tokenizer_files=False)
    assert not (tmp_path / "hf" / "vocab.json").exists()
    assert load_model_weights(str(tmp_path / "hf")).vocab_size == vocab + 24
    weights = load_model_weights(str(tmp_path / "hf"), tokenizer_files={
        "vocab_file": corpus["vocab"], "merge_file": corpus["merges"]})
    assert weights.vocab_size == vocab
    assert weights.args["vocab_file"] == os.path.abspath(corpus["vocab"])
    assert torch.equal(weights.state_dict[WORD_EMBEDDINGS], embedding)


def test_an_hf_tokenizer_larger_than_the_embedding_is_refused(corpus, tmp_path, capsys):
    _, vocab = _padded_hf_folder(corpus, tmp_path / "hf", extra_rows=0)
    weights = random_weights(hidden_size=32, num_heads=4, positions=24, vocab_size=vocab - 5)
    save_model_weights(weights, str(tmp_path / "small"), "hf")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tmp_path / "hf" / name, tmp_path / "small" / name)
    assert _tool("--load-dir", tmp_path / "small", "--save-dir", tmp_path / "out",
                 "--saver", "megatron") == 2
    assert (f"has {vocab} tokens, but {tmp_path / 'small'}/config.json's vocab_size is "
            f"{vocab - 5}: ids from {vocab - 5} on have no embedding row"
            in capsys.readouterr().err)
    assert _tool("--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out",
                 "--saver", "megatron", "--vocab-size", vocab - 1) == 2
    assert (f"--vocab-size {vocab - 1} disagrees with the {vocab} tokens of the tokenizer"
            in capsys.readouterr().err)
    assert _tool("--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out",
                 "--saver", "megatron", "--vocab-size", 0) == 2
    assert "--vocab-size must be positive, got 0" in capsys.readouterr().err


def test_a_sentencepiece_tokenizer_travels_through_an_hf_folder(corpus, tmp_path, capsys):
    """--saver hf copies a SentencePiece model as tokenizer.model (with its eod as the
    config's eos id) and says that HF's GPT-2 classes do not read it; the folder converts
    back with its tokenizer and generates from --load alone."""
    from megatron.tokenizer.sentencepiece_tokenizer import (SentencePieceTokenizer,
                                                            train_sentencepiece)
    texts = [json.loads(line)["text"] for line in open(corpus["json"])]
    model_file = str(tmp_path / "sp.model")
    train_sentencepiece(texts, 400, model_file)
    tokenizer = SentencePieceTokenizer(model_file)
    weights = random_weights(hidden_size=32, num_heads=4, positions=24,
                             vocab_size=tokenizer.vocab_size,
                             tokenizer_type="SentencePieceTokenizer", tokenizer_model=model_file)
    save_model_weights(weights, str(tmp_path / "meg"), "megatron")
    assert _tool("--load-dir", tmp_path / "meg", "--save-dir", tmp_path / "hf",
                 "--saver", "hf") == 0
    said = capsys.readouterr().out
    assert (f"note: the SentencePiece model is {tmp_path / 'hf' / 'tokenizer.model'}; Hugging "
            "Face's GPT-2 tokenizer classes do not read it") in said
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == open(model_file, "rb").read()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == tokenizer.eod
    back = load_model_weights(str(tmp_path / "hf"))
    assert back.args["tokenizer_type"] == "SentencePieceTokenizer"
    assert back.args["tokenizer_model"] == str(tmp_path / "hf" / "tokenizer.model")
    assert back.args["vocab_file"] is None and back.vocab_size == tokenizer.vocab_size
    generate = load_tool("generate_samples")
    genfile = tmp_path / "samples.jsonl"
    assert generate.main(["--load", str(tmp_path / "hf"), "--num-samples", "1", "--genfile",
                          str(genfile), "--out-seq-length", "4", "--greedy"]) == 0
    assert len(genfile.read_text().splitlines()) == 1


def test_an_hf_folder_without_a_tokenizer_says_so(tmp_path, capsys):
    save_model_weights(random_weights(), str(tmp_path / "meg"), "megatron")
    assert _tool("--load-dir", tmp_path / "meg", "--save-dir", tmp_path / "hf",
                 "--saver", "hf") == 0
    assert (f"note: {tmp_path / 'hf'} holds no tokenizer (the checkpoint records none, or its "
            "files are gone): give --vocab-file and --merge-file, or --tokenizer-model, to copy "
            "one in") in capsys.readouterr().out


def test_more_rows_past_the_tokenizer_than_tokens_is_another_tokenizer(corpus, tmp_path):
    """An 8192-row model given a 1000-token tokenizer: 88% of its rows were 'padding', dropped
    with a note, and the text came out garbled."""
    _, vocab = _padded_hf_folder(corpus, tmp_path / "wide", extra_rows=5000)
    assert vocab < 5000
    with pytest.raises(CheckpointError) as error:
        load_model_weights(str(tmp_path / "wide"))
    assert f"has {vocab} tokens, but {tmp_path / 'wide'}/config.json's vocab_size is " \
           f"{vocab + 5000}: 5000 rows more than tokens are not padding, so the tokenizer is " \
           "not the model's" in str(error.value)
