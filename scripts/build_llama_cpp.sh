#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-speculative-simple from the source PyPI's
# llama-cpp-python 0.3.36 vendors (llama.cpp 0c1e570), for this CPU, into $JAKIRO_CACHE/llama.cpp
# (default ~/.cache/jakiro/llama.cpp): the baseline `jakiro bench --methods llamacpp,llamacpp-pld`
# and `jakiro bench-cost --llamacpp` run. Needs cmake, a C++ compiler and pip; about 12 minutes on
# 2 cores. Safe to run again: it only builds what is missing.
set -euo pipefail
PY=${PYTHON:-python3}
ROOT=${JAKIRO_CACHE:-$HOME/.cache/jakiro}/llama.cpp
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
mkdir -p "$ROOT"
if [ ! -f "$ROOT/src/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  echo "llama-cpp-python==0.3.36 --hash=sha256:$SDIST_SHA256" > "$tmp/req.txt"
  "$PY" -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$tmp/req.txt" -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
  rm -rf "$ROOT/src"
  mv "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$tmp"
fi
cmake -S "$ROOT/src" -B "$ROOT/build" -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF >/dev/null
cmake --build "$ROOT/build" --target llama-server llama-bench llama-speculative-simple -j "$(nproc)"
mkdir -p "$ROOT/bin"
for f in "$ROOT"/build/bin/*; do ln -sf "$f" "$ROOT/bin/"; done
echo "llama.cpp binaries: $ROOT/bin (jakiro finds them there, or set JAKIRO_LLAMA_CPP)"
