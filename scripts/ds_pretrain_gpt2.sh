#!/usr/bin/env bash
# Pretrain the small GPT-2 of pretrain_gpt2.sh in one process through the zero engine
# (ZeRO stage 2 from a DeepSpeed JSON config), as Megatron-DeepSpeed's ds_pretrain_gpt2.sh.
#
#   bash scripts/ds_pretrain_gpt2.sh
#   ZERO_STAGE=1 bash scripts/ds_pretrain_gpt2.sh          # --zero-stage 1 overrides the config
#   DS_CONFIG=scripts/ds_zero_stage_1.config bash scripts/ds_pretrain_gpt2.sh
#
# This is pretrain_gpt2.sh (same data preparation via scripts/prepare_default_data.sh, same
# model and schedule, every variable of it works here) plus
#     --deepspeed --deepspeed_config $DS_CONFIG [--zero-stage $ZERO_STAGE]
# with its own checkpoint and log directories.  Variables of this script:
#   DS_CONFIG=scripts/ds_zero_stage_2.config   the DeepSpeed JSON; it fixes the micro batch
#              (train_micro_batch_size_per_gpu 8), accumulation (1), precision (bf16) and
#              clipping (1.0), and MICRO_BATCH/GLOBAL_BATCH/PRECISION must agree with it (a
#              clear error names both values otherwise).  DS_CONFIG=scripts/ds_zero_stage_3.config
#              trains with ZeRO stage 3 (the model is built under zero.Init).
#   ZERO_STAGE  0, 1, 2 or 3: --zero-stage, overriding the config's zero_optimization.stage
#   REMOTE_DEVICE  none, cpu or nvme (stage 3): --remote-device, where the parameter partitions
#              live (nvme: a config with offload_param nvme, e.g. ds_zero_infinity.config)
#   CHECKPOINT_DIR=checkpoints/gpt2_small_<config>[_stage<ZERO_STAGE>][_remote_<REMOTE_DEVICE>]
#   RUN_DIR=runs/(the same name): one folder per configuration (e.g. gpt2_small_ds_zero_stage_2,
#              gpt2_small_ds_zero_stage_2_stage1), since the script resumes from its folder.
#              To move a run to another ZeRO stage with its optimizer state, point the new
#              stage at its folder: CHECKPOINT_DIR=checkpoints/gpt2_small_ds_zero_stage_2
#              ZERO_STAGE=3 TRAIN_ITERS=600 bash scripts/ds_pretrain_gpt2.sh
# Checkpoints are DeepSpeed's layout (global_step<N>/mp_rank_00_model_states.pt,
# [bf16_]zero_pp_rank_0_mp_rank_00_optim_states.pt (bf16_ with the default config), latest,
# zero_to_fp32.py) plus Megatron's latest_checkpointed_iteration.txt; running the script
# again resumes from them.
#
# In one process ZeRO has one data-parallel rank to partition over, so stages 0-2 hold the same
# memory here; the point is the same command line and checkpoint layout as on a cluster
# (ds_zero2_pretrain_gpt2_model_parallel.sh partitions over 2 processes).
# Compute arithmetic (pretrain_gpt2.sh's defaults, printed again at start-up):
#   params N ~ 12*L*h^2 + (V + S)*h = 12*6*384^2 + (8192+256)*384 = 13.9M
#   tokens   = TRAIN_ITERS * GLOBAL_BATCH * SEQ_LEN = 300 * 8 * 256 = 614k
#   FLOPs    ~ 6*N*tokens + attention ~ 5.4e13: about 3-5 minutes on 2 CPU cores in bf16.
#   Memory   the engine keeps fp32 masters + Adam moments (12 bytes/param, 167 MB) beside the
#            bf16 weights and gradients (4 bytes/param, 56 MB).
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"  # pretrain_gpt2.sh checks its own variables
from_callers_folder DS_CONFIG
take_trainer_flags "$@"  # before the defaults below: --batch-size 4 is MICRO_BATCH=4
require_one_of ZERO_STAGE 0 1 2 3
require_one_of REMOTE_DEVICE none cpu nvme

DS_CONFIG="${DS_CONFIG:-$ROOT/scripts/ds_zero_stage_2.config}"
export MICRO_BATCH="${MICRO_BATCH:-8}"  # = train_micro_batch_size_per_gpu in $DS_CONFIG
export PRECISION="${PRECISION:-bf16}"   # = the config's bf16.enabled
CONFIG_NAME="$(basename "$DS_CONFIG")"; CONFIG_NAME="${CONFIG_NAME%.*}"
RUN_NAME="gpt2_small_${CONFIG_NAME}${ZERO_STAGE:+_stage$ZERO_STAGE}${REMOTE_DEVICE:+_remote_$REMOTE_DEVICE}"
export CHECKPOINT_DIR="${CHECKPOINT_DIR:-$ROOT/checkpoints/$RUN_NAME}"
export RUN_DIR="${RUN_DIR:-$ROOT/runs/$RUN_NAME}"

DS_ARGS=(--deepspeed --deepspeed_config "$DS_CONFIG")
if [ -n "${ZERO_STAGE:-}" ]; then
    DS_ARGS+=(--zero-stage "$ZERO_STAGE")
fi
if [ -n "${REMOTE_DEVICE:-}" ]; then
    DS_ARGS+=(--remote-device "$REMOTE_DEVICE")
fi
exec bash "$ROOT/scripts/pretrain_gpt2.sh" "${DS_ARGS[@]}" "$@"
