#!/usr/bin/env bash
# Our EAGLE-3 draft in llama.cpp, end to end: build llama.cpp from the source PyPI's
# llama-cpp-python 0.3.36 vendors (scripts/build_llama_cpp.sh, once), export the shipped
# smollm2-135m-eagle3 draft (or DRAFT=folder) to the GGUF llama.cpp loads, and run on the same
# held-out questions, interleaved, with the same threads and a fixed chain of DEPTH tokens:
#   llamacpp         llama.cpp's plain decoding (llama-server)
#   llamacpp-eagle3  llama.cpp's --spec-type draft-eagle3 with our draft (llama-server)
#   llamacpp-draft   llama.cpp's draft-simple with the target drafting for itself (llama-server)
#   ar, eagle3       our runtime's plain decoding and the same draft as the same chain
# then llama-speculative-simple --spec-type draft-eagle3 on the first question, for llama.cpp's
# own acceptance report. llama.cpp's greedy output with the draft is compared with its plain
# output (llamacpp_match in summary.json) and with its output when the target drafts for itself;
# acceptance (drafted tokens accepted) sits next to ours.
# Usage: scripts/eagle3_llamacpp.sh [OUT]   (env: DRAFT, DEPTH=3, THREADS=2, PER_CATEGORY=1,
# QUESTIONS=../shared/data/spec_bench/question.jsonl, TOKENS=128)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/eagle3-llamacpp}
DEPTH=${DEPTH:-3}
THREADS=${THREADS:-2}
TOKENS=${TOKENS:-128}
QUESTIONS=${QUESTIONS:-../shared/data/spec_bench/question.jsonl}
DRAFT=${DRAFT:-jakiro/drafts/smollm2-135m-eagle3}
JAKIRO=${JAKIRO:-.venv/bin/jakiro}
PY=${PY:-.venv/bin/python}
BIN=${JAKIRO_LLAMA_CPP:-${JAKIRO_CACHE:-$HOME/.cache/jakiro}/llama.cpp/bin}
[ -x "$BIN/llama-speculative-simple" ] || scripts/build_llama_cpp.sh
mkdir -p "$OUT"
# llamacpp-draft with the target drafting for itself (a near-perfect draft): llama.cpp's speculative
# output whatever the draft, to tell its verification's numerics from the draft's effect
"$JAKIRO" bench --questions "$QUESTIONS" --limit-per-category "${PER_CATEGORY:-1}" --threads "$THREADS" \
  --methods ar,eagle3,llamacpp,llamacpp-eagle3,llamacpp-draft --draft "eagle3=$DRAFT" --draft-model smollm2-135m \
  --depth "$DEPTH" --tree-top-k 1 --total-tokens "$DEPTH" --max-new-tokens "$TOKENS" --out "$OUT"
TARGET=$("$PY" -c "from jakiro.models.hub import resolve_target; from jakiro.models.gguf_file import source_file; print(source_file(resolve_target()))")
PROMPT=$("$PY" - "$QUESTIONS" <<'EOF'
import json, sys
from jakiro.api import load_tokenizer
from jakiro.models.hub import resolve_target
q = json.loads(open(sys.argv[1]).readline())
tok = load_tokenizer(resolve_target())
print(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False, add_generation_prompt=True))
EOF
)
"$BIN/llama-speculative-simple" -m "$TARGET" -md "$OUT/eagle3-draft.gguf" --spec-type draft-eagle3 -p "$PROMPT" \
  -n "$TOKENS" --temp 0 -t "$THREADS" --spec-draft-n-max "$DEPTH" --spec-draft-n-min "$DEPTH" --spec-draft-p-min 0 \
  > "$OUT/speculative-simple.log" 2>&1
grep -E "n_drafted|n_accept|accept |decoded" "$OUT/speculative-simple.log" | sed 's/^[0-9.]* I //'
"$PY" - "$OUT/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["methods"]
print(f"{'method':16} {'tokens/s':>9} {'decoding tokens/s':>18} {'acceptance':>11} {'same text as its plain':>23}")
for m in ("ar", "eagle3", "llamacpp", "llamacpp-eagle3", "llamacpp-draft"):
    a = s[m]["all"]
    acc = f"{a['acceptance']:.3f}" if a.get("acceptance") is not None else "-"
    same = a.get("llamacpp_match") if m.startswith("llamacpp-") else (a.get("greedy_match") if m == "eagle3" else None)
    print(f"{m:16} {a['tokens_per_s']:9.1f} {a['decode_tokens_per_s']:18.1f} {acc:>11} "
          f"{'-' if same is None else f'{same:.2f}':>23}")
answers = {}
for line in open(sys.argv[1].replace("summary.json", "progress.jsonl")):
    for m, rec in json.loads(line).items():
        answers.setdefault(m, []).extend(t["token_ids"] for t in rec["turns"])
same = sum(x == y for x, y in zip(answers["llamacpp-eagle3"], answers["llamacpp-draft"]))
print(f"llama.cpp with our draft: the same answer as llama.cpp with the target drafting for itself in "
      f"{same} of {len(answers['llamacpp-draft'])}")
for a, b in (("llamacpp-eagle3", "llamacpp"), ("eagle3", "ar")):
    x, y = s[a]["all"], s[b]["all"]
    print(f"{a} / {b}: decoding {x['decode_tokens_per_s'] / y['decode_tokens_per_s']:.2f}x, "
          f"with the prompt {x['tokens_per_s'] / y['tokens_per_s']:.2f}x")
EOF
