#!/bin/bash
# Runs am-diag's fuzzer (tests/fuzz/fuzz_diag.c): first every kept regression input once, then
# a bounded search (DIAG_FUZZ_SECONDS, default 20) from the seed logs and the regressions.
# Fails on any crash, leak, sanitizer report or disagreement of the fast reader with jansson.
set -eu
src=${AM_SRCDIR:-.}
fuzzer=${AM_BUILDDIR:-.}/tests/fuzz/fuzz_diag
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

shopt -s nullglob
regressions=("$src"/tests/fuzz/diag-regressions/*)
if [ ${#regressions[@]} -gt 0 ]; then
    "$fuzzer" -runs=1 "${regressions[@]}" >"$work/regressions.log" 2>&1 || { cat "$work/regressions.log"; exit 1; }
    echo "fuzz_diag: ${#regressions[@]} regression inputs pass"
fi
mkdir "$work/corpus"
cp "$src"/tests/fuzz/diag-seeds/* "${regressions[@]}" "$work/corpus/"
if ! "$fuzzer" -max_total_time="${DIAG_FUZZ_SECONDS:-20}" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
        -dict="$src/tests/fuzz/diag.dict" -artifact_prefix="$work/" "$work/corpus" >"$work/fuzz.log" 2>&1; then
    tail -n 60 "$work/fuzz.log"
    for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
        echo "fuzz_diag: failing input (keep it in tests/fuzz/diag-regressions/ once fixed):"
        base64 "$f"
    done
    exit 1
fi
grep -E "^#[0-9]+.*DONE|Done [0-9]+ runs" "$work/fuzz.log" | tail -n 1
echo "fuzz_diag: no crash in ${DIAG_FUZZ_SECONDS:-20} s"
