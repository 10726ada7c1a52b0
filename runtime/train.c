/* train.c - the training loop (train.h). */
#include "train.h"

#include <errno.h>
#include <libgen.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "dataset.h"
#include "log.h"
#include "model.h"
#include "model_io.h"
#include "optim.h"
#include "util.h"

struct trainer {
    struct am_rank_setup *s;
    const struct am_recipe *r;
    const struct am_plan *p;
    const struct am_kernels *K;
    struct am_comm_ctx *ctx;
    struct am_group_set groups;
    struct am_comm **comms;
    struct am_comm *dp, *tp;
    int dp_rank;
    struct am_model model;
    struct am_optim optim;
    struct am_gpt *data;
    struct am_log log;
    int32_t *sample, *tokens, *targets; /* host buffers for one micro-batch */
    char base_config[4096];
};

static int fail(struct am_errors *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(struct am_errors *err, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    am_errorf(err, NULL, "%s", text);
    return -1;
}

/* The layouts this trainer runs so far: data and tensor parallelism (without sequence
 * parallelism); pipeline, context and expert parallelism not yet. */
static int check_supported(const struct am_recipe *r, const struct am_plan *p, struct am_errors *err)
{
    if (p->pp > 1 || p->cp > 1 || p->ep > 1 || r->dist.sequence_parallel)
        return fail(err, "am-train does not run this layout yet: pp_size %d, cp_size %d, ep_size %d, "
                    "sequence_parallel %s (it runs data and tensor parallelism: use 1, 1, 1 and false)", p->pp,
                    p->cp, p->ep, r->dist.sequence_parallel ? "true" : "false");
    return 0;
}

static int build_comms(struct trainer *t, struct am_errors *err)
{
    char msg[512];
    static const enum am_group kinds[] = {AM_GROUP_DP, AM_GROUP_TP};
    t->ctx = am_comm_ctx_init(AM_COMM_UCX, t->s->boot, &t->s->info, -1, t->s->timeout_s, msg, sizeof(msg));
    if (!t->ctx)
        return fail(err, "%s", msg);
    if (am_place_groups(t->p, &t->s->place, kinds, 2, &t->groups, err) < 0)
        return -1;
    t->comms = calloc((size_t)t->groups.n, sizeof(*t->comms));
    if (!t->comms)
        return fail(err, "out of memory for %d communicators", t->groups.n);
    if (am_comm_create_groups(t->ctx, t->groups.n, t->groups.groups, t->groups.sizes, t->groups.names, t->comms) < 0)
        return fail(err, "%s", am_comm_ctx_error(t->ctx));
    for (int g = 0; g < t->groups.n; g++) {
        if (!t->comms[g])
            continue;
        if (t->groups.kinds[g] == AM_GROUP_DP)
            t->dp = t->comms[g];
        if (t->groups.kinds[g] == AM_GROUP_TP)
            t->tp = t->comms[g];
    }
    t->dp_rank = am_comm_rank(t->dp);
    return 0;
}

/* Weights: the checkpoint named by the recipe when it has any, else a random init. */
static int build_model(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    char msg[512];
    struct am_model_shard sh = {.tp = t->p->tp, .tp_rank = t->s->coords.tp, .first_layer = 0,
                                .n_layers = (int)r->model.num_hidden_layers, .first_stage = true, .last_stage = true};
    if (am_model_init(&t->model, &r->model, &sh, t->K, t->tp, t->p->microbatch_size, t->p->seq_length, msg,
                      sizeof(msg)) < 0)
        return fail(err, "%s", msg);
    t->base_config[0] = '\0';
    if (strcmp(r->model_source, "inline") != 0) {
        snprintf(t->base_config, sizeof(t->base_config), "%s", r->model_source);
        char dir[4096];
        snprintf(dir, sizeof(dir), "%s", r->model_source);
        dirname(dir);
        if (am_model_dir_has_weights(dir))
            return am_model_load_hf(&t->model, dir, err);
    }
    am_model_init_weights(&t->model, (uint64_t)r->seed);
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
    if (am_gpt_open(&cfg, &t->data, err) < 0)
        return -1;
    size_t n = (size_t)(t->p->microbatch_size * t->p->seq_length);
    t->sample = malloc((size_t)(t->p->seq_length + 1) * sizeof(int32_t));
    t->tokens = malloc(n * sizeof(int32_t));
    t->targets = malloc(n * sizeof(int32_t));
    if (!t->sample || !t->tokens || !t->targets)
        return fail(err, "out of memory for the batch");
    return 0;
}

/* Fills tokens/targets with the micro-batch's samples: input = sample[0..T), target = sample[1..T]. */
static int read_microbatch(struct trainer *t, long step, int64_t micro, struct am_errors *err)
{
    int64_t T = t->p->seq_length, b = t->p->microbatch_size;
    for (int64_t j = 0; j < b; j++) {
        int64_t k = micro * b + j;
        int64_t idx = am_gpt_global_index(step, t->p->global_batch, t->dp_rank, t->p->dp, k);
        if (am_gpt_sample(t->data, idx, t->sample, err) < 0)
            return -1;
        memcpy(t->tokens + j * T, t->sample, (size_t)T * sizeof(int32_t));
        memcpy(t->targets + j * T, t->sample + 1, (size_t)T * sizeof(int32_t));
    }
    return 0;
}

/* The first parameter whose gradient is not finite, for the log. */
static const char *first_nonfinite(const struct am_model *m)
{
    for (int i = 0; i < m->n_params; i++)
        if (!m->K->all_finite(&m->params[i].g))
            return m->params[i].name;
    return "(none)";
}

static void log_start(struct trainer *t)
{
    const struct am_coords *c = &t->s->coords;
    json_t *o = json_pack("{s:s,s:i,s:i,s:i,s:s,s:s,s:i,s:{s:i,s:i,s:i,s:i,s:i,s:i},s:s,s:f}", "host",
                          t->s->info.host, "pid", (int)getpid(), "rank", t->s->info.rank, "world", t->s->info.size,
                          "job", t->s->info.job_id, "recipe", t->r->file, "local_rank", t->s->info.local_rank, "coords",
                          "pp", c->pp, "dp_replicate", c->dp_replicate, "dp_shard", c->dp_shard, "cp", c->cp, "tp",
                          c->tp, "ep", c->ep, "device", t->K->name, "time", am_wall_time());
    json_object_set_new(o, "version", json_string(PACKAGE_VERSION));
    am_log_record(&t->log, "start", o);
}

static void print_step(const struct trainer *t, long step, double loss, double lr, double norm, double dt,
                       double elapsed)
{
    double tok_s = t->p->tokens_per_step / dt;
    double eta = elapsed / (double)(step + 1) * (double)(t->r->steps.max_steps - step - 1);
    printf("step %4ld/%ld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | %.2f GFLOP/s | ETA %d:%02d\n",
           step + 1, t->r->steps.max_steps, loss, lr, norm, tok_s, t->p->flops_per_step / dt / 1e9,
           (int)eta / 60, (int)eta % 60);
    fflush(stdout);
}

static int save_checkpoint(struct trainer *t, long step, struct am_errors *err)
{
    if (!t->r->ckpt.enabled || t->dp_rank != 0 || t->s->coords.tp != 0)
        return 0;
    char dir[4096];
    const char *root = t->r->ckpt.dir ? t->r->ckpt.dir : "checkpoints";
    snprintf(dir, sizeof(dir), "%s/step_%ld", root, step);
    if (am_mkdir_p(root) < 0)
        return fail(err, "checkpoint.checkpoint_dir: cannot create %s: %s", root, strerror(errno));
    if (am_model_save_hf(&t->model, dir, t->base_config[0] ? t->base_config : NULL, err) < 0)
        return -1;
    am_log_record(&t->log, "checkpoint", json_pack("{s:i,s:s}", "step", (int)step, "dir", dir));
    return 0;
}

static int run(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    const struct am_plan *p = t->p;
    struct am_model *m = &t->model;
    double total_tokens = (double)p->global_batch * (double)p->seq_length;
    float dloss_scale = (float)(1.0 / total_tokens);
    double t0 = am_mono_time();
    for (long step = 0; step < r->steps.max_steps; step++) {
        double ts = am_mono_time(), loss_sum = 0;
        char msg[1024];
        am_model_zero_grad(m);
        for (int64_t a = 0; a < p->grad_accum; a++) {
            double mb_loss;
            if (read_microbatch(t, step, a, err) < 0)
                return -1;
            if (am_model_step(m, t->tokens, t->targets, p->microbatch_size, dloss_scale, &mb_loss, msg,
                              sizeof(msg)) < 0)
                return fail(err, "step %ld: %s", step + 1, msg);
            loss_sum += mb_loss;
        }
        if (am_model_finish_grads(m, msg, sizeof(msg)) < 0)
            return fail(err, "step %ld: %s", step + 1, msg);
        float loss_f = (float)loss_sum;
        if (p->dp > 1) {
            if (am_allreduce(t->dp, m->grad_mem, m->grad_mem, m->n_elems, AM_F32, AM_SUM) < 0 ||
                am_allreduce(t->dp, &loss_f, &loss_f, 1, AM_F32, AM_SUM) < 0)
                return fail(err, "step %ld: %s", step + 1, am_comm_error(t->dp));
            loss_sum = loss_f;
        }
        double loss = loss_sum / total_tokens;
        struct am_tensor g = am_tensor_view(m->grad_mem, t->K->device, AM_T_F32, (int64_t)m->n_elems, 0, 0, 0);
        double sumsq;
        if (am_model_grad_sumsq(m, &sumsq, msg, sizeof(msg)) < 0)
            return fail(err, "step %ld: %s", step + 1, msg);
        double norm = sqrt(sumsq);
        if (!isfinite(loss) || !isfinite(norm)) {
            const char *bad = first_nonfinite(m);
            am_log_record(&t->log, "cause", json_pack("{s:s,s:i,s:f,s:f,s:s}", "cause", "nonfinite", "step",
                                                      (int)step + 1, "loss", loss, "grad_norm", norm, "tensor", bad));
            return fail(err, "step %ld: the loss or gradient norm is not finite (loss %g, grad norm %g; first "
                        "non-finite gradient: %s)", step + 1, loss, norm, bad);
        }
        if (r->optim.max_grad_norm > 0) {
            double coef = r->optim.max_grad_norm / (norm + 1e-6);
            if (coef < 1.0)
                t->K->scale(&g, (float)coef);
        }
        double lr = am_lr_at(r, step);
        am_optim_step(&t->optim, m->param_mem, m->grad_mem, (float)lr);
        double dt = am_mono_time() - ts;
        am_log_record(&t->log, "step", json_pack("{s:i,s:f,s:f,s:f,s:I,s:f,s:f}", "step", (int)step + 1, "loss",
                                                 loss, "lr", lr, "grad_norm", norm, "tokens",
                                                 (json_int_t)p->tokens_per_step, "step_s", dt, "time",
                                                 am_wall_time()));
        if (t->s->info.rank == 0)
            print_step(t, step, loss, lr, norm, dt, am_mono_time() - t0);
        if (r->ckpt.enabled && r->steps.ckpt_every > 0 && (step + 1) % r->steps.ckpt_every == 0 &&
            save_checkpoint(t, step + 1, err) < 0)
            return -1;
    }
    if (r->ckpt.enabled && (r->steps.ckpt_every <= 0 || r->steps.max_steps % r->steps.ckpt_every != 0))
        return save_checkpoint(t, r->steps.max_steps, err);
    return 0;
}

int am_train(struct am_rank_setup *s, struct am_errors *err)
{
    struct trainer t = {.s = s, .r = s->recipe, .p = &s->plan, .K = am_kernels_for(AM_DEV_CPU)};
    char msg[512];
    int rc = -1;
    if (check_supported(t.r, t.p, err) < 0)
        goto out;
    if (am_log_open(&t.log, NULL, s->info.job_id, s->info.rank, msg, sizeof(msg)) < 0) {
        fail(err, "%s", msg);
        goto out;
    }
    log_start(&t);
    if (build_comms(&t, err) < 0 || build_model(&t, err) < 0 || build_data(&t, err) < 0)
        goto out;
    if (am_optim_init(&t.optim, t.K, t.model.n_elems, t.r) < 0) {
        fail(err, "out of memory for the optimizer state of %zu parameters", t.model.n_elems);
        goto out;
    }
    rc = run(&t, err);
out:
    if (rc < 0 && t.log.fd >= 0 && err->n)
        am_log_record(&t.log, "cause", json_pack("{s:s,s:s}", "cause", "error", "message", err->msg[0]));
    am_optim_free(&t.optim);
    am_model_free(&t.model);
    am_gpt_close(t.data);
    free(t.sample);
    free(t.tokens);
    free(t.targets);
    for (int g = 0; t.comms && g < t.groups.n; g++)
        am_comm_destroy(t.comms[g]);
    free(t.comms);
    am_group_set_free(&t.groups);
    am_comm_ctx_fini(t.ctx);
    am_log_close(&t.log);
    return rc;
}
