"""Pipeline parallelism trains the same model as one process.

Each layout runs the real trainer (pretrain_gpt2.py) with dropout 0 and the global batch of
the other layout tests (8 samples, here in micro batches so the 1F1B schedule has something
to overlap), and is compared with the single-process run: losses within 1e-4 relative,
gradient norms within 1e-3.
"""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.parallel.launching import (REPO, assert_same_params_norms, build_corpus,
                                      launch_ranks, read_metrics, relative_difference,
                                      trainer_argv)
from tests.parallel.test_layouts import GLOBAL_BATCH, assert_same_training

ITERS = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("data"))


def train(corpus, out_dir, world_size, iters, *extra, expect_ok=True):
    """pretrain_gpt2.py on `world_size` processes: ({iteration: (loss, grad norm)}, outputs)."""
    argv = trainer_argv(corpus, out_dir / "log", iters, "--global-batch-size", GLOBAL_BATCH,
                        "--log-params-norm", *extra)
    results = launch_ranks(argv, world_size, out_dir, timeout=300)
    if expect_ok:
        for rank, (code, output) in enumerate(results):
            assert code == 0, f"rank {rank} failed:\n{output[-3000:]}"
    return read_metrics(out_dir / "log") if expect_ok else None, results


@pytest.fixture(scope="module")
def single_process_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    train(corpus, out, 1, ITERS, "--batch-size", 8, *optimizer_states(out))
    return out


def optimizer_states(out):
    """TensorBoard's optimizer/* numbers of every iteration."""
    return ("--tensorboard-dir", out / "tb", "--tensorboard-log-interval", 1,
            "--log-optimizer-states-to-tensorboard")


def assert_same_optimizer_states(reference_dir, out):
    """Adam's moments and the weights, each element once: the stages' sums are the model's."""
    from tests.training.test_tensorboard_flags import _scalars
    reference, found = _scalars(reference_dir / "tb"), _scalars(out / "tb")
    names = [tag for tag in reference if tag.startswith("optimizer/") and " vs " not in tag]
    assert len(names) == 12
    for name in names:
        for (step, value), (_, expected) in zip(found[name], reference[name], strict=True):
            assert relative_difference(value, expected) < 1e-4, (name, step, value, expected)


@pytest.fixture(scope="module")
def single_process(single_process_dir):
    return read_metrics(single_process_dir / "log")


@pytest.mark.parametrize("name, world_size, flags", [
    ("pp2", 2, ["--pipeline-model-parallel-size", 2, "--batch-size", 2]),
    ("pp2xtp2", 4, ["--pipeline-model-parallel-size", 2, "--model-parallel-size", 2,
                    "--batch-size", 2]),
    ("pp2xdp2", 4, ["--pipeline-model-parallel-size", 2, "--batch-size", 1]),
])
def test_pipeline_matches_single_process(corpus, single_process, single_process_dir, tmp_path,
                                         name, world_size, flags):
    # (TensorBoard every iteration: its numbers are read without resetting the bubble's)
    metrics, results = train(corpus, tmp_path, world_size, ITERS, *flags,
                             *optimizer_states(tmp_path))
    assert_same_training(single_process, metrics, ITERS)
    assert_same_params_norms(single_process_dir / "log", tmp_path / "log")  # stages summed
    assert_same_optimizer_states(single_process_dir, tmp_path)
    # rank 0, on the first stage, logs the loss
    bubbles = [float(b) for b in re.findall(r"pipeline bubble: ([0-9.]+)%", results[0][1])]
    assert len(bubbles) == ITERS and max(bubbles) < 90.0, bubbles


def test_pipeline_zero2_data_parallel_matches_single_process(corpus, single_process,
                                                             single_process_dir, tmp_path):
    """PP 2 x DP 2 with ZeRO stage 2 (its gradients reduced per micro batch) from a DeepSpeed
    JSON: one global norm and overflow decision over both stages."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                  "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
                                  "zero_optimization": {"stage": 2}}))
    metrics, _ = train(corpus, tmp_path, 4, ITERS, "--pipeline-model-parallel-size", 2,
                       "--batch-size", 1, "--deepspeed", "--deepspeed_config", config)
    assert_same_training(single_process, metrics, ITERS)
    assert_same_params_norms(single_process_dir / "log", tmp_path / "log")


@pytest.mark.slow
def test_pipeline_fp16_with_recompute_follows_single_process(corpus, single_process, tmp_path):
    """fp16 (the loss scale travels back with the gradients; one overflow decision) and
    --checkpoint-activations inside each stage, against fp32 in one process."""
    metrics, _ = train(corpus, tmp_path, 2, ITERS, "--pipeline-model-parallel-size", 2,
                       "--batch-size", 2, "--fp16", "--checkpoint-activations")
    for it in range(1, ITERS + 1):
        assert relative_difference(metrics[it][0], single_process[it][0]) < 2e-3, it


def test_pipeline_bf16_follows_single_process(corpus, tmp_path):
    """bf16, whose gradients the engine sums in fp32 (the tied output layer's on the last
    stage too: tests/parallel/test_tied_embedding_sums.py), against bf16 in one process."""
    single, _ = train(corpus, tmp_path / "single", 1, ITERS, "--batch-size", 8, "--bf16")
    metrics, _ = train(corpus, tmp_path / "pp2", 2, ITERS, "--pipeline-model-parallel-size", 2,
                       "--batch-size", 2, "--bf16")
    # (measured: 1e-5 in loss, 3e-4 in norm; the output layer's sum cut to its last micro
    # batch was 65% off in norm)
    for it in range(1, ITERS + 1):
        assert relative_difference(metrics[it][0], single[it][0]) < 1e-3, it
        assert relative_difference(metrics[it][1], single[it][1]) < 3e-3, it


FOUR_LAYERS = ["--num-layers", 4]


@pytest.fixture(scope="module")
def pp2_tp2_with_checkpoints(corpus, tmp_path_factory):
    """4 layers at TP 2 x PP 2, saving at the middle and the end."""
    out = tmp_path_factory.mktemp("pp2xtp2")
    metrics, _ = train(corpus, out, 4, ITERS, *FOUR_LAYERS, "--pipeline-model-parallel-size", 2,
                       "--model-parallel-size", 2, "--batch-size", 2, "--save", out / "ckpt",
                       "--save-interval", ITERS // 2)
    return out, metrics


def test_pipeline_checkpoint_has_a_file_per_stage_and_rank(pp2_tp2_with_checkpoints):
    """Megatron's names: mp_rank_TT_PPP; each stage numbers its layers from 0."""
    out, _ = pp2_tp2_with_checkpoints
    folder = out / "ckpt" / f"iter_{ITERS:07d}"
    assert sorted(p.name for p in folder.iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    first, last = (torch.load(folder / f"mp_rank_00_00{s}" / "model_optim_rng.pt",
                              weights_only=True) for s in (0, 1))
    assert first["args"]["pipeline_model_parallel_size"] == 2
    first, last = (f["model"]["language_model"] for f in (first, last))
    assert "embedding" in first and "embedding" not in last
    for stage in (first, last):
        assert {k.split(".")[1] for k in stage["transformer"] if k.startswith("layers.")} \
            == {"0", "1"}
    assert "final_layernorm.weight" in last["transformer"]
    assert "final_layernorm.weight" not in first["transformer"]


def _middle_checkpoint(out, tmp_path):
    middle = ITERS // 2
    resume_from = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt" / f"iter_{middle:07d}", resume_from / f"iter_{middle:07d}")
    (resume_from / "latest_checkpointed_iteration.txt").write_text(str(middle))
    return resume_from


def test_pipeline_resume_is_exact(corpus, pp2_tp2_with_checkpoints, tmp_path):
    out, uninterrupted = pp2_tp2_with_checkpoints
    resumed, _ = train(corpus, tmp_path, 4, ITERS, *FOUR_LAYERS,
                       "--pipeline-model-parallel-size", 2, "--model-parallel-size", 2,
                       "--batch-size", 2, "--load", _middle_checkpoint(out, tmp_path))
    assert sorted(resumed) == list(range(ITERS // 2 + 1, ITERS + 1))
    for it in resumed:
        assert resumed[it] == uninterrupted[it], it


@pytest.mark.parametrize("world_size, flags", [
    (2, ["--batch-size", 4]),  # TP 1 x PP 1 x DP 2
    pytest.param(4, ["--pipeline-model-parallel-size", 4, "--batch-size", 2],  # PP 4
                 marks=pytest.mark.slow),
    pytest.param(2, ["--pipeline-model-parallel-size", 2, "--batch-size", 2,  # interleaved
                     "--num-layers-per-virtual-pipeline-stage", 1], marks=pytest.mark.slow),
])
def test_resume_at_another_layout_continues_the_loss_curve(corpus, pp2_tp2_with_checkpoints,
                                                           tmp_path, world_size, flags):
    """--load converts a TP 2 x PP 2 checkpoint (weights, Adam moments, fp32 masters, the
    schedule) to the run's layout as it loads: the losses go on as the unbroken run's."""
    out, uninterrupted = pp2_tp2_with_checkpoints
    resumed, results = train(corpus, tmp_path, world_size, ITERS, *FOUR_LAYERS, *flags,
                             "--load", _middle_checkpoint(out, tmp_path))
    assert sorted(resumed) == list(range(ITERS // 2 + 1, ITERS + 1))
    for it in resumed:
        assert relative_difference(resumed[it][0], uninterrupted[it][0]) < 1e-4, it
        assert relative_difference(resumed[it][1], uninterrupted[it][1]) < 1e-3, it
    assert "converted to" in results[0][1] and "as it loaded" in results[0][1]


@pytest.mark.parametrize("world_size, flags, expected", [
    (2, ["--pipeline-model-parallel-size", 4],
     "world size 2 is not divisible by --model-parallel-size 1 x "
     "--pipeline-model-parallel-size 4 = 4"),
    (4, ["--pipeline-model-parallel-size", 4],
     "--pipeline-model-parallel-size 4 is more stages than --num-layers 2"),
])
def test_bad_pipeline_layout_is_one_error_line(corpus, tmp_path, world_size, flags, expected):
    argv = trainer_argv(corpus, tmp_path / "log", 2, "--batch-size", 2, *flags)
    results = launch_ranks(argv, world_size, tmp_path)
    assert all(code == 2 for code, _ in results)
    output0 = results[0][1]
    assert len(output0.strip().splitlines()) == 1, output0
    assert output0.startswith("error: ") and expected in output0, output0


@pytest.fixture(scope="module")
def four_layer_1f1b(corpus, tmp_path_factory):
    return train(corpus, tmp_path_factory.mktemp("pp2-4layers"), 2, ITERS, *FOUR_LAYERS,
                 "--pipeline-model-parallel-size", 2, "--batch-size", 2)[0]


def test_interleaved_schedule_matches_1f1b(corpus, four_layer_1f1b, tmp_path):
    """Two model chunks a stage (layers 0 and 2 on stage 0, 1 and 3 on stage 1): the same
    losses as plain 1F1B; its checkpoint, whose stages hold layers 0, 2 and 1, 3, loads into
    a run without stages."""
    metrics, _ = train(corpus, tmp_path, 2, ITERS, *FOUR_LAYERS,
                       "--pipeline-model-parallel-size", 2, "--batch-size", 2,
                       "--num-layers-per-virtual-pipeline-stage", 1, "--save", tmp_path / "ckpt")
    assert_same_training(four_layer_1f1b, metrics, ITERS)
    resumed, results = train(corpus, tmp_path / "resumed", 1, ITERS + 2, *FOUR_LAYERS,
                             "--batch-size", 8, "--load", tmp_path / "ckpt")
    assert sorted(resumed) == [ITERS + 1, ITERS + 2]
    assert "of 1-layer model chunks; converted to tensor-parallel size 1" in results[0][1]


def _zero_json(path, gas, stage=1):
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
                                "zero_optimization": {"stage": stage}}))
    return path


@pytest.fixture(scope="module")
def deepspeed_pp2_dp2(corpus, tmp_path_factory):
    """PP 2 x DP 2 at ZeRO-1 under --deepspeed, saving at the middle and the end."""
    out = tmp_path_factory.mktemp("ds-pp2xdp2")
    metrics, _ = train(corpus, out, 4, ITERS, "--pipeline-model-parallel-size", 2,
                       "--batch-size", 1, "--deepspeed", "--deepspeed_config",
                       _zero_json(out / "ds.json", gas=4), "--save", out / "ckpt",
                       "--save-interval", ITERS // 2)
    return out, metrics


def test_deepspeed_pipeline_checkpoint_layout(deepspeed_pp2_dp2):
    """DeepSpeed's PipelineEngine names: a file per layer and tensor slice, model and optimizer
    states per (stage x TP + TP rank), the module itself not in the model states."""
    out, _ = deepspeed_pp2_dp2
    folder = out / "ckpt" / f"global_step{ITERS}"
    assert sorted(p.name for p in folder.iterdir()) == [
        "layer_00-model_00-model_states.pt", "layer_01-model_00-model_states.pt",
        "layer_02-model_00-model_states.pt", "layer_03-model_00-model_states.pt",
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    states = torch.load(folder / "mp_rank_01_model_states.pt", weights_only=True)
    assert states["module"] is None and states["mp_world_size"] == 2
    embedding = torch.load(folder / "layer_00-model_00-model_states.pt", weights_only=True)
    assert sorted(embedding) == ["position_embeddings.weight", "word_embeddings.weight"]
    final = torch.load(folder / "layer_03-model_00-model_states.pt", weights_only=True)
    assert sorted(final) == ["bias", "weight"]


def test_deepspeed_pipeline_resume_is_exact(corpus, deepspeed_pp2_dp2, tmp_path):
    out, uninterrupted = deepspeed_pp2_dp2
    middle = ITERS // 2
    resume_from = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt" / f"global_step{middle}", resume_from / f"global_step{middle}")
    (resume_from / "latest").write_text(f"global_step{middle}")
    resumed, _ = train(corpus, tmp_path, 4, ITERS, "--pipeline-model-parallel-size", 2,
                       "--batch-size", 1, "--deepspeed", "--deepspeed_config",
                       _zero_json(tmp_path / "ds.json", gas=4), "--load", resume_from)
    assert sorted(resumed) == list(range(middle + 1, ITERS + 1))
    for it in resumed:
        assert resumed[it] == uninterrupted[it], it
    # the same checkpoint at DP 1 and ZeRO-2: the partitions are re-cut as they load
    resumed, _ = train(corpus, tmp_path / "dp1", 2, ITERS, "--pipeline-model-parallel-size", 2,
                       "--batch-size", 1, "--deepspeed", "--deepspeed_config",
                       _zero_json(tmp_path / "ds1.json", gas=8, stage=2), "--load", resume_from)
    for it in resumed:
        assert relative_difference(resumed[it][0], uninterrupted[it][0]) < 1e-4, it


def test_a_deepspeed_pipeline_checkpoint_at_other_stages_names_the_conversion(
        corpus, deepspeed_pp2_dp2, tmp_path):
    """DeepSpeed's layout is not converted as it loads: resuming it without its stages is one
    error on every rank that gives the command converting it (not an error about a
    tensor-parallel file, from the ranks whose own file is missing)."""
    out, _ = deepspeed_pp2_dp2
    _, results = train(corpus, tmp_path, 1, ITERS, "--batch-size", 1, "--deepspeed",
                       "--deepspeed_config", _zero_json(tmp_path / "ds.json", gas=8),
                       "--load", out / "ckpt", expect_ok=False)
    code, output = results[0]
    assert code == 2, output[-3000:]
    ckpt = out / "ckpt"
    assert "was saved at another parallel layout:\n  --pipeline-model-parallel-size: " \
        "checkpoint 2, flags 1\n" in output
    assert (f"convert it to these: python tools/merge_mp_partitions.py --deepspeed --load "
            f"{ckpt} --target-model-parallel-size 1 --target-pipeline-model-parallel-size 1 "
            f"--save {ckpt}_mp1, then --load {ckpt}_mp1, with or without --deepspeed (it "
            "writes Megatron's layout, with the optimizer state; add --no-load-optim where the "
            "tool says it was not converted: tiled linears)") in output
    assert "--finetune from a matching shape" not in output
    from zero.checkpoint.zero_to_fp32 import (CheckpointError,
                                              get_fp32_state_dict_from_zero_checkpoint)
    with pytest.raises(CheckpointError, match=r"holds 2 model-parallel ranks \(tensor slices x "
                                              r"pipeline stages, mp_rank_\*\).*tools/convert_"
                                              r"checkpoint.py --loader deepspeed"):
        get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def test_a_deepspeed_pipeline_checkpoint_converts_with_its_optimizer(
        corpus, deepspeed_pp2_dp2, tmp_path):
    """merge_mp_partitions.py --deepspeed reads each stage's fp32 masters and Adam moments out
    of that stage's ZeRO files and joins the stages: the one-stage Megatron checkpoint resumes
    without --deepspeed, on one process, and continues the PP 2 x DP 2 run's losses."""
    out, uninterrupted = deepspeed_pp2_dp2
    middle, merged = ITERS // 2, tmp_path / "merged"
    tool = subprocess.run([sys.executable, "tools/merge_mp_partitions.py", "--deepspeed",
                           "--load", str(out / "ckpt"), "--iteration", str(middle),
                           "--save", str(merged)], cwd=REPO, capture_output=True, text=True)
    assert tool.returncode == 0, tool.stderr
    assert "pipeline stages 2 -> 1" in tool.stdout
    assert " optimizer state: converted" in tool.stdout and "--no-load-optim" not in tool.stdout
    resumed, _ = train(corpus, tmp_path, 1, ITERS, "--batch-size", GLOBAL_BATCH,
                       "--load", merged)
    assert sorted(resumed) == list(range(middle + 1, ITERS + 1))  # no fresh warm-up
    for it in resumed:
        assert relative_difference(resumed[it][0], uninterrupted[it][0]) < 1e-4, it


def test_deepspeed_pipeline_checkpoint_converts(deepspeed_pp2_dp2, tmp_path):
    """The converters read the layer files (fp32 masters from the ZeRO partitions of each
    stage) and join the stages: the full model's layer 1 is the second stage's layer."""
    from megatron.convert.loaders import load_model_weights
    out, _ = deepspeed_pp2_dp2
    weights = load_model_weights(str(out / "ckpt"), "deepspeed").state_dict
    folder = out / "ckpt" / f"global_step{ITERS}"
    layer = torch.load(folder / "layer_02-model_00-model_states.pt", weights_only=True)
    for key, tensor in layer.items():
        assert torch.equal(weights[f"language_model.transformer.layers.1.{key}"], tensor), key
    embedding = torch.load(folder / "layer_00-model_00-model_states.pt", weights_only=True)
    assert torch.equal(weights["language_model.embedding.position_embeddings.weight"],
                       embedding["position_embeddings.weight"])
