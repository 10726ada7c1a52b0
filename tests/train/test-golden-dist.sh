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
# The measured worst differences are printed per run. The runs and their checks: lora_golden
# (lora-lib.sh; the goldens' 20 checks each).
set -u
. "$(dirname "$0")/lora-lib.sh"

# tokens per golden row (golden_dist refuses a recipe that does not match)
seq_of() { case $1 in mistral_window | qwen2_window) echo 32 ;; *) echo 16 ;; esac; }

for run in "llama_tp 1f1b false" "llama_tp interleaved1f1b false" "llama_tp 1f1b true" \
    "llama_tied 1f1b false" "llama_tied 1f1b true" "qwen3_tiny 1f1b false" "qwen3_tiny 1f1b true" \
    "mistral_window 1f1b false" "mistral_window 1f1b true" "qwen2_tiny 1f1b false" "qwen2_tiny 1f1b true" \
    "qwen2_window 1f1b false" "qwen2_window 1f1b true" "gemma2_tiny 1f1b false" "gemma2_tiny 1f1b true"; do
    set -- $run
    lora_golden -s "$2" $([ "$3" = true ] && echo -q) -n "$(seq_of "$1")" "$1" '' 2 2
done

# the test of the test: a learning rate 10% off moves the losses from step 2 on
lora_golden -p llama_tp '' 2 2
echo "golden tp2 pp2: $passes passed, $fails failed"
[ "$fails" = 0 ]
