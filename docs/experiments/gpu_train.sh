#!/bin/bash
# Train the shipped drafts for SmolLM2-135M-Instruct on one GPU from the committed self-distilled
# text, with the features computed on the fly (tokens-only datasets), in about ten minutes.
#
#   docs/experiments/gpu_train.sh STASH OUT [EAGLE2_MINUTES] [JAKIRO_MINUTES]
#
# REGEN_SEEDS="1 2" first regenerates new text on the GPU, one run per seed and entry of
# REGEN_SOURCES (for at most REGEN_MINUTES and REGEN_RECORDS conversations each, REGEN_BATCH at a
# time), trains on it too, and leaves it in OUT as regen-SOURCE-sSEED.jsonl.gz (to commit:
# `--source` rebuilds its datasets anywhere). Entries: target-prompts (the default: the target
# writes user turns itself and answers them greedily; needs STASH/evaluation-filter.json, made
# where the question packages are installed with `python -c "from jakiro.data.decontaminate
# import save_evaluation_filter as s; s('evaluation-filter.json')"`), or the name of a committed
# file (greedy, tasks-greedy, ...: its prompts answered again by sampling).
#
# STASH (built on the CPU by docs/experiments/gpu_stash.sh STASH; put it in the working tree,
# untracked, so that it travels to the GPU machine) holds: SmolLM2-135M-Instruct.Q4_1.gguf (or
# gguf.xz.* pieces of its xz stream), tok.tar.xz (the runs/tok/* folders of `jakiro data
# --tokens-only`, see data/self-distilled/README.md), evaluation-filter.json, eagle2-init/ (the EAGLE-2 draft to continue) and, where the gguf package is missing, its wheel.
# OUT receives both drafts (model weights in pieces of 16 MB), their logs and plots.
set -u
STASH=$1 OUT=$2 EM=${3:-3.2} JM=${4:-3.2}
# a dry run on the CPU (with .venv/bin first on PATH): DEVICE=cpu BATCH=2 EXTRA="--warmup 2 --eval-records 2"
# REGEN_SEEDS=1 REGEN_SOURCES="target-prompts greedy" REGEN_RECORDS=2 REGEN_BATCH=2 REGEN_MINUTES=6, minutes 0.2 0.2
DEVICE=${DEVICE:-cuda} BATCH=${BATCH:-64}
export PYTHONUNBUFFERED=1 JAKIRO_NO_EXT=1
cd "$(dirname "$0")/../.."
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site "$STASH"/gguf-*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$STASH/SmolLM2-135M-Instruct.Q4_1.gguf" ] && GGUF=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf || cat "$STASH"/gguf.xz.* | xz -d > $GGUF
sha256sum $GGUF
# the folder name is the target's name that datasets and drafts record (the GGUF's, as `jakiro`
# names its conversion anywhere: the runs/tok datasets in the stash name the same one)
TGT=/tmp/targets/$(python3 -c "from jakiro.models.hub import converted_name; print(converted_name('$GGUF'))")
[ -f $TGT/config.json ] || python3 -c "from jakiro.models.hub import convert_gguf; convert_gguf('$GGUF', '$TGT')" || exit 1
# the same features as on the CPU that built the shipped drafts (mean |x| of the final feature and of
# the streams after layers 3 and 15 on fixed tokens): 0.966963 2.106754 4.614119
python3 - "$TGT" $DEVICE <<'PY' || exit 1
import sys, torch
from jakiro.models.features import FeatureModel
fm = FeatureModel(sys.argv[1], (3, 15), sys.argv[2])
f = fm((torch.arange(1, 129, device=sys.argv[2]) * 7919 % 49152).view(2, 64)).double().cpu()
got = [float(f[..., i * 576:(i + 1) * 576].abs().mean()) for i in range(3)]
print("feature check", " ".join(f"{x:.6f}" for x in got))
sys.exit(0 if all(abs(a - b) < 1e-4 * b for a, b in zip(got, (0.966963, 2.106754, 4.614119))) else 1)
PY
mkdir -p /tmp/tok && tar xJf "$STASH/tok.tar.xz" -C /tmp/tok
DATA=$(echo /tmp/tok/{greedy,tasks3-greedy,tasks4-greedy,tasks5-greedy,tasks-greedy,tasks2-greedy,sample} | tr ' ' ,)
for d in /tmp/tok/*/; do  # any further folder of the stash's tok.tar.xz (e.g. own-greedy) joins them
  case ",$DATA," in *",${d%/},"*) ;; *) DATA=$DATA,${d%/} ;; esac
done
mkdir -p "$OUT"
for seed in ${REGEN_SEEDS:-}; do
  for src in ${REGEN_SOURCES:-target-prompts}; do
    if [ $src = target-prompts ]; then
      # prompts that exist only once written pass the evaluation filter here, from its digests
      [ -f "$STASH/evaluation-filter.json" ] || { echo "no $STASH/evaluation-filter.json: $src skipped"; continue; }
      ARGS="--source target-prompts --regenerate greedy"
      export JAKIRO_EVALUATION_FILTER="$STASH/evaluation-filter.json"
    else  # the committed files' prompts passed the filter when they were made
      ARGS="--source data/self-distilled/smollm2-135m-instruct-$src.jsonl.gz --regenerate sample --no-eval-filter"
    fi
    python3 -m jakiro data --target $TGT --device $DEVICE $ARGS --seed $seed --max-records ${REGEN_RECORDS:-100000} \
        --max-len 512 --regen-max-tokens 384 --regen-batch ${REGEN_BATCH:-256} --regen-minutes ${REGEN_MINUTES:-2} \
        --tokens-only --aux-layers 3,15 --out /tmp/tok/regen-$src-s$seed 2>&1 | tr '\r' '\n' | grep -v '^regenerate: ' | tail -3
    [ -f /tmp/tok/regen-$src-s$seed/state.json ] || continue
    gzip -c /tmp/tok/regen-$src-s$seed/regenerated.jsonl > "$OUT/regen-$src-s$seed.jsonl.gz"
    DATA=$DATA,/tmp/tok/regen-$src-s$seed
  done
done
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1  # the draft and the on-the-fly features in TF32
COMMON="--target $TGT --data $DATA --aux-layers 3,15 --device $DEVICE --batch-size $BATCH --unroll 4 --lr 5e-4 --warmup 30 --steps 100000 --eval-every 400 --checkpoint-every 200 ${EXTRA:-}"
ship() {  # run folder -> $OUT/NAME.tar (all but the weights) and $OUT/NAME.model.* (16 MB pieces)
  local run=$1 name=$2 src=$1
  [ -f $run/model.safetensors ] || src=$run/checkpoint
  [ -f $src/model.safetensors ] || return 0
  split -b 16000000 $src/model.safetensors "$OUT/$name.model."
  tar cf "$OUT/$name.tar" -C $run --exclude=checkpoint --exclude=model.safetensors . -C $src config.json
}
python3 -m jakiro train $COMMON --method eagle2 --init-from "$STASH/eagle2-init" --out /tmp/gpu-eagle2 --minutes $EM 2>&1; ship /tmp/gpu-eagle2 eagle2
INIT=/tmp/gpu-eagle2; [ -f $INIT/model.safetensors ] || INIT="$STASH/eagle2-init"
python3 -m jakiro train $COMMON --method jakiro --jakiro-loss separate --init-from $INIT --out /tmp/gpu-jakiro --minutes $JM 2>&1; ship /tmp/gpu-jakiro jakiro
ls -la "$OUT"
