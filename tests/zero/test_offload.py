"""Optimizer offload (cpu and nvme) at ZeRO stages 1-2: same losses as without offload at
DP=1 and DP=2, exact resume with NVMe, swapped state really off the heap, and bad input."""

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from zero.errors import ConfigError
from zero.ops import CPUAdam

STEPS = 20


def _offload(device, nvme_path=None, **options):
    zero = {"offload_optimizer": {"device": device, **options}}
    if device == "nvme":
        zero["offload_optimizer"]["nvme_path"] = str(nvme_path)
        zero["sub_group_size"] = 500  # several sub-groups per param group: swapping is exercised
    return zero


def _relative_error(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _variants(nvme_path):
    return {"cpu": _offload("cpu"),
            "nvme": _offload("nvme", nvme_path, pipeline_read=True, pipeline_write=True),
            "nvme_sync": _offload("nvme", nvme_path, buffer_count=1, fast_init=True)}


# (stage, variant) pairs run at each DP size; DP=2 runs fewer to keep the test fast
RUNS = {1: [(s, v) for s in (1, 2) for v in ("none", "cpu", "nvme", "nvme_sync")],
        2: [(2, "none"), (2, "cpu"), (2, "nvme"), (1, "nvme")]}


def _train_all(rank, world_size, nvme_path):
    results, variants = {}, _variants(nvme_path)
    for stage, name in RUNS[world_size]:
        engine = cases.make_engine(cases.ds_config(stage, **variants.get(name, {})))
        results[name, stage] = cases.train_steps(engine, STEPS)
        results[name, stage, "optimizer"] = type(engine.optimizer.optimizer).__name__
        engine.destroy()  # deletes the swap files
    return results


@pytest.fixture(scope="module")
def reference_losses():
    return cases.train_reference(STEPS)[0]


@pytest.mark.parametrize("world_size", [1, 2])
def test_offloaded_losses_match_the_plain_run(world_size, tmp_path, reference_losses):
    if world_size == 1:
        results = [_train_all(0, 1, tmp_path)]
    else:
        results = run_distributed(_train_all, 2, args=(str(tmp_path),))
    for stage, name in RUNS[world_size]:
        plain = results[0].get(("none", stage), results[0]["none", 2])  # stages 1, 2 agree
        assert _relative_error(plain, reference_losses) < 1e-4
        if name != "none":
            assert results[0][name, stage, "optimizer"] == "CPUAdam"
            for rank_results in results:
                assert _relative_error(rank_results[name, stage], plain) < 1e-4, (name, stage)
    assert os.listdir(tmp_path) == []  # swap files and their folders removed


def _resume(rank, world_size, nvme_path, save_dir):
    config = cases.ds_config(2, **_offload("nvme", nvme_path, pipeline_read=True,
                                           pipeline_write=True))
    straight = cases.train_steps(cases.make_engine(config), 8)
    first = cases.make_engine(config)
    cases.train_steps(first, 4)
    first.save_checkpoint(save_dir)
    del first
    second = cases.make_engine(config, model=cases.make_model(seed=99))  # other weights
    second.load_checkpoint(save_dir)
    return straight, cases.train_steps(second, 4, start=4)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_nvme_offload_resumes_exactly(world_size, tmp_path):
    nvme, save = str(tmp_path / "nvme"), str(tmp_path / "ckpt")
    os.makedirs(nvme)
    if world_size == 1:
        results = [_resume(0, 1, nvme, save)]
    else:
        results = run_distributed(_resume, 2, args=(nvme, save))
    for straight, resumed in results:
        assert resumed == straight[4:]
    optim = torch.load(os.path.join(save, "global_step4",
                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                       weights_only=True)["optimizer_state_dict"]
    state = optim["base_optimizer_state"]["state"][0]
    assert float(state["step"]) == 4 and state["exp_avg"].abs().sum() > 0  # swapped in


def test_cpu_and_nvme_checkpoints_are_interchangeable(tmp_path):
    """A checkpoint saved with NVMe offload resumes without offload to the same losses."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    offloaded = cases.make_engine(cases.ds_config(2, **_offload("nvme", nvme)))
    cases.train_steps(offloaded, 3)
    offloaded.save_checkpoint(str(tmp_path / "ckpt"))
    expected = cases.train_steps(offloaded, 3, start=3)
    plain = cases.make_engine(cases.ds_config(2))
    plain.load_checkpoint(str(tmp_path / "ckpt"))
    assert _relative_error(cases.train_steps(plain, 3, start=3), expected) < 1e-6


def test_nvme_keeps_the_optimizer_state_out_of_memory(tmp_path):
    engine = cases.make_engine(cases.ds_config(2, **_offload("nvme", tmp_path, buffer_count=2)))
    cases.train_steps(engine, 2)
    optimizer = engine.optimizer
    partition = sum(g.layout.partition_numel for g in optimizer.groups)
    assert all(g.master.untyped_storage().nbytes() == 0 for g in optimizer.groups)
    assert not optimizer.optimizer.state  # no moments in memory
    # at most buffer_count (2) buffers of master + 2 moments, made as the walk needs them,
    # each as long as the largest sub-group (sub_group_size 500 caps it)
    largest = min(500, max(g.layout.partition_numel for g in optimizer.groups))
    resident = optimizer.masters.store.resident_bytes()
    assert 3 * 4 * largest <= resident <= 2 * 3 * 4 * largest < 3 * 4 * partition
    files = os.listdir(optimizer.masters.store.swap_dir)
    assert sorted(files) == sorted(f"{g}_{name}.tensor.swp" for g in range(2)
                                   for name in ("master", "exp_avg", "exp_avg_sq"))


def test_old_cpu_offload_key_and_config_optimizer_choose_cpu_adam():
    config = cases.ds_config(1, cpu_offload=True)
    config["optimizer"] = {"type": "Adam", "params": {"lr": cases.LR}}
    engine, optimizer, _, _ = cases.zero.initialize(model=cases.make_model(), config=config)
    assert isinstance(optimizer.optimizer, CPUAdam)
    assert all(not g.master_is_flat for g in optimizer.groups)  # a host copy of its own
    cases.train_steps(engine, 2)


# ----- bad input: clear errors before training, nothing written -----

def _nvme_engine(nvme_path, stage=2):
    return cases.make_engine(cases.ds_config(stage, **_offload("nvme", nvme_path)))


def test_missing_nvme_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; create it"):
        _nvme_engine(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


def test_nvme_path_not_writable(tmp_path):
    target = tmp_path / "readonly"
    target.mkdir()
    target.chmod(0o500)
    if os.access(target, os.W_OK):  # root ignores permissions: use a read-only file system
        target = "/sys"
    with pytest.raises(ConfigError, match="is not writable"):
        _nvme_engine(target)


def test_nvme_path_without_enough_space(tmp_path, monkeypatch):
    import shutil
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(ConfigError, match=r"has 0.00 GiB free but .* need"):
        _nvme_engine(tmp_path)
    assert os.listdir(tmp_path) == []  # nothing half-written


def test_nvme_path_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        _nvme_engine(tmp_path / "file")


@pytest.mark.parametrize("zero, message", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs ZeRO stage 1, 2 or 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "needs ZeRO stage 3"),
    ({"stage": 1, "cpu_offload_params": True}, "needs ZeRO stage 3"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "nvme_path' is not set"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "needs ZeRO stage 3"),
])
def test_offload_config_errors(zero, message):
    config = {"train_batch_size": 4, "zero_optimization": zero}
    with pytest.raises(ConfigError, match=message):
        cases.zero.DeepSpeedConfig(config)


def test_offload_with_a_non_adam_optimizer_is_refused():
    model = cases.make_model()
    with pytest.raises(ConfigError, match="must be Adam or AdamW"):
        cases.zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              config={**cases.ds_config(2, **_offload("cpu")),
                                      "zero_allow_untested_optimizer": True})


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_resumes_exactly_under_a_warmup_schedule(stage, tmp_path):
    """Loading the optimizer state replaces torch's param-group dicts; the host Adam must step
    with the current ones (the schedule's learning rate), not those of before the load, whose
    warm-up lr of 0 would leave the weights where the checkpoint left them."""
    config = cases.ds_config(stage, **_offload("cpu"))
    config["scheduler"] = {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": cases.LR, "warmup_num_steps": 6}}
    straight = cases.make_engine(config)
    expected = cases.train_steps(straight, 8)
    first = cases.make_engine(config)
    cases.train_steps(first, 4)
    first.save_checkpoint(str(tmp_path))
    second = cases.make_engine(config, model=cases.make_model(seed=99))  # other weights
    second.load_checkpoint(str(tmp_path))
    assert cases.train_steps(second, 4, start=4) == expected[4:]


def test_a_checkpoint_saved_without_offload_resumes_with_it(tmp_path):
    """torch AdamW's saved groups lack CPUAdam's flags (adamw_mode, bias_correction): the
    offloaded run keeps its own and trains on as the run without offload would."""
    plain = cases.ds_config(2)
    expected = cases.train_steps(cases.make_engine(plain), 8)
    first = cases.make_engine(plain)
    cases.train_steps(first, 4)
    first.save_checkpoint(str(tmp_path))
    offloaded = cases.make_engine(cases.ds_config(2, **_offload("cpu")))
    offloaded.load_checkpoint(str(tmp_path))
    assert _relative_error(cases.train_steps(offloaded, 4, start=4), expected[4:]) < 1e-4
