#!/usr/bin/env bash
# test-dist.sh - the tarball has every file the build and the tests need: each file git tracks
# is among what `make dist` copies (`make list-dist-files`: automake's DISTFILES, where a
# folder stands for every file under it), but for those left out on purpose (LEFT_OUT: CI's
# script, git's ignore lists). A file added to git and not to EXTRA_DIST (or a dist_ variable)
# fails here, naming the file. Needs the source tree's own git checkout: skipped (77)
# elsewhere, as in make distcheck's unpacked tree.
set -uo pipefail
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
LEFT_OUT='^(\.ci/.*|(.*/)?\.gitignore)$'

top=$(git -C "$AM_SRCDIR" rev-parse --show-toplevel 2>/dev/null)
if [ -z "$top" ] || [ "$(cd "$top" && pwd -P)" != "$(cd "$AM_SRCDIR" && pwd -P)" ]; then
    echo "skip: $AM_SRCDIR is not a git checkout of its own (a tarball's tree): nothing to compare"
    exit 77
fi
T=$(mktemp -d /tmp/am-dist-XXXXXX)
trap 'rm -rf "$T"' EXIT
# the sub-make is not the caller's: no jobserver, no command-line variables of make check's
if ! env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s --no-print-directory -C "$AM_BUILDDIR" list-dist-files \
    >"$T/dist" 2>"$T/err"; then
    echo "FAIL: make list-dist-files: $(cat "$T/err")"
    exit 1
fi
git -C "$AM_SRCDIR" ls-files >"$T/tracked" || { echo "FAIL: git ls-files in $AM_SRCDIR"; exit 1; }
# the tracked files no dist entry covers (the entry itself or a folder above it), but LEFT_OUT
awk -v re="$LEFT_OUT" 'NR == FNR { sub(/^\.\//, ""); sub(/\/$/, ""); d[$0] = 1; next }
    $0 ~ re { next }
    { p = $0; covered = 0
      while (p != "") { if (p in d) { covered = 1; break }
                        if (!sub(/\/[^\/]*$/, "", p)) break }
      if (!covered) print }' "$T/dist" "$T/tracked" >"$T/missing"
n=$(wc -l <"$T/tracked") m=$(wc -l <"$T/missing")
if [ "$m" -gt 0 ]; then
    echo "FAIL: $m of $n tracked files are not in make dist's tarball (add them to EXTRA_DIST, or a dist_ variable,"
    echo "      in the Makefile.inc of their folder; or to LEFT_OUT in $0 when they are left out on purpose):"
    sed 's/^/    /' "$T/missing"
    exit 1
fi
echo "ok: the $n tracked files are in make dist's tarball, but $(grep -cE "$LEFT_OUT" "$T/tracked") left out on purpose"
