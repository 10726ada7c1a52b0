#!/usr/bin/env bash
# test-standalone.sh - `am-launch --nproc N` on this machine: bootstrap, all-or-nothing
# failure (exit code, segfault, abort request, a hung rank, a stubborn one, a fence
# timeout), exit records, signal forwarding, the rank's environment, usage errors, and the
# dry run (placement lines and errors).
set -uo pipefail
source "$(dirname "$0")/lib.sh"

T=$(mktemp -d /tmp/am-test-standalone.XXXXXX)
trap 'rm -rf "$T"' EXIT
HOST=$(hostname)

# run NAME ARGS...: am-launch with a fresh log dir $T/NAME/logs; sets RC, OUT, ERR, LOGS
run() {
  local name=$1
  shift
  mkdir -p "$T/$name"
  LOGS=$T/$name/logs OUT=$T/$name/out ERR=$T/$name/err
  "$LAUNCH" --log-dir "$LOGS" "$@" >"$OUT" 2>"$ERR"
  RC=$?
}

# ---- bootstrap --------------------------------------------------------------------------
run ok --nproc 4 "$RECIPE" -- "$BOOT_CHECK"
expect_rc "4 ranks" 0 "$RC" "$OUT" "$ERR"
for r in 0 1 2 3; do
  expect_match "rank $r bootstrapped" "$OUT" "^rank $r/4 on $HOST \\(node 0/1, local $r/4\\) job local-[0-9]+-[0-9]+: allgather ok$"
  expect_match "rank $r exit record" "$(job_dir "$LOGS")/rank-$r.jsonl" \
    "$(exit_record_re $r "$HOST" 0 0 null false '(false|null)' null)"
done

# ---- failures -------------------------------------------------------------------------------
run exit7 --nproc 4 "$RECIPE" -- env BOOT_CHECK_FAIL=2:7 "$BOOT_CHECK"
expect_rc "a rank exits 7" 7 "$RC" "$ERR"
expect_line "exit 7 reported" "$ERR" "am-launch: rank 2 on $HOST exited with status 7; stopping the other ranks"
expect_match "first failure named" "$ERR" "^am-launch: job local-[0-9]+-[0-9]+ failed: rank 2 failed first \\(exit status 7\\); logs in $LOGS/local-[0-9]+-[0-9]+/$"
expect_match "exit record of the failed rank" "$(job_dir "$LOGS")/rank-2.jsonl" \
  "$(exit_record_re 2 "$HOST" 7 0 null false '(false|null)' null)"
for r in 0 1 3; do
  [[ -s $(job_dir "$LOGS")/rank-$r.jsonl ]] && pass "exit record of stopped rank $r" || fail "no exit record of rank $r"
done

run segv --nproc 3 "$RECIPE" -- env BOOT_CHECK_SEGV=1 "$BOOT_CHECK"
expect_rc "a rank segfaults" 139 "$RC" "$ERR"
expect_line "segfault reported" "$ERR" "am-launch: rank 1 on $HOST was killed by signal 11 (SIGSEGV, Segmentation fault); stopping the other ranks"
expect_match "segfault exit record" "$(job_dir "$LOGS")/rank-1.jsonl" \
  "$(exit_record_re 1 "$HOST" 139 11 SIGSEGV false '(false|null)' null)"

run abort --nproc 3 "$RECIPE" -- env BOOT_CHECK_ABORT=1:6 BOOT_CHECK_HANG=2 "$BOOT_CHECK"
expect_rc "a rank aborts the job" 6 "$RC" "$ERR"
expect_line "abort reported" "$ERR" "am-launch: rank 1 aborted the job (status 6): boot_check asked to abort"
expect_match "aborting rank's exit record" "$(job_dir "$LOGS")/rank-1.jsonl" \
  "$(exit_record_re 1 "$HOST" 6 0 null false '(false|null)' null)"
expect_match "hung rank stopped" "$(job_dir "$LOGS")/rank-2.jsonl" \
  "$(exit_record_re 2 "$HOST" 143 15 SIGTERM false '(false|null)' SIGTERM)"

# a rank hangs, another fails: the hung one is stopped at once
t0=$SECONDS
run hang --nproc 4 "$RECIPE" -- env BOOT_CHECK_HANG=0 BOOT_CHECK_EXIT=3:5 "$BOOT_CHECK"
expect_rc "hang, then another rank fails" 5 "$RC" "$ERR"
(( SECONDS - t0 <= 3 )) && pass "hung rank stopped within 3 s" || fail "took $((SECONDS - t0)) s"
expect_match "hung rank's exit record" "$(job_dir "$LOGS")/rank-0.jsonl" \
  "$(exit_record_re 0 "$HOST" 143 15 SIGTERM false '(false|null)' SIGTERM)"

# a rank that ignores SIGTERM gets SIGKILL after the grace period (5 s)
t0=$SECONDS
run stubborn --nproc 2 "$RECIPE" -- env BOOT_CHECK_HANG=0:stubborn BOOT_CHECK_SEGV=1 "$BOOT_CHECK"
expect_rc "stubborn rank" 139 "$RC" "$ERR"
(( SECONDS - t0 >= 4 && SECONDS - t0 <= 9 )) && pass "SIGKILL after the grace period" || fail "took $((SECONDS - t0)) s"
expect_match "stubborn rank's exit record" "$(job_dir "$LOGS")/rank-0.jsonl" \
  "$(exit_record_re 0 "$HOST" 137 9 SIGKILL false '(false|null)' SIGKILL)"

# a rank never reaches the fence: the others' fence times out with a message
run fence --nproc 3 "$RECIPE" -- env BOOT_CHECK_HANG=1:before BOOT_CHECK_TIMEOUT=1 "$BOOT_CHECK"
expect_rc "fence timeout" 4 "$RC" "$ERR"
expect_match "fence timeout reported" "$ERR" "^boot_check: rank [02]: bootstrap allgather: timed out after 1 s: rank 1 did not reach it \\(stuck or slow: see its log\\)$"

# ranks that send the allgather values of different lengths: every rank is refused, with who sent what
run wide --nproc 3 "$RECIPE" -- env BOOT_CHECK_WIDE=1 "$BOOT_CHECK"
expect_rc "allgather of unequal lengths" 4 "$RC" "$ERR"
expect_match "allgather of unequal lengths reported" "$ERR" "^boot_check: rank [012]: bootstrap allgather: allgather 'x': rank 1 sent 8 bytes, rank 0 4 \\(every rank sends as many\\)$"

run noexec --nproc 2 "$RECIPE" -- /nonexistent/rank-program
expect_rc "program not found" 127 "$RC" "$ERR"
expect_line "program not found reported" "$ERR" "am-launch: cannot run /nonexistent/rank-program: No such file or directory"

# ---- signals ------------------------------------------------------------------------------
mkdir -p "$T/sig"
BOOT_CHECK_WAIT=1 "$LAUNCH" --log-dir "$T/sig/logs" --nproc 2 "$RECIPE" -- "$BOOT_CHECK" >"$T/sig/out" 2>"$T/sig/err" &
pid=$!
for _ in $(seq 100); do [[ $(grep -c ready "$T/sig/out" 2>/dev/null) == 2 ]] && break; sleep 0.1; done
kill -USR1 $pid; sleep 0.3
kill -USR2 $pid; sleep 0.3
kill -TERM $pid
wait $pid
expect_rc "SIGTERM to am-launch" 143 $? "$T/sig/out" "$T/sig/err"
for r in 0 1; do
  expect_line "rank $r got SIGUSR1" "$T/sig/out" "rank $r got SIGUSR1"
  expect_line "rank $r got SIGUSR2" "$T/sig/out" "rank $r got SIGUSR2"
  expect_line "rank $r got SIGTERM" "$T/sig/out" "rank $r got SIGTERM"
  expect_match "rank $r stopped by SIGTERM" "$(job_dir "$T/sig/logs")/rank-$r.jsonl" \
    "$(exit_record_re $r "$HOST" 0 0 null false '(false|null)' SIGTERM)"
done
expect_line "SIGTERM reported" "$T/sig/err" "am-launch: got SIGTERM, stopping every rank"

# ---- the rank's environment ---------------------------------------------------------------
cd "$T" || exit 1
run env --nproc 2 "$RECIPE" -- sh -c 'echo "$AM_RANK $AM_WORLD_SIZE $AM_LOCAL_RANK $AM_RECIPE $AM_LOG_DIR $AM_JOB_ID fd=$AM_BOOTSTRAP_FD"'
expect_rc "rank environment" 0 "$RC" "$OUT" "$ERR"
expect_match "rank 1's variables" "$OUT" "^1 2 1 $RECIPE $T/env/logs local-[0-9]+-[0-9]+ fd=[0-9]+$"
mkdir -p "$T/default" && cd "$T/default" && "$LAUNCH" --nproc 1 "$RECIPE" -- true && \
  [[ -s $(job_dir "$T/default/am-logs")/rank-0.jsonl ]] && pass "default log dir ./am-logs" || fail "no ./am-logs"
cd "$T/default" && AM_LOG_DIR=envlogs "$LAUNCH" --nproc 1 "$RECIPE" -- true && \
  [[ -s $(job_dir "$T/default/envlogs")/rank-0.jsonl ]] && pass "AM_LOG_DIR" || fail "AM_LOG_DIR not used"
cd "$T" || exit 1

# ---- usage errors ---------------------------------------------------------------------------
"$LAUNCH" "$RECIPE" >"$T/u.out" 2>"$T/u.err"
expect_rc "no --nproc, no PMIx" 2 $? "$T/u.err"
expect_line "how to launch" "$T/u.err" "am-launch: no --nproc and no PMIx server: run \`am-launch --nproc N $RECIPE\` on one machine, or \`srun --mpi=pmix am-launch $RECIPE\` under Slurm"
env -u SLURM_JOB_ID SLURM_STEP_ID=0 SLURM_PROCID=0 "$LAUNCH" "$RECIPE" >"$T/u.out" 2>"$T/u.err"
expect_rc "Slurm without PMIx, nor a Slurm environment" 2 $? "$T/u.err"
expect_line "both ways named" "$T/u.err" "am-launch: running in a Slurm step without PMIx, and its bootstrap over TCP with munge failed (SLURM_JOB_ID is not set: is this a task of a Slurm step (srun)?): start it with \`srun --mpi=pmix am-launch ...\` (or set MpiDefault=pmix in slurm.conf), or make munge and the boot server's port work on every node of the step (docs/admin.md)"
env SLURM_JOB_ID=7 SLURM_STEP_ID=0 SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_STEP_NUM_NODES=1 SLURM_NODEID=0 \
  SLURM_LOCALID=0 SLURM_STEP_TASKS_PER_NODE=1 SLURM_STEP_NODELIST=localhost AM_BOOT_HOST=127.0.0.1 AM_MUNGE_SOCKET=$T/no-munged.sock \
  "$LAUNCH" "$RECIPE" >"$T/u.out" 2>"$T/u.err"
expect_rc "Slurm without PMIx, no munged" 2 $? "$T/u.err"
expect_line "munged missing named" "$T/u.err" "am-launch: running in a Slurm step without PMIx, and its bootstrap over TCP with munge failed (munge cannot make a credential (munged's socket: $T/no-munged.sock; AM_MUNGE_SOCKET sets it): Failed to access \"$T/no-munged.sock\": No such file or directory (Did you start munged?)): start it with \`srun --mpi=pmix am-launch ...\` (or set MpiDefault=pmix in slurm.conf), or make munge and the boot server's port work on every node of the step (docs/admin.md)"
"$LAUNCH" --nproc 2 /nonexistent/r.yaml >"$T/u.out" 2>"$T/u.err"
expect_rc "missing recipe" 2 $? "$T/u.err"
expect_line "missing recipe reported" "$T/u.err" "am-launch: recipe /nonexistent/r.yaml: No such file or directory"
"$LAUNCH" --nproc 2 >"$T/u.out" 2>"$T/u.err"
expect_rc "no recipe" 2 $? "$T/u.err"
expect_line "no recipe reported" "$T/u.err" "am-launch: no recipe: give RECIPE, or set AM_RECIPE (sbatch/srun --am-recipe does)"
AM_RECIPE=$RECIPE "$LAUNCH" --nproc 1 -- sh -c 'test "$AM_RECIPE" = "'"$RECIPE"'"' 2>"$T/u.err"
expect_rc "recipe from AM_RECIPE" 0 $? "$T/u.err"
"$LAUNCH" --log-dir /proc/no/such --nproc 1 "$RECIPE" -- true >"$T/u.out" 2>"$T/u.err"
expect_rc "unwritable log dir" 1 $? "$T/u.err"
expect_match "log dir reported" "$T/u.err" "^am-launch: cannot create the log directory /proc/no/such/local-[0-9]+-[0-9]+ \\(--log-dir\\): .*; set --log-dir or AM_LOG_DIR to a writable directory$"

# ---- dry run --------------------------------------------------------------------------------
cat >"$T/topo.yaml" <<EOF
nodes:
  "$HOST": {gpus: 4, domains: [[0, 1], [2, 3]]}
EOF
AM_TP=2 run dry --nproc 4 --dry-run --topology "$T/topo.yaml" "$RECIPE"
expect_rc "dry run" 0 "$RC" "$OUT" "$ERR"
cat >"$T/dry.want" <<EOF
{"rank":0,"host":"$HOST","domain":"$HOST:0","local_rank":0,"gpu":0,"mesh_rank":0,"coords":{"pp":0,"dp_replicate":0,"dp_shard":0,"cp":0,"tp":0,"ep":0},"groups":{"tp":[0,1],"pp":[0],"dp":[0,2],"ep":[0]}}
{"rank":1,"host":"$HOST","domain":"$HOST:0","local_rank":1,"gpu":1,"mesh_rank":1,"coords":{"pp":0,"dp_replicate":0,"dp_shard":0,"cp":0,"tp":1,"ep":0},"groups":{"tp":[0,1],"pp":[1],"dp":[1,3],"ep":[1]}}
{"rank":2,"host":"$HOST","domain":"$HOST:1","local_rank":2,"gpu":2,"mesh_rank":2,"coords":{"pp":0,"dp_replicate":0,"dp_shard":1,"cp":0,"tp":0,"ep":0},"groups":{"tp":[2,3],"pp":[2],"dp":[0,2],"ep":[2]}}
{"rank":3,"host":"$HOST","domain":"$HOST:1","local_rank":3,"gpu":3,"mesh_rank":3,"coords":{"pp":0,"dp_replicate":0,"dp_shard":1,"cp":0,"tp":1,"ep":0},"groups":{"tp":[2,3],"pp":[3],"dp":[1,3],"ep":[3]}}
EOF
diff "$T/dry.want" "$OUT" >"$T/dry.diff" && pass "dry run lines" || { fail "dry run lines differ"; show "$T/dry.diff"; }

AM_TP=4 run dry4 --nproc 4 --dry-run --topology "$T/topo.yaml" "$RECIPE"
expect_rc "dry run, tp over two domains" 1 "$RC" "$ERR"
expect_count "placement error printed once" "$ERR" "am-place: error: placement: tp_size 4 cannot be placed: NVLink domain $HOST:0 has 2 ranks (0, 1); $HOST:1 has 2 ranks (2, 3). A tensor-parallel group must lie inside one domain, so every domain needs a multiple of 4 ranks: use tp_size 1 or 2 (dividing every domain's rank count), or start a multiple of 4 ranks in every domain (for example one rank per GPU: srun --ntasks-per-node=<GPUs per node>)" 1
[[ ! -s $OUT ]] && pass "no placement printed on error" || fail "placement printed on error"
expect_line "one failure reported" "$ERR" "am-launch: rank 0 on $HOST exited with status 1; stopping the other ranks"

AM_TP=3 run dry3 --nproc 4 --dry-run "$RECIPE"
expect_rc "dry run, bad tp" 1 "$RC" "$ERR"
expect_count "recipe rule printed once" "$ERR" "am-place: error: AM_TP=3: distributed.tp_size: 3 does not divide num_attention_heads = 4 (use 1, 2 or 4)" 1

printf 'nodes:\n  other: {gpus: 4}\n' >"$T/other.yaml"
run drytopo --nproc 2 --dry-run --topology "$T/other.yaml" "$RECIPE"
expect_rc "dry run, host not in the topology file" 1 "$RC" "$ERR"
expect_count "topology error printed once" "$ERR" "am-place: error: topology file $T/other.yaml: node $HOST (this rank's host) is not listed: add it under nodes: (with its gpus)" 1

finish
