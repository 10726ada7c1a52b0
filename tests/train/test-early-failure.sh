#!/usr/bin/env bash
# test-early-failure.sh - a rank that fails before training (the bootstrap, the recipe, the
# placement, the dataset, host memory while drawing the initial weights) leaves its error in its log: the start record (host, job, rank) is
# the log's first line, the message the rank printed is its cause record, and am-diag names
# the rank, its host and that message as the first failure (am-launch --nproc; the same on
# Slurm is in tests/slurm/test-jobs.sh).
set -uo pipefail
source "$(dirname "$0")/fault-lib.sh"

T=$(mktemp -d /tmp/am-early-XXXXXX)
trap 'rm -rf "$T"' EXIT
HOST=$(hostname)
make_recipe "$T" || { echo "FAIL: cannot build the corpus"; exit 1; }
sed "s|paths: .*|paths: $T/nonexistent/corpus|" "$T/tiny.yaml" >"$T/nodata.yaml"
sed 's/^  tp_size: 1$/  tp_size: 1\n  tp_sise: 2/' "$T/tiny.yaml" >"$T/badkey.yaml"

# case NAME NPROC RECIPE RANKS STATUS MESSAGE [VAR=VALUE...]: the job fails, first with
# MESSAGE on a rank matching the regex RANKS, whose exit status matches STATUS (every rank
# fails alike in the dataset case: any may be first, and be stopped by another's abort)
case_() {
  local name=$1 nproc=$2 recipe=$3 ranks=$4 status=$5 msg=$6 json dir want r
  shift 6
  CASES=$((CASES + 1))
  (cd "$T" && exec env "$@" timeout 60 "$LAUNCH" --nproc "$nproc" --log-dir "$T/$name" "$recipe" ${PROG:+-- sh -c "$PROG"}) \
    >"$T/$name.out" 2>"$T/$name.err"
  local rc=$?
  [[ $rc == 1 ]] && pass "$name: exit status 1" || fail "$name: exit status $rc, want 1"
  dir=$(find "$T/$name" -mindepth 1 -maxdepth 1 -type d | head -n 1)
  for ((r = 0; r < nproc; r++)); do
    head -n 1 "$dir/rank-$r.jsonl" | grep -qE "^\{\"type\":\"start\",\"host\":\"$HOST\",\"pid\":[0-9]+,\"rank\":$r,\"job\":\"local-[0-9]+-[0-9]+\"," &&
      pass "$name: rank $r's log starts with its start record" || { fail "$name: rank $r's first line is not the start record"; head -n 1 "$dir/rank-$r.jsonl"; }
  done
  json=$("$DIAG" "$dir" --json)
  local first
  first=$(jq -r '.first_failure.rank' <<<"$json")
  [[ $first =~ ^($ranks)$ ]] && pass "$name: am-diag's first failure is rank $first" || fail "$name: am-diag's first failure is rank $first, want $ranks"
  grep -qxF -- "$msg" <(sed -nE "s/^am-train: (rank $first: )?error: //p" "$T/$name.err") &&
    pass "$name: rank $first printed its error" || { fail "$name: no '$msg' on stderr"; sed 's/^/    /' "$T/$name.err"; }
  # the cause record carries exactly what the rank printed
  if jq -se --arg m "$msg" --argjson r "$first" 'any(.[]; .type == "cause" and .cause == "error" and .rank == $r and .message == $m)' \
    "$dir/rank-$first.jsonl" >/dev/null; then
    pass "$name: rank $first's cause record is its error"
  else
    fail "$name: rank $first's log has no cause record with the message"; sed 's/^/    /' "$dir/rank-$first.jsonl" | cut -c1-300
  fi
  want="\"first_failure\":\\{\"rank\":$first,\"host\":\"$HOST\",\"cause\":\"error\",\"signal\":null,\"step\":null,\"status\":($status),\"local_rank\":$first,"
  [[ $json =~ $want ]] && pass "$name: am-diag names rank $first on $HOST, cause error" || { fail "$name: am-diag --json lacks $want"; echo "    $json" | cut -c1-600; }
  [[ $(jq -r '.first_failure.detail' <<<"$json") == "$msg" ]] && pass "$name: am-diag gives the message" ||
    { fail "$name: am-diag's detail is not the message"; jq -r '.first_failure.detail' <<<"$json"; }
  "$DIAG" "$dir" >"$T/$name.diag"
  grep -qE "^first failure: rank $first on $HOST \(local rank $first" "$T/$name.diag" && pass "$name: am-diag's first-failure line" ||
    { fail "$name: am-diag's text lacks 'first failure: rank $first on $HOST'"; sed 's/^/    /' "$T/$name.diag"; }
  grep -qE "job \?|unknown host|without a cause record|no start record" "$T/$name.diag" &&
    { fail "$name: am-diag lacks the start or the cause record"; sed 's/^/    /' "$T/$name.diag"; } || pass "$name: am-diag has both records"
}

case_ placement 3 "$T/tiny.yaml" 0 1 "placement: tp_size 2 cannot be placed: NVLink domain $HOST has 3 ranks (0, 1, 2). A tensor-parallel group must lie inside one domain, so every domain needs a multiple of 2 ranks: use tp_size 1 or 3 (dividing every domain's rank count), or start a multiple of 2 ranks in every domain (for example one rank per GPU: srun --ntasks-per-node=<GPUs per node>)" AM_TP=2
case_ recipe 2 "$T/badkey.yaml" 0 1 "$T/badkey.yaml:23:3: distributed.tp_sise: unknown key (did you mean tp_size?)"
# a bootstrap that fails (the rank program handed a descriptor that is not open)
PROG="AM_BOOTSTRAP_FD=99 exec $AM_BUILDDIR/am-train" case_ bootstrap 1 "$T/tiny.yaml" 0 1 "no launcher: AM_BOOTSTRAP_FD is not an open descriptor; start rank programs with am-launch (\`am-launch --nproc N RECIPE\` on one machine, \`srun --mpi=pmix am-launch RECIPE\` under Slurm)"
case_ dataset 2 "$T/nodata.yaml" "0|1" "1|143" "$T/nonexistent/corpus.idx: cannot open: No such file or directory (build the dataset with am-data build --out PREFIX)"
# host memory that runs out while the initial weights are drawn (the first allocation of one
# MLP matrix's 176 x 64 floats fails: tests/train/fail_alloc.c), and while LoRA's adapters are
# (the first adapter A of rank 5 over the hidden size 64)
FAIL_ALLOC=$AM_BUILDDIR/tests/train/.libs/libfailalloc.so
sed 's/^peft:.*//' "$T/tiny.yaml" >"$T/lora.yaml"
printf 'peft:\n  _target_: nemo_automodel.components._peft.lora.PeftConfig\n  target_modules: "*_proj"\n  dim: 5\n  alpha: 10\n' >>"$T/lora.yaml"
case_ init-alloc 1 "$T/tiny.yaml" 0 1 "out of host memory drawing the initial weights" \
  LD_PRELOAD="$FAIL_ALLOC" AM_TEST_FAIL_MALLOC=$((176 * 64 * 4))
case_ lora-alloc 1 "$T/lora.yaml" 0 1 "out of host memory drawing the LoRA adapters' initial values" \
  LD_PRELOAD="$FAIL_ALLOC" AM_TEST_FAIL_CALLOC=$((5 * 64 * 4))

if [[ $FAILED == 0 ]]; then echo "$TEST_NAME: all $CASES cases passed"; exit 0; fi
echo "$TEST_NAME: some checks FAILED"
exit 1
