/* recipe.c - reading an AutoModel-layout recipe into struct am_recipe (recipe.h).
 *
 * Each section am owns is described by a table of keys: how to read each one into the
 * recipe, or that it is accepted and ignored. The tables are the single list of what am
 * understands; docs/recipes.md describes the same keys for users.
 */
#include "recipe.h"

#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

struct reader {
    struct am_recipe *r;
    struct am_errors *err;
    /* peft's module selection, resolved once the model is known (resolve_peft) */
    struct am_node *peft_targets, *peft_excludes;
    bool peft_match_all;
    struct am_node *is_peft; /* checkpoint.is_peft: true, checked against the peft section once read */
};

enum kind {
    K_INT,    /* int, >= min */
    K_LONG,   /* long, >= min */
    K_OPT_LONG, /* long, >= min; null/none/~/empty stores 0 ("not set") */
    K_SIZE,   /* int >= 1; null/none stores 0 ("not set": inferred or default) */
    K_DOUBLE, /* double, >= 0 */
    K_OPT_DOUBLE, /* double, >= 0; null/none/~/empty stores 0 ("off") */
    K_BOOL,
    K_STR,
    K_FN,     /* read by fn */
    K_IGNORE, /* accepted, listed as ignored */
};

/* One key of a section: its name, how it is read (kind, and fn for K_FN), where it is stored
 * (off), its bound (min) and its value when the recipe leaves it out (def: YAML as a recipe would
 * write it, read like the key itself; NULL: zero, false or none). */
struct key_spec {
    const char *name;
    enum kind kind;
    size_t off;
    long min;
    int (*fn)(struct reader *rd, struct am_node *v, const char *key);
    const char *def;
};

#define R(field) offsetof(struct am_recipe, field)
#define IGNORE(name) {name, K_IGNORE, 0, 0, NULL, NULL}

static void read_section(struct reader *rd, struct am_node *sec, const char *name, const struct key_spec *keys);
static int read_norm_type(struct reader *rd, struct am_node *v, const char *key);

static void add_ignored(struct reader *rd, const char *section, const char *key)
{
    char full[256];
    snprintf(full, sizeof(full), "%s%s%s", section, *section ? "." : "", key);
    am_list_add(&rd->r->arena, &rd->r->ignored, am_arena_strdup(&rd->r->arena, full));
}

static void add_note(struct reader *rd, const char *fmt, const char *a, const char *b)
{
    char text[512];
    snprintf(text, sizeof(text), fmt, a, b);
    am_list_add(&rd->r->arena, &rd->r->notes, am_arena_strdup(&rd->r->arena, text));
}

/* ---- custom readers ------------------------------------------------------------------ */

static const char *const strategy_names[] = {"fsdp2", "megatron_fsdp", "ddp", NULL};

static int read_strategy(struct reader *rd, struct am_node *v, const char *key)
{
    int i;
    if (am_node_choice(v, key, strategy_names, &i, rd->err) < 0)
        return -1;
    rd->r->dist.strategy = (enum am_strategy)i;
    return 0;
}

/* distributed._target_: AutoModel names the strategy by its manager class. */
static int read_dist_target(struct reader *rd, struct am_node *v, const char *key)
{
    static const struct {
        const char *suffix;
        enum am_strategy s;
    } managers[] = {{"FSDP2Manager", AM_FSDP2}, {"MegatronFSDPManager", AM_MEGATRON_FSDP},
                    {"NVFSDPManager", AM_MEGATRON_FSDP}, {"DDPManager", AM_DDP}};
    const char *s;
    if (am_node_str(v, key, &s, rd->err) < 0)
        return -1;
    const char *cls = strrchr(s, '.');
    cls = cls ? cls + 1 : s;
    for (size_t i = 0; i < sizeof(managers) / sizeof(managers[0]); i++) {
        if (strcmp(cls, managers[i].suffix) == 0) {
            struct am_node *strategy = am_node_path(rd->r->root, "distributed.strategy");
            if (strategy && strategy->kind == AM_NODE_SCALAR && strcmp(strategy->str, strategy_names[managers[i].s])) {
                am_errorf(rd->err, &v->pos, "%s: %s is strategy %s, but distributed.strategy says %s (keep one)", key,
                          cls, strategy_names[managers[i].s], strategy->str);
                return -1;
            }
            rd->r->dist.strategy = managers[i].s;
            return 0;
        }
    }
    am_errorf(rd->err, &v->pos, "%s: '%s' is not a distributed manager am knows (use strategy: fsdp2, "
              "megatron_fsdp or ddp)", key, s);
    return -1;
}

static int read_activation_ckpt(struct reader *rd, struct am_node *v, const char *key)
{
    if (v->kind == AM_NODE_SCALAR && (strcmp(v->str, "full") == 0 || strcmp(v->str, "selective") == 0)) {
        rd->r->dist.activation_checkpointing = true;
        if (strcmp(v->str, "selective") == 0)
            add_note(rd, "%s: selective: am recomputes whole layers%s", key, "");
        return 0;
    }
    return am_node_bool(v, key, &rd->r->dist.activation_checkpointing, rd->err);
}

static int read_schedule(struct reader *rd, struct am_node *v, const char *key)
{
    static const struct {
        const char *name;
        enum am_pp_schedule s;
    } names[] = {{"1f1b", AM_PP_1F1B},          {"1F1B", AM_PP_1F1B},
                 {"schedule1f1b", AM_PP_1F1B},  {"gpipe", AM_PP_GPIPE},
                 {"GPipe", AM_PP_GPIPE},        {"schedulegpipe", AM_PP_GPIPE},
                 {"interleaved1f1b", AM_PP_INTERLEAVED_1F1B}, {"interleaved_1f1b", AM_PP_INTERLEAVED_1F1B},
                 {"Interleaved1F1B", AM_PP_INTERLEAVED_1F1B}, {"scheduleinterleaved1f1b", AM_PP_INTERLEAVED_1F1B}};
    const char *s;
    if (am_node_is_null(v))
        return 0;
    if (am_node_str(v, key, &s, rd->err) < 0)
        return -1;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (strcmp(s, names[i].name) == 0) {
            rd->r->dist.pipeline.schedule = names[i].s;
            return 0;
        }
    }
    am_errorf(rd->err, &v->pos, "%s: '%s' is not a schedule am runs (use 1f1b, gpipe or interleaved1f1b)", key, s);
    return -1;
}

static int read_round(struct reader *rd, struct am_node *v, const char *key)
{
    static const char *const names[] = {"up", "down", NULL};
    int i;
    if (am_node_is_null(v))
        return rd->r->dist.pipeline.round_virtual = AM_ROUND_NONE, 0;
    if (am_node_choice(v, key, names, &i, rd->err) < 0)
        return -1;
    rd->r->dist.pipeline.round_virtual = i == 0 ? AM_ROUND_UP : AM_ROUND_DOWN;
    return 0;
}

static int read_dtype(struct reader *rd, struct am_node *v, const char *key, enum am_dtype *out)
{
    static const char *const names[] = {"bfloat16", "bf16", "torch.bfloat16", "float16", "fp16", "half",
                                        "torch.float16", "float32", "fp32", "float", "torch.float32", NULL};
    static const enum am_dtype types[] = {AM_BF16, AM_BF16, AM_BF16, AM_F16, AM_F16, AM_F16,
                                          AM_F16,  AM_F32,  AM_F32,  AM_F32, AM_F32};
    int i;
    if (v->kind == AM_NODE_SCALAR && strcmp(v->str, "auto") == 0)
        return 1; /* caller decides */
    if (am_node_choice(v, key, names, &i, rd->err) < 0)
        return -1;
    *out = types[i];
    return 0;
}

static int read_compute_dtype(struct reader *rd, struct am_node *v, const char *key)
{
    int rc = read_dtype(rd, v, key, &rd->r->compute_dtype);
    return rc < 0 ? -1 : 0;
}

static int read_reduce_dtype(struct reader *rd, struct am_node *v, const char *key)
{
    int rc = read_dtype(rd, v, key, &rd->r->reduce_dtype);
    return rc < 0 ? -1 : 0;
}

/* FSDP2's MixedPrecisionPolicy. output_dtype changes nothing am computes: its loss reads the
 * logits in fp32 whatever the model's output dtype, as transformers' loss upcasts them. */
static const struct key_spec mp_policy_keys[] = {
    {"param_dtype", K_FN, 0, 0, read_compute_dtype, NULL},
    {"reduce_dtype", K_FN, 0, 0, read_reduce_dtype, NULL},
    IGNORE("_target_"), IGNORE("output_dtype"), IGNORE("cast_forward_inputs"),
    {NULL, 0, 0, 0, NULL, NULL}};

static int read_mp_policy(struct reader *rd, struct am_node *v, const char *key)
{
    if (am_node_is_null(v))
        return 0;
    read_section(rd, v, key, mp_policy_keys);
    return 0;
}

static const struct key_spec pipeline_keys[] = {
    {"pp_schedule", K_FN, 0, 0, read_schedule, NULL},
    {"pp_microbatch_size", K_INT, R(dist.pipeline.microbatch_size), 1, NULL, "1"},
    {"layers_per_stage", K_SIZE, R(dist.pipeline.layers_per_stage), 1, NULL, NULL},
    {"round_virtual_stages_to_pp_multiple", K_FN, 0, 0, read_round, NULL},
    IGNORE("pp_batch_size"), IGNORE("pp_schedule_csv"), IGNORE("module_fqns_per_model_part"),
    IGNORE("patch_inner_model"), IGNORE("patch_causal_lm_model"), IGNORE("patch_stage_backward_maybe_with_nosync"),
    IGNORE("dtype"), IGNORE("scale_grads_in_schedule"), IGNORE("loss_fn"),
    IGNORE("pp_recv_buffer_pool"), IGNORE("pp_recv_buffer_pool_slack"), IGNORE("_target_"),
    {"pp_seq_len", K_OPT_LONG, R(dist.pipeline.seq_len), 1, NULL, NULL},
    {NULL, 0, 0, 0, NULL, NULL}};

/* pp_size as the recipe (and its overrides) give it, before the section is read; 1 when absent,
 * null, or not a number (that error is reported where pp_size is read). */
static long pp_size_given(struct reader *rd)
{
    struct am_node *n = am_node_path(rd->r->root, "distributed.pp_size");
    long pp = 1;
    struct am_errors quiet;
    if (!n || am_node_is_null(n))
        return 1;
    am_errors_init(&quiet);
    if (am_node_long(n, "pp_size", 1, 1 << 20, &pp, &quiet) < 0)
        pp = 1;
    am_errors_free(&quiet);
    return pp;
}

/* distributed.pipeline: with pp_size 1 AutoModel drops the section with a warning (a recipe
 * may keep it for runs that override pp_size); am does the same, with a note. */
static int read_pipeline(struct reader *rd, struct am_node *v, const char *key)
{
    if (am_node_is_null(v))
        return 0;
    if (pp_size_given(rd) <= 1) {
        add_note(rd, "%s: pp_size is 1, so pipeline parallelism is off and this section is ignored (as AutoModel "
                 "does)%s", key, "");
        return 0;
    }
    read_section(rd, v, key, pipeline_keys);
    return 0;
}

/* distributed.moe: MoEParallelizerConfig, used only with ep_size > 1 (AutoModel drops it
 * otherwise). Of its keys, lm_head_precision and mp_policy change the dtypes of what is
 * computed; the others change where weights live and what is recomputed. */
static int refuse_moe_dtype(struct reader *rd, struct am_node *v, const char *key)
{
    if (am_node_is_null(v))
        return 0;
    am_errorf(rd->err, &v->pos, "%s: am computes the experts and the output head in the compute dtype of "
              "distributed.mp_policy; a separate precision for them is not supported (remove it)", key);
    return -1;
}

static const struct key_spec moe_keys[] = {
    {"lm_head_precision", K_FN, 0, 0, refuse_moe_dtype, NULL},
    {"mp_policy", K_FN, 0, 0, refuse_moe_dtype, NULL},
    IGNORE("ignore_router_for_ac"), IGNORE("reshard_after_forward"), IGNORE("wrap_outer_model"), IGNORE("_target_"),
    {NULL, 0, 0, 0, NULL, NULL}};

static int read_moe(struct reader *rd, struct am_node *v, const char *key)
{
    if (am_node_is_null(v))
        return 0;
    struct am_node *ep = am_node_path(rd->r->root, "distributed.ep_size");
    long n = 1;
    struct am_errors quiet;
    am_errors_init(&quiet);
    if (ep && !am_node_is_null(ep) && am_node_long(ep, "ep_size", 1, 1 << 20, &n, &quiet) < 0)
        n = 1;
    am_errors_free(&quiet);
    if (n <= 1) {
        add_note(rd, "%s: ep_size is 1, so this section is ignored (as AutoModel does)%s", key, "");
        return 0;
    }
    read_section(rd, v, key, moe_keys);
    return 0;
}

static const struct key_spec distributed_keys[] = {
    {"strategy", K_FN, 0, 0, read_strategy, NULL},
    {"_target_", K_FN, 0, 0, read_dist_target, NULL},
    {"dp_size", K_SIZE, R(dist.dp), 1, NULL, NULL},
    {"dp_replicate_size", K_SIZE, R(dist.dp_replicate), 1, NULL, NULL},
    {"tp_size", K_SIZE, R(dist.tp), 1, NULL, NULL},
    {"pp_size", K_SIZE, R(dist.pp), 1, NULL, NULL},
    {"cp_size", K_SIZE, R(dist.cp), 1, NULL, NULL},
    {"ep_size", K_SIZE, R(dist.ep), 1, NULL, NULL},
    {"sequence_parallel", K_BOOL, R(dist.sequence_parallel), 0, NULL, NULL},
    {"activation_checkpointing", K_FN, 0, 0, read_activation_ckpt, NULL},
    {"zero_dp_strategy", K_INT, R(dist.zero_dp_strategy), 1, NULL, "3"},
    {"pipeline", K_FN, 0, 0, read_pipeline, NULL},
    {"mp_policy", K_FN, 0, 0, read_mp_policy, NULL},
    {"moe", K_FN, 0, 0, read_moe, NULL},
    /* FSDP2's policies for vision and audio towers: a language model has none */
    IGNORE("multimodal"),
    /* DDP's bucketing and buffer options */
    IGNORE("broadcast_buffers"), IGNORE("static_graph"), IGNORE("bucket_cap_mb"), IGNORE("gradient_as_bucket_view"),
    IGNORE("_recursive_"), IGNORE("_convert_"),
    IGNORE("tp_plan"), IGNORE("patch_is_packed_sequence"), IGNORE("offload_policy"), IGNORE("autocast_dtype"),
    IGNORE("activation_checkpointing_scope"), IGNORE("defer_fsdp_grad_sync"), {"reshard_after_forward", K_BOOL, R(dist.reshard_after_forward), 0, NULL, "true"},
    IGNORE("enable_async_tensor_parallel"), IGNORE("enable_compile"), IGNORE("enable_fsdp2_prefetch"),
    IGNORE("fsdp2_backward_prefetch_depth"), IGNORE("fsdp2_forward_prefetch_depth"),
    IGNORE("megatron_fsdp_unit_modules"), IGNORE("init_fsdp_with_meta_device"), IGNORE("grad_reduce_in_fp32"),
    IGNORE("preserve_fp32_weights"), IGNORE("overlap_grad_reduce"), IGNORE("overlap_param_gather"),
    IGNORE("check_for_nan_in_grad"), IGNORE("report_nan_in_param_grad"), IGNORE("average_in_collective"),
    IGNORE("disable_bucketing"), IGNORE("calculate_per_token_loss"), IGNORE("keep_fp8_transpose_cache"),
    IGNORE("nccl_ub"), IGNORE("fsdp_double_buffer"), IGNORE("backend"), IGNORE("find_unused_parameters"),
    IGNORE("use_hf_tp_plan"), IGNORE("cpu_offload"),
    {NULL, 0, 0, 0, NULL, NULL}};

/* step_scheduler.start_step / start_epoch: where a resumed run's counters start (AutoModel sets
 * them from a checkpoint); a recipe that starts elsewhere shifts the learning-rate schedule. */
static int read_start(struct reader *rd, struct am_node *v, const char *key)
{
    long l;
    if (am_node_is_null(v))
        return 0;
    if (am_node_long(v, key, 0, LONG_MAX, &l, rd->err) < 0)
        return -1;
    if (l != 0) {
        am_errorf(rd->err, &v->pos, "%s: %ld: am starts a run at step 0, or where checkpoint.restore_from left off "
                  "(remove it, or restore from a checkpoint)", key, l);
        return -1;
    }
    return 0;
}

static const struct key_spec step_keys[] = {
    {"global_batch_size", K_LONG, R(steps.global_batch), 1, NULL, NULL},
    {"local_batch_size", K_LONG, R(steps.local_batch), 1, NULL, NULL},
    {"max_steps", K_OPT_LONG, R(steps.max_steps), 1, NULL, NULL},
    {"ckpt_every_steps", K_OPT_LONG, R(steps.ckpt_every), 1, NULL, NULL},
    {"val_every_steps", K_OPT_LONG, R(steps.val_every), 1, NULL, NULL},
    {"num_epochs", K_OPT_LONG, R(steps.num_epochs), 1, NULL, "1"},
    /* StepScheduler's bookkeeping: when Python collects garbage, saves at epoch ends, logs to
     * a remote tracker, the window of its averaged loss, the preemption signal */
    IGNORE("_target_"), IGNORE("val_batches"), IGNORE("gc_every_steps"), IGNORE("save_checkpoint_every_epoch"),
    IGNORE("log_remote_every_steps"), IGNORE("loss_average_window_steps"), IGNORE("preemption_signal"),
    {"start_step", K_FN, 0, 0, read_start, NULL},
    {"start_epoch", K_FN, 0, 0, read_start, NULL},
    {NULL, 0, 0, 0, NULL, NULL}};

/* dataset.paths: a prefix, a list of prefixes, or Megatron's blend [w1, p1, w2, p2, ...]. */
static int read_paths(struct reader *rd, struct am_node *v, const char *key)
{
    struct am_recipe *r = rd->r;
    r->data.n_paths = 0;
    if (v->kind == AM_NODE_SCALAR) {
        r->data.paths[0] = v->str;
        r->data.weights[0] = 1.0;
        r->data.n_paths = 1;
        return 0;
    }
    if (v->kind != AM_NODE_SEQ || v->n == 0) {
        am_errorf(rd->err, &v->pos, "%s: expected a path prefix, or a list of prefixes (optionally each "
                  "preceded by its weight)", key);
        return -1;
    }
    bool weighted = v->entries[0].value->kind == AM_NODE_SCALAR && strtod(v->entries[0].value->str, NULL) > 0 &&
                    v->n % 2 == 0;
    size_t step = weighted ? 2 : 1;
    if (v->n / step > AM_MAX_DATA_PATHS) {
        am_errorf(rd->err, &v->pos, "%s: %zu datasets, more than the %d am blends", key, v->n / step, AM_MAX_DATA_PATHS);
        return -1;
    }
    for (size_t i = 0; i < v->n; i += step) {
        int k = r->data.n_paths;
        r->data.weights[k] = 1.0;
        if (weighted && am_node_double(v->entries[i].value, key, &r->data.weights[k], rd->err) < 0)
            return -1;
        if (r->data.weights[k] <= 0) {
            am_errorf(rd->err, &v->entries[i].value->pos, "%s: weight %g must be positive", key, r->data.weights[k]);
            return -1;
        }
        if (am_node_str(v->entries[i + step - 1].value, key, &r->data.paths[k], rd->err) < 0)
            return -1;
        r->data.n_paths++;
    }
    return 0;
}

static const struct key_spec dataset_keys[] = {
    {"paths", K_FN, 0, 0, read_paths, NULL},
    {"seq_length", K_OPT_LONG, R(data.seq_length), 1, NULL, NULL},
    {"shuffle", K_BOOL, R(data.shuffle), 0, NULL, "true"},
    {"seed", K_LONG, R(data.seed), 0, NULL, NULL},
    IGNORE("_target_"), IGNORE("split"), IGNORE("splits_to_build"), IGNORE("index_mapping_dir"),
    IGNORE("tokenizer"), IGNORE("num_val_samples"), IGNORE("num_train_samples"),
    {NULL, 0, 0, 0, NULL, NULL}};

/* A dataset class am does not implement: only the sequence length is read (for planning), under
 * the names AutoModel's datasets give it. */
static const char *const seq_length_names[] = {"seq_length", "seq_len", NULL};
static const struct key_spec foreign_dataset_keys[] = {
    {"seq_length", K_OPT_LONG, R(data.seq_length), 1, NULL, NULL},
    {"seq_len", K_OPT_LONG, R(data.seq_length), 1, NULL, NULL},
    {NULL, 0, 0, 0, NULL, NULL}};

/* packed_sequence.packing_strategy: how AutoModel fills each pack of packed_sequence_size
 * tokens: `thd` (first fit, in order) or `neat` (greedy knapsack). Both keep each sample's
 * attention within its own document with reset positions; they choose which samples share a
 * pack, which matters only for the datasets AutoModel packs (not Megatron's), and plan alike. */
static int read_packing_strategy(struct reader *rd, struct am_node *v, const char *key)
{
    static const char *const names[] = {"thd", "neat", NULL};
    int i;
    if (am_node_is_null(v))
        return 0;
    if (v->kind == AM_NODE_SCALAR && strchr(v->str, '.')) {
        am_errorf(rd->err, &v->pos, "%s: '%.40s' is a packing class am does not know (use thd or neat)", key, v->str);
        return -1;
    }
    if (am_node_choice(v, key, names, &i, rd->err) < 0)
        return -1;
    rd->r->packing_strategy = names[i];
    return 0;
}

static const struct key_spec packed_keys[] = {
    {"packed_sequence_size", K_OPT_LONG, R(packed_sequence_size), 0, NULL, NULL},
    {"packing_strategy", K_FN, 0, 0, read_packing_strategy, NULL},
    /* which documents are packed (runtime/data/pack.h): over-long ones dropped or refused, at
     * most max_packs packs */
    {"drop_long_samples", K_BOOL, R(drop_long_samples), 0, NULL, "true"},
    {"max_packs", K_OPT_LONG, R(max_packs), 1, NULL, NULL},
    /* how AutoModel builds packs (already-packed data, tokenizer processes); split_across_pack
     * has no effect in AutoModel any more */
    IGNORE("split_across_pack"), IGNORE("prepacked"), IGNORE("num_proc"),
    {NULL, 0, 0, 0, NULL, NULL}};

/* Transformer Engine's FusedAdam, by either of its import paths */
static bool te_fused_adam(const char *target)
{
    return strcmp(target, "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam") == 0 ||
           strcmp(target, "transformer_engine.pytorch.optimizers.FusedAdam") == 0;
}

static int read_optimizer_target(struct reader *rd, struct am_node *v, const char *key)
{
    const char *s;
    if (am_node_str(v, key, &s, rd->err) < 0)
        return -1;
    if (strcmp(s, "torch.optim.AdamW") == 0)
        rd->r->optim.name = "adamw";
    else if (strcmp(s, "torch.optim.Adam") == 0)
        rd->r->optim.name = "adam";
    else if (te_fused_adam(s))
        rd->r->optim.name = "adamw", rd->r->optim.te = true;
    else if (strstr(s, "FusedAdam") || strstr(s, "FlashAdamW")) {
        /* the same update rule, with their own precisions for the master weights and moments */
        am_errorf(rd->err, &v->pos, "%s: '%.60s' is not an optimizer am runs: its update is AdamW's, with its own "
                  "precisions for master weights and moments (use torch.optim.AdamW; model.torch_dtype: float32 "
                  "keeps fp32 weights and moments)", key, s);
        return -1;
    } else {
        am_errorf(rd->err, &v->pos, "%s: '%.60s' is not an optimizer am runs (use torch.optim.AdamW or "
                  "torch.optim.Adam)", key, s);
        return -1;
    }
    return 0;
}

static int read_betas(struct reader *rd, struct am_node *v, const char *key)
{
    if (v->kind != AM_NODE_SEQ || v->n != 2) {
        am_errorf(rd->err, &v->pos, "%s: expected two numbers, e.g. [0.9, 0.95]", key);
        return -1;
    }
    if (am_node_double(v->entries[0].value, key, &rd->r->optim.beta1, rd->err) < 0 ||
        am_node_double(v->entries[1].value, key, &rd->r->optim.beta2, rd->err) < 0)
        return -1;
    for (int i = 0; i < 2; i++) {
        double b = i ? rd->r->optim.beta2 : rd->r->optim.beta1;
        if (b < 0 || b >= 1) {
            am_errorf(rd->err, &v->entries[i].value->pos, "%s: %g must be in [0, 1)", key, b);
            return -1;
        }
    }
    return 0;
}

static const struct key_spec optimizer_keys[] = {
    {"_target_", K_FN, 0, 0, read_optimizer_target, "torch.optim.AdamW"},
    {"lr", K_DOUBLE, R(optim.lr), 0, NULL, "1.0e-4"},
    {"betas", K_FN, 0, 0, read_betas, "[0.9, 0.999]"},
    {"eps", K_DOUBLE, R(optim.eps), 0, NULL, "1.0e-8"},
    {"weight_decay", K_DOUBLE, R(optim.weight_decay), 0, NULL, "0.01"},
    IGNORE("foreach"), IGNORE("fused"), IGNORE("capturable"), IGNORE("differentiable"),
    {NULL, 0, 0, 0, NULL, NULL}};

/* FusedAdam's state dtypes: torch.float32, torch.bfloat16, torch.float16, or torch.uint8 (FP8) */
static int read_te_dtype(struct reader *rd, struct am_node *v, const char *key, enum am_dtype *out, bool *fp8)
{
    *fp8 = false;
    if (v->kind == AM_NODE_SCALAR && (strcmp(v->str, "torch.uint8") == 0 || strcmp(v->str, "uint8") == 0)) {
        *fp8 = true;
        return 0;
    }
    int rc = read_dtype(rd, v, key, out);
    if (rc > 0) {
        am_errorf(rd->err, &v->pos, "%s: 'auto' is not a dtype FusedAdam takes (torch.float32 or torch.bfloat16)", key);
        return -1;
    }
    return rc;
}

static int read_te_master(struct reader *rd, struct am_node *v, const char *key)
{
    bool fp8;
    if (read_te_dtype(rd, v, key, &rd->r->optim.master_weight_dtype, &fp8) < 0)
        return -1;
    if (fp8) { /* TE raises: "FusedAdam only supports fp32/fp16 master weights." */
        am_errorf(rd->err, &v->pos, "%s: %s: FusedAdam keeps master weights in fp32 or fp16 only (use torch.float32)",
                  key, v->str);
        return -1;
    }
    return 0;
}

static int read_te_exp_avg(struct reader *rd, struct am_node *v, const char *key)
{
    return read_te_dtype(rd, v, key, &rd->r->optim.exp_avg_dtype, &rd->r->optim.exp_avg_fp8);
}

static int read_te_exp_avg_sq(struct reader *rd, struct am_node *v, const char *key)
{
    return read_te_dtype(rd, v, key, &rd->r->optim.exp_avg_sq_dtype, &rd->r->optim.exp_avg_sq_fp8);
}

/* Transformer Engine's FusedAdam (transformer_engine/pytorch/optimizers/fused_adam.py), its
 * defaults. capturable changes nothing computed (the same functor, CUDA-graph friendly);
 * set_grad_none is deprecated (how zero_grad clears, nothing computed). */
static const struct key_spec te_adam_keys[] = {
    {"_target_", K_FN, 0, 0, read_optimizer_target, NULL},
    {"lr", K_DOUBLE, R(optim.lr), 0, NULL, "1.0e-3"},
    {"betas", K_FN, 0, 0, read_betas, "[0.9, 0.999]"},
    {"eps", K_DOUBLE, R(optim.eps), 0, NULL, "1.0e-8"},
    {"weight_decay", K_DOUBLE, R(optim.weight_decay), 0, NULL, "0.0"},
    {"amsgrad", K_BOOL, R(optim.amsgrad), 0, NULL, "false"},
    {"bias_correction", K_BOOL, R(optim.bias_correction), 0, NULL, "true"},
    {"adam_w_mode", K_BOOL, R(optim.adam_w_mode), 0, NULL, "true"},
    {"master_weights", K_BOOL, R(optim.master_weights), 0, NULL, "false"},
    {"master_weight_dtype", K_FN, 0, 0, read_te_master, "torch.float32"},
    {"exp_avg_dtype", K_FN, 0, 0, read_te_exp_avg, "torch.float32"},
    {"exp_avg_sq_dtype", K_FN, 0, 0, read_te_exp_avg_sq, "torch.float32"},
    {"use_decoupled_grad", K_BOOL, R(optim.decoupled_grad), 0, NULL, "false"},
    {"store_param_remainders", K_BOOL, R(optim.remainders), 0, NULL, "false"},
    IGNORE("capturable"), IGNORE("set_grad_none"),
    {NULL, 0, 0, 0, NULL, NULL}};

static int read_lr_style(struct reader *rd, struct am_node *v, const char *key)
{
    static const char *const names[] = {"constant", "linear", "cosine", NULL};
    int i;
    if (am_node_choice(v, key, names, &i, rd->err) < 0)
        return -1;
    rd->r->lr.style = (enum am_lr_style)i;
    return 0;
}

static const struct key_spec lr_keys[] = {
    {"lr_decay_style", K_FN, 0, 0, read_lr_style, NULL},
    {"lr_warmup_steps", K_LONG, R(lr.warmup_steps), 0, NULL, NULL},
    {"lr_decay_steps", K_LONG, R(lr.decay_steps), 1, NULL, NULL},
    {"min_lr", K_DOUBLE, R(lr.min_lr), 0, NULL, NULL},
    IGNORE("_target_"), IGNORE("init_lr"), IGNORE("start_weight_decay"), IGNORE("end_weight_decay"),
    IGNORE("weight_decay_incr_style"), IGNORE("use_checkpoint_opt_param_scheduler"),
    {NULL, 0, 0, 0, NULL, NULL}};

static int read_save_format(struct reader *rd, struct am_node *v, const char *key)
{
    static const char *const names[] = {"safetensors", "torch_save", NULL};
    int i;
    if (am_node_choice(v, key, names, &i, rd->err) < 0)
        return -1;
    if (i == 1)
        add_note(rd, "%s: torch_save: am writes Hugging Face safetensors checkpoints%s", key, "");
    return 0;
}

/* checkpoint.save_consolidated, as AutoModel's SaveConsolidatedMode: false, true or every (a
 * Hugging Face directory in every checkpoint), final (in the one at the end of training only). */
static int read_save_consolidated(struct reader *rd, struct am_node *v, const char *key)
{
    static const char *const names[] = {"false", "False", "FALSE", "true", "True", "TRUE", "every", "final", NULL};
    int i;
    if (am_node_choice(v, key, names, &i, rd->err) < 0)
        return -1;
    rd->r->ckpt.save_consolidated = i >= 3;
    rd->r->ckpt.consolidated_final = i == 7;
    return 0;
}

/* checkpoint.is_peft: the checkpoints hold LoRA adapters, which is what am's checkpoints of a
 * recipe with a peft section hold; without one it is refused (after the peft section is read). */
static int read_is_peft(struct reader *rd, struct am_node *v, const char *key)
{
    bool b = false;
    if (am_node_is_null(v) || am_node_bool(v, key, &b, rd->err) < 0 || !b)
        return 0;
    rd->is_peft = v;
    (void)key;
    return 0;
}

/* ---- peft: LoRA (AutoModel's PeftConfig) ------------------------------------------- */


static int read_peft_target(struct reader *rd, struct am_node *v, const char *key)
{
    if (!am_node_is_null(v) && v->kind == AM_NODE_SCALAR && !strstr(v->str, "PeftConfig")) {
        am_errorf(rd->err, &v->pos, "%s: '%.80s' is not AutoModel's LoRA configuration (use "
                  "nemo_automodel.components._peft.lora.PeftConfig)", key, v->str);
        return -1;
    }
    return 0;
}

static int read_peft_modules(struct reader *rd, struct am_node *v, const char *key)
{
    if (am_node_is_null(v))
        return 0;
    if (v->kind == AM_NODE_MAP) {
        am_errorf(rd->err, &v->pos, "%s: expected a module name pattern or a list of them ('*.q_proj')", key);
        return -1;
    }
    for (size_t i = 0; v->kind == AM_NODE_SEQ && i < v->n; i++) {
        if (v->entries[i].value->kind != AM_NODE_SCALAR) {
            am_errorf(rd->err, &v->entries[i].value->pos, "%s: expected a module name pattern ('*.q_proj')", key);
            return -1;
        }
    }
    if (strstr(key, "exclude"))
        rd->peft_excludes = v;
    else
        rd->peft_targets = v;
    return 0;
}

static int read_peft_all_linear(struct reader *rd, struct am_node *v, const char *key)
{
    return am_node_is_null(v) ? 0 : am_node_bool(v, key, &rd->peft_match_all, rd->err);
}

static int read_peft_rank_scaling(struct reader *rd, struct am_node *v, const char *key)
{
    return am_node_is_null(v) ? 0 : am_node_bool(v, key, &rd->r->peft.rank_scaling, rd->err);
}

static int read_peft_alpha(struct reader *rd, struct am_node *v, const char *key)
{
    if (am_node_double(v, key, &rd->r->peft.alpha, rd->err) < 0)
        return -1;
    if (!(rd->r->peft.alpha > 0)) {
        am_errorf(rd->err, &v->pos, "%s: %s: the adapters' scale alpha / dim must be positive (AutoModel's "
                  "default is 32)", key, v->str);
        return -1;
    }
    return 0;
}

/* dropout: torch.nn.functional.dropout's p on each adapter (lora.h), in [0, 1) */
static int read_peft_dropout(struct reader *rd, struct am_node *v, const char *key)
{
    double d = 0;
    if (am_node_is_null(v) || am_node_double(v, key, &d, rd->err) < 0)
        return am_node_is_null(v) ? 0 : -1;
    if (!(d >= 0 && d < 1)) {
        am_errorf(rd->err, &v->pos, "%s: %s: the adapters' dropout probability must be in [0, 1) (0.0: no "
                  "dropout)", key, v->str);
        return -1;
    }
    rd->r->peft.dropout = d;
    return 0;
}

static int read_peft_dropout_position(struct reader *rd, struct am_node *v, const char *key)
{
    static const char *const names[] = {"post", "pre", NULL};
    int i = 0;
    if (!am_node_is_null(v) && am_node_choice(v, key, names, &i, rd->err) < 0)
        return -1;
    rd->r->peft.dropout_pre = i == 1;
    return 0;
}

static int read_peft_dora(struct reader *rd, struct am_node *v, const char *key)
{
    bool b = false;
    if (am_node_is_null(v) || am_node_bool(v, key, &b, rd->err) < 0 || !b)
        return 0;
    am_errorf(rd->err, &v->pos, "%s: true: DoRA (weight-decomposed adapters, a learned magnitude per output) "
              "is not supported by am (set use_dora: false for LoRA)", key);
    return -1;
}

static int read_peft_init(struct reader *rd, struct am_node *v, const char *key)
{
    static const char *const names[] = {"xavier", "kaiming", NULL};
    int i;
    if (am_node_choice(v, key, names, &i, rd->err) < 0)
        return -1;
    rd->r->peft.a_init = (enum am_lora_init)i;
    return 0;
}

static int read_peft_dtype(struct reader *rd, struct am_node *v, const char *key)
{
    if (am_node_is_null(v))
        return 0;
    int rc = read_dtype(rd, v, key, &rd->r->peft.lora_dtype);
    rd->r->peft.dtype_set = rc == 0;
    return rc < 0 ? -1 : 0;
}

static const struct key_spec peft_keys[] = {
    {"_target_", K_FN, 0, 0, read_peft_target, NULL},
    {"target_modules", K_FN, 0, 0, read_peft_modules, NULL},
    {"exclude_modules", K_FN, 0, 0, read_peft_modules, NULL},
    {"match_all_linear", K_FN, 0, 0, read_peft_all_linear, NULL},
    {"dim", K_LONG, R(peft.dim), 1, NULL, "8"},
    {"alpha", K_FN, 0, 0, read_peft_alpha, "32"},
    {"dropout", K_FN, 0, 0, read_peft_dropout, NULL},
    {"dropout_position", K_FN, 0, 0, read_peft_dropout_position, NULL},
    {"use_dora", K_FN, 0, 0, read_peft_dora, NULL},
    {"lora_A_init", K_FN, 0, 0, read_peft_init, NULL},
    {"lora_dtype", K_FN, 0, 0, read_peft_dtype, NULL},
    {"moe_rank_scaling", K_FN, 0, 0, read_peft_rank_scaling, NULL},
    /* the others choose kernels (use_triton, use_memory_efficient_lora) or the experts' storage
     * (expert_weight_format) */
    IGNORE("use_triton"), IGNORE("use_memory_efficient_lora"), IGNORE("expert_weight_format"),
    {NULL, 0, 0, 0, NULL, NULL}};

/* AutoModel's wildcard_match: the pattern is a regular expression anchored at both ends in
 * which every '*' (with a '.' just before it) matches any text, and any other '.' matches one
 * character; other characters match themselves. */
static bool lora_wildcard(const char *p, const char *s)
{
    if (*p == '.' && p[1] == '*')
        p++;
    if (*p == '*') {
        for (const char *t = s;; t++) {
            if (lora_wildcard(p + 1, t))
                return true;
            if (!*t)
                return false;
        }
    }
    if (!*p)
        return !*s;
    return *s && (*p == '.' || *p == *s) && lora_wildcard(p + 1, s + 1);
}

/* Whether any pattern of a string or list node matches the module's dotted path. */
static bool lora_any(const struct am_node *v, const char *path)
{
    if (v->kind == AM_NODE_SCALAR)
        return strcmp(v->str, path) == 0 || lora_wildcard(v->str, path);
    for (size_t i = 0; i < v->n; i++)
        if (lora_any(v->entries[i].value, path))
            return true;
    return false;
}

/* The Hugging Face path of target t in layer l of model m ("model.layers.3.self_attn.q_proj");
 * false when m has no such projection (am_lora_target_path_of). */
static bool lora_path(const struct am_model_config *m, char *buf, size_t len, long l, int t)
{
    const char *p = am_lora_target_path_of(m, t);
    if (!p)
        return false;
    if (t == AM_LORA_HEAD)
        snprintf(buf, len, "lm_head");
    else
        snprintf(buf, len, "model.layers.%ld.%s", l, p);
    return true;
}

static bool lora_selects(struct reader *rd, const char *path)
{
    if (rd->peft_match_all)
        return true;
    if (rd->peft_targets)
        return lora_any(rd->peft_targets, path);
    return !lora_any(rd->peft_excludes, path);
}

/* Which linear layers AutoModel's ModuleMatcher picks, checked against what am adapts. */
/* The Hugging Face path of layer l's experts ("model.layers.3.block_sparse_moe.experts"). */
static void experts_path(const struct am_model_config *m, char *buf, size_t len, long l)
{
    bool mixtral = m->model_type && strcmp(m->model_type, "mixtral") == 0;
    snprintf(buf, len, "model.layers.%ld.%s.experts", l, mixtral ? "block_sparse_moe" : "mlp");
}

/* The Hugging Face path of MLP projection k (AM_LORA_GATE .. AM_LORA_DOWN) of layer l of a
 * DeepSeekMoE model (glm4_moe, deepseek_v3): a dense layer's ("model.layers.0.mlp.gate_proj")
 * or a MoE layer's shared experts' ("model.layers.3.mlp.shared_experts.gate_proj"). false when
 * the layer has neither (a MoE layer without shared experts). */
static bool deepseekmoe_mlp_path(const struct am_model_config *m, char *buf, size_t len, long l, int k)
{
    bool moe = am_model_layer_is_moe(m, l);
    if (moe && m->n_shared_experts <= 0)
        return false;
    snprintf(buf, len, "model.layers.%ld.mlp.%s%s", l, moe ? "shared_experts." : "", am_lora_target_name(k));
    return true;
}

/* A mixture-of-experts model: am adapts its attention projections (AutoModel's adapters on
 * q, k, v, o) and its experts (AutoModel's GroupedExpertsLoRA: a target_modules pattern that
 * matches model.layers.N.mlp.experts, as '*' does; match_all_linear and exclude_modules pick
 * linear layers only, which the experts are not), at rank dim or, with moe_rank_scaling, dim /
 * num_experts_per_tok. A DeepSeekMoE model's MLPs (glm4_moe, deepseek_v3: the dense layers'
 * mlp.gate_proj, up_proj, down_proj and the MoE layers' mlp.shared_experts.*: linear layers,
 * which '*_proj' and match_all_linear pick) are adapted as one target each: in all of those
 * layers or in none. Refused: the experts of some MoE layers only, a DeepSeekMoE MLP projection
 * in some of its layers only, and the MLP projections of the other models' dense layers. -1
 * with the message. */
static int moe_targets(struct reader *rd, struct am_pos at)
{
    const struct am_model_config *m = &rd->r->model;
    static const char fix[] = "on a mixture-of-experts model am adapts the attention projections (target_modules: "
                              "['*.q_proj', '*.k_proj', '*.v_proj', '*.o_proj'])";
    char path[128];
    long n_moe = 0, n_sel = 0, n_mlp = 0, mlp_sel[AM_LORA_DOWN + 1] = {0};
    for (long l = 0; l < m->num_hidden_layers; l++) {
        if (m->sigmoid_router && deepseekmoe_mlp_path(m, path, sizeof(path), l, AM_LORA_GATE)) {
            n_mlp++;
            for (int k = AM_LORA_GATE; k <= AM_LORA_DOWN; k++) {
                deepseekmoe_mlp_path(m, path, sizeof(path), l, k);
                mlp_sel[k] += lora_selects(rd, path);
            }
        }
        if (am_model_layer_is_moe(m, l)) {
            experts_path(m, path, sizeof(path), l);
            n_moe++;
            n_sel += rd->peft_targets && lora_any(rd->peft_targets, path);
            continue;
        }
        for (int k = AM_LORA_GATE; k <= AM_LORA_DOWN && !m->sigmoid_router; k++) {
            lora_path(m, path, sizeof(path), l, k);
            if (lora_selects(rd, path)) {
                am_errorf(rd->err, rd->peft_targets ? &rd->peft_targets->pos : rd->peft_excludes ? &rd->peft_excludes->pos : &at,
                          "peft: the patterns select %s of dense layer %ld: adapters on the MLP of a "
                          "mixture-of-experts model's dense layers are not supported by am yet; %s", path, l, fix);
                return -1;
            }
        }
    }
    for (int k = AM_LORA_GATE; k <= AM_LORA_DOWN; k++) {
        const char *name = am_lora_target_name(k);
        if (mlp_sel[k] > 0 && mlp_sel[k] < n_mlp) {
            am_errorf(rd->err, &(rd->peft_targets ? rd->peft_targets : rd->peft_excludes)->pos,
                      "peft: the patterns select %s in %ld of the %ld layers with an MLP (the dense layers' "
                      "mlp.%s, the shared experts' mlp.shared_experts.%s); am adapts a projection in every such "
                      "layer or in none (select it in all, as '*.%s')", name, mlp_sel[k], n_mlp, name, name, name);
            return -1;
        }
        if (mlp_sel[k] > 0)
            rd->r->peft.targets |= 1u << k;
    }
    if (n_sel > 0 && n_sel < n_moe) {
        am_errorf(rd->err, &rd->peft_targets->pos, "peft: the patterns select the experts in %ld of the %ld "
                  "mixture-of-experts layers; am adapts the experts in every such layer or in none (select them "
                  "in all layers, as '*.experts')", n_sel, n_moe);
        return -1;
    }
    rd->r->peft.experts = n_sel > 0;
    /* AutoModel's moe_rank_scaling: rank dim // n_activated_experts (a rank below 1 is refused
     * by am_validate_run, naming both numbers) */
    long k = m->num_experts_per_tok, d = rd->r->peft.dim;
    rd->r->peft.experts_dim = n_sel > 0 && rd->r->peft.rank_scaling && k > 0 ? d / k : d;
    if (n_sel > 0 && rd->r->peft.rank_scaling && k > 0 && d >= k && d % k) {
        char a[64], b[64];
        snprintf(a, sizeof(a), "%ld is not a multiple of num_experts_per_tok %ld", d, k);
        snprintf(b, sizeof(b), "%ld // %ld = %ld", d, k, d / k);
        add_note(rd, "peft.moe_rank_scaling: dim %s: the experts' adapters take rank %s, rounded down as AutoModel "
                 "does", a, b);
    }
    return 0;
}

static void resolve_peft(struct reader *rd, struct am_pos at)
{
    size_t before = rd->err->n;
    struct am_recipe *r = rd->r;
    const struct am_model_config *m = &r->model;
    struct am_node *t = rd->peft_targets, *x = rd->peft_excludes;
    bool has_t = t && (t->kind == AM_NODE_SCALAR || t->n > 0), has_x = x && (x->kind == AM_NODE_SCALAR || x->n > 0);
    if (has_t && has_x) {
        am_errorf(rd->err, &x->pos, "peft: target_modules and exclude_modules exclude each other (keep one)");
        return;
    }
    if (rd->peft_match_all && (has_t || has_x)) {
        am_errorf(rd->err, &(has_t ? t : x)->pos, "peft: match_all_linear: true adapts every linear layer; "
                  "remove %s (or match_all_linear)", has_t ? "target_modules" : "exclude_modules");
        return;
    }
    static struct am_node proj = {.kind = AM_NODE_SCALAR, .str = "*_proj", .plain = true};
    rd->peft_targets = has_t ? t : has_x || rd->peft_match_all ? NULL : &proj; /* AutoModel's default */
    rd->peft_excludes = has_x ? x : NULL;
    long L = m->num_hidden_layers;
    char path[128];
    if (m->num_experts > 0 && moe_targets(rd, at) < 0)
        return;
    for (int k = 0; k < AM_LORA_NTARGETS && L > 0; k++) {
        if (m->num_experts > 0 && k >= AM_LORA_GATE && k <= AM_LORA_DOWN)
            continue; /* a mixture of experts: no MLP projection in its expert layers (moe_targets) */
        long n = 0;
        for (long l = 0; l < (k == AM_LORA_HEAD ? 1 : L); l++)
            n += lora_path(m, path, sizeof(path), l, k) && lora_selects(rd, path);
        if (n && k != AM_LORA_HEAD && n < L) {
            am_errorf(rd->err, &(rd->peft_targets ? rd->peft_targets : rd->peft_excludes)->pos,
                      "peft: the patterns select %s in %ld of the %ld layers; am adapts a projection in every "
                      "layer or in none (select it in all layers, as '*.%s')", am_lora_target_name_of(m, k), n, L,
                      am_lora_target_name_of(m, k));
            return;
        }
        if (n)
            r->peft.targets |= 1u << k;
    }
    /* a pattern that selects nothing is a typo or a module am does not have */
    const struct am_node *lists[] = {rd->peft_targets, rd->peft_excludes};
    for (int j = 0; j < 2 && L > 0; j++) {
        const struct am_node *v = lists[j];
        for (size_t i = 0; v && i < (v->kind == AM_NODE_SCALAR ? 1 : v->n); i++) {
            const struct am_node *pat = v->kind == AM_NODE_SCALAR ? v : v->entries[i].value;
            bool hit = false;
            for (int k = 0; k < AM_LORA_NTARGETS && !hit; k++)
                hit = lora_path(m, path, sizeof(path), k == AM_LORA_HEAD ? 0 : L - 1, k) && lora_any(pat, path);
            for (long l = 0; l < L && !hit && m->num_experts > 0; l++) {
                if (am_model_layer_is_moe(m, l)) { /* the experts (moe_targets) */
                    experts_path(m, path, sizeof(path), l);
                    hit = lora_any(pat, path);
                }
                for (int k = AM_LORA_GATE; k <= AM_LORA_DOWN && !hit && m->sigmoid_router; k++)
                    hit = deepseekmoe_mlp_path(m, path, sizeof(path), l, k) && lora_any(pat, path);
            }
            if (!hit) {
                bool leaf = false;
                for (int k = 0; k < AM_LORA_NTARGETS; k++)
                    leaf |= k != AM_LORA_HEAD && am_lora_target_name_of(m, k) &&
                            strcmp(pat->str, am_lora_target_name_of(m, k)) == 0;
                if (leaf)
                    am_errorf(rd->err, &pat->pos, "peft.%s: '%s' matches no module: a pattern is compared with "
                              "whole dotted paths such as model.layers.0.self_attn.q_proj (write '*.%s')",
                              j ? "exclude_modules" : "target_modules", pat->str, pat->str);
                else
                    am_errorf(rd->err, &pat->pos, "peft.%s: '%.80s' matches none of the linear layers am adapts "
                              "(model.layers.N.self_attn.%s, model.layers.N.mlp.{gate,up,down}_proj, lm_head)",
                              j ? "exclude_modules" : "target_modules", pat->str,
                              m->mla ? "{q_a,q_b,kv_a,kv_b,o}_proj (kv_a_proj_with_mqa)" : "{q,k,v,o}_proj");
            }
        }
    }
    if (!r->peft.targets && !r->peft.experts && rd->err->n == before)
        am_errorf(rd->err, &at, "peft: the section selects no linear layer to adapt (give target_modules, "
                  "such as '*_proj')");
}

/* A targeted layer's input and output sizes, in layer l (a mixture of experts' MLP
 * projections: a DeepSeekMoE MoE layer's shared experts, of n_shared_experts x
 * moe_intermediate_size; false when layer l has no such projection). */
static bool lora_shape(const struct am_model_config *m, int t, long l, double *in, double *out)
{
    double h = (double)m->hidden_size, q = (double)m->num_attention_heads * (double)m->head_dim,
           kv = (double)m->num_key_value_heads * (double)m->head_dim, I = (double)m->intermediate_size;
    static const int kinds[] = {0, 1, 1, 2, 3, 3, 4, 6, 7, 8, 5};
    if (t >= AM_LORA_GATE && t <= AM_LORA_DOWN && m->num_experts > 0 && am_model_layer_is_moe(m, l)) {
        I = (double)(m->n_shared_experts * m->moe_intermediate_size);
        if (I <= 0)
            return false;
    }
    if (!am_lora_target_path_of(m, t))
        return false;
    if (m->mla) { /* multi-head latent attention (runtime/model/mla.c) */
        double H = (double)m->num_attention_heads, qr = (double)m->q_lora_rank, kvr = (double)m->kv_lora_rank;
        double dn = (double)m->qk_nope_head_dim, dr = (double)m->qk_rope_head_dim, dv = (double)m->v_head_dim;
        switch (t) {
        case AM_LORA_Q: *in = qr > 0 ? qr : h, *out = H * (dn + dr); return true;
        case AM_LORA_O: *in = H * dv, *out = h; return true;
        case AM_LORA_Q_A: *in = h, *out = qr; return true;
        case AM_LORA_KV_A: *in = h, *out = kvr + dr; return true;
        case AM_LORA_KV_B: *in = kvr, *out = H * (dn + dv); return true;
        default: break;
        }
    }
    switch (kinds[t]) {
    case 0: *in = h, *out = q; break;
    case 1: *in = h, *out = kv; break;
    case 2: *in = q, *out = h; break;
    case 3: *in = h, *out = I; break;
    case 4: *in = I, *out = h; break;
    default: *in = h, *out = (double)m->vocab_size; break;
    }
    return true;
}

double am_lora_layer_params(const struct am_recipe *r, long l)
{
    double n = 0, in, out;
    for (int t = 0; r->peft.enabled && t < AM_LORA_HEAD; t++)
        if ((r->peft.targets & (1u << t)) && lora_shape(&r->model, t, l, &in, &out))
            n += (double)r->peft.dim * (in + out);
    return n;
}

double am_lora_layers_params(const struct am_recipe *r)
{
    double n = 0;
    for (long l = 0; l < r->model.num_hidden_layers; l++)
        n += am_lora_layer_params(r, l);
    return n;
}

double am_lora_head_params(const struct am_recipe *r)
{
    double in, out;
    if (!r->peft.enabled || !(r->peft.targets & (1u << AM_LORA_HEAD)))
        return 0;
    lora_shape(&r->model, AM_LORA_HEAD, 0, &in, &out);
    return (double)r->peft.dim * (in + out);
}

double am_lora_expert_params(const struct am_recipe *r, bool saved)
{
    const struct am_model_config *m = &r->model;
    if (!r->peft.enabled || !r->peft.experts)
        return 0;
    double layers = 0, d = (double)r->peft.experts_dim, C = (double)m->hidden_size;
    double I = (double)m->moe_intermediate_size;
    for (long l = 0; l < m->num_hidden_layers; l++)
        layers += am_model_layer_is_moe(m, l);
    /* an expert's A of gate and up (shared: saved twice, as gate's and up's), B of gate and up,
     * A and B of down */
    return layers * (double)m->num_experts * d * ((saved ? 3 : 2) * C + 3 * I);
}

static const struct key_spec checkpoint_keys[] = {
    {"enabled", K_BOOL, R(ckpt.enabled), 0, NULL, NULL},
    {"checkpoint_dir", K_STR, R(ckpt.dir), 0, NULL, NULL},
    {"restore_from", K_STR, R(ckpt.restore_from), 0, NULL, NULL},
    {"max_recent_checkpoints", K_OPT_LONG, R(ckpt.keep_last), 1, NULL, NULL},
    {"save_consolidated", K_FN, 0, 0, read_save_consolidated, "true"},
    {"model_save_format", K_FN, 0, 0, read_save_format, NULL},
    {"is_peft", K_FN, 0, 0, read_is_peft, NULL},
    /* where and how AutoModel writes and stages its files; dequantize_base_checkpoint: am
     * dequantizes an FP8 checkpoint whenever its config.json's quantization_config says it is one
     * (AutoModel's default, null, detects the same) and refuses the other quantizations (model_config.c);
     * v4_compatible writes transformers-4 config files;
     * skip_task_head_prefixes_for_base_model names heads of other tasks */
    IGNORE("dequantize_base_checkpoint"), IGNORE("model_cache_dir"),
    IGNORE("model_repo_id"), IGNORE("_target_"), IGNORE("v4_compatible"), IGNORE("skip_task_head_prefixes_for_base_model"),
    IGNORE("model_state_dict_keys"), IGNORE("is_async"), IGNORE("wait_for_staging"), IGNORE("cpu_offload"),
    IGNORE("allow_legacy_pickle_restore"), IGNORE("original_model_root_dir"), IGNORE("single_rank_consolidation"),
    IGNORE("staging_dir"), IGNORE("diffusers_compatible"), IGNORE("best_metric_key"),
    IGNORE("consolidation_timeout_minutes"),
    {NULL, 0, 0, 0, NULL, NULL}};

static const struct key_spec dist_env_keys[] = {
    {"timeout_minutes", K_DOUBLE, R(dist_env.timeout_minutes), 0, NULL, "10"},
    {"backend", K_STR, R(dist_env.backend), 0, NULL, NULL},
    {NULL, 0, 0, 0, NULL, NULL}};

static const struct key_spec clip_keys[] = {
    {"max_norm", K_OPT_DOUBLE, R(optim.max_grad_norm), 0, NULL, "1.0"}, /* null: no clipping */
    {"norm_type", K_FN, 0, 0, read_norm_type, NULL},
    IGNORE("foreach"), IGNORE("error_if_nonfinite"),
    {NULL, 0, 0, 0, NULL, NULL}};

static const struct key_spec rng_keys[] = {
    {"seed", K_LONG, R(seed), 0, NULL, "42"},
    {"ranked", K_BOOL, R(seed_ranked), 0, NULL, NULL},
    IGNORE("_target_"),
    {NULL, 0, 0, 0, NULL, NULL}};

static int read_norm_type(struct reader *rd, struct am_node *v, const char *key)
{
    double d;
    if (am_node_double(v, key, &d, rd->err) < 0)
        return -1;
    if (d != 2.0) {
        am_errorf(rd->err, &v->pos, "%s: %g is not supported by am (it clips by the L2 norm: use 2)", key, d);
        return -1;
    }
    return 0;
}

/* ---- the generic section reader ------------------------------------------------------ */

static void read_key(struct reader *rd, const struct key_spec *k, struct am_node *v, const char *key)
{
    char *base = (char *)rd->r;
    long l;
    if (v->failed)
        return;
    switch (k->kind) {
    case K_INT:
        if (am_node_long(v, key, k->min, INT_MAX, &l, rd->err) == 0)
            *(int *)(base + k->off) = (int)l;
        break;
    case K_SIZE:
        if (am_node_is_null(v))
            *(int *)(base + k->off) = 0;
        else if (am_node_long(v, key, k->min, 1 << 20, &l, rd->err) == 0)
            *(int *)(base + k->off) = (int)l;
        break;
    case K_LONG:
        if (am_node_long(v, key, k->min, LONG_MAX, &l, rd->err) == 0)
            *(long *)(base + k->off) = l;
        break;
    case K_OPT_LONG:
        if (am_node_is_null(v))
            *(long *)(base + k->off) = 0;
        else if (am_node_long(v, key, k->min, LONG_MAX, &l, rd->err) == 0)
            *(long *)(base + k->off) = l;
        break;
    case K_DOUBLE:
    case K_OPT_DOUBLE:
        if (k->kind == K_OPT_DOUBLE && am_node_is_null(v))
            *(double *)(base + k->off) = 0;
        else if (am_node_double(v, key, (double *)(base + k->off), rd->err) == 0 && *(double *)(base + k->off) < 0)
            am_errorf(rd->err, &v->pos, "%s: %g must not be negative", key, *(double *)(base + k->off));
        break;
    case K_BOOL:
        am_node_bool(v, key, (bool *)(base + k->off), rd->err);
        break;
    case K_STR:
        if (!am_node_is_null(v))
            am_node_str(v, key, (const char **)(base + k->off), rd->err);
        break;
    case K_FN:
        k->fn(rd, v, key);
        break;
    case K_IGNORE:
        break;
    }
}

static void read_section(struct reader *rd, struct am_node *sec, const char *name, const struct key_spec *keys)
{
    if (am_node_is_null(sec))
        return;
    if (sec->kind != AM_NODE_MAP) {
        am_errorf(rd->err, &sec->pos, "%s: expected a section of key: value lines", name);
        return;
    }
    const char *names[96];
    size_t n_names = 0;
    for (const struct key_spec *k = keys; k->name && n_names + 1 < sizeof(names) / sizeof(names[0]); k++)
        names[n_names++] = k->name;
    names[n_names] = NULL;
    for (size_t i = 0; i < sec->n; i++) {
        struct am_entry *e = &sec->entries[i];
        char key[256];
        snprintf(key, sizeof(key), "%s.%s", name, e->key);
        const struct key_spec *k = keys;
        while (k->name && strcmp(k->name, e->key) != 0)
            k++;
        e->used = true;
        if (!k->name)
            am_error_unknown_key(rd->err, &e->key_pos, name, e->key, names, NULL);
        else if (k->kind == K_IGNORE)
            add_ignored(rd, name, e->key);
        else
            read_key(rd, k, e->value, key);
    }
}

/* Each key of a table the recipe leaves out takes its row's default, read like the key itself. */
static void apply_defaults(struct reader *rd, const char *name, const struct key_spec *keys)
{
    for (const struct key_spec *k = keys; k->name; k++) {
        if (!k->def)
            continue;
        char key[256];
        snprintf(key, sizeof(key), "%s.%s (default)", name, k->name);
        struct am_node *v = am_yaml_parse(&rd->r->arena, rd->r->file, key, k->def, strlen(k->def), rd->err);
        if (v)
            read_key(rd, k, v, key);
    }
}

/* ---- model --------------------------------------------------------------------------- */

/* Loads config.json for model.pretrained_model_name_or_path (or model.config's) and
 * merges the inline keys over it, then reads the architecture. */
static void read_model(struct reader *rd, struct am_node *model)
{
    struct am_recipe *r = rd->r;
    if (!model || model->kind != AM_NODE_MAP) {
        struct am_pos pos = {.file = r->file};
        if (model)
            pos = model->pos;
        am_errorf(rd->err, &pos, "model: missing (give pretrained_model_name_or_path, or the architecture "
                  "with config.json keys such as hidden_size)");
        return;
    }
    struct am_node *target = am_node_path(model, "_target_");
    if (target && target->kind == AM_NODE_SCALAR && !strstr(target->str, "ForCausalLM")) {
        am_errorf(rd->err, &target->pos, "model._target_: '%.80s' is not a causal language model; am trains "
                  "decoder-only models on next-token prediction (NeMoAutoModelForCausalLM.from_pretrained or "
                  ".from_config)", target->str);
        for (size_t i = 0; i < model->n; i++)
            model->entries[i].used = true;
        return;
    }
    struct am_node *inline_cfg = model;
    struct am_node *sub = am_node_child(model, "config"); /* from_config recipes */
    if (sub && sub->kind == AM_NODE_MAP)
        inline_cfg = sub;
    struct am_node *src = am_node_child(model, "pretrained_model_name_or_path");
    if (!src && inline_cfg != model)
        src = am_node_child(inline_cfg, "pretrained_model_name_or_path");
    struct am_node *dtype = am_node_child(model, "torch_dtype");
    int dtype_rc = dtype ? read_dtype(rd, dtype, "model.torch_dtype", &r->param_dtype) : 1;
    if (dtype_rc < 0)
        return;

    /* model.config's own source when model names one too: the same checkpoint */
    if (inline_cfg != model && src && am_node_entry(model, "pretrained_model_name_or_path")) {
        struct am_entry *dup = am_node_entry(inline_cfg, "pretrained_model_name_or_path");
        if (dup && !dup->used) {
            dup->used = true;
            add_ignored(rd, "model.config", "pretrained_model_name_or_path");
        }
    }
    struct am_node *merged = inline_cfg;
    r->model_source = "inline";
    if (src) {
        const char *name;
        char path[4096], looked[4096];
        if (am_node_str(src, "model.pretrained_model_name_or_path", &name, rd->err) < 0)
            return;
        if (am_model_resolve(name, path, sizeof(path), looked, sizeof(looked)) < 0) {
            char similar[1024];
            int slashes = 0;
            for (const char *c = name; *c; c++)
                slashes += *c == '/';
            if (slashes != 1 || name[0] == '/' || name[0] == '.' || name[0] == '~') {
                am_errorf(rd->err, &src->pos, "model.pretrained_model_name_or_path: '%s' not found; looked in %s "
                          "(give a directory with config.json, a hub id ORG/NAME, or write the architecture under "
                          "model:)", name, looked);
                return;
            }
            int n = am_model_similar(name, similar, sizeof(similar));
            am_errorf(rd->err, &src->pos, "model.pretrained_model_name_or_path: '%s' not found; looked in %s. am "
                      "needs only its config.json to plan: huggingface-cli download %s config.json%s%s%s", name,
                      looked, name, n ? " (close matches: " : "", n ? similar : "", n ? ")" : "");
            return;
        }
        struct am_node *cfg = am_json_file_to_node(&r->arena, path, rd->err);
        if (!cfg)
            return;
        r->model_source = am_arena_strdup(&r->arena, path);
        /* inline keys override config.json */
        for (size_t i = 0; i < inline_cfg->n; i++) {
            struct am_entry *e = &inline_cfg->entries[i];
            if (e->used)
                continue;
            struct am_entry *j = am_node_entry(cfg, e->key);
            if (j) {
                j->value = e->value;
                j->key_pos = e->key_pos;
            } else if (am_node_append(&r->arena, cfg, e->key, e->key_pos, e->value) < 0) {
                am_errorf(rd->err, NULL, "%s: out of memory", r->file);
                return;
            }
        }
        merged = cfg;
    }
    /* keys of `model` itself when the architecture sits under model.config */
    if (inline_cfg != model)
        for (size_t i = 0; i < model->n; i++)
            if (!model->entries[i].used) {
                model->entries[i].used = true;
                add_ignored(rd, "model", model->entries[i].key);
            }
    const char *section = inline_cfg == model ? "model" : "model.config";
    if (am_model_config_read(&r->arena, merged, section, &r->model, &r->ignored, rd->err) < 0)
        return;
    /* AutoModel's own deepseek_v3 (NeMoAutoModelForCausalLM without force_hf) builds its gates
     * with gate_bias_update_factor 1e-3 unless moe_overrides or moe_config says otherwise;
     * transformers' class (am's inline model, force_hf: true) updates nothing */
    const struct am_node *force = am_node_path(model, "force_hf");
    if (r->model.mla && !r->model.bias_update_set && target && target->kind == AM_NODE_SCALAR &&
        strstr(target->str, "NeMoAutoModel") &&
        !(force && force->kind == AM_NODE_SCALAR && strcmp(force->str, "true") == 0))
        r->model.gate_bias_update_factor = 1e-3;
    /* AutoModel's own gpt_oss and qwen3_moe build their gates with aux_loss_coeff =
     * router_aux_loss_coef unless moe_overrides or moe_config says otherwise, and add no
     * transformers' loss whatever output_router_logits says; transformers' class (am's inline
     * model, force_hf: true) adds transformers' loss with output_router_logits */
    bool own = target && target->kind == AM_NODE_SCALAR && strstr(target->str, "NeMoAutoModel") &&
               !(force && force->kind == AM_NODE_SCALAR && strcmp(force->str, "true") == 0);
    bool qwen3_moe = r->model.model_type && strcmp(r->model.model_type, "qwen3_moe") == 0;
    if (own && r->model.num_experts > 0 && (r->model.gpt_oss || qwen3_moe || r->model.sigmoid_router))
        r->model.automodel_gate = true;
    if (own && r->model.num_experts > 0 && (r->model.gpt_oss || qwen3_moe) && !r->model.aux_loss_set)
        r->model.aux_loss_coeff = r->model.router_aux_loss_coef > 0 ? r->model.router_aux_loss_coef : 0.0;
    if (dtype_rc == 1 && r->model.torch_dtype) { /* absent or "auto": the checkpoint's dtype */
        struct am_node v = {.kind = AM_NODE_SCALAR, .str = r->model.torch_dtype, .plain = true};
        read_dtype(rd, &v, "config.json torch_dtype", &r->param_dtype);
    } else if (dtype_rc == 1) {
        r->param_dtype_assumed = true; /* neither the recipe nor config.json: bfloat16 */
    }
}

/* ---- top level ----------------------------------------------------------------------- */

static const char *const owned_sections[] = {"model", "distributed", "step_scheduler", "dataset",
                                             "packed_sequence", "optimizer", "lr_scheduler", "checkpoint",
                                             "dist_env", "rng", "clip_grad_norm", "peft", NULL};

/* Top-level sections of features that change what is trained and that am does not have: a
 * recipe with one is refused, never trained without it. */
static const struct {
    const char *section, *why;
} refused_sections[] = {
    {"teacher_model", "knowledge distillation from a teacher model is not supported by am (remove teacher_model, "
                      "kd_loss_fn and kd_ratio to train on next-token prediction alone)"},
    {"kd_loss_fn", "knowledge distillation from a teacher model is not supported by am (remove teacher_model, "
                   "kd_loss_fn and kd_ratio to train on next-token prediction alone)"},
    {"quantization", "quantized training is not supported by am: it trains bf16 or fp32 weights (remove the section)"},
    {"qat", "quantization-aware training is not supported by am: it trains bf16 or fp32 weights (remove the section)"},
    {"neftune", "NEFTune adds noise to the embeddings in training, which am does not do (remove the section)"},
    {"freeze_config", "freezing parts of the model is not supported by am: it trains every weight (remove the "
                      "section)"},
};

/* fp8: torchao's Float8 training. enabled: false (or no section) changes nothing. */
static void read_fp8(struct reader *rd, struct am_node *fp8)
{
    struct am_node *en = am_node_child(fp8, "enabled");
    bool on = false;
    for (size_t i = 0; i < fp8->n; i++)
        fp8->entries[i].used = true;
    if (en && !am_node_is_null(en) && am_node_bool(en, "fp8.enabled", &on, rd->err) < 0)
        return;
    if (!on) {
        add_ignored(rd, "", "fp8");
        return;
    }
    am_errorf(rd->err, &en->pos, "fp8.enabled: true: FP8 matrix multiplications are not supported by am: it "
              "computes in bf16 or fp32 (set fp8.enabled: false)");
}

/* compile: torch.compile changes how the model is computed, not what: am runs its own kernels. */
static void read_compile(struct reader *rd, struct am_node *c)
{
    if (c->kind == AM_NODE_MAP)
        for (size_t i = 0; i < c->n; i++)
            c->entries[i].used = true;
    add_ignored(rd, "", "compile");
    struct am_node *en = c->kind == AM_NODE_MAP ? am_node_child(c, "enabled") : NULL;
    if (en && en->kind == AM_NODE_SCALAR && (strcmp(en->str, "true") == 0 || strcmp(en->str, "True") == 0))
        add_note(rd, "compile: enabled: am runs its own kernels; torch.compile would change how the model is "
                 "computed, not what%s%s", "", "");
}

/* Experiment trackers' sections: am's C runtime speaks none of their services' protocols;
 * rank 0 writes TensorBoard event files instead, and the note says how to look at them. */
static bool tracker_section(struct reader *rd, const char *key)
{
    static const struct {
        const char *section, *import;
    } trackers[] = {
        {"wandb", "import them into W&B with wandb sync --sync-tensorboard DIR"},
        {"mlflow", "view them with tensorboard --logdir DIR"},
        {"comet", "view them with tensorboard --logdir DIR"},
    };
    for (size_t i = 0; i < sizeof trackers / sizeof trackers[0]; i++) {
        if (strcmp(key, trackers[i].section) != 0)
            continue;
        add_ignored(rd, "", key);
        add_note(rd, "%s: am-train logs to no tracking service; rank 0 writes TensorBoard event files in <log "
                 "dir>/<job id>/tensorboard (docs/diagnostics.md, \"TensorBoard\"): %s", key,
                 trackers[i].import);
        return true;
    }
    return false;
}

static void read_recipe(struct reader *rd)
{
    struct am_recipe *r = rd->r;
    struct am_node *root = r->root;
    if (root->kind != AM_NODE_MAP) {
        struct am_pos pos = root->pos;
        am_errorf(rd->err, &pos, "a recipe is a YAML mapping of sections (model:, distributed:, ...); this "
                  "file is not");
        return;
    }
    am_node_resolve_env(&r->arena, root, owned_sections, rd->err);
    /* top-level keys am does not own are another component's: ignored, unless a typo */
    bool refused_kd = false;
    for (size_t i = 0; i < root->n; i++) {
        struct am_entry *e = &root->entries[i];
        if (am_key_in(e->key, owned_sections))
            continue;
        size_t k = 0, n_refused = sizeof(refused_sections) / sizeof(refused_sections[0]);
        while (k < n_refused && strcmp(e->key, refused_sections[k].section) != 0)
            k++;
        if (k < n_refused && !am_node_is_null(e->value)) {
            e->used = true;
            bool kd = strcmp(e->key, "teacher_model") == 0 || strcmp(e->key, "kd_loss_fn") == 0;
            if (!(kd && refused_kd))
                am_errorf(rd->err, &e->key_pos, "%s: %s", e->key, refused_sections[k].why);
            refused_kd = refused_kd || kd;
            continue;
        }
        if (strcmp(e->key, "fp8") == 0 && e->value->kind == AM_NODE_MAP) {
            e->used = true;
            read_fp8(rd, e->value);
            continue;
        }
        if (strcmp(e->key, "recipe") == 0 && e->value->kind == AM_NODE_SCALAR &&
            (strstr(e->value->str, "VLM") || strstr(e->value->str, "SequenceClassification"))) {
            e->used = true;
            am_errorf(rd->err, &e->value->pos, "recipe: %.60s trains %s; am trains text-only causal language "
                      "models on next-token prediction", e->value->str,
                      strstr(e->value->str, "VLM") ? "a vision-language model" : "a sequence classifier");
            continue;
        }
        if (strcmp(e->key, "compile") == 0) {
            e->used = true;
            read_compile(rd, e->value);
            continue;
        }
        if (tracker_section(rd, e->key)) {
            e->used = true;
            continue;
        }
        for (int j = 0; owned_sections[j]; j++) {
            if (am_edit_distance(e->key, owned_sections[j], 2) <= 2) {
                am_error_unknown_key(rd->err, &e->key_pos, "", e->key, owned_sections, NULL);
                goto next;
            }
        }
        e->used = true;
        add_ignored(rd, "", e->key);
    next:;
    }

    /* AutoModel's defaults: the tables' (each key's row), and the parameters' dtype (model.torch_dtype
     * or config.json's, else bfloat16: read_model) */
    static const struct {
        const char *name;
        const struct key_spec *keys;
    } tables[] = {{"distributed", distributed_keys}, {"distributed.pipeline", pipeline_keys},
                  {"step_scheduler", step_keys},     {"dataset", dataset_keys},
                  {"packed_sequence", packed_keys},  {"optimizer", optimizer_keys},
                  {"lr_scheduler", lr_keys},         {"checkpoint", checkpoint_keys},
                  {"dist_env", dist_env_keys},       {"clip_grad_norm", clip_keys},
                  {"rng", rng_keys}};
    for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++)
        apply_defaults(rd, tables[i].name, tables[i].keys);
    r->param_dtype = AM_BF16;

    read_model(rd, am_node_child(root, "model"));
    read_section(rd, am_node_child(root, "distributed"), "distributed", distributed_keys);
    read_section(rd, am_node_child(root, "step_scheduler"), "step_scheduler", step_keys);
    struct am_node *ds = am_node_child(root, "dataset");
    struct am_node *target = am_node_path(ds, "_target_");
    if (target && target->kind == AM_NODE_SCALAR && !strstr(target->str, "egatron")) {
        r->data.foreign = true;
        for (size_t i = 0; i < ds->n; i++)
            if (!am_key_in(ds->entries[i].key, seq_length_names)) {
                ds->entries[i].used = true;
                add_ignored(rd, "dataset", ds->entries[i].key);
            }
        for (int k = 0; seq_length_names[k]; k++) {
            struct am_entry *seq = am_node_entry(ds, seq_length_names[k]);
            if (!seq)
                continue;
            struct am_node only = *ds;
            only.entries = seq;
            only.n = 1;
            read_section(rd, &only, "dataset", foreign_dataset_keys);
            if (r->data.seq_length > 0) {
                r->data.seq_key = seq_length_names[k];
                break;
            }
        }
    } else {
        read_section(rd, ds, "dataset", dataset_keys);
    }
    read_section(rd, am_node_child(root, "packed_sequence"), "packed_sequence", packed_keys);
    /* an optimizer am does not run: that alone (its own keys would only add noise) */
    struct am_node *opt = am_node_child(root, "optimizer"), *opt_target = am_node_path(opt, "_target_");
    struct am_errors quiet;
    am_errors_init(&quiet);
    struct reader probe = {.r = r, .err = &quiet};
    if (opt && opt->kind == AM_NODE_MAP && opt_target && read_optimizer_target(&probe, opt_target, "") < 0) {
        read_optimizer_target(rd, opt_target, "optimizer._target_");
        for (size_t i = 0; i < opt->n; i++)
            opt->entries[i].used = true;
    } else if (opt && opt->kind == AM_NODE_MAP && opt_target && opt_target->kind == AM_NODE_SCALAR &&
               te_fused_adam(opt_target->str)) {
        apply_defaults(rd, "optimizer", te_adam_keys);
        read_section(rd, opt, "optimizer", te_adam_keys);
    } else {
        read_section(rd, opt, "optimizer", optimizer_keys);
    }
    am_errors_free(&quiet);
    read_section(rd, am_node_child(root, "lr_scheduler"), "lr_scheduler", lr_keys);
    read_section(rd, am_node_child(root, "checkpoint"), "checkpoint", checkpoint_keys);
    read_section(rd, am_node_child(root, "dist_env"), "dist_env", dist_env_keys);
    read_section(rd, am_node_child(root, "rng"), "rng", rng_keys);
    struct am_node *peft = am_node_child(root, "peft");
    if (peft && !am_node_is_null(peft)) {
        struct am_entry *pe = am_node_entry(root, "peft");
        size_t before = rd->err->n;
        r->peft.enabled = true;
        apply_defaults(rd, "peft", peft_keys);
        read_section(rd, peft, "peft", peft_keys);
        if (rd->err->n == before && peft->kind == AM_NODE_MAP)
            resolve_peft(rd, pe ? pe->key_pos : peft->pos);
    }
    if (rd->is_peft && !r->peft.enabled)
        am_errorf(rd->err, &rd->is_peft->pos, "checkpoint.is_peft: true: the checkpoints would hold LoRA adapters, "
                  "but the recipe has no peft section and trains every weight (add the peft section for a LoRA "
                  "fine-tune, or remove is_peft)");
    read_section(rd, am_node_child(root, "clip_grad_norm"), "clip_grad_norm", clip_keys);

    /* sizes not given are 1 (dp: inferred later) */
    int *sizes[] = {&r->dist.tp, &r->dist.pp, &r->dist.cp, &r->dist.ep};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
        if (*sizes[i] == 0)
            *sizes[i] = 1;
    /* mixed precision: AutoModel's default policy (bf16 compute, fp32 reduction) without an
     * mp_policy; a policy given keeps a dtype it leaves out as torch's None does (the compute
     * dtype stays the model's; the reduction follows the compute dtype) */
    bool policy = am_node_path(root, "distributed.mp_policy") &&
                  !am_node_is_null(am_node_path(root, "distributed.mp_policy"));
    if (!am_node_path(root, "distributed.mp_policy.param_dtype"))
        r->compute_dtype = r->dist.strategy == AM_DDP || policy ? r->param_dtype : AM_BF16;
    if (!am_node_path(root, "distributed.mp_policy.reduce_dtype"))
        r->reduce_dtype = policy ? r->compute_dtype : AM_F32;
    r->grad_shard_dtype = r->dist.strategy == AM_FSDP2 && r->param_dtype == AM_BF16 ? AM_BF16 : AM_F32;
    /* what the optimizer keeps: torch's, everything in the parameters' dtype; FusedAdam, its own */
    r->optim.split_master = r->optim.te && r->optim.master_weights && r->optim.remainders &&
                            r->optim.master_weight_dtype == AM_F32 && r->param_dtype == AM_BF16;
    r->optim.master_dtype = r->optim.te && r->optim.master_weights && !r->optim.split_master
                                ? r->optim.master_weight_dtype
                                : r->param_dtype;
    r->optim.moment_dtype[0] = r->optim.te ? r->optim.exp_avg_dtype : r->param_dtype;
    r->optim.moment_dtype[1] = r->optim.te ? r->optim.exp_avg_sq_dtype : r->param_dtype;
    if (r->optim.te && !r->optim.split_master && r->optim.master_dtype == AM_BF16)
        add_note(rd, "model.torch_dtype: bfloat16%s: FusedAdam without master_weights steps the bf16 parameters "
                 "themselves (master_weights: true keeps fp32 master weights beside them, as AutoModel's examples do)%s",
                 r->param_dtype_assumed ? " (assumed: no torch_dtype in the recipe or config.json)" : "", "");
    if (r->param_dtype == AM_BF16 && !r->optim.te) /* AutoModel's guide: "Risky Pattern: torch AdamW with bf16 Model Storage" */
        add_note(rd, "model.torch_dtype: bfloat16: the parameters%s and AdamW's moments are kept in bf16, as torch "
                 "keeps them (fine for fine-tuning; for long full-parameter training model.torch_dtype: float32 "
                 "keeps fp32 master weights and moments, still computing in bf16)%s", r->param_dtype_assumed ?
                 " (assumed: no torch_dtype in the recipe or config.json)" : "", "");
    if (!am_node_path(root, "rng.seed") && am_node_path(root, "dataset.seed"))
        r->seed = r->data.seed;
    if (!am_node_path(root, "dataset.seed"))
        r->data.seed = r->seed;
}

int am_override_parse(char *s, struct am_override *o)
{
    char *eq = strchr(s, '=');
    if (!eq || eq == s)
        return -1;
    *eq = '\0';
    o->path = s;
    o->value = eq + 1;
    return 0;
}

struct am_recipe *am_recipe_parse(const char *name, const char *buf, size_t len, const struct am_override *ov,
                                  size_t n_ov, struct am_errors *err)
{
    struct am_recipe *r = calloc(1, sizeof(*r));
    if (!r) {
        am_errorf(err, NULL, "%s: out of memory", name);
        return NULL;
    }
    am_arena_init(&r->arena, 64u << 20);
    r->file = am_arena_strdup(&r->arena, name);
    size_t before = err->n;
    r->root = am_yaml_parse(&r->arena, r->file, NULL, buf, len, err);
    if (!r->root) {
        if (err->n == before)
            am_errorf(err, NULL, "%s: out of memory while parsing", name);
        am_recipe_free(r);
        return NULL;
    }
    for (size_t i = 0; i < n_ov; i++) {
        char origin[512];
        snprintf(origin, sizeof(origin), "%s", ov[i].origin ? ov[i].origin : "--set");
        const char *o = am_arena_strdup(&r->arena, origin);
        struct am_pos pos = {.file = r->file, .origin = o};
        struct am_node *v = am_yaml_parse(&r->arena, r->file, o, ov[i].value, strlen(ov[i].value), err);
        if (!v)
            continue;
        if (v->kind == AM_NODE_MAP && v->n == 0) { /* "tp_size=" : an empty value */
            v->kind = AM_NODE_SCALAR;
            v->str = "";
            v->plain = true;
        }
        if (r->root->kind == AM_NODE_MAP)
            am_node_set(&r->arena, r->root, ov[i].path, v, &pos, err);
    }
    struct reader rd = {.r = r, .err = err};
    read_recipe(&rd);
    return r;
}

struct am_recipe *am_recipe_load(const char *path, const struct am_override *ov, size_t n_ov, struct am_errors *err)
{
    char *buf;
    size_t len;
    const char *why = am_read_file(path, AM_RECIPE_MAX_BYTES, &buf, &len);
    if (why) {
        am_errorf(err, NULL, "%s: %s", path, why);
        return NULL;
    }
    struct am_recipe *r = am_recipe_parse(path, buf, len, ov, n_ov, err);
    free(buf);
    return r;
}

void am_recipe_free(struct am_recipe *r)
{
    if (!r)
        return;
    am_arena_free(&r->arena);
    free(r);
}

struct am_pos am_recipe_pos(const struct am_recipe *r, const char *path)
{
    struct am_node *n = am_node_path(r->root, path);
    if (n && (n->pos.line > 0 || n->pos.origin))
        return n->pos;
    return (struct am_pos){.file = r->file};
}

const char *am_strategy_name(enum am_strategy s) { return strategy_names[s]; }

const char *am_pp_schedule_name(enum am_pp_schedule s)
{
    static const char *const names[] = {"1f1b", "gpipe", "interleaved1f1b"};
    return names[s];
}

