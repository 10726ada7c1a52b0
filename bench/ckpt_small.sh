#!/bin/bash
# Checkpoints: the time and bandwidth of a sharded save and of a restore per rank (each rank's
# file: fp32 masters and AdamW's two moments, 12 bytes a parameter), at 1 rank and at dp 2
# (fsdp2: each rank saves half), against the peer on the same disk: dd writing the same bytes
# with an fsync at the end (conv=fsync), and reading them back.
#   bench/ckpt_small.sh [BUILDDIR] [SIZE]    (run from the source tree; BUILDDIR defaults to .)
# SIZE: small (default) is bench-small (20.2M parameters: 242 MB of checkpoint at 1 rank);
# 0.3b is a Llama of 300M parameters (hidden 1024, 24 layers, 16 heads, 8 kv heads,
# intermediate 2816, vocab 8192: 3.6 GB of checkpoint at 1 rank), trained on sequences of 64
# tokens so that its two steps stay short. It needs about 3 times its checkpoint free on the
# disk of AM_BENCH_DIR (default /tmp) and twice in memory; the script checks the disk first.
# The figures: a save's "seconds" (its "checkpoint" record: from the first all-reduce to the
# commit of `latest`, fsyncs included) and a restore's (its "restore" record: manifest, crc32c
# of every file read, copies into the rank's arrays); bandwidth = the rank's file bytes / time.
# Reads are cold for both: the files' pages are dropped from the page cache first (dd
# iflag=nocache, which needs no privilege), so a restore and dd read from the disk.
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
size=${2:-small}
case $size in
small) need_gb=1 ;;
0.3b) need_gb=12 ;;
*) echo "ckpt_small.sh: SIZE is small or 0.3b, not '$size'" >&2; exit 2 ;;
esac
base_dir=${AM_BENCH_DIR:-/tmp}
free_gb=$(df -P -k "$base_dir" | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
if [ "$free_gb" -lt "$need_gb" ]; then
    echo "ckpt_small.sh: $base_dir has $free_gb GiB free, SIZE $size needs $need_gb: set AM_BENCH_DIR" >&2
    exit 1
fi
work=$(mktemp -d "$base_dir/am-ckpt-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
source "$src/bench/lib.sh"
bench_data "$work" "$build"
sed -e 's/max_steps: .*/max_steps: 2/' "$src/bench/bench_small.yaml" >"$work/base.yaml"
if [ "$size" = 0.3b ]; then
    sed -i -e 's/hidden_size: .*/hidden_size: 1024/' -e 's/intermediate_size: .*/intermediate_size: 2816/' \
        -e 's/num_hidden_layers: .*/num_hidden_layers: 24/' -e 's/num_attention_heads: .*/num_attention_heads: 16/' \
        -e 's/num_key_value_heads: .*/num_key_value_heads: 8/' -e 's/seq_length: .*/seq_length: 64/' \
        -e 's/global_batch_size: .*/global_batch_size: 2/' "$work/base.yaml"
fi
cat >>"$work/base.yaml" <<YAML
checkpoint:
  enabled: true
  checkpoint_dir: ckpt
  restore_from: latest
  save_consolidated: false
YAML
batch=$(sed -n 's/.*global_batch_size: //p' "$work/base.yaml")

uncache() { local f; for f in "$@"; do dd if="$f" iflag=nocache count=0 status=none; done; }

echo "checkpoint bench ($size): load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
printf '%-10s %12s %10s %10s %10s %10s %10s %10s\n' layout bytes/rank save_s save_MB/s dd_MB/s restore_s read_MB/s ddread_MB/s
for n in 1 2; do
    rm -rf "$work/ckpt" "$work/logs"
    sed -e "s/local_batch_size: .*/local_batch_size: $((batch / n))/" "$work/base.yaml" >"$work/r.yaml"
    (cd "$work" && OMP_NUM_THREADS=$((2 / n)) AM_LOG_DIR=logs "$build/am-launch" --nproc $n r.yaml >/dev/null 2>&1)
    save=$(grep -h '"type":"checkpoint"' "$work"/logs/*/rank-0.jsonl | sed -E 's/.*"seconds":([^,}]*).*/\1/' | tail -1)
    bytes=$(stat -c %s "$work"/ckpt/step-2/rank-00000.bin)
    # the restore: the same job started again (max_steps reached: it restores and ends), cold
    rm -rf "$work/logs"
    uncache "$work"/ckpt/step-2/*
    (cd "$work" && OMP_NUM_THREADS=$((2 / n)) AM_LOG_DIR=logs "$build/am-launch" --nproc $n r.yaml >/dev/null 2>&1)
    restore=$(grep -h '"type":"restore"' "$work"/logs/*/rank-0.jsonl | sed -E 's/.*"seconds":([^,}]*).*/\1/')
    # the peer: dd writes the same bytes and fsyncs, then reads them (cold)
    dd_w=$( { /usr/bin/time -f %e dd if="$work/ckpt/step-2/rank-00000.bin" of="$work/dd.bin" bs=1M conv=fsync status=none; } 2>&1)
    uncache "$work/dd.bin"
    dd_r=$( { /usr/bin/time -f %e dd if="$work/dd.bin" of=/dev/null bs=1M status=none; } 2>&1)
    rm -f "$work/dd.bin"
    awk -v l="$([ $n = 1 ] && echo 1-rank || echo dp2-fsdp2)" -v b="$bytes" -v s="$save" -v r="$restore" -v w="$dd_w" -v rd="$dd_r" 'BEGIN {
        if (w <= 0) w = 0.005; if (rd <= 0) rd = 0.005
        printf "%-10s %12.0f %10.3f %10.0f %10.0f %10.3f %10.0f %10.0f\n", l, b, s, b / s / 1e6, b / w / 1e6, r, b / r / 1e6, b / rd / 1e6 }'
done
echo "load average $(cut -d' ' -f1-3 /proc/loadavg) at the end"
