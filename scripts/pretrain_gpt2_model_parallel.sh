#!/usr/bin/env bash
# Pretrain the small GPT-2 with tensor (model) parallelism: each layer's weights are split
# over MP_SIZE adjacent processes (Megatron's scripts/pretrain_gpt2_model_parallel.sh).
#
#   bash scripts/pretrain_gpt2_model_parallel.sh               # MP_SIZE=2 over 2 processes here
#   MP_SIZE=4 NHEADS=8 GPUS_PER_NODE=8 bash scripts/pretrain_gpt2_model_parallel.sh  # TP4 x DP2
#   MP_SIZE=1 PP_SIZE=2 bash scripts/pretrain_gpt2_model_parallel.sh          # 2 pipeline stages
#   MP_SIZE=2 PP_SIZE=2 GPUS_PER_NODE=8 bash scripts/pretrain_gpt2_model_parallel.sh  # TP2xPP2xDP2
#   MP_SIZE=1 PP_SIZE=2 VP_LAYERS=1 bash ...                   # interleaved 1F1B, 3 chunks a stage
#
# PP_SIZE splits the layers over pipeline stages (Megatron's --pipeline-model-parallel-size):
# the embeddings on the first, the output layer on the last, the 1F1B schedule over the
# micro batches of the global batch (4 x PP_SIZE micro batches of 1 sample by default: the
# tokens per iteration of the other scripts; raise MICRO_BATCH on GPUs). Pipeline stages are the
# outer dimension of the rank order, so they may span nodes while each stage's tensor-parallel
# group stays on one. Checkpoints then hold iter_*/mp_rank_TT_PPP; `--load` of a checkpoint
# saved at other MP_SIZE / PP_SIZE converts it as it loads.
#
# This is pretrain_gpt2_distributed.sh with MP_SIZE=2, a micro batch of 8 per tensor-parallel
# group and its own checkpoint directory; every variable of that script works here too
# (GPUS_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, RDZV_ENDPOINT, RDZV_ID, sizes,
# paths), and so does running the same script on every node.  Keep MP_SIZE <= GPUS_PER_NODE:
# tensor-parallel groups are adjacent ranks, so they stay inside a node, on its fastest links.
# MP_SIZE must divide NHEADS (and the hidden and MLP sizes); the vocabulary is padded to a
# multiple of 128 x MP_SIZE.  Checkpoints hold one file per tensor-parallel rank
# (iter_*/mp_rank_00, mp_rank_01, ...); tools/merge_mp_partitions.py changes MP_SIZE of one.
#
# Compute arithmetic for the defaults on a 2-core machine without GPUs (2 processes, TP=2, DP=1):
#   params N ~ 13.9M (as pretrain_gpt2.sh); 7.0M per process, of which 0.1M (position
#            embeddings, LayerNorms, the biases added after a reduction) are replicated
#   tokens   = TRAIN_ITERS * GLOBAL_BATCH * SEQ_LEN = 300 * 8 * 256 = 614k
#   FLOPs    ~ 5.4e13 in all, half per process, plus per layer two all-reduces of the
#            [s, b, h] activations in forward and two in backward (256 * 8 * 384 values each).
#            Measured 1.5-2.3 s per iteration on the 2 cores while shared with other work:
#            about 10 minutes.
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"  # pretrain_gpt2_distributed.sh checks the others
take_trainer_flags "$@"  # before the defaults below: --batch-size 4 is MICRO_BATCH=4
require_whole 1 MP_SIZE PP_SIZE

export MP_SIZE="${MP_SIZE:-2}"
export PP_SIZE="${PP_SIZE:-1}"
# with stages, 4 x PP_SIZE micro batches of 1 sample: the default run's tokens per iteration
if (( PP_SIZE > 1 )); then
    export MICRO_BATCH="${MICRO_BATCH:-1}"; NAME="gpt2_small_mp${MP_SIZE}_pp$PP_SIZE"
else
    export MICRO_BATCH="${MICRO_BATCH:-8}"; NAME="gpt2_small_mp$MP_SIZE"
fi
export CHECKPOINT_DIR="${CHECKPOINT_DIR:-$ROOT/checkpoints/$NAME}"
export RUN_DIR="${RUN_DIR:-$ROOT/runs/$NAME}"
exec bash "$ROOT/scripts/pretrain_gpt2_distributed.sh" "$@"
