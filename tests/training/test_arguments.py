"""Flag validation: every inconsistency is a ConfigError that shows the arithmetic."""

import pytest

from megatron.arguments import parse_args
from megatron.errors import ConfigError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--batch-size", "4", "--train-iters", "10", "--lr", "1e-3",
        "--data-path", "x", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v",
        "--merge-file", "m"]


def parse(*extra, world_size=1):
    return parse_args(BASE + list(extra), world_size=world_size)


def test_defaults_and_derived_values():
    args = parse()
    assert args.max_position_embeddings == 32
    assert args.global_batch_size == 4 and args.num_micro_batches == 1
    assert args.lr_decay_iters == 10 and args.warmup_iters == 0
    assert args.params_dtype == "float32"
    args = parse("--global-batch-size", "16", "--model-parallel-size", "2", world_size=4)
    assert args.data_parallel_size == 2 and args.num_micro_batches == 2
    assert parse("--bf16").params_dtype == "bfloat16"
    assert parse("--warmup-iters", "3").warmup_iters == 3


def test_named_model_size_fills_unset_flags():
    argv = BASE[6:]  # without --num-layers/--hidden-size/--num-attention-heads
    args = parse_args(argv + ["--model-size", "gpt2-124m", "--num-layers", "3"], world_size=1)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (3, 768, 12)


@pytest.mark.parametrize("extra, world_size, message", [
    (["--num-attention-heads", "5"], 1, "--hidden-size 64 is not divisible by --num-attention-heads 5"),
    (["--max-position-embeddings", "16"], 1, "--seq-length 32 is longer than --max-position-embeddings 16"),
    (["--global-batch-size", "10"], 2, "--global-batch-size 10 is not divisible by --batch-size 4 x data-parallel size 2 = 8"),
    (["--model-parallel-size", "3"], 4, "world size 4 is not divisible by --model-parallel-size 3"),
    (["--model-parallel-size", "8", "--num-attention-heads", "4"], 8, "--num-attention-heads 4 is not divisible by --model-parallel-size 8"),
    (["--min-lr", "1"], 1, "--min-lr 1.0 is larger than --lr"),
    (["--fp16", "--bf16"], 1, "mutually exclusive"),
    (["--train-data", "webtext"], 1, "exactly one of --data-path"),
    (["--checkpoint-activations", "--checkpoint-num-layers", "3"], 1, "does not divide --num-layers 2"),
    (["--model-size", "gpt2-huge"], 1, "is not known"),
    (["--tokenizer-type", "SentencePieceTokenizer"], 1, "needs --tokenizer-model"),
])
def test_inconsistent_flags(extra, world_size, message):
    with pytest.raises(ConfigError, match=None) as info:
        parse(*extra, world_size=world_size)
    assert message in str(info.value)


def test_missing_required_flag():
    argv = [a for a in BASE if a not in ("--lr", "1e-3")]
    assert len(argv) == len(BASE) - 2
    with pytest.raises(ConfigError, match="--lr is required"):
        parse_args(argv, world_size=1)


def test_unknown_flag_is_rejected_not_ignored():
    with pytest.raises(SystemExit):
        parse("--no-such-flag")
