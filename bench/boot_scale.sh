#!/usr/bin/env bash
# bench/boot_scale.sh - the standalone bootstrap at 1,024 to 16,384 simulated ranks
# (bench/boot_scale: the real boot server in one process, the ranks as threads), with the
# one-request allgather, and the put + fence + N gets it replaced up to 1,024 ranks (its N^2
# requests make larger runs minutes long). Prints boot_scale's table; docs/performance.md
# ("Bootstrap at scale") has the figures and what they predict.
# Usage: bench/boot_scale.sh [RANKS...]      (from the build directory)
set -euo pipefail
BUILD=${AM_BUILDDIR:-$PWD}
[[ -x $BUILD/bench/boot_scale ]] || make -C "$BUILD" bench/boot_scale >/dev/null
ranks=("$@")
[ ${#ranks[@]} -gt 0 ] || ranks=(1024 2048 4096 8192 16384)
"$BUILD/bench/boot_scale" --mode allgather "${ranks[@]}"
small=()
for n in "${ranks[@]}"; do [ "$n" -le 1024 ] && small+=("$n"); done
[ ${#small[@]} -eq 0 ] || "$BUILD/bench/boot_scale" --mode gets "${small[@]}" | tail -n +2
