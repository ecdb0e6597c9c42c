"""Generation speed: our KV-cached decode and --recompute vs transformers' generate().

    python benchmarks/generation.py            # 12 layers, hidden 768 (GPT-2 124M), 128 new tokens
    python benchmarks/generation.py --quick    # 32 new tokens, 1 repeat

One randomly initialised GPT-2 124M (vocab 50257, 1024 positions) is converted to a Hugging
Face folder with tools' own converter, so both sides hold the very same weights.  Greedy,
batch 1, a 16-token prompt, the same number of new tokens (eos disabled on the HF side, and
our greedy tokens checked equal to transformers').  Tokens/s = new tokens / wall time of the
whole call (prefill included), median of --repeats runs after one warm-up, fp32.

The last row is a floor, not a peer: the per-token weight matmuls alone (no prefill, attention
or Python).  Batch-1 decoding is bound by reading the weights (~500 MB per token in fp32, a
third of it the LM head); a profile of 20 cached decode steps (torch.profiler, 1 thread) puts
88% of the time in those matmuls, ~3% in attention and the rest in LayerNorm, GeLU, the cache
writes and per-op dispatch.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_description, markdown_table, update_docs_section  # noqa: E402

import torch  # noqa: E402


def _median_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_floor(model, new_tokens):
    """The decode's weight matmuls alone, one token at a time: 4 per layer + the LM head.
    Batch-1 decoding reads every weight once per token, so this is the speed limit on this
    machine; the gap to it is attention, LayerNorm, GeLU and Python work per token."""
    import torch.nn.functional as F
    layers = model.language_model.transformer.layers
    head = model.language_model.embedding.word_embeddings.weight
    x = torch.zeros(1, 1, model.config.hidden_size)
    x4 = torch.zeros(1, 1, model.config.ffn_hidden_size)

    def run():
        with torch.inference_mode():
            for _ in range(new_tokens):
                for layer in layers:
                    F.linear(x, layer.attention.query_key_value.weight)
                    F.linear(x, layer.attention.dense.weight)
                    F.linear(x, layer.mlp.dense_h_to_4h.weight)
                    F.linear(x4, layer.mlp.dense_4h_to_h.weight)
                F.linear(x[:, 0], head)
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args(argv)
    new_tokens = args.new_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)

    import transformers
    from megatron.convert.savers import save_model_weights
    from megatron.convert.loaders import ModelWeights
    from megatron.convert.tp_layout import WORD_EMBEDDINGS
    from megatron.inference.loading import build_model_from_weights
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
    ours = build_model_from_weights(weights)
    with tempfile.TemporaryDirectory() as folder:
        save_model_weights(weights, os.path.join(folder, "hf"), "hf")
        hf = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(folder, "hf")).eval()
    del state, weights

    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(greedy=True, out_seq_length=new_tokens)
    no_eod = -1  # never produced: every run makes exactly new_tokens tokens
    cached = TextGenerator(ours, no_eod, vocab, use_cache=True)
    recompute = TextGenerator(ours, no_eod, vocab, use_cache=False)

    def run_hf():
        with torch.inference_mode():
            return hf.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[:, 16:]

    same = torch.equal(cached.generate(prompt, params)[0], run_hf())
    seconds = {
        "ours, KV cache": _median_time(lambda: cached.generate(prompt, params), repeats),
        "transformers generate()": _median_time(run_hf, repeats),
        "ours, --recompute": _median_time(lambda: recompute.generate(prompt, params),
                                          max(1, repeats // 3)),
        "floor: the matmuls alone": _median_time(_matmul_floor(ours, new_tokens), repeats),
    }
    hf_rate = new_tokens / seconds["transformers generate()"]
    rows = [[name, f"{new_tokens / s:.1f}", f"{hf_rate and (new_tokens / s) / hf_rate:.2f}x"]
            for name, s in seconds.items()]
    body = "\n".join([
        "## Text generation (tokens/s, greedy, batch 1)",
        "",
        f"Machine: {machine_description()}; transformers {transformers.__version__}.",
        f"Model: GPT-2 124M (12 layers, hidden 768, vocab 50257), random init, fp32; 16-token "
        f"prompt, {new_tokens} new tokens, median of {repeats} after a warm-up.  The floor row is "
        "the per-token weight matmuls alone (the bandwidth limit), not a peer.  "
        f"Same greedy tokens as transformers: {same}.  `python benchmarks/generation.py"
        f"{' --quick' if args.quick else ''}`",
        "",
        markdown_table(["implementation", "tokens/s", "vs transformers"], rows),
    ])
    print(body)
    if args.write_docs:
        update_docs_section("generation", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
