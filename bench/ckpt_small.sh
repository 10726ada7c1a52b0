#!/bin/bash
# bench-small checkpoints: the time and bandwidth of a sharded save and of a restore per rank
# (each rank's file: fp32 masters and AdamW's two moments, 12 bytes a parameter), at 1 rank
# and at dp 2 (fsdp2: each rank saves half), against the peer on the same disk: dd writing
# the same bytes with an fsync at the end (conv=fsync), and reading them back.
#   bench/ckpt_small.sh [BUILDDIR]    (run from the source tree; BUILDDIR defaults to .)
# The figures: a save's "seconds" (its "checkpoint" record: from the first all-reduce to the
# commit of `latest`, fsyncs included) and a restore's (its "restore" record: manifest, crc32c
# of every file read, copies into the rank's arrays); bandwidth = the rank's file bytes / time.
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
work=$(mktemp -d "${AM_BENCH_DIR:-/tmp}/am-ckpt-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
source "$src/bench/lib.sh"
bench_data "$work" "$build"
sed -e 's/max_steps: .*/max_steps: 2/' "$src/bench/bench_small.yaml" >"$work/base.yaml"
cat >>"$work/base.yaml" <<YAML
checkpoint:
  enabled: true
  checkpoint_dir: ckpt
  restore_from: latest
  save_consolidated: false
YAML

printf '%-10s %12s %10s %10s %10s %10s %10s %10s\n' layout bytes/rank save_s save_MB/s dd_MB/s restore_s read_MB/s ddread_MB/s
for n in 1 2; do
    rm -rf "$work/ckpt" "$work/logs"
    sed -e "s/local_batch_size: .*/local_batch_size: $((4 / n))/" "$work/base.yaml" >"$work/r.yaml"
    (cd "$work" && OMP_NUM_THREADS=$((2 / n)) AM_LOG_DIR=logs "$build/am-launch" --nproc $n r.yaml >/dev/null 2>&1)
    save=$(grep -h '"type":"checkpoint"' "$work"/logs/*/rank-0.jsonl | sed -E 's/.*"seconds":([^,}]*).*/\1/' | tail -1)
    bytes=$(stat -c %s "$work"/ckpt/step-2/rank-00000.bin)
    # the restore: the same job started again (max_steps reached: it restores and ends)
    rm -rf "$work/logs"
    (cd "$work" && OMP_NUM_THREADS=$((2 / n)) AM_LOG_DIR=logs "$build/am-launch" --nproc $n r.yaml >/dev/null 2>&1)
    restore=$(grep -h '"type":"restore"' "$work"/logs/*/rank-0.jsonl | sed -E 's/.*"seconds":([^,}]*).*/\1/')
    # the peer: dd writes the same bytes and fsyncs, then reads them
    dd_w=$( { /usr/bin/time -f %e dd if="$work/ckpt/step-2/rank-00000.bin" of="$work/dd.bin" bs=1M conv=fsync status=none; } 2>&1)
    dd_r=$( { /usr/bin/time -f %e dd if="$work/dd.bin" of=/dev/null bs=1M status=none; } 2>&1)
    rm -f "$work/dd.bin"
    awk -v l="$([ $n = 1 ] && echo 1-rank || echo dp2-fsdp2)" -v b="$bytes" -v s="$save" -v r="$restore" -v w="$dd_w" -v rd="$dd_r" 'BEGIN {
        if (w <= 0) w = 0.005; if (rd <= 0) rd = 0.005
        printf "%-10s %12d %10.3f %10.0f %10.0f %10.3f %10.0f %10.0f\n", l, b, s, b / s / 1e6, b / w / 1e6, r, b / r / 1e6, b / rd / 1e6 }'
done
