#!/bin/bash
# Hugging Face golden models trained at tp 2 x pp 2: tests/train/golden_dist on 4 ranks
# started by am-launch (AM_TP=2 AM_PP=2) loads a case of tests/golden/models into its shard,
# trains it 5 steps on the golden batch as am-train does, and compares every step's loss
# (1e-5 absolute) and grad norm (1e-5 relative) with what transformers computed: AdamW
# (lr 1e-2, betas 0.9/0.95, eps 1e-8, weight decay 0.1) without clipping, then from a fresh
# load with the global grad norm clipped to 1.0.
#   llama_tp   (4 layers, 4 heads / 2 kv heads): 1f1b; interleaved1f1b with 2 virtual stages
#              per pp rank (4 stages of one layer); 1f1b with sequence parallelism;
#   llama_tied (2 layers, MHA, the tied embedding on the first stage and the head's copy on the
#              last): 1f1b; 1f1b with sequence parallelism. Interleaving needs 4 layers: none.
#   qwen3_tiny (2 layers, 4 heads / 2 kv heads of 32, per-head q/k norms replicated on both tp
#              ranks, tied): 1f1b; 1f1b with sequence parallelism;
#   mistral_window (2 layers, 4 heads / 2 kv heads, sliding window 7 on 32 tokens): 1f1b; 1f1b
#              with sequence parallelism.
#   qwen2_tiny (2 layers, 4 heads / 2 kv heads, q, k, v biases split over tp with their rows):
#              1f1b; 1f1b with sequence parallelism;
#   qwen2_window (2 layers, MHA, biases, tied, sliding window 7 on layer 1 of 32 tokens): 1f1b;
#              1f1b with sequence parallelism;
#   gemma2_tiny (2 layers, 4 heads / 2 kv heads, soft-capped attention and logits, post norms of
#              the reduced row-parallel outputs, tied): 1f1b; 1f1b with sequence parallelism.
# Then the test of the test: the same run with lr 1.1e-2 in the recipe must fail.
# The measured worst differences are printed per run.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
unset AM_RECIPE AM_EP AM_CP AM_DRY_RUN AM_FAULT PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d "${TMPDIR:-/tmp}/am-test-golden-dist.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
export AM_LOG_DIR="$work/logs" OMP_NUM_THREADS=1
fails=0 passes=0

# tokens per golden row (golden_dist refuses a recipe that does not match)
seq_of() { case $1 in mistral_window | qwen2_window) echo 32 ;; *) echo 16 ;; esac; }

recipe() { # CASE SCHEDULE SP LR: the recipe of a golden run, to stdout
    cat <<EOF
model:
  pretrained_model_name_or_path: $AM_SRCDIR/tests/golden/models/$1
distributed:
  strategy: fsdp2
  tp_size: 1                 # AM_TP and AM_PP give the layout
  pp_size: 1
  sequence_parallel: $3
  mp_policy:
    param_dtype: float32
  pipeline:
    pp_schedule: $2
    pp_microbatch_size: 1    # one golden row per micro-batch
step_scheduler:
  global_batch_size: 2
  local_batch_size: 2
  max_steps: 5
dataset:
  seq_length: $(seq_of "$1")             # the golden rows; golden_dist ignores the last position's target
  paths: golden-rows        # a prefix am-train would read; golden_dist feeds the golden rows instead
optimizer:
  _target_: torch.optim.AdamW
  lr: $4
  betas: [0.9, 0.95]
  eps: 1.0e-8
  weight_decay: 0.1
lr_scheduler:
  lr_decay_style: constant
  lr_warmup_steps: 0
clip_grad_norm:
  max_norm: 1.0              # the clipped series; golden_dist runs the other without clipping
dist_env:
  timeout_minutes: 1
EOF
}

launch() { # NAME CASE SCHEDULE SP LR: golden_dist on 4 ranks, its output in out-NAME
    recipe "$2" "$3" "$4" "$5" >"$work/$1.yaml"
    (cd "$work" && AM_TP=2 AM_PP=2 timeout 300 "$AM_BUILDDIR/am-launch" --nproc 4 "$work/$1.yaml" -- \
        "$AM_BUILDDIR/tests/train/golden_dist" "$2" >"$work/out-$1" 2>&1)
}

for run in "llama_tp 1f1b false" "llama_tp interleaved1f1b false" "llama_tp 1f1b true" \
    "llama_tied 1f1b false" "llama_tied 1f1b true" "qwen3_tiny 1f1b false" "qwen3_tiny 1f1b true" \
    "mistral_window 1f1b false" "mistral_window 1f1b true" "qwen2_tiny 1f1b false" "qwen2_tiny 1f1b true" \
    "qwen2_window 1f1b false" "qwen2_window 1f1b true" "gemma2_tiny 1f1b false" "gemma2_tiny 1f1b true"; do
    set -- $run
    name="$1-$2-sp$3"
    start=$(date +%s)
    if launch "$name" "$1" "$2" "$3" 1.0e-2 && grep -q "^golden tp2 pp2 $1: 20 checks passed" "$work/out-$name"; then
        echo "ok: $1, $2, sequence parallel $3: $(grep '^golden tp2 pp2 .*checks passed' "$work/out-$name" |
            sed 's/.*passed (//; s/)$//') ($(($(date +%s) - start)) s)"
        passes=$((passes + 1))
    else
        echo "FAIL: $1, $2, sequence parallel $3"
        sed 's/^/    /' "$work/out-$name"
        fails=$((fails + 1))
    fi
done

# the test of the test: a learning rate 10% off moves the losses from step 2 on
if launch perturbed llama_tp 1f1b false 1.1e-2; then
    echo "FAIL: lr 1.1e-2 instead of 1e-2 went unnoticed"; sed 's/^/    /' "$work/out-perturbed"
    fails=$((fails + 1))
elif grep -q '^adamw step 2: loss .*MISMATCH' "$work/out-perturbed" &&
    grep -q '^golden tp2 pp2 llama_tp: .* checks FAILED' "$work/out-perturbed"; then
    echo "ok: lr 1.1e-2 instead of 1e-2 is caught: $(grep '^adamw step 2: loss' "$work/out-perturbed")"
    passes=$((passes + 1))
else
    echo "FAIL: the perturbed run failed for another reason"; sed 's/^/    /' "$work/out-perturbed"
    fails=$((fails + 1))
fi
echo "golden tp2 pp2: $passes passed, $fails failed"
[ "$fails" = 0 ]
