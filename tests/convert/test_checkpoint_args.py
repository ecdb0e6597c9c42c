"""`pretrain_gpt2.py --load X` takes the model's shape and tokenizer from X's checkpoint.

Only data and training flags on the command line: from a converted Hugging Face model and
from a normal training checkpoint.  A model flag that is given wins, and is an error when it
disagrees with the checkpoint.
"""

import os
import shutil

import pytest

import pretrain_gpt2
from megatron.config.flags import build_parser, given_on_command_line
from megatron.convert.loaders import load_model_weights
from megatron.convert.savers import save_model_weights
from tests.convert.conftest import load_tool, random_weights
from tests.training.test_deepspeed import TINY, read_losses, stage_config

pytest.importorskip("safetensors")

tool = load_tool("convert_checkpoint")

# Data and training flags only: no shape, no tokenizer, no --seq-length.
TRAINING_ONLY = ["--batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4", "--warmup-iters",
                 "1", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
                 "--num-workers", "0", "--split", "90,9,1", "--threads", "1",
                 "--attention-dropout", "0", "--hidden-dropout", "0"]


def _train_only(corpus, tmp_path, name, load, iters, *extra):
    argv = TRAINING_ONLY + ["--data-path", corpus["prefix"], "--load", str(load),
                            "--save", str(tmp_path / name), "--log-dir", str(tmp_path / name),
                            "--train-iters", str(iters)] + [str(e) for e in extra]
    return pretrain_gpt2.main(argv)


def _hf_model(corpus, tmp_path):
    from megatron.tokenizer import build_tokenizer
    vocab_size = build_tokenizer("GPT2BPETokenizer", corpus["vocab"], corpus["merges"]).vocab_size
    weights = random_weights(num_layers=2, hidden_size=32, num_heads=4, vocab_size=vocab_size,
                             positions=32, eps=1e-6, tokenizer_type="GPT2BPETokenizer",
                             vocab_file=corpus["vocab"], merge_file=corpus["merges"])
    save_model_weights(weights, str(tmp_path / "hf"), "hf")
    return tmp_path / "hf"


def test_converted_hf_model_trains_with_training_flags_only(corpus, tmp_path, capsys):
    hf = _hf_model(corpus, tmp_path)
    assert tool.main(["--load-dir", str(hf), "--save-dir", str(tmp_path / "meg"),
                      "--saver", "megatron"]) == 0
    assert _train_only(corpus, tmp_path, "trained", tmp_path / "meg", 2) == 0
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if "taking from checkpoint" in line]
    assert len(note) == 1 and "--num-layers 2" in note[0] and "--layernorm-epsilon 1e-06" in \
        note[0] and "--vocab-file" in note[0]
    assert sorted(read_losses(tmp_path / "trained")) == [1, 2]
    # A converted checkpoint holds weights only: no note about optimizer states it lacks
    assert _train_only(corpus, tmp_path, "quantised", tmp_path / "meg", 1, "--optimizer",
                       "adam4bit", "--adam-beta2", "0.95") == 0
    out = capsys.readouterr().out
    assert "the checkpoint was trained with" not in out and "optimizer state keeps" not in out
    # The training checkpoint it wrote resumes the same way.
    assert _train_only(corpus, tmp_path, "resumed", tmp_path / "trained", 3,
                       "--use-checkpoint-lr-scheduler") == 0
    assert sorted(read_losses(tmp_path / "resumed")) == [3]


def test_training_checkpoint_resumes_with_training_flags_only(corpus, tmp_path):
    """Resuming with all flags and with training flags only gives the same loss."""
    common = TINY + ["--batch-size", "4", "--data-path", corpus["prefix"], "--vocab-file",
                     corpus["vocab"], "--merge-file", corpus["merges"], "--attention-dropout",
                     "0", "--hidden-dropout", "0", "--layernorm-epsilon", "1e-4",
                     "--lr-decay-iters", "3"]
    assert pretrain_gpt2.main(common + ["--train-iters", "2", "--save", str(tmp_path / "c"),
                                        "--log-dir", str(tmp_path / "c")]) == 0
    assert pretrain_gpt2.main(common + ["--train-iters", "3", "--load", str(tmp_path / "c"),
                                        "--log-dir", str(tmp_path / "full")]) == 0
    # TINY's schedule, shape-free: the same lr schedule as the full-flag resume.
    argv = TRAINING_ONLY + ["--data-path", corpus["prefix"], "--load", str(tmp_path / "c"),
                            "--log-dir", str(tmp_path / "short"), "--train-iters", "3",
                            "--warmup-iters", "2", "--lr-decay-style", "cosine",
                            "--lr-decay-iters", "3"]
    assert pretrain_gpt2.main(argv) == 0
    full, short = read_losses(tmp_path / "full"), read_losses(tmp_path / "short")
    assert list(short) == [3] and short[3][0] == full[3][0]


def test_a_given_flag_that_disagrees_with_the_checkpoint_is_an_error(corpus, tmp_path, capsys):
    hf = _hf_model(corpus, tmp_path)
    assert tool.main(["--load-dir", str(hf), "--save-dir", str(tmp_path / "meg"),
                      "--saver", "megatron"]) == 0
    capsys.readouterr()
    assert _train_only(corpus, tmp_path, "t", tmp_path / "meg", 1, "--hidden-size", "64",
                       "--num-attention-heads", "4") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--hidden-size: checkpoint 32, flags 64" in err


def test_tokenizer_files_recorded_but_gone_is_a_clear_error(corpus, tmp_path, capsys):
    hf = _hf_model(corpus, tmp_path)
    assert tool.main(["--load-dir", str(hf), "--save-dir", str(tmp_path / "meg"),
                      "--saver", "megatron"]) == 0
    os.remove(tmp_path / "meg" / "vocab.json")
    capsys.readouterr()
    assert _train_only(corpus, tmp_path, "t", tmp_path / "meg", 1) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "vocab.json, which does not exist" in err


def test_a_converted_folder_moved_elsewhere_finds_its_tokenizer_beside_it(corpus, tmp_path,
                                                                          capsys):
    """The converted folder records its own copies of the tokenizer files by absolute path;
    moved (the old place gone), the trainer, the tools and generation read the copies in the
    folder where it now is."""
    hf = _hf_model(corpus, tmp_path)
    assert tool.main(["--load-dir", str(hf), "--save-dir", str(tmp_path / "meg"),
                      "--saver", "megatron"]) == 0
    moved = tmp_path / "moved"
    shutil.move(str(tmp_path / "meg"), str(moved))
    capsys.readouterr()
    assert _train_only(corpus, tmp_path, "t", moved, 1) == 0
    assert f"--vocab-file {moved / 'vocab.json'}, --merge-file {moved / 'merges.txt'}" in \
        capsys.readouterr().out
    assert load_model_weights(str(moved)).args["vocab_file"] == str(moved / "vocab.json")
    assert tool.main(["--load-dir", str(moved), "--save-dir", str(tmp_path / "hf2"),
                      "--saver", "hf"]) == 0


def test_given_detects_flags_given_with_their_default_value():
    parser = build_parser()
    given = given_on_command_line(parser, ["--layernorm-epsilon", "1e-5", "--lr", "1"])
    assert given == {"layernorm_epsilon", "lr"}
    assert parser.parse_args([]).layernorm_epsilon == 1e-5  # the real parser is untouched


def test_deepspeed_checkpoint_resumes_with_training_flags_only(corpus, tmp_path, capsys):
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 1)]
    argv = TINY + ["--batch-size", "4", "--data-path", corpus["prefix"], "--vocab-file",
                   corpus["vocab"], "--merge-file", corpus["merges"], "--lr-decay-iters", "3"]
    assert pretrain_gpt2.main(argv + ds + ["--train-iters", "2", "--save", str(tmp_path / "c"),
                                           "--log-dir", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    assert _train_only(corpus, tmp_path, "resumed", tmp_path / "c", 3, *ds,
                       "--lr-decay-iters", "3", "--warmup-iters", "2",
                       "--lr-decay-style", "cosine") == 0
    note = [line for line in capsys.readouterr().out.splitlines() if "taking from" in line]
    assert len(note) == 1 and "--hidden-size 32" in note[0]
    assert sorted(read_losses(tmp_path / "resumed")) == [3]


def _tokenizer_with_two_ids_swapped(corpus, folder):
    """The corpus's BPE with two tokens' ids swapped: the same size, other ids for text."""
    import json
    import shutil
    vocab = json.load(open(corpus["vocab"], encoding="utf-8"))
    first, second = "Ġthe", "Ġking"  # " the" is in the tokenizer's probe text
    vocab[first], vocab[second] = vocab[second], vocab[first]
    os.makedirs(folder)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    shutil.copy(corpus["merges"], os.path.join(folder, "merges.txt"))
    return os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")


def test_the_tools_refuse_another_tokenizer_of_the_same_size(corpus, tmp_path, capsys):
    from tests.training.test_pretrain import run
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, "--save", save, iters=2) == 0
    vocab, merges = _tokenizer_with_two_ids_swapped(corpus, str(tmp_path / "swapped"))
    capsys.readouterr()
    generate = load_tool("generate_samples")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the king said\n")
    other = ["--vocab-file", vocab, "--merge-file", merges]
    assert generate.main(["--load", save, "--sample-input-file", str(prompts), "--greedy",
                          "--out-seq-length", "4", *other]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the tokenizer files {vocab}, {merges} split text differently "
                          "from the tokenizer the checkpoint was trained with (probe hash ")
    assert "Give the tokenizer files the model was trained with" in err
    assert tool.main(["--load-dir", save, "--save-dir", str(tmp_path / "conv"), "--saver",
                      "megatron", *other]) == 2
    assert "split text differently" in capsys.readouterr().err
    assert not (tmp_path / "conv").exists()


def test_tokenizer_paths_are_recorded_absolute_and_relative_ones_are_explained(
        corpus, tmp_path, capsys, monkeypatch):
    import torch
    from tests.training.test_pretrain import TINY
    root = os.path.dirname(corpus["vocab"])  # .../tok
    monkeypatch.chdir(os.path.dirname(root))
    save = str(tmp_path / "ckpt")
    assert pretrain_gpt2.main(TINY + [
        "--batch-size", "4", "--train-iters", "2", "--data-path", corpus["prefix"],
        "--vocab-file", "tok/vocab.json", "--merge-file", "tok/merges.txt", "--save", save,
        "--log-dir", str(tmp_path / "run")]) == 0
    path = os.path.join(save, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=True)
    assert (state["args"]["vocab_file"], state["args"]["merge_file"]) == (
        corpus["vocab"], corpus["merges"])
    # a checkpoint written before paths were made absolute, used from another folder
    state["args"].update(vocab_file="tok/vocab.json", merge_file="tok/merges.txt")
    torch.save(state, path)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    generate = load_tool("generate_samples")
    assert generate.main(["--load", save, "--num-samples", "1", "--genfile",
                          str(tmp_path / "g.jsonl"), "--out-seq-length", "4"]) == 2
    recorded = (f"error: the checkpoint records --vocab-file tok/vocab.json, --merge-file "
                f"tok/merges.txt, which is not found from {tmp_path} (a path relative to where "
                "training ran?); give the tokenizer files on the command line")
    assert capsys.readouterr().err.startswith(recorded)
    assert tool.main(["--load-dir", save, "--save-dir", str(tmp_path / "conv"), "--saver",
                      "megatron"]) == 2
    assert capsys.readouterr().err.startswith(recorded)
    assert not (tmp_path / "conv").exists()
    assert tool.main(["--load-dir", save, "--save-dir", str(tmp_path / "conv"), "--saver",
                      "megatron", "--vocab-file", corpus["vocab"], "--merge-file",
                      corpus["merges"]]) == 0
    assert (tmp_path / "conv" / "vocab.json").exists()


def test_an_interrupted_conversion_removes_the_folder_it_made(corpus, tmp_path, monkeypatch,
                                                              capsys):
    import megatron.convert.checkpoint_files as checkpoint_files
    from tests.training.test_pretrain import run
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, "--save", save, iters=2) == 0
    calls = []

    def interrupt_at_the_second_file(state, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()

    monkeypatch.setattr(checkpoint_files, "atomic_torch_save", interrupt_at_the_second_file)
    for made, out in ((True, tmp_path / "new"), (False, tmp_path / "empty")):
        if not made:
            out.mkdir()
        calls.clear()
        assert tool.main(["--load-dir", save, "--save-dir", str(out), "--saver", "megatron",
                          "--target-tensor-parallel-size", "2"]) == 130
        assert len(calls) == 2
        assert (not out.exists()) if made else os.listdir(out) == []
    assert "Traceback" not in capsys.readouterr().err
