"""Offload at ZeRO stage 3: optimizer (cpu, nvme) and parameters (cpu, nvme) give the losses of
non-offloaded stage 3 at DP=1 and DP=2, resume exactly with NVMe, build under
zero.Init(remote_device="nvme") with the shards only in files, and refuse bad input."""

import os

import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from zero.errors import ConfigError
from zero.offload.param_swapper import is_swapped

STEPS = 20
# Small knobs so that parameters really are released, prefetched (read ahead) and re-gathered.
RELEASING = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
             "stage3_prefetch_bucket_size": 200, "stage3_max_live_parameters": 2000}


def _relative_error(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _variants(nvme):
    nvme_optimizer = {"device": "nvme", "nvme_path": nvme, "pipeline_read": True,
                      "pipeline_write": True}
    nvme_param = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0, "buffer_count": 3}
    return {
        "none": {},
        "cpu": {"offload_optimizer": {"device": "cpu"}},
        "nvme": {"sub_group_size": 500, "offload_optimizer": nvme_optimizer},
        "cpu_both": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "nvme_both": {"sub_group_size": 500, "offload_optimizer": nvme_optimizer,
                      "offload_param": nvme_param},
    }


RUNS = {1: ["none", "cpu", "nvme", "cpu_both", "nvme_both"],
        2: ["none", "cpu", "nvme_both"]}


def _train_all(rank, world_size, nvme):
    results, variants = {}, _variants(nvme)
    for name in RUNS[world_size]:
        engine = cases.make_engine(cases.ds_config(3, **RELEASING, **variants[name]))
        results[name] = cases.train_steps(engine, STEPS)
        results[name, "optimizer"] = type(engine.optimizer.optimizer).__name__
        results[name, "swapped"] = sum(is_swapped(p) for p in engine.module.parameters())
        engine.destroy()  # deletes the swap files
    return results


@pytest.mark.parametrize("world_size", [1, 2])
def test_stage3_offloaded_losses_match_plain_stage3(world_size, tmp_path):
    if world_size == 1:
        results = [_train_all(0, 1, str(tmp_path))]
    else:
        results = run_distributed(_train_all, 2, args=(str(tmp_path),))
    reference = cases.train_reference(STEPS)[0]
    for rank_results in results:
        plain = rank_results["none"]
        assert _relative_error(plain, reference) < 1e-4
        for name in RUNS[world_size][1:]:
            assert rank_results[name, "optimizer"] == "CPUAdam"
            assert _relative_error(rank_results[name], plain) < 1e-4, name
    assert results[0]["nvme_both", "swapped"] == 9  # every parameter's shard in a file
    assert os.listdir(tmp_path) == []  # swap files and their folders removed


def _resume(rank, world_size, nvme, save_dir):
    config = cases.ds_config(3, **RELEASING, **_variants(nvme)["nvme_both"])
    straight = cases.make_engine(config)
    expected = cases.train_steps(straight, 8)
    straight.destroy()
    first = cases.make_engine(config)
    cases.train_steps(first, 4)
    first.save_checkpoint(save_dir)
    first.destroy()
    second = cases.make_engine(config, model=cases.make_model(seed=99))  # other weights
    second.load_checkpoint(save_dir)
    resumed = cases.train_steps(second, 4, start=4)
    second.destroy()
    return expected, resumed


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_stage3_nvme_offload_resumes_exactly(world_size, tmp_path):
    nvme, save = str(tmp_path / "nvme"), str(tmp_path / "ckpt")
    os.makedirs(nvme)
    if world_size == 1:
        results = [_resume(0, 1, nvme, save)]
    else:
        results = run_distributed(_resume, 2, args=(nvme, save))
    for expected, resumed in results:
        assert resumed == expected[4:]
    optim = torch.load(os.path.join(save, "global_step4",
                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                       weights_only=True)["optimizer_state_dict"]
    state = optim["optimizer_state_dict"]["state"][0]  # swapped in, as plain tensors
    assert float(state["step"]) == 4 and state["exp_avg"].abs().sum() > 0
    assert optim["fp32_flat_groups"][0].abs().sum() > 0


def test_zero_init_remote_device_nvme_builds_the_model_in_files(tmp_path):
    config = cases.ds_config(3, **RELEASING, **_variants(str(tmp_path))["nvme_both"])
    plain = cases.train_steps(cases.make_engine(cases.ds_config(3, **RELEASING)), 4)
    torch.manual_seed(1234)
    with zero.Init(remote_device="nvme", config_dict_or_path=config):
        model = cases.TinyLM()
    params = list(model.parameters())
    assert all(is_swapped(p) and p.ds_tensor.untyped_storage().nbytes() == 0 for p in params)
    assert all(p.numel() == 0 for p in params)  # nothing whole either
    folder = tmp_path / "zero_stage_3" / "fp32params" / "rank0"
    assert sorted(os.listdir(folder)) == sorted(f"{p.ds_id}_param.tensor.swp" for p in params)
    engine = cases.make_engine(config, model=model)
    assert _relative_error(cases.train_steps(engine, 4), plain) < 1e-4
    bytes_ = engine.optimizer.model_state_bytes()
    assert bytes_["parameters"] == bytes_["master_weights"] == 0  # all in the swap files
    engine.destroy()
    assert not folder.exists() and os.listdir(tmp_path) == []


def test_swap_files_and_folders_go_with_the_parameters(tmp_path):
    # No engine.destroy(): the parameters' finalizers delete their files, and the last one
    # the folders (nvme_path ends as it began)
    import gc
    config = cases.ds_config(3, **RELEASING, **_variants(str(tmp_path))["nvme_both"])
    with zero.Init(remote_device="nvme", config_dict_or_path=config):
        model = cases.TinyLM()
    assert os.listdir(tmp_path / "zero_stage_3" / "fp32params" / "rank0")
    del model
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_gathered_parameters_with_modifier_reaches_swapped_shards(tmp_path):
    engine = cases.make_engine(cases.ds_config(3, **RELEASING,
                                               **_variants(str(tmp_path))["nvme_both"]))
    weight = engine.module.fc1.weight
    with zero.GatheredParameters(weight, modifier_rank=0):
        weight.data.fill_(0.5)
    with zero.GatheredParameters(weight):
        assert torch.all(weight == 0.5)
    master = engine.optimizer.master_partition(engine.optimizer.sub_groups.index(
        engine.optimizer.location[weight][0]))
    assert (master == 0.5).sum() >= weight.ds_numel  # the fp32 master followed
    engine.destroy()


def test_old_cpu_offload_keys_at_stage3():
    config = cases.ds_config(3, **RELEASING, cpu_offload=True, cpu_offload_params=True)
    parsed = zero.DeepSpeedConfig(config)
    assert parsed.zero_optimization.offload_param.device == "cpu"
    assert parsed.zero_optimization.offload_optimizer.device == "cpu"
    engine = cases.make_engine(config)
    assert type(engine.optimizer.optimizer).__name__ == "CPUAdam"
    plain = cases.train_steps(cases.make_engine(cases.ds_config(3, **RELEASING)), 3)
    assert _relative_error(cases.train_steps(engine, 3), plain) < 1e-4


# ----- bad input -----

def test_param_nvme_needs_optimizer_offload(tmp_path):
    config = cases.ds_config(3, offload_param={"device": "nvme", "nvme_path": str(tmp_path)})
    with pytest.raises(ConfigError, match="needs 'offload_optimizer'"):
        cases.make_engine(config)


def test_remote_device_nvme_without_nvme_path():
    with pytest.raises(ConfigError, match="offload_param.nvme_path"):
        zero.Init(remote_device="nvme", config_dict_or_path=cases.ds_config(3))
    with pytest.raises(ConfigError, match="offload_param.nvme_path"):
        zero.Init(remote_device="nvme")


def test_shard_larger_than_buffer_size_beyond_max_in_cpu(tmp_path):
    variant = _variants(str(tmp_path))["nvme_both"]
    variant["offload_param"]["buffer_size"] = 100  # fc1.weight's shard is 1024 elements
    with pytest.raises(ConfigError, match="larger than buffer_size .* max_in_cpu"):
        cases.make_engine(cases.ds_config(3, **variant))


def test_missing_param_nvme_path(tmp_path):
    config = cases.ds_config(3, offload_optimizer={"device": "cpu"},
                             offload_param={"device": "nvme",
                                            "nvme_path": str(tmp_path / "absent")})
    with pytest.raises(ConfigError, match="does not exist; create it"):
        cases.make_engine(config)
    assert not (tmp_path / "absent").exists()
