/* peft.h - LoRA adapters saved as the peft library saves them (PeftModel.save_pretrained):
 * a directory with adapter_config.json and adapter_model.safetensors.
 *
 * The tensors are named "base_model.model." + the base layer's module path + ".lora_A.weight"
 * (A [r, in]) or ".lora_B.weight" (B [out, r]), e.g.
 * base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight (am_peft_tensor_name); the
 * adapters of a 3-D parameter (target_parameters) are its module's, with the expert count
 * folded into the rank (model_io.c: gpt_oss's experts).
 * adapter_config.json says peft_type LORA, r, lora_alpha, the target module names, the ranks of
 * modules whose adapters' rank is not r (rank_pattern), lora_dropout
 * (the training's; peft drops the adapters' input, AutoModel's "pre"),
 * bias "none", task CAUSAL_LM, and that the adapters are plain LoRA (no DoRA, no rsLoRA, not
 * fan_in_fan_out): what peft needs to rebuild the adapters on the base model and load them.
 */
#ifndef AM_PEFT_H
#define AM_PEFT_H

#include <stddef.h>

#include "errors.h"
#include "safetensors.h"

struct am_peft_config {
    long r;
    double alpha;
    const char *const *targets; /* module names ("q_proj", ...); none: target_modules null */
    size_t n_targets;
    /* target_parameters: 3-D parameters adapted through peft's ParamWrapper (gpt_oss's fused
     * experts, "mlp.experts.gate_up_proj"), written when n_params > 0 */
    const char *const *params;
    size_t n_params;
    const char *base_model; /* base_model_name_or_path; NULL: null */
    double dropout;         /* lora_dropout: the adapters' training dropout (0: none) */
    /* rank_pattern: the modules whose name matches the regular expression rank_key (as peft
     * matches it: the whole name, or its end after a '.') have adapters of rank rank_r
     * (AutoModel's moe_rank_scaling: the experts'); their scale is lora_alpha / rank_r, as
     * peft computes it. NULL: every adapter has rank r. */
    const char *rank_key;
    long rank_r;
};

/* buf = "base_model.model." + module + (b ? ".lora_B.weight" : ".lora_A.weight"); -1 when it
 * does not fit. */
int am_peft_tensor_name(char *buf, size_t len, const char *module, int b);

/* Writes dir/adapter_config.json and dir/adapter_model.safetensors (creating dir), each
 * atomically. The tensors are named as above by the caller. Returns 0, or -1 with a message
 * naming the file. */
int am_peft_save(const char *dir, const struct am_peft_config *cfg, const struct am_st_wtensor *t, size_t n,
                 struct am_errors *err);

#endif
