#!/usr/bin/env bash
# munge_join.sh - the boot server's munge cost without PMIx (bench/munge_join.c): a private
# munged (as tests/slurm/cluster starts one: its own key, socket and files under a temporary
# directory, no system file touched), then munge_join at each rank count. Run from the build
# directory after `make bench/munge_join`:  bench/munge_join.sh [N ...]  (default 1024 4096 16384)
set -euo pipefail
B=${AM_BUILDDIR:-$PWD}
D=$(mktemp -d /tmp/am-munge-XXXXXX)
trap 'kill "$(cat "$D/pid" 2>/dev/null)" 2>/dev/null; rm -rf "$D"' EXIT
dd if=/dev/urandom of="$D/key" bs=1024 count=1 status=none
chmod 0400 "$D/key"
munged -f -S "$D/sock" --key-file="$D/key" --pid-file="$D/pid" --log-file="$D/log" --seed-file="$D/seed" </dev/null
for _ in $(seq 50); do munge -n -S "$D/sock" 2>/dev/null | unmunge -S "$D/sock" >/dev/null 2>&1 && break; sleep 0.1; done
[ $# -gt 0 ] || set -- 1024 4096 16384
for n in "$@"; do AM_MUNGE_SOCKET=$D/sock "$B/bench/munge_join" "$n"; done
