#!/usr/bin/env bash
# Zero-shot evaluation (tools/evaluate_gpt2.py): WikiText-103 perplexity with overlapping
# windows and LAMBADA accuracy (--strict-lambada).
#
#   bash scripts/evaluate_zeroshot_gpt2.sh
#   WIKITEXT_FILE=wikitext-103/wiki.test.tokens LAMBADA_FILE=lambada/lambada_test.jsonl \
#       CHECKPOINT_DIR=hf/gpt2 SEQ_LEN=1024 bash scripts/evaluate_zeroshot_gpt2.sh
#
# Defaults, so it runs on a 2-core CPU right after scripts/pretrain_gpt2.sh:
#   CHECKPOINT_DIR = checkpoints/gpt2_small (the default training run's checkpoint)
#   WIKITEXT_FILE / LAMBADA_FILE: when not given, SMALL STAND-INS are derived from the default
#     corpus's held-out documents (the last NUM_DOCUMENTS=1 scenes of data/webtext/data.json;
#     tools/make_zeroshot_files.py) into data/zeroshot/.  Their numbers are not comparable
#     with published WikiText-103/LAMBADA results; give the real files for that.
#   SEQ_LEN = the model's max positions; OVERLAP = 128 (Megatron's --overlapping-eval is 32,
#     4x the compute), at most SEQ_LEN when SEQ_LEN is given (a scaled-down model's windows
#     then do not overlap); MP_SIZE = 1 (>1 runs under torchrun).
# Extra arguments go to both evaluations.
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"
take_script_flags CHECKPOINT_DIR=--load -- "$@"  # --load among the arguments is the checkpoint
from_callers_folder CHECKPOINT_DIR WIKITEXT_FILE LAMBADA_FILE CORPUS_JSON
require_whole 1 MP_SIZE OVERLAP SEQ_LEN NUM_DOCUMENTS
PY="${VENV:-$ROOT/.venv}/bin/python"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$ROOT/checkpoints/gpt2_small}"
MP_SIZE="${MP_SIZE:-1}"
OVERLAP="${OVERLAP:-$(( ${SEQ_LEN:-128} < 128 ? ${SEQ_LEN:-128} : 128 ))}"
if [ ! -d "$CHECKPOINT_DIR" ]; then
    echo "error: no checkpoint at $CHECKPOINT_DIR; train one with bash scripts/pretrain_gpt2.sh" >&2
    exit 2
fi
if [ -z "${WIKITEXT_FILE:-}" ] || [ -z "${LAMBADA_FILE:-}" ]; then
    ZS_DIR="$ROOT/data/zeroshot"
    CORPUS_JSON="${CORPUS_JSON:-$ROOT/data/webtext/data.json}"
    MADE_FROM="$CORPUS_JSON, NUM_DOCUMENTS=${NUM_DOCUMENTS:-1}"  # remade when either changes
    if [ ! -f "$ZS_DIR/wiki.test.tokens" ] || [ ! -f "$ZS_DIR/lambada_test.jsonl" ] || \
            [ "$(cat "$ZS_DIR/made_from" 2>/dev/null)" != "$MADE_FROM" ]; then
        if [ ! -f "$CORPUS_JSON" ]; then
            echo "error: no corpus at $CORPUS_JSON to derive stand-in evaluation files from" \
                 "(CORPUS_JSON); run bash scripts/pretrain_gpt2.sh first, or give" \
                 "WIKITEXT_FILE and LAMBADA_FILE" >&2
            exit 2
        fi
        "$PY" "$ROOT/tools/make_zeroshot_files.py" --input "$CORPUS_JSON" \
            --output-dir "$ZS_DIR" --num-documents "${NUM_DOCUMENTS:-1}" --max-passages 50
        echo "$MADE_FROM" > "$ZS_DIR/made_from"
    fi
    WIKITEXT_FILE="${WIKITEXT_FILE:-$ZS_DIR/wiki.test.tokens}"
    LAMBADA_FILE="${LAMBADA_FILE:-$ZS_DIR/lambada_test.jsonl}"
fi
LAUNCH=("$PY")
if [ "$MP_SIZE" -gt 1 ]; then
    torchrun_command
    LAUNCH=("${TORCHRUN[@]}" --standalone --nproc_per_node "$MP_SIZE")
fi
COMMON=(--load "$CHECKPOINT_DIR" --model-parallel-size "$MP_SIZE")
[ -n "${SEQ_LEN:-}" ] && COMMON+=(--seq-length "$SEQ_LEN")
"${LAUNCH[@]}" "$ROOT/tools/evaluate_gpt2.py" --task WIKITEXT103 --valid-data "$WIKITEXT_FILE" \
    --overlapping-eval "$OVERLAP" "${COMMON[@]}" "$@"
"${LAUNCH[@]}" "$ROOT/tools/evaluate_gpt2.py" --task LAMBADA --valid-data "$LAMBADA_FILE" \
    --strict-lambada "${COMMON[@]}" "$@"
