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
# parallelism. Then the test of the test: lr 1.1e-2 must fail from step 2 on. The runs and their
# checks: lora_golden (lora-lib.sh).
set -u
. "$(dirname "$0")/lora-lib.sh"

targets_of() {
    case $1 in
    llama_lora_qv) echo "['*.q_proj', '*.v_proj']" ;;
    llama_lora_head) echo "['*.q_proj', '*.v_proj', 'lm_head']" ;;
    *) echo "['*_proj']" ;;
    esac
}

for golden in llama_lora_qv llama_lora_all llama_lora_head; do
    lora_golden "$golden" "$(targets_of "$golden")" 1 1
    lora_golden "$golden" "$(targets_of "$golden")" 2 2
    lora_golden -q "$golden" "$(targets_of "$golden")" 2 2
done

# the test of the test: a learning rate 10% off moves the losses from step 2 on
lora_golden -p llama_lora_qv "$(targets_of llama_lora_qv)" 1 1
echo "lora golden: $passes passed, $fails failed"
[ "$fails" = 0 ]
