#!/bin/bash
# Data-parallel parity: N ranks with local batch b and gradient accumulation A/N train the
# same model on the same samples as 1 rank with accumulation A, so their loss trajectories
# (and gradient norms) must agree to fp32 rounding: the only difference is the order in
# which per-sample gradients are summed (one rank in sequence; N ranks, then an all-reduce),
# a relative difference of a few 1e-7 per step that Adam carries forward. Tolerance: 1e-5
# absolute on losses near 5, and 1e-5 relative on gradient norms, over 8 steps (measured:
# 2.6e-7 and 2.6e-8).
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0 passes=0

"$AM_BUILDDIR/am-data" build --bytes --out "$work/corpus" "$AM_SRCDIR"/runtime/*.c >/dev/null || exit 1
# the tiny recipe, made short: 8 steps of a global batch of 16 sequences of 64 tokens
sed -e "s|paths: .*|paths: $work/corpus|" -e 's/max_steps: .*/max_steps: 8/' \
    "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$work/tiny.yaml"

losses() { # LOGDIR: "loss grad_norm" per step of rank 0
    grep -h '"type":"step"' "$1"/*/rank-0.jsonl | sed -E 's/.*"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2/'
}

run() { # N
    (cd "$work" && AM_LOG_DIR="$work/logs-$1" "$AM_BUILDDIR/am-launch" --nproc "$1" "$work/tiny.yaml" \
        >"$work/out-$1" 2>&1)
}

run 1 || { echo "FAIL: 1 rank did not train"; cat "$work/out-1"; exit 1; }
losses "$work/logs-1" >"$work/ref"
[ "$(wc -l <"$work/ref")" = 8 ] || { echo "FAIL: 1 rank logged $(wc -l <"$work/ref") steps, want 8"; exit 1; }
for n in 2 4; do
    if ! run "$n"; then
        echo "FAIL: $n ranks did not train"; sed 's/^/    /' "$work/out-$n"; fails=$((fails + 1)); continue
    fi
    losses "$work/logs-$n" >"$work/got-$n"
    if paste "$work/ref" "$work/got-$n" | awk '
        { d = $1 - $3; if (d < 0) d = -d; if (d > worst) worst = d
          g = ($2 - $4) / $2; if (g < 0) g = -g; if (g > gworst) gworst = g; n++ }
        END { printf "%d steps, largest loss difference %.2g, grad norm %.2g relative\n", n, worst, gworst
              exit !(n == 8 && worst <= 1e-5 && gworst <= 1e-5) }' >"$work/cmp-$n"; then
        echo "ok: $n ranks match 1 rank: $(cat "$work/cmp-$n")"; passes=$((passes + 1))
    else
        echo "FAIL: $n ranks differ from 1 rank: $(cat "$work/cmp-$n")"
        paste "$work/ref" "$work/got-$n" | sed 's/^/    /'
        fails=$((fails + 1))
    fi
done
# the loss falls: the last step's loss is below the first's
first=$(head -n1 "$work/ref" | cut -d' ' -f1) last=$(tail -n1 "$work/ref" | cut -d' ' -f1)
if awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }'; then
    echo "ok: loss falls from $first to $last"; passes=$((passes + 1))
else
    echo "FAIL: loss did not fall: $first -> $last"; fails=$((fails + 1))
fi
echo "parity: $passes passed, $fails failed"
[ "$fails" = 0 ]
