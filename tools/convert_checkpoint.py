"""Convert GPT-2 checkpoints between Megatron, DeepSpeed and Hugging Face formats.

    # Megatron (any TP x PP size) or --deepspeed (any ZeRO stage / TP / DP) -> Hugging Face
    python tools/convert_checkpoint.py --load-dir checkpoints/gpt2_small \
        --save-dir hf/gpt2_small --saver hf
    # Hugging Face GPT-2 -> Megatron at TP=2 x PP=2, to continue pretraining it
    python tools/convert_checkpoint.py --load-dir hf/gpt2 --save-dir checkpoints/gpt2_tp2 \
        --saver megatron --target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 2

Flags follow Megatron's tools/checkpoint/convert.py.  The source format is detected from the
directory when --loader is omitted.  Everything goes through one full, unsharded model with
flat Megatron keys (megatron/convert/loaders.py, savers.py; the HF key map is in hf.py).
A Megatron target is a `release` checkpoint holding the model's arguments and tokenizer
files: `pretrain_gpt2.py --load DIR` takes the model flags from it and starts from its weights
at iteration 0 (weights only: to change the TP size of a training run keeping its optimizer
state, use tools/merge_mp_partitions.py).  Conversions are exact in fp32.
"""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.cli import run_cli  # noqa: E402
from megatron.convert.checkpoint_files import trainer_command  # noqa: E402
from megatron.convert.hf import HF_TOKENIZER_FILES  # noqa: E402
from megatron.convert.loaders import FORMATS, load_model_weights  # noqa: E402
from megatron.convert.savers import SAVERS, check_save_dir, save_model_weights  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--load-dir", required=True, help="checkpoint folder to read")
    parser.add_argument("--save-dir", required=True, help="new, empty folder to write")
    parser.add_argument("--iteration", type=int, default=None,
                        help="the iteration to convert (default: the one the tracker names)")
    parser.add_argument("--loader", choices=FORMATS, default=None,
                        help="source format (default: detected from --load-dir)")
    parser.add_argument("--saver", choices=SAVERS, required=True, help="target format")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1,
                        help="TP size of a --saver megatron checkpoint (default 1)")
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=1,
                        help="pipeline stages of a --saver megatron checkpoint (default 1)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                        help="dtype of the written weights (default fp32)")
    group = parser.add_argument_group("the unpadded vocab size (to drop the padding rows): "
                                      "checkpoints saved since orig_vocab_size existed "
                                      "record it; an HF folder's tokenizer files give it")
    group.add_argument("--vocab-size", type=int, default=None, help="unpadded vocab size")
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    return parser.parse_args(argv)


def run(args):
    if args.iteration is not None and args.iteration < 0:
        raise ConfigError(f"--iteration must be at least 0, got {args.iteration}")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ConfigError(f"--vocab-size must be positive, got {args.vocab_size}")
    check_save_dir(args.save_dir)
    tokenizer_files = {k: v for k, v in (("vocab_file", args.vocab_file),
                                         ("merge_file", args.merge_file),
                                         ("tokenizer_model", args.tokenizer_model)) if v}
    for key, path in tokenizer_files.items():
        if not os.path.isfile(path):
            raise ConfigError(f"--{key.replace('_', '-')} {path} does not exist")
    if args.tokenizer_model and (args.vocab_file or args.merge_file):
        raise ConfigError("--tokenizer-model (SentencePiece) and --vocab-file/--merge-file "
                          "(GPT-2 BPE) are two tokenizers: give the one the model was trained "
                          "with")
    weights = load_model_weights(args.load_dir, args.loader, args.vocab_size,
                                 tokenizer_files or None, args.iteration)
    _check_tokenizer_kind(weights.args.get("tokenizer_type"), tokenizer_files)
    weights.args.update({k: os.path.abspath(v) for k, v in tokenizer_files.items()})
    if tokenizer_files and not weights.args.get("tokenizer_type"):
        weights.args["tokenizer_type"] = ("SentencePieceTokenizer" if args.tokenizer_model
                                          else "GPT2BPETokenizer")
    made = not os.path.exists(args.save_dir)  # else an empty folder (check_save_dir)
    try:
        paths = save_model_weights(weights, args.save_dir, args.saver,
                                   args.target_tensor_parallel_size, _DTYPES[args.dtype],
                                   args.target_pipeline_model_parallel_size)
    except BaseException:  # an error or Ctrl-C: no half-converted folder to trip over later
        _empty(args.save_dir, remove=made)
        raise
    a = weights.args
    print(f" converted {args.load_dir} ({weights.source_format}, iteration {weights.iteration}) "
          f"-> {args.save_dir} ({args.saver})")
    print(f" model: {a['num_layers']} layers, hidden {a['hidden_size']}, "
          f"{a['num_attention_heads']} heads, ffn {a['ffn_hidden_size']}, vocab "
          f"{weights.vocab_size}, positions {a['max_position_embeddings']}")
    for note in weights.notes:
        print(f" note: {note}")
    print(f" wrote {len(paths)} file(s)")
    if args.saver == "hf":
        _say_what_tokenizer_the_hf_folder_holds(a, args.save_dir)
    if args.saver == "megatron":
        # The checkpoint records the model's shape and tokenizer: --load supplies them.
        command = trainer_command(args.save_dir, args.target_tensor_parallel_size,
                                  args.target_pipeline_model_parallel_size)
        tokenizer = "" if a.get("tokenizer_type") else \
            " --tokenizer-type ... --vocab-file ... --merge-file ... (none recorded)"
        print(f" continue pretraining with: {command}{tokenizer} "
              "--data-path ... --batch-size ... --train-iters ... --lr ... (the weights "
              "only: training starts at iteration 0 with a fresh optimizer and learning-rate "
              "schedule; for a training run's checkpoint tools/merge_mp_partitions.py keeps "
              "its optimizer and iteration)")


def _check_tokenizer_kind(recorded, given):
    """Files of the other kind than the checkpoint's tokenizer would be copied and never
    read (or read as the wrong one)."""
    sentencepiece = "tokenizer_model" in given
    if given and recorded in ("GPT2BPETokenizer", "SentencePieceTokenizer") and \
            (recorded == "SentencePieceTokenizer") != sentencepiece:
        needs = "--tokenizer-model" if recorded == "SentencePieceTokenizer" else \
            "--vocab-file and --merge-file"
        raise ConfigError(f"the checkpoint was trained with a {recorded}: give its {needs}, "
                          f"not {', '.join('--' + k.replace('_', '-') for k in given)}")


def _say_what_tokenizer_the_hf_folder_holds(model_args, save_dir):
    names = HF_TOKENIZER_FILES.get(model_args.get("tokenizer_type"), {}).values()
    if not names or not all(os.path.isfile(os.path.join(save_dir, n)) for n in names):
        print(f" note: {save_dir} holds no tokenizer (the checkpoint records none, or its "
              "files are gone): give --vocab-file and --merge-file, or --tokenizer-model, to "
              "copy one in")
    elif model_args["tokenizer_type"] == "SentencePieceTokenizer":
        print(f" note: the SentencePiece model is {os.path.join(save_dir, 'tokenizer.model')}; "
              "Hugging Face's GPT-2 tokenizer classes do not read it: tokenize with "
              "sentencepiece.SentencePieceProcessor(model_file=...). This tool and the "
              "generation and evaluation tools read it back from the folder")


def _empty(folder, remove):
    """Delete what a failed conversion wrote into `folder` (empty before), and the folder
    itself if the conversion made it."""
    if not os.path.isdir(folder):
        return
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def main(argv=None):
    return run_cli(lambda: run(get_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
