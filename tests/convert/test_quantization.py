"""Quantised weights for inference (--quantize): round-trip bounds per row / group, torch's
kernels against the dequantised weight, a quantised model against its float model, TP=2 equal
to TP=1, the tools' flags, and the shapes the int4 kernel cannot take."""

import json

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.convert.savers import save_model_weights
from megatron.errors import ConfigError
from megatron.inference import quantization as q
from megatron.inference.loading import build_model_from_weights
from megatron.inference.text_generation import SamplingParams, TextGenerator
from tests.convert.conftest import load_tool, random_weights, tokenized_weights
from tests.dist_utils import run_distributed


def _weight(rows=96, features=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, features, generator=g) * 0.05
    w[3] *= 40  # rows and groups of very different ranges
    w[:, 5] += 1.0  # one large input feature
    w[7] = 0.0  # an all-zero row
    return w


def test_int8_round_trip_is_within_half_a_step_of_each_row():
    w = _weight()
    codes, scale = q.quantize_int8_rows(w)
    assert codes.dtype == torch.int8 and scale.shape == (96,)
    error = (q.dequantize_int8_rows(codes, scale) - w).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert torch.equal(codes[7], torch.zeros_like(codes[7]))
    assert torch.allclose(codes.abs().amax(dim=1)[scale > 0].float(), torch.tensor(127.0))


@pytest.mark.parametrize("group", q.INT4_GROUP_SIZES)
def test_int4_round_trip_is_within_half_a_step_of_each_group(group):
    w = _weight()
    codes, scale, minimum = q.quantize_int4_groups(w, group)
    assert int(codes.max()) <= 15 and scale.shape == (96, 256 // group)
    step = scale.repeat_interleave(group, dim=1)
    error = (q.dequantize_int4_groups(codes, scale, minimum) - w).abs()
    assert (error <= step / 2 + 1e-6).all()


def test_int8_kernel_equals_the_dequantised_matmul():
    w, x = _weight(), torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1))
    codes, scale = q.quantize_int8_rows(w)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(2))
    expected = F.linear(x, q.dequantize_int8_rows(codes, scale), bias)
    fallback = F.linear(x, q.Int8Weight(codes, scale, torch.float32, use_kernel=False), bias)
    kernel = F.linear(x, q.Int8Weight(codes, scale, torch.float32), bias)
    assert torch.allclose(fallback, expected, atol=1e-5)
    # the CPU kernel takes fp32 activations in bf16: bf16's rounding, no more
    assert kernel.dtype == torch.float32
    # the kernel takes its activations in bf16 (8 bits of mantissa): ~1% off at worst here
    assert (kernel - expected).norm() / expected.norm() < 2e-2


def test_int4_kernel_equals_the_dequantised_matmul():
    w, x = _weight(), torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    codes, scale, minimum = q.quantize_int4_groups(w, 64)
    expected = F.linear(x, q.dequantize_int4_groups(codes, scale, minimum))
    kernel = F.linear(x, q.Int4Weight(codes, scale, minimum, 64, torch.float32))
    fallback = F.linear(x, q.Int4Weight(codes, scale, minimum, 64, torch.float32,
                                        use_kernel=False))
    assert torch.allclose(fallback, expected, atol=1e-5)
    # the kernel takes its activations in bf16 (8 bits of mantissa): ~1% off at worst here
    assert (kernel - expected).norm() / expected.norm() < 2e-2


def test_int8_dynamic_is_close_to_the_float_matmul():
    # seeded: over random inputs the error is ~2% typically and above 5% for 1 in 100
    w, x = _weight(), torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    codes, scale = q.quantize_int8_rows(w)
    out = F.linear(x, q.Int8DynamicWeight(codes, scale, torch.float32))
    expected = F.linear(x, w)
    assert (out - expected).norm() / expected.norm() < 0.05


def test_empty_inputs_give_empty_outputs():
    w = _weight()
    codes, scale = q.quantize_int8_rows(w)
    int4 = q.quantize_int4_groups(w, 64)
    for weight in (q.Int8Weight(codes, scale, torch.float32),
                   q.Int8DynamicWeight(codes, scale, torch.float32),
                   q.Int4Weight(*int4, 64, torch.float32)):
        assert F.linear(torch.empty(2, 0, 256), weight).shape == (2, 0, 96)


def test_a_quantised_weight_refuses_other_ops():
    codes, scale = q.quantize_int8_rows(_weight())
    with pytest.raises(TypeError, match="only F.linear and F.embedding"):
        torch.matmul(torch.randn(2, 96), q.Int8Weight(codes, scale, torch.float32))


def _logits(model, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions)


TOKENS = torch.randint(0, 301, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("scheme, tolerance", [("int8", 0.03), ("int8-dynamic", 0.06),
                                               ("int4", 0.15)])
def test_a_quantised_model_stays_close_to_its_float_model(scheme, tolerance):
    weights = random_weights(hidden_size=64, num_heads=4)
    expected = _logits(build_model_from_weights(weights), TOKENS)
    model = build_model_from_weights(weights)
    report = q.quantize_model(model, q.QuantizationConfig(scheme, group_size=32))
    logits = _logits(model, TOKENS)
    assert (logits - expected).norm() / expected.norm() < tolerance
    assert report.layers == 2 * 4
    assert report.bytes_after < report.bytes_before / 3  # int8 (here the word embedding
    # dominates, which stays int8 under int4 too)
    assert not any("weight" in k and "position" not in k and "layernorm" not in k
                   for k in model.state_dict())  # the float weights are gone
    # KV-cached greedy decoding runs on the quantised weights and matches recompute
    params = SamplingParams(greedy=True, out_seq_length=8)
    cached = TextGenerator(model, eod=300, vocab_size=301).generate(TOKENS[:, :4], params)
    recomputed = TextGenerator(model, eod=300, vocab_size=301, use_cache=False).generate(
        TOKENS[:, :4], params)
    assert torch.equal(cached[0], recomputed[0])


def test_a_bf16_model_quantises_and_keeps_its_dtype():
    weights = random_weights(hidden_size=64, num_heads=4)
    expected = _logits(build_model_from_weights(weights), TOKENS)
    model = build_model_from_weights(weights, torch.bfloat16)
    q.quantize_model(model, q.QuantizationConfig("int8"))
    logits = _logits(model, TOKENS)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - expected).norm() / expected.norm() < 0.03


def _quantized_logits(scheme, use_kernels, weights):
    model = build_model_from_weights(weights)
    q.quantize_model(model, q.QuantizationConfig(scheme, group_size=32), use_kernels)
    return _logits(model, TOKENS)


def _tp2_worker(rank, world_size, scheme):
    weights = random_weights(hidden_size=64, num_heads=4)  # made before the TP groups exist
    mpu.initialize_model_parallel(2)
    return [_quantized_logits(scheme, use_kernels, weights) for use_kernels in (False, True)]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_tp2_quantises_as_tp1(scheme):
    """Scales of the whole row (int8) and groups inside a shard (int4) give TP=2 the codes of
    TP=1: the exact fp32 matmul of the dequantised weights agrees to fp32 rounding, and the
    kernels (bf16 activations, a bf16 partial sum per rank) to bf16 rounding."""
    weights = random_weights(hidden_size=64, num_heads=4)
    exact, kernel = (_quantized_logits(scheme, k, weights) for k in (False, True))
    for exact_tp2, kernel_tp2 in run_distributed(_tp2_worker, 2, (scheme,)):
        assert torch.allclose(exact_tp2, exact, atol=1e-5, rtol=0)
        assert torch.allclose(kernel_tp2, kernel, atol=3e-2, rtol=0)


def test_int4_shapes_the_kernel_cannot_take_are_one_error():
    model = build_model_from_weights(random_weights(hidden_size=48, num_heads=4))
    with pytest.raises(ConfigError, match=r"has 48 input features per rank, not a multiple of "
                       r"--quantize-group-size 32; no int4 group size fits; use --quantize int8"):
        q.quantize_model(model, q.QuantizationConfig("int4", group_size=32))
    model = build_model_from_weights(random_weights(hidden_size=64, num_heads=4))
    with pytest.raises(ConfigError, match="--quantize-group-size 32 or 64 fits"):
        q.quantize_model(model, q.QuantizationConfig("int4", group_size=128))


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    weights, _ = tokenized_weights(corpus, hidden_size=64, num_heads=4, positions=32)
    save_model_weights(weights, str(root / "ckpt"), "megatron")
    return str(root / "ckpt")


def test_evaluate_tool_reports_the_change_against_the_unquantised_model(checkpoint, tmp_path,
                                                                         capsys):
    tool = load_tool("evaluate_gpt2")
    text = tmp_path / "wiki.test.tokens"
    text.write_text(" = Valkyria = \n \n The game began in 2011 . It was very popular ; fans "
                    "said so , and the king said so too . \n")
    base = ["--load", checkpoint, "--task", "WIKITEXT103", "--valid-data", str(text),
            "--seq-length", "16"]
    assert tool.main(base + ["--results-file", str(tmp_path / "fp32.json")]) == 0
    assert tool.main(base + ["--quantize", "int4", "--quantize-group-size", "32",
                             "--results-file", str(tmp_path / "int4.json")]) == 0
    out = capsys.readouterr().out
    assert "--quantize int4: 8 linear layers and the word embedding" in out
    # a group size the model cannot take: refused before the unquantised evaluation runs
    assert tool.main(base + ["--quantize", "int4", "--quantize-group-size", "128"]) == 2
    assert "WIKITEXT103" not in capsys.readouterr().out
    assert "| int4 vs unquantised ppl" in out
    fp32 = json.loads((tmp_path / "fp32.json").read_text())["results"][0]
    int4 = json.loads((tmp_path / "int4.json").read_text())["results"][0]
    assert int4["unquantized_ppl"] == pytest.approx(fp32["ppl"], rel=1e-6)
    assert int4["ppl_change"] == pytest.approx(int4["ppl"] / fp32["ppl"] - 1)
    assert int4["ppl"] != fp32["ppl"]


def test_generate_tool_runs_quantised_and_refuses_what_int4_cannot_take(checkpoint, tmp_path,
                                                                        capsys):
    tool = load_tool("generate_samples")
    out = tmp_path / "samples.jsonl"
    assert tool.main(["--load", checkpoint, "--quantize", "int8", "--num-samples", "2",
                      "--genfile", str(out), "--out-seq-length", "6", "--greedy"]) == 0
    assert len(out.read_text().splitlines()) == 2
    assert tool.main(["--load", checkpoint, "--quantize", "int4", "--num-samples", "1",
                      "--genfile", str(out), "--greedy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--quantize-group-size 32 or 64 fits" in err
    assert tool.main(["--load", checkpoint, "--quantize", "int8", "--quantize-group-size",
                      "64"]) == 2
    assert capsys.readouterr().err == "error: --quantize-group-size applies to --quantize int4\n"
    with pytest.raises(SystemExit) as exit_:  # argparse: a group size the kernel lacks
        tool.main(["--load", checkpoint, "--quantize", "int4", "--quantize-group-size", "100"])
    assert exit_.value.code == 2
