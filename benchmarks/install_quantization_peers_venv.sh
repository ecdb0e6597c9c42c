#!/usr/bin/env bash
# Build a separate virtualenv with the quantised-optimizer peers: bitsandbytes (its CPU 8-bit
# optimizers) and torchao (low-bit optimizers). benchmarks/quantization.py times them beside
# zero.optim.Adam8bit through subprocesses. Kept outside the project's .venv so that the
# project never depends on either package.
#
#   bash benchmarks/install_quantization_peers_venv.sh     # -> /work/qvenv (or $QUANT_PEERS_VENV)
#
# Variables: QUANT_PEERS_VENV (target, default /work/qvenv), PYTHON (base interpreter, default
# python3), TORCH_VERSION (default 2.13.0). torch is the CPU build, as for the project's venv.
# Idempotent: an existing venv that imports both packages is left as it is.
set -euo pipefail
VENV="${QUANT_PEERS_VENV:-/work/qvenv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import bitsandbytes, torchao" 2>/dev/null; then
    echo "[quantization-peers] $VENV is ready"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[quantization-peers] installing the CPU build of torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION+cpu" 2>/dev/null \
        || pip_install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi
echo "[quantization-peers] installing bitsandbytes and torchao"
pip_install numpy bitsandbytes torchao
"$PY" -c "import bitsandbytes, torchao, torch; print(f'[quantization-peers] ready: bitsandbytes {bitsandbytes.__version__}, torchao {torchao.__version__}, torch {torch.__version__}')"
