/* validate.c - the layout rules (plan.h: am_validate). Each rule is a few lines and one
 * message naming the key, the rule, and values that would be valid. */
#include <stdio.h>
#include <string.h>

#include "plan.h"
#include "pp_schedule.h"

struct check {
    const struct am_recipe *r;
    struct am_errors *err;
    int added;
};

#define FAIL(c, key, ...)                                                                          \
    do {                                                                                           \
        struct am_pos pos_ = am_recipe_pos((c)->r, key);                                           \
        am_errorf((c)->err, &pos_, key ": " __VA_ARGS__);                                          \
        (c)->added++;                                                                              \
    } while (0)

/* "1, 2 or 4": the divisors of n up to max (at most 12 of them). */
static const char *divisors(long n, long max, char *buf, size_t len)
{
    long d[12];
    int k = 0;
    for (long i = 1; i <= n && i <= max && k < 12; i++)
        if (n % i == 0)
            d[k++] = i;
    buf[0] = '\0';
    for (int i = 0; i < k; i++) {
        size_t l = strlen(buf);
        snprintf(buf + l, len - l, "%s%ld", i == 0 ? "" : i == k - 1 ? " or " : ", ", d[i]);
    }
    return buf;
}

long am_recipe_seq_length(const struct am_recipe *r, bool *assumed)
{
    *assumed = false;
    if (r->packed_sequence_size > 0) /* documents or samples packed into sequences of this many tokens */
        return r->packed_sequence_size;
    if (!r->data.foreign && r->data.seq_length > 0) /* a Megatron dataset's samples: what am trains on */
        return r->data.seq_length;
    if (r->data.seq_length > 0)
        return r->data.seq_length;
    if (r->dist.pp > 1 && r->dist.pipeline.seq_len > 0)
        return r->dist.pipeline.seq_len;
    *assumed = true;
    return 2048;
}

static void strategy_rules(struct check *c)
{
    const struct am_recipe *r = c->r;
    if (r->dist.strategy == AM_MEGATRON_FSDP) {
        if (r->dist.pp > 1)
            FAIL(c, "distributed.pp_size", "megatron_fsdp does not support pipeline parallelism (use strategy: "
                 "fsdp2, or pp_size: 1)");
        if (r->dist.ep > 1)
            FAIL(c, "distributed.ep_size", "megatron_fsdp does not support expert parallelism (use strategy: "
                 "fsdp2, or ep_size: 1)");
        if (r->dist.sequence_parallel)
            FAIL(c, "distributed.sequence_parallel", "megatron_fsdp does not support sequence_parallel (use "
                 "strategy: fsdp2, or sequence_parallel: false)");
        if (r->dist.dp_replicate > 1)
            FAIL(c, "distributed.dp_replicate_size", "only fsdp2 supports HSDP; megatron_fsdp does not (use "
                 "strategy: fsdp2, or remove dp_replicate_size)");
        if (r->dist.zero_dp_strategy > 3)
            FAIL(c, "distributed.zero_dp_strategy", "%d is not a ZeRO stage (use 1, 2 or 3)", r->dist.zero_dp_strategy);
    }
    if (r->dist.strategy == AM_DDP) {
        if (r->dist.tp > 1)
            FAIL(c, "distributed.tp_size", "ddp does not support tensor parallelism (use strategy: fsdp2, or "
                 "tp_size: 1)");
        if (r->dist.pp > 1)
            FAIL(c, "distributed.pp_size", "ddp does not support pipeline parallelism (use strategy: fsdp2, or "
                 "pp_size: 1)");
        if (r->dist.cp > 1)
            FAIL(c, "distributed.cp_size", "ddp does not support context parallelism (use strategy: fsdp2, or "
                 "cp_size: 1)");
        if (r->dist.ep > 1)
            FAIL(c, "distributed.ep_size", "ddp does not support expert parallelism (use strategy: fsdp2, or "
                 "ep_size: 1)");
        if (r->dist.dp_replicate > 1)
            FAIL(c, "distributed.dp_replicate_size", "ddp does not support HSDP (use strategy: fsdp2, or "
                 "remove dp_replicate_size)");
    }
}

static void model_rules(struct check *c)
{
    const struct am_recipe *r = c->r;
    const struct am_model_config *m = &r->model;
    int tp = r->dist.tp;
    char d[128];
    if (m->num_hidden_layers <= 0)
        return; /* the model could not be read; that error is already reported */
    if (m->num_attention_heads % tp)
        FAIL(c, "distributed.tp_size", "%d does not divide num_attention_heads = %ld (use %s)", tp,
             m->num_attention_heads, divisors(m->num_attention_heads, 1024, d, sizeof(d)));
    else if (m->num_key_value_heads % tp && tp % m->num_key_value_heads)
        FAIL(c, "distributed.tp_size", "%d is neither a divisor nor a multiple of num_key_value_heads = %ld (each "
             "tp rank holds whole kv heads, or one replicated kv head)", tp, m->num_key_value_heads);
    if (m->vocab_size % tp)
        FAIL(c, "distributed.tp_size", "%d does not divide vocab_size = %ld (the vocabulary is split across tp "
             "ranks; use %s)", tp, m->vocab_size, divisors(m->vocab_size, 64, d, sizeof(d)));
    if ((m->num_experts == 0 || am_model_moe_layers(m) < m->num_hidden_layers) && m->intermediate_size % tp)
        FAIL(c, "distributed.tp_size", "%d does not divide intermediate_size = %ld (the MLP is split across tp "
             "ranks; use %s)", tp, m->intermediate_size, divisors(m->intermediate_size, 64, d, sizeof(d)));
    if (r->dist.ep > 1 && m->num_experts == 0)
        FAIL(c, "distributed.ep_size", "%d needs a mixture-of-experts model; %s has no experts (use ep_size: 1)",
             r->dist.ep, m->model_type);
    else if (m->num_experts > 0 && m->num_experts % r->dist.ep)
        FAIL(c, "distributed.ep_size", "%d does not divide the model's %ld experts (use %s)", r->dist.ep,
             m->num_experts, divisors(m->num_experts, 1024, d, sizeof(d)));
}

/* Stages: pp * v; v from layers_per_stage for interleaved schedules, whose layers split as
 * AutoModel splits them (the first L % stages stages one more); one stage per rank, layers
 * split evenly, otherwise. */
static void pipeline_rules(struct check *c)
{
    const struct am_recipe *r = c->r;
    long L = r->model.num_hidden_layers;
    int pp = r->dist.pp, lps = r->dist.pipeline.layers_per_stage;
    enum am_pp_schedule s = r->dist.pipeline.schedule;
    char d[128];
    if (L <= 0 || pp < 1)
        return;
    if (pp == 1)
        return; /* the pipeline section was dropped (recipe.c) */
    if (s != AM_PP_INTERLEAVED_1F1B) {
        if (lps && lps * pp != L)
            FAIL(c, "distributed.pipeline.layers_per_stage", "%d makes %ld stages for pp_size = %d, but %s runs "
                 "one stage per rank (use interleaved1f1b, or layers_per_stage: %ld)", lps, (L + lps - 1) / lps, pp,
                 am_pp_schedule_name(s), L % pp ? 0 : L / pp);
        else if (L % pp)
            FAIL(c, "distributed.pp_size", "%d does not divide num_hidden_layers = %ld (use %s)", pp, L,
                 divisors(L, 1024, d, sizeof(d)));
        return;
    }
    long stages = lps ? (L + lps - 1) / lps : 2L * pp;
    if (stages % pp) {
        enum am_round rnd = r->dist.pipeline.round_virtual;
        if (rnd == AM_ROUND_UP)
            stages = (stages / pp + 1) * pp;
        else if (rnd == AM_ROUND_DOWN && stages >= 2L * pp)
            stages = stages / pp * pp;
        else {
            FAIL(c, "distributed.pipeline.layers_per_stage", "%d makes %ld stages from num_hidden_layers = %ld, "
                 "not a multiple of pp_size = %d (set round_virtual_stages_to_pp_multiple: up, or choose layers_per_stage so "
                 "that num_hidden_layers / layers_per_stage is a multiple of %d)", lps, stages, L, pp, pp);
            return;
        }
    }
    if (stages / pp < 2)
        FAIL(c, "distributed.pipeline.layers_per_stage", "%d gives one stage per rank; interleaved1f1b needs "
             "at least 2 (use layers_per_stage <= %ld)", lps, L / (2L * pp));
    else if (stages > L && lps) /* the layers split as AutoModel splits them: the first L % stages one more */
        FAIL(c, "distributed.pipeline.layers_per_stage", "%d makes %ld stages (%d ranks x %ld virtual stages) for "
             "num_hidden_layers = %ld: a stage needs a layer at least (use round_virtual_stages_to_pp_multiple: down, "
             "or a smaller pp_size)", lps, stages, pp, stages / pp, L);
    else if (stages > L)
        FAIL(c, "distributed.pp_size", "%d makes %ld stages (%d ranks x 2 virtual stages) for num_hidden_layers = "
             "%ld: a stage needs a layer at least (use a smaller pp_size)", pp, stages, pp, L);
}

static void batch_rules(struct check *c, long dp)
{
    const struct am_recipe *r = c->r;
    long gb = r->steps.global_batch, lb = r->steps.local_batch;
    int pp = r->dist.pp, mbs = r->dist.pipeline.microbatch_size;
    char d[128];
    if (gb == 0)
        FAIL(c, "step_scheduler.global_batch_size", "missing (the number of sequences per optimizer step)");
    if (lb == 0)
        FAIL(c, "step_scheduler.local_batch_size", "missing (the number of sequences per rank per micro-step)");
    if (!gb || !lb)
        return;
    if (dp > 0 && gb % (lb * dp))
        FAIL(c, "step_scheduler.global_batch_size", "%ld is not a multiple of local_batch_size*dp_size = %ld*%ld "
             "= %ld (use a multiple of %ld)", gb, lb, dp, lb * dp, lb * dp);
    else if (gb < lb)
        FAIL(c, "step_scheduler.global_batch_size", "%ld is smaller than local_batch_size = %ld", gb, lb);
    if (pp > 1) {
        if (lb % mbs)
            FAIL(c, "distributed.pipeline.pp_microbatch_size", "%d does not divide step_scheduler.local_batch_size "
                 "= %ld (use %s)", mbs, lb, divisors(lb, 1024, d, sizeof(d)));
        else if (r->dist.pipeline.schedule != AM_PP_INTERLEAVED_1F1B && lb / mbs < pp)
            FAIL(c, "step_scheduler.local_batch_size", "%ld gives %ld micro-batches, fewer than pp_size = %d "
                 "stages (%s needs at least one micro-batch per stage: use local_batch_size >= %d * "
                 "pp_microbatch_size, or interleaved1f1b)", lb, lb / mbs, pp,
                 am_pp_schedule_name(r->dist.pipeline.schedule), pp);
        else if (r->dist.pipeline.schedule == AM_PP_INTERLEAVED_1F1B && am_pipe_round(pp, (int)(lb / mbs)) < 0) {
            long m = lb / mbs, rounds = m / pp;
            FAIL(c, "step_scheduler.local_batch_size", "interleaved1f1b runs the %ld micro-batches (local_batch_size "
                 "/ pp_microbatch_size) in max(1, %ld / pp_size) = %ld rounds, which must divide them (use %ld or "
                 "%ld micro-batches)", m, m, rounds, m / rounds * rounds, (m / rounds + 1) * rounds);
        }
    }
}

static void sequence_rules(struct check *c)
{
    const struct am_recipe *r = c->r;
    int cp = r->dist.cp, tp = r->dist.tp;
    /* the sequence trained on, under the key the recipe gives it: packs of packed_sequence_size
     * tokens, else dataset.seq_length, or seq_len (AutoModel's other datasets) */
    long seq = r->packed_sequence_size > 0 ? r->packed_sequence_size : r->data.seq_length;
    char key[64];
    if (r->packed_sequence_size > 0)
        snprintf(key, sizeof(key), "packed_sequence.packed_sequence_size");
    else
        snprintf(key, sizeof(key), "dataset.%s", r->data.seq_key ? r->data.seq_key : "seq_length");
    struct am_pos pos = am_recipe_pos(r, key);
    if (cp > 1 && seq && seq % (2L * cp)) {
        am_errorf(c->err, &pos, "%s: %ld is not divisible by 2*cp_size = %d (context parallelism splits each "
                  "sequence into 2*cp_size chunks for load balance)", key, seq, 2 * cp);
        c->added++;
    }
    if (r->dist.sequence_parallel && tp > 1 && seq && seq % tp) {
        am_errorf(c->err, &pos, "%s: %ld is not divisible by tp_size = %d (sequence_parallel splits the sequence "
                  "across tp ranks)", key, seq, tp);
        c->added++;
    }
    if (r->packed_sequence_size > 0 && !r->data.foreign && r->data.n_paths > 1)
        FAIL(c, "dataset.paths", "%d datasets: packed sequences are packed from the documents of one dataset, and "
             "a blend is not packed yet (give one prefix, or packed_sequence.packed_sequence_size: 0)",
             r->data.n_paths);
    if (r->dist_env.timeout_minutes <= 0)
        FAIL(c, "dist_env.timeout_minutes", "%g must be positive", r->dist_env.timeout_minutes);
}

/* The rules that need the job's size. Returns dp (0 when it cannot be inferred). */
static long world_rules(struct check *c, const struct am_world *w)
{
    const struct am_recipe *r = c->r;
    int tp = r->dist.tp;
    long mp = (long)tp * r->dist.pp * r->dist.cp, dp;
    char d[128];
    if (w->size <= 0) {
        struct am_pos pos = {.file = r->file};
        am_errorf(c->err, &pos, "the job has no ranks (world size %d)", w->size);
        c->added++;
        return 0;
    }
    if (r->dist.dp) {
        dp = r->dist.dp;
        if (dp * mp != w->size) {
            FAIL(c, "distributed.dp_size", "%ld * tp_size*pp_size*cp_size %ld = %ld ranks, but the job has %d (set "
                 "dp_size: none to infer it%s)", dp, mp, dp * mp, w->size, w->size % mp ? "" : ", or use the value it infers");
            return 0;
        }
    } else if (w->size % mp) {
        FAIL(c, "distributed.dp_size", "none is inferred as world size / (tp_size*pp_size*cp_size) = %d / %ld, not "
             "a whole number (use a world size that is a multiple of %ld, or change tp_size, pp_size or cp_size)",
             w->size, mp, mp);
        return 0;
    } else {
        dp = w->size / mp;
    }
    if (w->nvlink_domain > 0) {
        if (tp > w->nvlink_domain)
            FAIL(c, "distributed.tp_size", "%d does not fit in one NVLink domain of %d GPUs (use %s)", tp,
                 w->nvlink_domain, divisors(w->nvlink_domain, 1 << 20, d, sizeof(d)));
        else if (w->nvlink_domain % tp)
            FAIL(c, "distributed.tp_size", "%d does not divide the NVLink domain of %d GPUs, so a tensor-parallel "
                 "group would span two domains (use %s)", tp, w->nvlink_domain,
                 divisors(w->nvlink_domain, 1 << 20, d, sizeof(d)));
    }
    return dp;
}

/* The rules that depend on dp (known from the recipe, or inferred from the world). */
static void dp_rules(struct check *c, long dp)
{
    const struct am_recipe *r = c->r;
    char d[128];
    if ((dp * r->dist.cp) % r->dist.ep)
        FAIL(c, "distributed.ep_size", "%d does not divide dp_size*cp_size = %ld (use %s)", r->dist.ep,
             dp * r->dist.cp, divisors(dp * r->dist.cp, 1 << 20, d, sizeof(d)));
    if (r->dist.dp_replicate > 1 && r->dist.strategy == AM_FSDP2 && dp % r->dist.dp_replicate)
        FAIL(c, "distributed.dp_replicate_size", "%d does not divide dp_size = %ld (use %s)", r->dist.dp_replicate,
             dp, divisors(dp, 1 << 20, d, sizeof(d)));
}

int am_validate(const struct am_recipe *r, const struct am_world *w, struct am_errors *err)
{
    struct check c = {.r = r, .err = err};
    long dp = r->dist.dp;
    strategy_rules(&c);
    model_rules(&c);
    pipeline_rules(&c);
    sequence_rules(&c);
    if (w)
        dp = world_rules(&c, w);
    if (dp)
        dp_rules(&c, dp);
    batch_rules(&c, dp);
    return c.added;
}

/* ---- what am-train runs ------------------------------------------------------------------
 * Beyond the layout: combinations the trainer does not run yet, each refused by name with
 * the reason and what to use instead. These depend on the recipe alone, so sbatch refuses
 * them before the job queues. Every rule is a row of run_rules[]; tests/recipe/refusals.tsv
 * holds a recipe and the exact message for each row, checked through am-plan, am-train and
 * sbatch alike (a row missing there fails the test). */

static bool lora_on(const struct am_recipe *r, enum am_lora_target t)
{
    return r->peft.enabled && (r->peft.targets & (1u << t));
}

static void fp16(struct check *c)
{
    const struct am_recipe *r = c->r;
    if (r->compute_dtype == AM_F16)
        FAIL(c, "distributed.mp_policy.param_dtype", "float16 needs loss scaling, which am-train does not do (use "
             "bfloat16: fp32's range in half the bytes, or float32)");
    else if (r->reduce_dtype == AM_F16)
        FAIL(c, "distributed.mp_policy.reduce_dtype", "float16 needs loss scaling, which am-train does not do (use "
             "bfloat16 or float32)");
    else if (r->param_dtype == AM_F16)
        FAIL(c, "model.torch_dtype", "float16 parameters need loss scaling, which am-train does not do (use "
             "bfloat16, or float32 for fp32 master weights and AdamW state)");
}

static void lora_dtype(struct check *c)
{
    const struct am_recipe *r = c->r;
    if (r->peft.enabled && r->peft.dtype_set && r->peft.lora_dtype != r->param_dtype)
        FAIL(c, "peft.lora_dtype", "%s adapters beside %s parameters: am keeps the adapters in the parameters' dtype, "
             "as AutoModel does without lora_dtype (remove lora_dtype, or set model.torch_dtype: %s)",
             am_dtype_torch_name(r->peft.lora_dtype), am_dtype_torch_name(r->param_dtype),
             am_dtype_torch_name(r->peft.lora_dtype));
}

static void moe_sp(struct check *c)
{
    const struct am_recipe *r = c->r;
    if (r->model.num_experts > 0 && r->dist.sequence_parallel && r->dist.tp > 1)
        FAIL(c, "distributed.sequence_parallel", "%s with sequence parallelism: the experts are replicated over "
             "the tensor-parallel ranks and take every token, not a rank's share (set sequence_parallel: false)",
             r->model.model_type);
}

static void lora_head_dropout(struct check *c)
{
    if (lora_on(c->r, AM_LORA_HEAD) && c->r->peft.dropout > 0)
        FAIL(c, "peft.dropout", "adapter dropout on lm_head's adapter is not run by am-train yet (its targets match "
             "lm_head, as match_all_linear does: set dropout: 0.0, or add exclude_modules: ['lm_head'])");
}

static void lora_kv_tp(struct check *c)
{
    const struct am_recipe *r = c->r;
    long kvh = r->model.num_key_value_heads;
    if ((lora_on(r, AM_LORA_K) || lora_on(r, AM_LORA_V)) && r->dist.tp > kvh)
        FAIL(c, "peft", "adapters on k_proj or v_proj with tp_size %d above the %ld kv heads (each kv head shared by "
             "several tp ranks) are not run by am-train yet: use tp_size %ld or less, or leave k_proj and v_proj "
             "out of the targets", r->dist.tp, kvh, kvh);
}

/* LoRA on gpt_oss: the attention's projections (AutoModel's gpt-oss recipes' target_modules '*_proj',
 * which its experts, a module named mlp.experts, do not match); the experts' adapters are not run */
/* AutoModel's moe_rank_scaling: the experts' adapters of rank dim // num_experts_per_tok, which
 * must be 1 at least (AutoModel raises the same) */
static void lora_moe_rank(struct check *c)
{
    const struct am_recipe *r = c->r;
    long k = r->model.num_experts_per_tok;
    if (r->peft.enabled && r->peft.experts && r->peft.rank_scaling && r->peft.dim < k)
        FAIL(c, "peft.moe_rank_scaling", "true gives the experts' adapters rank dim // num_experts_per_tok = %ld // "
             "%ld = 0 (set peft.dim to %ld or more, or moe_rank_scaling: false for rank dim)", r->peft.dim, k, k);
}

static void glm_shared_tp(struct check *c)
{
    const struct am_recipe *r = c->r;
    long width = r->model.n_shared_experts * r->model.moe_intermediate_size;
    if (r->model.num_experts > 0 && width > 0 && width % r->dist.tp)
        FAIL(c, "distributed.tp_size", "%d does not divide %s's shared experts' width %ld (n_shared_experts x "
             "moe_intermediate_size), which tp splits as an MLP (use a tp_size that divides it)", r->dist.tp,
             r->model.model_type, width);
}

/* AutoModel's own deepseek_v3 (NeMoAutoModelForCausalLM without force_hf) at
 * gate_bias_update_factor 0: its Gate creates e_score_correction_bias only for a factor above 0
 * (or force_e_score_correction_bias), and without it chooses the groups by their best score,
 * not the two best: another router than the one am computes (transformers'). */
static void dsv3_no_bias(struct check *c)
{
    const struct am_recipe *r = c->r;
    if (!r->model.mla || !r->model.bias_update_set || r->model.gate_bias_update_factor > 0 || r->model.bias_forced)
        return;
    const struct am_node *target = am_node_path(r->root, "model._target_");
    const struct am_node *force = am_node_path(r->root, "model.force_hf");
    if (!target || target->kind != AM_NODE_SCALAR || !strstr(target->str, "NeMoAutoModel") ||
        (force && force->kind == AM_NODE_SCALAR && strcmp(force->str, "true") == 0))
        return;
    FAIL(c, "model._target_", "AutoModel's own deepseek_v3 with gate_bias_update_factor 0 builds its gates without "
         "the selection bias (Gate creates e_score_correction_bias only for a factor above 0 or with "
         "force_e_score_correction_bias) and chooses the expert groups by their best score instead of the two best, "
         "a router am does not compute: add force_e_score_correction_bias: true to moe_overrides (the bias kept, not "
         "updated), set the factor above 0, or force_hf: true for transformers' class");
}

/* transformers' class adds its loss with output_router_logits; moe_overrides' aux_loss_coeff asks
 * for AutoModel's, which its own model computes instead of transformers': not both. */
static void aux_twice(struct check *c)
{
    const struct am_recipe *r = c->r;
    if (r->model.aux_loss_coeff > 0 && am_model_hf_aux(&r->model))
        FAIL(c, "model.moe_overrides.aux_loss_coeff", "%g with output_router_logits: true on transformers' class "
             "(no NeMoAutoModelForCausalLM _target_, or force_hf): two load-balancing losses, transformers' and "
             "AutoModel's, where each model computes one (set output_router_logits: false for AutoModel's, or remove "
             "aux_loss_coeff for transformers')", r->model.aux_loss_coeff);
}

static void dataset(struct check *c)
{
    const struct am_recipe *r = c->r;
    if (r->data.foreign)
        FAIL(c, "dataset._target_", "%s is not a dataset am reads: am-train trains on Megatron indexed datasets "
             "(give dataset.paths, built with am-data build from text or token ids)",
             am_node_path(r->root, "dataset._target_")->str);
    else if (r->data.n_paths == 0)
        FAIL(c, "dataset.paths", "missing (the prefix of a Megatron indexed dataset; build one with am-data build "
             "--bytes --out PREFIX FILES...)");
}

/* Transformer Engine's FusedAdam: what of it am computes is its fp32 functor over fp32 or
 * bf16 masters and moments (kernels.h); its scaled fp16 and FP8 states, AMSGrad and the
 * decoupled gradients are not */
static void te_adam(struct check *c)
{
    const struct am_recipe *r = c->r;
    if (!r->optim.te)
        return;
    if (r->optim.amsgrad)
        FAIL(c, "optimizer.amsgrad", "true: FusedAdam has no AMSGrad variant (Transformer Engine raises on it; "
             "remove amsgrad)");
    if (r->optim.master_weights && r->optim.master_weight_dtype != AM_F32)
        FAIL(c, "optimizer.master_weight_dtype", "%s: FusedAdam keeps such master weights scaled per tensor to the "
             "dtype's range, which am does not compute (use torch.float32)",
             am_dtype_torch_name(r->optim.master_weight_dtype));
    const char *mk[2] = {"optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype"};
    bool fp8[2] = {r->optim.exp_avg_fp8, r->optim.exp_avg_sq_fp8};
    enum am_dtype dt[2] = {r->optim.exp_avg_dtype, r->optim.exp_avg_sq_dtype};
    for (int i = 0; i < 2; i++)
        if (fp8[i] || dt[i] == AM_F16) {
            struct am_pos pos = am_recipe_pos(r, mk[i]);
            am_errorf(c->err, &pos, "%s: %s: FusedAdam keeps such moments scaled per tensor to the dtype's range "
                      "(its own scale and amax), which am does not compute (use torch.float32 or torch.bfloat16)",
                      mk[i], fp8[i] ? "torch.uint8 (FP8)" : "float16");
            c->added++;
        }
    if (r->optim.decoupled_grad)
        FAIL(c, "optimizer.use_decoupled_grad", "true: FusedAdam then reads each parameter's .decoupled_grad, which "
             "AutoModel's training loop never sets (no parameter would be stepped; remove use_decoupled_grad)");
}

static const struct {
    const char *name; /* the row of tests/recipe/refusals.tsv */
    void (*check)(struct check *c);
} run_rules[] = {
    {"fp16", fp16},           {"lora-dtype", lora_dtype}, {"moe-sp", moe_sp},
    {"lora-head-dropout", lora_head_dropout},
    {"lora-kv-tp", lora_kv_tp}, {"lora-moe-rank", lora_moe_rank},
    {"glm-shared-tp", glm_shared_tp}, {"dsv3-no-bias", dsv3_no_bias}, {"aux-twice", aux_twice},
    {"dataset", dataset},     {"te-adam", te_adam},
};

int am_validate_run(const struct am_recipe *r, const struct am_world *w, struct am_errors *err)
{
    struct check c = {.r = r, .err = err};
    int added = am_validate(r, w, err);
    if (r->model.num_hidden_layers <= 0)
        return added; /* the model could not be read; that error is already reported */
    for (size_t i = 0; i < sizeof(run_rules) / sizeof(run_rules[0]); i++)
        run_rules[i].check(&c);
    return added + c.added;
}
