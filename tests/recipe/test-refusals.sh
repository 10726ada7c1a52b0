#!/bin/bash
# One validation: every refusal of am_validate_run (runtime/recipe/validate.c, run_rules[]) is
# printed, with the same position and the same words, by am-plan and by am-train at its start
# (standalone, through am-launch); tests/slurm/test-spank.sh checks sbatch against the same rows.
# The rows, a recipe and the exact message for each rule, are tests/recipe/refusals.tsv; a rule
# without a row fails here.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
rows=$AM_SRCDIR/tests/recipe/refusals.tsv
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0 passes=0
ok() { echo "ok: $1"; passes=$((passes + 1)); }
bad() { echo "FAIL: $1"; fails=$((fails + 1)); }

# every rule of the code has a row, and every row names a rule of the code
sed -n '/^} run_rules\[\] = {/,/^};/p' "$AM_SRCDIR/runtime/recipe/validate.c" | grep -o '{"[a-z0-9-]*"' |
    tr -d '{"' | sort -u >"$work/code"
grep -v '^#' "$rows" | cut -f1 | sort -u >"$work/rows"
if [ -s "$work/code" ] && diff "$work/code" "$work/rows" >"$work/diff"; then
    ok "every rule of run_rules[] has a row in refusals.tsv ($(wc -l <"$work/code") rules)"
else
    bad "run_rules[] and refusals.tsv differ (< code only, > rows only):"
    sed 's/^/    /' "$work/diff"
fi

i=0
while IFS=$'\t' read -r rule base edits message; do
    case $rule in '#'* | '') continue ;; esac
    i=$((i + 1))
    recipe=$work/$i-$rule.yaml
    sed -e "$edits" "$AM_SRCDIR/sbatch-templates/recipes/$base.yaml" >"$recipe"
    if cmp -s "$recipe" "$AM_SRCDIR/sbatch-templates/recipes/$base.yaml"; then
        bad "$rule (row $i): the edits changed nothing in $base.yaml"
        continue
    fi
    "$AM_BUILDDIR/am-plan" "$recipe" --nodes 1 --gpus-per-node 8 >"$work/plan.out" 2>&1
    plan_rc=$?
    (cd "$work" && AM_LOG_DIR="$work/logs-$i" timeout 120 "$AM_BUILDDIR/am-launch" --nproc 1 "$recipe") \
        >"$work/train.out" 2>&1
    train_rc=$?
    plan=$(grep -F -- "error: $recipe" "$work/plan.out" | sed 's/^error: //' | grep -F -- ": $message")
    train=$(grep -F -- "am-train: error: $recipe" "$work/train.out" | sed 's/^.*am-train: error: //' |
        grep -F -- ": $message")
    # exactly one line each: FILE[:LINE:COL]: MESSAGE
    at='' said=''
    [[ ${plan#"$recipe"} =~ ^(:[0-9]+:[0-9]+)?:\ (.*)$ ]] && at=${BASH_REMATCH[1]} said=${BASH_REMATCH[2]}
    if [ "$plan_rc" -ne 1 ] || [ "$said" != "$message" ]; then
        bad "$rule (row $i): am-plan (exit $plan_rc) did not print: $message"
        sed 's/^/    /' "$work/plan.out"
    elif [ "$train_rc" -eq 0 ] || [ "$train" != "$plan" ]; then
        bad "$rule (row $i): am-train (exit $train_rc) did not print am-plan's line: $plan"
        sed 's/^/    /' "$work/train.out"
    else
        ok "$rule (row $i): am-plan and am-train at ${at:-the file}: $message"
    fi
done <"$rows"
[ "$i" -gt 0 ] || bad "no rows in $rows"
echo "refusals: $passes passed, $fails failed"
[ "$fails" = 0 ]
