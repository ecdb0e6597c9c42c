# Sourced by the scripts that build a peer's virtualenv (install_deepspeed_venv.sh,
# install_quantization_peers_venv.sh): `peer_venv VENV TAG` makes VENV if needed, sets PY and
# pip_install, and installs the CPU build of torch==$TORCH_VERSION (default 2.13.0) unless the
# venv already imports torch (never the multi-GB CUDA wheel; the PyTorch CPU index is tried
# when the package index lacks +cpu). PYTHON is the base interpreter (default python3).
peer_venv() {
    local venv="$1" tag="$2" version="${TORCH_VERSION:-2.13.0}"
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    PY="$venv/bin/python"
    pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
    if ! "$PY" -c "import torch" 2>/dev/null; then
        echo "[$tag] installing the CPU build of torch==$version"
        pip_install "torch==$version+cpu" 2>/dev/null \
            || pip_install "torch==$version" --index-url https://download.pytorch.org/whl/cpu
    fi
}
