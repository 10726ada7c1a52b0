#!/bin/bash
# compare-results.sh BUILDDIR OUTFILE: the exact fp32 (and bf16) results of test-parity.sh's
# layouts, so that a change meant to leave training bit-identical (a refactor) can be proven so:
#     tests/train/compare-results.sh /path/to/old-build old.txt
#     tests/train/compare-results.sh /path/to/new-build new.txt
#     diff old.txt new.txt && echo bit-identical
# It runs test-parity.sh of the source tree it lives in (its recipes, its layouts) against
# BUILDDIR's programs, as `make check` does (AM_SRCDIR, AM_BUILDDIR, AM_MODELS_DIR), keeps the
# work directory (AM_PARITY_KEEP) and writes OUTFILE, sorted (LC_ALL=C), with
#   log NAME rank-R STEP:LOSS:GRAD_NORM ...   one line per layout and rank log that has step
#       records: the loss and grad_norm of every step as the JSON line prints them (%.17g of
#       the double), not reformatted;
#   ckpt NAME PATH SHA256                     one line per file of the layout's checkpoint
#       directory (ckpt-NAME: the shards rank-*.bin, manifest.json with their crc32c, config.json,
#       the Hugging Face export hf/model.safetensors and hf/config.json, and `latest`);
#       manifest.json is hashed without its "time" line (the save's wall-clock time, the one
#       value that differed between two runs of the same build);
#   # threads N, cpu MODEL                    what the bits depend on besides the code.
# Layouts that are refused (no step records) leave no line: which rank refuses first varies.
# The verdicts of test-parity.sh itself are not in OUTFILE: its output is kept beside the work
# directory (parity.out) and its last line printed; BUILDDIR without tests/train/ckpt_diff (not
# built before `make check`) makes its checkpoint comparisons fail, which OUTFILE does not see.
# Threads: every rank runs OMP_NUM_THREADS=1 (AM_COMPARE_THREADS=N for another count). am-launch
# would give each rank usable cores / ranks threads, and the bits depend on the count (the
# one-rank references' losses differ from the 10th digit between 1 and 2 threads: reductions
# split over threads), so OUTFILE would depend on the machine's cores; one thread also runs
# many times faster on a busy machine (OpenMP's threads spin). Set AM_COMPARE_THREADS=2 to
# cover a change to how a kernel splits its work over threads. The CPU matters too (am-launch
# picks OpenBLAS's kernels by it): compare OUTFILEs made on the same machine.
# Measured: two runs of the same build give the same OUTFILE, at 1 thread and at 2.
# Environment: AM_PARITY_ONLY (and AM_PARITY_BF16) pass through to test-parity.sh to run some
# layouts only (the 14 one-rank references always run); TMPDIR is where the work directory
# (compare-results.XXXXXX) is made; AM_COMPARE_CLEAN=1 removes it at the end.
# compare-results.sh --resume BUILDDIR OUTFILE: the same of test-resume.sh's uninterrupted runs
# (AM_RESUME_TRIALS 0 unless given): its references (r1, r-*: checkpoints of steps 4 and 6, the
# sharded files only), r1-final, ref1 and ref1-moe, the sources of the re-sharding (s-*) and the
# runs restored from them at another layout (to-*: their step 6 and its Hugging Face export).
# The runs killed on purpose, the one warned by SIGUSR1 (the step it saves depends on timing)
# and the refused ones are left out.
set -u
test=parity
[ "${1:-}" = --resume ] && { test=resume; shift; }
if [ $# != 2 ]; then
    echo "usage: $0 [--resume] BUILDDIR OUTFILE (AM_PARITY_ONLY=\"NAME RANKS CHANGES REF [VAR=VALUE...];...\" for some layouts)" >&2
    exit 2
fi
build=$(cd "$1" && pwd) || exit 2
out=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
for p in am-launch am-data am-train; do
    [ -x "$build/$p" ] || { echo "compare-results.sh: $build/$p: not built (build BUILDDIR first)" >&2; exit 2; }
done
[ -x "$build/tests/train/ckpt_diff" ] ||
    echo "compare-results.sh: $build/tests/train/ckpt_diff not built: test-parity.sh's checkpoint checks fail (OUTFILE is not affected)" >&2

threads=${AM_COMPARE_THREADS:-1}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/compare-results.XXXXXX") || exit 2
echo "compare-results.sh: work directory $tmp" >&2
start=$(date +%s)
# as the test environment of Makefile.am, from the build directory
(cd "$build" && env AM_SRCDIR="$src" AM_BUILDDIR="$build" AM_MODELS_DIR="$src/runtime/recipe/models" \
    HF_HUB_CACHE="$build/tests/no-hf-cache" AM_PARITY_KEEP=1 AM_RESUME_KEEP=1 AM_RESUME_TRIALS="${AM_RESUME_TRIALS:-0}" \
    TMPDIR="$tmp" OMP_NUM_THREADS="$threads" bash "$src/tests/train/test-$test.sh") >"$tmp/$test.out" 2>&1
rc=$?
echo "compare-results.sh: test-$test.sh ended with $rc after $(($(date +%s) - start)) s: $(tail -n1 "$tmp/$test.out")" >&2
work=$(ls -d "$tmp"/tmp.* 2>/dev/null | head -n1)
first=ref
[ "$test" = resume ] && first=r1
[ -d "$work/logs-$first" ] || { echo "compare-results.sh: no work directory with logs-$first under $tmp (see $tmp/$test.out)" >&2; exit 1; }
keep() { # NAME: whether the run's results go to OUTFILE
    [ "$test" = parity ] && return 0
    case $1 in r1 | r1-final | r-* | ref1 | ref1-moe | s-* | to-*) return 0 ;; esac
    return 1
}

{
    echo "# test-$test.sh, threads $threads, cpu $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)"
    for logs in "$work"/logs-*; do
        name=${logs##*/logs-}
        keep "$name" || continue
        for log in "$logs"/*/rank-*.jsonl; do
            [ -f "$log" ] || continue
            r=${log##*/}
            awk -v head="log $name ${r%.jsonl}" '
                function field(k) { # the value of "k" as printed: the characters up to , or }
                    if (!match($0, "\"" k "\":[^,}]*")) return "none"
                    return substr($0, RSTART + length(k) + 3, RLENGTH - length(k) - 3) }
                /"type":"step"/ { line = line " " field("step") ":" field("loss") ":" field("grad_norm"); n++ }
                END { if (n) print head line }' "$log"
        done
    done
    for ckpt in "$work"/ckpt-*; do
        [ -d "$ckpt" ] || continue
        name=${ckpt##*/ckpt-}
        keep "$name" || continue
        (cd "$ckpt" && find . -type f | sort) | while read -r f; do
            case $f in
            */manifest.json) sum=$(grep -v '^ *"time": ' "$ckpt/$f" | sha256sum) ;;
            *) sum=$(sha256sum <"$ckpt/$f") ;;
            esac
            echo "ckpt $name ${f#./} ${sum%% *}"
        done
    done
} | LC_ALL=C sort >"$out.tmp" && mv "$out.tmp" "$out" || exit 1
echo "compare-results.sh: $(grep -c '^log ' "$out") rank logs, $(grep -c '^ckpt ' "$out") checkpoint files in $out" >&2
[ -n "${AM_COMPARE_CLEAN:-}" ] && rm -rf "$tmp"
exit 0
