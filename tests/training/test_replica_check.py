"""--check-weight-hash-across-dp-replicas-interval N: data-parallel replicas compare their
weights' digests every N iterations; replicas that differ stop the run, naming the weights."""

import contextlib
import io
import os
import re

import pytest
import torch

import pretrain_gpt2
from megatron.errors import ConfigError
from tests.dist_utils import run_distributed
from tests.training.test_arguments import parse
from tests.training.test_deepspeed import NO_DROPOUT, stage_config, trainer_argv

FLAG = "--check-weight-hash-across-dp-replicas-interval"


def test_the_flag_resolves_and_wrong_uses_are_one_error(tmp_path):
    assert parse().training.check_weight_hash_across_dp_replicas_interval is None
    assert parse(FLAG, "5", world_size=2).training \
        .check_weight_hash_across_dp_replicas_interval == 5
    assert f" note: {FLAG}: one data-parallel rank, no replicas to compare" in \
        parse(FLAG, "5").notes
    with pytest.raises(ConfigError, match=f"^{FLAG} must be positive, got 0"):
        parse(FLAG, "0", world_size=2)
    with pytest.raises(ConfigError, match=re.escape(
            f"{FLAG} compares the weights data-parallel replicas hold; at ZeRO stage 3 each "
            "rank holds its own part of them")):
        parse(FLAG, "5", "--deepspeed", "--deepspeed_config", stage_config(tmp_path, 3),
              world_size=2)


def _train(rank, world_size, argv, drift_at_call):
    """pretrain_gpt2 on this rank, its stdout and stderr returned; with `drift_at_call`, DP
    rank 1 changes one weight alone at that forward step."""
    import megatron.gpt2
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    forward_step, calls = megatron.gpt2.forward_step, [0]

    def drifting(batch, model, ctx):
        calls[0] += 1
        if rank == 1 and calls[0] == drift_at_call:
            weight = dict(model.module.named_parameters())[
                "language_model.transformer.layers.1.mlp.dense_4h_to_h.weight"]
            with torch.no_grad():
                weight[0, 0] += 1e-3
        return forward_step(batch, model, ctx)

    megatron.gpt2.forward_step = drifting
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pretrain_gpt2.main(argv)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def dp2_runs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    argv = trainer_argv(corpus, root / "logs", 4, *NO_DROPOUT, FLAG, 2, micro=2)
    same = run_distributed(_train, 2, args=(argv, None))
    zero2 = run_distributed(_train, 2, args=(argv + ["--deepspeed", "--deepspeed_config",
                                                     stage_config(root, 2)], None))
    drifted = run_distributed(_train, 2, args=(argv, 3))  # iteration 3's forward, on rank 1
    # TP 2 x DP 2: rank 3 (TP rank 1 of DP rank 1) drifts; ranks 0 and 2 stop too
    tp2 = run_distributed(_train, 4, args=(argv + ["--model-parallel-size", "2"], 3))
    return {"same": same, "zero2": zero2, "drifted": drifted, "tp2": tp2}


@pytest.mark.parametrize("run", ["same", "zero2"])
def test_replicas_that_agree_say_so_at_each_interval(dp2_runs, run):
    """(at ZeRO stage 2 each rank updates its part and all-gathers the weights)"""
    (code0, out0), (code1, _) = dp2_runs[run]
    assert (code0, code1) == (0, 0)
    for iteration in (2, 4):
        assert f" iteration {iteration}: the weights of the 2 data-parallel replicas agree" \
            in out0


def test_a_replica_that_drifted_stops_every_rank_naming_the_weight(dp2_runs):
    (code0, out0), (code1, _) = dp2_runs["drifted"]
    assert code0 == code1 == 2
    assert " iteration 2: the weights of the 2 data-parallel replicas agree" in out0
    assert "error: iteration 4: the data-parallel replicas' weights differ (" + FLAG + "): " \
           "data-parallel rank(s) 1 (global 1) differ from data-parallel rank 0 (global 0) in " \
           "1 of 28 weights: language_model.transformer.layers.1.mlp.dense_4h_to_h.weight. " \
           "Resume from the last checkpoint" in out0


def test_every_rank_stops_when_another_model_parallel_groups_replicas_differ(dp2_runs):
    """Only DP group (1, 3) differs; ranks 0 and 2 would otherwise train on into a collective
    that ranks 1 and 3 never join."""
    results = dp2_runs["tp2"]
    assert [code for code, _ in results] == [2, 2, 2, 2]
    for rank in (1, 3):
        assert "data-parallel rank(s) 1 (global 3) differ from data-parallel rank 0 (global 1) " \
               "in 1 of 28 weights: language_model.transformer.layers.1.mlp.dense_4h_to_h." \
               "weight" in results[rank][1]
    assert "error: iteration 4: the data-parallel replicas' weights differ (" + FLAG + ") in " \
           "another model-parallel group than this rank's (rank 0): see the error of a rank " \
           "that names them" in results[0][1]
