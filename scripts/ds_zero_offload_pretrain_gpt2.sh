#!/usr/bin/env bash
# ZeRO-Offload: pretrain the small GPT-2 of pretrain_gpt2.sh through the zero engine with the
# optimizer (fp32 masters + Adam moments) stepped by CPUAdam on the host, as DeepSpeed's
# ds_zero-offload scripts do.
#
#   bash scripts/ds_zero_offload_pretrain_gpt2.sh                       # stage 2 + CPU offload
#   OFFLOAD=nvme bash scripts/ds_zero_offload_pretrain_gpt2.sh          # optimizer states in
#                                                                       # swap files (data/nvme)
#   DS_CONFIG=scripts/ds_zero_infinity.config bash scripts/ds_zero_offload_pretrain_gpt2.sh
#
# Variables (everything of ds_pretrain_gpt2.sh / pretrain_gpt2.sh works too, e.g. TRAIN_ITERS):
#   DS_CONFIG=scripts/ds_zero_offload.config  stage 2, offload_optimizer.device "cpu", bf16,
#             micro batch 8.  DS_CONFIG=scripts/ds_zero_stage_3_offload.config: stage 3 with
#             optimizer and parameters offloaded to "cpu"; DS_CONFIG=scripts/ds_zero_infinity.config:
#             stage 3 with both in NVMe swap files under data/nvme of the folder it is run
#             from, made here (ZeRO-Infinity; the model is
#             built under zero.Init straight into the swap files). Slow here (small sub-groups,
#             disk I/O on 2 cores): try TRAIN_ITERS=6 first.
#   OFFLOAD=nvme  run DS_CONFIG with offload_optimizer switched to NVMe swapping under
#             NVME_PATH (default data/nvme, git-ignored, created here), sub_group_size
#             SUB_GROUP (default 1e6 elements) and pipelined reads/writes; a generated config
#             is written to $RUN_DIR/ds_config_nvme.json.
#   CHECKPOINT_DIR=checkpoints/gpt2_small_offload_<config>[_nvme]  RUN_DIR=runs/(the same
#             name): one folder per configuration, since the script resumes from its folder
# On this CPU-only machine "cpu" offload is the same memory as compute: it still runs CPUAdam on
# separate host masters; "nvme" keeps the 12 bytes/param of optimizer state on disk instead of
# in RAM (benchmarks/offload_capacity.py measures the resident memory).
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"  # ds_pretrain_gpt2.sh and pretrain_gpt2.sh check theirs
from_callers_folder DS_CONFIG NVME_PATH RUN_DIR CHECKPOINT_DIR DATA_DIR
cd "$ROOT"
require_one_of OFFLOAD nvme
require_number SUB_GROUP

DS_CONFIG="${DS_CONFIG:-$ROOT/scripts/ds_zero_offload.config}"
CONFIG_NAME="$(basename "$DS_CONFIG")"; CONFIG_NAME="${CONFIG_NAME%.*}"
RUN_NAME="gpt2_small_offload_${CONFIG_NAME}${OFFLOAD:+_$OFFLOAD}"
export CHECKPOINT_DIR="${CHECKPOINT_DIR:-$ROOT/checkpoints/$RUN_NAME}"
export RUN_DIR="${RUN_DIR:-$ROOT/runs/$RUN_NAME}"
# A relative nvme_path in DS_CONFIG (scripts/ds_zero_infinity.config's data/nvme) is read by
# the trainer, which runs in the folder this script was run from: the swap folder is made there
if [ -f "$DS_CONFIG" ]; then
    while read -r swap_dir; do
        (cd "$CALLER_DIR" && mkdir -p "$swap_dir")
    done < <(grep -o '"nvme_path": *"[^"]*"' "$DS_CONFIG" | sed 's/.*: *"\(.*\)"$/\1/')
fi
NVME_PATH="${NVME_PATH:-$ROOT/data/nvme}"
mkdir -p "$NVME_PATH"

if [ "${OFFLOAD:-}" = "nvme" ]; then
    mkdir -p "$RUN_DIR"
    bash scripts/setup.sh  # on a fresh machine, the venv this step runs in
    "${VENV:-$ROOT/.venv}/bin/python" - "$DS_CONFIG" "$RUN_DIR/ds_config_nvme.json" "$NVME_PATH" \
        "${SUB_GROUP:-1000000}" <<'PY'
import json, sys
source, target, nvme_path, sub_group = sys.argv[1:]
config = json.load(open(source))
zero = config.setdefault("zero_optimization", {})
zero.pop("cpu_offload", None)
zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": True,
                             "pipeline_write": True, "buffer_count": 4}
zero["sub_group_size"] = int(float(sub_group))
json.dump(config, open(target, "w"), indent=2)
PY
    DS_CONFIG="$RUN_DIR/ds_config_nvme.json"
fi
exec env DS_CONFIG="$DS_CONFIG" bash "$ROOT/scripts/ds_pretrain_gpt2.sh" "$@"
