#!/bin/bash
# A save before Slurm's time limit, on the local cluster: sbatch-templates/tiny.sbatch (2 nodes
# x 2 tasks, tp 2 x dp 2, `--signal=B:USR1@60 --requeue`) trains 8 steps of the tiny recipe
# with checkpoint.restore_from: latest. After step 2 the batch script gets SIGUSR1 as Slurm's
# --signal=B: sends it (`scancel --batch --signal=USR1`; the time limit's own timing is
# Slurm's); its trap hands it to the step, every rank saves the same step (3, while rank 0
# sleeps at its start, or 2) and exits 85, the script
# requeues the job, which resumes from `latest` by itself and finishes: the job's losses over
# both runs must equal those of the same layout never interrupted (standalone, bit for bit),
# and the two runs' step records must cover steps 1-8 once each. Fails,
# never skips, when the cluster cannot start.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN AM_FAULT PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d /tmp/am-preempt-XXXXXX)
chmod 755 "$work"
export AM_CLUSTER_DIR=$work/cluster
cluster() { "$AM_SRCDIR/tests/slurm/cluster" "$@"; }
trap 'cluster down --purge >/dev/null 2>&1; rm -rf "$work"' EXIT
fails=0 passes=0
ok() { echo "ok: $*"; passes=$((passes + 1)); }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$AM_BUILDDIR/am-data" build --bytes --out "$work/corpus" /usr/share/common-licenses/* >/dev/null || exit 1
sed -e "s|paths: .*|paths: $work/corpus|" -e 's/max_steps: .*/max_steps: 8/' -e 's/enabled: false/enabled: true/' \
    -e 's/ckpt_every_steps: .*/ckpt_every_steps: 100/' -e "s|checkpoint_dir: .*|checkpoint_dir: ckpt|" \
    "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$work/tiny.yaml"
steps_of() { grep -h '"type":"step"' "$@" | sed -E 's/.*"step":([0-9]+),.*"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2 \3/'; }

# the same layout, never interrupted, standalone
mkdir -p "$work/ref"
(cd "$work/ref" && AM_TP=2 AM_LOG_DIR="$work/logs-ref" "$AM_BUILDDIR/am-launch" --nproc 4 "$work/tiny.yaml" \
    >"$work/out-ref" 2>&1) || { bad "the reference did not train"; cat "$work/out-ref"; exit 1; }
steps_of "$work"/logs-ref/*/rank-0.jsonl >"$work/losses-ref"

if ! AM_SPANK_PLUGIN=$AM_BUILDDIR/.libs/spank_am.so cluster up; then
    echo "FAIL: the local Slurm cluster did not start (see above); nothing was tested"
    exit 1
fi
eval "$(cluster env)"
mkdir -p "$work/run"
chmod 777 "$work/run"
# rank 0 sleeps 5 s at the start of step 3 (kind=slow): the warning lands inside step 3
job=$(cd "$work/run" && PATH="$AM_BUILDDIR:$PATH" AM_FAULT=rank=0,step=3,kind=slow:5 sbatch --parsable \
    --open-mode=append -o "$work/job.out" --am-recipe="$work/tiny.yaml" --am-log-dir="$work/logs" \
    "$AM_SRCDIR/sbatch-templates/tiny.sbatch" | tail -1)
job=${job%%;*}
[ -n "$job" ] || { bad "sbatch failed"; exit 1; }
for _ in $(seq 1200); do
    grep -qs '"type":"step","step":2,' "$work"/logs/*/rank-0.jsonl && break
    sleep 0.1
done
logs=$(dirname "$(ls "$work"/logs/*/rank-0.jsonl | head -1)")
echo "job $job, logs in $logs"
scancel --batch --signal=USR1 "$job"
# the job ends once, is requeued (Slurm holds a requeued job back for a while: BeginTime), runs
# again and ends for good
state=""
for _ in $(seq 240); do
    state=$(squeue -h -j "$job" -o %T 2>/dev/null)
    [ -z "$state" ] && { state=$(scontrol show job "$job" 2>/dev/null | sed -nE 's/.*JobState=([A-Z_]+).*/\1/p'); }
    case $state in COMPLETED | FAILED | CANCELLED* | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) break ;; esac
    sleep 1
done
restarts=$(scontrol show job "$job" 2>/dev/null | sed -nE 's/.*Restarts=([0-9]+).*/\1/p')
if [ "$state" != COMPLETED ]; then
    bad "job $job ended $state (want COMPLETED after a requeue)"; sed 's/^/    /' "$work/job.out"
fi
[ "$restarts" = 1 ] && grep -q "requeueing job $job" "$work/job.out" &&
    ok "job $job was warned, saved, requeued itself once and completed" ||
    bad "job $job: Restarts=$restarts; the script said: $(grep -c requeueing "$work/job.out") requeue lines"
# every rank stopped after the same step K (3, or 2 when the warning came before step 2's agreement)
agreed=$(cat "$logs"/rank-*.jsonl | grep '"type":"preempted"' | sed -E 's/.*"step":([0-9]+).*/\1/' | sort | uniq -c |
    awk '{print $1 ":" $2}' | tr '\n' ' ')
k=${agreed#4:}
k=${k% }
[ "$agreed" = "4:$k " ] && grep -q "\"type\":\"restore\".*\"step\":$k" "$logs/rank-0.jsonl" &&
    ok "the 4 ranks agreed on step $k, saved it, and the requeued job restored it" ||
    bad "preempted records (count:step) '$agreed' (want 4 at one step); restore: $(grep '"type":"restore"' "$logs/rank-0.jsonl" | tail -1)"
steps_of "$logs/rank-0.jsonl" >"$work/losses-job"
if [ "$(awk '{print $1}' "$work/losses-job" | tr '\n' ' ')" = "1 2 3 4 5 6 7 8 " ] && cmp -s "$work/losses-job" "$work/losses-ref"; then
    ok "steps 1-$k then $((k + 1))-8 over the two runs, every loss and gradient norm bit for bit those of the uninterrupted run"
else
    bad "the job's steps differ from the uninterrupted run's:"; paste "$work/losses-ref" "$work/losses-job" | sed 's/^/    /'
fi
echo "save before the time limit under Slurm: $passes passed, $fails failed"
[ "$fails" = 0 ]
