/* recipe.h - the recipe: NeMo AutoModel's YAML layout, read into typed settings.
 *
 * A recipe has AutoModel's sections (model, distributed, step_scheduler, dataset,
 * packed_sequence, optimizer, lr_scheduler, clip_grad_norm, checkpoint, dist_env, rng, peft). am reads the keys
 * it uses; keys that AutoModel defines but am does not use (`_target_`, mp_policy, ...) and
 * whole sections am does not own (wandb, ci, loss_fn, dataloader, ...) are accepted and
 * listed in `ignored`. An unknown key inside a section am owns is an error (with a
 * suggestion when it looks like a typo of a known key).
 *
 * Loading: the file is parsed, overrides (`--set distributed.tp_size=8`, or the plugin's
 * `--am-tp=8`) are applied to the tree, then the typed settings are read. The layout rules
 * are checked afterwards by am_validate (plan.h): without a world (what sbatch can check),
 * or with one (am_plan_build does). All errors are collected; none stops the others.
 *
 * Nothing here needs CUDA, NCCL or PMIx: the SPANK plugin links this library into sbatch.
 */
#ifndef AM_RECIPE_H
#define AM_RECIPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "arena.h"
#include "dtype.h"
#include "errors.h"
#include "model_config.h"
#include "node.h"

enum am_strategy { AM_FSDP2, AM_MEGATRON_FSDP, AM_DDP };
enum am_pp_schedule { AM_PP_1F1B, AM_PP_GPIPE, AM_PP_INTERLEAVED_1F1B };
enum am_lr_style { AM_LR_CONSTANT, AM_LR_LINEAR, AM_LR_COSINE };
enum am_round { AM_ROUND_NONE, AM_ROUND_UP, AM_ROUND_DOWN };
/* How lora_A starts (B starts at zero): xavier normal (AutoModel's default), or kaiming uniform
 * with a = sqrt(5) (torch's nn.Linear default, the peft library's). */
enum am_lora_init { AM_LORA_INIT_XAVIER, AM_LORA_INIT_KAIMING };

#define AM_MAX_DATA_PATHS 64

/* A command-line override: `path=value`, where value is YAML (a scalar, or a flow list).
 * `origin` is how the user wrote it, shown in errors ("--set distributed.tp_size=6"). */
struct am_override {
    const char *path;
    const char *value;
    const char *origin;
};

/* Parses "distributed.tp_size=8" into o (pointing into s); -1 when there is no '='. */
int am_override_parse(char *s, struct am_override *o);

struct am_recipe {
    const char *file; /* as given */
    struct am_node *root;
    struct am_arena arena;

    struct am_model_config model;
    const char *model_source; /* the resolved config.json, "inline", or a shipped config */
    enum am_dtype param_dtype;   /* model.torch_dtype: storage of parameters */
    bool param_dtype_assumed;    /* neither the recipe nor config.json gives it: bfloat16 */
    enum am_dtype compute_dtype; /* distributed.mp_policy.param_dtype, else per strategy */
    enum am_dtype reduce_dtype;  /* distributed.mp_policy.reduce_dtype: gradients' all-reduce */
    enum am_dtype grad_shard_dtype; /* resolved: fsdp2's reduced gradient shards, bf16 with bf16
                                       parameters as FSDP2 keeps them (train/grad_sync.h), else
                                       fp32 (megatron_fsdp's main gradients too) */

    struct {
        enum am_strategy strategy;
        int tp, pp, cp, ep;
        int dp;           /* 0: inferred as world / (tp*pp*cp) */
        int dp_replicate; /* 0: not set (1) */
        bool sequence_parallel;
        bool activation_checkpointing;
        int zero_dp_strategy; /* megatron_fsdp: 1, 2 or 3 */
        bool reshard_after_forward; /* fsdp2 (default true): false keeps every group gathered from its
                                       forward to its backward */
        struct {
            enum am_pp_schedule schedule;
            int microbatch_size;
            int layers_per_stage; /* 0: split evenly */
            enum am_round round_virtual;
            long seq_len; /* pp_seq_len: 0, not given */
        } pipeline;
    } dist;

    struct {
        long global_batch, local_batch, max_steps, ckpt_every, val_every, num_epochs;
    } steps;

    struct {
        const char *paths[AM_MAX_DATA_PATHS];
        double weights[AM_MAX_DATA_PATHS];
        int n_paths;
        long seq_length; /* 0: not given */
        const char *seq_key; /* the key it was read from: "seq_length" or "seq_len" */
        bool foreign;        /* dataset._target_ is not Megatron's: am plans with it but does not read it */
        bool shuffle;
        long seed;
    } data;
    long packed_sequence_size;
    const char *packing_strategy; /* "thd" (AutoModel's default) or "neat" */
    bool drop_long_samples;       /* packed_sequence.drop_long_samples: a document longer than a pack is
                                     dropped (true, the default), or refused */
    long max_packs;               /* packed_sequence.max_packs: 0, or at most this many packs */

    struct {
        const char *name; /* "adam" or "adamw" */
        double lr, beta1, beta2, eps, weight_decay;
        double max_grad_norm; /* clip_grad_norm.max_norm; 0: no clipping */
        /* Transformer Engine's FusedAdam (transformer_engine.pytorch.optimizers.FusedAdam): its
         * arithmetic (kernels.h, am_adamw_tensor.te) and its keys, TE's defaults where left out */
        bool te;
        bool adam_w_mode;      /* decoupled weight decay (true, AdamW), else L2: decay * p added
                                  to the gradient */
        bool bias_correction;  /* Adam's bias correction (true), else none */
        bool master_weights;   /* separate master weights in master_weight_dtype */
        bool remainders;       /* store_param_remainders, as given */
        bool amsgrad, decoupled_grad; /* amsgrad, use_decoupled_grad: refused (validate.c) */
        enum am_dtype master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype; /* as given */
        bool exp_avg_fp8, exp_avg_sq_fp8; /* the dtype given is torch.uint8 (FP8): refused */
        /* Resolved once the model's dtype is known: the masters' dtype (torch's optimizers: the
         * parameters', model.torch_dtype; FusedAdam: master_weight_dtype with master_weights,
         * else the parameters') and the two moments' (torch's: the parameters'; FusedAdam: its
         * exp_avg_dtype and exp_avg_sq_dtype) */
        enum am_dtype master_dtype, moment_dtype[2];
        /* Resolved: FusedAdam keeps each fp32 master as the bf16 parameter and its 16-bit
         * remainder (store_param_remainders with master_weights in fp32 and bf16 parameters, as
         * TE applies it; kernels.h, am_adamw_tensor.rem): master_dtype is then bf16, the
         * parameters', and the optimizer holds the remainders beside the moments */
        bool split_master;
    } optim;

    struct {
        enum am_lr_style style;
        long warmup_steps, decay_steps;
        double min_lr;
    } lr;

    struct {
        bool enabled;
        const char *dir, *restore_from;
        long keep_last;         /* max_recent_checkpoints: sharded checkpoints kept (0: all) */
        bool save_consolidated; /* also a Hugging Face directory in the checkpoints (default true) */
        bool consolidated_final; /* save_consolidated: final: in the checkpoint at the end of training only */
    } ckpt;

    /* peft: LoRA (AutoModel's PeftConfig). With it the model's weights are frozen and each
     * targeted linear layer y = W x gains y += (alpha / dim) * B (A x), A: dim x in, B: out x dim,
     * the only trained parameters. */
    struct {
        bool enabled;
        unsigned targets; /* bits 1u << enum am_lora_target; the same in every layer */
        long dim;         /* r */
        double alpha;
        enum am_lora_init a_init;
        double dropout;   /* AutoModel's dropout: each adapter's in training (lora.h); 0: none */
        bool dropout_pre; /* dropout_position "pre": on the adapter's input; else "post": on its output */
        bool experts;     /* a mixture of experts: adapters on each expert's projections too (AutoModel's
                           * GroupedExpertsLoRA, moe.h), in every MoE layer; no dropout on them */
        bool rank_scaling; /* moe_rank_scaling: the experts' adapters of rank dim / num_experts_per_tok */
        bool dtype_set;    /* lora_dtype given: the adapters' dtype (lora_dtype); without it, AutoModel's
                            * adapters take their base layer's, the storage dtype (param_dtype) */
        enum am_dtype lora_dtype;
        long experts_dim;  /* with experts: their adapters' rank, dim, or with rank_scaling (AutoModel's
                            * moe_dim) dim / num_experts_per_tok rounded down (0 when dim is below
                            * num_experts_per_tok: refused by am_validate_run); their scale is
                            * alpha / experts_dim */
    } peft;

    struct {
        double timeout_minutes;
        const char *backend;
    } dist_env;

    long seed;
    bool seed_ranked;

    /* Keys accepted but not used, as "section.key" (or a whole section's name). */
    struct am_list ignored;
    /* Things the user should know that are not errors (assumptions made, ...). */
    struct am_list notes;
};

/* Loads a recipe file: reads it (as the calling user), applies the overrides in order and
 * reads the typed settings. Returns the recipe, or NULL when the file could not be read or
 * parsed as YAML; a recipe is also returned with errors (a file that is not a mapping, bad
 * values): check err->n. The caller frees a returned recipe with am_recipe_free. */
struct am_recipe *am_recipe_load(const char *path, const struct am_override *ov, size_t n_ov,
                                 struct am_errors *err);

/* The same from a buffer (the fuzzer, and tests). `name` is used in positions. */
struct am_recipe *am_recipe_parse(const char *name, const char *buf, size_t len,
                                  const struct am_override *ov, size_t n_ov, struct am_errors *err);

void am_recipe_free(struct am_recipe *r);

/* The position of a dotted key's value for messages: its line and column when present,
 * else the file alone. */
struct am_pos am_recipe_pos(const struct am_recipe *r, const char *path);

const char *am_strategy_name(enum am_strategy s);
const char *am_pp_schedule_name(enum am_pp_schedule s);
/* Trainable LoRA parameters of layer l (counted whole, before tensor parallelism; a mixture
 * of experts' layers differ: a DeepSeekMoE model's dense MLP against its shared experts), of
 * all the layers, and of the head; 0 without peft. */
double am_lora_layer_params(const struct am_recipe *r, long l);
double am_lora_layers_params(const struct am_recipe *r);
double am_lora_head_params(const struct am_recipe *r);
/* With peft.experts: the experts' adapter parameters of the whole model (every MoE layer's E
 * experts), or with saved the values peft's file holds (the shared A of gate and up twice). */
double am_lora_expert_params(const struct am_recipe *r, bool saved);

/* Largest recipe file accepted (a real one is a few KiB). */
#define AM_RECIPE_MAX_BYTES (1024 * 1024)

#endif
