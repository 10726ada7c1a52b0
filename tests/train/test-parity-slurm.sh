#!/bin/bash
# Data-parallel parity under Slurm: `sbatch --am-recipe=...` through the SPANK plugin, with
# `srun --mpi=pmix am-launch` over 2 and 4 nodes of the local cluster, trains the same loss
# trajectory as one rank standalone with the whole global batch (tolerance as in
# test-parity.sh: 1e-5 on losses, 1e-5 relative on gradient norms). Fails, never skips, when
# the cluster cannot start.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d /tmp/am-parity-XXXXXX)
chmod 755 "$work"
export AM_CLUSTER_DIR=$work/cluster
cluster() { "$AM_SRCDIR/tests/slurm/cluster" "$@"; }
trap 'cluster down --purge >/dev/null 2>&1; rm -rf "$work"' EXIT
fails=0 passes=0

"$AM_BUILDDIR/am-data" build --bytes --out "$work/corpus" "$AM_SRCDIR"/runtime/*.c >/dev/null || exit 1
sed -e "s|paths: .*|paths: $work/corpus|" -e 's/max_steps: .*/max_steps: 8/' \
    "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$work/tiny.yaml"

losses() { grep -h '"type":"step"' "$1"/*/rank-0.jsonl | sed -E 's/.*"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2/'; }
compare() { # NAME FILE
    if paste "$work/ref" "$2" | awk '
        { d = $1 - $3; if (d < 0) d = -d; if (d > worst) worst = d
          g = ($2 - $4) / $2; if (g < 0) g = -g; if (g > gworst) gworst = g; n++ }
        END { printf "%d steps, largest loss difference %.2g, grad norm %.2g relative\n", n, worst, gworst
              exit !(n == 8 && worst <= 1e-5 && gworst <= 1e-5) }' >"$work/cmp"; then
        echo "ok: $1 matches 1 rank: $(cat "$work/cmp")"; passes=$((passes + 1))
    else
        echo "FAIL: $1 differs from 1 rank: $(cat "$work/cmp")"; paste "$work/ref" "$2" | sed 's/^/    /'
        fails=$((fails + 1))
    fi
}

(cd "$work" && AM_LOG_DIR="$work/logs-1" "$AM_BUILDDIR/am-launch" --nproc 1 "$work/tiny.yaml" >"$work/out-1" 2>&1) ||
    { echo "FAIL: 1 rank did not train"; cat "$work/out-1"; exit 1; }
losses "$work/logs-1" >"$work/ref"

if ! AM_SPANK_PLUGIN=$AM_BUILDDIR/.libs/spank_am.so cluster up; then
    echo "FAIL: the local Slurm cluster did not start (see above); nothing was tested"
    exit 1
fi
eval "$(cluster env)"
cat >"$work/job.sh" <<JOB
#!/bin/bash
srun --mpi=pmix "$AM_BUILDDIR/am-launch"
JOB
for n in 2 4; do
    (cd "$work" && timeout 120 sbatch --wait -N "$n" --ntasks-per-node=1 -o "$work/job-$n.out" \
        --am-recipe="$work/tiny.yaml" --am-log-dir="$work/logs-slurm-$n" "$work/job.sh" >/dev/null)
    rc=$?
    if [ "$rc" != 0 ]; then
        echo "FAIL: sbatch over $n nodes exited $rc"; sed 's/^/    /' "$work/job-$n.out"; fails=$((fails + 1)); continue
    fi
    losses "$work/logs-slurm-$n" >"$work/got-$n"
    compare "sbatch over $n nodes" "$work/got-$n"
done
echo "parity under Slurm: $passes passed, $fails failed"
[ "$fails" = 0 ]
