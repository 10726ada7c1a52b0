#!/usr/bin/env bash
# test-version.sh - every program answers --version with its name and am's version, then what
# the build has (configure's AM_BUILT_WITH: each of CUDA, PMIx, UCX and OpenBLAS with its
# version, or "no X"), and exits 0 without doing anything else.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
version=$(sed -n 's/^AC_INIT(\[am\], \[\([^]]*\)\].*/\1/p' "$AM_SRCDIR/configure.ac")
fails=0 passes=0
for prog in am-launch am-plan am-diag am-data am-ckpt am-train am-doctor am-place; do
    bin=$(find "$AM_BUILDDIR" -maxdepth 1 -name "$prog" -type f -perm -u+x | head -n 1)
    [ -n "$bin" ] || { echo "skip: $prog is not built here"; continue; }
    out=$(cd /tmp && env -i PATH=/usr/bin:/bin "$bin" --version 2>&1)
    rc=$?
    first=$(sed -n 1p <<<"$out") second=$(sed -n 2p <<<"$out")
    if [ $rc = 0 ] && [ "$first" = "$prog (am) $version" ] && [ "$(wc -l <<<"$out")" = 2 ] &&
        [[ $second =~ ^built\ with:\ (CUDA\ [0-9.]+,\ (cuDNN\ [0-9.]+|no\ cuDNN),\ NCCL\ [0-9.]+|no\ CUDA),\ (PMIx\ [0-9][^,]*|no\ PMIx),\ (UCX\ [0-9][^,]*|no\ UCX),\ (OpenBLAS\ [0-9][^,]*|no\ OpenBLAS)(,\ Slurm\ SPANK)?$ ]]; then
        echo "ok: $prog --version: $first; $second"; passes=$((passes + 1))
    else
        echo "FAIL: $prog --version (exit $rc):"; sed 's/^/    /' <<<"$out"; fails=$((fails + 1))
    fi
done
echo "version: $passes passed, $fails failed"
[ $fails = 0 ] && [ $passes -gt 0 ]
