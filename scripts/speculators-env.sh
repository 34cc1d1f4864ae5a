#!/usr/bin/env bash
# Creates .venv-speculators: the `speculators` package (the reference EAGLE-3 implementation vLLM reads)
# in an environment of its own, since it pins transformers<=5.19 and cannot share the project's.
# tests/test_speculators_interop.py drives it through a subprocess. Usage: bash scripts/speculators-env.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-speculators}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}
SPECULATORS_SPEC=${SPECULATORS_SPEC:-speculators==0.9.0 transformers==5.19.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q $TORCH_SPEC
"$VENV/bin/pip" install -q $SPECULATORS_SPEC
"$VENV/bin/python" -c 'import importlib.metadata as m; print(*(f"{p} {m.version(p)}" for p in ("speculators", "transformers", "torch")))'
