"""Zero-shot evaluation of a GPT-2 checkpoint: WikiText-103 perplexity, LAMBADA accuracy.

    python tools/evaluate_gpt2.py --task WIKITEXT103 --valid-data wikitext-103/wiki.test.tokens \
        --load checkpoints/gpt2_small --overlapping-eval 32
    python tools/evaluate_gpt2.py --task LAMBADA --valid-data lambada/lambada_test.jsonl \
        --load checkpoints/gpt2_small --strict-lambada

Flags follow Megatron's tasks/main.py (--task, --valid-data, --overlapping-eval,
--strict-lambada); the model's shape and tokenizer come from the checkpoint (Megatron layout
at any TP size, --deepspeed layout, or a Hugging Face GPT-2 folder).  Metrics are computed
as in megatron/inference/zeroshot.py; --results-file also writes them as JSON.

With --quantize int8|int8-dynamic|int4 the model is evaluated twice, unquantised and then
quantised, and each line also gives the unquantised figure and the change, so the accuracy a
quantisation costs is seen before it is deployed.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megatron.inference import zeroshot  # noqa: E402
from megatron.cli import run_cli  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.inference.loading import (check_output_file, inference_parser,  # noqa: E402
                                        initialize_inference, load_inference_model,
                                        quantize_for_inference)
from megatron.inference.quantization import check_quantizable, quantization_config  # noqa: E402
from megatron.runtime.initialize import destroy  # noqa: E402

TASKS = ("WIKITEXT103", "LAMBADA")


def get_args(argv=None):
    parser = inference_parser(__doc__.split("\n")[0])
    g = parser.add_argument_group("evaluation")
    g.add_argument("--task", required=True, choices=TASKS)
    g.add_argument("--valid-data", required=True, nargs="+",
                   help="wiki.test.tokens (WIKITEXT103) or lambada_test.jsonl (LAMBADA)")
    g.add_argument("--seq-length", type=int, default=None,
                   help="tokens per window (default: the model's max positions)")
    g.add_argument("--overlapping-eval", type=int, default=None,
                   help="WIKITEXT103: stride between windows (default: --seq-length, "
                        "no overlap); Megatron uses 32")
    g.add_argument("--strict-lambada", action="store_true",
                   help="LAMBADA: the target is the whole last word, not its last BPE token")
    g.add_argument("--results-file", default=None, help="write the metrics as JSON here")
    g.add_argument("--batch-size", type=int, default=1,
                   help="windows (WIKITEXT103) or passages (LAMBADA) per forward pass; the "
                        "metrics do not depend on it")
    g.add_argument("--log-interval", type=int, default=None,
                   help="print progress every this many batches (default: no progress lines)")
    args = parser.parse_args(argv)
    if args.strict_lambada and args.task != "LAMBADA":
        raise ConfigError("--strict-lambada applies to --task LAMBADA")
    if args.overlapping_eval is not None and args.task != "WIKITEXT103":
        raise ConfigError("--overlapping-eval applies to --task WIKITEXT103")
    for flag, value in (("--seq-length", args.seq_length),
                        ("--overlapping-eval", args.overlapping_eval),
                        ("--batch-size", args.batch_size), ("--log-interval", args.log_interval)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if args.results_file:
        check_output_file("--results-file", args.results_file, inputs=args.valid_data)
    return args


def read_valid_data(args):
    """Each --valid-data file's contents in the task's format: read (and checked) before the
    model is loaded, so a wrong or unreadable file costs no load."""
    read = zeroshot.read_wikitext if args.task == "WIKITEXT103" else zeroshot.read_lambada
    return [read(path) for path in args.valid_data]


def evaluate(args, model, tokenizer, contents):
    """`contents`: read_valid_data(args)."""
    max_positions = model.config.max_position_embeddings
    seq_length = max_positions if args.seq_length is None else args.seq_length
    if not 1 <= seq_length <= max_positions:
        raise ConfigError(f"--seq-length {seq_length} must lie in [1, the model's "
                          f"max_position_embeddings {max_positions}]")
    score = zeroshot.model_score_fn(model, tokenizer.vocab_size)
    results = []
    for path, content in zip(args.valid_data, contents):
        progress = _progress_printer(args, path)
        if args.task == "WIKITEXT103":
            text = content
            result = zeroshot.evaluate_wikitext(score, tokenizer, text, seq_length,
                                                args.overlapping_eval, args.batch_size, progress)
            results.append({"file": path, "avg_loss": result.avg_loss, "ppl": result.ppl,
                            "adjusted_ppl": result.adjusted_ppl,
                            "num_tokenized_tokens": result.num_tokenized_tokens,
                            "num_original_tokens": result.num_original_tokens})
        else:
            correct, total = zeroshot.evaluate_lambada(score, tokenizer, content, seq_length,
                                                       args.strict_lambada, args.batch_size,
                                                       progress)
            results.append({"file": path, "accuracy": correct / total, "correct": correct,
                            "total": total, "strict": args.strict_lambada})
    return results


def _progress_printer(args, path):
    """progress(done, total) printing every --log-interval batches on the first rank."""
    if args.log_interval is None or (dist.is_initialized() and dist.get_rank() != 0):
        return None
    what = "windows" if args.task == "WIKITEXT103" else "passages"
    every = args.log_interval * args.batch_size
    started = time.perf_counter()

    def progress(done, total):
        if done % every == 0 or done == total:
            print(f" {args.task} {path} | {what} {done}/{total} | elapsed "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
    return progress


def with_quantization_change(results, baseline, scheme):
    """Each quantised result gains the unquantised figure and the change against it."""
    changed = []
    for r, b in zip(results, baseline):
        r = dict(r, quantize=scheme)
        if "ppl" in r:
            r.update(unquantized_ppl=b["ppl"], ppl_change=r["ppl"] / b["ppl"] - 1)
        else:
            r.update(unquantized_accuracy=b["accuracy"],
                     accuracy_change=r["accuracy"] - b["accuracy"])
        changed.append(r)
    return changed


def _report(args, results):
    for r in results:
        if args.task == "WIKITEXT103":
            line = (f" {args.task} {r['file']} | avg loss: {r['avg_loss']:.4E} | ppl: "
                    f"{r['ppl']:.4E} | adjusted ppl: {r['adjusted_ppl']:.4E} | token ratio: "
                    f"{(r['num_tokenized_tokens'] - 1) / (r['num_original_tokens'] - 1):.4f}")
            if "quantize" in r:
                line += (f" | {r['quantize']} vs unquantised ppl {r['unquantized_ppl']:.4E}: "
                         f"{100 * r['ppl_change']:+.2f}%")
        else:
            line = (f" {args.task} {r['file']} | number correct: {r['correct']} | total: "
                    f"{r['total']} | accuracy: {100 * r['accuracy']:.2f}%"
                    f"{' (strict)' if r['strict'] else ''}")
            if "quantize" in r:
                line += (f" | {r['quantize']} vs unquantised "
                         f"{100 * r['unquantized_accuracy']:.2f}%: "
                         f"{100 * r['accuracy_change']:+.2f} points")
        print(line, flush=True)
    if args.results_file:
        with open(args.results_file, "w") as f:
            json.dump({"task": args.task, "load": args.load, "results": results}, f, indent=2)


def run(args):
    contents = read_valid_data(args)
    runtime = initialize_inference(args)
    try:
        model, tokenizer, _ = load_inference_model(args, runtime.device)
        if args.quantize:  # the quantisation's errors before the baseline's time is spent
            check_quantizable(model, quantization_config(args))
        baseline = evaluate(args, model, tokenizer, contents) if args.quantize else None
        if quantize_for_inference(args, model) is not None:
            results = with_quantization_change(evaluate(args, model, tokenizer, contents),
                                               baseline, args.quantize)
        else:
            results = evaluate(args, model, tokenizer, contents)
        if not dist.is_initialized() or dist.get_rank() == 0:
            _report(args, results)
        return results
    finally:
        destroy()


def main(argv=None):
    return run_cli(lambda: run(get_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
