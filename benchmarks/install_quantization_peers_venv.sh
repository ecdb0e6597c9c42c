#!/usr/bin/env bash
# Build a separate virtualenv with the quantised-optimizer peers: bitsandbytes (its CPU 8-bit
# optimizers) and torchao (low-bit optimizers). benchmarks/quantization.py times them beside
# zero.optim.quantized_adam's Adam8bit and Adam4bit through subprocesses. Kept outside the project's .venv so that the
# project never depends on either package.
#
#   bash benchmarks/install_quantization_peers_venv.sh     # -> /work/qvenv (or $QUANT_PEERS_VENV)
#
# Variables: QUANT_PEERS_VENV (target, default /work/qvenv), PYTHON (base interpreter, default
# python3), TORCH_VERSION (default 2.13.0). torch is the CPU build, as for the project's venv.
# Idempotent: an existing venv that imports both packages is left as it is.
set -euo pipefail
VENV="${QUANT_PEERS_VENV:-/work/qvenv}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import bitsandbytes, torchao" 2>/dev/null; then
    echo "[quantization-peers] $VENV is ready"
    exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/peer_venv.sh"
peer_venv "$VENV" quantization-peers  # sets PY and pip_install, installs CPU torch
echo "[quantization-peers] installing bitsandbytes and torchao"
pip_install numpy bitsandbytes torchao
"$PY" -c "import bitsandbytes, torchao, torch; print(f'[quantization-peers] ready: bitsandbytes {bitsandbytes.__version__}, torchao {torchao.__version__}, torch {torch.__version__}')"
