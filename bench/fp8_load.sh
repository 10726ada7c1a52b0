#!/bin/bash
# FP8 checkpoints: what dequantising at load costs. A synthetic model's weights (N matrices of
# R x C, default 12 of 2048 x 6144: 151M parameters, 302 MB in bf16) written twice by torch (the
# golden venv: AM_GOLDEN_PYTHON, tests/golden/README.md): in bf16, and in FP8 as DeepSeek-V3
# ships it (F8_E4M3, one fp32 scale per 128 x 128 block, 151 MB). bench/fp8_load reads every
# weight into fp32 host memory as am-train's load does, whole (one rank) and as tp rank 0 of 2
# (rows [0, R/2) of each), from the page cache (warm: the median of 5) and from the disk (cold:
# the files' pages dropped first with dd iflag=nocache, the median of 3).
#   bench/fp8_load.sh [BUILDDIR]     (run from the source tree; BUILDDIR defaults to .)
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
PY=${AM_GOLDEN_PYTHON:-/tmp/goldenv/bin/python}
N=${N:-12} R=${R:-2048} C=${C:-6144}
work=$(mktemp -d "${AM_BENCH_DIR:-/tmp}/am-fp8-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$PY" - "$work" "$N" "$R" "$C" <<'PYEOF'
import os, sys, torch
from safetensors.torch import save_file
out, n, R, C = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(1)
bf, fp = {}, {}
for i in range(n):
    w = torch.randn(R, C, generator=g) * 0.02
    name = f"model.layers.{i}.mlp.up_proj.weight"
    bf[name] = w.to(torch.bfloat16)
    blk = w.reshape(R // 128, 128, C // 128, 128)
    s = blk.abs().amax(dim=(1, 3)) / 448.0
    fp[name] = (blk / s[:, None, :, None]).to(torch.float8_e4m3fn).reshape(R, C)
    fp[name + "_scale_inv"] = s
for kind, t in (("bf16", bf), ("fp8", fp)):
    os.makedirs(os.path.join(out, kind))
    save_file(t, os.path.join(out, kind, "model.safetensors"), metadata={"format": "pt"})
PYEOF
drop() { dd if="$1/model.safetensors" iflag=nocache count=0 status=none; }
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
# run KIND TP COLD: seconds (median)
run() {
    local dir=$work/$1 args=(0 0 "$2") reps=5
    [ "$1" = fp8 ] && args=(128 128 "$2")
    [ "$3" = cold ] && reps=3
    for _ in $(seq $reps); do
        [ "$3" = cold ] && drop "$dir"
        "$build/bench/fp8_load" "$dir" "${args[@]}" | awk '{ print $2 }'
    done | median
}
for k in bf16 fp8; do printf '%s file: %s bytes\n' "$k" "$(stat -c %s "$work/$k/model.safetensors")"; done
printf '%-6s %-4s %-5s %s\n' kind tp cache seconds
for tp in 1 2; do
    for cache in warm cold; do
        for k in bf16 fp8; do
            printf '%-6s %-4s %-5s %s\n' "$k" "$tp" "$cache" "$(run "$k" "$tp" "$cache")"
        done
    done
done
