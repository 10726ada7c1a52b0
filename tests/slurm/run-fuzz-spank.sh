#!/bin/bash
# Runs the plugin's parser fuzzer (tests/slurm/fuzz_spank.c) for SPANK_FUZZ_SECONDS
# (default 10) from the seeds in tests/slurm/fuzz-seeds. Fails on any crash, leak, timeout
# or sanitizer report, and prints the failing input.
set -eu
src=${AM_SRCDIR:-.}
fuzzer=${AM_BUILDDIR:-.}/tests/slurm/fuzz_spank
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
mkdir "$work/corpus"
cp "$src"/tests/slurm/fuzz-seeds/* "$work/corpus/"
if ! "$fuzzer" -max_total_time="${SPANK_FUZZ_SECONDS:-10}" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$work/" "$work/corpus" >"$work/fuzz.log" 2>&1; then
    tail -n 60 "$work/fuzz.log"
    for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
        [ -e "$f" ] || continue
        echo "fuzz_spank: failing input:"
        base64 "$f"
    done
    exit 1
fi
grep -E "Done [0-9]+ runs" "$work/fuzz.log" | tail -n 1
echo "fuzz_spank: no crash in ${SPANK_FUZZ_SECONDS:-10} s"
