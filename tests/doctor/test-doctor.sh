#!/usr/bin/env bash
# test-doctor.sh - `am-launch --doctor` (runtime/doctor): the pre-flight check of a node set.
#   standalone (--nproc 2 and 4): a clean pass with the exact table (numbers masked), the
#     NVML fields from the stand-in libnvidia-ml (fake_nvml.c), a topology file that NVML
#     contradicts, a slowed all-reduce, low memory and disk and GPU memory thresholds,
#     --json, bad options;
#   on the private local Slurm cluster (tests/slurm/cluster, 4 nodes): a clean pass, a node
#     whose PMIx directory is read-only (its task in a mount namespace of its own where the
#     step's PMIx directory is remounted read-only: a real EROFS), a topology file that
#     disagrees with NVML on one node, a slowed communicator on one rank, a skewed clock on
#     one rank, a memory threshold: each report names the node, the problem and the fix,
#     and the exit status is 1.
# The Slurm part fails (does not skip) when the cluster cannot start; it is skipped only in
# a build without Slurm or PMIx.
set -uo pipefail
source "$(dirname "$0")/../launcher/lib.sh"
unset AM_DOCTOR_FAULT AM_DEVICE LD_PRELOAD FAKE_NVML_GPUS FAKE_NVML_NVLINK FAKE_NVML_MEM 2>/dev/null || true

DOCTOR=$AM_BUILDDIR/am-doctor
FAKE=$AM_BUILDDIR/tests/rank/.libs/libfakenvml.so
T=$(mktemp -d /tmp/am-test-doctor.XXXXXX)
CLUSTER=$AM_SRCDIR/tests/slurm/cluster
export AM_CLUSTER_DIR=/tmp/am-cluster-doctor-$$
cluster_up=0
cleanup() {
  [[ $cluster_up == 1 ]] && "$CLUSTER" down --purge >/dev/null 2>&1
  rm -rf "$T"
}
trap cleanup EXIT
cd "$T" || exit 1
HOST=$(hostname)
[[ -x $DOCTOR ]] || { fail "$DOCTOR was not built"; finish; }
[[ -f $FAKE ]] || { fail "$FAKE was not built"; finish; }
mkdir -p "$T/fake-nvml"
ln -s "$FAKE" "$T/fake-nvml/libnvidia-ml.so.1"

# doctor NAME ENV... -- AM-LAUNCH-ARGS...: a standalone run; sets RC, OUT, ERR
doctor() {
  local name=$1 envs=()
  shift
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  OUT=$T/$name.out ERR=$T/$name.err
  env "${envs[@]}" timeout 120 "$LAUNCH" --log-dir "$T/logs" "$@" >"$OUT" 2>"$ERR"
  RC=$?
}

# masked FILE: numbers as N (sizes, bandwidths, times vary)
masked() { sed -E 's/[-+]?[0-9]+\.[0-9]+/N/g' "$1"; }

# expect_text NAME FILE: FILE (masked) equals stdin (masked too: a path it names may hold
# numbers, as make distcheck's am-0.1.0/)
expect_text() {
  local want=$T/want.$RANDOM
  masked /dev/stdin >"$want"
  if masked "$2" | diff "$want" - >"$want.diff"; then pass "$1"; else fail "$1: output differs"; show "$want.diff"; fi
}

# ---- standalone: a clean pass, the exact table ------------------------------------------------
doctor clean -- --nproc 2 --doctor "$RECIPE"
expect_rc "standalone, 2 ranks" 0 "$RC" "$OUT" "$ERR"
expect_text "standalone, 2 ranks: the table" "$OUT" <<EOF
am-doctor: tiny.yaml on 1 node, 2 ranks (ucx): the job can run

node $HOST (ranks 0-1): ok
  check      status   detail
  pmix       ok       standalone: no PMIx (am-launch --nproc)
  clock      ok       one node: no skew to measure
  memory     ok       N GiB free of N GiB, needs N GiB
  disk       ok       N GiB free at $T (checkpoints disabled)
  gpus       ok       no GPU (libnvidia-ml.so.1 not found (no NVIDIA driver)): ranks run on CPUs
  topology   ok       domain $HOST (no GPU information)
  allreduce  ok       all-reduce in domain $HOST (ranks 0-1, ucx): N GB/s bus bandwidth, expected >= N
EOF
[[ ! -s $ERR ]] && pass "standalone, 2 ranks: nothing on stderr" || { fail "standalone, 2 ranks: stderr"; show "$ERR"; }

# 4 ranks on 4 fake GPUs in two NVLink pairs, with a topology file that agrees
printf 'nodes:\n  %s: {gpus: 4, domains: [[0, 1], [2, 3]]}\n' "$HOST" >"$T/pairs.yaml"
NV=(LD_LIBRARY_PATH="$T/fake-nvml" FAKE_NVML_GPUS=4 FAKE_NVML_NVLINK=0-1,2-3)
doctor gpus "${NV[@]}" -- --nproc 4 --topology "$T/pairs.yaml" --doctor "$RECIPE"
expect_rc "standalone, 4 ranks, NVML" 0 "$RC" "$OUT" "$ERR"
expect_text "standalone, 4 ranks, NVML: the table" "$OUT" <<EOF
am-doctor: tiny.yaml on 1 node, 4 ranks (ucx): the job can run

node $HOST (ranks 0-3): ok
  check      status   detail
  pmix       ok       standalone: no PMIx (am-launch --nproc)
  clock      ok       one node: no skew to measure
  memory     ok       N GiB free of N GiB, needs N GiB
  disk       ok       N GiB free at $T (checkpoints disabled)
  gpus       ok       4 GPUs, driver N.15, CUDA N; ranks on GPUs 0,1,2,3, N GiB free on GPU 0
  topology   ok       domains $HOST:0, $HOST:1 (topology file, NVML agrees)
  allreduce  ok       all-reduce in domain $HOST:0 (ranks 0-1, ucx): N GB/s bus bandwidth, expected >= N
  allreduce  ok       all-reduce in domain $HOST:1 (ranks 2-3, ucx): N GB/s bus bandwidth, expected >= N
EOF

# the topology file says one domain of 4; NVML's links say two pairs
printf 'nodes:\n  %s: {gpus: 4}\n' "$HOST" >"$T/one.yaml"
doctor topo "${NV[@]}" -- --nproc 4 --topology "$T/one.yaml" --doctor "$RECIPE"
expect_rc "standalone: topology file against NVML" 1 "$RC" "$OUT" "$ERR"
expect_line "topology: the problem" "$OUT" "  topology   PROBLEM  GPU 2: the topology file puts it in domain $HOST:0, NVML's NVLink links in $HOST:1"
expect_line "topology: the fix" "$OUT" "                      fix: correct $HOST's domains in the topology file to NVML's (nvidia-smi topo -m), or drop --topology"
expect_line "topology: the summary" "$OUT" "am-doctor: tiny.yaml on 1 node, 4 ranks (ucx): 1 problem on 1 node: the job cannot run"

# NVML's GPU faults: a link down, retired pages pending, ECC off (a warning only)
doctor gpufault "${NV[@]}" FAKE_NVML_LINK_DOWN=3 FAKE_NVML_RETIRED=0:2:1 FAKE_NVML_ECC=0:0 -- --nproc 4 --doctor "$RECIPE"
expect_rc "standalone: GPU faults" 1 "$RC" "$OUT" "$ERR"
expect_line "GPU faults: NVLink down" "$OUT" "  gpus       PROBLEM  GPU 3: 1 of 1 NVLink links down"
expect_line "GPU faults: retired pages pending" "$OUT" "  gpus       PROBLEM  GPU 0: retired or remapped memory pending a reset"
expect_line "GPU faults: its fix" "$OUT" "                      fix: reset GPU 0 (nvidia-smi -r -i 0) or reboot $HOST before running"
expect_line "GPU faults: ECC off" "$OUT" "  gpus       warning  GPU 0: ECC is off"
expect_line "GPU faults: double-bit retirements" "$OUT" "  gpus       warning  GPU 0: 2 pages retired after double-bit errors"

# the plan's memory per rank against NVML's free memory, for a GPU job
doctor gpumem "${NV[@]}" AM_DEVICE=cuda FAKE_NVML_MEM=80:0.0001 -- --nproc 2 --doctor "$RECIPE"
expect_rc "standalone: GPU memory" 1 "$RC" "$OUT" "$ERR"
expect_match "GPU memory: the problem" "$OUT" '^  gpus       PROBLEM  GPU 0: 0\.0 GiB free, the plan needs [0-9.]+ GiB \(1 rank\)$'

# thresholds: memory and disk
doctor lowmem -- --nproc 2 --doctor "$RECIPE" -- --min-mem-gb 1000000 --min-disk-gb 1000000
expect_rc "standalone: memory and disk thresholds" 1 "$RC" "$OUT" "$ERR"
expect_match "memory threshold: the problem" "$OUT" '^  memory     PROBLEM  [0-9.]+ GiB free of [0-9.]+ GiB, needs 1000000\.0 GiB$'
expect_line "memory threshold: the fix" "$OUT" "                      fix: free memory on $HOST (other jobs or processes: ps aux --sort=-rss), run fewer ranks per node, or lower the requirement (--min-mem-gb)"
expect_match "disk threshold: the problem" "$OUT" "^  disk       PROBLEM  [0-9.]+ GiB free at $T, needs 1000000\\.0 GiB \\(checkpoints in $T/checkpoints/tiny\\)$"
expect_line "disk threshold: the fix" "$OUT" "                      fix: free space under $T on $HOST, or set checkpoint.checkpoint_dir to a larger filesystem"
expect_line "thresholds: the summary" "$OUT" "am-doctor: tiny.yaml on 1 node, 2 ranks (ucx): 2 problems on 1 node: the job cannot run"

# --json: one object, every check with its status
doctor json -- --nproc 2 --doctor "$RECIPE" -- --json --min-disk-gb 1000000
expect_rc "standalone: --json with a problem" 1 "$RC" "$OUT" "$ERR"
got=$(jq -c '[.ok, .problems, .ranks, .transport, (.nodes[0].checks | map(.check + ":" + .status)), .nodes[0].checks[0].fix, (.allreduce | length)]' "$OUT" 2>&1)
want="[false,1,2,\"ucx\",[\"disk:problem\",\"pmix:ok\",\"clock:ok\",\"memory:ok\",\"gpus:ok\",\"topology:ok\",\"allreduce:ok\"],\"free space under $T on $HOST, or set checkpoint.checkpoint_dir to a larger filesystem\",1]"
[[ $got == "$want" ]] && pass "--json: fields" || { fail "--json: $got, want $want"; show "$OUT"; }

# a slowed all-reduce: rank 1 waits 1 s before each call, the others wait for it
doctor slow AM_DOCTOR_FAULT=rank=1,kind=slow-allreduce:1 -- --nproc 2 --doctor "$RECIPE"
expect_rc "standalone: slowed all-reduce" 1 "$RC" "$OUT" "$ERR"
expect_match "slowed all-reduce: rank 1 named" "$OUT" "^  allreduce  PROBLEM  all-reduce in domain $HOST \\(ranks 0-1, ucx\\): [0-9.]+ GB/s bus bandwidth, expected >= 0\\.020: the others waited [0-9.]+ s per call for rank 1 on $HOST$"

# a rank that takes no part (as behind a dead link): the others time out waiting, it is named
doctor skip AM_DOCTOR_FAULT=rank=1,kind=skip-allreduce -- --nproc 2 --doctor "$RECIPE" -- --timeout 2
expect_rc "standalone: a rank that does not answer" 1 "$RC" "$OUT" "$ERR"
expect_match "no answer: rank 1 named" "$OUT" "^  allreduce  PROBLEM  all-reduce in domain $HOST \\(ranks 0-1, ucx\\) failed: the others' calls timed out waiting for rank 1 on $HOST \\(allreduce #2 on group domain \\(2 ranks\\) timed out after 2 s waiting for rank 1 \\(global 1 on $HOST\\)\\)$"
expect_line "no answer: the fix" "$OUT" "                      fix: rank 1 on $HOST (or its link) did not answer: check its network (ib_write_bw, nvidia-smi nvlink -s) and drain $HOST if it stays"

# a layout the recipe refuses: the report is the setup's errors (3 ranks: dp 3 does not divide
# the global batch)
doctor setup -- --nproc 3 --doctor "$RECIPE"
expect_rc "standalone: the recipe refuses the layout" 1 "$RC" "$OUT" "$ERR"
expect_text "recipe refuses the layout: the report" "$OUT" <<EOF
am-doctor: tiny.yaml: the job cannot start: the recipe, the topology or the placement failed
  setup      PROBLEM  $RECIPE:34:22: step_scheduler.global_batch_size: 16 is not a multiple of local_batch_size*dp_size = 4*3 = 12 (use a multiple of 12)
                      fix: correct what each line names (am-launch --dry-run shows the placement)
EOF
doctor setupjson -- --nproc 3 --doctor "$RECIPE" -- --json
got=$(jq -c '[.ok, (.setup | length)]' "$OUT" 2>&1)
[[ $got == '[false,1]' ]] && pass "recipe refuses the layout: --json" || { fail "recipe refuses the layout: --json: $got"; show "$OUT"; }

# bad options and a bad fault spec
doctor badopt -- --nproc 2 --doctor "$RECIPE" -- --bogus
expect_rc "standalone: unknown option" 2 "$RC" "$ERR"
expect_line "unknown option: the message" "$ERR" "am-doctor: unknown option '--bogus' (am-doctor --help lists them)"
doctor badfault AM_DOCTOR_FAULT=rank=1,kind=slow -- --nproc 2 --doctor "$RECIPE"
expect_line "bad AM_DOCTOR_FAULT" "$ERR" "am-doctor: AM_DOCTOR_FAULT='rank=1,kind=slow': expected rank=R,kind=K with K slow-allreduce:SECONDS (SECONDS > 0), clock:SECONDS or skip-allreduce, e.g. rank=1,kind=slow-allreduce:2"
"$LAUNCH" --nproc 2 --doctor --dry-run "$RECIPE" >/dev/null 2>"$T/both.err"
expect_rc "--doctor with --dry-run" 2 "$?" "$T/both.err"
expect_line "--doctor with --dry-run: message" "$T/both.err" "am-launch: --doctor and --dry-run: give one of them"

# ---- on the local Slurm cluster -----------------------------------------------------------
if [[ ${AM_DOCTOR_SLURM:-yes} == no ]] || ! command -v srun >/dev/null || [[ $(ldd "$LAUNCH" 2>/dev/null) != *libpmix* ]]; then
  printf 'SKIP: Slurm part (no srun, or am-launch built without PMIx)\n'
  finish
fi
if ! "$CLUSTER" up >"$T/cluster.log" 2>&1; then
  fail "cannot start the local Slurm cluster in $AM_CLUSTER_DIR"
  show "$T/cluster.log"
  finish
fi
cluster_up=1
eval "$("$CLUSTER" env)"

# on4 NAME ENV... -- WRAPPER... -- AM-LAUNCH-ARGS: one rank on each of n1..n4
on4() {
  local name=$1 envs=() wrap=()
  shift
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  while [[ $1 != -- ]]; do wrap+=("$1"); shift; done
  shift
  OUT=$T/$name.out ERR=$T/$name.err
  env "${envs[@]}" timeout 120 srun -N4 -n4 --ntasks-per-node=1 -w n1,n2,n3,n4 --mpi=pmix "${wrap[@]}" \
    "$LAUNCH" --log-dir "$T/logs" --doctor "$@" >"$OUT" 2>"$ERR"
  RC=$?
}
# host_of RANK FILE: the node of that rank, from its table's header
host_of() { sed -nE "s/^node (n[0-9]+) \\(rank $1\\): .*/\\1/p" "$2"; }

on4 sclean -- -- "$RECIPE"
expect_rc "srun, 4 nodes" 0 "$RC" "$OUT" "$ERR"
expect_line "srun, 4 nodes: the summary" "$OUT" "am-doctor: tiny.yaml on 4 nodes, 4 ranks (ucx): the job can run"
expect_count "srun, 4 nodes: PMIx seen on every node" "$OUT" "  pmix       ok       Slurm mpi pmix, libpmix OpenPMIx " 4
expect_count "srun, 4 nodes: the across-nodes all-reduce on every node" "$OUT" "  allreduce  ok       all-reduce across nodes (ranks 0-3, ucx): " 4
[[ $(masked "$OUT" | grep -c '^  clock      ok       N s from most nodes (+N s; largest skew N s)$') == 4 ]] &&
  pass "srun, 4 nodes: four clock rows" || { fail "srun, 4 nodes: clock rows"; show "$OUT"; }

# n2's PMIx directory read-only: its task remounts it so in a mount namespace of its own
cat >"$T/ro-pmix.sh" <<'EOF'
#!/bin/sh
if [ "$SLURMD_NODENAME" = n2 ]; then
  exec unshare --mount sh -c 'mount --bind "$PMIX_SERVER_TMPDIR" "$PMIX_SERVER_TMPDIR" &&
    mount -o remount,bind,ro "$PMIX_SERVER_TMPDIR" && exec "$@"' sh "$@"
fi
exec "$@"
EOF
chmod +x "$T/ro-pmix.sh"
on4 spmix -- "$T/ro-pmix.sh" -- "$RECIPE"
expect_rc "srun: n2's PMIx directory read-only" 1 "$RC" "$OUT" "$ERR"
[[ $(sed -n 3p "$OUT") == "node n2 (rank "*"): 1 problem" ]] && pass "PMIx directory: n2's table first" || { fail "PMIx directory: n2 not first"; show "$OUT"; }
expect_match "PMIx directory: the problem" "$OUT" "^  pmix       PROBLEM  PMIx directory $AM_CLUSTER_DIR/spool/n2/pmix\\.[0-9]+\\.0/ is unusable: cannot create a file in it: Read-only file system$"
expect_line "PMIx directory: the fix" "$OUT" "                      fix: Slurm's PMIx plugin gives each step a directory under PMIxCliTmpDirBase (mpi.conf) on n2: make it a writable local directory with free space on n2, or drain n2 until it is (scontrol update nodename=n2 state=drain reason=pmix-dir)"
expect_line "PMIx directory: the summary" "$OUT" "am-doctor: tiny.yaml on 4 nodes, 4 ranks (ucx): 1 problem on 1 node: the job cannot run"

# a topology file that gives n3 8 GPUs where NVML sees 4
printf 'nodes:\n  "n[1-2,4]": {gpus: 4, domains: [[0, 1], [2, 3]]}\n  n3: {gpus: 8}\n' >"$T/n3.yaml"
on4 stopo LD_LIBRARY_PATH="$T/fake-nvml" FAKE_NVML_GPUS=4 FAKE_NVML_NVLINK=0-1,2-3 -- -- --topology "$T/n3.yaml" "$RECIPE"
expect_rc "srun: a topology file that disagrees" 1 "$RC" "$OUT" "$ERR"
expect_line "topology: n3 named" "$OUT" "  topology   PROBLEM  the topology file gives n3 8 GPUs, NVML sees 4"
expect_line "topology: the fix" "$OUT" "                      fix: correct n3's entry in the topology file (or drop --topology: NVML then tells)"
expect_count "topology: the others agree" "$OUT" "(topology file, NVML agrees)" 3

# a slowed communicator: rank 2 waits 1 s before each timed all-reduce
on4 sslow AM_DOCTOR_FAULT=rank=2,kind=slow-allreduce:1 -- -- "$RECIPE"
expect_rc "srun: a slow rank" 1 "$RC" "$OUT" "$ERR"
h=$(host_of 2 "$OUT")
expect_match "slow rank: rank 2 and its node named" "$OUT" "^  allreduce  PROBLEM  all-reduce across nodes \\(ranks 0-3, ucx\\): [0-9.]+ GB/s bus bandwidth, expected >= 0\\.020: the others waited [0-9.]+ s per call for rank 2 on ${h:-none}$"
[[ $(sed -n 3p "$OUT") == "node ${h:-none} (rank 2): 1 problem" ]] && pass "slow rank: its node's table first" || { fail "slow rank: its table is not first"; show "$OUT"; }
expect_count "slow rank: the others are told who slowed them" "$OUT" "  allreduce  warning  all-reduce across nodes (ranks 0-3, ucx): slowed by rank 2 on ${h:-none}" 3

# a rank that does not answer across nodes: the others time out waiting for it
on4 sskip AM_DOCTOR_FAULT=rank=2,kind=skip-allreduce -- -- "$RECIPE" -- --timeout 2
expect_rc "srun: a rank that does not answer" 1 "$RC" "$OUT" "$ERR"
h=$(host_of 2 "$OUT")
expect_match "no answer: rank 2 and its node named" "$OUT" "^  allreduce  PROBLEM  all-reduce across nodes \\(ranks 0-3, ucx\\) failed: the others' calls timed out waiting for rank 2 on ${h:-none} \\(allreduce #2 on group nodes \\(4 ranks\\) timed out after 2 s waiting for rank [0-9] \\(global [0-9] on n[1-4]\\)\\)$"
[[ $(sed -n 3p "$OUT") == "node ${h:-none} (rank 2): 1 problem" ]] && pass "no answer: its node's table first" || { fail "no answer: its table is not first"; show "$OUT"; }

# a skewed clock: rank 3's readings are 5 s ahead
on4 sclock AM_DOCTOR_FAULT=rank=3,kind=clock:5 -- -- "$RECIPE"
expect_rc "srun: a skewed clock" 1 "$RC" "$OUT" "$ERR"
h=$(host_of 3 "$OUT")
# (5 s injected, measured within the exchange's error bound: 4.99x or 5.00x)
expect_match "skewed clock: the problem" "$OUT" '^  clock      PROBLEM  \+(4\.99|5\.00)[0-9] s from most nodes \(\+-0\.[0-9]+ s; largest skew (4\.99|5\.00)[0-9]* s, allowed 0\.500 s\)$'
expect_line "skewed clock: the fix names the node" "$OUT" "                      fix: synchronise ${h:-none}'s clock (chronyc tracking / chronyc makestep, or its ntpd): am-diag orders the ranks' logs by time"

# memory and disk thresholds no node meets: every node named, twice
on4 smem -- -- "$RECIPE" -- --min-mem-gb 1000000 --min-disk-gb 1000000
expect_rc "srun: memory and disk thresholds" 1 "$RC" "$OUT" "$ERR"
expect_line "thresholds: the summary" "$OUT" "am-doctor: tiny.yaml on 4 nodes, 4 ranks (ucx): 8 problems on 4 nodes: the job cannot run"
for n in n1 n2 n3 n4; do
  expect_line "memory threshold: $n's fix" "$OUT" "                      fix: free memory on $n (other jobs or processes: ps aux --sort=-rss), run fewer ranks per node, or lower the requirement (--min-mem-gb)"
  expect_line "disk threshold: $n's fix" "$OUT" "                      fix: free space under $T on $n, or set checkpoint.checkpoint_dir to a larger filesystem"
done
expect_count "disk threshold: one problem per node" "$OUT" "  disk       PROBLEM  " 4

finish
