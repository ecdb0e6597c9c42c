"""pretrain_gpt2.py --deepspeed: the user's DeepSpeed JSON on the zero engine.

Both trainers run on the zero engine, so stage 0 under --deepspeed is checked against the
trainer without it as a consistency check of the config paths; tests/training/
test_reference.py checks the engine itself against plain PyTorch. Resume is checked against an
unbroken run (2N == N + resume + N, bit for bit).
"""

import json
import math
import os

import pytest
import torch

import pretrain_gpt2
from tests.dist_utils import run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--lr", "3e-3",
        "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--warmup-iters", "2",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--num-workers", "0", "--split", "90,9,1", "--threads", "1"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def write_config(directory, name="ds.json", **entries):
    path = os.path.join(str(directory), name)
    with open(path, "w") as f:
        json.dump(entries, f)
    return path


def stage_config(directory, stage, precision="fp32", **extra):
    """A config with no batch sizes (taken from the flags), clipping as --clip-grad's 1.0."""
    entries = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
               "gradient_clipping": 1.0, **extra}
    if precision == "bf16":
        entries["bf16"] = {"enabled": True}
    return write_config(directory, f"ds_stage{stage}_{precision}.json", **entries)


def trainer_argv(corpus, log_dir, iters, *extra, micro=4):
    return TINY + ["--batch-size", str(micro), "--train-iters", str(iters),
                   "--data-path", corpus["prefix"], "--vocab-file", corpus["vocab"],
                   "--merge-file", corpus["merges"], "--log-dir", str(log_dir)] + \
        [str(e) for e in extra]


def read_losses(log_dir):
    with open(os.path.join(str(log_dir), "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in records if "lm_loss" in r}


def run(corpus, log_dir, iters, *extra, micro=4):
    return pretrain_gpt2.main(trainer_argv(corpus, log_dir, iters, *extra, micro=micro))


# ------------------------------------------------------------------ single process: resume

@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"),
                                              (0, "bf16"), (1, "bf16"), (2, "bf16")])
def test_resume_is_exact(corpus, tmp_path, stage, precision):
    """6 iterations == 3, save, stop, resume, 3 more: same losses and norms bit for bit
    (dropout on, so the RNG state must come back too)."""
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, stage, precision)]
    assert run(corpus, tmp_path / "full", 6, *ds) == 0
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "split", 6, *ds, "--save", save, "--exit-interval", 3) == 0
    assert (save / "latest").read_text().strip() == "global_step3"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert run(corpus, tmp_path / "split", 6, *ds, "--save", save, "--load", save) == 0
    full, split = read_losses(tmp_path / "full"), read_losses(tmp_path / "split")
    assert sorted(full) == sorted(split) == list(range(1, 7))
    assert full == split


def test_checkpoint_layout_and_client_state(corpus, tmp_path, capsys):
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 2, "bf16")]
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "log", 4, *ds, "--save", save, "--save-interval", 2) == 0
    assert "(global_step4)" in capsys.readouterr().out
    assert (save / "zero_to_fp32.py").is_file()
    assert sorted(p.name for p in (save / "global_step2").iterdir()) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]
    states = torch.load(save / "global_step4" / "mp_rank_00_model_states.pt",
                        weights_only=True)
    assert states["iteration"] == 4 and states["global_steps"] == 4
    assert states["consumed_train_samples"] == 16
    assert states["args"]["hidden_size"] == 32 and states["args"]["deepspeed"] is True
    assert {"torch_rng_state", "np_rng_state", "rng_tracker_states"} <= set(states)
    assert states["module"]["language_model.embedding.word_embeddings.weight"].dtype == \
        torch.bfloat16
    assert not [p for p in save.rglob("*") if ".partial" in p.name or ".tmp" in p.name]


def test_finetune_no_load_rng_and_no_save_rng(corpus, tmp_path, capsys):
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 1), "--lr-decay-iters", 4]
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "a", 2, *ds, "--save", save, "--no-save-rng") == 0
    assert run(corpus, tmp_path / "b", 4, *ds, "--load", save) == 2
    assert "--no-load-rng" in capsys.readouterr().err
    assert run(corpus, tmp_path / "c", 4, *ds, "--load", save, "--no-load-rng") == 0
    assert sorted(read_losses(tmp_path / "c")) == [3, 4]
    assert run(corpus, tmp_path / "d", 2, *ds, "--load", save, "--finetune") == 0
    assert sorted(read_losses(tmp_path / "d")) == [1, 2]


@pytest.mark.parametrize("stage, optimizer", [(2, "adam"), (3, "adam"), (3, "adam8bit")])
def test_a_megatron_checkpoint_resumes_under_deepspeed_at_any_stage(corpus, tmp_path, capsys,
                                                                     stage, optimizer):
    """A run without --deepspeed goes on under --deepspeed (its optimizer state per parameter,
    8-bit codes too, cut into this stage's partitions; its schedule, data position and RNG):
    the losses continue the uninterrupted run's. A JSON scheduler would run another schedule:
    refused."""
    plain = [*NO_DROPOUT, "--global-batch-size", 8, "--optimizer", optimizer]
    assert run(corpus, tmp_path / "straight", 6, *plain) == 0
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "split", 6, *plain, "--save", save, "--exit-interval", 3) == 0
    capsys.readouterr()
    with_scheduler = write_config(tmp_path, zero_optimization={"stage": stage}, scheduler={
        "type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 2}})
    assert run(corpus, tmp_path / "refused", 6, *plain, "--deepspeed", "--deepspeed_config",
               with_scheduler, "--load", save) == 2
    assert "whose learning-rate schedule is Megatron's, and the DeepSpeed config's " \
        "'scheduler' section runs another" in capsys.readouterr().err
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, stage)]
    assert run(corpus, tmp_path / "split", 6, *plain, *ds, "--load", save) == 0
    assert_same_training(read_losses(tmp_path / "straight"), read_losses(tmp_path / "split"))


def test_a_dp2_megatron_checkpoint_resumes_under_deepspeed_at_dp2(corpus, tmp_path):
    """At DP=2 each rank cuts its own partition out of the per-parameter state (stage 2); at
    TP=2 the checkpoint is converted as it loads, optimizer state included."""
    plain = [*NO_DROPOUT, "--global-batch-size", 8]
    save = tmp_path / "ckpt"
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 2)]
    phases = [trainer_argv(corpus, tmp_path / "straight", 6, *plain),
              trainer_argv(corpus, tmp_path / "split", 6, *plain, "--save", save,
                           "--exit-interval", 3),
              trainer_argv(corpus, tmp_path / "split", 6, *plain, *ds, "--load", save),
              trainer_argv(corpus, tmp_path / "tp2", 6, *plain, *ds, "--model-parallel-size", 2,
                           "--load", save)]
    run_distributed(_train_dp, 2, args=(str(tmp_path), phases))
    straight = read_losses(tmp_path / "straight")
    assert_same_training(straight, read_losses(tmp_path / "split"))
    assert_same_training({i: straight[i] for i in (4, 5, 6)}, read_losses(tmp_path / "tp2"))


def test_finetuning_under_deepspeed_from_a_megatron_checkpoint(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "a", 2, "--save", save) == 0
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 2)]
    # the first loss is the one the same fine-tuning gets without --deepspeed
    assert run(corpus, tmp_path / "c", 2, *ds, "--load", save, "--finetune",
               "--save", tmp_path / "ds_ckpt") == 0
    assert "loaded the weights of" in capsys.readouterr().out
    assert run(corpus, tmp_path / "d", 2, "--load", save, "--finetune") == 0
    ds_losses, megatron_losses = read_losses(tmp_path / "c"), read_losses(tmp_path / "d")
    assert sorted(ds_losses) == [1, 2]
    assert ds_losses[1][0] == pytest.approx(megatron_losses[1][0], rel=1e-6)
    # at stage 3, whose parameters are partitioned as they are built, a parameter at a time
    stage3 = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 3)]
    assert run(corpus, tmp_path / "e", 2, *stage3, "--load", save, "--finetune") == 0
    stage3_losses = read_losses(tmp_path / "e")
    assert stage3_losses[1][0] == pytest.approx(megatron_losses[1][0], rel=1e-6)
    assert stage3_losses[2][0] == pytest.approx(ds_losses[2][0], rel=1e-5)
    capsys.readouterr()
    assert run(corpus, tmp_path / "f", 2, *stage3, "--load", save, "--finetune",
               "--memory-centric-tiled-linear", "--tile-factor", 2) == 2
    assert "cannot be loaded into the tiled layers (--memory-centric-tiled-linear) of a ZeRO " \
        "stage 3 model" in capsys.readouterr().err


def test_config_optimizer_and_scheduler_sections_are_used(corpus, tmp_path):
    """With 'optimizer' and 'scheduler' sections the config's own optimizer and WarmupLR
    run (lr = the schedule's, not --lr's); no decay on biases/LayerNorm either way."""
    config = write_config(tmp_path, optimizer={"type": "AdamW", "params": {
        "lr": 1e-3, "weight_decay": 0.1}}, scheduler={"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 4}},
        zero_optimization={"stage": 1})
    assert run(corpus, tmp_path / "log", 3, "--deepspeed", "--deepspeed_config", config) == 0
    with open(tmp_path / "log" / "metrics.jsonl") as f:
        lrs = [json.loads(line)["lr"] for line in f if "lm_loss" in line]
    # WarmupLR's log warmup over 4 steps: max_lr * log(n + 1) / log(4) after n steps (not
    # AnnealingLR's 0, 1.5e-3, 3e-3 from --lr 3e-3 and --warmup-iters 2)
    expected = [2e-3 * math.log(n + 1) / math.log(4) for n in range(3)]
    assert lrs == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------ contract 1 at DP=2

def _train_dp(rank, world_size, out_dir, phases):
    """Each phase: one pretrain() call in this process group, then a fresh group."""
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    for i, argv in enumerate(phases):
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous{i}",
                                    rank=rank, world_size=world_size)
        code = pretrain_gpt2.main(argv)
        assert code == 0, f"phase {i} exited with {code}"
    return True


def _dp_argv(corpus, tmp_path, name, stage, iters, *extra, micro=4):
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, stage)]
    return trainer_argv(corpus, tmp_path / name, iters, *NO_DROPOUT, "--global-batch-size", 8,
                        *ds, *extra, micro=micro)


def assert_same_training(reference, metrics):
    assert sorted(metrics) == sorted(reference)
    for it, (loss, norm) in metrics.items():
        ref_loss, ref_norm = reference[it]
        assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (it, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-3 * abs(ref_norm), (it, norm, ref_norm)


@pytest.fixture(scope="module")
def single_process_reference(corpus, tmp_path_factory):
    """The trainer without --deepspeed, 1 process, global batch 8, dropout 0."""
    log = tmp_path_factory.mktemp("reference")
    assert run(corpus, log, 6, *NO_DROPOUT, "--global-batch-size", 8, micro=8) == 0
    return read_losses(log)


def test_dp2_stages_match_single_process_and_resume_exactly(corpus, tmp_path,
                                                           single_process_reference):
    """Stages 0, 1, 2 at DP=2 (stage 1 with 2 micro batches of 2 per rank) match the plain
    single-process trainer; stage 2 at DP=2 resumes bit for bit."""
    save = tmp_path / "ckpt"
    phases = [_dp_argv(corpus, tmp_path, "stage0", 0, 6),
              _dp_argv(corpus, tmp_path, "stage1", 1, 6, micro=2),
              _dp_argv(corpus, tmp_path, "stage2", 2, 6),
              _dp_argv(corpus, tmp_path, "split", 2, 6, "--save", save, "--exit-interval", 3),
              _dp_argv(corpus, tmp_path, "split", 2, 6, "--save", save, "--load", save)]
    run_distributed(_train_dp, 2, args=(str(tmp_path), phases))
    for name in ("stage0", "stage1", "stage2"):
        assert_same_training(single_process_reference, read_losses(tmp_path / name))
    assert read_losses(tmp_path / "split") == read_losses(tmp_path / "stage2")
    assert sorted(p.name for p in (save / "global_step3").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


@pytest.mark.slow
def test_tp2_dp2_stage2_matches_single_process(corpus, tmp_path, single_process_reference):
    argv = _dp_argv(corpus, tmp_path, "tp2dp2", 2, 6, "--model-parallel-size", 2)
    run_distributed(_train_dp, 4, args=(str(tmp_path), [argv]))
    assert_same_training(single_process_reference, read_losses(tmp_path / "tp2dp2"))


# -------------------------------------------------- evaluation with loader workers, offloaded

def _offload(kind, nvme):
    cpu, disk = {"device": "cpu"}, {"device": "nvme", "nvme_path": str(nvme)}
    return {"cpu_stage2": (2, {"offload_optimizer": cpu}),
            "cpu_stage3": (3, {"offload_optimizer": cpu, "offload_param": cpu}),
            "nvme_stage2": (2, {"offload_optimizer": disk}),
            "nvme_stage3": (3, {"offload_optimizer": disk,
                                "offload_param": {**disk, "max_in_cpu": 0}})}[kind]


@pytest.mark.parametrize("kind", ["cpu_stage2", "cpu_stage3", "nvme_stage2", "nvme_stage3"])
def test_evaluation_with_loader_workers_under_every_offload_mode(corpus, tmp_path, kind):
    """Loader workers fork at every evaluation: the offloaded engine must not have reserved
    memory it never uses (a fork of a process with tens of GB mapped fails with ENOMEM on
    smaller machines). The run's peak virtual size is checked too."""
    import subprocess
    import sys
    (tmp_path / "nvme").mkdir()
    stage, sections = _offload(kind, tmp_path / "nvme")
    config = write_config(tmp_path, zero_optimization={"stage": stage, **sections},
                          gradient_clipping=1.0, bf16={"enabled": True})
    argv = trainer_argv(corpus, tmp_path / "log", 2, "--deepspeed", "--deepspeed_config",
                        config, "--eval-interval", 1, "--num-workers", 2)
    code = ("import sys, pretrain_gpt2\n"
            "code = pretrain_gpt2.main(sys.argv[1:])\n"
            "peak = [l for l in open('/proc/self/status') if l.startswith('VmPeak')][0]\n"
            "print('peak kB', peak.split()[1])\n"
            "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=240, cwd=os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__)))))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert output.count("validation loss at iteration 1") == 1 and "Traceback" not in output
    peak_kb = int(output.split("peak kB ")[1].split()[0])
    assert peak_kb < 6 * 2 ** 20, f"{peak_kb / 2 ** 20:.1f} GB of virtual memory at the peak"


# ------------------------------------------------- resuming with other flags than the save's

@pytest.mark.parametrize("saved, resumed", [(2, 3), (3, 1)])
def test_resume_at_another_zero_stage_continues(corpus, tmp_path, capsys, saved, resumed):
    """A run that outgrows its stage (or no longer needs stage 3) resumes at the other one:
    the masters, Adam's moments, schedule, data position and RNG carry over, so the losses
    continue the uninterrupted run's, and one note says which stage saved it."""
    def ds(stage):
        return ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, stage), *NO_DROPOUT]
    assert run(corpus, tmp_path / "full", 6, *ds(saved)) == 0
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "split", 6, *ds(saved), "--save", save,
               "--exit-interval", 3) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path / "split", 6, *ds(resumed), "--save", save, "--load", save) == 0
    out = capsys.readouterr().out
    assert f" note: {save}/global_step3 was saved at ZeRO stage {saved}; this run's stage " \
           f"{resumed} takes its fp32 master weights and optimizer state, re-partitioned" in out
    full, split = read_losses(tmp_path / "full"), read_losses(tmp_path / "split")
    assert sorted(split) == list(range(1, 7))
    for iteration in range(4, 7):
        assert math.isclose(split[iteration][0], full[iteration][0], rel_tol=1e-5), iteration


def test_a_finished_run_says_there_is_nothing_to_train(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "log", 2, "--save", save) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path / "log", 2, "--save", save, "--load", save) == 0
    out = capsys.readouterr().out
    assert " nothing to train: the checkpoint is at iteration 2 and --train-iters is 2; raise " \
           "--train-iters (the scripts: TRAIN_ITERS) to train on" in out
    assert sorted(read_losses(tmp_path / "log")) == [1, 2]  # nothing logged twice


def test_another_model_over_a_used_folder_is_told_to_pick_a_new_one(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "log", 2, "--save", save) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path / "log", 2, "--num-layers", 3, "--save", save, "--load",
               save) == 2
    err = capsys.readouterr().err
    assert "--num-layers: checkpoint 2, flags 3" in err
    assert f"This run saves where it loads ({save})" in err
    assert "CHECKPOINT_DIR=checkpoints/<new name>" in err and "Traceback" not in err


@pytest.mark.parametrize("deepspeed", [False, True], ids=["megatron", "deepspeed"])
def test_tiled_over_an_untiled_checkpoint_is_one_error_naming_both(corpus, tmp_path, capsys,
                                                                   deepspeed):
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 1)] if deepspeed else []
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "log", 2, *ds, "--save", save) == 0
    capsys.readouterr()
    tiled = ["--memory-centric-tiled-linear", "--tile-factor", 2]
    assert run(corpus, tmp_path / "log", 4, *ds, *tiled, "--save", save, "--load", save) == 2
    err = capsys.readouterr().err
    assert "no --memory-centric-tiled-linear but this run has --memory-centric-tiled-linear " \
           "--tile-factor 2" in err and "--no-load-optim" in err and "Traceback" not in err
    # the way out the message names works: weights load, the optimizer starts fresh
    assert run(corpus, tmp_path / "log", 4, *ds, *tiled, "--no-load-optim", "--save", save,
               "--load", save) == 0
