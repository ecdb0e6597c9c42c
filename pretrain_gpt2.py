"""Pretrain GPT-2 with Megatron-LM 1.1.5 flags.

    python pretrain_gpt2.py --num-layers 6 --hidden-size 384 --num-attention-heads 6 \
        --seq-length 256 --batch-size 8 --train-iters 200 --lr 6e-4 \
        --data-path data/webtext/data_text_document --tokenizer-type GPT2BPETokenizer \
        --vocab-file data/tokenizer/vocab.json --merge-file data/tokenizer/merges.txt

Multi-process: `torchrun --nproc_per_node N pretrain_gpt2.py ... --model-parallel-size M`.
"""

import sys

from megatron.cli import run_cli


def train(argv):
    # Flags first: --help, a typo or a missing flag answer before torch is imported (seconds
    # on a slow CPU).
    from megatron.config import resolve_config
    config = resolve_config(argv, defaults={"tokenizer_type": "GPT2BPETokenizer"})
    from megatron.gpt2 import forward_step, model_provider, train_valid_test_datasets_provider
    from megatron.training.pretrain import pretrain
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, config)


def main(argv=None):
    return run_cli(train, argv)


if __name__ == "__main__":
    sys.exit(main())
