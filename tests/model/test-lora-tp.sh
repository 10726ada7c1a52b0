#!/bin/sh
# tests/model/test-lora-tp.sh - LoRA adapters split over tp = 2 ranks (tests/model/lora_tp_check
# under the standalone launcher) against the peft library's golden: llama_lora_qv (q, v) and
# llama_lora_all (all seven projections, and with sequence parallelism: sp), llama_lora_head
# (q, v and lm_head: B split with the vocabulary, A's gradient summed over tp; and sp),
# gemma2_lora_head (the same with a tied, soft-capped head); then the test of
# the test: without the completion of the partial gradients over tp (LORA_TP_PERTURB=1) the
# check must fail. Fails, never skips.
set -u
B=${AM_BUILDDIR:-$(pwd)}
S=${AM_SRCDIR:-$(dirname "$0")/../..}
export AM_SRCDIR=$S
recipe=$S/sbatch-templates/recipes/tiny.yaml
work=$(mktemp -d "${TMPDIR:-/tmp}/am-test-lora-tp.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
export AM_LOG_DIR="$work/am-logs" AM_COMM_TIMEOUT="${AM_COMM_TIMEOUT:-30}" OMP_NUM_THREADS=1
failed=0
for c in "llama_lora_qv qv" "llama_lora_all all" "llama_lora_all all sp" "llama_lora_head head" "llama_lora_head head sp" \
    "gemma2_lora_head head"; do
  set -- $c
  if timeout 120 "$B/am-launch" --nproc 2 "$recipe" -- "$B/tests/model/lora_tp_check" "$@" >"$work/out" 2>&1 &&
     [ "$(grep -c 'checks passed' "$work/out")" -eq 2 ]; then
    echo "ok - $* over tp 2"
  else
    echo "not ok - $* over tp 2"
    sed 's/^/#   /' "$work/out" | tail -n 20
    failed=1
  fi
done
if LORA_TP_PERTURB=1 timeout 120 "$B/am-launch" --nproc 2 "$recipe" -- "$B/tests/model/lora_tp_check" llama_lora_all all \
     >"$work/out" 2>&1; then
  echo "not ok - the partial gradients left unsummed went unnoticed"
  failed=1
elif grep -q 'checks FAILED' "$work/out"; then
  echo "ok - the partial gradients left unsummed are caught"
else
  echo "not ok - the perturbed run failed otherwise"
  sed 's/^/#   /' "$work/out" | tail -n 20
  failed=1
fi
exit $failed
