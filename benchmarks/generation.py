"""Generation speed: our KV-cached decode in fp32, bf16 and with quantised weights (--quantize
int8 / int8-dynamic / int4) vs transformers' generate() in fp32 and under torch's dynamic int8
quantisation, each beside its weight-bandwidth floor; at batch 1 and (fp32, bf16) batch 8.

    python benchmarks/generation.py            # 12 layers, hidden 768 (GPT-2 124M), 128 new tokens
    python benchmarks/generation.py --quick    # 32 new tokens, 1 repeat
    python benchmarks/generation.py --device cuda   # on a GPU: no CPU-only quantised rows

One randomly initialised GPT-2 124M (vocab 50257, 1024 positions) is converted to a Hugging
Face folder with tools' own converter, so both sides hold the very same weights.  Greedy,
batch 1, a 16-token prompt, the same number of new tokens (eos disabled on the HF side).
Tokens/s = new tokens / wall time of the whole call (prefill included), median of --repeats
runs after one warm-up (which compiles the --compile rows' decode step).  "same tokens" is
the share of greedy tokens equal to our fp32 run's.

Decoding reads every matmul weight once per step, for the whole batch, so the floor is
batch x (copy bandwidth measured in the same run) / (weight bytes per step).  A random-init
model's logits are nearly flat, so the smallest perturbation changes a greedy choice and the
rest of the sequence with it: "same tokens" is a harsh test here.  The accuracy a
quantisation costs on a trained model is measured by tools/evaluate_gpt2.py --quantize
(README, "Guide: quantisation").
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import copy_bandwidth, machine_description, markdown_table, update_docs_section  # noqa: E402

import torch  # noqa: E402


def _median_time(fn, repeats, device):
    from megatron.runtime.device import synchronize
    fn()  # warm-up
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _weight_bytes_per_token(model):
    """Bytes of matmul weights one decode step reads: every linear weight and the LM head
    (the embedding lookup reads one row; int8-dynamic's lookup codes are not read)."""
    from megatron.inference.quantization import Int8DynamicWeight
    total = 0
    for module in model.modules():
        weight = module.__dict__.get("weight", module._parameters.get("weight"))
        if weight is None or module.__class__.__name__.endswith("LayerNorm") or \
                module is model.language_model.embedding.position_embeddings:
            continue
        total += weight.nbytes
        if isinstance(weight, Int8DynamicWeight) and weight.rows is not None:
            total -= weight.rows.nbytes
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the fp32/bf16 rows (the quantised rows use CPU kernels); "
                             "--compile rows replay the decode step as CUDA graphs")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device)
    on_cpu = device.type == "cpu"
    new_tokens = args.new_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)

    import transformers
    from megatron.convert.savers import save_model_weights
    from megatron.convert.loaders import ModelWeights
    from megatron.convert.tp_layout import WORD_EMBEDDINGS
    from megatron.inference.loading import build_model_from_weights
    from megatron.inference.quantization import QuantizationConfig, quantize_model
    from megatron.model import GPT2Model, GPTConfig
    from megatron.inference.text_generation import SamplingParams, TextGenerator

    vocab, layers, hidden, heads, positions = 50257, 12, 768, 12, 1024
    torch.manual_seed(0)
    config = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       vocab_size=50304, max_position_embeddings=positions,
                       hidden_dropout=0.0, attention_dropout=0.0)
    state = GPT2Model(config).state_dict()
    state[WORD_EMBEDDINGS] = state[WORD_EMBEDDINGS][:vocab].clone()
    weights = ModelWeights(state, dict(num_layers=layers, hidden_size=hidden,
                                       num_attention_heads=heads, ffn_hidden_size=4 * hidden,
                                       max_position_embeddings=positions,
                                       orig_vocab_size=vocab), "benchmark")
    with tempfile.TemporaryDirectory() as folder:
        save_model_weights(weights, os.path.join(folder, "hf"), "hf")
        hf = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(folder, "hf")).eval()
    # torch's recipe for transformers (a copy): GPT-2's Conv1D layers are not nn.Linear, so
    # only the LM head is quantised
    hf_int8 = torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, dtype=torch.qint8) \
        if on_cpu else None
    hf = hf.to(device)

    # batch 8: the batch-1 prompt first, then 7 others
    prompts = {1: torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1))}
    prompts[8] = torch.cat([prompts[1], torch.randint(
        0, vocab, (7, 16), generator=torch.Generator().manual_seed(2))])
    prompts = {batch: tokens.to(device) for batch, tokens in prompts.items()}
    params = SamplingParams(greedy=True, out_seq_length=new_tokens)
    no_eod = -1  # never produced: every run makes exactly new_tokens tokens

    def ours(dtype=torch.float32, scheme=None, use_cache=True, batch=1, compile=False):
        model = build_model_from_weights(weights, dtype, device)
        if scheme:
            quantize_model(model, QuantizationConfig(scheme, group_size=128))
        generator = TextGenerator(model, no_eod, vocab, use_cache=use_cache, compile=compile)
        return ((lambda: generator.generate(prompts[batch], params)[0]),
                _weight_bytes_per_token(model), batch)

    def hf_generate(model, batch=1):
        def run():
            with torch.inference_mode():
                return model.generate(prompts[batch], max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[:, 16:]
        return run

    fp32_bytes = 4 * sum(p.numel() for n, p in hf.named_parameters()
                         if p.dim() == 2 and "wpe" not in n)
    runs = {  # name -> (generate(), weight bytes per step, batch)
        "ours fp32, KV cache": ours(),
        "ours fp32, --compile (decode step)": ours(compile=True),
        "ours bf16": ours(torch.bfloat16),
    }
    if on_cpu:
        runs.update({
            "ours --quantize int8": ours(scheme="int8"),
            "ours --quantize int8-dynamic": ours(scheme="int8-dynamic"),
            "ours --quantize int4 (group 128)": ours(scheme="int4")})
    else:
        runs["ours bf16, --compile"] = ours(torch.bfloat16, compile=True)
    runs["transformers generate() fp32"] = (hf_generate(hf), fp32_bytes, 1)
    if on_cpu:
        runs["transformers + torch quantize_dynamic int8"] = (hf_generate(hf_int8), None, 1)
    runs.update({
        "ours fp32 --recompute": ours(use_cache=False),
        "ours fp32, batch 8": ours(batch=8),
        "ours bf16, batch 8": ours(torch.bfloat16, batch=8),
        "ours fp32, batch 8, --compile": ours(batch=8, compile=True),
        "ours bf16, batch 8, --compile": ours(torch.bfloat16, batch=8, compile=True),
        "transformers generate() fp32, batch 8": (hf_generate(hf, batch=8), fp32_bytes, 8),
    })
    del state
    bandwidth = copy_bandwidth(25_000_000 if on_cpu else 250_000_000, device)
    reference = runs["ours fp32, KV cache"][0]()[0]
    rows, hf_rate = [], {}
    for name, (generate, weight_bytes, batch) in runs.items():
        same = (generate()[0] == reference).float().mean().item()  # the first row
        seconds = _median_time(generate, max(1, repeats // 3) if "recompute" in name
                               else repeats, device)
        rate = batch * new_tokens / seconds
        if name.startswith("transformers generate() fp32"):
            hf_rate[batch] = rate
        floor = batch * bandwidth / weight_bytes if weight_bytes else None
        rows.append([name, f"{rate:.1f}", batch,
                     f"{weight_bytes / 2**20:.0f}" if weight_bytes else "-",
                     f"{floor:.1f}" if floor else "-",
                     f"{100 * rate / floor:.0f}%" if floor else "-", f"{100 * same:.0f}%"])
        print(name, rows[-1], flush=True)
    for row in rows:  # vs transformers fp32 at the same batch size
        row[2] = f"{float(row[1]) / hf_rate[row[2]]:.2f}x"
    body = "\n".join([
        f"## Text generation{'' if on_cpu else ', GPU'} (tokens/s, greedy, batch 1 and 8)",
        "",
        f"Machine: {machine_description()}; transformers {transformers.__version__}; copy "
        f"bandwidth {bandwidth / 1e9:.1f} GB/s (measured in the same run).",
        f"Model: GPT-2 124M (12 layers, hidden 768, vocab 50257), random init; 16-token "
        f"prompt, {new_tokens} new tokens, median of {repeats} after a warm-up; batch 1 "
        "unless the name says 8 (tokens/s counts every row's tokens).  Floor = batch x copy "
        "bandwidth / weight bytes read per step (the speed limit while weights dominate); "
        "\"same tokens\" = greedy tokens (of the first row) equal to our fp32 run's "
        "(random init: nearly flat logits, so a harsh "
        "test; the accuracy cost on a trained model is in the README's quantisation guide).  "
        + ("int8 and int4 run their matmuls in bf16 "
           "(torch's CPU kernels); int8-dynamic in int8 (fbgemm).  The transformers int8 row "
           "quantises only its nn.Linear (the LM head): GPT-2's Conv1D layers stay fp32.  "
           if on_cpu else "")
        + "--compile rows: the one-token decode step compiled over the fixed-shape cache (256 "
        "positions here, masked beyond the tokens so far)"
        + ("." if on_cpu else ", replayed as CUDA graphs.") + "  "
        f"`python benchmarks/generation.py{' --quick' if args.quick else ''}"
        f"{'' if on_cpu else ' --device cuda'}`",
        "",
        markdown_table(["implementation", "tokens/s", "vs transformers fp32",
                        "weight MB/step", "floor tokens/s", "of floor", "same tokens"], rows),
    ])
    print(body)
    if args.write_docs:
        update_docs_section("generation" if on_cpu else "generation_cuda", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
