#!/usr/bin/env bash
# test-nvml.sh - the NVML path of the topology, on a machine without a GPU: a stand-in
# libnvidia-ml.so.1 (fake_nvml.c) describes the GPUs, the dry run shows the domains NVML's
# answers make: NVLink pairs, a multi-node fabric clique, and no driver at all.
set -uo pipefail
source "$(dirname "$0")/../launcher/lib.sh"

FAKE=$AM_BUILDDIR/tests/rank/.libs/libfakenvml.so
T=$(mktemp -d /tmp/am-test-nvml.XXXXXX)
trap 'rm -rf "$T"' EXIT
HOST=$(hostname)
[[ -f $FAKE ]] || { fail "$FAKE was not built"; finish; }
mkdir -p "$T/fake-nvml"
ln -s "$FAKE" "$T/fake-nvml/libnvidia-ml.so.1"

# domains NAME ENV...: the dry run's "domain" values of 4 ranks, one per line
domains() {
  local name=$1
  shift
  env LD_LIBRARY_PATH="$T/fake-nvml" "$@" "$LAUNCH" --log-dir "$T/logs" --nproc 4 --dry-run "$RECIPE" \
    >"$T/$name.out" 2>"$T/$name.err"
  RC=$?
  sed -E 's/.*"domain":"([^"]*)".*"gpu":(-?[0-9]+).*/\1 gpu \2/' "$T/$name.out" >"$T/$name.domains"
}

# GPUs 0-1 and 2-3 joined by NVLink: two domains on this node
domains pairs FAKE_NVML_GPUS=4 FAKE_NVML_NVLINK=0-1,2-3
expect_rc "NVLink pairs" 0 "$RC" "$T/pairs.err"
printf '%s\n' "$HOST:0 gpu 0" "$HOST:0 gpu 1" "$HOST:1 gpu 2" "$HOST:1 gpu 3" >"$T/pairs.want"
diff "$T/pairs.want" "$T/pairs.domains" >/dev/null && pass "pairs: two domains" || { fail "pairs"; show "$T/pairs.domains" "$T/pairs.err"; }

# all four joined in a chain 0-1-2-3: one domain (connected components)
domains chain FAKE_NVML_GPUS=4 FAKE_NVML_NVLINK=0-1,1-2,2-3
printf '%s\n' "$HOST:0 gpu 0" "$HOST:0 gpu 1" "$HOST:0 gpu 2" "$HOST:0 gpu 3" >"$T/chain.want"
diff "$T/chain.want" "$T/chain.domains" >/dev/null && pass "chain: one domain" || { fail "chain"; show "$T/chain.domains" "$T/chain.err"; }

# no NVLink (PCIe only): every GPU alone, so tp must be 1
AM_TP=2 domains pcie FAKE_NVML_GPUS=4
expect_rc "PCIe only, tp 2" 1 "$RC" "$T/pcie.err"
expect_match "PCIe only: one GPU per domain" "$T/pcie.err" "^am-place: error: placement: tp_size 2 cannot be placed: NVLink domain $HOST:0 has 1 rank \\(0\\); $HOST:1 has 1 rank \\(1\\); "

# a completed fabric registration: the clique's domain, shared across nodes
domains fabric FAKE_NVML_GPUS=4 FAKE_NVML_NVLINK=0-1 FAKE_NVML_FABRIC=ab:7
uuid=abababababababababababababababab
printf '%s\n' "fabric:$uuid:7 gpu 0" "fabric:$uuid:7 gpu 1" "fabric:$uuid:7 gpu 2" "fabric:$uuid:7 gpu 3" >"$T/fabric.want"
diff "$T/fabric.want" "$T/fabric.domains" >/dev/null && pass "fabric clique domain" || { fail "fabric"; show "$T/fabric.domains" "$T/fabric.err"; }

# the library is there but no driver: the node is one domain
domains nodriver
printf '%s\n' "$HOST gpu -1" "$HOST gpu -1" "$HOST gpu -1" "$HOST gpu -1" >"$T/nodriver.want"
diff "$T/nodriver.want" "$T/nodriver.domains" >/dev/null && pass "no driver: node domain" || { fail "no driver"; show "$T/nodriver.domains" "$T/nodriver.err"; }

# CUDA_VISIBLE_DEVICES restricts the rank to GPUs 2, 3
domains visible FAKE_NVML_GPUS=4 FAKE_NVML_NVLINK=0-1,2-3 CUDA_VISIBLE_DEVICES=2,3
printf '%s\n' "$HOST:1 gpu 2" "$HOST:1 gpu 3" "$HOST:1 gpu 2" "$HOST:1 gpu 3" >"$T/visible.want"
diff "$T/visible.want" "$T/visible.domains" >/dev/null && pass "CUDA_VISIBLE_DEVICES binding" || { fail "visible"; show "$T/visible.domains" "$T/visible.err"; }

finish
