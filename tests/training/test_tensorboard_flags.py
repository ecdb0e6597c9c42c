"""pretrain_gpt2.py with Megatron-LM's logging flags: --log-params-norm on the line, in
metrics.jsonl and TensorBoard; --tensorboard-log-interval writing every N-th iteration's own
numbers; the --log-*-to-tensorboard switches."""

import json
import math

import pytest
import torch

from tests.training.test_pretrain import run

pytest.importorskip("tensorboard")


def _scalars(tb_dir):
    """{tag: [(step, value)]} of a TensorBoard folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    return {tag: [(s.step, s.value) for s in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def _records(log_dir):
    with open(log_dir / "metrics.jsonl") as f:
        return {r["iteration"]: r for r in map(json.loads, f) if "lm_loss" in r}


def test_every_nth_iteration_goes_to_tensorboard_with_its_own_numbers(corpus, tmp_path):
    tb, save = tmp_path / "tb", tmp_path / "ckpt"
    assert run(corpus, tmp_path, "--tensorboard-dir", str(tb), "--tensorboard-log-interval",
               "2", "--tensorboard-queue-size", "1", "--log-params-norm",
               "--log-batch-size-to-tensorboard", "--log-world-size-to-tensorboard",
               "--log-memory-to-tensorboard", "--no-log-learning-rate-to-tensorboard",
               "--save", str(save), iters=6) == 0
    records, scalars = _records(tmp_path / "run"), _scalars(tb)
    # the line's numbers are each iteration's (--log-interval 1): TensorBoard has 2, 4 and 6
    for tag, key in (("lm-loss", "lm_loss"), ("grad-norm", "grad_norm"),
                     ("params-norm", "params_norm"), ("loss-scale", "loss_scale")):
        assert [step for step, _ in scalars[tag]] == [2, 4, 6], tag
        for step, value in scalars[tag]:
            assert value == pytest.approx(records[step][key], rel=1e-6), (tag, step)
        assert [step for step, _ in scalars[f"{tag} vs samples"]] == [8, 16, 24]
    assert [value for _, value in scalars["batch-size"]] == [4, 4, 4]
    assert [value for _, value in scalars["world-size"]] == [1, 1, 1]
    assert {"mem-rss-bytes", "mem-max-rss-bytes"} <= set(scalars)
    assert all(value > 1e6 for _, value in scalars["mem-max-rss-bytes"])
    assert "learning-rate" not in scalars and "learning-rate vs samples" not in scalars
    # the interval's numbers still go with every log line
    assert [step for step, _ in scalars["ms-per-iteration"]] == [1, 2, 3, 4, 5, 6]
    # the norm is the trained weights': those the checkpoint holds (fp32: the masters)
    saved = torch.load(save / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=True)["model"]
    assert records[6]["params_norm"] == pytest.approx(
        math.sqrt(sum(t.double().pow(2).sum().item() for t in _tensors(saved))), rel=1e-6)


def _tensors(tree):
    if torch.is_tensor(tree):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)


def test_params_norm_goes_with_the_log_line_by_default(corpus, tmp_path, capsys):
    tb = tmp_path / "tb"
    assert run(corpus, tmp_path, "--tensorboard-dir", str(tb), "--log-params-norm",
               "--log-interval", "3", iters=6) == 0
    records, scalars = _records(tmp_path / "run"), _scalars(tb)
    assert sorted(records) == [3, 6]
    assert [step for step, _ in scalars["params-norm"]] == [3, 6]
    assert [step for step, _ in scalars["lm-loss"]] == [3, 6]  # the interval's mean
    assert scalars["lm-loss"][1][1] == pytest.approx(records[6]["lm_loss"], rel=1e-6)
    out = capsys.readouterr().out
    assert f"| params norm: {records[6]['params_norm']:.3f} |" in out


def test_optimizer_states_go_to_tensorboard_with_the_iterations_numbers(corpus, tmp_path):
    """Megatron-DeepSpeed's twelve optimizer/* numbers at the TensorBoard interval (each also
    vs samples); the weights' L2 norm is --log-params-norm's."""
    tb = tmp_path / "tb"
    assert run(corpus, tmp_path, "--tensorboard-dir", str(tb), "--tensorboard-log-interval",
               "2", "--log-optimizer-states-to-tensorboard", "--log-params-norm",
               iters=4) == 0
    records, scalars = _records(tmp_path / "run"), _scalars(tb)
    names = sorted(tag for tag in scalars if tag.startswith("optimizer/") and " vs " not in tag)
    assert names == sorted(f"optimizer/{kind}_{norm}" for norm in ("l2", "l1", "abs_max")
                           for kind in ("variance", "variance_sqrt", "momentum", "weight"))
    for name in names:
        assert [step for step, _ in scalars[name]] == [2, 4], name
        assert [step for step, _ in scalars[f"{name} vs samples"]] == [8, 16], name
    assert [v for _, v in scalars["optimizer/weight_l2"]] == pytest.approx(
        [records[2]["params_norm"], records[4]["params_norm"]], rel=1e-6)
    (_, variance_l1), (_, variance_sqrt_l2) = (scalars["optimizer/variance_l1"][-1],
                                               scalars["optimizer/variance_sqrt_l2"][-1])
    assert variance_sqrt_l2 == pytest.approx(math.sqrt(variance_l1), rel=1e-5)


def test_zeros_in_the_gradient_go_on_the_line_in_metrics_and_to_tensorboard(corpus, tmp_path,
                                                                           capsys):
    """--log-num-zeros-in-grad: Megatron-LM's ' num zeros: N |' after the grad norm (few here:
    the output layer tied to the word embeddings gives every row a gradient; counting is
    tested in tests/zero/test_zeros_in_grad.py)."""
    tb = tmp_path / "tb"
    assert run(corpus, tmp_path, "--tensorboard-dir", str(tb), "--log-num-zeros-in-grad",
               "--log-interval", "2", iters=4) == 0
    records, scalars = _records(tmp_path / "run"), _scalars(tb)
    assert sorted(records) == [2, 4]
    counts = [records[it]["num_zeros_in_grad"] for it in (2, 4)]
    assert all(isinstance(count, int) and count >= 0 for count in counts)
    assert [value for _, value in scalars["num-zeros"]] == counts
    assert [step for step, _ in scalars["num-zeros vs samples"]] == [8, 16]
    out = capsys.readouterr().out
    assert f"| grad norm: {records[4]['grad_norm']:.3f} | num zeros: {counts[1]:.1f} |" in out
