#!/bin/bash
# Tokenisation throughput: `am-data build --tokenizer` against the Hugging Face `tokenizers`
# library (bench/tokenize_peer.py) on the same JSONL corpus (about 60 MB of text found on a
# Debian machine: licenses, copyright files, Python sources) with the same Llama 3-style
# tokenizer (16384 ids, trained on the corpus), both on all cores, one after the other REPEAT
# times (default 3), median tokens/s. am-data's time is the whole build (reading, JSON,
# encoding, writing the dataset); the library's is encode_batch alone (the texts already in
# memory), which favours the peer. The ids are checked equal first. PYTHON names an
# interpreter with tokenizers (default /tmp/goldenv/bin/python).
#   bench/tokenize.sh [BUILDDIR]
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
py=${PYTHON:-/tmp/goldenv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -c "import tokenizers" 2>/dev/null || { echo "bench: $py has no tokenizers (set PYTHON)"; exit 1; }
source "$src/bench/lib.sh"
th=$(nproc)
echo "tokenisation: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $th cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "tokenizers $("$py" -c 'import tokenizers; print(tokenizers.__version__)'); corpus: $("$py" "$src/bench/tokenize_peer.py" prepare "$work")"
"$build/am-data" build --tokenizer "$work/tok.json" --out "$work/ds" --no-progress "$work/corpus.jsonl" >/dev/null
"$py" "$src/bench/tokenize_peer.py" check "$work" "$work/ds"
: >"$work/am" && : >"$work/peer"
for ((i = 0; i < ${REPEAT:-3}; i++)); do
    rm -f "$work"/ds.*
    "$build/am-data" build --tokenizer "$work/tok.json" --out "$work/ds" --threads "$th" --no-progress \
        "$work/corpus.jsonl" | sed -E 's/.*, ([0-9.]+) tokens\/s.*/\1/' >>"$work/am"
    RAYON_NUM_THREADS=$th "$py" "$src/bench/tokenize_peer.py" run "$work" >>"$work/peer"
done
am=$(median <"$work/am") peer=$(median <"$work/peer")
printf '%-8s %14s %16s %10s\n' threads "am tok/s" "tokenizers tok/s" "am/peer"
printf '%-8s %14.0f %16.0f %10.2f\n' "$th" "$am" "$peer" "$(echo "$am / $peer" | bc -l)"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
