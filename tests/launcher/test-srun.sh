#!/usr/bin/env bash
# test-srun.sh - `srun --mpi=pmix am-launch` on a private local Slurm cluster (4 nodes of 4
# fake GPUs, tests/slurm/cluster): the PMIx bootstrap, the dry run's placement with a
# topology file of two NVLink pairs per node under block, cyclic and arbitrary task
# distributions (every TP group inside one domain; exact lines for the small cases), a
# failing rank ending the whole step within seconds with its status and exit record, an
# abort request, a fence timeout, signals reaching the ranks once, and nothing a rank started
# left running (a rank's orphaned child, a task whose am-launch is killed).
# Fails (does not skip) when the cluster cannot start. Slurm picks any free nodes for -N2 or
# -N3, so the runs whose output names hosts ask for theirs with -w.
set -uo pipefail
source "$(dirname "$0")/lib.sh"

CLUSTER=$AM_SRCDIR/tests/slurm/cluster
export AM_CLUSTER_DIR=/tmp/am-cluster-ltest-$$
T=$(mktemp -d /tmp/am-test-srun.XXXXXX)
cleanup() {
  "$CLUSTER" down --purge >/dev/null 2>&1
  rm -rf "$T"
}
trap cleanup EXIT
cd "$T" || exit 1

if ! "$CLUSTER" up >"$T/cluster.log" 2>&1; then
  fail "cannot start the local Slurm cluster in $AM_CLUSTER_DIR"
  show "$T/cluster.log"
  finish
fi
eval "$("$CLUSTER" env)"

cat >"$T/topo.yaml" <<'EOF'
# each node: 4 GPUs in two NVLink pairs
nodes:
  "n[1-4]": {gpus: 4, domains: [[0, 1], [2, 3]]}
EOF

# srun_launch NAME SRUN-OPTIONS... -- AM-LAUNCH-ARGS...: sets RC, OUT, ERR, LOGS, SECS
srun_launch() {
  local name=$1 opts=()
  shift
  while [[ $1 != -- ]]; do opts+=("$1"); shift; done
  shift
  mkdir -p "$T/$name"
  LOGS=$T/$name/logs OUT=$T/$name/out ERR=$T/$name/err
  local t0=$EPOCHREALTIME
  timeout 60 srun "${opts[@]}" --mpi=pmix "$LAUNCH" --log-dir "$LOGS" "$@" >"$OUT" 2>"$ERR"
  RC=$?
  SECS=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
}

# tp_in_domains NAME FILE: every rank's TP group lies in that rank's domain
tp_in_domains() {
  if awk '
      { match($0, /"rank":[0-9]+/); r = substr($0, RSTART + 7, RLENGTH - 7)
        match($0, /"domain":"[^"]*"/); d[r] = substr($0, RSTART + 10, RLENGTH - 11)
        match($0, /"tp":\[[0-9,]*\]/); tp[r] = substr($0, RSTART + 6, RLENGTH - 7); n++ }
      END { if (n == 0) exit 1
            for (r in tp) { k = split(tp[r], m, ","); for (i = 1; i <= k; i++) if (d[m[i]] != d[r]) exit 1 } }' "$2"
  then pass "$1: every TP group inside one NVLink domain"
  else fail "$1: a TP group leaves its domain (or no output)"; show "$2"; fi
}

# ---- the PMIx bootstrap -------------------------------------------------------------------
srun_launch boot -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$RECIPE" -- "$BOOT_CHECK"
expect_rc "bootstrap over PMIx" 0 "$RC" "$OUT" "$ERR"
expect_match "rank 3's view" "$OUT" '^rank 3/4 on n2 \(node 1/2, local 1/2\) job [0-9]+\.0: allgather ok$'
for r in 0 1 2 3; do
  host=n$((r / 2 + 1))
  expect_match "rank $r exit record" "$(job_dir "$LOGS")/rank-$r.jsonl" \
    "$(exit_record_re $r $host 0 0 null false '(false|null)' null)"
done

# ---- placement: exact lines for 8 ranks, 2 per node, tp 2 -------------------------------------
line() { # RANK NODE LOCAL MESH DP_SHARD TP TPGROUP DPGROUP
  printf '{"rank":%s,"host":"n%s","domain":"n%s:0","local_rank":%s,"gpu":%s,"mesh_rank":%s,"coords":{"pp":0,"dp_replicate":0,"dp_shard":%s,"cp":0,"tp":%s,"ep":0},"groups":{"tp":[%s],"pp":[%s],"dp":[%s],"ep":[%s]}}\n' \
    "$1" "$2" "$2" "$3" "$3" "$4" "$5" "$6" "$7" "$1" "$8" "$1"
}
AM_TP=2 srun_launch block -N4 -n8 --ntasks-per-node=2 --distribution=block -- --dry-run --topology "$T/topo.yaml" "$RECIPE"
expect_rc "dry run, block" 0 "$RC" "$OUT" "$ERR"
{ for r in 0 1 2 3 4 5 6 7; do line $r $((r / 2 + 1)) $((r % 2)) $r $((r / 2)) $((r % 2)) "$((r / 2 * 2)),$((r / 2 * 2 + 1))" "$((r % 2)),$((r % 2 + 2)),$((r % 2 + 4)),$((r % 2 + 6))"; done; } >"$T/block.want"
diff "$T/block.want" "$OUT" >"$T/block.diff" && pass "dry run, block: exact lines (mesh rank = Slurm rank)" || { fail "dry run, block: lines differ"; show "$T/block.diff"; }
tp_in_domains "block" "$OUT"

# cyclic: rank r on node r%4, local rank r/4; TP groups {r, r+4} on one node; mesh rank
# 2*(r%4) + r/4
AM_TP=2 srun_launch cyclic -N4 -n8 --ntasks-per-node=2 --distribution=cyclic -- --dry-run --topology "$T/topo.yaml" "$RECIPE"
expect_rc "dry run, cyclic" 0 "$RC" "$OUT" "$ERR"
{ for r in 0 1 2 3 4 5 6 7; do line $r $((r % 4 + 1)) $((r / 4)) $((2 * (r % 4) + r / 4)) $((r % 4)) $((r / 4)) "$((r % 4)),$((r % 4 + 4))" "$((r / 4 * 4)),$((r / 4 * 4 + 1)),$((r / 4 * 4 + 2)),$((r / 4 * 4 + 3))"; done; } >"$T/cyclic.want"
diff "$T/cyclic.want" "$OUT" >"$T/cyclic.diff" && pass "dry run, cyclic: exact lines" || { fail "dry run, cyclic: lines differ"; show "$T/cyclic.diff"; }
tp_in_domains "cyclic" "$OUT"

# 4 ranks per node fill both pairs; cyclic puts ranks r and r+2 on one GPU pair
AM_TP=2 srun_launch cyclic4 -N2 -w n1,n2 -n8 --ntasks-per-node=4 --distribution=cyclic -- --dry-run --topology "$T/topo.yaml" "$RECIPE"
expect_rc "dry run, cyclic, 4 per node" 0 "$RC" "$OUT" "$ERR"
tp_in_domains "cyclic, 4 per node" "$OUT"
expect_match "cyclic, 4 per node: rank 2 in rank 0's group" "$OUT" '^\{"rank":2,"host":"n1","domain":"n1:0","local_rank":1,"gpu":1,"mesh_rank":1,.*"tp":\[0,2\]'

# arbitrary: the host list n2 n1 n2 n1 n1 n2 n1 n2; GPUs from Slurm (--gres): mesh order is
# n1:0 {1, 3}, n1:1 {4, 6}, n2:0 {0, 2}, n2:1 {5, 7}
printf '%s\n' n2 n1 n2 n1 n1 n2 n1 n2 >"$T/hosts"
AM_TP=2 SLURM_HOSTFILE=$T/hosts srun_launch arbitrary -n8 --distribution=arbitrary --gres=gpu:4 -- --dry-run --topology "$T/topo.yaml" "$RECIPE"
expect_rc "dry run, arbitrary" 0 "$RC" "$OUT" "$ERR"
tp_in_domains "arbitrary" "$OUT"
sed -E 's/.*"mesh_rank":([0-9]+).*/\1/' "$OUT" | tr '\n' ' ' >"$T/arbitrary.mesh"
[[ $(cat "$T/arbitrary.mesh") == "4 0 5 1 2 6 3 7 " ]] && pass "arbitrary: mesh ranks" || { fail "arbitrary: mesh ranks $(cat "$T/arbitrary.mesh")"; show "$OUT"; }

# impossible: Slurm's default for -N4 -n8 packs 4, 2, 1, 1 ranks on the nodes
AM_TP=2 srun_launch uneven -N4 -n8 -- --dry-run --topology "$T/topo.yaml" "$RECIPE"
expect_rc "dry run, uneven distribution" 1 "$RC" "$ERR"
expect_count "placement error printed once" "$ERR" "am-place: error: placement: tp_size 2 cannot be placed: NVLink domain n3:0 has 1 rank (6); n4:0 has 1 rank (7). A tensor-parallel group must lie inside one domain, so every domain needs a multiple of 2 ranks: use tp_size 1 (dividing every domain's rank count), or start a multiple of 2 ranks in every domain (for example one rank per GPU: srun --ntasks-per-node=<GPUs per node>)" 1
expect_count "one supervisor reports it" "$ERR" "am-launch: rank 0 on n1 exited with status 1; aborting the job" 1

# errors of some ranks only are gathered and printed once, by rank 0
printf 'nodes:\n  n1: {gpus: 4}\n' >"$T/n1only.yaml"
srun_launch partial -N3 -w n1,n2,n3 -n6 --ntasks-per-node=2 -- --dry-run --topology "$T/n1only.yaml" "$RECIPE"
expect_rc "dry run, topology file without n2 and n3" 1 "$RC" "$ERR"
for n in 2 3; do
  expect_count "n$n's error printed once" "$ERR" "am-place: error: rank $((2 * n - 2)) on n$n (and 1 other rank): topology file $T/n1only.yaml: node n$n (this rank's host) is not listed: add it under nodes: (with its gpus)" 1
done

# ---- failures end the step within seconds ----------------------------------------------
ln -s "$BOOT_CHECK" "$T/rank-prog"   # a name to find leftover ranks by
srun_launch segv -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$RECIPE" -- env BOOT_CHECK_SEGV=2 BOOT_CHECK_HANG=all "$T/rank-prog"
expect_rc "rank 2 segfaults, the others hang" 139 "$RC" "$ERR"
awk -v s="$SECS" 'BEGIN { exit !(s < 10) }' && pass "step ended in ${SECS}s" || fail "step took ${SECS}s"
expect_line "segfault reported" "$ERR" "am-launch: rank 2 on n2 was killed by signal 11 (SIGSEGV, Segmentation fault); aborting the job (log: $(job_dir "$LOGS")/rank-2.jsonl)"
expect_match "segfault exit record" "$(job_dir "$LOGS")/rank-2.jsonl" "$(exit_record_re 2 n2 139 11 SIGSEGV false '(false|null)' null)"
sleep 1
pgrep -f "$T/rank-prog" >/dev/null && fail "ranks left running: $(pgrep -af "$T/rank-prog")" || pass "no rank left running"

srun_launch exit7 -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$RECIPE" -- env BOOT_CHECK_FAIL=1:7 "$T/rank-prog"
expect_rc "rank 1 exits 7 before the fence" 7 "$RC" "$ERR"
awk -v s="$SECS" 'BEGIN { exit !(s < 10) }' && pass "step ended in ${SECS}s" || fail "step took ${SECS}s"
expect_match "exit 7 record" "$(job_dir "$LOGS")/rank-1.jsonl" "$(exit_record_re 1 n1 7 0 null false '(false|null)' null)"

srun_launch abort -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$RECIPE" -- env BOOT_CHECK_ABORT=3:6 BOOT_CHECK_HANG=all "$T/rank-prog"
expect_rc "rank 3 aborts the job" 6 "$RC" "$ERR"
expect_line "abort reported" "$ERR" "am-launch: rank 3 on n2 aborted the job (status 6): boot_check asked to abort; aborting the job (log: $(job_dir "$LOGS")/rank-3.jsonl)"

srun_launch fence -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$RECIPE" -- env BOOT_CHECK_HANG=1:before BOOT_CHECK_TIMEOUT=2 "$T/rank-prog"
expect_rc "rank 1 never reaches the fence" 4 "$RC" "$ERR"
expect_match "fence timeout reported" "$ERR" '^boot_check: rank [023]: bootstrap allgather: timed out after 2 s: not every rank reached this fence \(one is stuck or slow: see the logs\)$'
awk -v s="$SECS" 'BEGIN { exit !(s < 12) }' && pass "fence timeout ended the step in ${SECS}s" || fail "step took ${SECS}s"

# ---- signals reach each rank once; a stop is not a failure ---------------------------------
mkdir -p "$T/sig"
BOOT_CHECK_WAIT=1 timeout 60 srun -N2 -n2 -w n1,n2 --mpi=pmix "$LAUNCH" --log-dir "$T/sig/logs" "$RECIPE" -- "$BOOT_CHECK" \
  >"$T/sig/out" 2>"$T/sig/err" &
pid=$!
for _ in $(seq 100); do [[ $(grep -c ready "$T/sig/out" 2>/dev/null) == 2 ]] && break; sleep 0.1; done
job=$(squeue -h -o %i | head -n 1)
scancel --signal=USR1 "$job.0"; sleep 0.5
scancel --signal=TERM "$job.0"
wait $pid
for r in 0 1; do
  expect_count "rank $r got SIGUSR1 once" "$T/sig/out" "rank $r got SIGUSR1" 1
  expect_count "rank $r got SIGTERM once" "$T/sig/out" "rank $r got SIGTERM" 1
  expect_match "rank $r exit record" "$(job_dir "$T/sig/logs")/rank-$r.jsonl" \
    "$(exit_record_re $r n$((r + 1)) 0 0 null false '(false|null)' '("SIGTERM"|null)')"
done
grep -q "aborting the job" "$T/sig/err" && { fail "a stopped rank was reported as a failure"; show "$T/sig/err"; } || pass "no abort for a stopped job"

# ---- nothing left behind under srun (launcher/reaper.h) -------------------------------------
# a rank's shell ends and leaves a child running: the child goes with the rank
s1="sleep 8${$}1"
srun_launch orphan -N2 -w n1,n2 -n2 -- "$RECIPE" -- sh -c "$s1 & exit 0"
expect_rc "ranks that leave a child running" 0 "$RC" "$ERR"
n=$(pgrep -cxf "$s1")
[[ $n == 0 ]] && pass "no child of a rank left after the step" || { fail "$n '$s1' left after the step"; pkill -KILL -xf "$s1"; }

# one task's am-launch killed with SIGKILL: its guard kills the rank's group (the rank dies
# with am-launch, and its child would be an orphan that Slurm's process tracking has lost);
# --kill-on-bad-exit ends the rest of the step (the templates use it)
s2="sleep 8${$}2"
mkdir -p "$T/killed"
timeout 60 srun --kill-on-bad-exit=1 -N2 -n2 -w n1,n2 --mpi=pmix "$LAUNCH" --log-dir "$T/killed/logs" "$RECIPE" -- sh -c "$s2; echo done" \
  >"$T/killed/out" 2>"$T/killed/err" &
pid=$!
for _ in $(seq 100); do [[ $(pgrep -cxf "$s2") == 2 ]] && break; sleep 0.1; done
victim=""
for p in $(pgrep -f -- "^$LAUNCH --log-dir $T/killed/logs"); do # am-launch itself: not srun, not its guard
  [[ $(cat "/proc/$p/comm" 2>/dev/null) == am-launch ]] && { victim=$p; break; }
done
[[ -n $victim ]] && kill -KILL "$victim" || fail "no am-launch of the step found to kill"
wait $pid
rc=$?
[[ $rc != 0 && $rc != 124 ]] && pass "SIGKILL to one task's am-launch ends the step ($rc)" || fail "the step exited $rc after a task's am-launch was killed"
for _ in $(seq 50); do [[ $(pgrep -cxf "$s2") == 0 ]] && break; sleep 0.1; done
n=$(pgrep -cxf "$s2")
[[ $n == 0 ]] && pass "no rank's child left after SIGKILL to am-launch" || { fail "$n '$s2' left after SIGKILL to am-launch"; pkill -KILL -xf "$s2"; }

finish
