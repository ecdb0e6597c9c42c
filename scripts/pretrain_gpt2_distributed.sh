#!/usr/bin/env bash
# Pretrain the small GPT-2 of pretrain_gpt2.sh with several processes per machine and on
# several machines, launched by torchrun (Megatron's scripts/pretrain_gpt2_distributed.sh).
#
#   bash scripts/pretrain_gpt2_distributed.sh    # one process per GPU, or 2 on a CPU machine
#
# Every node runs this same script; only NODE_RANK differs (or nothing, with a rendezvous):
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/pretrain_gpt2_distributed.sh
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash scripts/pretrain_gpt2_distributed.sh
#   or, with a rendezvous, on each node in any order:
#            NNODES=2 RDZV_ENDPOINT=node0:29400 RDZV_ID=run1 \
#                bash scripts/pretrain_gpt2_distributed.sh
#
# Launch variables (the original script's names):
#   GPUS_PER_NODE  processes per node (default: the GPUs torch sees; 2 CPU processes without)
#   NNODES=1 NODE_RANK=0 MASTER_ADDR=localhost MASTER_PORT=6000   (torchrun's static rendezvous)
#   RDZV_ENDPOINT=host:port RDZV_ID=gpt2_small   (when RDZV_ENDPOINT is set: torchrun's c10d
#                  rendezvous instead, hosted at that address; NODE_RANK, MASTER_* unused)
#   DISTRIBUTED_TIMEOUT_MINUTES=10  how long the rendezvous and every collective wait for a
#                  missing peer (or pass --distributed-timeout-minutes N)
#   MP_SIZE=1      tensor-parallel size (pretrain_gpt2_model_parallel.sh defaults it to 2)
#   PP_SIZE=1      pipeline stages (--pipeline-model-parallel-size; must not exceed NLAYERS);
#                  data-parallel size = NNODES * GPUS_PER_NODE / (MP_SIZE * PP_SIZE)
#   VP_LAYERS      --num-layers-per-virtual-pipeline-stage (interleaved 1F1B; unset: plain)
#   OMP_NUM_THREADS  CPU threads per process (default: cores / GPUS_PER_NODE)
# Any extra arguments are passed on to pretrain_gpt2.py (checked as its flags before the data
# steps), except the three layout flags above: they are MP_SIZE, PP_SIZE and VP_LAYERS here,
# which size the launch.  Data: scripts/prepare_default_data.sh,
# the same corpus, tokenizer and .bin/.idx as pretrain_gpt2.sh.  Every node prepares what its
# DATA_DIR lacks, so with a DATA_DIR shared by the nodes run
# `bash scripts/prepare_default_data.sh` once before launching.
#
# Sizes are pretrain_gpt2.sh's, with the micro batch per process and the global batch derived:
#   NLAYERS=6 NHIDDEN=384 NHEADS=6 SEQ_LEN=256 MICRO_BATCH=4 GLOBAL_BATCH=(micro x data-parallel,
#   times 4 x PP_SIZE with pipeline stages: 4 x PP_SIZE micro batches keep each stage's bubble
#   (P-1)/(m+P-1) near 20%)
#   TRAIN_ITERS=300 LR=1e-3 MIN_LR=(LR / 10) WARMUP_ITERS=(TRAIN_ITERS / 10) VOCAB_SIZE=8192
#   PRECISION=bf16|fp16|fp32 (default: one node measures the faster of bf16 and fp32; several
#   nodes take bf16)
#   DATA_DIR=data  CHECKPOINT_DIR=checkpoints/gpt2_small_distributed
#   RUN_DIR=runs/gpt2_small_distributed
#   LOG_INTERVAL=10 EVAL_INTERVAL=100 EVAL_ITERS=5 SAVE_INTERVAL=(the end) WORKERS=2
#   With --rampup-batch-size START INCREMENT SAMPLES (Megatron-LM's batch-size ramp) TRAIN_ITERS
#   and WARMUP_ITERS count global batches of samples: the script passes --train-samples and
#   --lr-warmup-samples, and the ramp's smaller batches make the run more iterations.
#
# Compute arithmetic for the defaults on a 2-core machine without GPUs (2 processes, DP=2):
#   params N ~ 12*L*h^2 + (V + S)*h = 12*6*384^2 + (8192+256)*384 = 10.6M + 3.2M = 13.9M
#   tokens   = TRAIN_ITERS * GLOBAL_BATCH * SEQ_LEN = 300 * (4*2) * 256 = 614k (pretrain_gpt2.sh's)
#   FLOPs    ~ 6*N*tokens (+ attention 12*L*h*S per token) ~ 5.4e13, split over the 2 processes
#              (one core each), plus per iteration an all-reduce of the 13.9M gradients.
#              Measured 1.5-1.8 s per iteration on the 2 cores while shared with other work:
#              under 10 minutes.  On 8 GPUs the global batch is 32, so 4x the tokens and FLOPs.
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"  # before any arithmetic, setup or data preparation
from_callers_folder DATA_DIR CHECKPOINT_DIR RUN_DIR
cd "$ROOT"
take_trainer_flags "$@"  # e.g. --train-iters 20: TRAIN_ITERS, and the warmup follows it
require_port MASTER_PORT
require_whole 1 NNODES MP_SIZE PP_SIZE VP_LAYERS GPUS_PER_NODE OMP_NUM_THREADS \
    NLAYERS NHIDDEN NHEADS SEQ_LEN MICRO_BATCH GLOBAL_BATCH TRAIN_ITERS VOCAB_SIZE \
    LOG_INTERVAL EVAL_INTERVAL SAVE_INTERVAL WORKERS
require_whole 0 NODE_RANK WARMUP_ITERS EVAL_ITERS
require_number LR MIN_LR DISTRIBUTED_TIMEOUT_MINUTES
require_one_of PRECISION bf16 fp16 fp32
refuse_script_flags MP_SIZE=--model-parallel-size MP_SIZE=--tensor-model-parallel-size \
    PP_SIZE=--pipeline-model-parallel-size VP_LAYERS=--num-layers-per-virtual-pipeline-stage \
    -- "$@"
note_unread MP_SIZE TP TP_SIZE MP TENSOR_MODEL_PARALLEL_SIZE
note_unread PP_SIZE PP PIPELINE_MODEL_PARALLEL_SIZE
note_unread VP_LAYERS VP VPP VP_SIZE
note_unread GPUS_PER_NODE NPROC_PER_NODE NUM_GPUS NUM_GPUS_PER_WORKER
note_unread NNODES NUM_NODES NUM_WORKERS

NNODES="${NNODES:-1}"; NODE_RANK="${NODE_RANK:-0}"
if (( NNODES == 1 )) && [ -n "${MASTER_ADDR:-}" ] && [ "$MASTER_ADDR" != localhost ] && \
        [ "$MASTER_ADDR" != 127.0.0.1 ]; then  # (one left in the environment by another job)
    echo " note: MASTER_ADDR=$MASTER_ADDR is not used with NNODES=1: the processes meet on" \
         "this machine (localhost)" >&2
    MASTER_ADDR=localhost
fi
MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-6000}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-}"; RDZV_ID="${RDZV_ID:-gpt2_small}"
[[ "$MASTER_ADDR" =~ ^[^[:space:]]+$ ]] || _env_error "MASTER_ADDR must be a host name or" \
    "address (got '$MASTER_ADDR')"
if [ -n "$RDZV_ENDPOINT" ] && { ! [[ "$RDZV_ENDPOINT" =~ ^[^[:space:]]+:([0-9]{1,5})$ ]] || \
        (( BASH_REMATCH[1] < 1 || BASH_REMATCH[1] > 65535 )); }; then
    _env_error "RDZV_ENDPOINT must be host:port, the port from 1 to 65535 (got '$RDZV_ENDPOINT')"
fi
MP_SIZE="${MP_SIZE:-1}"; PP_SIZE="${PP_SIZE:-1}"; VP_LAYERS="${VP_LAYERS:-}"
[ -n "$RDZV_ENDPOINT" ] || require_below NODE_RANK NNODES  # else torchrun waits for node 0

NLAYERS="${NLAYERS:-6}"; NHIDDEN="${NHIDDEN:-384}"; NHEADS="${NHEADS:-6}"
SEQ_LEN="${SEQ_LEN:-256}"; MICRO_BATCH="${MICRO_BATCH:-4}"
TRAIN_ITERS="${TRAIN_ITERS:-300}"; LR="${LR:-1e-3}"
MIN_LR="${MIN_LR:-$(awk -v lr="$LR" 'BEGIN { printf "%g", lr / 10 }')}"
WARMUP_ITERS="${WARMUP_ITERS:-$(( TRAIN_ITERS / 10 ))}"; VOCAB_SIZE="${VOCAB_SIZE:-8192}"
DATA_DIR="${DATA_DIR:-$ROOT/data}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$ROOT/checkpoints/gpt2_small_distributed}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/gpt2_small_distributed}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"; EVAL_INTERVAL="${EVAL_INTERVAL:-100}"
EVAL_ITERS="${EVAL_ITERS:-5}"
WORKERS="${WORKERS:-2}"
# the layer split in the variables' terms (the trainer would name its flags)
(( PP_SIZE <= NLAYERS )) || _env_error "PP_SIZE=$PP_SIZE is more pipeline stages than" \
    "NLAYERS=$NLAYERS: every stage needs at least one layer"
if [ -n "$VP_LAYERS" ] && (( PP_SIZE == 1 )); then
    _env_error "VP_LAYERS=$VP_LAYERS needs PP_SIZE > 1 (it splits each pipeline stage's layers" \
        "into interleaved model chunks)"
fi
if [ -n "$VP_LAYERS" ] && (( NLAYERS % (VP_LAYERS * PP_SIZE) != 0 )); then
    _env_error "NLAYERS=$NLAYERS is not divisible by VP_LAYERS=$VP_LAYERS x PP_SIZE=$PP_SIZE" \
        "(each stage's layers are split into model chunks of VP_LAYERS layers)"
fi

TRAINER_ARGS=("$@")  # checked as pretrain_gpt2.py flags before the data is prepared
source scripts/prepare_default_data.sh  # sets PY, TOKENIZER_DIR, DATA_PREFIX

if [ -z "${GPUS_PER_NODE:-}" ]; then
    GPUS_PER_NODE=0
    if command -v nvidia-smi >/dev/null 2>&1; then  # torch's count honours CUDA_VISIBLE_DEVICES
        GPUS_PER_NODE="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
    fi
    [ "$GPUS_PER_NODE" -gt 0 ] || GPUS_PER_NODE=2  # no GPU: 2 CPU processes talking over gloo
fi
CORES_PER_PROCESS=$(( $(nproc) / GPUS_PER_NODE ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES_PER_PROCESS > 0 ? CORES_PER_PROCESS : 1 ))}"

WORLD_SIZE=$(( GPUS_PER_NODE * NNODES ))
if (( WORLD_SIZE % (MP_SIZE * PP_SIZE) != 0 )); then
    echo "MP_SIZE=$MP_SIZE x PP_SIZE=$PP_SIZE does not divide the $WORLD_SIZE processes" \
         "(NNODES=$NNODES x GPUS_PER_NODE=$GPUS_PER_NODE)" >&2
    exit 2
fi
DP_SIZE=$(( WORLD_SIZE / (MP_SIZE * PP_SIZE) ))
if (( PP_SIZE > 1 )); then
    GLOBAL_BATCH="${GLOBAL_BATCH:-$(( MICRO_BATCH * DP_SIZE * 4 * PP_SIZE ))}"
else
    GLOBAL_BATCH="${GLOBAL_BATCH:-$(( MICRO_BATCH * DP_SIZE ))}"
fi
SAVE_INTERVAL="${SAVE_INTERVAL:-$(run_end)}"  # (at the end only; a ramp's: more iterations)
print_compute_estimate "$NLAYERS" "$NHIDDEN" "$VOCAB_SIZE" "$SEQ_LEN" "$TRAIN_ITERS" "$GLOBAL_BATCH"
echo "[launch] $NNODES node(s) x $GPUS_PER_NODE processes: tensor-parallel $MP_SIZE," \
     "pipeline stages $PP_SIZE, data-parallel $DP_SIZE, global batch $GLOBAL_BATCH"

# Unset PRECISION is measured per node (the faster of bf16 and fp32); nodes must agree, so
# a multi-node launch that names none takes bf16.
[ "$NNODES" -gt 1 ] && PRECISION="${PRECISION:-bf16}"
set_precision_flags "$@"

# The launcher's rendezvous waits as long as the processes' own collectives do
# (--distributed-timeout-minutes, from the arguments or DISTRIBUTED_TIMEOUT_MINUTES, default 10
# as in Megatron): a node that never arrives is an error after that, not a silent hang.
TIMEOUT_MINUTES="${DISTRIBUTED_TIMEOUT_MINUTES:-10}"
TIMEOUT_FROM=DISTRIBUTED_TIMEOUT_MINUTES
ARGS=("$@")
for i in "${!ARGS[@]}"; do
    case "${ARGS[$i]}" in
        --distributed-timeout-minutes) TIMEOUT_MINUTES="${ARGS[$((i + 1))]:-}" ;;
        --distributed-timeout-minutes=*) TIMEOUT_MINUTES="${ARGS[$i]#*=}" ;;
        *) continue ;;
    esac
    TIMEOUT_FROM=--distributed-timeout-minutes
done
if ! [[ "$TIMEOUT_MINUTES" =~ ^[0-9]*\.?[0-9]+$ ]] || \
        [ "$(awk -v m="$TIMEOUT_MINUTES" 'BEGIN { print (m * 60 >= 1) }')" != 1 ]; then
    echo "$TIMEOUT_FROM must be a number of minutes, at least 1 second's" \
         "worth (got '$TIMEOUT_MINUTES')" >&2
    exit 2
fi
RDZV_TIMEOUT_S="$(awk -v m="$TIMEOUT_MINUTES" 'BEGIN { print int(m * 60) }')"

# torchrun, taken from the venv's torch (its failures said in one line: torchrun_command).
DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES")
if [ -n "$RDZV_ENDPOINT" ]; then
    DISTRIBUTED_ARGS+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID"
                       --rdzv-conf "join_timeout=$RDZV_TIMEOUT_S")
else
    DISTRIBUTED_ARGS+=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR"
                       --master_port "$MASTER_PORT" --rdzv-conf "timeout=$RDZV_TIMEOUT_S")
fi
if (( NNODES > 1 )); then
    echo "[launch] waiting up to $TIMEOUT_MINUTES min for the $NNODES nodes to meet" \
         "(--distributed-timeout-minutes)"
fi

MODEL_ARGS=(--model-parallel-size "$MP_SIZE" --pipeline-model-parallel-size "$PP_SIZE"
            ${VP_LAYERS:+--num-layers-per-virtual-pipeline-stage "$VP_LAYERS"}
            --num-layers "$NLAYERS" --hidden-size "$NHIDDEN" --num-attention-heads "$NHEADS"
            --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN")
run_length_args  # LENGTH_ARGS: --train-iters, --warmup-iters (in samples under a ramp)
TRAIN_ARGS=(--batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
            "${LENGTH_ARGS[@]}" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
            --weight-decay 1e-2 --clip-grad 1.0
            --attention-dropout 0.0 --hidden-dropout 0.0 "${PRECISION_FLAGS[@]}")
DATA_ARGS=(--data-path "${DATA_PREFIX}_text_document" --split 949,50,1
           --tokenizer-type GPT2BPETokenizer --vocab-file "$TOKENIZER_DIR/vocab.json"
           --merge-file "$TOKENIZER_DIR/merges.txt" --num-workers 1)
OUTPUT_ARGS=(--distributed-timeout-minutes "$TIMEOUT_MINUTES"
             --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL"
             --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL"
             --eval-iters "$EVAL_ITERS" --tensorboard-dir "$RUN_DIR")

source scripts/launch_env.sh  # GLIBC_TUNABLES for ZeRO-3's host memory
cd "$CALLER_DIR"  # relative paths among the arguments: from where the script was run
torchrun_command
exec "${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt2.py" \
    "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
