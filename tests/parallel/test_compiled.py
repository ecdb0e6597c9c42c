"""--compile trains the same model as eager.

Every compiled layout runs the real trainer (pretrain_gpt2.py) and is compared with the eager
single-process run, with dropout 0 and the same tolerance as the other layout tests: losses
within 1e-4 relative, gradient norms within 1e-3. Compiled code differs from eager only in
rounding (fused kernels, GeLU spelled with a sigmoid). With dropout, a compiled run resumes
exactly, and recomputing checkpointed activations replays its dropout masks.
"""

import json
import shutil

import pytest

from tests.parallel.launching import (build_corpus, launch_ranks, read_metrics,
                                      relative_difference, trainer_argv)
from tests.parallel.test_layouts import GLOBAL_BATCH, assert_same_training

ITERS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("data"))


def train(corpus, out_dir, world_size, iters, *extra):
    """pretrain_gpt2.py on `world_size` processes: ({iteration: (loss, grad norm)}, rank 0's
    output)."""
    argv = trainer_argv(corpus, out_dir / "log", iters, "--global-batch-size", GLOBAL_BATCH,
                        *extra)
    results = launch_ranks(argv, world_size, out_dir, timeout=300)
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{output[-3000:]}"
    return read_metrics(out_dir / "log"), results[0][1]


@pytest.fixture(scope="module")
def eager(corpus, tmp_path_factory):
    return train(corpus, tmp_path_factory.mktemp("eager"), 1, ITERS, "--batch-size", 8)[0]


def test_compiled_single_process_matches_eager(corpus, eager, tmp_path):
    metrics, output = train(corpus, tmp_path, 1, ITERS, "--batch-size", 8, "--compile")
    assert_same_training(eager, metrics, ITERS)
    lines = [line for line in output.splitlines() if line.startswith(" compile: ")]
    assert len(lines) == 1 and "the first step took" in lines[0], output[-2000:]


def test_compiled_fp16_with_split_halves_matches_eager(corpus, eager, tmp_path):
    """fp16 (loss scaling) and --checkpoint-activations --split-transformers (the layer's
    halves through the compiled module call), against eager fp32."""
    metrics, _ = train(corpus, tmp_path, 1, ITERS, "--batch-size", 8, "--compile", "--fp16",
                       "--checkpoint-activations", "--split-transformers")
    for it in range(1, ITERS + 1):
        assert relative_difference(metrics[it][0], eager[it][0]) < 1e-3, it


def test_compiled_tensor_parallel_matches_eager(corpus, eager, tmp_path):
    """TP=2, --compile with fullgraph=True from DeepSpeed's "compile" kwargs: each layer is
    one graph, its tensor-parallel all-reduces traced into it (in training and in the final
    evaluation, without grad), or torch.compile would raise."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
                                  "compile": {"kwargs": {"fullgraph": True}}}))
    metrics, _ = train(corpus, tmp_path, 2, ITERS, "--batch-size", 8,
                       "--model-parallel-size", 2, "--compile", "--deepspeed",
                       "--deepspeed_config", config)
    assert_same_training(eager, metrics, ITERS)


def test_compiled_zero2_from_the_deepspeed_config_matches_eager(corpus, eager, tmp_path):
    """DP=2, ZeRO-2, with DeepSpeed's "compile" section instead of the flag."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
                                  "zero_optimization": {"stage": 2},
                                  "compile": {"enabled": True}}))
    metrics, output = train(corpus, tmp_path, 2, ITERS, "--batch-size", 4, "--deepspeed",
                            "--deepspeed_config", config)
    assert_same_training(eager, metrics, ITERS)
    assert " compile: the first step took" in output


def test_zero3_runs_eagerly_and_says_so(corpus, eager, tmp_path):
    metrics, output = train(corpus, tmp_path, 2, ITERS, "--batch-size", 4, "--deepspeed",
                            "--zero-stage", 3, "--compile", "--deepspeed_config",
                            _zero_config(tmp_path))
    assert_same_training(eager, metrics, ITERS)
    notes = [line for line in output.splitlines() if "compile" in line]
    assert len(notes) == 1 and "runs eagerly at ZeRO stage 3" in notes[0], output[-2000:]


def _zero_config(tmp_path):
    path = tmp_path / "ds_zero.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0}))
    return path


DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def test_compiled_dropout_resumes_exactly_and_replays_masks_on_recompute(corpus, tmp_path):
    """Compiled with dropout: 2N iterations == N, save, resume N (bit for bit); and the same
    run with --checkpoint-activations gives the same losses (the recompute draws the masks
    of the forward), with mpu's checkpointing and with zero's (whose first forward runs
    without grad: another compiled graph, which must draw the same seeds)."""
    whole, _ = train(corpus, tmp_path / "whole", 1, ITERS, "--batch-size", 8, "--compile",
                     *DROPOUT, "--save", tmp_path / "ckpt", "--save-interval", ITERS // 2)
    resume = tmp_path / "resume"
    shutil.copytree(tmp_path / "ckpt" / f"iter_{ITERS // 2:07d}",
                    resume / f"iter_{ITERS // 2:07d}")
    (resume / "latest_checkpointed_iteration.txt").write_text(str(ITERS // 2))
    resumed, _ = train(corpus, tmp_path / "resumed", 1, ITERS, "--batch-size", 8, "--compile",
                       *DROPOUT, "--load", resume)
    assert sorted(resumed) == list(range(ITERS // 2 + 1, ITERS + 1))
    for it in resumed:
        assert resumed[it] == whole[it], it
    for name, recompute in (("mpu", []), ("zero", ["--deepspeed-activation-checkpointing"])):
        recomputed, _ = train(corpus, tmp_path / name, 1, ITERS, "--batch-size", 8, "--compile",
                              *DROPOUT, "--checkpoint-activations", *recompute)
        assert_same_training(whole, recomputed, ITERS)
