/* model_config.h - a model's architecture, in Hugging Face config.json terms.
 *
 * Where it comes from, in order (as transformers does with local_files_only):
 *   1. `model.pretrained_model_name_or_path` as a local directory holding config.json;
 *   2. a hub id (ORG/NAME) in the local Hugging Face cache: HF_HUB_CACHE, else
 *      HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub,
 *      at models--ORG--NAME/snapshots/<refs/main>/config.json;
 *   3. a config shipped with am for well-known models (AM_MODELS_DIR, else the installed
 *      share/am/models), so that planning needs no weights;
 * and finally keys written inline under `model:` (HF names) override what was loaded, as
 * from_pretrained's keyword arguments do.
 */
#ifndef AM_MODEL_CONFIG_H
#define AM_MODEL_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "arena.h"
#include "errors.h"
#include "node.h"

/* Layers whose attention type is tracked (a model with a sliding window has at most these). */
#define AM_MAX_WINDOW_LAYERS 1024

struct am_model_config {
    const char *model_type; /* llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, glm4_moe,
                               deepseek_v3, gpt_oss */
    long hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim;
    long intermediate_size, vocab_size, max_position_embeddings;
    double rope_theta, rms_norm_eps, initializer_range;
    bool tie_word_embeddings;
    bool qk_norm; /* qwen3: RMSNorm on each query and key head (before rope) */
    bool qkv_bias; /* qwen2: a bias on the q, k and v projections (Qwen2Attention's, always; none on o) */
    /* Sliding-window attention, as transformers resolves the config (Mistral's and Mixtral's
     * sliding_window on every layer; Qwen2's and Qwen3's when use_sliding_window, on the layers
     * layer_types marks sliding_attention, by default those from max_window_layers on): on
     * such a layer the query at position t sees the keys t - sliding_window < j <= t. 0: no
     * window on any layer. am_model_layer_window() gives a layer's. */
    long sliding_window;
    uint64_t window_layers[AM_MAX_WINDOW_LAYERS / 64]; /* bit l: layer l has the window */
    /* mixture of experts: num_experts 0 for a dense model */
    long num_experts, num_experts_per_tok, moe_intermediate_size;
    bool norm_topk_prob;
    double router_aux_loss_coef;
    bool output_router_logits; /* the load-balancing loss is added to the loss (transformers adds
                                  router_aux_loss_coef * aux only when this is set) */
    /* qwen3_moe: layer l has experts unless it is in mlp_only_layers or (l + 1) is not a
     * multiple of decoder_sparse_step; those layers have a dense MLP of intermediate_size.
     * Bit l set: layer l is dense. am_model_layer_is_moe() gives a layer's kind. */
    long decoder_sparse_step;
    uint64_t dense_layers[AM_MAX_WINDOW_LAYERS / 64];
    struct {
        const char *type; /* NULL: no scaling; "llama3", "linear", "yarn" */
        double factor, low_freq_factor, high_freq_factor;
        long original_max_position_embeddings;
        /* yarn (kernels.h, am_rope_scaling): 0 for a key absent or null; no_truncate: truncate false */
        double beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim;
        bool no_truncate;
    } rope_scaling;
    const char *torch_dtype; /* as written in config.json, or NULL */
    /* Gemma 2 and Gemma 3 (gemma2, gemma3_text), as transformers' Gemma2ForCausalLM and
     * Gemma3ForCausalLM compute them: the embedding scaled by sqrt(hidden_size), RMSNorm with
     * the weight 1 + w, a norm after attention and one before and after the MLP (four per
     * layer), GeGLU (gelu_pytorch_tanh), attention scaled by query_pre_attn_scalar ** -0.5,
     * attention logits capped to cap * tanh(s / cap), the final logits likewise; gemma3_text:
     * q/k norms (1 + w), and rope_local_base_freq as the rope theta of the sliding layers
     * (rope_theta and rope_scaling for the full ones). */
    bool gemma;
    double query_pre_attn_scalar;   /* > 0 for gemma */
    double attn_logit_softcapping;  /* 0: none */
    double final_logit_softcapping; /* 0: none */
    double rope_local_base_freq;    /* gemma3_text: the sliding layers' rope theta; 0: rope_theta */
    /* Partial rotary embedding (glm4_moe's partial_rotary_factor, default 0.5 there): rope on the
     * first rotary_dim = int(head_dim * partial_rotary_factor) dims of each head, the rest
     * passed through; its tables are those of a head of rotary_dim. rotary_dim = head_dim for
     * every other model. */
    double partial_rotary_factor;
    long rotary_dim;
    /* DeepSeekMoE (glm4_moe), as transformers' Glm4MoeTopkRouter and Glm4MoeMoE compute it: the
     * router's scores are sigmoid(logits) in fp32; the selection adds the per-expert
     * e_score_correction_bias (a buffer of the checkpoint: it chooses, never weights), keeps the
     * topk_group of n_group groups of experts whose two best biased scores sum highest, and the
     * num_experts_per_tok best biased scores among them; the weights are the chosen unbiased
     * scores, divided by their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor.
     * n_shared_experts: a dense MLP of n_shared_experts * moe_intermediate_size beside the routed
     * experts on every MoE layer (mlp.shared_experts). The first first_k_dense_replace layers
     * are dense MLPs of intermediate_size. No load-balancing loss (transformers computes none
     * for it; AutoModel's aux_loss_coeff is 0 there). */
    bool sigmoid_router;
    long n_group, topk_group, n_shared_experts, first_k_dense_replace;
    double routed_scaling_factor;
    /* AutoModel's own deepseek_v3 (MoEConfig's gate_bias_update_factor, its Gate.update_bias):
     * after every optimizer step each MoE layer's selection bias gets factor x sign(mean load -
     * load), the loads counted over the step and summed over dp x cp (docs/training.md). 0: the
     * bias stays as loaded (transformers' classes, glm4_moe). Set from model.moe_overrides or
     * model.moe_config (bias_update_set), else 1e-3 for a deepseek_v3 built as AutoModel's own
     * model (recipe.c). */
    double gate_bias_update_factor;
    bool bias_update_set;
    bool bias_forced; /* moe_overrides' force_e_score_correction_bias: AutoModel keeps the bias at factor 0 */
    /* AutoModel's own load-balancing loss (MoEConfig's aux_loss_coeff, its Gate._compute_aux_loss)
     * of the MoEs it builds its own gate for (deepseek_v3, glm4_moe, gpt_oss, qwen3_moe): per MoE
     * layer and micro-batch Σ_e f_e P_e, its gradient times aux_loss_coeff / (dp x micro-batches)
     * injected in the backward, never added to the loss (moe.h, docs/training.md). 0: none. Set
     * from model.moe_overrides or model.moe_config (aux_loss_set), else router_aux_loss_coef for a
     * gpt_oss or qwen3_moe built as AutoModel's own model (recipe.c). */
    double aux_loss_coeff;
    bool aux_loss_set;
    /* The model is AutoModel's own (NeMoAutoModelForCausalLM without force_hf) of one of those
     * types: it adds no transformers' loss whatever output_router_logits says (am_model_hf_aux). */
    bool automodel_gate;
    /* config.json's quantization_config of an FP8 checkpoint (quant_method fp8, fmt e4m3), whose
     * F8_E4M3 weights are dequantised at load (runtime/ckpt/quant.h): fp8_block is
     * weight_block_size, the rows and columns of one scale. false: not quantised. */
    bool fp8;
    long fp8_block[2];
    /* Multi-head latent attention (deepseek_v3: DeepSeek-V3, Moonlight, Kimi K2), as transformers'
     * DeepseekV3Attention computes it: q = q_b_proj(q_a_layernorm(q_a_proj(h))), or q_proj(h) when
     * q_lora_rank is null (0 here), per head [q_nope (qk_nope_head_dim), q_pe (qk_rope_head_dim)];
     * kv_a_proj_with_mqa(h) = [c (kv_lora_rank), k_pe (qk_rope_head_dim, one rope key shared by
     * every head)]; kv_b_proj(kv_a_layernorm(c)) per head [k_nope, v (v_head_dim)]; q = [q_nope,
     * rope(q_pe)], k = [k_nope, rope(k_pe)]; the softmax scale (qk_nope + qk_rope)^-0.5. With
     * rope_interleave the rope part is taken in the order (x0, x2, ..., x1, x3, ...) before
     * rotate-half. head_dim is then max(qk_nope + qk_rope, v_head_dim) (the attention kernels
     * take q's and k's heads at qk_nope + qk_rope, v's and the output's at v_head_dim:
     * am_model_qk_head_dim, am_model_v_head_dim), and rotary_dim qk_rope_head_dim.
     * num_key_value_heads equals num_attention_heads. */
    bool mla;
    long q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    bool rope_interleave;
    /* gpt-oss (gpt_oss), as transformers' GptOssForCausalLM computes it: attention_bias gives q, k,
     * v and o biases (o_bias; qkv_bias), a learned sink logit per head in each softmax's
     * denominator (self_attn.sinks), layer_types alternating sliding_attention (sliding_window,
     * default 128) and full_attention, experts of intermediate_size (moe_intermediate_size =
     * intermediate_size) with biases (gate_up_proj_bias, down_proj_bias) and the clamped SwiGLU
     * (swiglu_alpha, swiglu_limit: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)),
     * the router mlp.router with a bias: the top-k of its logits, softmaxed over the k chosen (the
     * renormalised top-k of the softmax, norm_topk_prob), the load-balancing loss as mixtral's
     * when output_router_logits. mxfp4: quantization_config quant_method mxfp4 (the experts'
     * `*_blocks` and `*_scales`, dequantised at load: runtime/ckpt/quant.h). */
    bool gpt_oss, o_bias, mxfp4;
    double swiglu_alpha, swiglu_limit;
};

/* Finds the config.json for a name or path (steps 1-3 above). Returns 0 and the path in
 * out, or -1 with `looked` describing every place tried. */
int am_model_resolve(const char *name_or_path, char *out, size_t out_len, char *looked, size_t looked_len);

/* Hub ids close to `id` (ignoring case, by the name after ORG/: one contains the other, or
 * they differ in at most 2 letters) among the Hugging Face cache and the configs
 * shipped with am, closest first, at most 3, as "ORG/NAME, ORG/NAME" in out. Returns how many. */
int am_model_similar(const char *id, char *out, size_t len);

/* Reads a JSON file into a node tree (positions name the file). NULL with an error when it
 * cannot be read or is not a JSON object. */
struct am_node *am_json_file_to_node(struct am_arena *a, const char *path, struct am_errors *err);

/* The linear layers LoRA can adapt (peft's target modules), in one order for the recipe, the
 * model and the adapters' files: a decoder layer's projections, then the output head. Multi-head
 * latent attention (deepseek_v3) has q (q_b_proj, or q_proj when q_lora_rank is null), o and
 * its own three: q_a_proj, kv_a_proj_with_mqa, kv_b_proj (no k or v). */
enum am_lora_target {
    AM_LORA_Q, AM_LORA_K, AM_LORA_V, AM_LORA_O, AM_LORA_GATE, AM_LORA_UP, AM_LORA_DOWN,
    AM_LORA_Q_A, AM_LORA_KV_A, AM_LORA_KV_B,
    AM_LORA_HEAD,
    AM_LORA_NTARGETS,
    AM_LORA_NPROJ = AM_LORA_HEAD /* a layer's projections: the targets before lm_head */
};
/* Its module name ("q_proj", ..., "lm_head") and its path inside a decoder layer
 * ("self_attn.q_proj", "mlp.down_proj"; "lm_head" for the head), as Hugging Face names them. */
const char *am_lora_target_name(enum am_lora_target t);
const char *am_lora_target_path(enum am_lora_target t);
/* The same in model m: deepseek_v3's q is "q_b_proj" when q_lora_rank is set; NULL when m's
 * layers have no such projection (k, v, q_a_proj and the kv projections on the other side). */
const char *am_lora_target_name_of(const struct am_model_config *m, enum am_lora_target t);
const char *am_lora_target_path_of(const struct am_model_config *m, enum am_lora_target t);

/* Reads the architecture from `cfg` (config.json merged with inline keys). `strict`
 * entries (those written in the recipe) must be known keys; config.json may hold
 * anything. Checks the model itself (heads divide hidden size, kv heads divide heads,
 * ...). `section` prefixes keys in messages ("model"). */
int am_model_config_read(struct am_arena *a, struct am_node *cfg, const char *section,
                         struct am_model_config *m, struct am_list *ignored, struct am_errors *err);

/* Parameter counts, exact for the supported architectures. */
struct am_param_count {
    double embedding;   /* vocab x hidden */
    double lm_head;     /* 0 when tied */
    double per_layer;   /* attention + norms + MLP/experts (all experts) */
    double attn_per_layer, mlp_per_layer, experts_per_layer, router_per_layer, norms_per_layer;
    double shared_per_layer; /* glm4_moe's shared experts (a MoE layer's dense MLP) */
    double final_norm;
    double total;
    double active_per_token; /* parameters touched per token (matmuls only, incl. lm_head) */
};
void am_model_params(const struct am_model_config *m, struct am_param_count *p);

/* The sliding window of layer l (0 <= l < num_hidden_layers): its size in keys, or 0 when the
 * layer attends to every earlier position. */
long am_model_layer_window(const struct am_model_config *m, long l);
/* Whether layer l has experts (a MoE model's sparse layers) rather than a dense MLP. */
bool am_model_layer_is_moe(const struct am_model_config *m, long l);
/* How many of the model's layers have experts. */
long am_model_moe_layers(const struct am_model_config *m);
/* The width of layer l's dense MLP (gate, up and their product), before tp splits it: a dense
 * layer's intermediate_size; a MoE layer's shared experts' n_shared_experts x
 * moe_intermediate_size (deepseek_v3, glm4_moe), 0 without them (Qwen3-MoE, Mixtral, gpt_oss;
 * the routed experts' tensors are apart). */
long am_model_layer_mlp_width(const struct am_model_config *m, long l);
/* A head's width in q and k, and in v and the attention's output: head_dim, or with multi-head
 * latent attention qk_nope + qk_rope and v_head_dim. */
static inline long am_model_qk_head_dim(const struct am_model_config *m)
{
    return m->mla ? m->qk_nope_head_dim + m->qk_rope_head_dim : m->head_dim;
}
static inline long am_model_v_head_dim(const struct am_model_config *m)
{
    return m->mla ? m->v_head_dim : m->head_dim;
}

/* The rope theta of layer l and whether rope_scaling applies there: rope_local_base_freq
 * without scaling on a gemma3_text sliding layer, rope_theta with rope_scaling elsewhere. */
double am_model_layer_rope_theta(const struct am_model_config *m, long l, bool *scaled);

/* The rotary part of each head (partial rotary: rotary_dim; else, or unset, head_dim). */
/* Whether transformers' load-balancing loss is added (output_router_logits on transformers' class). */
static inline bool am_model_hf_aux(const struct am_model_config *m)
{
    return m->output_router_logits && !m->automodel_gate;
}

static inline long am_model_rotary_dim(const struct am_model_config *m)
{
    return m->rotary_dim > 0 ? m->rotary_dim : m->head_dim;
}

/* True when the model name is one am can train. */
bool am_model_type_supported(const char *model_type);

#endif
