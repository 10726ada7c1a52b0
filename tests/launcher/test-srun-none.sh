#!/usr/bin/env bash
# test-srun-none.sh - `srun --mpi=none am-launch` on a private local Slurm cluster (whose
# MpiDefault is none; tests/slurm/cluster): the bootstrap from Slurm's environment over TCP,
# served by the first node's task and joined with munge credentials (launcher/env_task.c):
#   - 4 ranks over 2 nodes bootstrap (each rank's view) and record their exits;
#   - a failing rank ends the whole step with its status; a fence timeout names the late rank;
#   - forged joins are refused, with the exact reason on the forger and on the server: a
#     credential for another job, for another server address, garbage, a replayed one, a
#     first request that is no join, a credential made by another user (boot_forge, as rank
#     1 of a step; then it runs the real am-launch and the step completes);
#   - a tp 2 job over 2 nodes (2 tasks each: tp inside a node, dp 2 between them) trains to the very same losses and gradient norms as under
#     --mpi=pmix (when am-launch has PMIx), and as with the port given by --boot-port.
# The cluster's munged listens on a private socket, which am-launch finds in slurm.conf's
# AuthInfo (SLURM_CONF); its node names (n1..n4) do not resolve: AM_BOOT_HOST=127.0.0.1 is
# their address. Skips (77) when the cluster cannot start.
set -uo pipefail
source "$(dirname "$0")/lib.sh"

CLUSTER=$AM_SRCDIR/tests/slurm/cluster
export AM_CLUSTER_DIR=${AM_CLUSTER_DIR:-/tmp/am-cluster-none-$$}
FORGE=$AM_BUILDDIR/tests/launcher/boot_forge
T=$(mktemp -d /tmp/am-test-srun-none.XXXXXX)
chmod 755 "$T"
cleanup() {
  "$CLUSTER" down --purge >/dev/null 2>&1
  rm -rf "$T"
}
trap cleanup EXIT
cd "$T" || exit 1

if ! "$CLUSTER" up >"$T/cluster.log" 2>&1; then
  printf 'SKIP: cannot start the local Slurm cluster in %s\n' "$AM_CLUSTER_DIR"
  sed 's/^/    /' "$T/cluster.log" | tail -20
  exit 77
fi
eval "$("$CLUSTER" env)"
unset AM_MUNGE_SOCKET
export AM_BOOT_HOST=127.0.0.1

# run NAME SRUN-OPTIONS... -- COMMAND...: sets RC, OUT, ERR (srun without --mpi: MpiDefault=none)
run() {
  local name=$1 opts=()
  shift
  while [[ $1 != -- ]]; do opts+=("$1"); shift; done
  shift
  mkdir -p "$T/$name"
  OUT=$T/$name/out ERR=$T/$name/err
  timeout 120 srun "${opts[@]}" "$@" >"$OUT" 2>"$ERR"
  RC=$?
}

# ---- the bootstrap ----------------------------------------------------------------------------
run boot -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$LAUNCH" --log-dir "$T/boot/logs" "$RECIPE" -- "$BOOT_CHECK"
expect_rc "bootstrap over TCP" 0 "$RC" "$OUT" "$ERR"
for r in 0 1 2 3; do
  expect_match "rank $r's view" "$OUT" "^rank $r/4 on n$((r / 2 + 1)) \(node $((r / 2))/2, local $((r % 2))/2\) job [0-9]+\.0: allgather ok$"
  expect_match "rank $r exit record" "$(job_dir "$T/boot/logs")/rank-$r.jsonl" \
    "$(exit_record_re $r n$((r / 2 + 1)) 0 0 null false '(false|null)' null)"
done
run mpinone --mpi=none -N2 -w n1,n2 -n2 -- "$LAUNCH" --log-dir "$T/mpinone/logs" "$RECIPE" -- "$BOOT_CHECK"
expect_rc "bootstrap with srun --mpi=none" 0 "$RC" "$OUT" "$ERR"

# ---- a failing rank ends the step -------------------------------------------------------------
BOOT_CHECK_EXIT=3:7 run fail -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$LAUNCH" --log-dir "$T/fail/logs" "$RECIPE" -- "$BOOT_CHECK"
expect_rc "a rank exits 7" 7 "$RC" "$OUT" "$ERR"
expect_match "its failure reported" "$ERR" '^am-launch: rank 3 on n2 exited with status 7; aborting the job \(log: .*/rank-3\.jsonl\)$'

# ---- a fence timeout, enforced by the boot server: it names the rank that did not come ----------
BOOT_CHECK_HANG=1:before BOOT_CHECK_TIMEOUT=2 run fence -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- \
  "$LAUNCH" --log-dir "$T/fence/logs" "$RECIPE" -- "$BOOT_CHECK"
expect_rc "a rank stuck before the allgather" 4 "$RC" "$OUT" "$ERR"
expect_match "the timeout names it" "$ERR" \
  '^boot_check: rank [023]: bootstrap allgather: timed out after 2 s: rank 1 did not reach it \(stuck or slow: see its log\)$'

# ---- forged joins -----------------------------------------------------------------------------
PORT=24567
AM_BOOT_PORT=$PORT run forge -N2 -w n1,n2 -n2 -- bash -c \
  'if [ "$SLURM_PROCID" = 1 ]; then exec "$0" other-job other-server garbage replay not-a-join uid -- "$@"; else exec "$@"; fi' \
  "$FORGE" "$LAUNCH" --log-dir "$T/forge/logs" "$RECIPE" -- "$BOOT_CHECK"
expect_rc "a forger, then the real rank 1" 0 "$RC" "$OUT" "$ERR"
JOB=$(sed -nE 's/^rank 0\/2 on n1 .* job ([0-9]+)\.0: allgather ok$/\1/p' "$OUT")
expect_match "the step ran" "$OUT" "^rank 1/2 on n2 \(node 1/2, local 0/1\) job $JOB\.0: allgather ok$"
refusals=(
  "other-job|the credential is for step $((JOB + 1)).0, not this step $JOB.0"
  "other-server|the credential is for the boot server 10.9.8.7:1, not this one (127.0.0.1:$PORT)"
  "garbage|munge refused the credential: Failed to base64-decode credential"
  "replay|the credential was used before (a replay)"
  "not-a-join|its first request is not a join (op 1)"
  "uid|the credential was made by uid 65534, not by the job's user (uid $(id -u))"
)
for x in "${refusals[@]}"; do
  mode=${x%%|*} why=${x#*|}
  expect_line "$mode: the forger is told" "$OUT" "boot_forge: $mode: refused: $why"
  re=$(printf '%s' "$why" | sed 's/[][().*^$]/\\&/g')
  expect_match "$mode: the server says so" "$ERR" \
    "^am-launch: boot server 127\.0\.0\.1:$PORT: refused a join from 127\.0\.0\.1:[0-9]+: $re\$"
done
expect_count "no other refusal" "$ERR" 'refused a join' 6

# ---- training: tp 2 x dp 2 over 2 nodes, as under PMIx -------------------------------------------------
"$AM_BUILDDIR/am-data" build --bytes --out "$T/corpus" /usr/share/common-licenses/* >/dev/null || fail "am-data"
sed -e "s|paths: .*|paths: $T/corpus|" -e 's/max_steps: .*/max_steps: 8/' \
  "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$T/tiny.yaml"
steps() { grep -h '"type":"step"' "$1"/*/rank-0.jsonl | sed -E 's/.*"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2/'; }
AM_TP=2 run train-none -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$LAUNCH" --log-dir "$T/train-none/logs" "$T/tiny.yaml"
expect_rc "tp 2 x dp 2 over 2 nodes, srun --mpi=none" 0 "$RC" "$OUT" "$ERR"
steps "$T/train-none/logs" >"$T/none.steps"
if [[ $(grep -cE '^[0-9.e+-]+ [0-9.e+-]+$' "$T/none.steps") == 8 ]]; then pass "8 steps logged"
else fail "not 8 steps logged"; show "$T/none.steps" "$ERR"; fi
AM_TP=2 run train-port -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$LAUNCH" --boot-port 24568 --log-dir "$T/train-port/logs" "$T/tiny.yaml"
expect_rc "the same with --boot-port" 0 "$RC" "$OUT" "$ERR"
steps "$T/train-port/logs" >"$T/port.steps"
if cmp -s "$T/none.steps" "$T/port.steps"; then pass "--boot-port: the same losses"
else fail "--boot-port: other losses"; diff "$T/none.steps" "$T/port.steps"; fi
if [[ $("$LAUNCH" --version) == *"PMIx "[0-9]* ]]; then
  AM_TP=2 run train-pmix --mpi=pmix -N2 -w n1,n2 -n4 --ntasks-per-node=2 -- "$LAUNCH" --log-dir "$T/train-pmix/logs" "$T/tiny.yaml"
  expect_rc "tp 2 x dp 2 over 2 nodes, srun --mpi=pmix" 0 "$RC" "$OUT" "$ERR"
  steps "$T/train-pmix/logs" >"$T/pmix.steps"
  if [[ -s $T/none.steps ]] && cmp -s "$T/none.steps" "$T/pmix.steps"; then
    pass "--mpi=none trains to the very losses and gradient norms of --mpi=pmix"
  else
    fail "--mpi=none and --mpi=pmix differ"; paste "$T/none.steps" "$T/pmix.steps"
  fi
else
  printf 'SKIP: am-launch without PMIx: no comparison with --mpi=pmix\n'
fi
finish
