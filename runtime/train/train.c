/* train.c - the training loop (train.h). */
#include "train.h"

#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "comm.h"
#include "crash.h"
#include "dataset.h"
#include "fault.h"
#include "fsdp.h"
#include "grad_sync.h"
#include "kernels.h"
#include "groups.h"
#include "flight.h"
#include "log.h"
#include "model.h"
#include "moe.h"
#include "model_io.h"
#include "optim.h"
#include "pack.h"
#include "packed.h"
#include "pipeline.h"
#include "ring.h"
#include "preempt.h"
#include "resume.h"
#include "util.h"
#include "watchdog.h"

extern char **environ;

struct trainer {
    struct am_rank_setup *s;
    const struct am_recipe *r;
    const struct am_plan *p;
    struct am_dev dev;                  /* the rank's device: its kernels run there */
    const struct am_kernels *K;         /* dev.k */
    struct am_groups g;
    int dp_rank;
    struct am_model model;
    struct am_pipe pipe;
    struct am_optim optim;
    struct am_gsync sync;
    struct am_fsdp fsdp;
    bool sharded;                       /* sharded data parallelism (fsdp.h): ZeRO stage zero >= 1 */
    int zero;
    struct am_gpt *data;
    struct am_gpt *mask;                /* the loss mask beside the data (PREFIX.mask, docs/data.md), or NULL */
    char **mask_paths;
    int32_t *mask_sample;
    struct am_log *log;                 /* opened by am_train_log_begin */
    int32_t *sample, *tokens, *targets; /* host buffers for one pipeline run's micro-batches */
    struct am_packs *packs;             /* packed sequences (pack.h): the packs of whole documents, or NULL */
    int32_t *starts;                    /* packed: each row's document start, beside tokens and targets */
    int32_t *pack_rows;                 /* packed: one pack's tokens, targets and starts (3 x seq_length) */
    int32_t *cp_pos;                    /* context parallelism: this rank's positions of a sequence, or NULL */
    struct am_comm *grad_dp;            /* the loss and replicated gradients are summed over it: dp x cp */
    char base_config[4096];
    /* diagnostics (docs/diagnostics.md) */
    struct am_flight flight;
    struct am_watchdog wd;
    struct am_fault fault;
    const char **hosts;                 /* host of each global rank */
    double comm_s;                      /* seconds in communication calls this step */
    long step;                          /* the step being run (1-based) */
    long start_step;                    /* steps done before this run: checkpoint.restore_from's */
    bool comm_init_failed;              /* the communicators could not be made (NCCL: a "nccl" cause) */
    double peak_flops;                  /* the device's dense peak, FLOP/s (0: unknown: no MFU) */
    const char *peak_from;              /* where peak_flops came from, for the start record */
};

/* The layouts this trainer runs so far: data, tensor (+ sequence), pipeline, expert
 * (runtime/model/moe.h) and context parallelism (dense models in fp32, runtime/model/ring.h);
 * packed sequences in fp32 (runtime/model/packed.h). */
static int check_supported(const struct am_plan *p, const struct am_recipe *r, struct am_errors *err)
{
    if (p->cp > 1 && r->compute_dtype != AM_F32)
        return am_errors_fail(err, "cp_size %d: ring attention computes in fp32 so far (distributed.mp_policy."
                              "param_dtype %s: use float32 with context parallelism)", p->cp,
                              am_dtype_torch_name(r->compute_dtype));
    if (p->cp > 1 && r->model.num_experts > 0)
        return am_errors_fail(err, "cp_size %d: a mixture of experts with context parallelism is not run yet (its "
                              "router statistics are per micro-batch of whole sequences: use cp_size 1)", p->cp);
    if (p->cp > 1 && r->model.gemma)
        return am_errors_fail(err, "cp_size %d: ring attention has neither Gemma's attention scale and soft cap nor "
                              "Gemma 3's second rotary table yet (model_type %s: use cp_size 1)", p->cp,
                              r->model.model_type);
    if (p->cp > 1 && p->dp_replicate > 1)
        return am_errors_fail(err, "cp_size %d with dp_replicate_size %d: HSDP's shard groups over dp_shard x cp are "
                              "not built yet (use dp_replicate_size 1: fsdp2 then shards over dp x cp)", p->cp,
                              p->dp_replicate);
    if (p->ep > 1 && p->dp_replicate > 1)
        return am_errors_fail(err, "am-train does not run this layout yet: ep_size %d with dp_replicate_size %d "
                              "(HSDP): the experts are sharded over the ranks holding the same experts, which would "
                              "span the replica groups (use dp_replicate_size 1 with expert parallelism)", p->ep,
                              p->dp_replicate);
    if (r->packed_sequence_size > 0 && r->compute_dtype != AM_F32)
        return am_errors_fail(err, "packed_sequence.packed_sequence_size %ld: the attention of documents computes "
                              "in fp32 so far (distributed.mp_policy.param_dtype %s: use float32 with packed "
                              "sequences)", r->packed_sequence_size, am_dtype_torch_name(r->compute_dtype));
    if (r->packed_sequence_size > 0 && r->model.gemma)
        return am_errors_fail(err, "packed_sequence.packed_sequence_size %ld: the attention of documents has neither "
                              "Gemma's attention scale and soft cap nor Gemma 3's second rotary table yet (model_type "
                              "%s: use packed_sequence_size 0)", r->packed_sequence_size, r->model.model_type);
    if (r->compute_dtype == AM_F16 || r->reduce_dtype == AM_F16)
        return am_errors_fail(err, "distributed.mp_policy: float16 compute or reduction needs loss scaling, which "
                              "am-train does not do: use bfloat16 (fp32's range in half the bytes) or float32");
    return 0;
}

/* This rank's groups, for am-diag: {"type":"groups","groups":[{"name":"dp","gid":0,"ranks":[0,1]},...]}. */
static void log_groups(struct trainer *t)
{
    json_t *a = json_array();
    for (int g = 0; g < t->g.set.n; g++) {
        if (!t->g.comms[g])
            continue;
        json_t *ranks = json_array();
        for (int i = 0; i < t->g.set.sizes[g]; i++)
            json_array_append_new(ranks, json_integer(t->g.set.groups[g][i]));
        json_array_append_new(a, json_pack("{s:s,s:i,s:o}", "name", t->g.names[g], "gid", g, "ranks", ranks));
    }
    am_log_record(t->log, "groups", json_pack("{s:i,s:o}", "rank", t->s->info.rank, "groups", a));
}

/* am-plan's memory estimate for this rank: its pipeline rank's. */
static double plan_bytes(const struct trainer *t)
{
    const struct am_plan *p = t->p;
    int k = t->s->coords.pp;
    return p->mem_pp && k >= 0 && k < p->pp ? p->mem_pp[k].total : p->mem.total;
}

static int build_comms(struct trainer *t, struct am_errors *err)
{
    enum am_comm_backend be = t->dev.device == AM_DEV_CUDA ? AM_COMM_NCCL : AM_COMM_UCX;
    if (am_groups_build(&t->g, t->s, be, t->dev.ordinal, &t->flight, t->hosts, err) < 0) {
        t->comm_init_failed = true;
        return -1;
    }
    /* NCCL, ordered against the compute stream (comm.h): the tensor- and data-parallel groups
     * on the compute stream itself (collectives after the kernels that wrote their buffers,
     * kernels after the collectives they read; non-blocking ones on the group's communication
     * stream, joined by events); the pipeline's groups on streams of their own that wait for
     * the compute stream before each call (a send's kernel waits for the peer's receive and
     * must not hold the compute stream) */
    for (int g = 0; be == AM_COMM_NCCL && g < t->g.set.n; g++) {
        struct am_comm *c = t->g.comms[g];
        char msg[AM_COMM_ERR_LEN];
        if (!c)
            continue;
        if (c != t->g.pp && c != t->g.pp_grad)
            am_comm_set_stream(c, t->dev.stream);
        else if (am_comm_set_stream_after(c, t->dev.stream, msg, sizeof(msg)) < 0)
            return am_errors_fail(err, "%s", msg);
    }
    t->dp_rank = am_comm_rank(t->g.dp);
    t->grad_dp = t->g.dp_cp;
    log_groups(t);
    return 0;
}

/* What the rank allocated, as am-plan counts it: weights (fp32 masters and their copy in the
 * compute dtype), gradients (fp32, and their copy in a narrower reduce_dtype), Adam's moments,
 * activations and the pipeline's buffers. */
static void log_memory(struct trainer *t)
{
    const struct am_model *m = &t->model;
    size_t n = m->n_elems, lp = m->param_lp_mem ? am_dtype_size(m->act_dt) : 0;
    size_t glp = t->sync.lp_mem ? am_dtype_size(t->sync.reduce) : 0;
    /* the gradients and the optimizer's moments: every parameter's, or with LoRA the adapters' */
    size_t weights = n * (sizeof(float) + lp), grads = m->grad_elems * (sizeof(float) + glp),
           opt = t->optim.n * 2 * sizeof(float);
    size_t gathered = 0, grad_buffers = am_gsync_buffer_bytes(&t->sync);
    if (t->sharded) { /* fsdp.h: the shards; stage 1 the full-size gradients (and their reduce_dtype
                       * copy), from stage 2 the per-group buffers instead (grad_sync.h) */
        size_t S = t->fsdp.n_shard, slab = m->slab_elems;
        weights = am_fsdp_weight_bytes(&t->fsdp);
        grads = (t->zero >= 2 ? 0 : slab * sizeof(float)) + am_gsync_bytes(&t->sync) + S * sizeof(float);
        opt = S * 2 * sizeof(float);
        gathered = am_fsdp_gathered_bytes(&t->fsdp);
    }
    json_t *o = json_pack("{s:I,s:I,s:I,s:I,s:I,s:I,s:i,s:i,s:b}", "param_bytes", (json_int_t)(n * sizeof(float)),
                          "weights_bytes", (json_int_t)weights, "grads_bytes",
                          (json_int_t)grads, "optimizer_bytes", (json_int_t)opt,
                          "act_bytes", (json_int_t)m->act_bytes, "pipe_bytes", (json_int_t)am_pipe_bytes(&t->pipe),
                          "slots", m->n_slots, "peak_micro", am_pipe_peak(t->pipe.actions, t->pipe.n_actions),
                          "recompute", m->sh.recompute);
    json_object_set_new(o, "compute_dtype", json_string(am_dtype_torch_name(m->act_dt)));
    json_object_set_new(o, "gathered_bytes", json_integer((json_int_t)gathered));
    json_object_set_new(o, "grad_buffers_bytes", json_integer((json_int_t)grad_buffers));
    json_object_set_new(o, "sharded", json_boolean(t->sharded));
    if (m->sh.lora_r > 0)
        json_object_set_new(o, "adapter_params", json_integer((json_int_t)m->grad_elems));
    json_object_set_new(o, "alltoall_bytes", json_integer((json_int_t)am_moe_alltoall_bytes(m)));
    am_log_record(t->log, "memory", o);
}

/* LoRA: the adapters as peft and AutoModel start them (B zero, A by peft.lora_A_init), from
 * rng.seed: every layout starts the same adapters. */
static void init_adapters(struct trainer *t)
{
    if (t->model.sh.lora_r > 0)
        am_model_init_lora(&t->model, (uint64_t)t->r->seed, t->r->peft.a_init == AM_LORA_INIT_KAIMING);
}

/* Weights: the checkpoint named by the recipe when it has any, else a random init. */
static int build_model(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    const struct am_plan *p = t->p;
    char msg[512];
    struct am_model_shard sh;
    if (am_pipe_init(&t->pipe, p, r, &t->s->coords, &sh, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    sh.ep = p->ep; /* expert parallelism: this rank's share of the experts (moe.h) */
    if (r->peft.enabled) { /* LoRA (model.h): the adapters on the targeted projections, the base frozen */
        sh.lora_r = (int)r->peft.dim;
        sh.lora_alpha = (float)r->peft.alpha;
        sh.lora_targets = r->peft.targets & ((1u << AM_LORA_NPROJ) - 1); /* recipe.h's order of the projections */
    }
    sh.ep_rank = p->ep > 1 ? am_comm_rank(t->g.ep) : 0;
    struct am_comm *pp = p->pp > 1 ? t->g.pp : NULL;
    t->zero = p->zero_stage;
    t->sharded = p->zero_stage >= 1;
    sh.group_align = t->sharded ? am_comm_size(t->g.dp_shard) : 0;
    /* context parallelism: each rank holds seq_length / cp rows of every sequence (ring.h) */
    if (am_model_init(&t->model, &r->model, &sh, &t->dev, t->g.tp, pp, p->microbatch_size, p->seq_length / p->cp, msg,
                      sizeof(msg)) < 0 ||
        (p->cp > 1 && am_cp_init(&t->model, t->g.cp, p->seq_length, msg, sizeof(msg)) < 0) ||
        (r->packed_sequence_size > 0 && am_packed_init(&t->model, p->seq_length, msg, sizeof(msg)) < 0) ||
        am_pipe_bind(&t->pipe, &t->model, p->microbatch_size, pp, p->pp > 1 ? t->g.pp_grad : NULL, msg,
                     sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    t->model.ep_comm = p->ep > 1 ? t->g.ep : NULL;
    t->base_config[0] = '\0';
    if (strcmp(r->model_source, "inline") != 0) {
        snprintf(t->base_config, sizeof(t->base_config), "%s", r->model_source);
        char dir[4096];
        snprintf(dir, sizeof(dir), "%s", r->model_source);
        dirname(dir);
        if (am_model_dir_has_weights(dir)) {
            if (am_model_load_hf(&t->model, dir, err) < 0)
                return -1;
            init_adapters(t);
            return 0;
        }
    }
    am_model_init_weights(&t->model, (uint64_t)r->seed);
    init_adapters(t);
    return 0;
}

/* The loss mask of instruction data: PREFIX.mask beside every dataset of the blend (or none).
 * Its documents have the lengths of PREFIX's, so the same configuration gives the same
 * samples: mask sample i lines up with data sample i token for token. */
static int open_mask(struct trainer *t, const struct am_gpt_config *cfg, struct am_errors *err)
{
    int have = 0;
    if (!(t->mask_paths = calloc((size_t)cfg->n_paths, sizeof(char *))))
        return am_errors_fail(err, "out of memory");
    for (int i = 0; i < cfg->n_paths; i++) {
        size_t n = strlen(cfg->paths[i]) + 16;
        if (!(t->mask_paths[i] = malloc(n)))
            return am_errors_fail(err, "out of memory");
        snprintf(t->mask_paths[i], n, "%s.mask.idx", cfg->paths[i]);
        have += access(t->mask_paths[i], F_OK) == 0;
        snprintf(t->mask_paths[i], n, "%s.mask", cfg->paths[i]);
    }
    if (have == 0)
        return 0;
    if (have != cfg->n_paths)
        return am_errors_fail(err, "dataset.paths: %d of the %d datasets have a loss mask (PREFIX.mask.idx, from "
                              "am-data build --instruction) and the others none: blend instruction data with "
                              "instruction data only", have, cfg->n_paths);
    struct am_gpt_config mc = *cfg;
    mc.paths = (const char *const *)t->mask_paths;
    if (am_gpt_open(&mc, &t->mask, err) < 0)
        return -1;
    if (am_gpt_size(t->mask) != am_gpt_size(t->data))
        return am_errors_fail(err, "%s: its samples do not line up with %s's (was it built with them?)",
                              t->mask_paths[0], cfg->paths[0]);
    if (!(t->mask_sample = malloc((size_t)(cfg->seq_length + 1) * sizeof(int32_t))))
        return am_errors_fail(err, "out of memory");
    return 0;
}

/* The labels the loss counts in step `step` (0-based) over the whole global batch, every
 * rank's samples: what AutoModel normalises a masked loss by (its num_label_tokens). Every
 * rank computes it from the same files: nothing is exchanged. */
static int count_labels(struct trainer *t, long step, int64_t *count, struct am_errors *err)
{
    int64_t G = t->p->global_batch, T = t->p->seq_length;
    *count = 0;
    for (int64_t i = step * G; t->packs && i < (step + 1) * G; i++) { /* a pack's targets >= 0 */
        int32_t *tgt = t->pack_rows + T;
        if (am_packs_read(t->packs, i, t->pack_rows, tgt, tgt + T, err) < 0)
            return -1;
        for (int64_t k = 0; k < T; k++)
            *count += tgt[k] >= 0;
    }
    for (int64_t i = step * G; !t->packs && i < (step + 1) * G; i++) {
        if (am_gpt_sample(t->mask, i, t->mask_sample, err) < 0)
            return -1;
        for (int64_t k = 1; k <= T; k++)
            *count += t->mask_sample[k] != 0;
    }
    return 0;
}

static int build_data(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    struct am_gpt_config cfg;
    if (r->data.n_paths == 0) {
        struct am_pos pos = {.file = r->file};
        am_errorf(err, &pos, "dataset.paths: missing (the prefix of a Megatron indexed dataset; build one with "
                  "am-data build --bytes --out PREFIX FILES...)");
        return -1;
    }
    if (am_gpt_config_from_recipe(r, t->p->global_batch * r->steps.max_steps, &cfg, err) < 0)
        return -1;
    cfg.seq_length = t->p->seq_length;
    size_t n = (size_t)(t->p->n_microbatches * t->p->microbatch_size * t->p->seq_length);
    if (r->packed_sequence_size > 0) { /* whole documents packed into sequences (pack.h) */
        struct am_pack_config pc = {.path = cfg.paths[0], .size = t->p->seq_length,
                                    .neat = r->packing_strategy && !strcmp(r->packing_strategy, "neat"),
                                    .drop_long = r->drop_long_samples, .shuffle = cfg.shuffle, .seed = cfg.seed,
                                    .max_packs = r->max_packs};
        if (am_packs_open(&pc, &t->packs, err) < 0)
            return -1;
        am_log_record(t->log, "packs", json_pack("{s:I,s:I,s:s,s:b}", "packs", (json_int_t)am_packs_count(t->packs),
                                                 "dropped", (json_int_t)am_packs_dropped(t->packs), "strategy",
                                                 pc.neat ? "neat" : "thd", "masked", am_packs_masked(t->packs)));
        t->starts = malloc(n * sizeof(int32_t));
        t->pack_rows = malloc((size_t)(3 * t->p->seq_length) * sizeof(int32_t));
        if (!t->starts || !t->pack_rows)
            return am_errors_fail(err, "out of memory for the batch");
    } else if (am_gpt_open(&cfg, &t->data, err) < 0 || open_mask(t, &cfg, err) < 0) {
        return -1;
    }
    t->sample = malloc((size_t)(t->p->seq_length + 1) * sizeof(int32_t));
    if (t->p->cp > 1) { /* this cp rank's positions of every sequence (ring.h) */
        t->cp_pos = malloc((size_t)(t->p->seq_length / t->p->cp) * sizeof(int32_t));
        if (!t->cp_pos)
            return am_errors_fail(err, "out of memory for the batch");
        am_cp_positions(t->p->seq_length, t->p->cp, am_comm_rank(t->g.cp), t->cp_pos);
    }
    t->tokens = malloc(n * sizeof(int32_t));
    t->targets = malloc(n * sizeof(int32_t));
    if (!t->sample || !t->tokens || !t->targets)
        return am_errors_fail(err, "out of memory for the batch");
    return 0;
}

/* Fills tokens/targets with the samples of accumulation step `accum` (its n_microbatches
 * micro-batches, one after the other): input = sample[0..T), target = sample[1..T] (a masked
 * label: -1), or with packed sequences a pack's rows, targets and document starts (pack.h); with
 * context parallelism this rank's T / cp rows of each (cp_pos: the zigzag of ring.h). */
static int read_microbatches(struct trainer *t, long step, int64_t accum, struct am_errors *err)
{
    int64_t T = t->p->seq_length, b = t->p->microbatch_size * t->p->n_microbatches, Tl = T / t->p->cp;
    for (int64_t j = 0; j < b; j++) {
        int64_t k = accum * b + j;
        int64_t idx = am_gpt_global_index(step, t->p->global_batch, t->dp_rank, t->p->dp, k);
        int32_t *tok = t->tokens + j * Tl, *tgt = t->targets + j * Tl, *st = t->starts ? t->starts + j * Tl : NULL;
        const int32_t *rows, *rtgt, *rst = NULL; /* the whole sequence's tokens, targets, starts */
        if (t->packs) {
            if (am_packs_read(t->packs, idx, t->pack_rows, t->pack_rows + T, t->pack_rows + 2 * T, err) < 0)
                return -1;
            rows = t->pack_rows;
            rtgt = rows + T;
            rst = rows + 2 * T;
        } else {
            if (am_gpt_sample(t->data, idx, t->sample, err) < 0)
                return -1;
            if (t->mask && am_gpt_sample(t->mask, idx, t->mask_sample, err) < 0)
                return -1;
            rows = t->sample;
            rtgt = t->sample + 1;
        }
        for (int64_t i = 0; i < Tl; i++) {
            int64_t at = t->cp_pos ? t->cp_pos[i] : i;
            tok[i] = rows[at];
            /* a masked label: target -1, no loss and no gradient (kernels.h) */
            tgt[i] = t->mask && !t->mask_sample[at + 1] ? -1 : rtgt[at];
            if (st)
                st[i] = rst[at];
        }
    }
    return 0;
}

/* The first parameter whose gradient is not finite, for the log (after a failure: a read of
 * the device per parameter). */
static const char *first_nonfinite(struct am_gsync *s, struct am_model *m)
{
    int sharded = am_gsync_first_nonfinite(s); /* sharded gradients: flagged as the backward went */
    if (sharded != -2)
        return sharded >= 0 ? m->params[sharded].name : "(none)";
    for (int i = 0; i < m->n_params; i++) {
        int32_t ok = 1;
        if (!m->params[i].g.data)
            continue; /* LoRA's frozen base */
        m->K->upload(m->dev, m->scalars.flag.data, &ok, sizeof(ok));
        m->K->all_finite(m->dev, &m->scalars.flag, &m->params[i].g);
        m->K->download(m->dev, &ok, m->scalars.flag.data, sizeof(ok));
        if (!ok)
            return m->params[i].name;
    }
    return "(none)";
}

/* A number, or "nan" / "inf" / "-inf" (JSON has no such numbers). */
static json_t *number(double v)
{
    if (isfinite(v))
        return json_real(v);
    return json_string(isnan(v) ? "nan" : v > 0 ? "inf" : "-inf");
}

/* FNV-1a (64 bits) of the recipe file, in hex: tells whether ranks ran the same recipe. */
static void recipe_hash(const char *path, char out[17])
{
    char *buf = NULL;
    size_t len = 0;
    uint64_t h = 1469598103934665603ull;
    if (!path || am_read_file(path, 16u << 20, &buf, &len) != NULL) {
        snprintf(out, 17, "unknown");
        return;
    }
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)buf[i]) * 1099511628211ull;
    free(buf);
    snprintf(out, 17, "%016llx", (unsigned long long)h);
}

/* The AM_* variables of the environment (the bootstrap's socket number left out). */
static json_t *am_settings(void)
{
    json_t *o = json_object();
    for (char **e = environ; *e; e++) {
        const char *eq = strchr(*e, '=');
        if (strncmp(*e, "AM_", 3) != 0 || !eq || strncmp(*e, "AM_BOOTSTRAP_FD=", 16) == 0)
            continue;
        char key[128];
        snprintf(key, sizeof(key), "%.*s", (int)(eq - *e) < 127 ? (int)(eq - *e) : 127, *e);
        json_object_set_new(o, key, json_string(eq + 1));
    }
    return o;
}

static void log_start(struct trainer *t)
{
    const struct am_coords *c = &t->s->coords;
    char hash[17];
    recipe_hash(t->r->file, hash);
    json_t *o = json_pack("{s:s,s:i,s:i,s:i,s:s,s:s,s:i,s:{s:i,s:i,s:i,s:i,s:i,s:i},s:s,s:f}", "host",
                          t->s->info.host, "pid", (int)getpid(), "rank", t->s->info.rank, "world", t->s->info.size,
                          "job", t->s->info.job_id, "recipe", t->r->file, "local_rank", t->s->info.local_rank, "coords",
                          "pp", c->pp, "dp_replicate", c->dp_replicate, "dp_shard", c->dp_shard, "cp", c->cp, "tp",
                          c->tp, "ep", c->ep, "device", t->K->name, "time", t->flight.anchor_wall);
    json_object_set_new(o, "version", json_string(PACKAGE_VERSION));
    json_object_set_new(o, "mono", json_real(t->flight.anchor_mono));
    json_object_set_new(o, "node_id", json_integer(t->s->info.node_id));
    json_object_set_new(o, "mesh_rank", json_integer(t->s->place.mesh_of ? t->s->place.mesh_of[t->s->info.rank] : -1));
    json_object_set_new(o, "recipe_hash", json_string(hash));
    json_object_set_new(o, "max_steps", json_integer(t->r->steps.max_steps));
    json_object_set_new(o, "timeout_s", json_real(t->wd.timeout_s));
    json_object_set_new(o, "timeout_from", json_string(t->wd.timeout_from));
    json_object_set_new(o, "flight_size", json_integer((json_int_t)t->flight.cap));
    json_object_set_new(o, "device_name", json_string(t->dev.name));
    json_object_set_new(o, "plan_bytes", json_integer((json_int_t)plan_bytes(t)));
    if (t->peak_flops > 0) {
        json_object_set_new(o, "peak_flops", json_real(t->peak_flops));
        json_object_set_new(o, "peak_from", json_string(t->peak_from));
    }
    json_object_set_new(o, "settings", am_settings());
    am_log_record(t->log, "start", o);
}

/* The one cause record of this rank (crash.h: the first one wins), then the flight recorder. */
static void report(struct trainer *t, json_t *cause)
{
    if (!am_crash_report_begin() || t->log->fd < 0) {
        json_decref(cause);
        return;
    }
    json_object_set_new(cause, "rank", json_integer(t->s->info.rank));
    if (!json_object_get(cause, "time"))
        json_object_set_new(cause, "time", json_real(am_wall_time()));
    am_log_record(t->log, "cause", cause);
    am_crash_report_end();
}

/* The model's place in the step, into a cause record: "phase" and "layer" (a number, or null
 * with "part": "embedding" / "head"). */
static void add_where(json_t *o, const struct am_model_where *w)
{
    json_object_set_new(o, "phase", json_string(am_model_phase_name(w->phase)));
    json_object_set_new(o, "layer", w->layer >= 0 ? json_integer(w->layer) : json_null());
    const char *part = w->layer >= 0 ? "layer" : w->layer == AM_WHERE_EMBEDDING ? "embedding"
                       : w->layer == AM_WHERE_HEAD ? "head" : NULL;
    json_object_set_new(o, "part", part ? json_string(part) : json_null());
}

/* The device's fault hook (kernels.h): an allocation that failed is the rank's "oom" cause,
 * with what was asked, what the allocator holds and uses, the plan's estimate for the rank
 * (am-plan's for its pipeline rank) and where the step was; a CUDA error before the
 * backend aborts is "cuda" with the runtime's text; a kernel called wrongly is an "error"; a
 * note (another path taken, nothing failed) is a "note" record and a line on stderr. */
static void device_fault(void *arg, const struct am_dev_fault *f)
{
    struct trainer *t = arg;
    json_t *o;
    if (f->kind == AM_DEV_FAULT_NOTE) { /* nothing failed: a line in the log and on stderr */
        am_log_record(t->log, "note", json_pack("{s:s,s:s,s:f}", "where", f->where ? f->where : "", "message",
                                                f->message ? f->message : "", "time", am_wall_time()));
        fprintf(stderr, "am-train: rank %d: note: %s: %s\n", t->s->info.rank, f->where ? f->where : "device",
                f->message ? f->message : "");
        return;
    }
    if (f->kind == AM_DEV_FAULT_OOM) {
        o = json_pack("{s:s,s:s,s:i,s:s}", "cause", "oom", "device", f->backend, "ordinal", f->ordinal, "where",
                      f->where ? f->where : "");
        json_object_set_new(o, "bytes_asked", json_integer((json_int_t)f->bytes_asked));
        json_object_set_new(o, "bytes_held", json_integer((json_int_t)f->bytes_held));
        json_object_set_new(o, "bytes_in_use", json_integer((json_int_t)f->bytes_in_use));
        json_object_set_new(o, "bytes_total", json_integer((json_int_t)f->bytes_total));
        json_object_set_new(o, "plan_bytes", json_integer((json_int_t)plan_bytes(t)));
    } else {
        o = json_pack("{s:s,s:s,s:i,s:s,s:s}", "cause", f->kind == AM_DEV_FAULT_ERROR ? "cuda" : "error", "device",
                      f->backend, "ordinal", f->ordinal, "where", f->where ? f->where : "", "error",
                      f->error ? f->error : "");
    }
    add_where(o, &t->model.where);
    json_object_set_new(o, "step", json_integer(am_crash_step()));
    char msg[1200];
    snprintf(msg, sizeof msg, "%s: %s", f->where ? f->where : "device", f->message ? f->message : "");
    json_object_set_new(o, "message", json_string(msg));
    report(t, o);
}

/* The rank fails with `message`. When its last communication call failed (any group: the
 * data-parallel all-reduce, or a tensor-parallel collective inside the model), the cause is
 * that call: "timeout" (the backend's wait expired) or "comm" (an error, naming the peer and
 * its host); otherwise "error" with the message. */
static void report_error(struct trainer *t, const char *message)
{
    struct am_flight_view v;
    uint64_t newest = atomic_load(&t->flight.newest);
    if (!am_flight_get(&t->flight, newest, &v) ||
        (v.state != AM_FLIGHT_FAILED && v.state != AM_FLIGHT_TIMED_OUT && v.state != AM_FLIGHT_ABORTED)) {
        /* NCCL's communicators could not be made (ncclCommInitRankConfig's error in the message) */
        int nccl = t->comm_init_failed && t->dev.device == AM_DEV_CUDA;
        report(t, json_pack("{s:s,s:s}", "cause", nccl ? "nccl" : "error", "message", message));
        return;
    }
    int timed_out = v.state == AM_FLIGHT_TIMED_OUT;
    double waited = (v.ended > 0 ? v.ended : am_flight_now()) - (v.started > 0 ? v.started : v.enqueued);
    /* NCCL's own errors (ncclGetErrorString and ncclGetLastError's text in the message,
     * asynchronous ones from ncclCommGetAsyncError included) are "nccl" */
    int nccl = am_comm_ctx_backend(t->g.ctx) == AM_COMM_NCCL && v.state == AM_FLIGHT_FAILED;
    report(t, am_watchdog_comm_cause(&t->flight, &v, timed_out ? "timeout" : nccl ? "nccl" : "comm", "backend", waited,
                                     timed_out ? t->s->timeout_s : 0, t->s->info.rank, t->hosts, t->s->info.size,
                                     message));
}

/* AM_FAULT at the start of a step: writes the "fault" record, then misbehaves (fault.h). */
static void fault_record(struct trainer *t, long step, const char *tensor)
{
    json_t *o = json_pack("{s:s,s:s,s:i,s:i,s:f}", "kind", am_fault_kind_name(t->fault.kind), "spec", t->fault.spec,
                          "rank", t->fault.rank, "step", (int)step, "time", am_wall_time());
    if (tensor)
        json_object_set_new(o, "tensor", json_string(tensor));
    am_log_record(t->log, "fault", o);
}

static void fault_at_step_start(struct trainer *t, long step)
{
    const struct am_fault *f = &t->fault;
    int rank = t->s->info.rank;
    static const enum am_fault_kind now[] = {AM_FAULT_SEGV, AM_FAULT_ABORT, AM_FAULT_EXIT, AM_FAULT_HANG,
                                             AM_FAULT_SLOW, AM_FAULT_KILL, AM_FAULT_OOM};
    for (size_t i = 0; i < sizeof(now) / sizeof(now[0]); i++) {
        if (!am_fault_due(f, rank, step, now[i]))
            continue;
        fault_record(t, step, NULL);
        switch (f->kind) {
        case AM_FAULT_SEGV: am_fault_segv();
        case AM_FAULT_ABORT: am_fault_abort();
        case AM_FAULT_EXIT: am_fault_exit(f->code);
        case AM_FAULT_HANG: am_fault_hang();
        case AM_FAULT_KILL: am_fault_kill();
        case AM_FAULT_OOM: am_fault_oom();
        case AM_FAULT_SLOW: am_fault_sleep(f->seconds); break;
        default: break;
        }
    }
}

/* AM_FAULT kind=nan: a NaN in the middle parameter's gradient, once the backward has made
 * it final (before its group is synchronised). */
static void fault_nan(struct trainer *t, long step)
{
    struct am_model *m = &t->model;
    if (!am_fault_due(&t->fault, t->s->info.rank, step, AM_FAULT_NAN) || m->n_params < 1)
        return;
    int i = m->n_params / 2;
    while (i < m->n_params && !m->params[i].g.data) /* LoRA's frozen base has no gradient: the next that has */
        i++;
    if (i == m->n_params)
        return;
    struct am_param *p = &m->params[i];
    fault_record(t, step, p->name);
    float nan = NAN;
    m->K->upload(m->dev, p->g.data, &nan, sizeof(nan));
}

/* AM_FAULT kind=device-oom: an allocation no device can serve, made for real through the
 * device's table (its failure reaches device_fault: the "oom" cause record). */
static int fault_device_oom(struct trainer *t, long step, char *err, size_t err_len)
{
    if (!am_fault_due(&t->fault, t->s->info.rank, step, AM_FAULT_DEVICE_OOM))
        return 0;
    fault_record(t, step, NULL);
    size_t bytes = (size_t)1 << 62;
    void *p = t->K->alloc(&t->dev, bytes);
    if (p) { /* a device that has it: nothing failed */
        t->K->free(&t->dev, p);
        return 0;
    }
    return am_fail(err, err_len, "out of %s memory: %zu bytes asked for in the %s", t->K->name, bytes,
                   am_model_phase_name(t->model.where.phase));
}

/* The device's dense bf16 peak, FLOP/s, for the step's MFU: AM_PEAK_TFLOPS when set, else
 * the table below by the GPU's name; 0 (no MFU) for the CPU and unknown GPUs. Figures are
 * NVIDIA's datasheets' dense BF16 Tensor Core numbers (the sparse figure halved): H100 SXM
 * 989.4 TFLOP/s (H100 Tensor Core GPU datasheet), H200 the same (H200 datasheet, same
 * Hopper SXM5 compute), H100 NVL 835, H100 PCIe 756, A100 312 (A100 datasheet). */
static int device_peak(struct trainer *t, char *err, size_t err_len)
{
    static const struct {
        const char *has, *also;
        double tflops;
    } table[] = {{"H100", "NVL", 835}, {"H100", "PCIe", 756}, {"H200", NULL, 989.4}, {"H100", NULL, 989.4},
                 {"A100", NULL, 312}};
    const char *env = getenv("AM_PEAK_TFLOPS");
    t->peak_flops = 0;
    t->peak_from = NULL;
    if (env && *env) {
        char *end;
        double v = strtod(env, &end);
        if (*end || !(v > 0) || !isfinite(v))
            return am_fail(err, err_len, "AM_PEAK_TFLOPS=%s: not a number of TFLOP/s above 0 (the device's dense peak "
                           "for the step line's MFU, e.g. AM_PEAK_TFLOPS=989)", env);
        t->peak_flops = v * 1e12;
        t->peak_from = "AM_PEAK_TFLOPS";
        return 0;
    }
    if (t->dev.device != AM_DEV_CUDA)
        return 0;
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (strstr(t->dev.name, table[i].has) && (!table[i].also || strstr(t->dev.name, table[i].also))) {
            t->peak_flops = table[i].tflops * 1e12;
            t->peak_from = "table";
            return 0;
        }
    return 0;
}

/* This rank's share of the model FLOPs of a step (am-plan's count for the job / world). */
static double rank_flops(const struct trainer *t) { return t->p->flops_per_step / (double)t->p->world; }

static void print_step(const struct trainer *t, long step, double loss, double lr, double norm, double dt,
                       double elapsed)
{
    double tok_s = t->p->tokens_per_step / dt;
    double eta = elapsed / (double)(step + 1) * (double)(t->r->steps.max_steps - step - 1);
    char mfu[32] = "";
    if (t->peak_flops > 0)
        snprintf(mfu, sizeof mfu, " | MFU %.1f%%", 100.0 * rank_flops(t) / dt / t->peak_flops);
    printf("step %4ld/%ld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | %.2f GFLOP/s%s | ETA %d:%02d\n",
           step + 1, t->r->steps.max_steps, loss, lr, norm, tok_s, t->p->flops_per_step / dt / 1e9, mfu,
           (int)eta / 60, (int)eta % 60);
    fflush(stdout);
}

/* The Hugging Face export of the weights (checkpoint.save_consolidated) into dir: one replica
 * saves (cp rank 0 of it), its tp and pp ranks together (pp 0 / tp 0 writes); fully sharded,
 * the shard groups first gather the masters; with ep > 1 every rank first gathers its ep
 * group's experts. */
static int save_hf(struct trainer *t, const char *dir, struct am_errors *err)
{
    void *slab = NULL;
    if (t->model.sh.lora_r > 0) { /* LoRA: the adapters, as peft saves them; the base is the model directory */
        bool saves = t->dp_rank == 0 && !(t->g.cp && am_comm_rank(t->g.cp) != 0);
        char base[4096];
        const char *model_dir = NULL; /* the adapters' base_model_name_or_path: the base's directory */
        if (t->base_config[0]) {
            snprintf(base, sizeof(base), "%s", t->base_config);
            model_dir = dirname(base);
        }
        return am_model_save_peft_dist(&t->model, t->p->tp > 1 ? t->g.tp : NULL, t->p->pp > 1 ? t->g.pp : NULL,
                                       saves, dir, model_dir, err);
    }
    char msg[1024];
    if (t->zero >= 3 && am_fsdp_gather_masters(&t->fsdp, &slab, msg, sizeof(msg)) < 0) {
        am_fsdp_release_masters(&t->fsdp, slab);
        return am_errors_fail(err, "%s", msg);
    }
    bool saves = t->dp_rank == 0 && !(t->g.cp && am_comm_rank(t->g.cp) != 0);
    int rc = !saves && t->p->ep == 1
                 ? 0
                 : am_model_save_hf_ep(&t->model, t->p->tp > 1 ? t->g.tp : NULL, t->p->pp > 1 ? t->g.pp : NULL,
                                       t->p->ep > 1 ? t->g.ep : NULL, saves, dir,
                                       t->base_config[0] ? t->base_config : NULL, err);
    if (t->zero >= 3)
        am_fsdp_release_masters(&t->fsdp, slab);
    return rc;
}

static int save_hf_extra(void *arg, const char *tmp_dir, char *err, size_t err_len)
{
    struct trainer *t = arg;
    char dir[4200];
    struct am_errors e;
    am_errors_init(&e);
    bool lora = t->model.sh.lora_r > 0;
    snprintf(dir, sizeof(dir), "%s/%s", tmp_dir, lora ? "peft" : "hf");
    int rc = save_hf(t, dir, &e);
    if (rc < 0)
        snprintf(err, err_len, "%s: %s", lora ? "the LoRA adapters (peft)" : "the Hugging Face export",
                 e.n ? e.msg[0] : "failed");
    am_errors_free(&e);
    return rc;
}

/* AM_FAULT kill-in-save:PHASE (fault.h) */
static void fault_in_save(void *arg, enum am_sckpt_phase phase)
{
    struct trainer *t = arg;
    if (am_fault_due(&t->fault, t->s->info.rank, t->step, AM_FAULT_KILL_IN_SAVE) && t->fault.code == (int)phase) {
        fault_record(t, t->step, NULL);
        am_fault_kill();
    }
}

/* What resume.h saves and restores of this rank. */
static struct am_train_state train_state(struct trainer *t)
{
    const char *job = getenv("AM_JOB_ID");
    return (struct am_train_state){
        .m = &t->model, .fsdp = t->sharded ? &t->fsdp : NULL, .optim = &t->optim,
        /* unsharded: the slab's [grad_off, +grad_elems): all of it, or LoRA's adapters */
        .master = t->sharded ? t->fsdp.master : (float *)t->model.param_mem + t->model.grad_off,
        .n = t->sharded ? t->fsdp.n_shard : t->model.grad_elems, .base = t->sharded ? 0 : t->model.grad_off,
        .job = {t->g.tp, t->g.pp, t->g.dp, t->g.cp}, .rank = t->s->info.rank, .world = t->s->info.size,
        /* a copy of a lower rank's state does not write: replicas (HSDP's, or every data-parallel
         * and context-parallel rank but the first when nothing is sharded) */
        .writes = t->sharded ? !t->g.dp_replicate || am_comm_rank(t->g.dp_replicate) == 0
                             : t->dp_rank == 0 && !(t->g.cp && am_comm_rank(t->g.cp) != 0),
        .r = t->r, .p = t->p, .tag = job && *job ? job : "0", .hook = fault_in_save, .hook_arg = t,
        .extra = t->r->ckpt.save_consolidated || t->model.sh.lora_r > 0 ? save_hf_extra : NULL, .extra_arg = t};
}

/* A sharded checkpoint (resume.h) of the state after `step` steps, with the Hugging Face
 * export inside it when checkpoint.save_consolidated (every checkpoint, or with `final` the
 * one at the end of training). */
static int save_checkpoint(struct trainer *t, long step, struct am_errors *err)
{
    if (!t->r->ckpt.enabled)
        return 0;
    struct am_train_state st = train_state(t);
    if (t->r->ckpt.consolidated_final && t->model.sh.lora_r == 0 && step != t->r->steps.max_steps)
        st.extra = NULL; /* save_consolidated: final: the Hugging Face directory with the last checkpoint only */
    char dir[4096], msg[2048];
    double secs = 0;
    /* its end is the "checkpoint" record: am-diag reports a save that began and did not end */
    am_log_record(t->log, "checkpoint_start", json_pack("{s:i,s:f}", "step", (int)step, "time", am_wall_time()));
    if (am_train_save(&st, step, dir, sizeof(dir), &secs, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    am_log_record(t->log, "checkpoint", json_pack("{s:i,s:s,s:f,s:s,s:b,s:f}", "step", (int)step, "dir", dir,
                                                  "seconds", secs, "format", "sharded", "writes", st.writes, "time",
                                                  am_wall_time()));
    return 0;
}

/* Slurm's warning before the time limit (preempt.h), agreed by every rank at the end of each
 * step: 1 when the ranks stop after `step` (saved; `saved` when ckpt_every_steps did it). */
static int preempt_check(struct trainer *t, long step, bool saved, struct am_errors *err)
{
    struct am_train_state st = train_state(t);
    int32_t warned = am_preempt_noted();
    char msg[1024];
    if (am_train_job_max(&st, &warned, 1, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "step %ld: agreeing on Slurm's warning (SIGUSR1): %s", step, msg);
    if (!warned)
        return 0;
    if (!saved && save_checkpoint(t, step, err) < 0)
        return -1;
    am_log_record(t->log, "preempted", json_pack("{s:i,s:f,s:i}", "step", (int)step, "time", am_wall_time(),
                                                 "exit", AM_EXIT_REQUEUE));
    if (t->s->info.rank == 0)
        printf("am-train: warned (SIGUSR1): saved the state after step %ld, stopping for a requeue (status %d)\n",
               step, AM_EXIT_REQUEUE);
    return 1;
}

/* checkpoint.restore_from: the state of a sharded checkpoint (resume.h), saved at any layout;
 * `latest` before any checkpoint exists starts from the beginning. */
static int restore_checkpoint(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    const char *root = r->ckpt.dir ? r->ckpt.dir : "checkpoints";
    char dir[4096], msg[2048];
    bool found = false;
    long step = 0;
    double t0 = am_mono_time();
    if (!r->ckpt.restore_from || !*r->ckpt.restore_from)
        return 0;
    if (am_sckpt_resolve(root, r->ckpt.restore_from, dir, sizeof(dir), &found, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    if (!found) {
        am_log_record(t->log, "restore", json_pack("{s:s,s:b}", "from", r->ckpt.restore_from, "found", 0));
        return 0;
    }
    struct am_train_state st = train_state(t);
    if (am_train_restore(&st, dir, &step, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "checkpoint.restore_from: %s", msg);
    if (step > r->steps.max_steps)
        return am_errors_fail(err, "checkpoint.restore_from: %s was saved after step %ld, past max_steps %ld: raise "
                              "step_scheduler.max_steps", dir, step, r->steps.max_steps);
    if (t->sharded && t->zero < 3 && am_fsdp_publish(&t->fsdp, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "checkpoint.restore_from: %s", msg);
    t->start_step = step;
    am_log_record(t->log, "restore", json_pack("{s:s,s:b,s:s,s:i,s:f}", "from", r->ckpt.restore_from, "found", 1,
                                               "dir", dir, "step", (int)step, "seconds", am_mono_time() - t0));
    if (t->s->info.rank == 0)
        printf("am-train: resumed from %s after step %ld\n", dir, step);
    return 0;
}

/* A non-finite loss or gradient norm: origin "local" (this rank's own, before any reduction:
 * this rank is where it came from) or "reduced" (after the data-parallel all-reduce). */
static int nonfinite(struct trainer *t, long step, double loss, double norm, const char *origin, struct am_errors *err)
{
    const char *bad = first_nonfinite(&t->sync, &t->model);
    json_t *o = json_pack("{s:s,s:i,s:s,s:s}", "cause", "nonfinite", "step", (int)step, "tensor", bad, "origin", origin);
    json_object_set_new(o, "loss", number(loss));
    json_object_set_new(o, "grad_norm", number(norm));
    report(t, o);
    return am_errors_fail(err, "step %ld: the %s loss or gradient norm is not finite (loss %g, grad norm %g; first non-finite "
                "gradient: %s)", step, origin, loss, norm, bad);
}

/* The model's grad_ready hook: AM_FAULT kind=nan first, then the group's synchronisation. */
static int grad_ready(void *arg, int group, char *err, size_t err_len)
{
    struct trainer *t = arg;
    const struct am_pgroup *G = &t->model.groups[group];
    int mid = t->model.n_params / 2;
    if (mid >= G->first && mid < G->first + G->n) {
        fault_nan(t, t->step);
        if (fault_device_oom(t, t->step, err, err_len) < 0)
            return -1;
    }
    return am_gsync_group(&t->sync, group, err, err_len);
}

/* The model's group_use hook: fully sharded (stage 3), the group's weights gathered. */
static int group_use(void *arg, int group, bool backward, char *err, size_t err_len)
{
    struct trainer *t = arg;
    return t->zero >= 3 ? am_fsdp_use(&t->fsdp, group, backward, err, err_len) : 0;
}

/* The model's grad_use hook: sharded gradients (from stage 2) in a buffer of their own. */
static int grad_use(void *arg, int group, char *err, size_t err_len)
{
    struct trainer *t = arg;
    return t->zero >= 2 ? am_gsync_use(&t->sync, group, err, err_len) : 0;
}

/* The model's hooks (model.h), installed once. */
static void install_hooks(struct trainer *t)
{
    struct am_model_hooks h = {.group_use = group_use, .grad_use = grad_use, .grad_ready = grad_ready,
                               .grads_each_pass = t->zero >= 2, .arg = t};
    am_model_set_hooks(&t->model, &h);
}

/* Forward and backward of every micro-batch of the step, gradients synchronised over dp. */
static int forward_backward(struct trainer *t, long step, float dloss_scale, struct am_errors *err)
{
    const struct am_plan *p = t->p;
    char msg[1024];
    am_model_begin_step(&t->model);
    am_gsync_begin_step(&t->sync);
    if (t->sharded)
        am_fsdp_begin_step(&t->fsdp);
    if (p->dp > 1 && am_fault_due(&t->fault, t->s->info.rank, step, AM_FAULT_HANG_IN_COLLECTIVE)) {
        fault_record(t, step, NULL);
        am_comm_inject_stall(t->g.dp, am_comm_seq(t->g.dp) + 1);
    }
    if (p->ep > 1 && am_fault_due(&t->fault, t->s->info.rank, step, AM_FAULT_KILL_IN_ALLTOALL)) {
        fault_record(t, step, NULL); /* the ep group's next call exchanges counts, the one after dispatches */
        am_comm_inject_kill(t->g.ep, am_comm_seq(t->g.ep) + 2);
    }
    for (int64_t a = 0; a < p->grad_accum; a++) {
        if (read_microbatches(t, step - 1, a, err) < 0)
            return -1;
        if (am_pipe_run(&t->pipe, &t->model, t->tokens, t->targets, t->starts, p->microbatch_size, dloss_scale,
                        a == p->grad_accum - 1, msg, sizeof(msg)) < 0)
            return am_errors_fail(err, "step %ld: %s", step, msg);
    }
    t->model.where = (struct am_model_where){AM_PHASE_GRAD_SYNC, AM_WHERE_NONE};
    if (am_gsync_finish(&t->sync, msg, sizeof(msg)) < 0 || (t->sharded && am_fsdp_end_step(&t->fsdp, msg, sizeof(msg)) < 0))
        return am_errors_fail(err, "step %ld: %s", step, msg);
    if (t->zero == 1)
        am_fsdp_take_grads(&t->fsdp);
    /* NCCL: the collectives left to the device this step, each seen complete (a timeout names
     * the one that is not) before the host reads results; nothing on UCX */
    if (am_comm_stream_wait(t->g.tp, msg, sizeof(msg)) < 0 || am_comm_stream_wait(t->g.dp, msg, sizeof(msg)) < 0 ||
        (t->g.cp && (am_comm_stream_wait(t->g.cp, msg, sizeof(msg)) < 0 ||
                     am_comm_stream_wait(t->g.dp_cp, msg, sizeof(msg)) < 0)))
        return am_errors_fail(err, "step %ld: %s", step, msg);
    return 0;
}

/* The step's loss and gradient norm, reduced on the device (their collectives): the
 * optimizer's update is enqueued after this and before step_values reads them. */
static int reduce_values(struct trainer *t, long step, struct am_errors *err)
{
    const struct am_plan *p = t->p;
    struct am_model *m = &t->model;
    char msg[1024];
    if (am_model_reduce_loss(m, p->dp * p->cp > 1 ? t->grad_dp : NULL, msg, sizeof(msg)) < 0 ||
        (t->sharded ? am_model_grad_sumsq_shards(m, t->fsdp.grads, t->fsdp.rank, t->g.dp_shard, msg, sizeof(msg))
                    : am_model_grad_sumsq(m, msg, sizeof(msg))) < 0)
        return am_errors_fail(err, "step %ld: %s", step, msg);
    return 0;
}

/* The step's loss and gradient norm, read once. A non-finite one fails the step (the
 * optimizer has skipped it on the device, reading the same norm): on the rank it came from
 * as "local"; a rank that only received it through the data-parallel all-reduce waits to be
 * stopped by the job's end (the source's supervisor stops every rank within seconds), as a
 * rank blocked in that all-reduce would, and reports "reduced" only when nothing stops it. */
static int step_values(struct trainer *t, long step, double total_tokens, double *loss, double *norm,
                       struct am_errors *err)
{
    const struct am_plan *p = t->p;
    struct am_model *m = &t->model;
    struct am_model_values v;
    am_model_read_scalars(m, &v);
    *loss = v.loss_sum / total_tokens;
    *norm = sqrt(v.sumsq);
    int reduced = p->dp * p->cp > 1; /* over dp x cp */
    if (reduced && !isfinite(v.local_sumsq))
        return nonfinite(t, step, *loss, sqrt(v.local_sumsq), "local", err);
    if (isfinite(*loss) && isfinite(*norm))
        return 0;
    if (reduced)
        am_fault_sleep(t->wd.timeout_s);
    return nonfinite(t, step, *loss, *norm, reduced ? "reduced" : "local", err);
}

static int run(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    const struct am_plan *p = t->p;
    struct am_model *m = &t->model;
    float dloss_scale = (float)(1.0 / ((double)p->global_batch * (double)p->seq_length));
    double t0 = am_mono_time();
    int rank = t->s->info.rank;
    for (long step = t->start_step; step < r->steps.max_steps; step++) {
        double ts = am_mono_time(), loss = 0, norm = 0;
        t->step = step + 1;
        am_crash_set_step(step + 1);
        double busy0 = am_comm_ctx_busy_s(t->g.ctx);
        fault_at_step_start(t, step + 1);
        double lr = am_lr_at(r, step);
        /* the loss is the mean over the labels it counts: every token's, or with a loss mask
         * or packed sequences the targets of the global batch (AutoModel's normalisation by its
         * num_label_tokens) */
        int64_t labels = p->global_batch * p->seq_length;
        if ((t->mask || t->packs) && count_labels(t, step, &labels, err) < 0)
            return -1;
        if (t->mask || t->packs)
            dloss_scale = labels ? (float)(1.0 / (double)labels) : 0.0f;
        if (forward_backward(t, step + 1, dloss_scale, err) < 0 || reduce_values(t, step + 1, err) < 0)
            return -1;
        m->where = (struct am_model_where){AM_PHASE_OPTIMIZER, AM_WHERE_NONE};
        /* clipped to max_norm / (norm + 1e-6) when below 1, or skipped when the norm is not
         * finite, on the device: enqueued before the one read of the step's values */
        if (t->sharded) { /* the shards alone (fsdp.h); below stage 3 then gathered into the model */
            char msg[1024];
            am_optim_step(&t->optim, t->fsdp.master, t->fsdp.grads, am_model_sumsq(m), r->optim.max_grad_norm,
                          (float)lr);
            if (t->zero < 3 && am_fsdp_publish(&t->fsdp, msg, sizeof(msg)) < 0)
                return am_errors_fail(err, "step %ld: %s", step + 1, msg);
        } else {
            /* every parameter, or with LoRA the adapters alone (the gradient slab's span) */
            am_optim_step(&t->optim, (float *)m->param_mem + m->grad_off, m->grad_mem, am_model_sumsq(m),
                          r->optim.max_grad_norm, (float)lr);
        }
        if (step_values(t, step + 1, labels ? (double)labels : 1.0, &loss, &norm, err) < 0)
            return -1;
        double dt = am_mono_time() - ts;
        t->comm_s = am_comm_ctx_busy_s(t->g.ctx) - busy0;
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        json_t *rec = json_pack("{s:i,s:f,s:f,s:f,s:I,s:f,s:f,s:f,s:I}", "step", (int)step + 1, "loss", loss, "lr", lr,
                                "grad_norm", norm, "tokens", (json_int_t)p->tokens_per_step, "step_s", dt, "time",
                                am_wall_time(), "comm_s", t->comm_s, "max_rss_kib", (json_int_t)ru.ru_maxrss);
        json_object_set_new(rec, "grad_wait_s", json_real(t->sync.wait_s));
        if (t->mask || t->packs)
            json_object_set_new(rec, "label_tokens", json_integer((json_int_t)labels));
        if (t->sharded)
            json_object_set_new(rec, "gather_wait_s", json_real(t->fsdp.gather_wait_s));
        if (m->cp) { /* context parallelism: waiting for the ring, and the block kernels (ring.h) */
            json_object_set_new(rec, "ring_wait_s", json_real(m->cp->wait_s));
            json_object_set_new(rec, "ring_block_s", json_real(m->cp->block_s));
            m->cp->wait_s = m->cp->block_s = 0;
        }
        if (t->peak_flops > 0) { /* mfu = flops / step_s / peak_flops, all three here */
            json_object_set_new(rec, "flops", json_real(rank_flops(t)));
            json_object_set_new(rec, "peak_flops", json_real(t->peak_flops));
            json_object_set_new(rec, "mfu", json_real(rank_flops(t) / dt / t->peak_flops));
        }
        if (t->K->mem_stats) {
            struct am_dev_mem dm;
            t->K->mem_stats(&t->dev, &dm);
            json_object_set_new(rec, "dev_mem_in_use", json_integer((json_int_t)dm.in_use));
            json_object_set_new(rec, "dev_mem_peak", json_integer((json_int_t)dm.peak));
            json_object_set_new(rec, "dev_mem_held", json_integer((json_int_t)dm.held));
        }
        if (m->moe) { /* tokens routed to each expert over the step on this rank (moe.h) */
            struct am_moe_stats ms;
            am_moe_stats(m, &ms);
            json_object_set_new(rec, "expert_tokens_min", json_integer((json_int_t)ms.min));
            json_object_set_new(rec, "expert_tokens_max", json_integer((json_int_t)ms.max));
            json_object_set_new(rec, "expert_imbalance", json_real(ms.imbalance));
            if (r->model.output_router_logits)
                json_object_set_new(rec, "aux_loss", json_real(ms.aux));
            if (p->ep > 1) {
                json_object_set_new(rec, "alltoall_s", json_real(ms.alltoall_s));
                json_object_set_new(rec, "ep_tokens_in", json_integer((json_int_t)ms.tokens_in));
            }
        }
        am_log_record(t->log, "step", rec);
        if (rank == 0)
            print_step(t, step, loss, lr, norm, dt, am_mono_time() - t0);
        bool saved = r->ckpt.enabled && r->steps.ckpt_every > 0 && (step + 1) % r->steps.ckpt_every == 0;
        if (saved && save_checkpoint(t, step + 1, err) < 0)
            return -1;
        int stop = r->ckpt.enabled && step + 1 < r->steps.max_steps ? preempt_check(t, step + 1, saved, err) : 0;
        if (stop != 0)
            return stop; /* -1, or 1: saved for a requeue */
    }
    if (r->ckpt.enabled && t->start_step < r->steps.max_steps && /* a restored end is saved already */
        (r->steps.ckpt_every <= 0 || r->steps.max_steps % r->steps.ckpt_every != 0))
        return save_checkpoint(t, r->steps.max_steps, err);
    return 0;
}

/* Diagnostics that need nothing but the environment and the rank: AM_FAULT, the flight
 * recorder's size, the watchdog's timeout, every rank's host (for messages). */
static int setup_diagnostics(struct trainer *t, struct am_errors *err)
{
    char msg[512];
    size_t size;
    if (am_fault_parse(getenv("AM_FAULT"), &t->fault, msg, sizeof(msg)) < 0 ||
        am_fault_check(&t->fault, t->s->info.size, t->p->dp, msg, sizeof(msg)) < 0 ||
        am_fault_check_ep(&t->fault, t->p->ep, msg, sizeof(msg)) < 0 ||
        am_flight_size_from_env(&size, msg, sizeof(msg)) < 0 ||
        am_watchdog_timeout(t->s->timeout_s, &t->wd.timeout_s, &t->wd.timeout_from, msg, sizeof(msg)) < 0 ||
        am_flight_init(&t->flight, size, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    t->hosts = calloc((size_t)t->s->info.size, sizeof(*t->hosts));
    if (!t->hosts)
        return am_errors_fail(err, "out of memory for %d host names", t->s->info.size);
    for (int r = 0; r < t->s->info.size; r++)
        t->hosts[r] = t->s->ranks ? t->s->ranks[r].host : "";
    return 0;
}

/* The rank's device: AM_DEVICE (cpu, cuda) when set, else CUDA where this build has complete
 * CUDA kernels (every kernel of the table) and the rank was given a GPU, else the CPU. Its
 * communicators follow: UCX for host memory, NCCL for device memory. */
static int open_device(struct trainer *t, struct am_errors *err)
{
    const char *want = getenv("AM_DEVICE");
    const struct am_kernels *cuda = am_kernels_for(AM_DEV_CUDA);
    enum am_device d = cuda && am_kernels_missing(cuda, NULL, 0) == 0 && t->s->topo.gpu.device >= 0 ? AM_DEV_CUDA
                                                                                                   : AM_DEV_CPU;
    char msg[512];
    if (want && *want) {
        if (strcmp(want, "cpu") != 0 && strcmp(want, "cuda") != 0)
            return am_errors_fail(err, "AM_DEVICE=%s: not a device (cpu or cuda)", want);
        d = strcmp(want, "cuda") == 0 ? AM_DEV_CUDA : AM_DEV_CPU;
    }
    if (am_dev_open(&t->dev, d, t->s->topo.gpu.device, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    t->K = t->dev.k;
    return 0;
}

/* AM_GRAD_OVERLAP=0 reduces the gradients after the backward instead of during it. */
static bool grad_overlap(void)
{
    const char *v = getenv("AM_GRAD_OVERLAP");
    return !(v && strcmp(v, "0") == 0);
}

/* ---- the rank program's start: the log before anything that can fail ------------------- */

/* The host as the launcher names it: Slurm's node name under srun, else the host name. */
static void host_name(char *out, size_t len)
{
    const char *node = getenv("SLURMD_NODENAME");
    if (node && *node)
        snprintf(out, len, "%s", node);
    else if (gethostname(out, len - 1) < 0)
        snprintf(out, len, "localhost");
    out[len - 1] = '\0';
}

/* A whole number from the environment, or -1. */
static long env_number(const char *name)
{
    const char *v = getenv(name);
    char *end;
    if (!v || !*v)
        return -1;
    errno = 0;
    long n = strtol(v, &end, 10);
    return *end || errno || n < 0 || n > (1L << 30) ? -1 : n;
}

int am_train_log_begin(struct am_log *log, int *rank, char *err, size_t err_len)
{
    const char *job = getenv("AM_JOB_ID"), *recipe = getenv("AM_RECIPE");
    long r = env_number("AM_RANK"), world = env_number("AM_WORLD_SIZE"), local = env_number("AM_LOCAL_RANK");
    char host[256];
    log->fd = -1;
    *rank = (int)r;
    if (!job || !*job || r < 0) {
        snprintf(err, err_len, "no log: AM_JOB_ID and AM_RANK are not set (am-launch sets them: start rank programs "
                 "with am-launch)");
        return -1;
    }
    if (am_log_open(log, NULL, job, (int)r, err, err_len) < 0)
        return -1;
    host_name(host, sizeof(host));
    json_t *o = json_pack("{s:s,s:i,s:i,s:s,s:s,s:f}", "host", host, "pid", (int)getpid(), "rank", (int)r, "job", job,
                          "version", PACKAGE_VERSION, "time", am_wall_time());
    if (world > 0)
        json_object_set_new(o, "world", json_integer(world));
    if (local >= 0)
        json_object_set_new(o, "local_rank", json_integer(local));
    if (recipe && *recipe)
        json_object_set_new(o, "recipe", json_string(recipe));
    am_log_record(log, "start", o);
    return am_crash_install(log->fd, (int)r, NULL, err, err_len);
}

void am_train_log_failure(struct am_log *log, int rank, const char *stage, const struct am_errors *err)
{
    if (log->fd < 0 || err->n == 0 || !am_crash_report_begin())
        return;
    json_t *o = json_pack("{s:s,s:s,s:s,s:i,s:f}", "cause", "error", "stage", stage, "message", err->msg[0], "rank",
                          rank, "time", am_wall_time());
    if (err->n > 1) {
        json_t *all = json_array();
        for (size_t i = 0; i < err->n; i++)
            json_array_append_new(all, json_string(err->msg[i]));
        json_object_set_new(o, "messages", all);
    }
    am_log_record(log, "cause", o);
    am_crash_report_end();
}

void am_train_log_end(struct am_log *log)
{
    am_crash_uninstall();
    am_log_close(log);
}

int am_train(struct am_rank_setup *s, struct am_log *log, struct am_errors *err)
{
    struct trainer t = {.s = s, .r = s->recipe, .p = &s->plan, .log = log};
    char msg[512];
    int rc = -1;
    if (check_supported(t.p, t.r, err) < 0 || setup_diagnostics(&t, err) < 0 || open_device(&t, err) < 0)
        goto out;
    am_crash_set_flight(&t.flight);
    am_kernels_set_fault_hook(device_fault, &t);
    if (device_peak(&t, msg, sizeof(msg)) < 0) {
        am_errors_fail(err, "%s", msg);
        goto out;
    }
    log_start(&t);
    if (t.r->ckpt.enabled && am_preempt_install(msg, sizeof(msg)) < 0) {
        am_errors_fail(err, "%s", msg);
        goto out;
    }
    if (build_comms(&t, err) < 0)
        goto out;
    t.wd.flight = &t.flight;
    t.wd.ctx = t.g.ctx;
    t.wd.log = t.log;
    t.wd.hosts = t.hosts;
    t.wd.n_hosts = s->info.size;
    t.wd.rank = s->info.rank;
    if (am_watchdog_start(&t.wd, msg, sizeof(msg)) < 0) {
        am_errors_fail(err, "%s", msg);
        goto out;
    }
    /* the device's memory for the run reserved at once, as the plan counts it (CUDA: the
     * caching allocator's arena; it grows past that when the estimate falls short) */
    if (t.K->reserve && plan_bytes(&t) > 0 && t.K->reserve(&t.dev, (size_t)plan_bytes(&t)) < 0)
        fprintf(stderr, "am-train: rank %d: could not reserve the plan's %.0f bytes on %s up front; allocating as "
                "the run goes\n", s->info.rank, plan_bytes(&t), t.dev.name);
    if (build_model(&t, err) < 0 || build_data(&t, err) < 0)
        goto out;
    /* with expert parallelism the experts are sharded, and their gradients reduced, over the
     * ranks holding the same ones (fsdp.h; one rank when ep = dp: a communicator of one) */
    for (int g = 0; t.p->ep > 1 && g < t.model.n_groups; g++)
        if (t.model.groups[g].kind == AM_PG_EXPERTS)
            t.model.groups[g].comm = t.g.edp;
    if (t.sharded &&
        am_fsdp_init(&t.fsdp, &t.model, t.g.dp_shard, t.zero, t.r->dist.reshard_after_forward, msg, sizeof(msg)) < 0) {
        am_errors_fail(err, "%s", msg);
        goto out;
    }
    size_t n_opt = t.sharded ? t.fsdp.n_shard : t.model.grad_elems; /* LoRA: the adapters' alone */
    if (am_optim_init(&t.optim, &t.dev, n_opt, t.r) < 0) {
        am_errors_fail(err, "out of memory for the optimizer state of %zu parameters", n_opt);
        goto out;
    }
    /* from ZeRO stage 2 the gradients are sharded too: per-group buffers reduce-scattered into
     * the shards (grad_sync.h) */
    struct am_gsync_shards shards = {t.fsdp.grads, t.fsdp.n_shard, t.g.dp_replicate};
    if (am_gsync_init(&t.sync, &t.model, t.p->dp * t.p->cp > 1 ? t.grad_dp : NULL, grad_overlap(), t.r->reduce_dtype,
                      t.zero >= 2 ? &shards : NULL, msg, sizeof(msg)) < 0) {
        am_errors_fail(err, "%s", msg);
        goto out;
    }
    install_hooks(&t);
    log_memory(&t);
    if (restore_checkpoint(&t, err) < 0)
        goto out;
    rc = run(&t, err);
out:
    am_watchdog_stop(&t.wd);
    if (rc < 0 && t.log->fd >= 0 && err->n)
        report_error(&t, err->msg[0]);
    am_crash_set_flight(NULL); /* freed below */
    am_kernels_set_fault_hook(NULL, NULL);
    /* the communicators first: a request or a send still under way (a step that failed in
     * its backward) writes into or reads from the gradients and the pipeline's buffers until
     * its group is destroyed */
    am_groups_free(&t.g);
    am_gsync_free(&t.sync);
    am_fsdp_free(&t.fsdp);
    am_optim_free(&t.optim);
    am_model_free(&t.model);
    am_pipe_free(&t.pipe);
    am_gpt_close(t.data);
    am_gpt_close(t.mask);
    am_packs_close(t.packs);
    free(t.starts);
    free(t.pack_rows);
    for (int i = 0; t.mask_paths && i < t.r->data.n_paths; i++)
        free(t.mask_paths[i]);
    free(t.mask_paths);
    free(t.mask_sample);
    free(t.sample);
    free(t.tokens);
    free(t.targets);
    free(t.cp_pos);
    am_flight_free(&t.flight);
    free(t.hosts);
    am_dev_close(&t.dev);
    return rc;
}
