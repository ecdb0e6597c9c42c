"""pretrain_gpt2.py --deepspeed: a ZeRO checkpoint saved at DP=2 resumes at DP=1 (at its
own stage, and at stage 3).

Beyond DeepSpeed (which refuses another DP size for the optimizer state unless its checkpoint
is converted): the fp32 masters and Adam moments are re-partitioned on load. The global batch stays 8;
DP=1 makes it up with 2 micro batches of 4 (gradient accumulation), so the losses must
continue as the uninterrupted DP=2 run's within 1e-4 relative.
"""

import pytest

from tests.dist_utils import run_distributed
from tests.training.test_deepspeed import (NO_DROPOUT, _train_dp, read_losses, run,
                                           stage_config, trainer_argv)

ITERS, SAVED_AT = 6, 3


def _argv(corpus, tmp_path, name, stage, *extra):
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, stage)]
    return trainer_argv(corpus, tmp_path / name, ITERS, *NO_DROPOUT, "--global-batch-size", 8,
                        *ds, *extra, micro=4)


@pytest.fixture(scope="module")
def dp2_runs(corpus, tmp_path_factory):
    """At DP=2, stages 1 and 2: an uninterrupted run and one saved at iteration 3."""
    root = tmp_path_factory.mktemp("dp2")
    phases = []
    for stage in (1, 2):
        save = root / f"ckpt{stage}"
        phases += [_argv(corpus, root, f"straight{stage}", stage),
                   _argv(corpus, root, f"head{stage}", stage, "--save", save,
                         "--exit-interval", SAVED_AT)]
    run_distributed(_train_dp, 2, args=(str(root), phases))
    return root


@pytest.mark.parametrize("stage, resumed_stage", [(1, 1), (2, 2), (2, 3)])
def test_dp2_checkpoint_resumes_at_dp1_with_the_same_losses(corpus, dp2_runs, tmp_path, stage,
                                                            resumed_stage):
    save = dp2_runs / f"ckpt{stage}"
    assert sorted(p.name for p in (save / f"global_step{SAVED_AT}").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert run(corpus, tmp_path / "resumed", ITERS, *NO_DROPOUT, "--global-batch-size", 8,
               "--deepspeed", "--deepspeed_config", stage_config(tmp_path, resumed_stage),
               "--load", save, micro=4) == 0
    straight = read_losses(dp2_runs / f"straight{stage}")
    head = read_losses(dp2_runs / f"head{stage}")
    resumed = read_losses(tmp_path / "resumed")
    assert sorted(head) == list(range(1, SAVED_AT + 1))
    assert sorted(resumed) == list(range(SAVED_AT + 1, ITERS + 1))
    for it, (loss, norm) in resumed.items():
        ref_loss, ref_norm = straight[it]
        assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (it, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-3 * abs(ref_norm), (it, norm, ref_norm)
