"""Write the checkpoint fixtures of tests/compat/ (run once; the files are committed).

    python -m tests.compat.make_fixtures [--output tests/compat/fixtures]

Every fixture is made through the command line only (pretrain_gpt2.py, torchrun,
tools/convert_checkpoint.py, tools/generate_samples.py), so this script keeps working as the
code under it changes. Each training case trains a tiny GPT-2 for 2 iterations and saves
(`--exit-interval 2`); a second run resumes that checkpoint to iteration 4, and its log
records are what a later version of the code must reproduce when it resumes the same files.
The committed files were written by the code at commit 12b6d75 (the last one before the
trainer and the ZeRO engine were joined into one stack).
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MODEL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
         "--seq-length", "16", "--max-position-embeddings", "16"]
TRAINING = ["--batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style",
            "cosine", "--warmup-iters", "1", "--train-iters", "4", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", "--num-workers", "0",
            "--split", "90,9,1", "--threads", "1", "--seed", "1234"]

# name -> (processes, extra flags, DeepSpeed config or None)
CASES = {
    "megatron_fp32": (1, [], None),
    "megatron_fp16": (1, ["--fp16", "--initial-loss-scale", "1024"], None),
    "megatron_bf16_tp2": (2, ["--bf16", "--model-parallel-size", "2"], None),
    "zero1_bf16_dp2": (2, [], {"zero_optimization": {"stage": 1, "reduce_bucket_size": 3000},
                               "bf16": {"enabled": True}, "gradient_clipping": 1.0}),
    "zero2_fp32_dp2": (2, [], {"zero_optimization": {"stage": 2, "reduce_bucket_size": 3000},
                               "gradient_clipping": 1.0}),
    "zero3_fp32_dp2": (2, [], {"zero_optimization": {"stage": 3, "reduce_bucket_size": 3000,
                                                     "stage3_param_persistence_threshold": 0},
                               "gradient_clipping": 1.0}),
    "megatron_tiled_fp32": (1, ["--memory-centric-tiled-linear", "--tile-factor", "2"], None),
    "zero3_tiled_fp32_dp2": (2, ["--memory-centric-tiled-linear", "--tile-factor", "2"],
                             {"zero_optimization": {"stage": 3, "reduce_bucket_size": 3000,
                                                    "stage3_param_persistence_threshold": 0},
                              "gradient_clipping": 1.0}),
}
PROMPT = "The king"

_WORDS = ("the king queen lord night day love death sword crown honour heaven earth thou "
          "shall speak would come go hath good sweet fair noble brother sister father mother "
          "friend war peace gold land sea ship storm wind fire water stone").split()


def _document(rng):
    sentences = [" ".join(rng.choices(_WORDS, k=rng.randint(4, 14))).capitalize() + "."
                 for _ in range(rng.randint(4, 12))]
    return " ".join(sentences)


def _run(command, env=None):
    print("+", " ".join(str(c) for c in command), flush=True)
    subprocess.run([str(c) for c in command], cwd=REPO, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _python(script, *args):
    _run([sys.executable, REPO / script, *args])


def _trainer(nproc, *args):
    if nproc == 1:
        _python("pretrain_gpt2.py", *args)
    else:
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
              nproc, REPO / "pretrain_gpt2.py", *args])


def make_data(out):
    """A 512-token BPE tokenizer and a .bin/.idx of 80 synthetic documents."""
    rng = random.Random(0)
    data = out / "data"
    data.mkdir(parents=True)
    with open(data / "corpus.json", "w") as f:
        for _ in range(80):
            f.write(json.dumps({"text": _document(rng)}) + "\n")
    _python("tools/train_tokenizer.py", "--input", data / "corpus.json", "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-size", "512", "--output-dir", data)
    _python("tools/preprocess_data.py", "--input", data / "corpus.json", "--output-prefix",
            data / "corpus", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            data / "vocab.json", "--merge-file", data / "merges.txt", "--append-eod",
            "--workers", "1")
    (data / "corpus.json").unlink()


def data_flags(root):
    data = Path(root) / "data"
    return ["--data-path", data / "corpus_text_document", "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", data / "vocab.json", "--merge-file",
            data / "merges.txt"]


def case_flags(name, root):
    nproc, extra, config = CASES[name]
    flags = MODEL + TRAINING + data_flags(root) + extra
    if config is not None:
        flags += ["--deepspeed", "--deepspeed_config", Path(root) / "configs" / f"{name}.json"]
    return nproc, flags


def read_records(log_dir):
    with open(Path(log_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if "lm_loss" in line]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "tests" / "compat" / "fixtures"))
    out = Path(parser.parse_args().output)
    if out.exists():
        shutil.rmtree(out)
    make_data(out)
    (out / "configs").mkdir()
    expected = {"cases": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name, (nproc, _, config) in CASES.items():
            if config is not None:
                (out / "configs" / f"{name}.json").write_text(json.dumps(config, indent=1))
            nproc, flags = case_flags(name, out)
            save = out / "checkpoints" / name
            _trainer(nproc, *flags, "--save", save, "--exit-interval", "2",
                     "--log-dir", Path(scratch) / name / "first")
            resumed = Path(scratch) / name / "resumed"
            _trainer(nproc, *flags, "--load", save, "--log-dir", resumed)
            expected["cases"][name] = [r for r in read_records(resumed) if r["iteration"] > 2]
    # A Hugging Face folder converted from the fp32 checkpoint, and what greedy generation
    # prints from both.
    hf = out / "checkpoints" / "hf_from_megatron_fp32"
    _python("tools/convert_checkpoint.py", "--load-dir", out / "checkpoints" / "megatron_fp32",
            "--save-dir", hf, "--saver", "hf")
    for source in ("megatron_fp32", "hf_from_megatron_fp32"):
        samples = out / f"{source}_samples.jsonl"
        prompts = out / "prompt.txt"
        prompts.write_text(PROMPT + "\n")
        _python("tools/generate_samples.py", "--load", out / "checkpoints" / source,
                "--vocab-file", out / "data" / "vocab.json", "--merge-file",
                out / "data" / "merges.txt", "--greedy", "--out-seq-length", "12",
                "--sample-input-file", prompts, "--sample-output-file", samples)
        expected.setdefault("generation", {})[source] = \
            [json.loads(line) for line in samples.read_text().splitlines()]
        samples.unlink()
        prompts.unlink()
    for made_by_training in (*out.glob("data/*_indexmap_*"),
                             *out.glob("checkpoints/*/zero_to_fp32.py")):  # not needed to load
        made_by_training.unlink()
    expected["prompt"] = PROMPT
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
