#!/bin/bash
# tests/diag/test-diag-limits.sh - am-diag on logs built to exhaust it: numbers written inside
# a log that once sized allocations (a group member, "world", a file name of 2 million), long
# logs that took quadratic time (3 ranks x 100k steps; 128 ranks with full 1024-entry flight
# recorders), 10 MB of bad lines (one note each), a FIFO and a link to /dev/zero. Each runs
# under a memory limit (ulimit -v) and a time bound far above what it takes (no timing: the
# bound only catches a hang or a quadratic blow-up), with its exact output checked.
set -u
: "${AM_BUILDDIR:=$PWD}"
DIAG=$AM_BUILDDIR/am-diag
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
FAILED=0
pass() { printf 'PASS: %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; FAILED=1; }
MEM_KB=262144   # 256 MiB of address space: am-diag needs a few MiB here

# run NAME DIR WANT_RC: am-diag under the limits; its stdout in $T/NAME.out, stderr in .err
run() {
  ( ulimit -v $MEM_KB; exec timeout 60 "$DIAG" "$2" ) >"$T/$1.out" 2>"$T/$1.err"
  local rc=$?
  if [[ $rc != "$3" ]]; then
    fail "$1: am-diag exited $rc, want $3: $(head -c 600 "$T/$1.err")"
    return 1
  fi
}

# expect NAME FILE LINE...: each LINE is a whole line of FILE
expect() {
  local name=$1 file=$2 ok=1
  shift 2
  for line in "$@"; do
    grep -qxF -- "$line" "$file" || { fail "$name: no line '$line' in:"; head -n 40 "$file"; ok=0; }
  done
  [[ $ok == 1 ]] && pass "$name"
}

# ---- numbers inside a log size nothing ---------------------------------------------------------
mkdir -p "$T/member" "$T/world" "$T/name"
printf '%s\n' '{"type":"start","world":2,"time":1.0}' \
  '{"type":"groups","groups":[{"name":"dp","gid":0,"ranks":[0,1,2000000]}]}' \
  '{"type":"exit","status":1,"time":5.0}' >"$T/member/rank-0.jsonl"
if run member "$T/member" 1; then
  expect "a group member 2000000 in a job of 2: dropped with a note" "$T/member.out" \
    "am-diag: job ? ($T/member): 2 ranks, FAILED" \
    "others: 1 missing (rank 1)" \
    "  rank 1: missing: no log (rank-1.jsonl): its node's logs are missing, or the rank never started" \
    "  rank 0: 1 rank number in its log is not a rank of the job (the first: 2000000; the job has 2 ranks); ignored"
  [[ $(wc -l <"$T/member.out") -le 16 ]] || fail "member: $(wc -l <"$T/member.out") lines of output"
fi
printf '%s\n' '{"type":"start","world":2000000,"time":1.0}' '{"type":"exit","status":1,"time":5.0}' >"$T/world/rank-0.jsonl"
if run world "$T/world" 1; then
  expect '"world":2000000: the missing ranks as one run' "$T/world.out" \
    "am-diag: job ? ($T/world): 2000000 ranks, FAILED" \
    "others: 1999999 missing (ranks 1-1999999)" \
    "missing logs: 1-1999999" \
    "  ranks 1-1999999: missing: no log, and no other log names them"
  [[ $(wc -l <"$T/world.out") -le 12 ]] || fail "world: $(wc -l <"$T/world.out") lines of output"
fi
printf '%s\n' '{"type":"start","world":1,"time":1.0}' '{"type":"exit","status":0,"time":5.0}' >"$T/name/rank-2000000.jsonl"
if run name "$T/name" 0; then
  expect "rank-2000000.jsonl in a job of 1: read, noted" "$T/name.out" \
    "am-diag: job ? ($T/name): 1 rank, clean" \
    "missing logs: 0" \
    "  rank 0: missing: no log, and no other log names it" \
    "  rank 2000000: its log (rank-2000000.jsonl) is of a rank outside the job, which has 1 rank (the start records' world)"
fi

# ---- long logs: linear time --------------------------------------------------------------------
mkdir -p "$T/steps" "$T/flight"
for r in 0 1 2; do
  { echo "{\"type\":\"start\",\"host\":\"n1\",\"world\":3,\"time\":1000.0,\"max_steps\":100000}"
    awk -v r=$r 'BEGIN { for (s = 1; s <= 100000; s++)
      printf "{\"type\":\"step\",\"step\":%d,\"loss\":5.0,\"step_s\":%s,\"comm_s\":0.05,\"time\":%d.5}\n", s,
             (r == 1 && s == 777) ? "3.1" : "0.1", 1000 + s }'
    echo "{\"type\":\"exit\",\"status\":0,\"time\":200000.0}"; } >"$T/steps/rank-$r.jsonl"
done
if run steps "$T/steps" 0; then
  expect "3 ranks x 100k steps: the straggler found" "$T/steps.out" \
    "others: 1 straggler (rank 1), 2 clean (ranks 0, 2)" \
    "  rank 1 on n1: straggler: finished cleanly, but held the others back: at step 777 it spent 3.00 s longer outside collectives than the median rank, while the others waited for it"
fi
awk -v dir="$T/flight" 'BEGIN {
  for (r = 0; r < 128; r++) {
    f = dir "/rank-" r ".jsonl"
    printf "{\"type\":\"start\",\"host\":\"n%d\",\"world\":128,\"time\":1000.0,\"max_steps\":10}\n", r / 8 >f
    printf "{\"type\":\"groups\",\"groups\":[{\"name\":\"dp\",\"gid\":0,\"ranks\":[" >f
    for (q = 0; q < 128; q++) printf "%s%d", q ? "," : "", q >f
    printf "]}]}\n" >f
    for (s = 1; s <= 10; s++) printf "{\"type\":\"step\",\"step\":%d,\"step_s\":0.1,\"comm_s\":0.05,\"time\":%d.0}\n", s, 1000 + s >f
    for (k = 1; k <= 1024; k++)
      printf "{\"type\":\"flight\",\"id\":%d,\"group\":\"dp\",\"gid\":0,\"seq\":%d,\"op\":\"allreduce\",\"dtype\":\"fp32\",\"count\":%d,\"bytes\":400,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\",\"enqueued\":1001.0,\"started\":1001.0,\"ended\":1001.5,\"waiting_for\":null}\n", k, k, (r == 77 && k == 900) ? 99 : 100 >f
    printf "{\"type\":\"exit\",\"status\":0,\"time\":1020.0}\n" >f
    close(f)
  } }'
if run flight "$T/flight" 1; then
  expect "128 ranks x 1024 flight entries: the one size mismatch found" "$T/flight.out" \
    "am-diag: job ? ($T/flight): 128 ranks, FAILED" \
    "others: 128 clean (ranks 0-127)" \
    "  size: allreduce #900 of group dp: rank 0 passed 100 fp32, rank 77 passed 99 fp32"
fi

# ---- 10 MB of bad lines: one note ----------------------------------------------------------------
mkdir -p "$T/bad"
{ echo '{"type":"start","world":1,"time":1.0,"max_steps":1}'
  yes x | head -n 5000000
  echo '{"type":"step","step":1,"time":2.0}'
  echo '{"type":"exit","status":0,"time":3.0}'; } >"$T/bad/rank-0.jsonl"
if run bad "$T/bad" 0; then
  expect "5 million bad lines: one note" "$T/bad.out" \
    "no failure: every rank with a log finished cleanly" \
    "  rank 0: 5000000 lines are not JSON objects (the first: line 2, '[' or '{' expected near 'x'); skipped"
  [[ $(wc -l <"$T/bad.out") -le 12 ]] || fail "bad lines: $(wc -l <"$T/bad.out") lines of output"
fi

# ---- files that are no regular files ------------------------------------------------------------
mkdir -p "$T/fifo"
mkfifo "$T/fifo/rank-0.jsonl"
ln -s /dev/zero "$T/fifo/rank-1.jsonl"
if run fifo "$T/fifo" 2; then
  expect "a FIFO and a link to /dev/zero: refused, said why" "$T/fifo.err" \
    "am-diag: $T/fifo: the rank logs hold no record (every line is empty or not JSON): nothing to analyse" \
    "  rank 0: rank-0.jsonl is a FIFO, not a regular file; skipped" \
    "  rank 1: rank-1.jsonl is a character device, not a regular file; skipped"
fi
exit $FAILED
