"""pretrain_gpt2.py --optimizer adam8bit / adam4bit (and a DeepSpeed JSON's "Adam8bit" /
"Adam4bit"): exact resume in both checkpoint layouts, switching optimizers on --load, and the
combinations they refuse."""

import pytest
import torch

from tests.training.test_deepspeed import read_losses, run, stage_config, write_config


def _resume_matches_unbroken(corpus, tmp_path, *flags):
    assert run(corpus, tmp_path / "full", 6, *flags) == 0
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path / "split", 6, *flags, "--save", save, "--exit-interval", 3) == 0
    assert run(corpus, tmp_path / "split", 6, *flags, "--save", save, "--load", save) == 0
    full, split = read_losses(tmp_path / "full"), read_losses(tmp_path / "split")
    assert sorted(full) == sorted(split) == list(range(1, 7))
    assert full == split
    return full


@pytest.mark.parametrize("name, formula", [("adam8bit", "(2 B + 2 x 4 B per 256-element block"),
                                           ("adam4bit", "(1 B per quantised element + 2 x 4 B per 128-element block")])
def test_resume_is_exact_in_the_megatron_layout(corpus, tmp_path, capsys, name, formula):
    losses = _resume_matches_unbroken(corpus, tmp_path, "--optimizer", name)
    assert losses[6][0] < losses[1][0]
    out = capsys.readouterr().out  # bytes/param and the formula
    assert " > optimizer state: " in out and formula in out
    saved = torch.load(tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=True)["optimizer"]["optimizer"]["state"]
    codes = [entry["exp_avg_codes"] for entry in saved.values()]  # codes, not fp32 moments
    assert codes and all(c.element_size() == 1 for c in codes)
    assert not any("exp_avg" in entry for entry in saved.values())


@pytest.mark.parametrize("name", ["AdamW8bit", "Adam4bit"])
def test_resume_is_exact_with_a_deepspeed_config_that_names_it(corpus, tmp_path, name):
    config = write_config(tmp_path, zero_optimization={"stage": 2, "reduce_bucket_size": 3000},
                          gradient_clipping=1.0,
                          optimizer={"type": name, "params": {"lr": 3e-3,
                                                              "weight_decay": 0.01}})
    _resume_matches_unbroken(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config)


@pytest.mark.parametrize("before, after", [("adam", "adam8bit"), ("adam8bit", "adam4bit"),
                                           ("adam4bit", "adam")])
def test_switching_optimizers_on_load_converts_the_states(corpus, tmp_path, capsys, before,
                                                          after):
    save = tmp_path / "ckpt"
    first = ("--optimizer", before)
    assert run(corpus, tmp_path / "unbroken", 6, *first) == 0
    assert run(corpus, tmp_path / "switch", 6, *first, "--save", save, "--exit-interval", 3) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path / "switch", 6, "--optimizer", after, "--save", save,
               "--load", save) == 0
    assert f"the checkpoint was trained with --optimizer {before}; its Adam states are " \
           f"converted for --optimizer {after} as they load" in capsys.readouterr().out
    unbroken, switched = read_losses(tmp_path / "unbroken"), read_losses(tmp_path / "switch")
    assert switched[4] == unbroken[4]  # the same weights before the first switched step
    for iteration in (5, 6):
        assert abs(switched[iteration][0] - unbroken[iteration][0]) / unbroken[iteration][0] \
            < 0.01


@pytest.mark.parametrize("name", ["adam8bit", "adam4bit"])
@pytest.mark.parametrize("extra, message", [
    ("cpu_optimizer", "--optimizer {} keeps its own quantised state and --cpu-optimizer is the "
                      "fp32 CPU Adam: drop --cpu-optimizer (to step on the CPU, add "
                      "zero_optimization.offload_optimizer"),
    ("json_optimizer", "--optimizer {} and the DeepSpeed config's optimizer section "
                       "(\"Adam\") both choose the optimizer"),
])
def test_what_they_cannot_honour_is_one_error_line(corpus, tmp_path, capsys, extra, message,
                                                   name):
    if extra == "cpu_optimizer":
        extra = ["--cpu-optimizer", "--deepspeed", "--deepspeed_config",
                 stage_config(tmp_path, 1)]
    elif extra == "json_optimizer":
        extra = ["--deepspeed", "--deepspeed_config", write_config(
            tmp_path, zero_optimization={"stage": 1}, optimizer={"type": "Adam"})]
    assert run(corpus, tmp_path / "log", 2, "--optimizer", name, *extra) == 2
    err = capsys.readouterr().err
    assert message.format(name) in err and err.count("\n") == 1 and "Traceback" not in err


def test_resume_is_exact_at_zero_stage_3(corpus, tmp_path):
    config = write_config(tmp_path, zero_optimization={"stage": 3}, gradient_clipping=1.0,
                          optimizer={"type": "Adam8bit", "params": {"lr": 3e-3}})
    _resume_matches_unbroken(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config)


def test_resume_is_exact_with_the_optimizer_offloaded_to_host_memory(corpus, tmp_path):
    config = write_config(tmp_path, zero_optimization={"stage": 2, "offload_optimizer": {
        "device": "cpu"}}, gradient_clipping=1.0, optimizer={"type": "Adam8bit",
                                                              "params": {"lr": 3e-3}})
    _resume_matches_unbroken(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config)


@pytest.mark.parametrize("name", ["Adam8bit", "Adam4bit"])
def test_resume_is_exact_with_the_masters_in_nvme_swap_files(corpus, tmp_path, name):
    (tmp_path / "swap").mkdir()
    config = write_config(tmp_path, zero_optimization={
        "stage": 3, "sub_group_size": 5000, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path / "swap")}},
        gradient_clipping=1.0, optimizer={"type": name, "params": {"lr": 3e-3}})
    _resume_matches_unbroken(corpus, tmp_path, "--deepspeed", "--deepspeed_config", config)
