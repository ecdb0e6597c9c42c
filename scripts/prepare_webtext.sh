#!/usr/bin/env bash
# Clean downloaded web pages into a training corpus: tools/openwebtext/run_pipeline.py
# (merge -> ftfy/language/length cleanup -> MinHash near-duplicate removal -> shuffle ->
# .bin/.idx).  Reruns skip the stages that finished; a table of kept/dropped ends the run.
#
#   PAGES=downloaded_pages/ [URLS=url_lists/] bash scripts/prepare_webtext.sh
#   bash scripts/prepare_webtext.sh          # demo on this machine, see below
#
# PAGES: directories or files of loose JSON pages, one {"text": ..., "url": ...} per line
# (download is not part of this repository; see tools/openwebtext/README.md).  Without PAGES
# the script runs a scaled-down demo: the default corpus (data/webtext/data.json, made by
# scripts/prepare_default_data.sh) is cut into page files under $WORK_DIR/demo_pages, with
# one near-duplicate and one repeated URL planted per 50 documents (DEMO_DOCS caps how many
# documents are used).  It takes about a minute or two on 2 cores.
#
# Variables: PAGES, URLS, DATA_DIR (<repo>/data), WORK_DIR ($DATA_DIR/owt_work),
#   OUTPUT_JSON ($WORK_DIR/train_data.json; set $DATA_DIR/webtext/data.json to train with
#   --train-data webtext), WORKERS (2), MIN_TOKENS (128), LANGUAGE (en), THRESHOLD (0.8),
#   SEED (1234), DEMO_DOCS (0 = all documents of the default corpus), VENV (<repo>/.venv).
[ -n "${BASH_VERSION:-}" ] || { echo "error: run this script with bash: bash $0" >&2; exit 2; }
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/check_env.sh"  # before prepare_default_data.sh's setup and corpus
from_callers_folder DATA_DIR WORK_DIR OUTPUT_JSON
from_callers_folder --lists PAGES URLS  # (word-split where they are passed on)
cd "$ROOT"
require_whole 1 WORKERS
require_whole 0 DEMO_DOCS MIN_TOKENS SEED
require_number THRESHOLD
DATA_DIR="${DATA_DIR:-$ROOT/data}"
WORK_DIR="${WORK_DIR:-$DATA_DIR/owt_work}"
OUTPUT_JSON="${OUTPUT_JSON:-$WORK_DIR/train_data.json}"
WORKERS="${WORKERS:-2}"
DEMO_DOCS="${DEMO_DOCS:-0}"

# The default corpus and its tokenizer (the pipeline's length filter counts its tokens).
source scripts/prepare_default_data.sh
EXTRAS=webtext bash scripts/setup.sh

if [ -z "${PAGES:-}" ]; then
    PAGES="$WORK_DIR/demo_pages"
    if [ ! -d "$PAGES" ]; then
        echo "[demo] cutting $CORPUS into page files under $PAGES"
        "$PY" - "$CORPUS" "$PAGES" "$DEMO_DOCS" <<'PYEOF'
import json, os, sys
corpus, pages, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
tmp = pages + ".tmp"
os.makedirs(tmp, exist_ok=True)
with open(corpus, encoding="utf-8") as f:
    docs = [json.loads(line) for line in f][:limit or None]
files = [open(os.path.join(tmp, f"pages_{k}.json"), "w", encoding="utf-8") for k in range(4)]
for i, doc in enumerate(docs):
    out = files[i % 4]
    url = doc.get("url") or f"https://demo.invalid/page{i}"  # a corpus without URLs
    out.write(json.dumps({"text": doc["text"], "url": url}, ensure_ascii=False) + "\n")
    if i % 50 == 0:  # a near-duplicate (one word changed) and a page downloaded twice
        words = doc["text"].split(" ")
        words[len(words) // 2] = "zounds"
        out.write(json.dumps({"text": " ".join(words), "url": url + "#mirror"}) + "\n")
        out.write(json.dumps({"text": doc["text"], "url": url}) + "\n")
for out in files:
    out.close()
os.replace(tmp, pages)
PYEOF
    fi
fi

url_flags=()
if [ -n "${URLS:-}" ]; then
    url_flags=(--urls $URLS)
fi
"$PY" tools/openwebtext/run_pipeline.py --pages $PAGES "${url_flags[@]}" \
    --work-dir "$WORK_DIR" --output-json "$OUTPUT_JSON" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$TOKENIZER_DIR/vocab.json" \
    --merge-file "$TOKENIZER_DIR/merges.txt" --min-tokens "${MIN_TOKENS:-128}" \
    --language ${LANGUAGE:-en} --threshold "${THRESHOLD:-0.8}" --seed "${SEED:-1234}" \
    --workers "$WORKERS"
echo "[done] corpus: $OUTPUT_JSON; train with --data-path $WORK_DIR/webtext_text_document"
