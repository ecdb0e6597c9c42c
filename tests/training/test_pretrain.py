"""pretrain_gpt2.py end to end on a tiny model: resume, layouts, errors, outputs."""

import json
import os

import pytest
import torch

import pretrain_gpt2

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--lr", "3e-3",
        "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--warmup-iters", "2",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--num-workers", "0", "--split", "90,9,1", "--threads", "1"]


def run(corpus, tmp_path, *extra, iters=6, log_dir="run"):
    argv = TINY + ["--batch-size", "4", "--train-iters", str(iters),
                   "--data-path", corpus["prefix"], "--vocab-file", corpus["vocab"],
                   "--merge-file", corpus["merges"], "--log-dir", str(tmp_path / log_dir)]
    return pretrain_gpt2.main(argv + list(extra))


def losses(tmp_path, log_dir="run"):
    with open(tmp_path / log_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in records if "lm_loss" in r}


@pytest.mark.parametrize("precision", [[], ["--fp16"], ["--bf16"]],
                         ids=["fp32", "fp16", "bf16"])
def test_resume_is_exact(corpus, tmp_path, precision):
    """2N iterations == N, stop, resume, N more: bit for bit, with dropout on."""
    assert run(corpus, tmp_path, *precision, log_dir="full") == 0
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, *precision, "--save", save, "--exit-interval", "3",
               log_dir="split") == 0
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "3"
    assert run(corpus, tmp_path, *precision, "--save", save, "--load", save,
               log_dir="split") == 0
    full, split = losses(tmp_path, "full"), losses(tmp_path, "split")
    assert sorted(full) == sorted(split) == list(range(1, 7))
    assert full == split


def test_checkpoint_layout_and_safe_loading(corpus, tmp_path):
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path, "--save", str(save), "--save-interval", "2", iters=4) == 0
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    for it in (2, 4):
        path = save / f"iter_{it:07d}" / "mp_rank_00" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=True)
        assert state["iteration"] == it
        assert state["args"]["hidden_size"] == 32
        emb = state["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]
        assert emb.shape == (512, 32)  # 512 tokens already a multiple of 128
        assert "layers.0.attention.query_key_value.weight" in \
            state["model"]["language_model"]["transformer"]
        assert {"optimizer", "lr_scheduler", "torch_rng_state"} <= set(state)
    assert not [p for p in save.rglob("*.tmp*")]


def test_no_save_optim_and_finetune(corpus, tmp_path):
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path, "--save", str(save), "--no-save-optim", "--no-save-rng",
               iters=2) == 0
    state = torch.load(save / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=True)
    assert "optimizer" not in state and "torch_rng_state" not in state
    # Resuming needs optimizer state; --finetune takes the weights and starts at iteration 0.
    assert run(corpus, tmp_path, "--load", str(save), iters=4, log_dir="r1") == 2
    assert run(corpus, tmp_path, "--load", str(save), "--finetune", iters=3, log_dir="ft") == 0
    assert sorted(losses(tmp_path, "ft")) == [1, 2, 3]


def test_checkpoint_for_another_shape_lists_the_differences(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path, "--save", str(save), iters=2) == 0
    argv = ["--load", str(save), "--num-layers", "3", "--hidden-size", "64"]
    assert run(corpus, tmp_path, *argv, iters=4, log_dir="r") == 2
    out, err = capsys.readouterr()
    assert "--num-layers: checkpoint 2, flags 3" in err
    assert "--hidden-size: checkpoint 32, flags 64" in err
    # the checkpoint's 4 x 32 is not taken for a 64-wide model: its own default differs too
    assert "--ffn-hidden-size: checkpoint 128, flags 256" in err
    assert "--ffn-hidden-size 128" not in out
    assert "Traceback" not in err
    assert run(corpus, tmp_path, "--load", str(save), "--layernorm-epsilon", "1e-6", iters=4,
               log_dir="eps") == 2  # the same weights would compute another function
    assert "--layernorm-epsilon: checkpoint 1e-05, flags 1e-06" in capsys.readouterr().err
    assert run(corpus, tmp_path, *argv, "--finetune", iters=4, log_dir="ft") == 2
    assert "--finetune loads the weights into the same shape: give the checkpoint's (or leave " \
           "the shape flags out: they are taken from it)" in capsys.readouterr().err
    # another tokenizer's vocabulary has no flag of its own: the checkpoint's files are named
    assert run(corpus, tmp_path, "--load", str(save), "--make-vocab-size-divisible-by", "1024",
               iters=4, log_dir="vocab") == 2
    err = capsys.readouterr().err
    assert "the vocabulary padded to a multiple of --make-vocab-size-divisible-by: checkpoint " \
           f"512, this run's tokenizer 1024 (the checkpoint's tokenizer: --vocab-file " \
           f"{corpus['vocab']}, --merge-file {corpus['merges']})" in err, err


def test_gradient_accumulation_matches_one_big_batch(corpus, tmp_path):
    common = ["--attention-dropout", "0", "--hidden-dropout", "0", "--global-batch-size", "8"]
    assert run(corpus, tmp_path, *common, "--batch-size", "8", log_dir="big") == 0
    assert run(corpus, tmp_path, *common, "--batch-size", "2", log_dir="accum") == 0
    big, accum = losses(tmp_path, "big"), losses(tmp_path, "accum")
    for it in big:
        assert big[it][0] == pytest.approx(accum[it][0], rel=1e-5)


def test_loss_falls_and_outputs_are_written(corpus, tmp_path, capsys):
    tb = tmp_path / "tb"
    assert run(corpus, tmp_path, "--tensorboard-dir", str(tb), "--eval-interval", "20",
               "--eval-iters", "2", iters=40) == 0
    curve = losses(tmp_path)
    first, last = curve[1][0], curve[40][0]
    assert first > 6.0 and last < first - 1.5, (first, last)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [r for r in records if "split" in r]
    assert {r["split"] for r in evals} >= {"valid", "test"}
    keys = {"iteration", "lm_loss", "lr", "loss_scale", "grad_norm", "ms_per_iter",
            "tokens_per_s", "mfu", "skipped_iters", "consumed_samples"}
    assert keys <= set(records[0])
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))
    out = capsys.readouterr().out
    assert " iteration       40/      40 | consumed samples          160 |" in out
    assert "metrics.jsonl" in out and "tensorboard --logdir" in out


def test_train_data_loose_json_is_tokenized_on_first_use(corpus, tmp_path):
    import shutil
    json_path = tmp_path / "webtext" / "data.json"
    json_path.parent.mkdir()
    shutil.copy(corpus["json"], json_path)
    argv = TINY + ["--batch-size", "2", "--train-iters", "2", "--train-data", str(json_path),
                   "--vocab-file", corpus["vocab"], "--merge-file", corpus["merges"]]
    assert pretrain_gpt2.main(argv) == 0
    assert (tmp_path / "webtext" / "data_text_document.idx").exists()


@pytest.mark.parametrize("argv, message", [
    (["--data-path", "/nonexistent/prefix"], "preprocess_data.py"),
    (["--vocab-file", "/nonexistent/vocab.json"], "vocab.json"),
], ids=["missing-data", "missing-vocab"])
def test_bad_paths_are_clear_errors(corpus, tmp_path, capsys, argv, message):
    assert run(corpus, tmp_path, *argv, iters=3) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert "parameters on tensor-parallel rank" not in out  # found before the model is built


def test_an_empty_valid_split_and_too_many_loader_workers(corpus, tmp_path, capsys):
    assert run(corpus, tmp_path, "--split", "100,0,0", "--warmup-iters", "0", iters=1) == 0
    assert "--eval-iters 1 evaluates nothing" in capsys.readouterr().out
    assert run(corpus, tmp_path, "--num-workers", "100000", "--warmup-iters", "0", iters=1) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --num-workers 100000") and "Traceback" not in err


def test_token_ids_beyond_the_vocabulary_stop_before_training(corpus, tmp_path, capsys):
    from tests.data.fakes import write_token_dataset
    other = write_token_dataset(tmp_path / "other_tokenizer", [[5, 600, 7] * 40] * 20)
    assert run(corpus, tmp_path, "--data-path", other, iters=3) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert "holds token id 600, but the model's vocabulary has 512 entries" in err


def test_a_dataset_tokenized_by_another_tokenizer_stops_before_training(corpus, tmp_path,
                                                                        capsys):
    """Byte ids fit the 512-token vocabulary, so only the tokenization record tells."""
    from megatron.data.preprocessing import ConstantFactory, tokenize_loose_json
    from tests.data.fakes import ByteTokenizer
    outputs, _ = tokenize_loose_json(corpus["json"], str(tmp_path / "bytes"),
                                     ConstantFactory(ByteTokenizer()), append_eod=True)
    capsys.readouterr()
    assert run(corpus, tmp_path, "--data-path", outputs["text"], iters=3) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert "bytes_text_document.bin was tokenized by ByteTokenizer (vocab 257, eod 256)" in err
    assert "this run's tokenizer is GPT2BPETokenizer (vocab " in err


def test_resuming_with_another_tokenizer_of_the_same_padded_size_is_refused(corpus, tmp_path,
                                                                            capsys):
    """A second BPE of 480 tokens pads to the same 512 rows as the corpus's: only the
    tokenizer the checkpoint records tells that its embedding rows mean other tokens."""
    from megatron.data.preprocessing import ConstantFactory, tokenize_loose_json
    from megatron.tokenizer import build_tokenizer
    from megatron.tokenizer.bpe_trainer import (count_pretokens, train_byte_level_bpe,
                                                write_gpt2_files)
    texts = [f"Other words {i}: alpha beta gamma delta epsilon zeta eta theta." * 8
             for i in range(200)]
    vocab, merges = write_gpt2_files(train_byte_level_bpe(count_pretokens(texts), 480),
                                     str(tmp_path / "other_tok"))
    other = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    assert other.vocab_size <= 512
    outputs, _ = tokenize_loose_json(corpus["json"], str(tmp_path / "other"),
                                     ConstantFactory(other), append_eod=True)
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, "--save", save, iters=2) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path, "--load", save, "--data-path", outputs["text"],
               "--vocab-file", vocab, "--merge-file", merges, iters=4) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint ") and "Traceback" not in err
    assert "was trained with another tokenizer" in err
    assert "its embedding rows would stand for other tokens" in err


def test_resuming_says_what_the_optimizer_state_decides(corpus, tmp_path, capsys):
    """The loaded state keeps its own weight decay and Adam settings (as in Megatron), and
    --no-load-optim starts the optimizer and the schedule afresh: both said at start."""
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, "--save", save, iters=2) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path, "--load", save, "--weight-decay", "0.5", "--adam-eps", "1e-6",
               iters=3) == 0
    out = capsys.readouterr().out
    assert (" note: --weight-decay 0.5 (the checkpoint's: 0.01), --adam-eps 1e-06 (the "
            "checkpoint's: 1e-08): the loaded optimizer state keeps the checkpoint's values"
            in out)
    assert run(corpus, tmp_path, "--load", save, "--no-load-optim", iters=3) == 0
    out = capsys.readouterr().out
    assert " note: --no-load-optim: the optimizer state and the learning-rate schedule start " \
           "fresh, as in Megatron" in out and "weight-decay" not in out


def test_an_fp32_checkpoint_resumed_in_bf16_keeps_its_weights_as_the_masters(corpus, tmp_path):
    """The fp32 run saves no separate masters; the bf16 run's are its fp32 weights, not
    those weights rounded to bf16 (an lr of 0 keeps them as loaded until the next save)."""
    save, resumed = str(tmp_path / "fp32"), str(tmp_path / "bf16")
    assert run(corpus, tmp_path, "--save", save, iters=2) == 0
    assert run(corpus, tmp_path, "--load", save, "--save", resumed, "--bf16",
               "--override-lr-scheduler", "--lr", "0", "--min-lr", "0", iters=3) == 0
    fp32 = torch.load(os.path.join(save, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"),
                      weights_only=True)
    bf16 = torch.load(os.path.join(resumed, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"),
                      weights_only=True)
    embedding = fp32["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]
    masters = [m for group in bf16["optimizer"]["fp32_from_fp16_params"] for m in group]
    assert all(m is not None and m.dtype == torch.float32 for m in masters)
    matching = [m for m in masters if m.shape == embedding.shape]
    assert len(matching) == 1 and torch.equal(matching[0], embedding)
    assert not torch.equal(embedding.bfloat16().float(), embedding)  # rounding would show


def test_a_restarted_finetune_over_its_own_save_resumes_instead_of_starting_again(
        corpus, tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, "--save", save, iters=2, log_dir="pretrain") == 0
    capsys.readouterr()
    finetune = ["--load", save, "--save", save, "--finetune"]
    assert run(corpus, tmp_path, *finetune, iters=2, log_dir="finetune") == 0
    out = capsys.readouterr().out
    assert f" loaded the weights of {save} for --finetune: the optimizer" in out
    assert sorted(losses(tmp_path, "finetune")) == [1, 2]  # from iteration 0
    # the same command again (a requeued job): its own fine-tuned checkpoint is resumed
    assert run(corpus, tmp_path, *finetune, iters=3, log_dir="finetune") == 0
    out = capsys.readouterr().out
    assert (f" note: --finetune with --load = --save: {save} holds this fine-tuning's own "
            "checkpoint (iteration 2), so the run resumes it") in out
    assert f" loaded checkpoint from {save} at iteration 2" in out
    assert sorted(losses(tmp_path, "finetune")) == [1, 2, 3]


def test_resuming_with_another_sample_order_says_so(corpus, tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, "--save", save, iters=2) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path, "--load", save, iters=3) == 0  # unchanged: no note
    assert "count of consumed samples" not in capsys.readouterr().out
    assert run(corpus, tmp_path, "--load", save, "--split", "50,50,0", "--seed", "7",
               iters=4) == 0
    out = capsys.readouterr().out
    assert (" note: --split 50,50,0 (the checkpoint's: 90,9,1), --seed 7 (the checkpoint's: "
            "1234): training continues at the checkpoint's count of consumed samples, in "
            "another order of samples") in out
    assert "validation and test may now hold documents the model trained on" in out


def test_resuming_over_more_epochs_says_the_order_changes(corpus, tmp_path, capsys):
    from megatron.data.index_maps import num_epochs_needed, sample_counts_spanning
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.data.splits import split_document_ranges
    sizes = MMapIndexedDataset(corpus["prefix"]).sizes
    first, end = split_document_ranges("10,89,1", len(sizes))[:2]
    tokens_per_epoch = int(sizes[first:end].sum())
    most = sample_counts_spanning(1, tokens_per_epoch, 32)[1]
    assert 2 * 4 <= most < 40 * 4  # 2 iterations fit in one epoch, 40 need more
    epochs = num_epochs_needed(tokens_per_epoch, 32, 40 * 4)
    save = str(tmp_path / "ckpt")
    small_train_split = ["--split", "10,89,1", "--save", save]
    assert run(corpus, tmp_path, *small_train_split, iters=2) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path, *small_train_split, "--load", save, "--exit-interval", "3",
               iters=40) == 0
    out = capsys.readouterr().out
    assert (f" note: the train split's samples now span {epochs} epoch(s) of its documents "
            "(the checkpoint's run: 1), and the samples of all epochs are shuffled together, "
            "as in Megatron: training continues at the checkpoint's count of consumed samples "
            "in another order") in out
    assert (f"; --train-iters 3 to {most // 4} at global batch size 4 would keep the "
            "checkpoint's order") in out
    # the checkpoint saved at iteration 3 records the new count: resuming it says nothing
    assert run(corpus, tmp_path, *small_train_split, "--load", save, "--exit-interval", "4",
               iters=40) == 0
    assert "epoch(s) of its documents" not in capsys.readouterr().out


def test_a_tiled_bf16_run_resumes(corpus, tmp_path):
    """Tiled parameters have other names than the untiled weights a checkpoint holds."""
    save = str(tmp_path / "ckpt")
    tiled = ["--bf16", "--memory-centric-tiled-linear", "--tile-factor", "2"]
    assert run(corpus, tmp_path, *tiled, "--save", save, iters=2) == 0
    assert run(corpus, tmp_path, *tiled, "--load", save, iters=3) == 0
    assert sorted(losses(tmp_path)) == [1, 2, 3]


def test_a_run_with_nothing_to_train_leaves_its_own_checkpoint_as_it_was(corpus, tmp_path,
                                                                         capsys):
    """--train-iters below the checkpoint's iteration over --load = --save: nothing is
    trained, and nothing is saved over the checkpoint (it would record this run's schedule,
    decaying over 2 iterations, and a later resume would train at the minimum rate)."""
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path, "--save", save, "--load", save, "--exit-interval", 3) == 0
    saved = (save / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt").read_bytes()
    capsys.readouterr()
    assert run(corpus, tmp_path, "--save", save, "--load", save, iters=2) == 0
    assert " nothing to train: the checkpoint is at iteration 3 and --train-iters is 2" in \
        capsys.readouterr().out
    assert (save / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt").read_bytes() == saved
    assert run(corpus, tmp_path, "--save", save, "--load", save, log_dir="full") == 0
    assert run(corpus, tmp_path, log_dir="straight") == 0
    assert losses(tmp_path, "full") == {i: losses(tmp_path, "straight")[i] for i in (4, 5, 6)}


def test_a_finished_run_continues_with_more_train_iters(corpus, tmp_path, capsys):
    """The README's 'raise TRAIN_ITERS to continue': the decay --train-iters implied follows
    the new length (said once; --warmup-iters 2 was given, so warmup stays), and training
    goes on from the checkpoint."""
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, "--save", save, "--load", save, iters=4) == 0
    capsys.readouterr()
    assert run(corpus, tmp_path, "--save", save, "--load", save, iters=8) == 0
    out = capsys.readouterr().out
    assert out.count("the schedule follows the new length (decay steps 4 -> 8; resuming at "
                     "step 4)") == 1
    assert sorted(losses(tmp_path)) == list(range(1, 9))
    # an explicit length that disagrees is still refused
    assert run(corpus, tmp_path, "--save", save, "--load", save, "--lr-decay-iters", "20",
               iters=12) == 2
    assert "--lr-decay-iters = 8 but the command line gives 20" in capsys.readouterr().err


def test_metrics_hold_each_iteration_once_across_reruns_and_resumes(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    assert run(corpus, tmp_path, "--save", save, "--load", save, iters=4) == 0
    assert run(corpus, tmp_path, "--save", save, "--load", save, iters=4) == 0  # finished
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:  # a run killed past its save
        f.write(json.dumps({"iteration": 5, "lm_loss": 1.0}) + "\n" + '{"iteration": 6, "lm_')
    assert run(corpus, tmp_path, "--save", save, "--load", save, iters=6) == 0
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    train = [r["iteration"] for r in records if "lm_loss" in r]
    evals = [(r["iteration"], r["split"]) for r in records if "split" in r]
    assert train == [1, 2, 3, 4, 5, 6] and records[4]["lm_loss"] != 1.0
    assert len(evals) == len(set(evals)) and (6, "valid") in evals


def test_timing_log_level_prints_the_time_per_phase(corpus, tmp_path, capsys):
    """--timing-log-level 1: under each log line Megatron's timers line (ms per iteration over
    the interval; by default the minimum and maximum over ranks, the same with one process),
    the same numbers in metrics.jsonl and, with --log-timers-to-tensorboard, TensorBoard; the
    losses are the untimed run's."""
    assert run(corpus, tmp_path, "--log-interval", "2", iters=4, log_dir="plain") == 0
    tb = tmp_path / "tb"
    assert run(corpus, tmp_path, "--log-interval", "2", "--timing-log-level", "1",
               "--log-timers-to-tensorboard", "--tensorboard-dir", str(tb), "--eval-interval",
               "2", "--eval-iters", "20", iters=4, log_dir="timed") == 0
    assert losses(tmp_path, "timed") == losses(tmp_path, "plain")
    lines = capsys.readouterr().out.splitlines()
    timers = [i for i, line in enumerate(lines)
              if line.startswith(" (min, max) time across ranks (ms) | ")]
    assert len(timers) == 2 and all(lines[i - 1].startswith(" iteration ") for i in timers)
    phases = [part.split(":")[0] for part in lines[timers[0]].split(" | ")[1:]]
    assert phases == ["forward", "backward", "optimizer", "batch generator"]
    records = [json.loads(line) for line in open(tmp_path / "timed" / "metrics.jsonl")]
    timed = [r["phase_ms"] for r in records if "phase_ms" in r]
    assert len(timed) == 2 and all(ms > 0 for ms in timed[0].values())
    assert [r["phase_ms_min"] for r in records if "phase_ms" in r] == timed  # one rank
    # 20 evaluation forwards ran in the second interval (--eval-interval 2), 10x its
    # training's 2: they are not counted
    assert timed[1]["forward"] < 3 * timed[0]["forward"]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tb))
    events.Reload()
    assert {"forward-time", "backward-time", "optimizer-time", "batch-generator-time"} <= \
        set(events.Tags()["scalars"])


def _timers_output(lines, option):
    """{phase: [the numbers shown]} of each timers line in `lines` (rank 0's output)."""
    if option == "all":
        heads = [i for i, line in enumerate(lines) if line == " times across ranks (ms):"]
        return [{phase: [float(part.split(": ")[1]) for part in parts]
                 for phase, *parts in (line.strip().split(" | ") for line in lines[i + 1:i + 5])}
                for i in heads]
    header = {"max": " max time across ranks (ms)",
              "minmax": " (min, max) time across ranks (ms)"}[option]
    return [{phase: [float(n) for n in value.strip("()").split(", ")]
             for phase, value in (part.split(": ") for part in line.split(" | ")[1:])}
            for line in lines if line.split(" | ")[0] == header]


@pytest.mark.parametrize("option", ["max", "minmax", "all"])
def test_timing_log_option_shows_the_phase_times_over_ranks(corpus, tmp_path, option):
    """Two gloo ranks (data parallel): rank 0's timers line has the maximum over both ranks
    (max), the minimum and maximum (minmax) or each rank's time (all), as in metrics.jsonl,
    whose phase_ms is the maximum whatever the option; the other rank prints none."""
    from tests.parallel.launching import launch_ranks, trainer_argv
    argv = trainer_argv(corpus, tmp_path / "log", 2, "--batch-size", 2, "--timing-log-level",
                        1, "--timing-log-option", option)
    (code0, out0), (code1, out1) = launch_ranks(argv, 2, tmp_path / "out")
    assert code0 == code1 == 0, out0[-3000:] + out1[-3000:]
    shown = _timers_output(out0.splitlines(), option)
    assert len(shown) == 2 and "across ranks" not in out1
    records = [json.loads(line) for line in open(tmp_path / "log" / "metrics.jsonl")]
    records = [r for r in records if "phase_ms" in r]
    phases = ["forward", "backward", "optimizer", "batch generator"]
    for numbers, record in zip(shown, records, strict=True):
        assert list(numbers) == list(record["phase_ms"]) == phases
        expected = {"max": lambda p: [record["phase_ms"][p]],
                    "minmax": lambda p: [record["phase_ms_min"][p], record["phase_ms"][p]],
                    "all": lambda p: record["phase_ms_by_rank"][p]}[option]
        assert numbers == {p: [round(ms, 2) for ms in expected(p)] for p in phases}
        if option == "all":
            assert all(max(record["phase_ms_by_rank"][p]) == record["phase_ms"][p]
                       and len(record["phase_ms_by_rank"][p]) == 2 for p in phases)
        if option == "minmax":  # two processes' clocks: never all the same
            assert record["phase_ms_min"] != record["phase_ms"]
            assert all(record["phase_ms_min"][p] <= record["phase_ms"][p] for p in phases)
