#!/bin/sh
# tests/ckpt/test-save-dist.sh - a Hugging Face checkpoint saved from a model sharded over tp
# and pp (am_model_save_hf_dist, run by tests/ckpt/save_dist_check under the standalone
# launcher) equals one rank's save of the same model bit for bit and loads back into the
# shards, for tp x pp in 2x1, 1x2, 2x2, 4x1, 1x4, 4x2 and an interleaved 2x2 with two stages
# per pp rank, an untied Llama and a tied Qwen2 (q, k, v biases split with their rows). Then the test of the test: one rank changes an element of its
# shard before saving, and the check must fail. Fails, never skips.
set -u
B=${AM_BUILDDIR:-$(pwd)}
S=${AM_SRCDIR:-$(dirname "$0")/../..}
recipe=$S/sbatch-templates/recipes/tiny.yaml
work=$(mktemp -d "${TMPDIR:-/tmp}/am-test-save-dist.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
export AM_LOG_DIR="$work/am-logs" AM_COMM_TIMEOUT="${AM_COMM_TIMEOUT:-30}" OMP_NUM_THREADS=1
failed=0
case=0

launch() { # TP PP VIRTUAL [VAR=VALUE...]: runs the check on TP*PP ranks in a fresh directory
  tp=$1 pp=$2 v=$3
  shift 3
  case=$((case + 1))
  mkdir "$work/$case"
  env "$@" timeout 120 "$B/am-launch" --nproc $((tp * pp)) "$recipe" -- "$B/tests/ckpt/save_dist_check" \
    "$tp" "$pp" "$v" "$work/$case" >"$work/out" 2>&1
}

for layout in "2 1 1" "1 2 1" "2 2 1" "4 1 1" "1 4 1" "4 2 1" "2 2 2"; do
  set -- $layout
  n=$(($1 * $2))
  start=$(date +%s)
  if launch "$1" "$2" "$3" && [ "$(grep -c 'checks passed' "$work/out")" -eq "$n" ]; then
    echo "ok - tp $1 x pp $2, $3 stage(s) per pp rank ($(( $(date +%s) - start )) s)"
  else
    echo "not ok - tp $1 x pp $2, $3 stage(s) per pp rank"
    sed 's/^/#   /' "$work/out" | tail -n 30
    failed=1
  fi
done

if launch 2 2 1 SAVE_DIST_PERTURB=1; then
  echo "not ok - a changed element went unnoticed"; failed=1
elif grep -q 'differs from one rank.s save' "$work/out"; then
  echo "ok - a changed element is caught"
else
  echo "not ok - the perturbed run failed for another reason"
  sed 's/^/#   /' "$work/out" | tail -n 30
  failed=1
fi
exit $failed
