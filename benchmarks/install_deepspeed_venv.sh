#!/usr/bin/env bash
# Build a separate virtualenv with real DeepSpeed, used only as a peer/compatibility oracle by
# benchmarks/zero_memory_comm.py and tests/zero/test_deepspeed_compat.py.  It lives outside the
# repository because DeepSpeed must never be importable from the project's own .venv (the zero
# package is the DeepSpeed replacement, and the comparison has to be against the real thing).
#
#   bash benchmarks/install_deepspeed_venv.sh          # -> /work/dsvenv (or $DEEPSPEED_VENV)
#
# Variables: DEEPSPEED_VENV (target, default /work/dsvenv), PYTHON (base interpreter, default
# python3), TORCH_VERSION (default 2.13.0), DEEPSPEED_VERSION (default: newest).
# Idempotent: an existing venv that already imports deepspeed is left as it is.
# torch: the CPU build (never the multi-GB CUDA wheel on a machine without a GPU); if the local
# wheel cache lacks +cpu the PyTorch CPU index is tried.  DS_BUILD_OPS=0 skips compiling
# DeepSpeed's C++/CUDA ops at install time; at run time use DS_ACCELERATOR=cpu (the first start
# JIT-compiles one small op, ~25 s, cached under ~/.cache/torch_extensions).
set -euo pipefail
VENV="${DEEPSPEED_VENV:-/work/dsvenv}"
DS_SPEC="deepspeed${DEEPSPEED_VERSION:+==$DEEPSPEED_VERSION}"

if [ -x "$VENV/bin/python" ] && DS_ACCELERATOR=cpu "$VENV/bin/python" -c "import deepspeed" 2>/dev/null; then
    echo "[deepspeed-venv] $VENV already has deepspeed $("$VENV/bin/python" -c 'import deepspeed; print(deepspeed.__version__)' 2>/dev/null | tail -1)"
    exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/peer_venv.sh"
peer_venv "$VENV" deepspeed-venv  # sets PY and pip_install, installs CPU torch
echo "[deepspeed-venv] installing $DS_SPEC (DS_BUILD_OPS=0) and its pure-Python dependencies"
pip_install numpy packaging py-cpuinfo hjson ninja pydantic psutil msgpack tqdm einops
DS_BUILD_OPS=0 pip_install "$DS_SPEC"
DS_ACCELERATOR=cpu "$PY" -c "import deepspeed, torch; print(f'[deepspeed-venv] ready: deepspeed {deepspeed.__version__}, torch {torch.__version__}')"
