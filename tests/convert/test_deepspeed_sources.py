"""--deepspeed checkpoints saved by 2 processes (DP=2 with ZeRO stage 2; TP=2 with stage 1)
convert to Hugging Face with the right weights, and generate_samples.py / evaluate_gpt2.py
run straight from them, giving what they give from the converted folder."""

import json
import os
import shutil

import pytest
import torch

from megatron.convert.loaders import load_model_weights
from megatron.convert.tp_layout import WORD_EMBEDDINGS, parameter_layout, split_full
from megatron.inference.loading import build_model_from_weights
from tests.convert.conftest import load_tool
from tests.dist_utils import run_distributed
from tests.training.test_deepspeed import NO_DROPOUT, _train_dp, stage_config, trainer_argv
from zero import get_fp32_state_dict_from_zero_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

convert_tool = load_tool("convert_checkpoint")
generate_tool = load_tool("generate_samples")
evaluate_tool = load_tool("evaluate_gpt2")


@pytest.fixture(scope="module")
def two_process_checkpoints(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("ds2")
    saves = {"dp2": root / "dp2", "tp2": root / "tp2"}
    phases = [
        trainer_argv(corpus, root / "log_dp2", 2, *NO_DROPOUT, "--deepspeed",
                     "--deepspeed_config", stage_config(root, 2), "--save", saves["dp2"]),
        trainer_argv(corpus, root / "log_tp2", 2, *NO_DROPOUT, "--deepspeed",
                     "--deepspeed_config", stage_config(root, 1), "--save", saves["tp2"],
                     "--model-parallel-size", 2),
    ]
    run_distributed(_train_dp, 2, args=(str(root), phases))
    return {name: str(path) for name, path in saves.items()}


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _hf_logits_match(save, hf_dir):
    assert convert_tool.main(["--load-dir", save, "--save-dir", hf_dir, "--saver", "hf"]) == 0
    for name in os.listdir(hf_dir):  # readable as any file the user creates (umask 022 here)
        assert os.stat(os.path.join(hf_dir, name)).st_mode & 0o777 == 0o666 & ~_umask(), name
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    weights = load_model_weights(save)
    vocab = weights.vocab_size
    tokens = torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = build_model_from_weights(weights)(tokens, torch.arange(20).expand(2, 20))
        assert torch.allclose(ours[..., :vocab], hf(tokens).logits, atol=1e-5, rtol=0)
    return weights


def test_dp2_zero2_checkpoint_to_hf(two_process_checkpoints, tmp_path):
    save = two_process_checkpoints["dp2"]
    weights = _hf_logits_match(save, str(tmp_path / "hf"))
    consolidated = get_fp32_state_dict_from_zero_checkpoint(save)  # both DP partitions
    for name, tensor in weights.state_dict.items():
        assert torch.equal(tensor, consolidated[name][:tensor.shape[0]]), name


def test_tp2_checkpoint_to_hf(two_process_checkpoints, tmp_path):
    save = two_process_checkpoints["tp2"]
    weights = _hf_logits_match(save, str(tmp_path / "hf"))
    # Each TP rank's consolidated masters are that rank's slice of the merged full weights.
    ranks = [get_fp32_state_dict_from_zero_checkpoint(save, mp_rank=r) for r in (0, 1)]
    for name, tensor in weights.state_dict.items():
        if name == WORD_EMBEDDINGS:  # split over the padded vocab; the real rows lead
            merged = torch.cat([ranks[0][name], ranks[1][name]])
            assert torch.equal(merged[:tensor.shape[0]], tensor)
            continue
        parts = split_full(tensor, parameter_layout(name).split, 2)
        for rank, part in enumerate(parts):
            assert torch.equal(ranks[rank][name], part), (name, rank)


@pytest.mark.parametrize("source", ["dp2", "tp2"])
def test_generate_and_evaluate_from_a_deepspeed_checkpoint(two_process_checkpoints, source,
                                                           tmp_path):
    """Straight from the --deepspeed folder == from its Hugging Face conversion."""
    save = two_process_checkpoints[source]
    hf_dir = str(tmp_path / "hf")
    assert convert_tool.main(["--load-dir", save, "--save-dir", hf_dir, "--saver", "hf"]) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the king said\nsweet love\n")
    wiki = tmp_path / "wiki.test.tokens"
    wiki.write_text(" = Valkyria = \n \n The king said , sweet love , and so . \n")
    outputs = {}
    for name, load in (("ds", save), ("hf", hf_dir)):
        out = tmp_path / f"{name}.jsonl"
        extra = ["--deepspeed"] if name == "ds" else []
        assert generate_tool.main(["--load", load, *extra, "--greedy", "--out-seq-length", "8",
                                   "--sample-input-file", str(prompts),
                                   "--sample-output-file", str(out)]) == 0
        results = tmp_path / f"{name}.json"
        assert evaluate_tool.main(["--load", load, *extra, "--task", "WIKITEXT103",
                                   "--valid-data", str(wiki), "--seq-length", "16",
                                   "--overlapping-eval", "8", "--results-file",
                                   str(results)]) == 0
        outputs[name] = ([json.loads(line) for line in out.read_text().splitlines()],
                         json.loads(results.read_text())["results"][0])
    assert outputs["ds"][0] == outputs["hf"][0] and len(outputs["ds"][0]) == 2
    assert outputs["ds"][1]["ppl"] == pytest.approx(outputs["hf"][1]["ppl"], rel=1e-5)


def test_tp2_checkpoint_missing_a_rank_is_a_clear_error(two_process_checkpoints, tmp_path,
                                                        capsys):
    copy = tmp_path / "copy"
    shutil.copytree(two_process_checkpoints["tp2"], copy)
    (copy / "global_step2" / "mp_rank_01_model_states.pt").unlink()
    capsys.readouterr()
    assert convert_tool.main(["--load-dir", str(copy), "--save-dir", str(tmp_path / "hf"),
                              "--saver", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model_parallel_size 2" in err and \
        "mp_rank_01_model_states.pt" in err
    assert not (tmp_path / "hf").exists()


def test_a_step_folder_given_for_the_checkpoint_names_the_folder_above(tmp_path):
    from megatron.convert.loaders import detect_format
    from megatron.errors import CheckpointError
    step = tmp_path / "ckpt" / "global_step3"
    step.mkdir(parents=True)
    (step / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"global_step3 is a step folder of a DeepSpeed "
                                              rf"checkpoint: give the checkpoint folder above it, "
                                              rf"{tmp_path / 'ckpt'} \(its tracker"):
        detect_format(str(step))


def test_a_rank_whose_optimizer_file_is_missing_is_said_to_be_missing(tmp_path):
    """It was blamed on tensor parallelism, which these files do not have."""
    from pathlib import Path

    from zero.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from zero.errors import CheckpointError
    fixture = Path(__file__).parents[1] / "compat" / "fixtures" / "checkpoints" / "zero2_fp32_dp2"
    shutil.copytree(fixture, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError) as error:
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert "expected 2 *_optim_states.pt files in" in str(error.value)
    assert "found 1: the checkpoint is incomplete: a rank's files were not written or not " \
           "copied" in str(error.value)
