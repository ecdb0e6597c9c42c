#!/usr/bin/env bash
# Checks of the environment variables the scripts read, sourced before anything else runs:
# a mistyped size or count stops the script at once with the variable named, instead of as a
# bash arithmetic error, a Python traceback or a wrong estimate, or after minutes of setup
# and data preparation on a fresh machine. Unset or empty variables are skipped: the script's
# default applies to them.
#
#   source scripts/check_env.sh
#   require_whole 1 NLAYERS NHIDDEN    # each a whole number >= 1, leading zeros dropped
#   require_number LR MIN_LR           # each a non-negative decimal number: 3, 0.5, 1e-3
#   require_one_of PRECISION bf16 fp16 fp32   # one of the values listed
#   require_below NODE_RANK NNODES     # the first < the second (both already checked)
#   note_unread PP_SIZE PP PIPELINE_MODEL_PARALLEL_SIZE   # the others set: a note naming the first
#   note_read_elsewhere other.sh "why not here" MP_SIZE  # set: a note naming the script reading it
#   refuse_script_flags PP_SIZE=--pipeline-model-parallel-size -- "$@"   # the flag in "$@": error
#   take_trainer_flags "$@"   # --train-iters 20 among the arguments sets TRAIN_ITERS=20, ...
#   from_callers_folder DATA_DIR CHECKPOINT_DIR   # relative paths: from where the user ran it
#   require_port MASTER_PORT          # a whole number from 1 to 65535
#
# Source it before `cd "$ROOT"`: CALLER_DIR is the folder the first script of a chain was run
# in (exported, so the scripts it starts read relative paths from there too). The scripts
# prepare data in the repository's root and start Python back in CALLER_DIR, so relative
# paths among their arguments are read from there as well.

_env_error() { echo "$*" >&2; exit 2; }

export CALLER_DIR="${CALLER_DIR:-$PWD}"

from_callers_folder() {
    # The scripts work in the repository's root; a relative path the user gave is read from
    # the folder they ran the script in (DATA_DIR=data run in /home/me is /home/me/data).
    # With --lists, each variable is a space-separated list of paths.
    local lists=0 name value words i
    [ "${1:-}" = --lists ] && { lists=1; shift; }
    for name in "$@"; do
        value="${!name:-}"
        [ -n "$value" ] || continue
        if (( lists )); then read -r -a words <<< "$value"; else words=("$value"); fi
        for i in "${!words[@]}"; do
            [ "${words[$i]#/}" = "${words[$i]}" ] && words[$i]="$CALLER_DIR/${words[$i]}"
        done
        printf -v "$name" '%s' "${words[*]}"
    done
}

from_callers_folder VENV  # (the scripts' python: ${VENV:-<repo>/.venv}/bin/python)

# torchrun, from the venv's torch, with failures said in one line (megatron/runtime/torchrun.py;
# the repository first on the import path: the folder Python runs in may hold a `megatron` too)
torchrun_command() {
    TORCHRUN=("$PY" -c "import sys; sys.path.insert(0, sys.argv.pop(1)); from megatron.runtime.torchrun import main; sys.exit(main())" "$ROOT")
}

require_port() {
    local name
    require_whole 1 "$@"
    for name in "$@"; do
        if [ -n "${!name:-}" ] && (( ${!name} > 65535 )); then
            _env_error "$name must be a port from 1 to 65535 (got '${!name}')"
        fi
    done
}

declare -A _FLAG_OF=()  # a variable take_script_flags set -> the flag it came from
_named() { echo "${_FLAG_OF[$1]:-$1}"; }  # how an error names the variable's value

require_whole() {
    local min="$1" name value
    shift
    for name in "$@"; do
        value="${!name:-}"
        [ -n "$value" ] || continue
        if ! [[ "$value" =~ ^[0-9]{1,18}$ ]] || (( 10#$value < min )); then
            _env_error "$(_named "$name") must be a whole number >= $min (got '$value')"
        fi
        printf -v "$name" '%d' "$(( 10#$value ))"  # 08 is 8, not an octal error, in $(( ))
    done
}

require_number() {
    local name value
    for name in "$@"; do
        value="${!name:-}"
        [ -n "$value" ] || continue
        if ! [[ "$value" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]]; then
            _env_error "$(_named "$name") must be a non-negative number such as 3, 0.5 or 1e-3 (got '$value')"
        fi
    done
}

require_one_of() {
    local name="$1" value="${!1:-}" allowed
    shift
    [ -n "$value" ] || return 0
    for allowed in "$@"; do
        [ "$value" = "$allowed" ] && return 0
    done
    _env_error "$name must be one of: $* (got '$value')"
}

require_below() {
    local small="$1" large="$2"
    if (( 10#${!small} >= 10#${!large} )); then
        _env_error "$small=${!small} must be below $large=${!large} (counted from 0)"
    fi
}

note_unread() {
    # Names other launchers use for a variable this script reads as $1: set, they would be
    # ignored without a word (and the run laid out by the default).
    local read="$1" name
    shift
    for name in "$@"; do
        if [ -n "${!name:-}" ]; then
            echo " note: $name=${!name} is not read by this script; $read is (e.g. $read=${!name})" >&2
        fi
    done
}

note_read_elsewhere() {
    # A script, why this one does not read them, then variables: set, they are the other
    # script's settings, which this one would ignore without a word.
    local script="$1" why="$2" name
    shift 2
    for name in "$@"; do
        if [ -n "${!name:-}" ]; then
            echo " note: $name=${!name} is not read by this script ($why); scripts/$script" \
                 "reads it" >&2
        fi
    done
}

refuse_script_flags() {
    # VAR=--flag pairs, then --, then the script's extra arguments: the script lays out the
    # launch from VAR (process counts, batch, checkpoint folder), so the flag given after it
    # would override the trainer's value behind the script's back.
    local pairs=() pair arg
    while [ "$1" != "--" ]; do pairs+=("$1"); shift; done
    shift
    for arg in "$@"; do
        for pair in "${pairs[@]}"; do
            if [ "$arg" = "${pair#*=}" ] || [[ "$arg" == "${pair#*=}="* ]]; then
                _env_error "${pair#*=} is set by this script from ${pair%%=*} (it lays out the processes with it): set ${pair%%=*}=N instead of passing the flag"
            fi
        done
    done
}

take_script_flags() {
    # VAR=--flag pairs, then --, then the script's extra arguments. The script passes VAR as
    # --flag itself and derives other values from it (the warmup and the save interval from
    # TRAIN_ITERS, --max-position-embeddings from SEQ_LEN, the global batch from MICRO_BATCH),
    # so a --flag among the arguments is read into VAR and what the script derives follows
    # it. VAR set in the environment to another value as well is an error: which is meant?
    local pairs=() pair var flag value i args=()
    while [ "$1" != "--" ]; do pairs+=("$1"); shift; done
    shift
    args=("$@")
    for ((i = 0; i < ${#args[@]}; i++)); do  # in order: the last of two spellings wins
        for pair in "${pairs[@]}"; do
            var="${pair%%=*}"; flag="${pair#*=}"
            if [ "${args[$i]}" = "$flag" ]; then
                value="${args[$((i + 1))]:-}"
            elif [[ "${args[$i]}" == "$flag="* ]]; then
                value="${args[$i]#*=}"
            else
                continue
            fi
            if [ -n "${!var:-}" ] && [ -z "${_FLAG_OF[$var]:-}" ] && [ "${!var}" != "$value" ]
            then  # (a flag given twice: the last wins, as in pretrain_gpt2.py)
                _env_error "$var=${!var} and $flag $value both set $var: give one of them"
            fi
            printf -v "$var" '%s' "$value"
            _FLAG_OF[$var]="$flag"
        done
    done
}

run_end() {
    # The save interval that saves at the end only (the scripts' default): TRAIN_ITERS, or
    # under --rampup-batch-size, whose smaller batches take more iterations, a bound on them
    # (TRAIN_ITERS x GLOBAL_BATCH samples, one at least each); the trainer saves at its end.
    if [ -n "$RAMPUP_GIVEN" ]; then echo $(( TRAIN_ITERS * GLOBAL_BATCH )); else echo "$TRAIN_ITERS"; fi
}

run_length_args() {
    # LENGTH_ARGS: the run's length and warmup as the launch scripts pass them, --train-iters
    # TRAIN_ITERS and --warmup-iters WARMUP_ITERS (no warmup flag when a --warmup fraction or
    # --lr-warmup-samples/-tokens was given). Under --rampup-batch-size an iteration's samples
    # grow, so the trainer takes lengths in samples: TRAIN_ITERS and WARMUP_ITERS global
    # batches of GLOBAL_BATCH samples (the ramp's smaller batches make that more iterations).
    if [ -n "$RAMPUP_GIVEN" ]; then
        LENGTH_ARGS=(--train-samples "$(( TRAIN_ITERS * GLOBAL_BATCH ))")
        [ -n "$WARMUP_FRACTION_GIVEN" ] ||
            LENGTH_ARGS+=(--lr-warmup-samples "$(( WARMUP_ITERS * GLOBAL_BATCH ))")
    else
        LENGTH_ARGS=(--train-iters "$TRAIN_ITERS")
        [ -n "$WARMUP_FRACTION_GIVEN" ] || LENGTH_ARGS+=(--warmup-iters "$WARMUP_ITERS")
    fi
}

take_trainer_flags() {
    # The pretrain_gpt2.py flags the launch scripts build from their variables (the same
    # names in every script). --warmup/--lr-warmup-fraction (a fraction) and the warmup in
    # samples or tokens replace the script's --warmup-iters: WARMUP_FRACTION_GIVEN=1 says so.
    # The run's length in samples would meet the script's --train-iters: refused.
    take_script_flags NLAYERS=--num-layers NHIDDEN=--hidden-size NHEADS=--num-attention-heads \
        SEQ_LEN=--seq-length MICRO_BATCH=--batch-size MICRO_BATCH=--micro-batch-size \
        GLOBAL_BATCH=--global-batch-size TRAIN_ITERS=--train-iters LR=--lr MIN_LR=--min-lr \
        WARMUP_ITERS=--warmup-iters WARMUP_ITERS=--lr-warmup-iters \
        LOG_INTERVAL=--log-interval EVAL_INTERVAL=--eval-interval EVAL_ITERS=--eval-iters \
        SAVE_INTERVAL=--save-interval -- "$@"
    WARMUP_FRACTION_GIVEN=""; RAMPUP_GIVEN=""
    local arg
    for arg in "$@"; do
        case "$arg" in
            --warmup|--warmup=*|--lr-warmup-fraction|--lr-warmup-fraction=*|\
            --lr-warmup-samples|--lr-warmup-samples=*|--lr-warmup-tokens|--lr-warmup-tokens=*)
                WARMUP_FRACTION_GIVEN=1 ;;
            --train-samples|--train-samples=*)
                _env_error "--train-samples: this script sets the run's length in iterations;" \
                    "give TRAIN_ITERS=N (samples / global batch) instead" ;;
            --rampup-batch-size) RAMPUP_GIVEN=1 ;;
        esac
    done
    if [ -n "$RAMPUP_GIVEN" ]; then  # (run_length_args passes the lengths in samples)
        local var
        for var in TRAIN_ITERS WARMUP_ITERS; do
            [ -z "${_FLAG_OF[$var]:-}" ] || _env_error "${_FLAG_OF[$var]} with" \
                "--rampup-batch-size: the trainer takes lengths in samples then; give $var=N" \
                "(global batches of GLOBAL_BATCH) and the script passes N x GLOBAL_BATCH samples"
        done
    fi
    if [ -n "$WARMUP_FRACTION_GIVEN" ] && [ -n "${WARMUP_ITERS:-}" ]; then
        local iters="WARMUP_ITERS=$WARMUP_ITERS"
        [ -z "${_FLAG_OF[WARMUP_ITERS]:-}" ] || iters="${_FLAG_OF[WARMUP_ITERS]} $WARMUP_ITERS"
        _env_error "$iters and --warmup (a fraction, or --lr-warmup-samples/-tokens) both set" \
            "the warmup: give one of them"
    fi
}
