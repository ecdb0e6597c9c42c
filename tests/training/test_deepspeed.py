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
import zero
from megatron.config import resolve_config
from megatron.errors import ConfigError
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


def test_megatron_checkpoint_under_deepspeed_is_a_clear_error(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "a", 2, "--save", save) == 0
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 2)]
    assert run(corpus, tmp_path / "b", 4, *ds, "--load", save) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "saved without --deepspeed" in err
    assert "Traceback" not in err
    assert "start this run from its weights with --finetune and a --save directory" in err
    # which works: the first loss is the one the same fine-tuning gets without --deepspeed
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


# ------------------------------------------------------------------ flags and config

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--batch-size", "4", "--train-iters", "10", "--lr", "1e-3",
        "--data-path", "x", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v",
        "--merge-file", "m"]


def parse(*extra, world_size=1):
    return resolve_config(BASE + [str(e) for e in extra], world_size=world_size)


def test_flags_override_the_config_and_fill_its_batch_sizes(tmp_path):
    config = write_config(tmp_path, zero_optimization={"stage": 2, "reduce_bucket_size": 10},
                          bf16={"enabled": True})
    parsed = parse("--deepspeed", "--deepspeed_config", config, "--global-batch-size", 16,
                   "--zero-stage", 1, "--zero-reduce-bucket-size", "5e7",
                   "--zero-allgather-bucket-size", 1000, "--zero-contigious-gradients",
                   "--zero-reduce-scatter", world_size=2)
    final = parsed.engine.ds_config.raw
    assert final["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 50_000_000,
                                          "allgather_bucket_size": 1000,
                                          "contiguous_gradients": True,
                                          "reduce_scatter": True}
    assert final["train_micro_batch_size_per_gpu"] == 4
    assert final["gradient_accumulation_steps"] == 2  # 16 / (4 x 2 ranks)
    assert parsed.precision.params_dtype == "bfloat16"
    assert parsed.precision.bf16 and not parsed.precision.fp16
    assert parsed.optimizer.clip_grad == 0.0  # no gradient_clipping: DeepSpeed's default
    assert "gradient_clipping" not in final
    assert parsed.engine.ds_config.zero_optimization.reduce_bucket_size == 50_000_000
    spelled = parse("--deepspeed", "--deepspeed_config", config,
                    "--zero-contiguous-gradients")
    assert spelled.engine.ds_config.zero_optimization.contiguous_gradients is True


def test_global_batch_comes_from_the_config_when_not_given(tmp_path):
    config = write_config(tmp_path, train_batch_size=24, train_micro_batch_size_per_gpu=4)
    parsed = parse("--deepspeed", "--deepspeed_config", config, world_size=2)
    assert parsed.training.global_batch_size == 24
    assert parsed.training.num_micro_batches == 3  # 24 / (4 x 2)
    parsed = parse("--deepspeed", "--deepspeed_config", config, "--clip-grad", 0.5,
                   world_size=2)
    assert parsed.optimizer.clip_grad == 0.5
    assert parsed.engine.ds_config.gradient_clipping == 0.5


def test_the_micro_batch_comes_from_the_config_without_batch_size(tmp_path):
    without = [a for i, a in enumerate(BASE) if "--batch-size" not in BASE[max(i - 1, 0):i + 1]]
    micro = write_config(tmp_path, "micro.json", train_micro_batch_size_per_gpu=6)
    parsed = resolve_config(without + ["--deepspeed", "--deepspeed_config", micro])
    assert (parsed.training.batch_size, parsed.training.global_batch_size) == (6, 6)
    total = write_config(tmp_path, "total.json", train_batch_size=24,
                         gradient_accumulation_steps=3)
    parsed = resolve_config(without + ["--deepspeed", "--deepspeed_config", total],
                            world_size=2)
    assert (parsed.training.batch_size, parsed.training.num_micro_batches) == (4, 3)
    neither = write_config(tmp_path, "neither.json", zero_optimization={"stage": 1})
    with pytest.raises(ConfigError, match="--batch-size is required: DeepSpeed config .*"
                                          "neither.json sets no batch size either"):
        resolve_config(without + ["--deepspeed", "--deepspeed_config", neither])
    with pytest.raises(ConfigError, match="^--batch-size is required$"):
        resolve_config(without)


def test_help_says_what_deepspeed_chooses(capsys):
    from megatron.config.flags import build_parser
    text = build_parser().format_help()
    assert "no impact" not in text and "save DeepSpeed's checkpoint layout" in text


def test_deepspeed_mpi_takes_rank_and_world_size_from_mpi(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.setenv(name, "0")  # recorded, so the variables the flag sets are removed
        monkeypatch.delenv(name)       # again after the test
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    config = write_config(tmp_path, train_micro_batch_size_per_gpu=4)
    parsed = resolve_config(BASE + ["--deepspeed", "--deepspeed_config", config,
                                    "--deepspeed_mpi"])
    assert os.environ["RANK"] == "1" and os.environ["WORLD_SIZE"] == "2"
    assert parsed.parallel.world_size == 2 and parsed.training.global_batch_size == 8


BAD_FLAGS = {
    "micro-batch-mismatch": (
        {"train_micro_batch_size_per_gpu": 8}, [],
        "--batch-size 4 disagrees with DeepSpeed config {config}: train_batch_size 16 = "
        "train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 1 x data-parallel "
        "size 2"),
    "global-batch-mismatch": (
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4},
        ["--global-batch-size", "32"],
        "--global-batch-size 32 disagrees with DeepSpeed config {config}: train_batch_size 16"),
    "precision-mismatch": ({"bf16": {"enabled": True}}, ["--fp16"],
                           "--fp16 is given but 'fp16.enabled' is not true"),
    "clip-mismatch": ({"gradient_clipping": 1.0}, ["--clip-grad", "0.5"],
                      "--clip-grad 0.5 disagrees with 'gradient_clipping': 1.0"),
    "zero-stage-4": ({}, ["--zero-stage", "4"], "--zero-stage 4 is not a ZeRO stage"),
    "remote-device-below-stage-3": (
        {"zero_optimization": {"stage": 2}}, ["--remote-device", "cpu"],
        "--remote-device places ZeRO stage 3 parameter partitions (zero.Init), but the ZeRO "
        "stage is 2"),
    "offload-at-stage-0": (
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, [],
        "'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3, but "
        "'zero_optimization.stage' is 0"),
    "offload-param-below-stage-3": (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, [],
        "'zero_optimization.offload_param' needs ZeRO stage 3"),
    "bad-bucket": ({}, ["--zero-reduce-bucket-size", "0"],
                   "--zero-reduce-bucket-size must be a positive number"),
    "loss-scale-without-fp16": ({}, ["--loss-scale", "128"],
                                "--loss-scale has no effect: 'fp16.enabled' is not true"),
    "loss-scale-window-mismatch": ({"fp16": {"enabled": True, "loss_scale_window": 100}},
                                   ["--loss-scale-window", "200"],
                                   "--loss-scale-window 200 disagrees with "
                                   "'fp16.loss_scale_window'"),
    "fp32-allreduce-mismatch": ({}, ["--fp32-allreduce"],
                                "--fp32-allreduce True disagrees with 'communication_data_type'"),
    "ddp-impl": ({}, ["--DDP-impl", "torch"], "--DDP-impl has no effect under --deepspeed"),
    "no-save-optim": ({}, ["--no-save-optim"], "--no-save-optim has no effect under --deepspeed"),
}


@pytest.mark.parametrize("name", list(BAD_FLAGS))
def test_inconsistent_flags_and_config_are_config_errors(tmp_path, name):
    entries, extra, message = BAD_FLAGS[name]
    config = write_config(tmp_path, **entries)
    # flag conflicts are the trainer's ConfigError; config-only conflicts are zero's
    with pytest.raises((ConfigError, zero.ConfigError)) as error:
        parse("--deepspeed", "--deepspeed_config", config, *extra, world_size=2)
    assert message.format(config=config) in str(error.value)


def test_deepspeed_flags_need_each_other():
    with pytest.raises(ConfigError, match="--deepspeed needs --deepspeed_config"):
        parse("--deepspeed")
    with pytest.raises(ConfigError, match=r"--deepspeed_config, --zero-stage only act\(s\) "
                                          r"with --deepspeed"):
        parse("--deepspeed_config", "x.json", "--zero-stage", "1")


@pytest.mark.parametrize("entries, path, message", [
    ({"zero_optimizaton": {"stage": 2}}, None,
     "unknown key 'zero_optimizaton' at the top level; did you mean 'zero_optimization'?"),
    ({}, "/nonexistent/ds.json", "DeepSpeed config file '/nonexistent/ds.json' does not exist"),
], ids=["unknown-key", "missing-file"])
def test_config_mistakes_are_one_error_line(corpus, tmp_path, capsys, entries, path, message):
    config = path or write_config(tmp_path, **entries)
    assert run(corpus, tmp_path / "log", 2, "--deepspeed", "--deepspeed_config", config) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    if path is None:
        assert f"DeepSpeed config {config}:" in err  # the user's file, not "(dict)"
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_activation_checkpointing_options_need_recomputation(corpus, tmp_path, capsys):
    """The section acts (tests/training/test_activation_checkpointing.py) on the checkpoints of
    --checkpoint-activations; without those it would do nothing, so it is refused."""
    config = stage_config(tmp_path, 1, activation_checkpointing={"partition_activations": True})
    assert run(corpus, tmp_path / "log", 2, "--deepspeed", "--deepspeed_config", config) == 2
    err = capsys.readouterr().err
    assert "'activation_checkpointing.partition_activations' acts on the checkpoints of " \
           "--checkpoint-activations, which is off" in err, err


def test_gradient_checkpointing_key_turns_on_recomputation(corpus, tmp_path):
    """Our extension: "gradient_checkpointing": true recomputes each layer in backward, which
    changes nothing numerically (dropout 0 here) but must be switched on."""
    plain = stage_config(tmp_path, 1)
    recompute = write_config(tmp_path, "recompute.json", gradient_checkpointing=True,
                             zero_optimization={"stage": 1}, gradient_clipping=1.0)
    assert run(corpus, tmp_path / "a", 2, *NO_DROPOUT, "--deepspeed", "--deepspeed_config",
               plain) == 0
    assert run(corpus, tmp_path / "b", 2, *NO_DROPOUT, "--deepspeed", "--deepspeed_config",
               recompute) == 0
    a, b = read_losses(tmp_path / "a"), read_losses(tmp_path / "b")
    assert all(a[i][0] == pytest.approx(b[i][0], rel=1e-6) for i in a)
    argv = trainer_argv(corpus, tmp_path / "c", 2, "--deepspeed", "--deepspeed_config",
                        recompute, "--tokenizer-type", "GPT2BPETokenizer")
    assert resolve_config(argv, world_size=1).activation_checkpointing.checkpoint_activations


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

def test_resume_at_another_zero_stage_continues_or_says_why_not(corpus, tmp_path, capsys):
    """Stages 1 and 2 keep the same optimizer-state files: a stage-2 save resumes at stage 1
    and trains on (the loss curve continues); stage 3 keeps its states per parameter, so a
    stage-2 save is one clear error there, never a run that trains nothing."""
    def ds(stage):
        return ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, stage), *NO_DROPOUT]
    assert run(corpus, tmp_path / "full", 6, *ds(2)) == 0
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "split", 6, *ds(2), "--save", save, "--exit-interval", 3) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path / "stage3", 6, *ds(3), "--save", save, "--load", save) == 2
    err = capsys.readouterr().err
    assert "holds no ZeRO stage 3 model states" in err and "Traceback" not in err
    assert run(corpus, tmp_path / "split", 6, *ds(1), "--save", save, "--load", save) == 0
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
