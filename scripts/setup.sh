#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv with everything it needs.  Idempotent: a second
# run only checks a stamp and returns.
#
#   bash scripts/setup.sh            # runtime dependencies
#   EXTRAS=test bash scripts/setup.sh   # plus what the test suite uses
#   EXTRAS=webtext bash scripts/setup.sh   # the webtext cleaning tools (tools/openwebtext)
#
# torch: an already-installed torch is kept (the venv then sees the base interpreter's
# packages).  Otherwise a machine with an NVIDIA driver gets the default (CUDA) wheel and a
# machine without one gets the CPU build, never the multi-GB CUDA build.
# Variables: PYTHON (base interpreter, default python3), VENV (default <repo>/.venv),
#            TORCH_VERSION (default 2.13.0), EXTRAS (any of "test", "convert", "webtext").
# The test extras include the webtext packages: the suite runs the webtext pipeline.
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$ROOT/.venv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
EXTRAS="${EXTRAS:-}"
for extra in ${EXTRAS//,/ }; do  # a misspelt extra would install nothing and say nothing
    case "$extra" in
        test|convert|webtext) ;;
        *) echo "EXTRAS: unknown extra '$extra'; the extras are test, convert and webtext" \
                "(comma-separated, e.g. EXTRAS=test,convert)" >&2; exit 2 ;;
    esac
done

RUNTIME_PACKAGES=(numpy sentencepiece regex tensorboard tqdm)
WEBTEXT_PACKAGES=(ftfy langdetect datasketch)
TEST_PACKAGES=(pytest ruff hypothesis tokenizers "${WEBTEXT_PACKAGES[@]}")
CONVERT_PACKAGES=(transformers safetensors)

# Whether the venv finds an installed torch package (looked up, not imported: importing takes
# a second or more, and every training script runs this check; a folder left behind by an
# uninstall, with no __init__.py, does not count).
has_torch() { "$1" -c "import importlib.util as u, sys; s = u.find_spec('torch'); sys.exit(s is None or s.origin is None)" 2>/dev/null; }

if [ ! -x "$VENV/bin/python" ]; then
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then
        echo "PYTHON=$PYTHON is not a Python >= 3.9 interpreter on PATH; the venv needs one" \
             "(e.g. PYTHON=python3.11 bash scripts/setup.sh)" >&2
        exit 2
    fi
    if "$PYTHON" -c "import torch" 2>/dev/null; then  # once: reuse a torch that imports
        echo "[setup] $PYTHON already has torch $("$PYTHON" -c 'import torch; print(torch.__version__)'); the venv will reuse it"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"

wanted=("${RUNTIME_PACKAGES[@]}")
[[ "$EXTRAS" == *test* ]] && wanted+=("${TEST_PACKAGES[@]}")
[[ "$EXTRAS" == *convert* ]] && wanted+=("${CONVERT_PACKAGES[@]}")
[[ "$EXTRAS" == *webtext* ]] && wanted+=("${WEBTEXT_PACKAGES[@]}")
stamp="$VENV/.setup-stamp"
all_installed() {
    [ -f "$stamp" ] || return 1
    for pkg in "${wanted[@]}"; do grep -qx "$pkg" "$stamp" || return 1; done
}
if all_installed && has_torch "$PY"; then
    exit 0
fi

pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }

if ! has_torch "$PY"; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        echo "[setup] NVIDIA driver found: installing torch==$TORCH_VERSION (CUDA build)"
        pip_install "torch==$TORCH_VERSION"
    else
        echo "[setup] no CUDA device: installing the CPU build of torch==$TORCH_VERSION"
        # A local mirror or wheel cache may carry the +cpu build; else the PyTorch CPU index.
        pip_install "torch==$TORCH_VERSION+cpu" 2>/dev/null \
            || pip_install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
    fi
fi
echo "[setup] installing: ${wanted[*]}"
pip_install "${wanted[@]}"
{ [ -f "$stamp" ] && cat "$stamp"; printf '%s\n' "${wanted[@]}"; } | sort -u > "$stamp.tmp"
mv "$stamp.tmp" "$stamp"
"$PY" -c "import torch; print(f'[setup] ready: torch {torch.__version__}, cuda available: {torch.cuda.is_available()}')"
