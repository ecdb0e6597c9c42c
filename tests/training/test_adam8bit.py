"""pretrain_gpt2.py --optimizer adam8bit (and a DeepSpeed JSON's "Adam8bit"): exact resume in
both checkpoint layouts, switching optimizers on --load, and the combinations it refuses."""

import pytest

from tests.training.test_deepspeed import read_losses, run, stage_config, write_config

EIGHT_BIT = ["--optimizer", "adam8bit"]


def _resume_matches_unbroken(corpus, tmp_path, *flags):
    assert run(corpus, tmp_path / "full", 6, *flags) == 0
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "split", 6, *flags, "--save", save, "--exit-interval", 3) == 0
    assert run(corpus, tmp_path / "split", 6, *flags, "--save", save, "--load", save) == 0
    full, split = read_losses(tmp_path / "full"), read_losses(tmp_path / "split")
    assert sorted(full) == sorted(split) == list(range(1, 7))
    assert full == split
    return full


def test_resume_is_exact_in_the_megatron_layout(corpus, tmp_path, capsys):
    losses = _resume_matches_unbroken(corpus, tmp_path, *EIGHT_BIT)
    assert losses[6][0] < losses[1][0]
    assert " > optimizer state: " in capsys.readouterr().out  # bytes/param and the formula


def test_resume_is_exact_with_a_deepspeed_config_that_names_adam8bit(corpus, tmp_path):
    config = write_config(tmp_path, zero_optimization={"stage": 2, "reduce_bucket_size": 3000},
                          gradient_clipping=1.0,
                          optimizer={"type": "AdamW8bit", "params": {"lr": 3e-3,
                                                                      "weight_decay": 0.01}})
    _resume_matches_unbroken(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config)


def test_switching_from_adam_to_adam8bit_on_load_converts_the_states(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "adam", 6) == 0
    assert run(corpus, tmp_path / "switch", 6, "--save", save, "--exit-interval", 3) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path / "switch", 6, *EIGHT_BIT, "--save", save, "--load", save) == 0
    assert "the checkpoint was trained with --optimizer adam; its Adam states are converted " \
           "for --optimizer adam8bit as they load" in capsys.readouterr().out
    adam, switched = read_losses(tmp_path / "adam"), read_losses(tmp_path / "switch")
    assert switched[4] == adam[4]  # the same weights before the first 8-bit step
    for iteration in (5, 6):
        assert abs(switched[iteration][0] - adam[iteration][0]) / adam[iteration][0] < 0.01


@pytest.mark.parametrize("extra, message", [
    ("cpu_optimizer", "--optimizer adam8bit steps on the device"),
    ("json_optimizer", "--optimizer adam8bit and the DeepSpeed config's optimizer section "
                       "(\"Adam\") both choose the optimizer"),
])
def test_what_adam8bit_cannot_honour_is_one_error_line(corpus, tmp_path, capsys, extra,
                                                       message):
    if extra == "cpu_optimizer":
        extra = ["--cpu-optimizer", "--deepspeed", "--deepspeed_config",
                 stage_config(tmp_path, 1)]
    elif extra == "json_optimizer":
        extra = ["--deepspeed", "--deepspeed_config", write_config(
            tmp_path, zero_optimization={"stage": 1}, optimizer={"type": "Adam"})]
    assert run(corpus, tmp_path / "log", 2, *EIGHT_BIT, *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_resume_is_exact_at_zero_stage_3(corpus, tmp_path):
    config = write_config(tmp_path, zero_optimization={"stage": 3}, gradient_clipping=1.0,
                          optimizer={"type": "Adam8bit", "params": {"lr": 3e-3}})
    _resume_matches_unbroken(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config)


def test_resume_is_exact_with_the_optimizer_offloaded_to_host_memory(corpus, tmp_path):
    config = write_config(tmp_path, zero_optimization={"stage": 2, "offload_optimizer": {
        "device": "cpu"}}, gradient_clipping=1.0, optimizer={"type": "Adam8bit",
                                                              "params": {"lr": 3e-3}})
    _resume_matches_unbroken(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config)


def test_resume_is_exact_with_the_masters_in_nvme_swap_files(corpus, tmp_path):
    (tmp_path / "swap").mkdir()
    config = write_config(tmp_path, zero_optimization={
        "stage": 3, "sub_group_size": 5000, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path / "swap")}},
        gradient_clipping=1.0, optimizer={"type": "Adam8bit", "params": {"lr": 3e-3}})
    _resume_matches_unbroken(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config)
