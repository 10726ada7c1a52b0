#!/bin/bash
# LoRA on DeepSeek-V3 (deepseek_v3: multi-head latent attention's q_a_proj, q_b_proj,
# kv_a_proj_with_mqa, kv_b_proj and o_proj, with glm4_moe's MoE): test-lora-glm.sh's checks
# (its header) on that model, against the peft golden deepseek_v3_lora.
LORA_ARCH=deepseek_v3 exec bash "$(dirname "$0")/test-lora-glm.sh" "$@"
