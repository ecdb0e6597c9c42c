#!/usr/bin/env bash
# Lint, then run the test suite (the README's second command; .ci/run calls exactly this).
#
#   bash scripts/test.sh                # ruff (pyproject.toml), then the default suite
#   bash scripts/test.sh -m slow        # the long tests only
#   bash scripts/test.sh tests/mpu -x   # any pytest arguments
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# convert: transformers + safetensors, so the checkpoint-conversion tests run, not skip.
EXTRAS="test,convert${EXTRAS:+,$EXTRAS}" bash scripts/setup.sh
PY="${VENV:-$ROOT/.venv}/bin/python"
"$PY" -m ruff check .   # fails the run on a lint error, before any test starts
set +e
"$PY" -m pytest -q "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then   # pytest: no tests collected (e.g. a -k that matches nothing)
    echo "no tests were collected"
    exit 0
fi
exit "$status"
