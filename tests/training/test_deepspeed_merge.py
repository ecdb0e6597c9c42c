"""tools/merge_mp_partitions.py --deepspeed: a ZeRO checkpoint becomes a Megatron-layout one.

A --deepspeed run (ZeRO stage 2) saves at iteration 3; the tool consolidates the fp32
partitions and the Adam moments and writes TP=1 and TP=2 Megatron checkpoints. Both resume
without --deepspeed (and the TP=2 one under --deepspeed at stage 3) and continue the
uninterrupted --deepspeed run's losses (same weights, optimizer state, schedule and data
position).
"""

import importlib.util
import os

import pytest
import torch

from megatron.convert import load_unsharded_checkpoint
from tests.dist_utils import run_distributed
from tests.training.test_deepspeed import (NO_DROPOUT, _train_dp, read_losses, run,
                                           stage_config, trainer_argv)
from zero.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "tools", "merge_mp_partitions.py")


def _tool():
    spec = importlib.util.spec_from_file_location("merge_mp_partitions_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deepspeed_checkpoint_converts_and_resumes_without_deepspeed(corpus, tmp_path, capsys):
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 2)]
    common = [*NO_DROPOUT, "--global-batch-size", 8]
    assert run(corpus, tmp_path / "straight", 6, *common, *ds) == 0
    save = tmp_path / "ds_ckpt"
    assert run(corpus, tmp_path / "head", 6, *common, *ds, "--save", save,
               "--exit-interval", 3) == 0
    capsys.readouterr()
    # forgetting --deepspeed: the error names the layout and both ways out
    assert run(corpus, tmp_path / "no_ds", 4, *common, "--load", save) == 2
    err = capsys.readouterr().err
    assert "holds a --deepspeed checkpoint" in err and "merge_mp_partitions.py --deepspeed" in err
    tool = _tool()
    assert tool.main(["--load", str(save), "--save", str(tmp_path / "no_flag")]) == 2
    assert "holds a DeepSpeed checkpoint" in capsys.readouterr().err  # the tool says it too
    for target in (1, 2):
        assert tool.main(["--deepspeed", "--load", str(save), "--save",
                          str(tmp_path / f"mp{target}"),
                          "--target-model-parallel-size", str(target)]) == 0
    out = capsys.readouterr().out
    assert out.count(" optimizer state: converted") == 2 and "--no-load-optim" not in out
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(save))  # word embeddings padded
    for target in (1, 2):
        assert (tmp_path / f"mp{target}" / "latest_checkpointed_iteration.txt").read_text() == "3"
        merged = load_unsharded_checkpoint(str(tmp_path / f"mp{target}")).model  # padded
        assert set(merged) == set(fp32)
        for name, tensor in fp32.items():
            assert torch.equal(merged[name][:tensor.shape[0]], tensor), (target, name)
    straight = read_losses(tmp_path / "straight")
    assert run(corpus, tmp_path / "resumed_mp1", 6, *common, "--load", tmp_path / "mp1") == 0
    # at TP=2: without --deepspeed, and under --deepspeed at stage 3 (its partitions cut
    # from the per-parameter state)
    stage3 = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 3)]
    run_distributed(_train_dp, 2, args=(str(tmp_path), [trainer_argv(
        corpus, tmp_path / log, 6, *common, "--model-parallel-size", 2, *extra, "--load",
        tmp_path / "mp2") for log, extra in (("resumed_mp2", []), ("resumed_mp2_ds", stage3))]))
    for target in (1, 2, "2_ds"):
        resumed = read_losses(tmp_path / f"resumed_mp{target}")
        assert sorted(resumed) == [4, 5, 6]  # with its optimizer: no fresh warm-up
        for iteration in (4, 5, 6):
            assert abs(resumed[iteration][0] - straight[iteration][0]) <= \
                1e-4 * abs(straight[iteration][0]), (target, iteration)


@pytest.mark.parametrize("stage, precision, optimizer", [(3, "bf16", "adam"),
                                                       (1, "fp32", "adam8bit")])
def test_the_optimizer_state_carries_over_from_any_stage_and_precision(corpus, tmp_path, stage,
                                                                       precision, optimizer):
    """bf16 (fp32 masters beside the bf16 weights), stage 3 (per-parameter pieces) and 8-bit
    moments (codes and scale runs, dequantised by the conversion and requantised by the
    first step) reach the Megatron layout's per-parameter optimizer state."""
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, stage, precision)]
    common = [*NO_DROPOUT, "--global-batch-size", 8, "--optimizer", optimizer,
              *(["--bf16"] if precision == "bf16" else [])]
    save = tmp_path / "ds_ckpt"
    assert run(corpus, tmp_path / "straight", 6, *common, *ds) == 0
    assert run(corpus, tmp_path / "head", 6, *common, *ds, "--save", save,
               "--exit-interval", 3) == 0
    assert _tool().main(["--deepspeed", "--load", str(save), "--save",
                         str(tmp_path / "merged")]) == 0
    shard = torch.load(tmp_path / "merged" / "iter_0000003" / "mp_rank_00" /
                       "model_optim_rng.pt", weights_only=True)
    masters = [m for group in shard["optimizer"]["fp32_from_fp16_params"] for m in group]
    assert all((m is None) == (precision == "fp32") for m in masters)
    assert run(corpus, tmp_path / "resumed", 6, *common, "--load", tmp_path / "merged") == 0
    straight, resumed = read_losses(tmp_path / "straight"), read_losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    for iteration in (4, 5, 6):
        assert abs(resumed[iteration][0] - straight[iteration][0]) <= \
            3e-4 * abs(straight[iteration][0]), iteration


@pytest.mark.parametrize("saved, resumed", [(2, 3), (3, 1)])
def test_finetuning_from_another_zero_stage(corpus, tmp_path, capsys, saved, resumed):
    """--finetune takes the weights of a checkpoint of either family of stages, directly or
    merged into one file by tools/merge_mp_partitions.py --deepspeed."""
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "first", 2, "--deepspeed", "--deepspeed_config",
               stage_config(tmp_path, saved), "--save", save) == 0
    other = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, resumed)]
    assert _tool().main(["--deepspeed", "--load", str(save), "--save",
                         str(tmp_path / "merged")]) == 0
    first = read_losses(tmp_path / "first")
    for source, log in ((save, "direct"), (tmp_path / "merged", "from_merged")):
        assert run(corpus, tmp_path / log, 2, *other, "--load", source, "--finetune") == 0
        finetuned = read_losses(tmp_path / log)
        assert sorted(finetuned) == [1, 2]
        assert finetuned[1][0] < first[1][0]  # it starts from the trained weights
    assert read_losses(tmp_path / "direct")[1][0] == \
        pytest.approx(read_losses(tmp_path / "from_merged")[1][0], rel=1e-5)


def test_deepspeed_flag_on_a_megatron_checkpoint_is_a_clear_error(corpus, tmp_path, capsys):
    save = tmp_path / "megatron_ckpt"
    assert run(corpus, tmp_path / "log", 3, "--save", save) == 0
    capsys.readouterr()
    code = _tool().main(["--deepspeed", "--load", str(save), "--save", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"error: {save} holds a Megatron-layout checkpoint (written "
                                 "without --deepspeed): read it without --deepspeed "
                                 "(convert_checkpoint.py: --loader megatron)\n")
    code = _tool().main(["--deepspeed", "--load", str(save), "--iteration", "7",
                         "--save", str(tmp_path / "out")])
    assert code == 2 and "global_step7 does not exist" in capsys.readouterr().err
