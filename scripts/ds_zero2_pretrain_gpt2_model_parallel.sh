#!/usr/bin/env bash
# Pretrain the small GPT-2 with ZeRO stage 2 over data-parallel processes, optionally with
# tensor (model) parallelism, launched by torchrun (Megatron-DeepSpeed's
# ds_zero2_pretrain_gpt2_model_parallel.sh).
#
#   bash scripts/ds_zero2_pretrain_gpt2_model_parallel.sh   # 2 CPU processes here: MP 1 x DP 2
#   MP_SIZE=2 GPUS_PER_NODE=8 bash scripts/ds_zero2_pretrain_gpt2_model_parallel.sh   # TP 2 x DP 4
#
# This is pretrain_gpt2_distributed.sh (torchrun, multi-node variables, data preparation via
# scripts/prepare_default_data.sh; every variable of it works here) plus
#     --deepspeed --deepspeed_config $DS_CONFIG [--zero-stage $ZERO_STAGE]
# Variables of this script:
#   MP_SIZE     tensor-parallel size.  Default: 2 on a machine with GPUs (the original used 4),
#               1 without, so that the 2 CPU processes of a 2-core machine are 2 data-parallel
#               ranks and ZeRO-2 really partitions the optimizer states and gradients over
#               them (MP_SIZE=2 here runs too: TP 2 x DP 1, where ZeRO has nothing to split).
#   DS_CONFIG=scripts/ds_zero_stage_2.config   fixes the micro batch per process
#               (train_micro_batch_size_per_gpu 8), accumulation (1), bf16 and clipping (1.0);
#               MICRO_BATCH, GLOBAL_BATCH (= 8 x data-parallel size) and PRECISION must agree
#               with it.  scripts/ds_zero_stage_1.config and ds_zero_stage_3.config work too
#               (stage 3: the model is built under zero.Init, parameters partitioned over DP).
#   ZERO_STAGE  0, 1, 2 or 3: --zero-stage, overriding the config's zero_optimization.stage
#   TRAIN_ITERS=150  CHECKPOINT_DIR=checkpoints/gpt2_small_zero2_mp$MP_SIZE
#   RUN_DIR=runs/gpt2_small_zero2_mp$MP_SIZE
# Checkpoints: DeepSpeed's layout, one model-states file per tensor-parallel rank and one
# optimizer-state partition per (data-parallel, tensor-parallel) rank:
#   global_step<N>/mp_rank_{mp:02d}_model_states.pt,
#   global_step<N>/bf16_zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt, latest,
#   zero_to_fp32.py; they load at another data-parallel size.
#
# Compute arithmetic for the defaults on a 2-core machine without GPUs (2 processes, DP=2):
#   params N ~ 12*L*h^2 + (V + S)*h = 13.9M (pretrain_gpt2.sh's model)
#   tokens   = TRAIN_ITERS * GLOBAL_BATCH * SEQ_LEN = 150 * (8*2) * 256 = 614k (pretrain_gpt2.sh's)
#   FLOPs    ~ 6*N*tokens + attention ~ 5.4e13, half per process (one core each), plus per
#            iteration a reduce-scatter of the 13.9M gradients and an all-gather of the weights.
#   Memory   per process: fp32 masters + Adam moments are split in 2 (12 bytes/param / 2 =
#            83 MB instead of 167 MB); stage 2 also keeps only half of the fp32 gradients.
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"  # pretrain_gpt2_distributed.sh checks its own variables
from_callers_folder DS_CONFIG
take_trainer_flags "$@"  # before the defaults below: --batch-size 4 is MICRO_BATCH=4
require_one_of ZERO_STAGE 0 1 2 3

if [ -z "${MP_SIZE:-}" ]; then
    MP_SIZE=1
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        MP_SIZE=2
    fi
fi
export MP_SIZE
DS_CONFIG="${DS_CONFIG:-$ROOT/scripts/ds_zero_stage_2.config}"
export MICRO_BATCH="${MICRO_BATCH:-8}"  # = train_micro_batch_size_per_gpu in $DS_CONFIG
export PRECISION="${PRECISION:-bf16}"   # = the config's bf16.enabled
export TRAIN_ITERS="${TRAIN_ITERS:-150}"
export CHECKPOINT_DIR="${CHECKPOINT_DIR:-$ROOT/checkpoints/gpt2_small_zero2_mp$MP_SIZE}"
export RUN_DIR="${RUN_DIR:-$ROOT/runs/gpt2_small_zero2_mp$MP_SIZE}"

DS_ARGS=(--deepspeed --deepspeed_config "$DS_CONFIG")
if [ -n "${ZERO_STAGE:-}" ]; then
    DS_ARGS+=(--zero-stage "$ZERO_STAGE")
fi
exec bash "$ROOT/scripts/pretrain_gpt2_distributed.sh" "${DS_ARGS[@]}" "$@"
