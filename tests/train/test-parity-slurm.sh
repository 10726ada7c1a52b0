#!/bin/bash
# Layout parity under Slurm: `sbatch --am-recipe=... [--am-tp=2 --am-pp=2]` through the SPANK
# plugin, with `srun --mpi=pmix am-launch` over 2 and 4 nodes of the local cluster, trains the
# same loss trajectory as one rank standalone with the whole global batch, and saves the same
# checkpoint (tolerances as in test-parity.sh: 1e-5 on losses, 1e-5 relative on gradient
# norms, 5e-5 on weights). The subset: data parallel over 2 and 4 nodes; tp 2 x pp 2 over 2
# nodes (1f1b); tp 2 x pp 2 x dp 2 over 4 nodes (interleaved1f1b, sequence parallel). The
# tiny recipe's strategy is fsdp2, so data parallelism shards (each rank's memory record says
# "sharded":true): over 4 nodes with dp_shard 4, and as HSDP (2 replicas of 2 shards). A
# mixture of experts (Mixtral's layers: 4 experts, top 2) with `--am-ep=2` over 4 nodes (dp 4:
# two ep groups of 2 ranks, tokens dispatched between nodes with all-to-all-v, the experts
# sharded over the 2 ranks holding the same ones) against its own one rank. Context
# parallelism: `--am-cp=2 --am-tp=2` over 2 nodes of 2 tasks (the tp pairs inside a node, the
# cp ring between the nodes, each sequence of 64 in 4 chunks of 16). Two combinations: that
# layout in bf16 (ring attention's bf16 blocks between the nodes) against one rank in bf16,
# within twice one rank's bf16-vs-fp32 distance (test-parity.sh's rule); and the mixture of
# experts at ep 2 under HSDP over 4 nodes (2 replicas of 2 shards, the experts sharded over
# ep_shard across the replicas). Fails, never skips, when
# the cluster cannot start. AM_PARITY_SLURM_ONLY="NAME NODES TASKS RECIPE [OPTIONS];..." runs
# only those jobs.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d /tmp/am-parity-XXXXXX)
chmod 755 "$work"
export AM_CLUSTER_DIR=$work/cluster
cluster() { "$AM_SRCDIR/tests/slurm/cluster" "$@"; }
trap 'cluster down --purge >/dev/null 2>&1; rm -rf "$work"' EXIT
fails=0 passes=0

# a corpus that does not change with the sources (Debian's license texts, as README's demo)
"$AM_BUILDDIR/am-data" build --bytes --out "$work/corpus" /usr/share/common-licenses/* >/dev/null || exit 1
sed -e "s|paths: .*|paths: $work/corpus|" -e 's/max_steps: .*/max_steps: 8/' -e 's/enabled: false/enabled: true/' \
    -e "s|checkpoint_dir: .*|checkpoint_dir: ckpt|" "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$work/tiny.yaml"
sed -e 's/sequence_parallel: false/sequence_parallel: true/' -e 's/pp_schedule: .*/pp_schedule: interleaved1f1b/' \
    "$work/tiny.yaml" >"$work/tiny-sp-il.yaml"
sed -e 's/  dp_size: none.*/  dp_size: none\n  dp_replicate_size: 2/' "$work/tiny.yaml" >"$work/tiny-hsdp.yaml"
sed -e 's/model_type: llama/model_type: mixtral\n  num_local_experts: 4\n  num_experts_per_tok: 2/' "$work/tiny.yaml" \
    >"$work/tiny-moe.yaml"
sed -e 's/  dp_size: none.*/  dp_size: none\n  dp_replicate_size: 2/' "$work/tiny-moe.yaml" >"$work/tiny-moe-hsdp.yaml"
sed -e 's/param_dtype: float32.*/param_dtype: bfloat16/' "$work/tiny.yaml" >"$work/tiny-bf16.yaml"

losses() { grep -h '"type":"step"' "$1"/*/rank-0.jsonl | sed -E 's/.*"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2/'; }
compare() { # NAME FILE REF [LOSS_TOL NORM_TOL]
    if paste "$3" "$2" | awk -v lt="${4:-1e-5}" -v nt="${5:-1e-5}" '
        { d = $1 - $3; if (d < 0) d = -d; if (d > worst) worst = d
          g = ($2 - $4) / $2; if (g < 0) g = -g; if (g > gworst) gworst = g; n++ }
        END { printf "%d steps, largest loss difference %.2g, grad norm %.2g relative\n", n, worst, gworst
              exit !(n == 8 && worst <= lt && gworst <= nt) }' >"$work/cmp"; then
        echo "ok: $1 matches 1 rank: $(cat "$work/cmp")"; passes=$((passes + 1))
    else
        echo "FAIL: $1 differs from 1 rank: $(cat "$work/cmp")"; paste "$3" "$2" | sed 's/^/    /'
        fails=$((fails + 1))
    fi
}
ref_run() { # NAME RECIPE: one rank standalone in $work/run-NAME, its losses in $work/ref${NAME#1}
    mkdir -p "$work/run-$1"
    (cd "$work/run-$1" && AM_LOG_DIR="$work/logs-$1" "$AM_BUILDDIR/am-launch" --nproc 1 "$work/$2" >"$work/out-$1" 2>&1) ||
        { echo "FAIL: 1 rank ($2) did not train"; cat "$work/out-$1"; exit 1; }
    losses "$work/logs-$1" >"$work/ref${1#1}"
}

ref_run 1 tiny.yaml
ref_run 1-moe tiny-moe.yaml
ref_run 1-bf16 tiny-bf16.yaml
# bf16 tolerances: twice one rank's bf16-vs-fp32 distance (loss, grad norm relative, weights)
read -r bf16_lt bf16_nt <<<"$(paste "$work/ref" "$work/ref-bf16" | awk '
    { d = $1 - $3; if (d < 0) d = -d; if (d > l) l = d; g = ($2 - $4) / $2; if (g < 0) g = -g; if (g > n) n = g }
    END { printf "%.3g %.3g", 2 * l, 2 * n }')"
"$AM_BUILDDIR/tests/train/ckpt_diff" "$work/run-1/ckpt/step-8/hf" "$work/run-1-bf16/ckpt/step-8/hf" 1e9 >"$work/wdiff-bf16" 2>&1
bf16_wt=$(sed -nE 's/.*largest difference ([^ ]*) .*/\1/p' "$work/wdiff-bf16" | awk '{ printf "%.3g", 2 * $1 }')
if ! awk -v t="$bf16_lt" 'BEGIN { exit !(t > 1e-4) }'; then
    echo "FAIL: one rank's bf16 run is not different from fp32 (loss tolerance $bf16_lt): is bf16 used?"; exit 1
fi
echo "bf16 jobs' tolerances (twice one rank's bf16-vs-fp32 distance): loss $bf16_lt, grad norm $bf16_nt, weights $bf16_wt"

if ! AM_SPANK_PLUGIN=$AM_BUILDDIR/.libs/spank_am.so cluster up; then
    echo "FAIL: the local Slurm cluster did not start (see above); nothing was tested"
    exit 1
fi
eval "$(cluster env)"
cat >"$work/job.sh" <<JOB
#!/bin/bash
srun --mpi=pmix "$AM_BUILDDIR/am-launch"
JOB
# NAME NODES TASKS-PER-NODE RECIPE [PLUGIN OPTIONS]
jobs=("dp2 2 1 tiny.yaml" "dp4 4 1 tiny.yaml" "tp2-pp2 2 2 tiny.yaml --am-tp=2 --am-pp=2"
    "tp2-pp2-dp2-sp-il 4 2 tiny-sp-il.yaml --am-tp=2 --am-pp=2" "hsdp-dp4 4 1 tiny-hsdp.yaml"
    "moe-ep2-dp4 4 1 tiny-moe.yaml --am-ep=2" "cp2-tp2 2 2 tiny.yaml --am-cp=2 --am-tp=2"
    "cp2-tp2-bf16 2 2 tiny-bf16.yaml --am-cp=2 --am-tp=2" "moe-ep2-hsdp 4 1 tiny-moe-hsdp.yaml --am-ep=2")
[ -n "${AM_PARITY_SLURM_ONLY:-}" ] && IFS=';' read -ra jobs <<<"$AM_PARITY_SLURM_ONLY"
for job in "${jobs[@]}"; do
    set -- $job
    name=$1 nodes=$2 per=$3 recipe=$4
    shift 4
    ref=1 lt=1e-5 nt=1e-5 wt=5e-5
    case $recipe in
        tiny-moe*) ref=1-moe ;;
        tiny-bf16.yaml) ref=1-bf16 lt=$bf16_lt nt=$bf16_nt wt=$bf16_wt ;;
    esac
    mkdir -p "$work/run-$name"
    chmod 777 "$work/run-$name"
    (cd "$work/run-$name" && timeout 120 sbatch --wait -N "$nodes" --ntasks-per-node="$per" -o "$work/job-$name.out" \
        --am-recipe="$work/$recipe" "$@" --am-log-dir="$work/logs-$name" "$work/job.sh" >/dev/null)
    rc=$?
    if [ "$rc" != 0 ]; then
        echo "FAIL: sbatch $name exited $rc"; sed 's/^/    /' "$work/job-$name.out"; fails=$((fails + 1)); continue
    fi
    losses "$work/logs-$name" >"$work/got-$name"
    compare "sbatch $name ($nodes nodes x $per tasks $*)" "$work/got-$name" "$work/ref${ref#1}" "$lt" "$nt"
    if [ "$name" = dp4 ] || [ "$name" = hsdp-dp4 ] || [ "$name" = moe-ep2-hsdp ]; then
        n=$(grep -h '"type":"memory"' "$work/logs-$name"/*/rank-*.jsonl | grep -c '"sharded":true')
        if [ "$n" = 4 ]; then
            echo "ok: sbatch $name: the 4 ranks shard (fsdp2)"; passes=$((passes + 1))
        else
            echo "FAIL: sbatch $name: $n of 4 ranks' memory records say sharded"; fails=$((fails + 1))
        fi
    fi
    if [ "$name" = moe-ep2-dp4 ] || [ "$name" = moe-ep2-hsdp ]; then # the ep and expert-data-parallel groups rank 0 logged
        got=$(grep -h '"type":"groups"' "$work/logs-$name"/*/rank-0.jsonl | grep -o '"name":"ep[a-z_]*","gid":[0-9]*,"ranks":\[[0-9,]*\]' | sed -E 's/"name":"([a-z_]*)","gid":[0-9]*,"ranks":/\1 /' | tr '\n' ' ')
        if [ "$got" = "ep [0,1] ep_shard [0,2] " ]; then
            echo "ok: sbatch $name: rank 0's groups: $got"; passes=$((passes + 1))
        else
            echo "FAIL: sbatch $name: rank 0's ep groups are '$got', want 'ep [0,1] ep_shard [0,2] '"; fails=$((fails + 1))
        fi
    fi
    if "$AM_BUILDDIR/tests/train/ckpt_diff" "$work/run-$ref/ckpt/step-8/hf" "$work/run-$name/ckpt/step-8/hf" "$wt" \
        >"$work/wdiff" 2>&1; then
        echo "ok: sbatch $name saved the checkpoint of 1 rank: $(cat "$work/wdiff")"; passes=$((passes + 1))
    else
        echo "FAIL: sbatch $name's checkpoint differs from 1 rank's: $(cat "$work/wdiff")"; fails=$((fails + 1))
    fi
done
echo "parity under Slurm: $passes passed, $fails failed"
[ "$fails" = 0 ]
