"""Generate text from a GPT-2 checkpoint (Megatron, --deepspeed or Hugging Face layout).

    # interactive: type a prompt, get a continuation; `stop` (or end of input) exits
    python tools/generate_samples.py --load checkpoints/gpt2_small --top_k 40
    # one prompt per line of a file -> JSON lines {context, text, length, finished}
    python tools/generate_samples.py --load CKPT --sample-input-file prompts.txt \
        --sample-output-file out.jsonl --greedy
    # unconditional samples (from <|endoftext|>) as JSON lines {text, length, finished}
    python tools/generate_samples.py --load CKPT --num-samples 8 --genfile samples.jsonl
    # int8 weights (4x smaller; int8-dynamic: int8 activations too; int4: 8x, per group)
    python tools/generate_samples.py --load CKPT --quantize int8 --greedy --num-samples 2 \
        --genfile samples.jsonl
    # tensor-parallel: any TP size, whatever the checkpoint was saved at
    torchrun --standalone --nproc_per_node 2 tools/generate_samples.py --load CKPT \
        --model-parallel-size 2 --sample-input-file prompts.txt --sample-output-file out.jsonl

Flags follow Megatron's tools/generate_samples_gpt2.py.  The model's shape and tokenizer are
read from the checkpoint.  A KV cache makes each new token cost one token's forward; with
--recompute every step runs the whole prefix again (same tokens with --greedy, slower).
Samples are written as they are made, to <output>.partial, renamed to the output file when
all are done: a run stopped part way keeps what it made there.
"""

import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.cli import launched_rank, run_cli  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.inference.loading import (check_output_file, inference_parser,  # noqa: E402
                                        initialize_inference, load_inference_model,
                                        quantize_for_inference)
from megatron.runtime.initialize import destroy  # noqa: E402
from megatron.inference.text_generation import SamplingParams, TextGenerator, generate_text  # noqa: E402

PROMPT = "Context prompt (stop to exit) >>> "


def get_args(argv=None):
    parser = inference_parser(__doc__.split("\n")[0])
    g = parser.add_argument_group("text generation")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--greedy", action="store_true",
                   help="argmax instead of sampling (so no --top_k, --top_p or --temperature)")
    g.add_argument("--top_p", type=float, default=0.0, help="nucleus sampling mass (0: off)")
    g.add_argument("--top_k", type=int, default=0, help="sample from the k best (0: off)")
    g.add_argument("--out-seq-length", type=int, default=256, help="new tokens at most")
    g.add_argument("--seq-length", type=int, default=None,
                   help="prompt + new tokens at most, as in Megatron (a longer prompt keeps its "
                        "last tokens); default and at most: the checkpoint's "
                        "--max-position-embeddings")
    g.add_argument("--recompute", action="store_true",
                   help="no KV cache: recompute the whole prefix every step")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the one-token decode step (a fixed-shape KV cache of "
                        "256-position multiples: one compile per size, cached on disk; on a "
                        "GPU replayed as CUDA graphs)")
    g.add_argument("--sample-input-file", default=None, help="one prompt per line")
    g.add_argument("--sample-output-file", default=None,
                   help="JSON lines out (default: <input>.out.jsonl)")
    g.add_argument("--num-samples", type=int, default=0,
                   help="N > 0: N unconditional samples into --genfile")
    g.add_argument("--genfile", default=None, help="JSON lines file for --num-samples")
    g.add_argument("--batch-size", type=int, default=1,
                   help="unconditional samples generated together")
    args = parser.parse_args(argv)
    _validate(args)
    return args


def _validate(args):
    if not math.isfinite(args.temperature) or (args.temperature <= 0 and not args.greedy):
        raise ConfigError(f"--temperature must be a number > 0 (got {args.temperature}); use "
                          "--greedy for argmax decoding")
    if args.top_k < 0 or not 0.0 <= args.top_p <= 1.0:
        raise ConfigError(f"--top_k must be >= 0 and --top_p in [0, 1] (got {args.top_k}, "
                          f"{args.top_p})")
    if args.top_k > 0 and args.top_p > 0:
        raise ConfigError("--top_k and --top_p are alternatives; give one of them")
    if args.out_seq_length < 1 or args.batch_size < 1 or args.num_samples < 0:
        raise ConfigError("--out-seq-length and --batch-size must be >= 1, --num-samples >= 0")
    if args.seq_length is not None and args.seq_length < 2:
        raise ConfigError(f"--seq-length bounds the prompt and the new tokens together: at "
                          f"least 2 (got {args.seq_length})")
    if args.compile and args.recompute:
        raise ConfigError("--compile compiles the KV-cached decode step; drop --recompute")
    if args.num_samples > 0 and not args.genfile:
        raise ConfigError("--num-samples needs --genfile (the JSON lines file to write)")
    if args.genfile and args.num_samples == 0:
        raise ConfigError("--genfile is where --num-samples N writes N unconditional samples; "
                          "give --num-samples N with N at least 1")
    if args.num_samples > 0 and args.sample_input_file:  # Megatron's tool ignores the prompts
        raise ConfigError("--num-samples N writes unconditional samples (no prompts) and "
                          "--sample-input-file continues prompts: drop --num-samples and "
                          "--genfile to continue the prompts, or drop --sample-input-file for "
                          "unconditional samples")
    if args.sample_output_file and not args.sample_input_file:
        raise ConfigError("--sample-output-file is where the continuations of "
                          "--sample-input-file's prompts go; add --sample-input-file, or drop "
                          "--sample-output-file (--num-samples N writes to --genfile)")
    sampling = [flag for flag, given in (
        ("--top_k", args.top_k != 0), ("--top_p", args.top_p != 0.0),
        ("--temperature", args.temperature not in (0.0, 1.0))) if given]  # 0: greedy's own
    if args.greedy and sampling:
        raise ConfigError(f"--greedy takes the most likely token, which {' and '.join(sampling)}"
                          f" would not change: drop {'it' if len(sampling) == 1 else 'them'}, "
                          "or drop --greedy to sample")
    if args.sample_input_file and args.sample_output_file is None:
        args.sample_output_file = args.sample_input_file + ".out.jsonl"
    if launched_rank() != 0:
        return  # only rank 0 reads the prompts and writes the samples
    if args.sample_input_file and not os.path.isfile(args.sample_input_file):
        what = "is a directory" if os.path.isdir(args.sample_input_file) else "does not exist"
        raise ConfigError(f"--sample-input-file {args.sample_input_file} {what}; give a text "
                          "file of prompts, one a line")
    for flag, path in (("--sample-output-file", args.sample_output_file),
                       ("--genfile", args.genfile)):
        if path:
            check_output_file(flag, path, inputs=(args.sample_input_file,))


def _is_writer():
    return not dist.is_initialized() or dist.get_rank() == 0


def _share(obj):
    """Rank 0's value of `obj` on every rank (prompts are read on rank 0 only)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


class SampleWriter:
    """JSON lines written (by rank 0) as each sample is made, to `<path>.partial`, renamed to
    `path` when all `total` are: a stopped run keeps what it made, a finished file is whole.
    A line every tenth of a long run says how far it is."""

    def __init__(self, path, total, what):
        self.path, self.total, self.what = path, total, what
        self.partial, self.count, self.started = f"{path}.partial", 0, time.monotonic()
        self.file = open(self.partial, "w", encoding="utf-8") if _is_writer() else None

    def add(self, record):
        self.count += 1
        if self.file is None:
            return
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()
        if self.total >= 20 and self.count % (self.total // 10) == 0 and \
                self.count < self.total:
            print(f" {self.count} of {self.total} {self.what} "
                  f"({time.monotonic() - self.started:.0f} s)", flush=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if self.file is None:
            return False
        self.file.close()
        if kind is None:
            os.replace(self.partial, self.path)
            print(f" wrote {self.count} {self.what} to {self.path}", flush=True)
        elif self.count:
            print(f" note: stopped after {self.count} of {self.total} {self.what}; they are "
                  f"in {self.partial}", flush=True)
        else:
            os.remove(self.partial)
        return False


def read_prompts(path):
    """The non-blank lines of the prompts file (rank 0 reads it, before any process group)."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # (a BOM some editors write is no text)
            return [line.rstrip("\n") for line in f if line.strip()]
    except UnicodeDecodeError as error:
        raise ConfigError(f"--sample-input-file {path} is not UTF-8 text (byte {error.start}); "
                          "give a text file of prompts, one a line") from None


def generate_from_file(generator, tokenizer, params, args, prompts):
    """`prompts`: rank 0's read_prompts (None on the other ranks)."""
    prompts = _share(prompts)
    cut = 0
    with SampleWriter(args.sample_output_file, len(prompts), "samples") as writer:
        for prompt in prompts:
            record = generate_text(generator, tokenizer, prompt, params)
            cut += "context_truncated_to_tokens" in record
            writer.add(record)
    if _is_writer():
        if cut:
            print(f" note: {cut} of the prompts did not fit {_length_limit(args, generator)} "
                  "with room for a new token and kept only their last tokens "
                  "(context_truncated_to_tokens in their records)", flush=True)


def _length_limit(args, generator):
    """What bounds prompt + new tokens, in words."""
    if args.seq_length is None:
        return f"the model's {generator.max_length} positions"
    return f"--seq-length {generator.max_length}"


def generate_interactive(generator, tokenizer, params):
    while True:
        prompt = None
        if _is_writer():
            try:
                prompt = input(PROMPT)
            except EOFError:
                prompt = "stop"
        prompt = _share(prompt)
        if prompt.strip() == "stop":
            return
        if not prompt.strip():
            continue
        record = generate_text(generator, tokenizer, prompt, params)
        if _is_writer():
            print(f"\nContext: {prompt}\n\nMegatron-LM: {record['text']}\n", flush=True)
            if "context_truncated_to_tokens" in record:  # (said in the file modes too)
                print(f" note: the prompt did not fit {generator.max_length} positions with "
                      "room for a new token; only its last "
                      f"{record['context_truncated_to_tokens']} tokens were read", flush=True)


def generate_unconditional(generator, tokenizer, params, args):
    with SampleWriter(args.genfile, args.num_samples, "unconditional samples") as writer:
        while writer.count < args.num_samples:
            batch = min(args.batch_size, args.num_samples - writer.count)
            context = torch.full((batch, 1), tokenizer.eod, dtype=torch.long)
            new, finished = generator.generate(context, params)
            for row, done in zip(new.tolist(), finished.tolist()):
                tokens = row[:row.index(tokenizer.eod)] if tokenizer.eod in row else row
                writer.add({"text": tokenizer.detokenize(tokens), "length": len(tokens),
                            "finished": bool(done)})


def run(args):
    prompts = read_prompts(args.sample_input_file) \
        if args.sample_input_file and launched_rank() == 0 else None
    if prompts == []:  # before the model is loaded
        raise ConfigError(f"--sample-input-file {args.sample_input_file} holds no prompts (no "
                          "line that is not blank)")
    runtime = initialize_inference(args)
    try:
        model, tokenizer, _ = load_inference_model(args, runtime.device)
        quantize_for_inference(args, model)
        generator = TextGenerator(model, tokenizer.eod, tokenizer.vocab_size,
                                  use_cache=not args.recompute, compile=args.compile,
                                  max_length=args.seq_length)
        params = SamplingParams(args.greedy, args.temperature, args.top_k, args.top_p,
                                args.out_seq_length)
        if args.out_seq_length >= generator.max_length and _is_writer():
            print(f" note: --out-seq-length {args.out_seq_length}, but the prompt and the new "
                  f"tokens together fit {_length_limit(args, generator)}: at most "
                  f"{generator.max_length - 1} new tokens", flush=True)
        if args.num_samples > 0:
            generate_unconditional(generator, tokenizer, params, args)
        elif args.sample_input_file:
            if args.batch_size > 1 and _is_writer():
                print(f" note: --batch-size {args.batch_size} batches --num-samples; prompts "
                      "are continued one at a time", flush=True)
            generate_from_file(generator, tokenizer, params, args, prompts)
        else:
            generate_interactive(generator, tokenizer, params)
    finally:
        destroy()


def main(argv=None):
    return run_cli(lambda: run(get_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
