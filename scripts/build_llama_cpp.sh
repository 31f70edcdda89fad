#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-speculative-simple from the source PyPI's
# llama-cpp-python 0.3.36 vendors (llama.cpp 0c1e570), for this CPU (-march=native; see below for
# CPUs with AMX), into $JAKIRO_CACHE/llama.cpp
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
# This llama.cpp's AMX matrix kernels stop with SIGILL in llama-server (a tile instruction before
# the thread's tile configuration: the server's first batched forward). On CPUs with AMX build for
# the CPU's other instruction sets without them (the AVX-512 VNNI kernels it uses on Zen 4);
# elsewhere -march=native as usual.
ISA="-DGGML_NATIVE=ON"
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
if [[ " $flags " == *" amx_int8 "* ]]; then
  ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  for f in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    [[ " $flags " == *" ${f%%:*} "* ]] && ISA="$ISA -DGGML_${f##*:}=ON"
  done
  ISA="$ISA -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
cmake -S "$ROOT/src" -B "$ROOT/build" -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
  -DCMAKE_BUILD_TYPE=Release $ISA -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF >/dev/null
cmake --build "$ROOT/build" --target llama-server llama-bench llama-speculative-simple -j "$(nproc)"
mkdir -p "$ROOT/bin"
for f in "$ROOT"/build/bin/*; do ln -sf "$f" "$ROOT/bin/"; done
echo "llama.cpp binaries: $ROOT/bin (jakiro finds them there, or set JAKIRO_LLAMA_CPP)"
