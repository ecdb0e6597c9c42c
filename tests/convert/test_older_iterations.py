"""An older iteration than the tracker names, read by the tools: tools/convert_checkpoint.py
--iteration N and the inference tools' --ckpt-step N (Megatron-LM's), in either layout."""

import pytest
import torch

import pretrain_gpt2
from megatron.convert.loaders import load_model_weights
from megatron.errors import CheckpointError
from tests.convert.conftest import load_tool
from tests.training.test_deepspeed import TINY, stage_config

convert_tool = load_tool("convert_checkpoint")
generate_tool = load_tool("generate_samples")


@pytest.fixture(scope="module", params=["megatron", "deepspeed"])
def saved_twice(request, corpus, tmp_path_factory):
    """(format, folder of checkpoints at iterations 1 and 2, the tracker naming 2)."""
    root = tmp_path_factory.mktemp(request.param)
    ds = ["--deepspeed", "--deepspeed_config", stage_config(root, 2)] \
        if request.param == "deepspeed" else []
    save = str(root / "ckpt")
    argv = TINY + ["--batch-size", "4", "--train-iters", "2", "--data-path", corpus["prefix"],
                   "--vocab-file", corpus["vocab"], "--merge-file", corpus["merges"],
                   "--save", save, "--save-interval", "1", *ds]
    assert pretrain_gpt2.main(argv) == 0
    return request.param, save


def test_an_older_iteration_is_the_one_read(saved_twice):
    source, save = saved_twice
    older, newer = load_model_weights(save, iteration=1), load_model_weights(save)
    assert (older.source_format, older.iteration, newer.iteration) == (source, 1, 2)
    name = "language_model.transformer.final_layernorm.weight"
    assert not torch.equal(older.state_dict[name], newer.state_dict[name])
    with pytest.raises(CheckpointError, match=r"^(iteration 5: .*iter_0000005 does not exist; "
                                              r"saved iterations here: iter_0000001, "
                                              r"iter_0000002|.*global_step5 does not exist; "
                                              r"saved steps here: global_step1, global_step2)"):
        load_model_weights(save, iteration=5)


def test_the_tools_take_the_iteration(saved_twice, tmp_path, capsys):
    source, save = saved_twice
    assert convert_tool.main(["--load-dir", save, "--save-dir", str(tmp_path / "one"),
                              "--saver", "megatron", "--iteration", "1"]) == 0
    assert f" converted {save} ({source}, iteration 1)" in capsys.readouterr().out
    converted, older = load_model_weights(str(tmp_path / "one")), load_model_weights(save, iteration=1)
    name = "language_model.transformer.final_layernorm.weight"
    assert torch.equal(converted.state_dict[name], older.state_dict[name])
    assert convert_tool.main(["--load-dir", save, "--save-dir", str(tmp_path / "neg"),
                              "--saver", "megatron", "--iteration", "-1"]) == 2
    assert "error: --iteration must be at least 0, got -1" in capsys.readouterr().err
    # a converted folder is one model (`release`): an iteration of it is an error
    assert convert_tool.main(["--load-dir", str(tmp_path / "one"), "--save-dir",
                              str(tmp_path / "two"), "--saver", "megatron",
                              "--iteration", "1"]) == 2
    assert "iter_0000001 does not exist" in capsys.readouterr().err
    out = tmp_path / "samples.jsonl"
    assert generate_tool.main(["--load", save, "--ckpt-step", "1", "--num-samples", "1",
                               "--genfile", str(out), "--out-seq-length", "4"]) == 0
    assert f" loaded {save} ({source}, iteration 1)" in capsys.readouterr().out
    assert generate_tool.main(["--load", save, "--ckpt-step", "-2", "--num-samples", "1",
                               "--genfile", str(out)]) == 2
    assert "error: --ckpt-step must be from 0 to 2147483647, got -2" in capsys.readouterr().err


def test_a_hugging_face_folder_has_no_iterations(tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(CheckpointError, match="is a Hugging Face folder, which holds one model: "
                                              "leave the iteration out"):
        load_model_weights(str(tmp_path / "hf"), loader="hf", iteration=3)
