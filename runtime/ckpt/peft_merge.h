/* peft_merge.h - LoRA adapters merged into their base model, offline, as a Hugging Face
 * directory (what peft's merge_and_unload() then save_pretrained() give for plain LoRA).
 *
 * am_peft_merge(BASE, PEFT, OUT) reads the base model directory (config.json and
 * model.safetensors, or its index and shards) and the adapters as the peft library saves them
 * (PEFT/adapter_config.json + PEFT/adapter_model.safetensors: an am step-N/peft directory or
 * one PeftModel.save_pretrained wrote), and writes OUT with:
 *   - every adapted weight W (the module M whose M.lora_A.weight A [r, in] and
 *     M.lora_B.weight B [out, r] the adapters hold) replaced by W + (lora_alpha / r) * B @ A,
 *     computed in double precision and rounded once to W's dtype (F32, BF16 or F16); r is
 *     adapter_config.json's, or rank_pattern's for a module one of its keys matches (peft's
 *     match: the first key that is the whole name or its end after a '.', read as a POSIX
 *     extended regular expression; AutoModel's moe_rank_scaling experts);
 *   - with adapter_config.json's target_parameters (peft's ParamWrapper), on a gpt_oss base: each
 *     adapted 3-D parameter W [E, in, out] (the module path M, with one ".base_layer" per wrapper
 *     inside the outermost, names the parameter: peft nests a module's target_parameters in
 *     sorted order, the first outermost; gpt_oss's experts: M = ...mlp.experts for down_proj,
 *     ...mlp.experts.base_layer for gate_up_proj) replaced by W_e + (lora_alpha / r) A_eᵀ B_eᵀ
 *     for each expert e, A [r E, in] holding expert e's rows at e r + k, B [out, r E] its
 *     columns at k E + e (peft's delta for a weight used as x @ W), rounded once as above;
 *   - every other tensor copied bit for bit, each in the same file as in BASE (the shards and
 *     model.safetensors.index.json keep their names);
 *   - config.json and the other top-level files of BASE (tokenizer files,
 *     generation_config.json, ...) copied as they are; weight files other than the
 *     safetensors (pytorch_model*.bin, ...) are not.
 * OUT is built in OUT.tmp-XXXXXX beside it, every file fsynced, then renamed to OUT: OUT never
 * holds half a model. OUT must not exist, or be an empty directory: it is never overwritten.
 *
 * Refused, with the file, the rule and what to do: a missing file; an adapter_config.json that
 * is not plain LoRA (peft_type other than LORA, use_dora, use_rslora, fan_in_fan_out,
 * lora_bias, alpha_pattern, modules_to_save; a rank_pattern key that is not a regular
 * expression); a tensor of the adapters that is not a LoRA A or B matrix; a module with A and
 * no B (or B and no A); a module the base lacks (lm_head's adapter on a base that ties the
 * head to the embedding has its own message: merged, it would change the input embedding
 * too); shapes that do not fit the base weight and the module's r; target_parameters on a base
 * other than gpt_oss (whose parameters' orientation am-ckpt does not know). lm_head's adapter on an
 * untied base is merged into lm_head.weight as any other.
 */
#ifndef AM_PEFT_MERGE_H
#define AM_PEFT_MERGE_H

#include <stddef.h>

#include "errors.h"
#include "progress.h"

/* Merges as above, showing the bytes written on bar (progress.h; bar->on says whether it
 * shows; NULL: none). Returns the number of weights merged (>= 1), or -1 with messages in err
 * (OUT then does not exist or is as it was). */
long am_peft_merge(const char *base_dir, const char *peft_dir, const char *out_dir, struct am_progress *bar,
                   struct am_errors *err);

#endif
