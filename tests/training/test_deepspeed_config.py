"""pretrain_gpt2.py --deepspeed: the DeepSpeed JSON and the Megatron flags resolved into one
config, and the mistakes in either refused with one error line."""

import os

import pytest

import zero
from megatron.config import resolve_config
from megatron.errors import ConfigError
from tests.training.test_deepspeed import (NO_DROPOUT, read_losses, run, stage_config,
                                           trainer_argv, write_config)

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


def test_clip_grad_over_a_config_without_clipping_says_megatron_deepspeed_would_not_clip(
        tmp_path):
    config = write_config(tmp_path, "noclip.json", zero_optimization={"stage": 1})
    parsed = parse("--deepspeed", "--deepspeed_config", config, "--clip-grad", 1.0)
    assert parsed.engine.ds_config.gradient_clipping == 1.0
    assert f" note: --clip-grad 1 clips the gradients: DeepSpeed config {config} sets no " \
        "'gradient_clipping' (Megatron-DeepSpeed ignores --clip-grad under --deepspeed, so the " \
        "same script clips nothing there)" in parsed.notes
    assert parse("--deepspeed", "--deepspeed_config", config).engine.ds_config \
        .gradient_clipping == 0.0  # nothing given: DeepSpeed's default, off
    assert not any("clip" in note for note in parse("--deepspeed", "--deepspeed_config",
                                                    config).notes)


def test_old_and_empty_zero_sections_read_as_zero_reads_them(tmp_path, caplog):
    """A ZeRO-1 era boolean section (with its 'allgather_size') and a null one."""
    config = write_config(tmp_path, "bool.json", zero_optimization=True, allgather_size=1000)
    with caplog.at_level("WARNING"):
        zero_config = parse("--deepspeed", "--deepspeed_config", config).engine.ds_config
    assert "boolean 'zero_optimization' is deprecated" in caplog.text
    assert (zero_config.zero_optimization.stage,
            zero_config.zero_optimization.allgather_bucket_size) == (1, 1000)
    caplog.clear()
    without_batch_size = [a for i, a in enumerate(BASE)
                          if "--batch-size" not in BASE[max(i - 1, 0):i + 1]]
    config = write_config(tmp_path, "micro.json", train_micro_batch_size_per_gpu=2,
                          zero_optimization={"stage": 2, "cpu_offload": True})
    with caplog.at_level("WARNING"):  # the micro batch is read from it first: one warning
        resolve_config(without_batch_size + ["--deepspeed", "--deepspeed_config", config])
    assert caplog.text.count("'zero_optimization.cpu_offload' is deprecated") == 1
    config = write_config(tmp_path, "null.json", zero_optimization=None)
    zero_config = parse("--deepspeed", "--deepspeed_config", config, "--zero-stage", 2).engine
    assert zero_config.ds_config.zero_optimization.stage == 2


def test_keys_that_would_do_nothing_get_a_note_each(tmp_path):
    config = write_config(tmp_path, steps_per_print=None, wall_clock_breakdown=True,
                          dataloader_drop_last=True,
                          zero_optimization={
                              "stage": 3, "stage3_max_live_parameters": 10,
                              "prefetch_bucket_size": 10,
                              "offload_optimizer": {"device": "cpu", "nvme_path": "/tmp"},
                              "offload_param": {"pin_memory": True}})
    notes = parse("--deepspeed", "--deepspeed_config", config, "--zero-stage", 2,
                  "--zero-reduce-bucket-size", 100).notes
    assert notes == (
        " note: 'zero_optimization.offload_optimizer.nvme_path' not used: the device is "
        "\"cpu\", not \"nvme\"",
        " note: 'zero_optimization.offload_param' names no \"device\" (the default is "
        "\"none\"), so nothing is offloaded; add \"device\": \"cpu\" or \"nvme\"",
        " note: zero_optimization.prefetch_bucket_size, zero_optimization.stage3_max_live_parameters"
        " not used: only ZeRO stage 3 reads them, and the stage is 2",
        " note: 'dataloader_drop_last' not used: it is for the loader of zero.initialize's "
        "training_data, and the trainer reads its data through its own sampler, which gives "
        "every iteration a whole global batch"), notes
    used = write_config(tmp_path, "used.json", zero_optimization={
        "stage": 3, "stage3_max_live_parameters": 10, "offload_param": {"device": "none"}})
    assert parse("--deepspeed", "--deepspeed_config", used).notes == ()


def test_wall_clock_breakdown_and_timing_log_level_are_one_switch(tmp_path):
    """The JSON's wall_clock_breakdown prints the phase times under the log line (not only
    every steps_per_print steps); --timing-log-level 1 turns it on in a JSON without it."""
    timed = write_config(tmp_path, "timed.json", wall_clock_breakdown=True)
    assert parse("--deepspeed", "--deepspeed_config", timed).logging.phase_times
    plain = write_config(tmp_path, "plain.json")
    assert not parse("--deepspeed", "--deepspeed_config", plain).logging.phase_times
    flagged = parse("--deepspeed", "--deepspeed_config", plain, "--timing-log-level", 1)
    assert flagged.logging.phase_times and flagged.engine.ds_config.wall_clock_breakdown
    by_json = parse("--deepspeed", "--deepspeed_config", timed, "--timing-log-option", "all")
    assert by_json.logging.timing_log_option == "all" and by_json.notes == ()  # timers on


def test_the_lr_comes_from_the_config_without_lr(tmp_path):
    """As --batch-size: under --deepspeed a JSON that sets the optimizer's lr needs no --lr."""
    without = [a for i, a in enumerate(BASE) if "--lr" not in BASE[max(i - 1, 0):i + 1]]
    config = write_config(tmp_path, "lr.json", optimizer={"type": "Adam", "params": {"lr": 5e-4}},
                          scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
    parsed = resolve_config(without + ["--deepspeed", "--deepspeed_config", config])
    assert parsed.optimizer.lr == 5e-4
    assert parsed.engine.ds_config.optimizer.params["lr"] == 5e-4
    assert not any("optimizer.params.lr" in note for note in parsed.notes)
    with pytest.raises(ConfigError, match="--min-lr 0.001 is larger than --lr 0.0005"):
        resolve_config(without + ["--deepspeed", "--deepspeed_config", config,
                                  "--min-lr", "1e-3"])
    for name, optimizer in (("none.json", None), ("auto.json", {"type": "Adam", "params": {
            "lr": "auto"}}), ("nolr.json", {"type": "Adam", "params": {}})):
        config = write_config(tmp_path, name, **({"optimizer": optimizer} if optimizer else {}))
        with pytest.raises(ConfigError, match=f"^--lr is required: DeepSpeed config .*{name} "
                                              "sets no number at 'optimizer.params.lr' either$"):
            resolve_config(without + ["--deepspeed", "--deepspeed_config", config])
    config = write_config(tmp_path, "text.json", optimizer={"type": "Adam", "params": {
        "lr": "1e-3"}})
    with pytest.raises(ConfigError, match="'optimizer.params.lr' in DeepSpeed config .*text.json "
                                          "must be a non-negative number, got \"1e-3\""):
        resolve_config(without + ["--deepspeed", "--deepspeed_config", config])
    with pytest.raises(ConfigError, match="^--lr is required$"):
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
    "pin-memory-without-host-partitions": (
        {"zero_optimization": {"stage": 3}}, ["--use-pin-memory"],
        "--use-pin-memory pins the parameter partitions kept in host memory, but they stay on "
        "the compute device"),
    "offload-at-stage-0": (
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, [],
        "'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3, but "
        "'zero_optimization.stage' is 0"),
    "offload-param-below-stage-3": (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, [],
        "'zero_optimization.offload_param' needs ZeRO stage 3"),
    "zero-stage-flag-below-the-offload": (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        ["--zero-stage", "0"], "'zero_optimization.stage' is 0 (--zero-stage 0 sets "
        "'zero_optimization.stage' over the config)"),
    "zero-optimization-not-an-object": ({"zero_optimization": [1]}, [],
                                        "'zero_optimization' must be an object {{...}}, got [1]"),
    "bad-bucket": ({}, ["--zero-reduce-bucket-size", "0"],
                   "--zero-reduce-bucket-size must be a positive number"),
    "loss-scale-without-fp16": ({}, ["--loss-scale", "128"],
                                "--loss-scale has no effect: 'fp16.enabled' is not true"),
    "loss-scale-window-mismatch": ({"fp16": {"enabled": True, "loss_scale_window": 100}},
                                   ["--loss-scale-window", "200"],
                                   "--loss-scale-window 200 disagrees with "
                                   "'fp16.loss_scale_window': 100 in DeepSpeed config"),
    "fp32-allreduce-mismatch": ({}, ["--fp32-allreduce"],
                                "--fp32-allreduce True disagrees with 'communication_data_type': "
                                "null"),
    "fp32-accumulation-mismatch": ({"bf16": {"enabled": True},
                                    "data_types": {"grad_accum_dtype": "bf16"}},
                                   ["--accumulate-allreduce-grads-in-fp32"],
                                   "--accumulate-allreduce-grads-in-fp32 disagrees with "
                                   "'data_types.grad_accum_dtype': \"bf16\" in DeepSpeed config"),
    "fp32-accumulation-at-stage-1": ({"bf16": {"enabled": True},
                                      "zero_optimization": {"stage": 1}},
                                     ["--accumulate-allreduce-grads-in-fp32"],
                                     "'data_types.grad_accum_dtype' 'fp32' with bf16 parameters "
                                     "at ZeRO stage 1: gradients are summed in the parameters' "
                                     "dtype (bf16)"),
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


def test_remote_device_is_the_engines_offload_param_device(tmp_path):
    """zero.Init (the flag) and the engine (the config) keep the partitions in one place."""
    swap = write_config(tmp_path, "swap.json", zero_optimization={
        "stage": 3, "offload_param": {"device": "cpu", "nvme_path": str(tmp_path)}})
    parsed = parse("--deepspeed", "--deepspeed_config", swap, "--remote-device", "nvme")
    assert parsed.engine.ds_config.zero_optimization.offload_param.device == "nvme"
    assert not any("nvme_path" in note for note in parsed.notes)
    stage3 = write_config(tmp_path, "stage3.json", zero_optimization={"stage": 3})
    with pytest.raises(zero.ConfigError, match=r"'zero_optimization.offload_param.nvme_path' "
                                               r"is not set; .* \(--remote-device nvme sets "
                                               r"'zero_optimization.offload_param.device' over "
                                               r"the config\)") as error:
        parse("--deepspeed", "--deepspeed_config", stage3, "--remote-device", "nvme")
    assert error.value.same_on_every_rank  # every rank parses the same file: rank 0 says it
    assert parse("--deepspeed", "--deepspeed_config", swap, "--remote-device",
                 "none").engine.ds_config.zero_optimization.offload_param is None


def test_pinned_partitions_need_host_partitions(tmp_path):
    stage3 = write_config(tmp_path, "stage3.json", zero_optimization={"stage": 3})
    engine = parse("--deepspeed", "--deepspeed_config", stage3, "--use-pin-memory",
                   "--remote-device", "cpu").engine
    assert engine.use_pin_memory and engine.remote_device == "cpu"
    offloaded = write_config(tmp_path, "offloaded.json", zero_optimization={
        "stage": 3, "offload_param": {"device": "cpu"}})
    assert parse("--deepspeed", "--deepspeed_config", offloaded,
                 "--use-pin-memory").engine.use_pin_memory


def test_deepspeed_flags_need_each_other():
    with pytest.raises(ConfigError, match="--deepspeed needs --deepspeed_config"):
        parse("--deepspeed")
    with pytest.raises(ConfigError, match=r"--deepspeed_config, --zero-stage only act\(s\) "
                                          r"with --deepspeed"):
        parse("--deepspeed_config", "x.json", "--zero-stage", "1")
    # before the batch arithmetic, which a ramp would otherwise fail first
    with pytest.raises(ConfigError, match=r"^--deepspeed_config only act\(s\) with --deepspeed"):
        parse("--deepspeed_config", "x.json", "--rampup-batch-size", "4", "4", "64")


@pytest.mark.parametrize("entries, path, message", [
    ({"zero_optimizaton": {"stage": 2}}, None,
     "unknown key 'zero_optimizaton' at the top level; did you mean 'zero_optimization'?"),
    ({}, "/nonexistent/ds.json", "DeepSpeed config file '/nonexistent/ds.json' does not exist"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}},
     None, "SGD is not one of the optimizers ZeRO is tested with"),  # the engine's, at start
], ids=["unknown-key", "missing-file", "untested-optimizer"])
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


def test_the_json_optimizer_and_the_megatron_optimizer_flags_meet(tmp_path):
    """"auto" and keys the JSON leaves out take a given flag's value; a value it sets must
    equal a given flag's; its lr, without a 'scheduler' section, is replaced by --lr (a
    note); with one, Megatron's schedule flags get a note that they are not used."""
    config = write_config(tmp_path, optimizer={"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}})
    parsed = parse("--deepspeed", "--deepspeed_config", config, "--weight-decay", 0.3,
                   "--adam-beta2", 0.95, "--adam-eps", 1e-5)
    assert parsed.engine.ds_config.optimizer.params == {
        "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-5, "weight_decay": 0.3}
    assert not any("optimizer.params.lr" in note for note in parsed.notes)
    config = write_config(tmp_path, optimizer={"type": "Adam", "params": {"lr": 0.5}})
    parsed = parse("--deepspeed", "--deepspeed_config", config, "--weight-decay", 0.1,
                   "--adam-beta1", 0.8)
    assert parsed.engine.ds_config.optimizer.params == {
        "lr": 0.5, "weight_decay": 0.1, "betas": [0.8, 0.999]}
    assert f" note: 'optimizer.params.lr' 0.5 in DeepSpeed config {config} is replaced by " \
        "Megatron's schedule from --lr 0.001 (the config has no 'scheduler' section)" \
        in parsed.notes
    config = write_config(tmp_path, optimizer={"type": "Adam", "params": {
        "weight_decay": 0.01, "betas": [0.9, 0.999]}})
    with pytest.raises(ConfigError, match=r"--adam-beta1 0\.95 disagrees with "
                                          r"'optimizer\.params\.betas': \[0\.9, 0\.999\]"):
        parse("--deepspeed", "--deepspeed_config", config, "--adam-beta1", 0.95)
    with pytest.raises(ConfigError, match=r"--weight-decay 0\.2 disagrees with "
                                          r"'optimizer\.params\.weight_decay': 0\.01"):
        parse("--deepspeed", "--deepspeed_config", config, "--weight-decay", 0.2)
    config = write_config(tmp_path, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    with pytest.raises(ConfigError, match="--adam-eps sets an Adam hyperparameter, but the "
                                          "optimizer of DeepSpeed config .* is \"SGD\""):
        parse("--deepspeed", "--deepspeed_config", config, "--adam-eps", 1e-6)
    config = write_config(tmp_path, optimizer={"type": "Adam", "params": {"lr": 1e-3}},
                          scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
    parsed = parse("--deepspeed", "--deepspeed_config", config, "--lr-decay-style", "cosine",
                   "--min-lr", 1e-5)
    assert f" note: --lr, --lr-decay-style, --min-lr not used: the 'scheduler' section of " \
        f"DeepSpeed config {config} sets the learning rate under --deepspeed, not Megatron's " \
        "schedule" in parsed.notes  # WarmupLR's warmup_max_lr (0.001) is the peak, not --lr


def test_cpu_optimizer_flags_that_would_do_nothing_are_refused(tmp_path):
    with_json_optimizer = write_config(tmp_path, optimizer={"type": "SGD", "params": {"lr": 0.1}},
                                       zero_optimization={"stage": 1},
                                       zero_allow_untested_optimizer=True)
    with pytest.raises(ConfigError, match=r"--cpu-optimizer and the DeepSpeed config's optimizer "
                                          r'section \("SGD"\) both choose the optimizer'):
        parse("--deepspeed", "--deepspeed_config", with_json_optimizer, "--cpu-optimizer")
    stage1 = write_config(tmp_path, zero_optimization={"stage": 1})
    with pytest.raises(ConfigError, match="^--cpu-torch-adam picks torch's AdamW as "
                                          "--cpu-optimizer's CPU Adam; add --cpu-optimizer"):
        parse("--deepspeed", "--deepspeed_config", stage1, "--cpu-torch-adam")  # as typed
    offloaded = write_config(tmp_path, zero_optimization={
        "stage": 2, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ConfigError, match="--cpu_torch_adam has no effect under "
                                          "zero_optimization.offload_optimizer"):
        parse("--deepspeed", "--deepspeed_config", offloaded, "--cpu-optimizer",
              "--cpu_torch_adam")
    assert parse("--deepspeed", "--deepspeed_config", offloaded, "--cpu-optimizer")
    assert parse("--deepspeed", "--deepspeed_config", offloaded, "--cpu-optimizer",
                 "--device", "cuda")
    # on a GPU the CPU Adam meets GPU parameters unless the optimizer is offloaded
    stage1 = write_config(tmp_path, "stage1.json", zero_optimization={"stage": 1})
    assert parse("--deepspeed", "--deepspeed_config", stage1, "--cpu-optimizer",
                 "--device", "cpu")
    with pytest.raises(ConfigError, match="--cpu-optimizer steps a CPU Adam, but without "
                                          "zero_optimization.offload_optimizer the fp32 "
                                          "parameters and gradients stay on the GPU"):
        parse("--deepspeed", "--deepspeed_config", stage1, "--cpu-optimizer", "--device", "cuda")
    assert parse("--deepspeed", "--deepspeed_config", stage1, "--cpu-optimizer",
                 "--cpu_torch_adam", "--device", "cuda")


def test_a_deepspeed_resume_says_which_optimizer_settings_the_loaded_state_keeps(
        corpus, tmp_path, capsys):
    """As without --deepspeed: the flag-built optimizer's loaded state keeps the checkpoint's
    weight decay and Adam settings, and the resume says so."""
    config, save = stage_config(tmp_path, 1), str(tmp_path / "ckpt")
    assert run(corpus, tmp_path / "log", 2, "--deepspeed", "--deepspeed_config", config,
               "--save", save) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path / "log2", 3, "--deepspeed", "--deepspeed_config", config,
               "--load", save, "--weight-decay", "0.2", "--adam-beta2", "0.95") == 0
    assert (" note: --weight-decay 0.2 (the checkpoint's: 0.01), --adam-beta2 0.95 (the "
            "checkpoint's: 0.999): the loaded optimizer state keeps the checkpoint's values"
            in capsys.readouterr().out)
