"""ZeRO stage 3 against plain single-process training: losses, memory, zero.Init,
GatheredParameters, persistence, checkpoints (exact resume, another DP size, zero_to_fp32)."""

import os

import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from zero.stages.partition_parameters import ParamStatus, is_zero_param

STEPS = 20
# Small knobs so that parameters really are released, prefetched and re-gathered.
RELEASING = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
             "stage3_prefetch_bucket_size": 200, "stage3_max_live_parameters": 2000}


def _relative_error(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _stage3(**options):
    return cases.ds_config(3, **{**RELEASING, **options})


def _full_weights(engine):
    """{name: full tensor} gathered from the partitions."""
    result = {}
    for name, param in engine.module.named_parameters():
        with zero.GatheredParameters(param):
            result[name] = param.detach().float().clone()
    return result


def _scenarios(rank, world_size, ckpt_dir):
    torch.manual_seed(rank)  # the engine must not depend on per-rank RNG state
    results = {}
    engine = cases.make_engine(_stage3())
    results["fp32"] = cases.train_steps(engine, STEPS)
    results["bytes"] = engine.optimizer.model_state_bytes()
    results["fetches"] = engine.optimizer.coordinator.fetch_count
    results["weights"] = _full_weights(engine)
    engine = cases.make_engine(_stage3(overlap_comm=True, reduce_scatter=False,
                                       stage3_max_reuse_distance=10 ** 9,
                                       stage3_param_persistence_threshold=20))
    results["knobs"] = cases.train_steps(engine, 6)
    results["persist"] = {n: p.ds_persist for n, p in engine.module.named_parameters()}
    results["forward_gathers"] = _all_gathers_of_one_forward(engine)
    engine = cases.make_engine(_stage3(precision="bf16"))
    results["bf16"] = cases.train_steps(engine, 8)
    results["bf16_dtypes"] = (engine.optimizer.sub_groups[0].flat.dtype,
                              engine.optimizer.sub_groups[0].master.dtype)
    results["fp16"] = _fp16(world_size)
    results["resume"] = _resume(world_size, ckpt_dir)
    results["init"] = _init_equals_plain_model(world_size)
    results["appended"] = _init_with_appended_modules()
    results["modifier"] = _gathered_with_modifier(rank)
    results["two_losses"] = cases.two_losses_per_step(3)
    return results


def _all_gathers_of_one_forward(engine):
    """All-gathers of a forward after a step (every partition changed): one per
    non-persistent parameter, and one for all the persistent ones together."""
    params = set(engine.module.parameters())
    comms = {p.ds_comm for p in params}
    for comm in comms:
        comm.stats.reset()
    tokens, labels = cases.global_batch(0, 2)
    with torch.no_grad():
        engine(tokens, labels)
    persistent = sorted(n for n, p in engine.module.named_parameters() if p.ds_persist)
    return (sum(comm.stats.calls("all_gather") for comm in comms), persistent,
            len(params) - len(persistent))


def _fp16(world_size):
    """fp16 with dynamic loss scaling: trains like fp32; a scale too large for fp16 overflows
    and every rank skips the same steps (each rank checks only its own gradient partition)."""
    engine = cases.make_engine(_stage3(precision="fp16"))
    out = {"losses": cases.train_steps(engine, 8),
           "dtype": engine.optimizer.sub_groups[0].flat.dtype}
    config = _stage3(precision="fp16")
    config["fp16"].update(initial_scale_power=40, hysteresis=1)
    engine = cases.make_engine(config)
    before = _full_weights(engine)
    cases.train_steps(engine, 3)
    out["skipped"] = (engine.skipped_steps, engine.global_steps, engine.cur_scale)
    out["unchanged"] = all(torch.equal(before[n], w) for n, w in _full_weights(engine).items())
    return out


def _resume(world_size, ckpt_dir):
    """Train 3, save, train 3 -> same as a fresh engine that loads and trains 3. A checkpoint
    written at DP=2 loads at DP=4 (the dp2 run writes it first)."""
    out = {}
    if world_size == 2:
        engine = cases.make_engine(_stage3())
        cases.train_steps(engine, 3)
        engine.save_checkpoint(ckpt_dir)
        out["continued"] = cases.train_steps(engine, 3, start=3)
    fresh = cases.make_engine(_stage3(), model=cases.make_model(seed=99))
    path, client = fresh.load_checkpoint(ckpt_dir)
    out["loaded_steps"] = fresh.global_steps
    out["resumed"] = cases.train_steps(fresh, 3, start=3)
    return out


def _init_equals_plain_model(world_size):
    with zero.Init(config=_stage3()):
        model = cases.make_model(seed=7)
    plain = cases.make_model(seed=7)
    sizes = {n: p.ds_tensor.numel() for n, p in model.named_parameters()}
    all_partitioned = all(is_zero_param(p) and p.numel() == 0 for p in model.parameters())
    equal = True
    for (name, param), plain_param in zip(model.named_parameters(), plain.parameters()):
        with zero.GatheredParameters(param):
            equal &= torch.equal(param.detach(), plain_param.detach())
    engine = cases.make_engine(_stage3(), model=model)  # built under Init: trains as usual
    return {"equal": equal, "partitioned": all_partitioned, "sizes": sizes,
            "losses": cases.train_steps(engine, 3)}


class _Appended(torch.nn.Module):
    """Submodules appended to a ModuleList after its __init__ (a common pattern): zero.Init
    partitions them when the context ends, and every rank must do so in the same order."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        for i in range(24):
            self.blocks.append(torch.nn.Linear(3 + i, 2 + i % 5))


def _init_with_appended_modules():
    torch.manual_seed(11)
    plain = _Appended()
    torch.manual_seed(11)
    with zero.Init(config=_stage3()):
        model = _Appended()
    equal = True
    for param, plain_param in zip(model.parameters(), plain.parameters()):
        with zero.GatheredParameters(param):
            equal &= torch.equal(param.detach(), plain_param.detach())
    return equal and all(p.numel() == 0 for p in model.parameters())


def _gathered_with_modifier(rank):
    engine = cases.make_engine(_stage3())
    weight = engine.module.fc1.weight
    with zero.GatheredParameters(weight, modifier_rank=1):
        if rank == 1:
            weight.data.fill_(0.5)
    after_exit = weight.ds_status
    with zero.GatheredParameters(weight):
        seen = weight.detach().clone()
        weight.data.fill_(-1.0)  # no modifier_rank: discarded
    with zero.GatheredParameters(weight):
        again = weight.detach().clone()
    sub_group, offset = engine.optimizer.location[weight]
    master = sub_group.master.detach().narrow(0, offset, weight.ds_tensor.numel())
    try:  # no rank 5 in a group of 2: said on every rank before anything is gathered
        zero.GatheredParameters(weight, modifier_rank=5)
        no_such_rank = None
    except zero.ZeroError as e:
        no_such_rank = str(e)
    return {"all_half": bool((seen == 0.5).all()), "discarded": bool((again == 0.5).all()),
            "no_such_rank": no_such_rank,
            "released": after_exit is ParamStatus.NOT_AVAILABLE,
            "master_follows": bool((master[:weight.ds_numel] == 0.5).all())
            if rank == 0 else True}


@pytest.fixture(scope="module")
def reference():
    return cases.train_reference(STEPS)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("stage3_ckpt"))


@pytest.fixture(scope="module")
def dp2(ckpt_dir):
    return run_distributed(_scenarios, 2, args=(ckpt_dir,))


@pytest.fixture(scope="module")
def dp4(dp2, ckpt_dir):
    return run_distributed(_scenarios, 4, args=(ckpt_dir,))


@pytest.mark.parametrize("world", [2, 4])
def test_losses_match_single_process_training(world, dp2, dp4, reference):
    results = {2: dp2, 4: dp4}[world]
    losses = reference[0]
    for rank_results in results:
        assert _relative_error(rank_results["fp32"], losses) < 1e-4
    assert losses[-1] < losses[0] - 0.05  # it does learn
    assert _relative_error(results[0]["knobs"], losses[:6]) < 1e-4
    assert results[0]["fetches"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_tracks_fp32_with_fp32_masters(world, dp2, dp4, reference):
    results = {2: dp2, 4: dp4}[world]
    assert _relative_error(results[0]["bf16"], reference[0][:8]) < 1e-2
    assert results[0]["bf16_dtypes"] == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("world", [2, 4])
def test_fp16_tracks_fp32_and_every_rank_skips_the_overflowing_steps(world, dp2, dp4, reference):
    results = {2: dp2, 4: dp4}[world]
    assert _relative_error(results[0]["fp16"]["losses"], reference[0][:8]) < 1e-2
    assert results[0]["fp16"]["dtype"] == torch.float16
    # 3 optimizer steps of 2 micro-batches, all overflowing: the scale halves per step
    assert [r["fp16"]["skipped"] for r in results] == [(3, 3, 2.0 ** 37)] * world
    assert all(r["fp16"]["unchanged"] for r in results)


def test_final_weights_equal_single_process(dp2, reference):
    model = reference[1]
    for name, param in model.named_parameters():
        torch.testing.assert_close(dp2[0]["weights"][name], param.detach(), rtol=1e-4,
                                   atol=1e-5)


def test_two_backward_passes_before_one_step_add_their_gradients(dp2):
    for rank_results in dp2:
        assert rank_results["two_losses"] < 1e-6


def test_model_state_bytes_scale_as_one_over_dp(dp2, dp4):
    b2, b4 = dp2[0]["bytes"], dp4[0]["bytes"]
    for key in ("parameters", "gradients", "optimizer_states"):
        assert b2[key] > 0
        assert abs(b4[key] / b2[key] - 0.5) < 0.05, (key, b2, b4)
    assert b2["master_weights"] == 0  # fp32: the partitions are the masters
    assert b2["gathered_parameters"] == 0  # nothing stays gathered after a step


def test_persistence_threshold_keeps_small_params_whole(dp2):
    persist = dp2[0]["persist"]
    assert persist["norm1.weight"] and persist["fc2.bias"]  # 16 elements <= 20
    assert not persist["fc1.bias"] and not persist["fc1.weight"]  # 64, 1024


def test_persistent_params_are_gathered_together_after_a_step(dp2):
    calls, persistent, others = dp2[0]["forward_gathers"]
    assert persistent == ["fc2.bias", "norm1.bias", "norm1.weight", "norm2.bias",
                          "norm2.weight"]
    assert calls == others + 1  # (embed/head, fc1.weight, fc1.bias, fc2.weight) + 1


def test_zero_init_partitions_at_construction_with_identical_values(dp2, dp4, reference):
    for results, world in ((dp2, 2), (dp4, 4)):
        init = results[0]["init"]
        assert init["equal"] and init["partitioned"]
        assert init["sizes"]["fc1.weight"] == -(-4 * cases.HIDDEN * cases.HIDDEN // world)
        assert all(r["appended"] for r in results)  # ModuleList.append'ed blocks too


def test_gathered_parameters_modifier_rank_broadcasts_and_repartitions(dp2):
    for rank_results in dp2:
        result = rank_results["modifier"]
        assert result["all_half"] and result["discarded"] and result["released"]
        assert result["master_follows"]
        assert result["no_such_rank"] == ("GatheredParameters: modifier_rank 5 is not a rank of "
                                          "the parameters' data-parallel group (0..1)")


def test_exact_resume_and_loading_at_another_dp_size(dp2, dp4, ckpt_dir):
    resume = dp2[0]["resume"]
    assert resume["loaded_steps"] == 3
    assert resume["resumed"] == resume["continued"]  # bit for bit
    assert _relative_error(dp4[0]["resume"]["resumed"], resume["continued"]) < 1e-5
    files = sorted(os.listdir(os.path.join(ckpt_dir, "global_step3")))
    assert files == ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                     "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_model_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_checkpoint_has_deepspeed_stage3_keys_and_consolidates(dp2, ckpt_dir):
    tag_dir = os.path.join(ckpt_dir, "global_step3")
    optim = torch.load(os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                       weights_only=True)["optimizer_state_dict"]
    assert optim["zero_stage"] == 3 and optim["partition_count"] == 2
    assert all(t.dtype == torch.float32 for t in optim["fp32_flat_groups"])
    states = torch.load(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                        weights_only=True)
    assert states["shared_params"] == {"head.weight": "embed.weight"}
    consolidated = zero.get_fp32_state_dict_from_zero_checkpoint(ckpt_dir)
    # the weights after 3 steps: a single process trained 3 steps
    _, model, _ = cases.train_reference(3)
    for name, param in model.named_parameters():
        torch.testing.assert_close(consolidated[name], param.detach(), rtol=1e-4, atol=1e-5)
    assert torch.equal(consolidated["head.weight"], consolidated["embed.weight"])


# ----- single process -----

def test_single_process_stage3_matches_and_saves_16bit_model(tmp_path):
    reference = cases.train_reference(4, global_batch_size=4)
    engine = cases.make_engine(_stage3(global_batch_size=4, gas=1,
                                       stage3_gather_16bit_weights_on_model_save=True))
    assert _relative_error(cases.train_steps(engine, 4), reference[0]) < 1e-5
    assert engine.save_16bit_model(str(tmp_path), "model.bin")
    saved = torch.load(tmp_path / "model.bin", weights_only=True)
    for name, param in reference[1].state_dict().items():
        torch.testing.assert_close(saved[name], param, rtol=1e-4, atol=1e-5)


def test_partition_gradients_exist_from_backward_to_the_step_only():
    """The fp32 partition gradients are freed at each step (so they never share memory with the
    gathered parameters of forward) and rebuilt in the first backward after it: the training
    still matches, and a parameter without a gradient gets zeros in its slot."""
    reference = cases.train_reference(3)[0]
    model = cases.make_model()
    model.unused = torch.nn.Linear(3, 5)  # trainable, never in the loss
    engine = cases.make_engine(_stage3(), model=model)  # gas 2: the second backward adds
    sub_groups = engine.optimizer.sub_groups
    assert all(g.master.grad is None for g in sub_groups)
    tokens, labels = cases.global_batch(0, 16)
    engine.backward(engine(tokens[:8], labels[:8]))
    assert all(g.master.grad is not None for g in sub_groups)
    sub_group, offset = engine.optimizer.location[model.unused.weight]
    assert sub_group.master.grad.narrow(0, offset, 15).abs().sum() == 0
    assert sub_group.master.grad.abs().sum() > 0
    engine.step()
    engine.backward(engine(tokens[8:], labels[8:]))
    engine.step()  # the boundary
    assert all(g.master.grad is None for g in sub_groups)
    assert _relative_error(cases.train_steps(engine, 2, start=1), reference[1:]) < 1e-4
    engine.optimizer.step()  # a step no backward reached: zero gradients, weight decay only
    assert all(g.master.grad is not None for g in sub_groups)


def test_save_16bit_model_needs_the_gather_option(tmp_path):
    engine = cases.make_engine(_stage3(global_batch_size=4, gas=1))
    assert engine.save_16bit_model(str(tmp_path), "model.bin") is False
    assert not (tmp_path / "model.bin").exists()


def test_optimizers_that_cannot_be_partitioned_are_refused():
    model = cases.make_model()
    config = _stage3(global_batch_size=4, gas=1)
    config["zero_allow_untested_optimizer"] = True  # stage 3 still cannot step a slice of these
    with pytest.raises(zero.ZeroError, match="cannot partition torch.optim.LBFGS"):
        zero.initialize(model=model, optimizer=torch.optim.LBFGS(model.parameters()),
                        config=config)

    class NotATorchOptimizer:
        param_groups = []

        def __init__(self, params):
            self.params = list(params)
    with pytest.raises(zero.ZeroError, match="needs a torch.optim.Optimizer"):
        zero.initialize(model=cases.make_model(), optimizer=NotATorchOptimizer, config=config)


def test_remote_device_nvme_is_a_clear_error_and_cpu_works():
    with pytest.raises(zero.ConfigError, match="offload_param.nvme_path"):  # no config
        zero.Init(remote_device="nvme")
    with pytest.raises(zero.ConfigError, match="not one of"):
        zero.Init(remote_device="disk")
    with zero.Init(remote_device="cpu"):
        model = cases.make_model()
    assert all(p.ds_tensor.device.type == "cpu" for p in model.parameters())
    with zero.Init(enabled=False):
        plain = cases.make_model()
    assert not any(is_zero_param(p) for p in plain.parameters())
    assert not hasattr(torch.nn.Linear.__init__, "_zero_original")  # classes restored


def test_single_process_fp16_tracks_fp32_with_loss_scaling():
    reference = cases.train_reference(6, global_batch_size=4)[0]
    engine = cases.make_engine(_stage3(global_batch_size=4, gas=1, precision="fp16"))
    assert _relative_error(cases.train_steps(engine, 6), reference) < 1e-2
    assert engine.optimizer.sub_groups[0].flat.dtype == torch.float16
    assert engine.cur_scale > 1  # dynamic loss scaling is on


def test_write_full_value_fills_the_partition_the_gathered_copy_and_the_master():
    """What a Megatron-layout load does at stage 3 (each rank read the whole tensor): its own
    piece, no collective; a copy gathered at the time (a persistent parameter) follows."""
    from zero.stages.partition_parameters import release_param, start_gather, write_full_value
    engine = cases.make_engine(_stage3())
    weight = engine.module.fc1.weight
    full = torch.full(tuple(weight.ds_shape), 0.25)
    with zero.GatheredParameters(weight):
        write_full_value(weight, full)
        assert torch.equal(weight.detach().float(), full)
    with zero.GatheredParameters(weight):
        assert torch.equal(weight.detach().float(), full)
    sub_group, offset = engine.optimizer.location[weight]
    master = sub_group.master.detach().narrow(0, offset, weight.ds_numel)
    assert bool((master == 0.25).all())
    start_gather(weight)  # a gather in flight: it would bring the old values
    write_full_value(weight, full * 2)
    assert torch.equal(weight.detach().float(), full * 2)
    release_param(weight)
