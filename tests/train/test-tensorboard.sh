#!/usr/bin/env bash
# test-tensorboard.sh - every job's curves: rank 0 writes TensorBoard event files in
# <log dir>/<job id>/tensorboard, one Event per step holding every number of its step record
# as "train/<key>" (and train/tokens_per_s), stamped with the record's time. The file is read
# back by tests/base/tfevents_dump (both crc32c of every record checked) and, where Python
# has the tensorboard package (AM_TB_PYTHON, else python3), by TensorBoard's own
# EventAccumulator; every value must equal its step record's as a float. The records' maxima
# over the job (step_s_max, work_s_max, work_s_max_rank) must be the ranks' own: the largest
# step_s, the largest step_s - comm_s and its rank, which is the rank slowed by AM_FAULT
# (kind=slow) at its step. AM_TENSORBOARD_DIR
# moves the files (DIR/<job id>) or, set to none, turns them off; a directory that cannot be
# made is a note and the run goes on.
set -uo pipefail
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN AM_FAULT AM_TENSORBOARD_DIR 2>/dev/null || true
T=$(mktemp -d /tmp/am-tb-XXXXXX)
trap '[ -n "${AM_KEEP:-}" ] || rm -rf "$T"' EXIT
fails=0 passes=0
ok() { echo "ok: $*"; passes=$((passes + 1)); }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$AM_BUILDDIR/am-data" build --bytes --out "$T/corpus" /usr/share/common-licenses/* >/dev/null || exit 1
sed -e "s|paths: .*|paths: $T/corpus|" -e 's/max_steps: .*/max_steps: 6/' -e 's/local_batch_size: .*/local_batch_size: 2/' \
    "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$T/tiny.yaml"
sed -e 's/model_type: llama/model_type: mixtral\n  num_local_experts: 4\n  num_experts_per_tok: 2\n  output_router_logits: true/' \
    "$T/tiny.yaml" >"$T/moe.yaml"

# job NAME NPROC RECIPE [VAR=VALUE...]: trains; its job directory in $T/job-NAME
job() {
    local name=$1 n=$2 recipe=$3
    shift 3
    (cd "$T" && env "$@" "$AM_BUILDDIR/am-launch" --nproc "$n" --log-dir "$T/logs-$name" "$recipe" \
        >"$T/$name.out" 2>"$T/$name.err") || { bad "$name did not train"; sed 's/^/    /' "$T/$name.err"; return 1; }
    find "$T/logs-$name" -mindepth 1 -maxdepth 1 -type d >"$T/job-$name"
}

# check NAME FILE: the file's values against rank 0's step records
check() {
    local name=$1 file=$2 dir
    dir=$(cat "$T/job-$name")
    if ! "$AM_BUILDDIR/tests/base/tfevents_dump" "$file" >"$T/$name.dump" 2>"$T/$name.dumperr"; then
        bad "$name: the event file does not read back: $(cat "$T/$name.dumperr")"; return
    fi
    [[ $(head -n 1 "$T/$name.dump") =~ ^version\ [0-9.]+\ 0\ brain.Event:2$ ]] && ok "$name: the file starts with its version" ||
        bad "$name: first record is not the file version: $(head -n 1 "$T/$name.dump")"
    # the step records' numbers: "STEP TIME KEY VALUE", and tokens / step_s
    jq -r 'select(.type == "step") | . as $r | (to_entries[] | select((.value | type) == "number") |
             select(.key != "step" and .key != "time") | "\($r.step) \($r.time) train/\(.key) \(.value)"),
           "\(.step) \(.time) train/tokens_per_s \(.tokens / .step_s)"' "$dir/rank-0.jsonl" | sort >"$T/$name.want"
    awk '$1 == "scalar" { print $3, $2, $4, $5 }' "$T/$name.dump" | sort >"$T/$name.got"
    local nw ng
    nw=$(wc -l <"$T/$name.want") ng=$(wc -l <"$T/$name.got")
    if [ "$nw" -gt 6 ] && [ "$nw" = "$ng" ]; then ok "$name: $ng scalars over 6 steps, one per number of the step records"; else
        bad "$name: $ng scalars in the file, $nw numbers in the step records"; diff <(cut -d' ' -f1,3 "$T/$name.want") <(cut -d' ' -f1,3 "$T/$name.got") | head; fi
    # each value equal to its record's rounded to a float (relative 1e-7), the time to the microsecond
    if join -j1 <(awk '{ print $1 "|" $3, $2, $4 }' "$T/$name.want" | sort) <(awk '{ print $1 "|" $3, $2, $4 }' "$T/$name.got" | sort) |
        awk '{ d = $3 - $5; if (d < 0) d = -d; m = $3 < 0 ? -$3 : $3; t = $2 - $4; if (t < 0) t = -t
               if (d > 1e-7 * m + 1e-38 || t > 2e-6) { print "    " $0; bad++ } n++ }
             END { exit !(n > 0 && !bad) }' >"$T/$name.cmp"; then
        ok "$name: every scalar equals its step record's value (as a float) at its time"
    else bad "$name: scalars differ from the step records:"; head "$T/$name.cmp"; fi
}

job dense 2 tiny.yaml AM_FAULT=rank=1,step=4,kind=slow:0.5 && {
    files=("$(cat "$T/job-dense")"/tensorboard/events.out.tfevents.*)
    [ "${#files[@]}" = 1 ] && [ -s "${files[0]}" ] && ok "dense: one event file in <log dir>/<job id>/tensorboard" ||
        bad "dense: ${#files[@]} event files in $(cat "$T/job-dense")/tensorboard"
    check dense "${files[0]}"
    # the slowest ranks: every rank's record holds the maxima of the ranks' own step records
    # (the time outside communication to the microsecond, its rank one that had it)
    if jq -nr '[inputs | select(.type == "step") | . + {rank: (input_filename | capture("rank-(?<r>[0-9]+)[.]jsonl$").r | tonumber)}]
            | group_by(.step)[] | . as $s | ($s | map(.step_s) | max) as $mx | ($s | map(.step_s - .comm_s) | max) as $w
            | $s[] | . as $r | ([$s[] | select(.rank == $r.work_s_max_rank) | .step_s - .comm_s] | first // -1) as $named
            | select(.step_s_max != $mx or (.work_s_max - $w | fabs) > 1e-6 or $named < $w - 1e-6)
            | "    step \(.step) rank \(.rank): step_s_max \(.step_s_max) work_s_max \(.work_s_max) rank \(.work_s_max_rank); the ranks: \($mx) \($w)"' \
            "$(cat "$T/job-dense")"/rank-*.jsonl >"$T/dense.max" && [ ! -s "$T/dense.max" ] &&
        [ "$(grep -c '"type":"step"' "$(cat "$T/job-dense")"/rank-1.jsonl)" = 6 ]; then
        ok "dense: step_s_max, work_s_max and work_s_max_rank are the ranks' own maxima at every step"
    else bad "dense: the records' maxima are not the ranks' own:"; head "$T/dense.max"; fi
    jq -se 'any(.[]; .type == "step" and .step == 4 and .work_s_max_rank == 1 and .work_s_max >= 0.5)' \
        "$(cat "$T/job-dense")/rank-0.jsonl" >/dev/null && grep -q ' train/work_s_max_rank 1$' <(grep '^4 ' "$T/dense.got") &&
        ok "dense: rank 1, slowed by 0.5 s at step 4, is work_s_max_rank there (and in TensorBoard)" ||
        bad "dense: the rank slowed at step 4 is not named: $(jq -c 'select(.type == "step" and .step == 4)' "$(cat "$T/job-dense")/rank-0.jsonl")"
    py=${AM_TB_PYTHON:-python3}
    if "$py" -c 'import tensorboard.backend.event_processing.event_accumulator' 2>/dev/null; then
        if "$py" - "$(cat "$T/job-dense")/tensorboard" "$T/dense.want" <<'PY'; then ok "dense: TensorBoard's EventAccumulator reads every value of the step records"; else bad "dense: TensorBoard's EventAccumulator disagrees"; fi
import struct, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
want = {}
for line in open(sys.argv[2]):
    step, _, tag, value = line.split()
    want[(int(step), tag)] = struct.unpack("f", struct.pack("f", float(value)))[0]
got = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
bad = [k for k in want if got.get(k) != want[k]]
print("    EventAccumulator: %d scalars, %d tags, %d differ" % (len(got), len(acc.Tags()["scalars"]), len(bad)))
sys.exit(1 if bad or len(got) != len(want) else 0)
PY
    else
        echo "skip: no Python with the tensorboard package (AM_TB_PYTHON): EventAccumulator's check not run"
    fi
}

# a mixture of experts: the load-balancing loss and the experts' tokens are curves too
job moe 1 moe.yaml && {
    check moe "$(cat "$T/job-moe")"/tensorboard/events.out.tfevents.*
    grep -q ' train/aux_loss ' "$T/moe.got" && grep -q ' train/expert_tokens_max ' "$T/moe.got" &&
        ok "moe: train/aux_loss and train/expert_tokens_max are scalars" || bad "moe: no aux_loss or expert_tokens_max scalar"
}

# AM_TENSORBOARD_DIR: moved to DIR/<job id>; none: no file
job moved 1 tiny.yaml AM_TENSORBOARD_DIR="$T/tb" && {
    id=$(basename "$(cat "$T/job-moved")")
    ls "$T/tb/$id"/events.out.tfevents.* >/dev/null 2>&1 && [ ! -e "$(cat "$T/job-moved")/tensorboard" ] &&
        ok "AM_TENSORBOARD_DIR=DIR: the file is in DIR/$id" || bad "AM_TENSORBOARD_DIR=DIR: no file in $T/tb/$id"
}
job off 1 tiny.yaml AM_TENSORBOARD_DIR=none && {
    [ -z "$(find "$T/logs-off" -name 'events.out.tfevents.*')" ] && ok "AM_TENSORBOARD_DIR=none: no event file" ||
        bad "AM_TENSORBOARD_DIR=none: an event file was written"
}
# a directory that cannot be made: a note on stderr and in the log, and the run trains on
job noted 1 tiny.yaml AM_TENSORBOARD_DIR=/proc/am-no-tb && {
    want="am-train: rank 0: note: TensorBoard: /proc/am-no-tb/$(basename "$(cat "$T/job-noted")"): cannot create the TensorBoard directory: No such file or directory (no curves for this run: set AM_TENSORBOARD_DIR to a writable directory, or to none)"
    grep -qxF -- "$want" "$T/noted.err" && ok "an unwritable AM_TENSORBOARD_DIR: the note on stderr" ||
        { bad "no note '$want' on stderr"; sed 's/^/    /' "$T/noted.err"; }
    [ "$(grep -c '"type":"step"' "$(cat "$T/job-noted")/rank-0.jsonl")" = 6 ] &&
        jq -se 'any(.[]; .type == "note" and .where == "tensorboard")' "$(cat "$T/job-noted")/rank-0.jsonl" >/dev/null &&
        ok "an unwritable AM_TENSORBOARD_DIR: the run trained its 6 steps, the note is in its log" ||
        bad "an unwritable AM_TENSORBOARD_DIR stopped the run or left no note record"
}

echo "tensorboard: $passes passed, $fails failed"
[ "$fails" = 0 ]
