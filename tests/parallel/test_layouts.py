"""Contract 1: every parallel layout trains the same model as one process.

With dropout 0, the same seed and the same global batch (8 samples), the losses of the first
20 iterations of tensor-parallel 2/4, data-parallel 2/4, TP 2 x DP 2 and gradient
accumulation agree with a single process within 1e-4 relative (gradient norms within 1e-3;
both agree to ~1e-7 and ~1e-5 here).  Every layout runs the real trainer (pretrain_gpt2.py)
in separate processes and is compared with the single-process run, never with itself.
"""

import shutil
import subprocess

import pytest
import torch

from tests.parallel.launching import (PYTHON, REPO, assert_same_params_norms, build_corpus,
                                      clean_environment, launch_ranks, read_metrics,
                                      relative_difference, run_torchrun, trainer_argv)

GLOBAL_BATCH = 8
ITERS = 20  # the contract's number; resume is checked at TP 2 x DP 2 from ITERS // 2
# name: (tensor-parallel size, data-parallel size, micro batch); global batch 8 in each.
LAYOUTS = {
    "tp2": (2, 1, 8),
    "tp4": (4, 1, 8),
    "dp2": (1, 2, 4),
    "dp4": (1, 4, 2),
    "tp2xdp2": (2, 2, 4),
    "dp2-accumulate": (1, 2, 2),  # global batch = 2 x micro x dp: two micro batches per step
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("data"))


def train(corpus, out_dir, layout, iters, *extra):
    """Run pretrain_gpt2.py with `layout`; return its {iteration: (loss, grad norm)} (the
    weights' norms are in its metrics.jsonl too: --log-params-norm)."""
    tp, dp, micro = layout
    argv = trainer_argv(corpus, out_dir / "log", iters, "--model-parallel-size", tp,
                        "--batch-size", micro, "--global-batch-size", GLOBAL_BATCH,
                        "--log-params-norm", *extra)
    results = launch_ranks(argv, tp * dp, out_dir)
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} of {layout} failed:\n{output[-3000:]}"
    return read_metrics(out_dir / "log")


def assert_same_training(reference, metrics, iters, loss_tolerance=1e-4):
    assert sorted(metrics) == list(range(1, iters + 1))
    for it in range(1, iters + 1):
        (loss, norm), (ref_loss, ref_norm) = metrics[it], reference[it]
        assert relative_difference(loss, ref_loss) < loss_tolerance, (it, loss, ref_loss)
        assert relative_difference(norm, ref_norm) < 1e-3, (it, norm, ref_norm)


@pytest.fixture(scope="module")
def single_process_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    train(corpus, out, (1, 1, GLOBAL_BATCH), ITERS)
    return out


@pytest.fixture(scope="module")
def single_process(single_process_dir):
    return read_metrics(single_process_dir / "log")


@pytest.fixture(scope="module")
def tp2_dp2_with_checkpoints(corpus, tmp_path_factory):
    """TP 2 x DP 2 for ITERS iterations, saving at the middle and at the end."""
    out = tmp_path_factory.mktemp("tp2xdp2")
    metrics = train(corpus, out, LAYOUTS["tp2xdp2"], ITERS, "--save", out / "ckpt",
                    "--save-interval", ITERS // 2)
    return out, metrics


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "tp2xdp2"])
def test_layout_matches_single_process(corpus, single_process, single_process_dir, tmp_path,
                                       name):
    metrics = train(corpus, tmp_path, LAYOUTS[name], ITERS)
    assert_same_training(single_process, metrics, ITERS)
    assert_same_params_norms(single_process_dir / "log", tmp_path / "log")


def test_tp2_dp2_matches_single_process(single_process, single_process_dir,
                                        tp2_dp2_with_checkpoints):
    assert_same_training(single_process, tp2_dp2_with_checkpoints[1], ITERS)
    assert_same_params_norms(single_process_dir / "log", tp2_dp2_with_checkpoints[0] / "log")


def test_tp2_dp2_checkpoint_has_one_file_per_tensor_parallel_rank(tp2_dp2_with_checkpoints):
    """4 processes, 2 tensor-parallel ranks: DP rank 0 of each TP group writes its shard."""
    out, _ = tp2_dp2_with_checkpoints
    save = out / "ckpt"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    for iteration in (ITERS // 2, ITERS):
        files = sorted(str(p.relative_to(save)) for p in save.glob(f"iter_{iteration:07d}/**/*")
                       if p.is_file())
        assert files == [f"iter_{iteration:07d}/mp_rank_00/model_optim_rng.pt",
                         f"iter_{iteration:07d}/mp_rank_01/model_optim_rng.pt"]
    shards = [torch.load(save / f"iter_{ITERS:07d}" / f"mp_rank_0{r}" / "model_optim_rng.pt",
                         weights_only=True) for r in range(2)]
    for shard in shards:
        assert shard["args"]["model_parallel_size"] == 2
        model = shard["model"]["language_model"]
        # hidden 32 over 2 ranks: QKV rows 3*32/2, vocab rows 512/2; LayerNorm replicated.
        assert model["transformer"]["layers.0.attention.query_key_value.weight"].shape == (48, 32)
        assert model["embedding"]["word_embeddings"]["weight"].shape == (256, 32)
    qkv = [s["model"]["language_model"]["transformer"]["layers.0.attention.query_key_value.weight"]
           for s in shards]
    assert not torch.equal(qkv[0], qkv[1])
    norm = "layers.0.input_layernorm.weight"
    assert torch.equal(shards[0]["model"]["language_model"]["transformer"][norm],
                       shards[1]["model"]["language_model"]["transformer"][norm])


def test_tp2_dp2_resume_is_exact(corpus, tp2_dp2_with_checkpoints, tmp_path):
    """N iterations, stop, resume for N more == 2N in one go, bit for bit."""
    out, uninterrupted = tp2_dp2_with_checkpoints
    middle = ITERS // 2
    resume_from = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt" / f"iter_{middle:07d}", resume_from / f"iter_{middle:07d}")
    (resume_from / "latest_checkpointed_iteration.txt").write_text(str(middle))
    resumed = train(corpus, tmp_path, LAYOUTS["tp2xdp2"], ITERS, "--load", resume_from)
    assert sorted(resumed) == list(range(middle + 1, ITERS + 1))
    for it in resumed:
        assert resumed[it] == uninterrupted[it], it


def test_vocab_is_padded_to_a_multiple_of_the_tensor_parallel_size(corpus, tmp_path):
    """512 tokens, --make-vocab-size-divisible-by 100, TP 2: padded to 600, 300 rows a rank."""
    argv = trainer_argv(corpus, tmp_path / "log", 2, "--model-parallel-size", 2,
                        "--batch-size", 2, "--make-vocab-size-divisible-by", 100,
                        "--save", tmp_path / "ckpt")
    for code, output in launch_ranks(argv, 2, tmp_path):
        assert code == 0, output[-3000:]
    for rank in range(2):
        shard = torch.load(tmp_path / "ckpt" / "iter_0000002" / f"mp_rank_0{rank}" /
                           "model_optim_rng.pt", weights_only=True)
        assert shard["args"]["padded_vocab_size"] == 600
        rows = shard["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]
        assert rows.shape == (300, 32)


BAD_LAYOUTS = {
    "world-not-divisible-by-tp": (["--model-parallel-size", "4"],
                                  "world size 2 is not divisible by --model-parallel-size 4"),
    "heads-not-divisible-by-tp": (["--num-attention-heads", "3", "--hidden-size", "48",
                                   "--model-parallel-size", "2"],
                                  "--model-parallel-size 2 must divide "
                                  "--num-attention-heads 3"),
    "ffn-not-divisible-by-tp": (["--ffn-hidden-size", "65", "--model-parallel-size", "2"],
                                "--model-parallel-size 2 must divide --ffn-hidden-size 65 "
                                "(65 % 2 = 1)"),
}


@pytest.mark.parametrize("name", list(BAD_LAYOUTS))
def test_bad_layout_is_one_error_line_for_the_job(corpus, tmp_path, name):
    """Every rank stops with exit code 2; rank 0 says why in one line, the others (which
    would say the same) are silent."""
    extra, expected = BAD_LAYOUTS[name]
    argv = trainer_argv(corpus, tmp_path / "log", 2, "--batch-size", 2, *extra)
    (code0, output0), (code1, output1) = launch_ranks(argv, 2, tmp_path)
    assert code0 == code1 == 2
    assert len(output0.strip().splitlines()) == 1, output0
    assert output0.startswith("error: ") and expected in output0, output0
    assert output1.strip() == "", output1


def test_bad_layout_under_torchrun_is_a_clear_error(corpus, tmp_path):
    extra, expected = BAD_LAYOUTS["heads-not-divisible-by-tp"]
    argv = trainer_argv(corpus, tmp_path / "log", 2, "--batch-size", 2, *extra)
    code, output = run_torchrun(argv, 2, tmp_path / "torchrun.out")
    assert code != 0
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], output[-3000:]  # once, not per rank
    # torchrun reports the failed ranks with a traceback of its own; none runs through the
    # trainer's code.
    assert f'File "{REPO / "megatron"}' not in output
    assert f'File "{REPO / "pretrain_gpt2.py"}' not in output


def test_tensor_parallel_without_enough_processes_is_a_one_line_error(corpus, tmp_path):
    argv = trainer_argv(corpus, tmp_path / "log", 2, "--batch-size", 2,
                        "--model-parallel-size", 2)
    done = subprocess.run([PYTHON, "pretrain_gpt2.py", *argv], cwd=REPO, capture_output=True,
                          text=True, env=clean_environment(), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: world size 1 is not divisible by "
                                   "--model-parallel-size 2 (1 % 2 = 1)")
