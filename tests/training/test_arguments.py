"""Resolving the flags: defaults derived once, and every inconsistency a ConfigError that shows
the arithmetic."""

import dataclasses
import json
import re

import pytest

from megatron.config import resolve_config
from megatron.errors import ConfigError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--batch-size", "4", "--train-iters", "10", "--lr", "1e-3",
        "--data-path", "x", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v",
        "--merge-file", "m"]


def parse(*extra, world_size=1):
    return resolve_config(BASE + list(extra), world_size=world_size)


def test_defaults_and_derived_values():
    config = parse()
    assert config.model.max_position_embeddings == 32 and config.model.ffn_hidden_size == 256
    assert config.training.global_batch_size == 4 and config.training.num_micro_batches == 1
    assert config.optimizer.lr_decay_steps == 10 and config.optimizer.warmup_steps == 0.1  # 0.01 x 10
    assert config.optimizer.clip_grad == 1.0 and config.model.tile_factor == 1
    assert config.precision.params_dtype == "float32"
    assert config.checkpoint.save_interval is None and config.logging.log_dir is None
    config = parse("--global-batch-size", "16", "--model-parallel-size", "2", world_size=4)
    assert config.parallel.data_parallel_size == 2 and config.training.num_micro_batches == 2
    assert parse("--bf16").precision.params_dtype == "bfloat16"
    assert parse("--warmup-iters", "3").optimizer.warmup_steps == 3
    # a fraction's warmup is Megatron's product, fractional or whole (train iters 10)
    assert parse("--warmup", "0.15").optimizer.warmup_steps == 1.5
    assert type(parse("--warmup", "0.2").optimizer.warmup_steps) is int
    assert parse("--warmup", "0.07", "--train-iters", "100").optimizer.warmup_steps == 7  # not
    # 7.000000000000001
    config = parse("--save", "ckpt", "--tensorboard-dir", "tb")
    assert config.checkpoint.save_interval == 10 and config.logging.log_dir == "tb"


def test_the_config_is_frozen_and_records_the_flags():
    config = parse("--fp16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.num_layers = 4
    flat = config.as_flat_dict()
    assert flat["num_layers"] == 2 and flat["model_parallel_size"] == 1
    assert flat["params_dtype"] == "float16" and flat["tokenizer_type"] == "GPT2BPETokenizer"


def test_megatron_flags_become_the_stage_0_engine_config():
    """Without --deepspeed the zero engine runs at stage 0 with what the flags say."""
    ds = parse("--fp16", "--loss-scale-window", "50", "--hysteresis", "3",
               "--initial-loss-scale", "1024", "--global-batch-size", "8", "--clip-grad", "0.5",
               "--ddp-bucket-size", "2", "--fp32-allreduce").engine.ds_config
    assert ds.zero_optimization.stage == 0 and ds.zero_optimization.overlap_comm
    assert ds.zero_optimization.reduce_bucket_size == 2 * 2 ** 20 // 4  # fp32 elements
    assert (ds.fp16.enabled, ds.fp16.initial_scale_power, ds.fp16.loss_scale_window,
            ds.fp16.hysteresis, ds.fp16.loss_scale) == (True, 10, 50, 3, 0.0)
    assert ds.gradient_clipping == 0.5 and ds.communication_data_type == "fp32"
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (4, 2)
    # bf16 gradients are summed and all-reduced in fp32 (as in Megatron-LM), fp16 ones in fp16
    assert parse("--bf16").engine.ds_config.zero_optimization.reduce_bucket_size == \
        25 * 2 ** 20 // 4
    assert parse("--fp16").engine.ds_config.zero_optimization.reduce_bucket_size == \
        25 * 2 ** 20 // 2
    fp32_sums = parse("--fp16", "--accumulate-allreduce-grads-in-fp32").engine.ds_config
    assert fp32_sums.data_types.grad_accum_dtype == "fp32"
    assert fp32_sums.zero_optimization.reduce_bucket_size == 25 * 2 ** 20 // 4
    with pytest.raises(ConfigError, match="^--accumulate-allreduce-grads-in-fp32 needs "
                                          "--DDP-impl local"):
        parse("--bf16", "--accumulate-allreduce-grads-in-fp32", "--DDP-impl", "torch")


def test_named_model_size_fills_unset_flags():
    argv = BASE[6:]  # without --num-layers/--hidden-size/--num-attention-heads
    config = resolve_config(argv + ["--model-size", "gpt2-124m", "--num-layers", "3"],
                            world_size=1)
    assert (config.model.num_layers, config.model.hidden_size,
            config.model.num_attention_heads) == (3, 768, 12)


@pytest.mark.parametrize("extra, world_size, message", [
    (["--num-attention-heads", "5"], 1, "--num-attention-heads 5 must divide --hidden-size 64 (64 % 5 = 4)"),
    (["--max-position-embeddings", "16"], 1, "--seq-length 32 is longer than --max-position-embeddings 16"),
    (["--global-batch-size", "10"], 2, "--global-batch-size 10 is not divisible by --batch-size 4 x data-parallel size 2 = 8"),
    (["--model-parallel-size", "3"], 4, "world size 4 is not divisible by --model-parallel-size 3"),
    (["--model-parallel-size", "8", "--num-attention-heads", "4"], 8, "--model-parallel-size 8 must divide --num-attention-heads 4"),
    (["--lr", "nan"], 1, "--lr must be non-negative, got nan"),
    (["--adam-beta2", "1.0"], 1, "--adam-beta2 must be in [0, 1), got 1.0"),
    (["--hidden-dropout", "1.5"], 1, "--hidden-dropout must be in [0, 1), got 1.5"),
    (["--warmup", "2"], 1, "--warmup must be a fraction in [0, 1], got 2.0"),
    (["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes must be positive"),
    (["--eval-iters", "-1"], 1, "--eval-iters must be >= 0, got -1"),
    (["--tile-factor", "2"], 1, "--tile-factor 2 has no effect without --memory-centric-tiled-linear"),
    (["--memory-centric-tiled-linear", "--tile-factor", "3"], 1, "--tile-factor 3 does not divide the layers"),
    (["--keep-last-n-checkpoints", "2"], 1, "--keep-last-n-checkpoints needs --save"),
    (["--save-interval", "5"], 1, "--save-interval 5 needs --save (the directory checkpoints go to)"),
    (["--initial-loss-scale", "1000", "--fp16"], 1, "--initial-loss-scale 1000 must be a power of 2"),
    (["--loss-scale", "-1", "--fp16"], 1, "--loss-scale must be positive"),
    (["--fp16", "--initial-loss-scale", "1024", "--min-scale", "4096"], 1,
     "--initial-loss-scale 1024 is below --min-scale 4096"),
    (["--fp16", "--min-scale", "0"], 1, "--min-scale must be positive, got 0.0"),
    (["--fp16", "--hysteresis", "0"], 1, "--hysteresis must be at least 1, got 0"),
    (["--bf16", "--loss-scale", "128"], 1, "--loss-scale only act(s) with --fp16 (loss "
                                           "scaling); add --fp16 or drop them"),
    (["--initial-loss-scale", "1000", "--hysteresis", "0"], 1,
     "--initial-loss-scale, --hysteresis only act(s) with --fp16"),
    (["--fp16", "--loss-scale", "128", "--initial-loss-scale", "1024", "--loss-scale-window",
      "5"], 1, "--loss-scale 128 is a static scale, so --initial-loss-scale, "
               "--loss-scale-window (dynamic scaling) would not act"),
    (["--ddp-bucket-size", "0"], 1, "--ddp-bucket-size must be a positive number of megabytes"),
    (["--zero-stage", "1"], 1, "--zero-stage only act(s) with --deepspeed"),
    (["--min-lr", "1"], 1, "--min-lr 1.0 is larger than --lr"),
    (["--fp16", "--bf16"], 1, "mutually exclusive"),
    (["--train-data", "webtext"], 1, "exactly one of --data-path"),
    (["--checkpoint-activations", "--checkpoint-num-layers", "3"], 1, "does not divide --num-layers 2"),
    (["--model-size", "gpt2-huge"], 1, "is not known"),
    (["--tokenizer-type", "SentencePieceTokenizer"], 1, "needs --tokenizer-model"),
])
def test_inconsistent_flags(extra, world_size, message):
    with pytest.raises(ConfigError) as info:
        parse(*extra, world_size=world_size)
    assert message in str(info.value)


def test_missing_required_flag():
    argv = [a for a in BASE if a not in ("--lr", "1e-3")]
    assert len(argv) == len(BASE) - 2
    with pytest.raises(ConfigError, match="--lr is required"):
        resolve_config(argv, world_size=1)


@pytest.mark.parametrize("split, message", [
    ("-1,50,1", "--split '-1,50,1' needs non-negative weights"),
    ("1,2,3,4", "--split '1,2,3,4' has 4 entries"),
    ("90,x,1", "--split '90,x,1' is not a list of numbers"),
    ("1e308,1e308", "--split '1e308,1e308' needs non-negative weights with a positive sum"),
])
def test_a_bad_split_is_refused_with_the_flags(split, message):
    """Before any data or model is built (it used to be found after both); a value starting
    with a dash is the --split check's error, not argparse's "expected one argument"."""
    from megatron.errors import DataError
    with pytest.raises(DataError) as info:
        parse("--split", split)
    assert str(info.value).startswith(message)
    assert parse("--split", "98/2").data.split == "98/2"


def test_megatron_flags_not_taken_are_one_error_that_says_what_to_do_instead():
    with pytest.raises(ConfigError) as info:
        parse("--apply-query-key-layer-scaling", "--num-unique-layers=2")
    message = str(info.value)
    assert message.startswith("Megatron-LM flags not taken here (drop them): ")
    assert "--num-unique-layers: sharing weights between layers is not built" in message
    assert "--apply-query-key-layer-scaling: an fp16 guard" in message
    with pytest.raises(ConfigError, match=r"flag not taken here \(drop it\): --bias-gelu-fusion: "
                                          r".*--compile fuses"):
        parse("--bias-gelu-fusion")


def test_later_megatron_lm_names_are_aliases():
    """Megatron-LM 2.x renamed four flags this trainer takes: the new names set the same
    values; --kv-channels is taken when it is the one head size built (its sample-based
    lengths: test_lengths_in_samples_and_tokens_are_iterations; its batch-size ramp:
    tests/training/test_batch_rampup.py)."""
    argv = [a for i, a in enumerate(BASE) if "--batch-size" not in BASE[max(i - 1, 0):i + 1]]
    old = resolve_config(argv + ["--batch-size", "2", "--model-parallel-size", "2",
                                 "--warmup-iters", "3"], world_size=4)
    new = resolve_config(argv + ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
                                 "--lr-warmup-iters", "3"], world_size=4)
    assert dataclasses.replace(new, engine=None) == dataclasses.replace(old, engine=None)
    assert repr(new.engine) == repr(old.engine)  # the parsed DeepSpeed config compares by id
    assert parse("--lr-warmup-fraction", "0.5").optimizer.warmup_steps == \
        parse("--warmup", "0.5").optimizer.warmup_steps
    assert parse("--kv-channels", "16", "--position-embedding-type", "learned_absolute",
                 "--normalization", "LayerNorm").model == parse().model  # GPT-2's own values
    with pytest.raises(ConfigError, match="^--kv-channels 32 is not --hidden-size 64 / "
                                          "--num-attention-heads 4: each head has hidden / "
                                          "heads channels here"):
        parse("--kv-channels", "32")
    with pytest.raises(ConfigError, match="^argument --position-embedding-type: rope: rope and "
                                          "alibi positions are not built"):
        parse("--position-embedding-type", "rope")
    assert parse("--log-num-zeros-in-grad").logging.num_zeros_in_grad
    assert parse("--log-validation-ppl-to-tensorboard").notes == (
        " note: --log-validation-ppl-to-tensorboard asks for what this trainer always does: "
        "each evaluation's perplexity always goes to TensorBoard (lm-loss-valid-ppl)",)
    argv_errors = [(argv + ["--micro-batch-size", "0"], "^--micro-batch-size must be positive"),
                   (BASE + ["--tensor-model-parallel-size", "3"],
                    r"^world size 4 is not divisible by --tensor-model-parallel-size 3")]
    for argv_with_error, message in argv_errors:  # the error names the flag as it was typed
        with pytest.raises(ConfigError, match=message):
            resolve_config(argv_with_error, world_size=4)
    with pytest.raises(ConfigError, match=r"^--warmup 0.1 and --lr-warmup-iters 3 both set the "
                                          r"warmup \(as a fraction"):
        parse("--warmup", "0.1", "--lr-warmup-iters", "3")


def test_megatron_core_command_lines_get_one_answer_for_all_their_flags():
    """Later Megatron-LM's flags: renamed ones are aliases, those asking for what is always
    done are taken with a note, the rest are named together in one error with what to do."""
    renamed = parse("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler",
                    "--min-loss-scale", "2", "--norm-epsilon", "1e-6", "--fp16")
    plain = parse("--override-lr-scheduler", "--use-checkpoint-lr-scheduler", "--min-scale",
                  "2", "--layernorm-epsilon", "1e-6", "--fp16")
    assert (renamed.optimizer, renamed.model) == (plain.optimizer, plain.model)
    assert renamed.engine.ds_config.fp16.min_loss_scale == 2.0
    notes = parse("--use-flash-attn", "--overlap-grad-reduce", "--no-masked-softmax-fusion",
                  "--attention-softmax-in-fp32", "--log-throughput").notes
    assert [note.split(" asks")[0] for note in notes] == [
        " note: --attention-softmax-in-fp32", " note: --use-flash-attn",
        " note: --overlap-grad-reduce", " note: --log-throughput",
        " note: --no-masked-softmax-fusion"]
    with pytest.raises(ConfigError) as error:
        parse("--swiglu", "--use-rotary-position-embeddings", "--sequence-parallel",
              "--use-distributed-optimizer",
              "--recompute-granularity", "full", "--fp8-format", "hybrid",
              "--wandb-project", "x")
    message = str(error.value)
    assert message.startswith("Megatron-LM flags not taken here (drop them): ")
    for piece in ("--swiglu, --use-rotary-position-embeddings: a later Megatron-LM model "
                  "option", "--sequence-parallel: "
                  "Megatron's sequence parallelism is not built", "--use-distributed-optimizer"
                  ": Megatron's distributed optimizer is ZeRO stage 1 here",
                  "--recompute-granularity: full-layer recompute is --checkpoint-activations "
                  "--checkpoint-num-layers N", "--fp8-format: fp8 training",
                  "--wandb-project: Weights & Biases"):
        assert piece in message, piece


def test_megatron_deepspeed_command_lines_get_one_answer_for_all_their_flags(tmp_path):
    """Megatron-DeepSpeed's own flags (its example scripts): those asking for what is always
    done here (no pipeline engine at size 1, a dense model, flash attention, fused Adam) are
    taken with a note, MoE and sequence-parallel sizes at 1 too; the rest are named together
    in one error, each reason once."""
    config = parse("--no-pipeline-parallel", "--num-experts", "1", "--moe-loss-coeff", "0.1",
                   "--mlp-type", "standard", "--create-moe-param-group",
                   "--ds-sequence-parallel-size", "1", "--use-flash-attn-v2", "--ds_fused_adam",
                   "--repeated-dataloader", "--disable-mem-efficient-ln",
                   "--normalization", "layernorm", "--universal-checkpoint")
    assert config.model == parse().model
    noted = [note.split(" asks")[0].split(" has no")[0] for note in config.notes]
    assert noted == [f" note: {flag}" for flag in (
        "--no-pipeline-parallel", "--use-flash-attn-v2", "--disable-mem-efficient-ln",
        "--ds_fused_adam", "--repeated-dataloader", "--universal-checkpoint",
        "--create-moe-param-group", "--num-experts", "--ds-sequence-parallel-size",
        "--moe-loss-coeff 0.1", "--mlp-type standard")]
    for argv, message in (
            (["--num-experts", "8"], "--num-experts: 8: Megatron-DeepSpeed's mixture of experts"),
            (["--ds-sequence-parallel-size", "4"], "4: DeepSpeed-Ulysses sequence parallelism "
                                                   "is not built"),
            (["--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"],
             "--no-pipeline-parallel asks for no pipeline, but --pipeline-model-parallel-size "
             "is 2: drop one of them"),
            (["--distributed-backend", "hccl"], "hccl (Habana, Megatron-DeepSpeed's) is not "
                                                "built: nccl on CUDA, gloo on a CPU"),
            (["--DDP-impl", "FSDP"], "torch FSDP is not built: ZeRO stage 3"),
            (["--tokenizer-type", "HFTokenizer"], "Hugging Face tokenizers are not loaded"),
            (["--kd", "--kd-temp", "2", "--random-ltd", "--enable-zbh1-pipeline"],
             "Megatron-LM flags not taken here (drop them): --enable-zbh1-pipeline: the "
             "zero-bubble (ZB-H1) pipeline schedule is not built"),
            (["--kd", "--kd-temp", "2"], "--kd, --kd-temp: knowledge distillation (a teacher "
                                         "model in the loss) is not built")):
        with pytest.raises(ConfigError) as error:
            parse(*argv, world_size=2)
        assert message in str(error.value), (argv, str(error.value))
    (tmp_path / "latest").write_text("global_step200")
    (tmp_path / "latest_universal").write_text("global_step100_universal")
    with pytest.raises(ConfigError, match="latest_universal names a folder converted by "
                                          "DeepSpeed's ds_to_universal.py, which is not read"):
        parse("--universal-checkpoint", "--load", str(tmp_path))


def _without_train_iters():
    return [a for i, a in enumerate(BASE) if "--train-iters" not in BASE[max(i - 1, 0):i + 1]]


def test_lengths_in_samples_and_tokens_are_iterations(tmp_path):
    """Later Megatron-LM's sample lengths and Megatron-DeepSpeed's token lengths: the same run
    and schedule as the iterations they stand for, said in one note; a length given twice (in
    two units) is an error."""
    def resolve(*extra):
        return resolve_config(_without_train_iters() + ["--global-batch-size", "8",
                                                        *extra], world_size=2)
    in_iterations = resolve("--train-iters", "125", "--lr-decay-iters", "100",
                            "--warmup-iters", "12")
    seq = in_iterations.data.seq_length
    for extra in (["--train-samples", "1000", "--lr-decay-samples", "800",
                   "--lr-warmup-samples", "96"],
                  ["--train-iters", "125", "--train-tokens", str(1000 * seq),
                   "--lr-decay-tokens", str(800 * seq), "--lr-warmup-tokens", str(96 * seq)]):
        config = resolve(*extra)
        assert (config.training, config.optimizer) == \
            (in_iterations.training, in_iterations.optimizer)
    notes = [n for n in resolve("--train-samples", "1000", "--lr-warmup-samples", "100").notes
             if "an iteration" in n]
    assert notes == [" note: at 8 samples of 32 tokens an iteration: --train-samples 1000 is "
                     "--train-iters 125; --lr-warmup-samples 100 is --warmup-iters 13 (12.50, "
                     "rounded)"]
    fewer = resolve("--train-iters", "10", "--train-tokens", str(10 ** 12))  # 300B-style
    assert fewer.training.train_iters == 10
    assert resolve("--train-tokens", str(20 * seq)).training.train_iters == 3  # 2.5 -> 3
    for extra, message in (
            (["--train-iters", "10", "--train-samples", "80"], "--train-samples and "
                                                               "--train-iters both set"),
            (["--train-samples", "80", "--warmup", "0.1", "--lr-warmup-samples", "8"],
             "--lr-warmup-samples and --warmup/--warmup-iters both set the warmup"),
            (["--train-samples", "80", "--lr-decay-samples", "80", "--lr-decay-tokens", "9"],
             "--lr-decay-samples and --lr-decay-tokens both set"),
            ([], "--train-iters is required (or --train-samples / --train-tokens)"),
            (["--train-samples", "0"], "--train-samples must be positive, got 0"),
            (["--train-samples", "5"], "--train-samples 5 is less than one global batch (8 "
                                       "samples): the run would train nothing"),
            (["--train-iters", "5", "--lr-warmup-samples", "200"],
             "the warmup (25 iterations, from --lr-warmup-samples 200) must lie between 0 and "
             "the decay's end (5 iterations, from --train-iters 5)"),
            (["--train-samples", "80", "--lr-decay-samples", "16", "--warmup-iters", "3"],
             "the warmup (3 iterations, from --warmup-iters 3) must lie between 0 and the "
             "decay's end (2 iterations, from --lr-decay-samples 16)")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve(*extra)
    short = resolve("--train-samples", "80", "--lr-decay-style", "WSD",
                    "--lr-wsd-decay-samples", "3")
    assert short.optimizer.lr_wsd_decay_steps == 1
    assert "--lr-wsd-decay-samples 3 is --lr-wsd-decay-iters 1 (0.38, raised to 1: the " \
           "shortest a length can be)" in short.notes[-1]
    # --deepspeed: the global batch is the JSON's
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}))
    config = resolve_config(_without_train_iters() + ["--deepspeed", "--deepspeed_config",
                                                      str(ds_json), "--train-samples", "160"],
                            world_size=2)
    assert config.training.train_iters == 10


@pytest.mark.parametrize("flag", ["--lr", "--min-lr", "--weight-decay", "--init-method-std"])
def test_a_negative_value_with_an_exponent_reaches_the_flags_own_check(flag):
    """argparse reads `-1e-3` as a flag ("expected one argument"); it is the flag's value."""
    with pytest.raises(ConfigError, match=f"^{flag} must be .*, got -0.001$"):
        parse(flag, "-1e-3")


def test_a_decay_that_ends_before_training_says_the_rest_runs_at_min_lr():
    notes = parse("--lr-decay-style", "constant", "--lr-decay-iters", "4",
                  "--warmup-iters", "0").notes
    assert notes == (" note: --lr-decay-iters 4 ends the constant schedule before --train-iters "
                     "10: iterations 5-10 run at --min-lr 0 (Megatron's rule, for every "
                     "--lr-decay-style); leave --lr-decay-iters out to schedule over the whole "
                     "run",)
    assert parse("--lr-decay-iters", "10").notes == ()


def test_a_flag_given_twice_with_different_values_keeps_the_last_and_says_so():
    """Launch scripts let the user override their flags by appending them (argparse keeps
    the last); a note makes a forgotten duplicate visible."""
    parsed = parse("--lr", "5e-4", "--train-iters=20", "--micro-batch-size", "2", "--fp16",
                   "--fp16", "--seed", "1234")
    assert parsed.optimizer.lr == 5e-4 and parsed.training.train_iters == 20
    assert parsed.notes == (" note: --batch-size 4, then --micro-batch-size 2: the last one is "
                            "used",
                            " note: --train-iters 10, then --train-iters 20: the last one is used",
                            " note: --lr 1e-3, then --lr 5e-4: the last one is used")

    def tags(parser):  # a script's own flag that collects every value
        parser.add_argument("--tag", action="append")
        return parser
    parsed = resolve_config(BASE + ["--tag", "a", "--tag", "b"], world_size=1,
                            extra_args_provider=tags)
    assert parsed.extra["tag"] == ["a", "b"] and parsed.notes == ()


def test_megatron_flags_for_what_is_always_so_are_taken_and_said():
    from megatron.config.flags import build_parser
    from megatron.config.megatron_flags import ALWAYS_SO, NOT_TAKEN
    known = {s for action in build_parser()._actions for s in action.option_strings}
    assert not known & set(NOT_TAKEN) and set(ALWAYS_SO) <= known
    assert parse().notes == ()
    notes = parse("--openai-gelu", "--use-cpu-initialization").notes
    assert notes == (" note: --openai-gelu asks for what this trainer always does: the MLP's "
                     "GeLU is always GPT-2's tanh form",
                     " note: --use-cpu-initialization asks for what this trainer always does: weights "
                     "are always initialised on the CPU from the seeded generator, as for the "
                     "whole tensor, each rank keeping its part")


def test_the_deepspeed_tutorials_megatron_command_line_is_taken_or_answered():
    """DeepSpeed's GPT-2 tutorial ran an earlier Megatron-LM: its data flags either ask for
    what this trainer always does (a note each) or are one error that says what to do."""
    notes = parse("--resume-dataloader", "--lazy-loader", "--loose-json", "--shuffle").notes
    assert [note[:note.index(" does") + 5] for note in notes] == [
        f" note: {flag} asks for what this trainer always does"
        for flag in ("--resume-dataloader", "--lazy-loader", "--loose-json", "--shuffle")]
    with pytest.raises(ConfigError) as info:
        parse("--cache-dir", "cache", "--valid-data", "wiki.json", "--eval-batch-size=4")
    message = str(info.value)
    assert message.startswith("Megatron-LM flags not taken here (drop them): --cache-dir: the "
                              "tutorial's Megatron-LM downloaded GPT-2's tokenizer files; "
                              "nothing is downloaded here: give --tokenizer-type "
                              "GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt")
    assert "--valid-data: validation and test data are --split's shares" in message
    assert "--eval-batch-size: validation uses the training batch size" in message


def test_a_script_may_define_a_flag_megatron_has_and_this_trainer_does_not():
    def with_mask_prob(parser):
        parser.add_argument("--mask-prob", type=float, default=0.15)
        return parser
    config = resolve_config(BASE + ["--mask-prob", "0.2"], world_size=1,
                            extra_args_provider=with_mask_prob)
    assert config.extra["mask_prob"] == 0.2
    with pytest.raises(ConfigError, match="--mask-prob: a BERT flag"):
        parse("--mask-prob", "0.2")


def test_unknown_flag_is_rejected_not_ignored():
    """One error line (the usage block is --help's), naming the closest known flag."""
    with pytest.raises(ConfigError, match=r"^unrecognized arguments: --no-such-flag --fp166 "
                                          r"\(did you mean --fp16\?\) \(.* --help lists the "
                                          r"flags\)$"):
        parse("--no-such-flag", "--fp166")
    with pytest.raises(ConfigError, match=r"^argument --DDP-impl: invalid choice: 'apex'"):
        parse("--DDP-impl", "apex")
    with pytest.raises(ConfigError, match=r"^argument --tokenizer-type: "
                                          r"GPTSentencePieceTokenizer: a SentencePiece model is "
                                          r"--tokenizer-type SentencePieceTokenizer"):
        parse("--tokenizer-type", "GPTSentencePieceTokenizer")  # later Megatron-LM's name


@pytest.mark.parametrize("flag, value, hint", [
    ("--timing-log-level", "2", "Megatron-LM's level 2 adds finer timers (the pipeline's sends "
                                "and receives, compute per micro batch) that this trainer does "
                                "not have: give 1 (forward, backward, optimizer and batch "
                                "generator)"),
    ("--data-impl", "lazy", "older Megatron-LM's lazy and cached datasets (a TNTIDX index) are "
                            "not read: this trainer reads the mmap (MMIDIDX) format "
                            "tools/preprocess_data.py writes; give mmap or drop the flag"),
    ("--data-impl", "cached", "older Megatron-LM's lazy and cached datasets"),
    ("--optimizer", "sgd", "Megatron-LM's SGD is not built: the optimizers here are adam "
                           "(AdamW), adam8bit and adam4bit"),
])
def test_a_choice_another_megatron_offers_says_what_to_give_instead(flag, value, hint):
    """Megatron-LM's values outside this trainer's choices: one error line saying what it
    offers instead, not argparse's bare "invalid choice"; other values keep argparse's."""
    message = (f"^argument {re.escape(flag)}: {re.escape(value)}: {re.escape(hint)}.* "
               f"\\(.* --help lists the flags\\)$")
    with pytest.raises(ConfigError, match=message):
        parse(flag, value)
    with pytest.raises(ConfigError, match=message):
        parse(f"{flag}={value}")  # the same, joined


def test_other_invalid_choices_keep_argparses_line():
    with pytest.raises(ConfigError, match=r"^argument --timing-log-level: invalid choice: 3 "
                                          r"\(choose from 0, 1\)"):
        parse("--timing-log-level", "3")
    with pytest.raises(ConfigError, match=r"^argument --timing-log-level: invalid int value: "
                                          r"'x'"):
        parse("--timing-log-level", "x")
    with pytest.raises(ConfigError, match=r"^argument --lr-decay-style: invalid choice: 'cos' "
                                          r"\(choose from 'constant', 'linear', 'cosine', "
                                          r"'exponential', 'WSD', 'inverse-square-root'\)"):
        parse("--lr-decay-style", "cos")
    assert parse("--timing-log-level", "1", "--lr-decay-style", "cosine", "--data-impl",
                 "infer", "--optimizer", "adam8bit").optimizer.lr_decay_style == "cosine"
