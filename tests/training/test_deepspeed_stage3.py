"""pretrain_gpt2.py --deepspeed with ZeRO stage 3: the model is built under zero.Init, trains
like the plain single-process trainer at DP=2 (and TP=2 x DP=2; also with the linears tiled, and
with offload and recompute), and resumes bit for bit."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.parallel.launching import assert_same_params_norms
from tests.training.test_deepspeed import (NO_DROPOUT, _train_dp, assert_same_training,
                                           read_losses, run, stage_config, trainer_argv)

# small knobs so that the GPT's parameters are released and re-gathered for real
KNOBS = {"stage3_param_persistence_threshold": 100, "stage3_max_reuse_distance": 0,
         "stage3_prefetch_bucket_size": 5000, "stage3_max_live_parameters": 20000}


def _config(tmp_path, **extra):
    path = stage_config(tmp_path, 3)
    import json
    with open(path) as f:
        entries = json.load(f)
    entries["zero_optimization"].update(KNOBS, **extra)
    with open(path, "w") as f:
        json.dump(entries, f)
    return path


def _argv(corpus, tmp_path, name, iters, *extra, micro=4, **zero_options):
    config_dir = tmp_path / f"config_{name}" if zero_options else tmp_path
    config_dir.mkdir(exist_ok=True)
    ds = ["--deepspeed", "--deepspeed_config", _config(config_dir, **zero_options)]
    return trainer_argv(corpus, tmp_path / name, iters, *NO_DROPOUT, "--global-batch-size", 8,
                        *ds, *extra, micro=micro)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The trainer without --deepspeed, 1 process, global batch 8, dropout 0."""
    log = tmp_path_factory.mktemp("reference")
    assert run(corpus, log, 6, *NO_DROPOUT, "--global-batch-size", 8, "--log-params-norm",
               micro=8) == 0
    return log


def test_dp2_stage3_matches_single_process_and_resumes_exactly(corpus, tmp_path, reference):
    save = tmp_path / "ckpt"
    # a Megatron-layout checkpoint, and fine-tuning from it without --deepspeed
    megatron = tmp_path / "megatron_ckpt"
    plain = [*NO_DROPOUT, "--global-batch-size", 8]
    assert run(corpus, tmp_path / "megatron", 2, *plain, "--save", megatron, micro=8) == 0
    assert run(corpus, tmp_path / "finetune_plain", 3, *plain, "--load", megatron,
               "--finetune", micro=8) == 0
    phases = [
              # its weights loaded into partitioned parameters, one gathered at a time
              _argv(corpus, tmp_path, "finetune", 3, "--load", megatron, "--finetune"),
              _argv(corpus, tmp_path, "stage3", 6, "--remote-device", "cpu",
                    "--log-params-norm"),
              _argv(corpus, tmp_path, "split", 6, "--save", save, "--exit-interval", 3,
                    micro=2),
              _argv(corpus, tmp_path, "split", 6, "--save", save, "--load", save, micro=2),
              # every tile its own module: gathered, released and partitioned on its own
              _argv(corpus, tmp_path, "tiled", 6, "--memory-centric-tiled-linear",
                    "--tile-factor", 2),
              # parameters and optimizer in host memory, layers recomputed in backward
              _argv(corpus, tmp_path, "offload", 6, "--checkpoint-activations",
                    "--log-params-norm", offload_param={"device": "cpu"},
                    offload_optimizer={"device": "cpu"})]
    run_distributed(_train_dp, 2, args=(str(tmp_path), phases))
    expected = read_losses(reference)
    assert_same_training(expected, read_losses(tmp_path / "stage3"))
    assert_same_training(expected, read_losses(tmp_path / "tiled"))
    assert_same_training(expected, read_losses(tmp_path / "offload"))
    assert_same_training(expected, read_losses(tmp_path / "split"))
    for name in ("stage3", "offload"):  # the weights' norm over the DP partitions
        assert_same_params_norms(reference, tmp_path / name)
    assert_same_training(read_losses(tmp_path / "finetune_plain"),
                         read_losses(tmp_path / "finetune"))
    assert sorted(p.name for p in (save / "global_step3").iterdir()) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    optim = torch.load(save / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                       weights_only=True)["optimizer_state_dict"]
    assert optim["zero_stage"] == 3 and optim["partition_count"] == 2


def test_single_process_resume_is_exact(corpus, tmp_path):
    """6 iterations == 3, save, stop, resume, 3 more (dropout on: RNG state comes back)."""
    ds = ["--deepspeed", "--deepspeed_config", _config(tmp_path), "--global-batch-size", 8]
    assert run(corpus, tmp_path / "full", 6, *ds) == 0
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "split", 6, *ds, "--save", save, "--exit-interval", 3) == 0
    assert run(corpus, tmp_path / "split", 6, *ds, "--save", save, "--load", save) == 0
    assert read_losses(tmp_path / "full") == read_losses(tmp_path / "split")


@pytest.mark.slow  # four gloo processes on two cores
def test_tp2_dp2_stage3_matches_single_process(corpus, tmp_path, reference):
    argv = _argv(corpus, tmp_path, "tp2dp2", 6, "--model-parallel-size", 2, "--log-params-norm")
    run_distributed(_train_dp, 4, args=(str(tmp_path), [argv]))
    assert_same_training(read_losses(reference), read_losses(tmp_path / "tp2dp2"))
    assert_same_params_norms(reference, tmp_path / "tp2dp2")




def test_a_tp2_stage2_checkpoint_resumes_at_stage3(corpus, tmp_path):
    """Each tensor-parallel rank's files are read on their own: at TP=2 a stage 2 save resumes
    at stage 3 (the other family of stages) and the losses continue the stage 2 run's."""
    save = tmp_path / "ckpt"
    stage2 = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 2)]

    def argv(name, *extra):
        return trainer_argv(corpus, tmp_path / name, 6, *NO_DROPOUT, "--global-batch-size", 4,
                            "--model-parallel-size", 2, *extra, micro=4)
    (tmp_path / "s3").mkdir()
    phases = [argv("straight", *stage2),
              argv("split", *stage2, "--save", save, "--exit-interval", 3),
              argv("split", "--deepspeed", "--deepspeed_config", _config(tmp_path / "s3"),
                   "--save", save, "--load", save)]
    run_distributed(_train_dp, 2, args=(str(tmp_path), phases))
    assert_same_training(read_losses(tmp_path / "straight"), read_losses(tmp_path / "split"))
    assert sorted(p.name for p in (save / "global_step6").iterdir())[-1] == \
        "zero_pp_rank_0_mp_rank_01_optim_states.pt"  # the resumed run saved at stage 3
