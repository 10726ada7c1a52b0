#!/bin/bash
# LoRA against the peft library: tests/train/golden_dist (a rank program that trains as am-train
# does) on the LoRA goldens (tests/golden/models/llama_lora_qv: adapters on q and v;
# llama_lora_all: on all seven projections; llama_lora_head: on q, v and lm_head (the adapter on
# the last stage, B split over tp with the vocabulary); peft on transformers, tests/golden/README.md). The
# recipe's peft section gives the adapters (r 4, alpha 8) as am-train reads it; golden_dist loads
# the base and peft's initial adapters, steps the adapters alone with the golden's AdamW (lr 1e-2,
# betas 0.9/0.95, eps 1e-8, weight decay 0.1, no clipping) for 5 steps on the golden batch, and
# compares each loss with peft's (1e-5 absolute) and the final adapters (5e-5 absolute, each
# rank its own slices). Layouts: one rank; tp 2 x pp 2 (1f1b); tp 2 x pp 2 with sequence
# parallelism. Then the test of the test: lr 1.1e-2 must fail from step 2 on.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_DRY_RUN AM_FAULT PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d "${TMPDIR:-/tmp}/am-test-lora-golden.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
export AM_LOG_DIR="$work/logs" OMP_NUM_THREADS=1
fails=0 passes=0

targets_of() {
    case $1 in
    llama_lora_qv) echo "['*.q_proj', '*.v_proj']" ;;
    llama_lora_head) echo "['*.q_proj', '*.v_proj', 'lm_head']" ;;
    *) echo "['*_proj']" ;;
    esac
}

recipe() { # CASE SP LR: the recipe of a golden run, to stdout
    cat <<EOF
model:
  pretrained_model_name_or_path: $AM_SRCDIR/tests/golden/models/$1/base
distributed:
  strategy: fsdp2
  tp_size: 1                 # AM_TP and AM_PP give the layout
  pp_size: 1
  sequence_parallel: $2
  mp_policy:
    param_dtype: float32
  pipeline:
    pp_schedule: 1f1b
    pp_microbatch_size: 1    # one golden row per micro-batch
step_scheduler:
  global_batch_size: 2
  local_batch_size: 2
  max_steps: 5
dataset:
  seq_length: 16             # the golden rows; golden_dist ignores the last position's target
  paths: golden-rows        # a prefix am-train would read; golden_dist feeds the golden rows instead
optimizer:
  _target_: torch.optim.AdamW
  lr: $3
  betas: [0.9, 0.95]
  eps: 1.0e-8
  weight_decay: 0.1
lr_scheduler:
  lr_decay_style: constant
  lr_warmup_steps: 0
clip_grad_norm:
  max_norm: null
peft:
  _target_: nemo_automodel.components._peft.lora.PeftConfig
  target_modules: $(targets_of "$1")
  dim: 4
  alpha: 8
  dropout: 0.0
  lora_A_init: kaiming
dist_env:
  timeout_minutes: 1
EOF
}

launch() { # NAME CASE TP PP SP LR: golden_dist on TP x PP ranks, its output in out-NAME
    recipe "$2" "$5" "$6" >"$work/$1.yaml"
    (cd "$work" && AM_TP=$3 AM_PP=$4 timeout 300 "$AM_BUILDDIR/am-launch" --nproc $(($3 * $4)) "$work/$1.yaml" -- \
        "$AM_BUILDDIR/tests/train/golden_dist" "$2" >"$work/out-$1" 2>&1)
}

for run in "llama_lora_qv 1 1 false" "llama_lora_qv 2 2 false" "llama_lora_qv 2 2 true" \
    "llama_lora_all 1 1 false" "llama_lora_all 2 2 false" "llama_lora_all 2 2 true" \
    "llama_lora_head 1 1 false" "llama_lora_head 2 2 false" "llama_lora_head 2 2 true"; do
    set -- $run
    name="$1-tp$2-pp$3-sp$4"
    # 5 losses, and the final adapters: 4 tensors per adapted projection and layer (A, B) on rank 0
    if launch "$name" "$1" "$2" "$3" "$4" 1.0e-2 && grep -q "^golden tp$2 pp$3 $1: [0-9]* checks passed" "$work/out-$name" &&
        [ "$(grep -c '^adamw step [1-5]: loss ' "$work/out-$name")" = 5 ] && grep -q '^final adapters: ' "$work/out-$name"; then
        echo "ok: $name: $(grep '^golden .*checks passed' "$work/out-$name" | sed 's/.*passed (//; s/)$//'); $(grep '^final adapters' "$work/out-$name")"
        passes=$((passes + 1))
    else
        echo "FAIL: $name"
        sed 's/^/    /' "$work/out-$name"
        fails=$((fails + 1))
    fi
done

# the test of the test: a learning rate 10% off moves the losses from step 2 on
if launch perturbed llama_lora_qv 1 1 false 1.1e-2; then
    echo "FAIL: lr 1.1e-2 instead of 1e-2 went unnoticed"; sed 's/^/    /' "$work/out-perturbed"
    fails=$((fails + 1))
elif grep -q '^adamw step 2: loss .*MISMATCH' "$work/out-perturbed" &&
    grep -q '^golden tp1 pp1 llama_lora_qv: .* checks FAILED' "$work/out-perturbed"; then
    echo "ok: lr 1.1e-2 instead of 1e-2 is caught: $(grep '^adamw step 2: loss' "$work/out-perturbed")"
    passes=$((passes + 1))
else
    echo "FAIL: the perturbed run failed for another reason"; sed 's/^/    /' "$work/out-perturbed"
    fails=$((fails + 1))
fi
echo "lora golden: $passes passed, $fails failed"
[ "$fails" = 0 ]
