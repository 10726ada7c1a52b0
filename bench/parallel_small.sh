#!/bin/bash
# bench-small sharded: tokens/s of am-train at tp 2 and pp 2 against 1 rank on this machine,
# the scaling efficiency, and the pipeline bubble measured against (pp - 1) / (m + pp - 1).
#   bench/parallel_small.sh [BUILDDIR]    (run from the source tree; BUILDDIR defaults to .)
# Each rank runs one OpenMP thread, so 2 ranks use 2 cores: efficiency = tokens/s of the
# 2-rank layout / (2 x tokens/s of 1 rank with 1 thread). The bubble of a pipeline rank is the
# share of its step spent waiting in communication (comm_s / step_s in its log: receives of
# activations and gradients, which on one machine move in microseconds, so the wait is the
# bubble); GPipe and 1F1B both idle (pp - 1) / (m + pp - 1) of a step in theory, for stages
# of equal cost. bench-small's last stage also holds the 8192-word head and the loss, so its
# first stage waits for it longer than the bubble; a second table repeats the pipeline runs
# with a 512-word vocabulary, where the two stages cost about the same.
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$src/bench/lib.sh"
bench_data "$work" "$build"

vocab=8192
run() { # NAME RANKS BATCH SCHEDULE [VAR=VALUE...]: bench_small with global = local batch BATCH
    local name=$1 n=$2 batch=$3 schedule=$4
    shift 4
    sed -e "s/global_batch_size: .*/global_batch_size: $batch/" -e "s/local_batch_size: .*/local_batch_size: $batch/" \
        -e "s/vocab_size: .*/vocab_size: $vocab/" \
        -e "s/^distributed:/distributed:\n  pipeline:\n    pp_schedule: $schedule/" \
        "$src/bench/bench_small.yaml" >"$work/$name.yaml"
    (cd "$work" && env OMP_NUM_THREADS=1 "$@" AM_LOG_DIR="logs-$name" "$build/am-launch" --nproc "$n" "$name.yaml" \
        >"out-$name" 2>&1) || { echo "bench: $name failed"; cat "$work/out-$name"; exit 1; }
}
field() { step_field "$work/logs-$1" "$3" "$2" | median; } # NAME RANK KEY: median over steps 3..
tok_s() { echo "$(grep -h '"type":"step"' "$work"/logs-"$1"/*/rank-0.jsonl | head -1 |
    sed -E 's/.*"tokens":([0-9]+).*/\1/') / $(field "$1" 0 step_s)" | bc -l; }
bubble() { # NAME RANK: comm_s / step_s of that rank, median over steps 3..
    grep -h '"type":"step"' "$work"/logs-"$1"/*/rank-"$2".jsonl | tail -n +3 |
        sed -E 's/.*"step_s":([^,}]*).*"comm_s":([^,}]*).*/\1 \2/' | awk '{ print $2 / $1 }' | median
}

echo "bench-small sharded: Llama hidden 512, 4 layers, seq 256, fp32, 1 thread per rank"
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
table() { # LAYOUTS...: one row per layout at batch 4 and 8 against 1 rank
    printf '%-24s %10s %11s %24s %10s\n' layout "tok/s" efficiency "bubble rank 0 / rank 1" theory
    local layouts=("$@") batch layout name got eff b0 b1 one
    for batch in 4 8; do
        run "one-$vocab-$batch" 1 "$batch" 1f1b
        one=$(tok_s "one-$vocab-$batch")
        printf '%-24s %10.0f %11s %24s %10s\n' "1 rank, batch $batch" "$one" - - -
        for layout in "${layouts[@]}"; do
            set -- $layout
            name="$1-$vocab-$batch"
            run "$name" 2 "$batch" "$2" "$3"
            got=$(tok_s "$name")
            eff=$(echo "100 * $got / (2 * $one)" | bc -l)
            if [ "${1#pp}" != "$1" ]; then
                b0=$(bubble "$name" 0) b1=$(bubble "$name" 1)
                printf '%-24s %10.0f %10.0f%% %11.0f%% / %5.0f%% %9.0f%%\n' "$1, m $batch" "$got" "$eff" \
                    "$(echo "100 * $b0" | bc -l)" "$(echo "100 * $b1" | bc -l)" "$(echo "100 / ($batch + 1)" | bc -l)"
            else
                printf '%-24s %10.0f %10.0f%% %24s %10s\n' "$1, batch $batch" "$got" "$eff" - -
            fi
        done
    done
}
echo "vocabulary 8192 (bench-small):"
table "tp2 1f1b AM_TP=2" "pp2-1f1b 1f1b AM_PP=2" "pp2-gpipe gpipe AM_PP=2"
vocab=512
echo "vocabulary 512 (stages of about equal cost):"
table "pp2-1f1b 1f1b AM_PP=2" "pp2-gpipe gpipe AM_PP=2"
