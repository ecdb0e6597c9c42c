"""A ZeRO checkpoint resumed at the other family of stages (3 <-> 0-2): masters, optimizer
state and loss scale carry over, also at another data-parallel size, with offload on either
side; the model and its param groups are checked."""

import os

import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from tests.zero.test_zero_checkpoint import N, _close, _engine, _grown_engine, _weights
from zero.errors import CheckpointError

def _nvme(tmp_path, name):
    (tmp_path / name).mkdir()
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / name)},
            "sub_group_size": 700}


@pytest.mark.parametrize("saved, resumed, precision, with_frozen", [
    (2, 3, "fp32", False), (3, 1, "bf16", True), (0, 3, "fp16", True), (3, 0, "fp32", False),
    ("3+nvme", "2+cpu", "bf16", False), ("2+cpu", "3+nvme", "fp32", True)])
def test_a_checkpoint_resumes_at_the_other_family_of_stages(tmp_path, saved, resumed,
                                                             precision, with_frozen):
    """Stage 3 keeps each parameter cut into dp pieces, stages 0-2 each param group's flat
    tensor: the loader reads either one parameter at a time, so the masters, Adam's moments and
    the loss scale carry over and training goes on as if never stopped, bit for bit in fp32
    (with a fresh optimizer the losses move by ~1.6e-2). Offloaded optimizers on either
    side."""
    def engine(variant):
        stage, _, offload = str(variant).partition("+")
        options = {"cpu": {"offload_optimizer": {"device": "cpu"}}, "": {},
                   "nvme": _nvme(tmp_path, f"swap{len(os.listdir(tmp_path))}")}[offload]
        config = cases.ds_config(int(stage), precision=precision, **options)
        return cases.make_engine(config, model=cases.make_model(with_frozen=with_frozen))
    first = engine(saved)
    cases.train_steps(first, N)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    scale = first.cur_scale
    continued = cases.train_steps(first, N, start=N)
    second = engine(resumed)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    assert (second.global_steps, second.cur_scale) == (N, scale)
    resumed_losses = cases.train_steps(second, N, start=N)
    if precision == "fp32":
        assert resumed_losses == continued
    else:  # 16-bit gradients accumulate in another dtype at stages 0-1 than at 2-3
        assert _close(resumed_losses, continued, 1e-4)


def _other_stage_runs(rank, world_size, dirs):
    """DP=2: the straight stage 2 run; a stage 3 save; the DP=1 stage 3 save resumed at
    stage 2."""
    results = {"straight": cases.train_steps(_engine(stage=2), 2 * N)}
    stage3 = _engine(stage=3)
    cases.train_steps(stage3, N)
    stage3.save_checkpoint(dirs["dp2_stage3"])
    resumed = _engine(stage=2)
    resumed.load_checkpoint(dirs["dp1_stage3"])
    results["stage3_dp1_at_stage2_dp2"] = cases.train_steps(resumed, N, start=N)
    return results


def test_another_stage_at_another_data_parallel_size(tmp_path):
    dirs = {name: str(tmp_path / name) for name in ("dp1_stage3", "dp2_stage3")}
    dp1 = _engine(stage=3)
    cases.train_steps(dp1, N)
    dp1.save_checkpoint(dirs["dp1_stage3"])
    dp2 = run_distributed(_other_stage_runs, 2, args=(dirs,))
    straight = dp2[0]["straight"]
    for rank in range(2):
        assert _close(dp2[rank]["stage3_dp1_at_stage2_dp2"], straight[N:])
    resumed = _engine(stage=1)
    resumed.load_checkpoint(dirs["dp2_stage3"])
    assert _close(cases.train_steps(resumed, N, start=N), straight[N:])


def test_another_stage_checks_the_model_and_its_param_groups(tmp_path):
    saved = cases.make_engine(cases.ds_config(3))
    cases.train_steps(saved, 1)
    saved.save_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="extra.weight"):
        _grown_engine(1).load_checkpoint(str(tmp_path))
    grown = _grown_engine(1)
    before = _weights(grown)
    grown.load_checkpoint(str(tmp_path), None, False)  # not strict: the new layer keeps its own
    assert torch.equal(_weights(grown)["extra.weight"], before["extra.weight"])
    assert all(torch.equal(_weights(grown)[n], w) for n, w in _weights(saved).items())

    model = cases.make_model()
    groups = cases.param_groups(model)
    groups[0]["params"], groups[1]["params"] = groups[0]["params"][1:], \
        groups[1]["params"] + groups[0]["params"][:1]  # one weight moved to the other group
    regrouped, *_ = zero.initialize(model=model, config=cases.ds_config(1),
                                    optimizer=torch.optim.AdamW(groups, lr=cases.LR))
    with pytest.raises(CheckpointError, match=r"1 parameter\(s\) of .* sit in another optimizer "
                                              r"param group than when saved \(embed.weight: "
                                              r"group 0, now 1\)"):
        regrouped.load_checkpoint(str(tmp_path))
