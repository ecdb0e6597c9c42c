#!/usr/bin/env bash
# Generate text from a checkpoint (tools/generate_samples.py).  Defaults to the checkpoint the
# default training run (scripts/pretrain_gpt2.sh) writes; run that first.
#
#   bash scripts/generate_text.sh                         # interactive: type prompts, `stop` exits
#   bash scripts/generate_text.sh --sample-input-file prompts.txt --sample-output-file out.jsonl
#   bash scripts/generate_text.sh --num-samples 4 --genfile samples.jsonl
#   MP_SIZE=2 bash scripts/generate_text.sh ...           # tensor-parallel, via torchrun
#   bash scripts/generate_text.sh --quantize int8         # int8 weights (also int8-dynamic, int4)
#
# Variables: CHECKPOINT_DIR (default checkpoints/gpt2_small; Megatron, --deepspeed or Hugging
# Face layout), MP_SIZE (1), TOP_K (40), TEMPERATURE (1.0; neither is passed with --greedy),
# OUT_SEQ_LENGTH (64, small for a 2-core CPU).  Extra arguments go to tools/generate_samples.py
# (e.g. --greedy, --recompute).
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"
take_script_flags CHECKPOINT_DIR=--load -- "$@"  # --load among the arguments is the checkpoint
from_callers_folder CHECKPOINT_DIR
require_whole 1 MP_SIZE OUT_SEQ_LENGTH
require_whole 0 TOP_K
require_number TEMPERATURE
PY="${VENV:-$ROOT/.venv}/bin/python"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$ROOT/checkpoints/gpt2_small}"
MP_SIZE="${MP_SIZE:-1}"
if [ ! -d "$CHECKPOINT_DIR" ]; then
    echo "error: no checkpoint at $CHECKPOINT_DIR; train one with bash scripts/pretrain_gpt2.sh" >&2
    exit 2
fi
ARGS=(--load "$CHECKPOINT_DIR" --model-parallel-size "$MP_SIZE"
      --out-seq-length "${OUT_SEQ_LENGTH:-64}")
# Sampling defaults, unless --greedy is asked for (which takes no sampling flags; a TOP_K or
# TEMPERATURE set with it still goes through, for the tool to refuse)
GREEDY=0
TOP_P_GIVEN=0
for arg in "$@"; do
    case "$arg" in
        --greedy) GREEDY=1 ;;
        --top_p|--top-p|--top_p=*|--top-p=*) TOP_P_GIVEN=1 ;;  # (the alternative to top-k)
    esac
done
if { [ "$GREEDY" = 0 ] && [ "$TOP_P_GIVEN" = 0 ]; } || [ -n "${TOP_K+set}" ]; then
    ARGS+=(--top_k "${TOP_K:-40}")
fi
if [ "$GREEDY" = 0 ] || [ -n "${TEMPERATURE+set}" ]; then
    ARGS+=(--temperature "${TEMPERATURE:-1.0}")
fi
if [ "$MP_SIZE" -gt 1 ]; then
    torchrun_command
    exec "${TORCHRUN[@]}" --standalone --nproc_per_node "$MP_SIZE" \
        "$ROOT/tools/generate_samples.py" "${ARGS[@]}" "$@"
fi
exec "$PY" "$ROOT/tools/generate_samples.py" "${ARGS[@]}" "$@"
