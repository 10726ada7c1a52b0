# bench/lib.sh - what the bench-small scripts share (sourced, not run).

# bench_data WORK BUILD: WORK/bench-data/random_tokens, the Megatron dataset bench_small.yaml
# reads: 64 documents of 2048 random tokens in [0, 8192), the same every time.
bench_data() {
    awk 'BEGIN { srand(1); for (d = 0; d < 64; d++) { for (i = 0; i < 2048; i++) printf "%d ", int(rand() * 8192); print "" } }' \
        >"$1/ids.txt"
    mkdir -p "$1/bench-data"
    "$2/am-data" build --out "$1/bench-data/random_tokens" "$1/ids.txt" >/dev/null
}

# median: of the numbers on standard input, one a line
median() { sort -g | awk '{ v[NR] = $1 } END { printf "%.4f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# step_field LOGDIR KEY [RANK]: KEY of every step record after the first two (warm-up), of
# every rank or of RANK only
step_field() {
    grep -h '"type":"step"' "$1"/*/rank-${3:-*}.jsonl | grep -v '"step":[12],' | sed -E "s/.*\"$2\":([^,}]*).*/\\1/"
}

# am_tokens_s WORK BUILD RECIPE THREADS: bench-small's tokens/s on one rank, the median over
# steps 3.. (the first two warm up) of a run of RECIPE (in WORK)
am_tokens_s() {
    (cd "$1" && rm -rf logs && OMP_NUM_THREADS=$4 AM_LOG_DIR=logs "$2/am-launch" --nproc 1 "$3" >/dev/null)
    grep -h '"type":"step"' "$1"/logs/*/rank-0.jsonl | sed -E 's/.*"step_s":([^,}]*).*/\1/' | tail -n +3 |
        median | awk '{ printf "%.1f\n", 1024 / $1 }'
}
