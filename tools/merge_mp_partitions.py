"""Change the tensor-parallel size and the pipeline stages of a Megatron-layout checkpoint:
TP N x PP P -> TP M x PP Q, any sizes the model allows.

    python tools/merge_mp_partitions.py --load checkpoints/gpt2 --target-model-parallel-size 1
    # writes checkpoints/gpt2_mp1/{latest_checkpointed_iteration.txt, iter_XXXXXXX/mp_rank_00/}
    python pretrain_gpt2.py --load checkpoints/gpt2_mp1 --model-parallel-size 1 ...
    python tools/merge_mp_partitions.py --load checkpoints/gpt2 --target-model-parallel-size 2 \
        --target-pipeline-model-parallel-size 2     # -> checkpoints/gpt2_mp2_pp2/.../mp_rank_TT_PPP

The data-parallel size is not part of this layout (data-parallel rank 0 writes each file), so a
checkpoint resumes at any data-parallel size as it is.

The source size is read from the checkpoint.  Model weights, Adam moments and fp32 master
weights are all converted, so training continues where it stopped.  The vocab padding
(a multiple of --make-vocab-size-divisible-by x TP) is redone for the target size, which needs
the unpadded vocab size: it comes from the tokenizer files recorded in the checkpoint, or
from --vocab-file/--merge-file/--tokenizer-model, or --vocab-size.  Trained padding rows are
kept where the target has them and new ones are zeros; padding logits enter the softmax, so
the loss is unchanged when the padded size stays the same and rises a little when it grows
(by about log(new padded / old padded) for an untrained model, less once training sharpens
the real logits).

--deepspeed: the source is a `pretrain_gpt2.py --deepspeed` checkpoint (DeepSpeed's layout:
<load>/latest, <load>/global_stepN/, any ZeRO stage and data-parallel size). Each TP rank's
fp32 weights are consolidated over the ZeRO partitions (zero's get_fp32_state_dict_from_zero_
checkpoint), then resharded as above into a Megatron-layout checkpoint, with the optimizer
state (fp32 masters and Adam moments, read parameter by parameter out of the partitions of
each pipeline stage; not with tiled linears, whose state ZeRO keeps per tile: then resume
with --no-load-optim). Resume it without --deepspeed, or under --deepspeed with
--finetune (the weights only):

    python tools/merge_mp_partitions.py --deepspeed --load checkpoints/ds --save ckpt_mp2 \
        --target-model-parallel-size 2

A Megatron-DeepSpeed --deepspeed checkpoint (its pickled arguments, Megatron-LM 2.x's names)
converts the same way, its fp32 masters and Adam moments read out of DeepSpeed's ZeRO files
(stages 1-3; their pickled DeepSpeed classes are read as plain values, no code runs) and its
learning-rate schedule counted in iterations; not its RNG states (resume with --no-load-rng),
nor the optimizer state of a ZeRO stage 0 checkpoint (the weights only). With pipeline
stages each stage's ZeRO files are read and the stages joined.

RNG states: every target rank gets rank 0's python/numpy/torch generators (identical on all
TP ranks anyway); the per-rank attention-dropout stream continues on ranks that existed and
is re-derived from --seed for new ones, as the trainer seeds them.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpointing.megatron_lm import MEGATRON_DEEPSPEED  # noqa: E402
from megatron.convert import read_sharded_checkpoint, reshard_checkpoint  # noqa: E402
from megatron.convert.checkpoint_files import trainer_command  # noqa: E402
from megatron.convert.deepspeed_source import read_deepspeed_checkpoint  # noqa: E402
from megatron.cli import run_cli  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True,
                        help="checkpoint directory (holds latest_checkpointed_iteration.txt)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration to convert (default: the one the tracker names)")
    parser.add_argument("--deepspeed", action="store_true",
                        help="the source was saved by pretrain_gpt2.py --deepspeed (ZeRO "
                             "partitions in DeepSpeed's layout); output a Megatron layout")
    parser.add_argument("--target-model-parallel-size", type=int, default=1,
                        help="tensor-parallel size to convert to (default 1: merge)")
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=1,
                        help="pipeline stages to convert to (default 1: join the stages)")
    parser.add_argument("--model-parallel-size", type=int, default=None,
                        help="the SOURCE size (Megatron's flag); optional, it is read from the "
                             "checkpoint and must agree")
    parser.add_argument("--save", default=None,
                        help="output directory (default: <load>_mp<target size>); must not "
                             "already hold the same iteration")
    group = parser.add_argument_group("vocab size (to redo the vocab padding)")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="the tokenizer's vocab size, unpadded")
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    args = parser.parse_args(argv)
    if args.save is None:
        pp = args.target_pipeline_model_parallel_size
        args.save = f"{os.path.normpath(args.load)}_mp{args.target_model_parallel_size}" + \
            (f"_pp{pp}" if pp > 1 else "")
    return args


def run(args):
    if args.iteration is not None and args.iteration < 0:
        raise ConfigError(f"--iteration must be at least 0, got {args.iteration}")
    tokenizer_files = {"vocab_file": args.vocab_file, "merge_file": args.merge_file,
                       "tokenizer_model": args.tokenizer_model}
    result = reshard_checkpoint(args.load, args.save, args.target_model_parallel_size,
                                iteration=args.iteration, vocab_size=args.vocab_size,
                                tokenizer_files=tokenizer_files,
                                source_tp=args.model_parallel_size,
                                reader=read_deepspeed_checkpoint if args.deepspeed
                                else read_sharded_checkpoint,
                                target_pp=args.target_pipeline_model_parallel_size)
    name = "release" if result.release else f"iteration {result.iteration}"
    foreign = result.saved_by == MEGATRON_DEEPSPEED
    optimizer = "converted" if result.optimizer_converted else \
        "not converted (Megatron-DeepSpeed's without ZeRO partitions, stage 0): resume " \
        "with --no-load-optim" if foreign else \
        "not converted (tiled linears: ZeRO keeps it per tile): resume with --no-load-optim" \
        if args.deepspeed else "none in the source checkpoint"
    resume_flags = [flag for flag, wanted in (
        ("--no-load-optim", args.deepspeed and not result.optimizer_converted),
        ("--override-lr-scheduler", foreign and result.optimizer_converted
         and not result.schedule_converted),
        ("--no-load-rng", foreign)) if wanted]
    print("\n".join([
        f" converted {args.load} ({name}): tensor-parallel size {result.source_tp} -> "
        f"{result.target_tp}, pipeline stages {result.source_pp} -> {result.target_pp}",
        f" vocab: {result.vocab_size} tokens, padded {result.source_padded_vocab_size} -> "
        f"{result.target_padded_vocab_size}",
        f" optimizer state: {optimizer}",
        f" wrote {len(result.paths)} file(s) under {os.path.dirname(result.paths[0])}/..",
        f" resume with: {trainer_command(args.save, result.target_tp, result.target_pp)}"
        f"{''.join(' ' + flag for flag in resume_flags)} ...",
    ]), flush=True)
    return result


def main(argv=None):
    return run_cli(lambda: run(get_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
