#!/usr/bin/env bash
# test-load-progress.sh - rank 0 shows its loading of a Hugging Face model's weights on a
# terminal (progress.h: the bytes of its share, the rate, the time left), once per job, and
# nothing when stderr is not a terminal. The terminal is script(1)'s pseudo-terminal; the
# model is the llama_gqa golden's (tests/golden/models).
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN AM_FAULT 2>/dev/null || true
command -v script >/dev/null || { echo "skip: no script(1) for a pseudo-terminal"; exit 77; }
T=$(mktemp -d /tmp/am-load-XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
"$AM_BUILDDIR/am-data" build --bytes --out "$T/corpus" /usr/share/common-licenses/* >/dev/null || exit 1
awk -v base="$AM_SRCDIR/tests/golden/models/llama_gqa" -v data="$T/corpus" '
    /^model:/ { print "model:\n  pretrained_model_name_or_path: " base "\n"; skip = 1; next }
    skip && /^[a-z]/ { skip = 0 }
    skip { next }
    { sub(/paths: .*/, "paths: " data); sub(/max_steps: .*/, "max_steps: 2"); sub(/seq_length: .*/, "seq_length: 32"); print }' \
    "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$T/load.yaml"
bytes=$(( $(du -b "$AM_SRCDIR/tests/golden/models/llama_gqa/model.safetensors" | cut -f1) / 1000 ))
(cd "$T" && script -qec "'$AM_BUILDDIR/am-launch' --nproc 2 --log-dir '$T/tty' load.yaml" /dev/null </dev/null >"$T/tty.out")
n=$(tr '\r' '\n' <"$T/tty.out" | grep -cE '^am-train: loading the weights: 100\.0%  [0-9]+ kB of [0-9]+ kB  ')
if [ "$n" = 1 ] && grep -q 'step    2/2' "$T/tty.out"; then
    echo "ok: on a terminal, rank 0's load ends at 100.0% once (the checkpoint holds about $bytes kB), then the job trains"
else
    echo "FAIL: on a terminal: $n lines ending the load at 100.0%, want 1:"; cat -A "$T/tty.out" | head; fails=1
fi
(cd "$T" && "$AM_BUILDDIR/am-launch" --nproc 2 --log-dir "$T/pipe" load.yaml >"$T/pipe.out" 2>"$T/pipe.err") ||
    { echo "FAIL: the job did not train"; cat "$T/pipe.err"; exit 1; }
if grep -q 'loading the weights' "$T/pipe.err" "$T/pipe.out"; then
    echo "FAIL: a progress line without a terminal"; fails=1
else
    echo "ok: without a terminal, no progress line"
fi
[ $fails = 0 ]
