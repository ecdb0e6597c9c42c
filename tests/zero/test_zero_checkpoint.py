"""DeepSpeed-layout checkpoints: contents, exact resume, other DP sizes, errors (zero_to_fp32:
test_zero_to_fp32.py)."""

import math
import os
import shutil

import numpy as np
import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from zero.checkpoint.partitions import natural_partition_numel
from zero.errors import CheckpointError
from zero.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

N = 4  # steps before and after the checkpoint


def _engine(stage=2, precision="fp32", with_frozen=False, gas=2):
    return cases.make_engine(cases.ds_config(stage, precision=precision, gas=gas),
                             model=cases.make_model(with_frozen=with_frozen))


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


# ----- layout and contents -----

def test_layout_and_keys_follow_deepspeed(tmp_path):
    engine = _engine(stage=2, with_frozen=True)
    cases.train_steps(engine, 2)
    engine.save_checkpoint(str(tmp_path), client_state={"iteration": 2, "rng": torch.arange(3)})
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert (tmp_path / "zero_to_fp32.py").read_bytes() == \
        open(os.path.join(os.path.dirname(cases.zero.__file__), "checkpoint",
                         "zero_to_fp32.py"), "rb").read()
    tag_dir = tmp_path / "global_step2"
    assert sorted(os.listdir(tag_dir)) == ["mp_rank_00_model_states.pt",
                                           "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    states = _load(tag_dir / "mp_rank_00_model_states.pt")
    for key in ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
                "frozen_param_fragments", "shared_params", "lr_scheduler", "skipped_steps",
                "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                "ds_version"):
        assert key in states, key
    assert states["optimizer"] is None and states["global_steps"] == 2
    assert states["global_samples"] == 2 * 16 and states["dp_world_size"] == 1
    assert states["iteration"] == 2 and torch.equal(states["rng"], torch.arange(3))
    assert states["shared_params"] == {"head.weight": "embed.weight"}
    assert states["buffer_names"] == ["position_bias"]
    assert list(states["frozen_param_shapes"]) == ["frozen.weight", "frozen.bias"]
    shapes = [dict(group) for group in states["param_shapes"]]
    assert shapes[0]["fc1.weight"] == torch.Size([64, 16]) and "norm1.weight" in shapes[1]
    optim = _load(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    zero_state = optim["optimizer_state_dict"]
    assert zero_state["zero_stage"] == 2 and zero_state["partition_count"] == [1, 1]
    fp32 = zero_state["single_partition_of_fp32_groups"]
    assert [t.numel() for t in fp32] == [sum(math.prod(s) for s in g.values()) for g in shapes]
    exp_avg = zero_state["base_optimizer_state"]["state"][0]["exp_avg"]
    assert exp_avg.numel() == natural_partition_numel(fp32[0].numel(), 1)


def test_16bit_model_and_bf16_file_names(tmp_path):
    engine = _engine(stage=1, precision="bf16")
    cases.train_steps(engine, 1)
    assert engine.save_16bit_model(str(tmp_path), "model.bin")
    saved = _load(tmp_path / "model.bin")
    assert saved["fc1.weight"].dtype == torch.bfloat16
    assert torch.equal(saved["fc1.weight"], engine.module.fc1.weight.detach())
    assert saved["fc1.weight"].untyped_storage().nbytes() == 64 * 16 * 2  # not the flat buffer
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in os.listdir(tmp_path / "ckpt" / "t")


# ----- exact resume -----

@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"),
                                             (2, "fp16"), (0, "bf16")])
def test_resume_is_bit_exact(tmp_path, stage, precision):
    straight = cases.train_steps(_engine(stage, precision), 2 * N)
    first = _engine(stage, precision)
    head = cases.train_steps(first, N)
    first.save_checkpoint(str(tmp_path))
    second = _engine(stage, precision)
    path, client_state = second.load_checkpoint(str(tmp_path))
    assert path.endswith(os.path.join(f"global_step{N}", "mp_rank_00_model_states.pt"))
    assert client_state == {}
    assert (second.global_steps, second.global_samples) == (N, N * 16)
    assert second.cur_scale == first.cur_scale and second.get_lr() == first.get_lr()
    assert head + cases.train_steps(second, N, start=N) == straight


def test_masters_from_16bit_weights_when_asked(tmp_path):
    first = _engine(stage=1, precision="fp16")
    cases.train_steps(first, 2)
    first.save_checkpoint(str(tmp_path))
    for from_fp32 in (True, False):
        config = cases.ds_config(1, precision="fp16", load_from_fp32_weights=from_fp32)
        second = cases.make_engine(config)
        second.load_checkpoint(str(tmp_path))
        masters = cases.fp32_weights(second)
        assert torch.equal(masters["fc1.weight"], cases.fp32_weights(first)["fc1.weight"]
                           if from_fp32 else second.module.fc1.weight.float())
    assert not torch.equal(cases.fp32_weights(first)["fc1.weight"],
                           first.module.fc1.weight.float())  # the two sources do differ


def test_fp16_overflow_skips_step_and_scaler_state_resumes(tmp_path):
    config = cases.ds_config(2, precision="fp16", gas=1)
    config["fp16"].update({"initial_scale_power": 8, "hysteresis": 1})
    engine = cases.make_engine(config)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    tokens, labels = cases.global_batch(0, 16)
    engine.backward(engine(tokens, labels) * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 1 and engine.cur_scale == 128
    assert all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    engine.save_checkpoint(str(tmp_path))
    resumed = cases.make_engine(config)
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.cur_scale == 128 and resumed.skipped_steps == 1


# ----- other data-parallel sizes -----

def _dp2_run(rank, world_size, save_dir, load_dir):
    """Uninterrupted 2N steps; N steps saved to save_dir; N steps resumed from load_dir."""
    results = {"straight": cases.train_steps(_engine(stage=2), 2 * N)}
    engine = _engine(stage=2)
    results["head"] = cases.train_steps(engine, N)
    engine.save_checkpoint(save_dir)
    results["weights"] = {n: p.detach().clone() for n, p in engine.module.state_dict().items()}
    try:
        engine.save_checkpoint(save_dir, tag=f"rank{rank}")
    except CheckpointError as e:
        results["mixed_tags"] = str(e)
    if load_dir is not None:
        resumed = _engine(stage=1)  # and another stage
        resumed.load_checkpoint(load_dir)
        results["resumed"] = cases.train_steps(resumed, N, start=N)
    return results


@pytest.fixture(scope="module")
def resize_runs(tmp_path_factory):
    """DP=2 saves; DP=1 resumes it. DP=1 saves; DP=2 resumes it. Two spawns in all."""
    from_dp2 = str(tmp_path_factory.mktemp("from_dp2"))
    from_dp1 = str(tmp_path_factory.mktemp("from_dp1"))
    dp1 = _engine(stage=1)
    dp1_head = cases.train_steps(dp1, N)
    dp1.save_checkpoint(from_dp1)
    dp2 = run_distributed(_dp2_run, 2, args=(from_dp2, from_dp1))
    resumed_on_dp1 = _engine(stage=2)
    resumed_on_dp1.load_checkpoint(from_dp2)
    return {"dp2": dp2, "dp1_head": dp1_head, "from_dp2": from_dp2,
            "dp1_resumed": cases.train_steps(resumed_on_dp1, N, start=N)}


def test_ranks_saving_under_different_tags_are_refused_before_writing(resize_runs):
    for rank, results in enumerate(resize_runs["dp2"]):
        assert f"rank {rank} saves under tag 'rank{rank}'" in results["mixed_tags"]
    assert sorted(os.listdir(resize_runs["from_dp2"])) == ["global_step4", "latest",
                                                           "zero_to_fp32.py"]


def _close(a, b, tolerance=1e-5):
    return all(abs(x - y) <= tolerance * abs(y) for x, y in zip(a, b))


def test_dp2_checkpoint_resumes_on_dp1(resize_runs):
    straight = resize_runs["dp2"][0]["straight"]
    assert resize_runs["dp2"][0]["head"] == straight[:N]
    assert _close(resize_runs["dp1_resumed"], straight[N:])


def test_dp1_checkpoint_resumes_on_dp2(resize_runs):
    straight = resize_runs["dp2"][0]["straight"]
    assert _close(resize_runs["dp1_head"], straight[:N])
    for rank in range(2):
        assert _close(resize_runs["dp2"][rank]["resumed"], straight[N:])


def _load_where_rank1_has_damaged_files(rank, world_size, good_dir, damaged_dir):
    engine = _engine(stage=2)
    try:
        engine.load_checkpoint(damaged_dir if rank == 1 else good_dir)
        failed = "loaded"
    except CheckpointError as e:
        failed = str(e)
    # then the weights alone, on every rank: nothing the failed load restored is published
    # (rank 0 restored its masters before the agreement failed)
    path, _ = engine.load_checkpoint(good_dir, load_optimizer_states=False)
    return failed, path is not None


def test_a_rank_that_cannot_read_its_files_stops_the_others_with_a_clear_error(
        resize_runs, tmp_path):
    """Rank 1's copy of the checkpoint is damaged, rank 0's is fine: both stop with an error
    that says why, before the restored masters are all-gathered (rank 0 would otherwise
    wait in that collective for a rank that never joins it)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(resize_runs["from_dp2"], damaged)
    optim = damaged / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:1000])
    (failed0, retried0), (failed1, retried1) = run_distributed(
        _load_where_rank1_has_damaged_files, 2, args=(resize_runs["from_dp2"], str(damaged)))
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in failed1, failed1
    assert "another rank failed" in failed0, failed0
    assert retried0 and retried1


def test_zero_to_fp32_consolidates_dp2_partitions(resize_runs):
    live = resize_runs["dp2"][0]["weights"]  # fp32 training: the module holds the masters
    consolidated = get_fp32_state_dict_from_zero_checkpoint(resize_runs["from_dp2"])
    assert set(consolidated) == set(live)
    for name, tensor in live.items():
        assert torch.equal(consolidated[name], tensor.float()), name
    assert consolidated["head.weight"] is consolidated["embed.weight"]


# ----- errors and atomicity -----

def test_missing_tag_lists_the_available_ones(tmp_path, caplog):
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="first")
    engine.save_checkpoint(str(tmp_path), tag="second", save_latest=False)
    with pytest.raises(CheckpointError, match="'third' not found.*first, second"):
        engine.load_checkpoint(str(tmp_path), tag="third")
    with caplog.at_level("WARNING", logger="zero.checkpoint.layout"):
        assert _engine().load_checkpoint(str(tmp_path / "typo")) == (None, None)  # DeepSpeed's
    assert f"no folder {tmp_path / 'typo'} and no tag given: nothing loaded" in caplog.text
    assert _engine().load_checkpoint(str(tmp_path))[0].endswith(
        os.path.join("first", "mp_rank_00_model_states.pt"))


def test_other_tensor_parallel_size_and_missing_optimizer_states(tmp_path):
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="t")
    tag_dir = tmp_path / "t"
    optim = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.rename(optim, tmp_path / "optim.pt")
    with pytest.raises(CheckpointError, match="optimizer states missing.*load_optimizer_states"):
        _engine().load_checkpoint(str(tmp_path), tag="t")
    _engine().load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=False)
    os.rename(tmp_path / "optim.pt", optim)
    states = _load(tag_dir / "mp_rank_00_model_states.pt")
    states["mp_world_size"] = 2
    torch.save(states, tag_dir / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=r"saved with 2 model-parallel rank\(s\) "
                                              r"\(tensor slices x pipeline stages\), this run has 1"):
        _engine().load_checkpoint(str(tmp_path), tag="t")
    os.rename(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="tensor-parallel"):
        _engine().load_checkpoint(str(tmp_path), tag="t")


def _grown_engine(stage):
    """The test model with one more layer, which no checkpoint of the test model has."""
    model = cases.make_model(seed=5)
    model.extra = torch.nn.Linear(3, 3)
    return cases.make_engine(cases.ds_config(stage), model=model)


def _weights(engine):
    params = dict(engine.module.named_parameters())
    with zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


@pytest.mark.parametrize("stage", [1, 3])
def test_load_checkpoint_takes_deepspeeds_positional_arguments_and_strictness(stage, tmp_path):
    """load_checkpoint(dir, tag, load_module_strict, load_optimizer_states, ...) as DeepSpeed's
    (the third positional argument used to be load_optimizer_states). Not strict, the weights
    the checkpoint has are loaded and the others keep their values; strict, a model that
    differs from the saved one is an error that names the difference."""
    saved = cases.make_engine(cases.ds_config(stage))
    cases.train_steps(saved, 1)
    saved.save_checkpoint(str(tmp_path))
    saved_weights = _weights(saved)

    weights_only = cases.make_engine(cases.ds_config(stage))
    weights_only.load_checkpoint(str(tmp_path), None, True, False)
    assert all(torch.equal(w, saved_weights[n]) for n, w in _weights(weights_only).items())
    state = weights_only.optimizer.optimizer.state
    assert not any(state.values())  # load_optimizer_states=False: a fresh optimizer

    grown = _grown_engine(stage)
    with pytest.raises(CheckpointError, match="extra.weight"):
        grown.load_checkpoint(str(tmp_path))
    grown = _grown_engine(stage)
    before = _weights(grown)
    grown.load_checkpoint(str(tmp_path), None, False, False)
    after = _weights(grown)
    assert torch.equal(after["extra.weight"], before["extra.weight"])
    assert all(torch.equal(after[n], w) for n, w in saved_weights.items())
    assert not torch.equal(before["fc1.weight"], after["fc1.weight"])


@pytest.mark.parametrize("stage", [1, 3])
def test_another_optimizers_state_and_another_stages_checkpoint_are_named(stage, tmp_path):
    adamw = cases.make_engine(cases.ds_config(stage))
    cases.train_steps(adamw, 1)
    adamw.save_checkpoint(str(tmp_path))
    config = {**cases.ds_config(stage), "zero_allow_untested_optimizer": True}

    def sgd_engine():
        model = cases.make_model()
        engine, *_ = zero.initialize(model=model, config=config,
                                     optimizer=torch.optim.SGD(cases.param_groups(model), lr=0.1,
                                                               momentum=0.9))
        return engine
    with pytest.raises(CheckpointError, match=r"saved by another optimizer.*'momentum'.*SGD"):
        sgd_engine().load_checkpoint(str(tmp_path))
    engine = sgd_engine()
    engine.load_checkpoint(str(tmp_path), load_optimizer_states=False)
    cases.train_steps(engine, 1, start=1)
    config = {**cases.ds_config(1 if stage == 3 else 3), "zero_allow_untested_optimizer": True}
    with pytest.raises(CheckpointError, match=r"saved by another optimizer.*'momentum'.*SGD"):
        sgd_engine().load_checkpoint(str(tmp_path))  # at the other family of stages too


def test_a_state_without_torchs_switches_loads_under_offload(tmp_path):
    """DeepSpeed's FusedAdam saves param groups without torch's implementation switches
    (foreach, fused, amsgrad, ...): they load, also into CPUAdam (offload_optimizer)."""
    saved = cases.make_engine(cases.ds_config(1))
    cases.train_steps(saved, 1)
    saved.save_checkpoint(str(tmp_path), tag="t")
    path = tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    states = torch.load(path, weights_only=False)
    for group in states["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]:
        for key in ("foreach", "maximize", "capturable", "differentiable", "fused",
                    "decoupled_weight_decay", "amsgrad"):
            group.pop(key, None)
    torch.save(states, path)
    for offload in ({}, {"offload_optimizer": {"device": "cpu"}}):
        engine = cases.make_engine(cases.ds_config(1, **offload))
        engine.load_checkpoint(str(tmp_path), tag="t")
        cases.train_steps(engine, 1, start=1)


def test_a_save_syncs_the_directories_it_renames_in(tmp_path, monkeypatch):
    """A rename is on disk only once its directory is synced: the tag's folder (every rank's
    files) before it is renamed into place, the save folder before `latest` names the tag
    and after."""
    from zero.checkpoint import layout
    synced, sync = [], layout.fsync_dir
    monkeypatch.setattr(layout, "fsync_dir",
                        lambda directory: (synced.append(os.path.relpath(directory, tmp_path)),
                                           sync(directory)))
    _engine().save_checkpoint(str(tmp_path), tag="t")
    assert synced == [".t.partial", ".", "."]


def test_wrong_model_and_client_state_clash(tmp_path):
    engine = _engine()
    with pytest.raises(CheckpointError, match="clash"):
        engine.save_checkpoint(str(tmp_path), client_state={"module": 1})
    with pytest.raises(CheckpointError, match=r"client_state\['rng'\]\[1\] is a numpy.ndarray"):
        engine.save_checkpoint(str(tmp_path), client_state={"rng": ("MT19937", np.zeros(3))})
    engine.save_checkpoint(str(tmp_path))
    other = cases.make_engine(cases.ds_config(2), model=cases.make_model(with_frozen=True))
    with pytest.raises(CheckpointError, match="does not fit the model"):
        other.load_checkpoint(str(tmp_path))


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    engine = _engine()
    cases.train_steps(engine, 1)
    engine.save_checkpoint(str(tmp_path))
    before = sorted(os.listdir(tmp_path / "global_step1"))
    cases.train_steps(engine, 1, start=1)
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if "model_states" in str(path):
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(CheckpointError, match="No space left"):
        engine.save_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="No space left"):
        engine.save_checkpoint(str(tmp_path), tag="global_step1")  # re-saving the same tag
    monkeypatch.setattr(torch, "save", real_save)
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert sorted(os.listdir(tmp_path / "global_step1")) == before
    assert not (tmp_path / "global_step2").exists()
    resumed = _engine()
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.global_steps == 1
