/* golden_dist - a rank program: a Hugging Face golden model (tests/golden/) trained sharded
 * over tp x pp by the library, exactly as am-train trains, against transformers' losses.
 *
 *   AM_TP=2 AM_PP=2 am-launch --nproc 4 RECIPE -- tests/train/golden_dist CASE
 *
 * The recipe (tests/train/test-golden-dist.sh writes it) names the case's model directory
 * (model.pretrained_model_name_or_path), the golden's AdamW (optimizer, constant lr, no
 * warm-up, clip_grad_norm.max_norm 1.0) and a batch shaped like the golden one: one
 * data-parallel replica, step_scheduler.local_batch_size = global_batch_size = B = 2,
 * pp_microbatch_size 1 (so each golden row is one micro-batch) and dataset.seq_length = T. The
 * program refuses any other shape. (With AM_TP=1 AM_PP=1 on one rank it gives the one-rank
 * baseline of the same sequence.)
 *
 * Every rank sets up as am-train does (rank_setup.h), builds its communicators as am-train
 * does (groups.h), and its shard as am_train_build_model does (setup.c: am_pipe_init, am_model_init, am_pipe_bind, am_model_load_hf of the case). Then 5 steps on the golden batch
 * as train.c's run() does them (with one data-parallel rank, nothing to reduce over dp): zero
 * the gradients, am_pipe_run, am_model_finish_grads, the loss summed over the pp group (only
 * the last stage has it, am_model_reduce_loss), am_model_grad_sumsq, am_optim_step at
 * am_lr_at (clipping by max_norm / (norm + 1e-6) on the device), one read of both. Twice, each from a fresh
 * load: without clipping, against losses_adamw / grad_norms_adamw; with the recipe's
 * max_norm, against losses_adamw_clip / grad_norms_adamw_clip.
 *
 * LoRA (a recipe with a peft section: the cases llama_lora_qv and llama_lora_all, whose recipe
 * names CASE/base): the model gets the recipe's adapters (as am-train sets them), loads the base
 * and then peft's initial adapters (CASE/adapter_init), and the optimizer steps the adapters
 * alone (the gradient slab's span, as am-train); one series without clipping, each loss against
 * losses_adamw (the golden has no grad norms), then every adapter element this rank holds
 * against the golden's final adapters (final.*; gpt_oss's experts' in their ParamWrapper tensors,
 * am_model_peft_place) within 5e-5 absolute (test_golden's tolerance
 * for final weights: AdamW moves an element whose gradient nearly cancels by up to lr on
 * rounding alone).
 *
 * The golden convention (tests/golden/README.md): token t's target is input t + 1, the last
 * position has none (target -1), and the loss is the mean over the B * (T - 1) targets, so the
 * gradient scale is 1 / (B * (T - 1)) rather than am-train's 1 / (B * T). A sequence of T
 * tokens (not T - 1) keeps T divisible by tp for sequence parallelism.
 *
 * Tolerances: each loss within 1e-5 absolute, each grad norm within 1e-5 relative (the
 * README's: transformers' own fp32-vs-fp64 distance on these losses is at most 6.4e-7).
 * Rank 0 prints one line per step (got, want, difference) and, when every check passed,
 * "golden tpT ppP CASE: N checks passed (...)", else "... M of N checks FAILED". Every rank
 * checks its own copy of the values (the others say only how many failed) and exits 1 on any
 * mismatch, all together after rank 0 has printed (am_rank_setup_exit); a failure to set up
 * or to communicate aborts the job.
 */
#include <libgen.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "groups.h"
#include "kernels.h"
#include "model.h"
#include "model_io.h"
#include "optim.h"
#include "pipeline.h"
#include "rank_setup.h"
#include "safetensors.h"

#define STEPS 5
#define LOSS_TOL 1e-5 /* absolute */
#define NORM_TOL 1e-5 /* relative */
#define FINAL_TOL 5e-5 /* absolute: LoRA's final adapters */

/* The golden batch and the two AdamW series of one case. */
struct golden {
    const char *name;
    char dir[4096];             /* the model directory (the recipe's config.json's) */
    int64_t B, T;
    int32_t *tokens, *targets;  /* [B, T], row b = micro-batch b */
    int n_targets;              /* B * (T - 1) */
    float losses[2][STEPS], norms[2][STEPS]; /* [clip] */
    bool lora;                  /* a LoRA case: the base in dir, the golden and adapter_init beside it */
    char golden[4200];          /* golden.safetensors */
};

/* This rank's setup and communicators (groups.h, as am-train builds them). */
struct dist {
    struct am_rank_setup *s;
    struct am_dev dev;
    struct am_groups g;
};

/* The running tally of checks; rank 0 prints, every rank keeps its verdict. */
struct tally {
    int rank, checks, failures;
    double loss_worst, norm_worst, final_worst;
};

/* Copies `n` floats of the golden tensor `key` into out; -1 with a message when the tensor is
 * missing or has another size. */
static int read_series(struct am_st_file *f, const char *key, float *out, int64_t n, struct am_errors *err)
{
    const struct am_st_info *t = am_st_find(f, key);
    if (!t)
        return am_errors_fail(err, "%s: no tensor %s", am_st_path(f), key);
    if (t->numel != n)
        return am_errors_fail(err, "%s: %s has %lld elements, want %lld", am_st_path(f), key, (long long)t->numel, (long long)n);
    return am_st_read_f32(f, t, 0, n, out, err);
}

/* Reads the case's golden.safetensors next to the recipe's config.json: the batch (tokens
 * and the shifted targets) and the four series. */
static int open_golden(struct golden *G, const char *name, const struct am_recipe *r, struct am_errors *err)
{
    memset(G, 0, sizeof(*G));
    G->name = name;
    if (strcmp(r->model_source, "inline") == 0)
        return am_errors_fail(err, "the recipe must name the golden model: model.pretrained_model_name_or_path");
    snprintf(G->dir, sizeof(G->dir), "%s", r->model_source);
    dirname(G->dir);
    G->lora = r->peft.enabled;
    char path[4200], up[4096];
    snprintf(up, sizeof(up), "%s", G->dir);
    snprintf(path, sizeof(path), "%s/golden.safetensors", G->lora ? dirname(up) : G->dir);
    snprintf(G->golden, sizeof(G->golden), "%s", path);
    struct am_st_file *f;
    if (am_st_open(path, &f, err) < 0)
        return -1;
    int rc = -1;
    const struct am_st_info *ids = am_st_find(f, "input_ids");
    if (!ids || ids->dtype != AM_ST_I32 || ids->ndim != 2 || ids->shape[1] < 2) {
        am_errors_fail(err, "%s: input_ids must be I32 [B, T >= 2]", path);
        goto out;
    }
    G->B = ids->shape[0];
    G->T = ids->shape[1];
    size_t N = (size_t)(G->B * G->T);
    G->tokens = malloc(N * sizeof(int32_t));
    G->targets = malloc(N * sizeof(int32_t));
    if (!G->tokens || !G->targets) {
        am_errors_fail(err, "out of memory for the golden batch");
        goto out;
    }
    memcpy(G->tokens, ids->data, N * sizeof(int32_t));
    for (int64_t b = 0; b < G->B; b++)
        for (int64_t t = 0; t < G->T; t++)
            G->targets[b * G->T + t] = t + 1 < G->T ? G->tokens[b * G->T + t + 1] : -1;
    G->n_targets = (int)(G->B * (G->T - 1));
    static const char *const keys[2][2] = {{"losses_adamw", "grad_norms_adamw"},
                                           {"losses_adamw_clip", "grad_norms_adamw_clip"}};
    if (G->lora) { /* the golden's losses, read as float64 */
        const struct am_st_info *l = am_st_find(f, "losses_adamw");
        if (!l || l->dtype != AM_ST_F64 || l->numel != STEPS) {
            am_errors_fail(err, "%s: losses_adamw must be F64 [%d]", path, STEPS);
            goto out;
        }
        for (int k = 0; k < STEPS; k++)
            G->losses[0][k] = (float)((const double *)l->data)[k];
        rc = 0;
        goto out;
    }
    for (int c = 0; c < 2; c++)
        if (read_series(f, keys[c][0], G->losses[c], STEPS, err) < 0 ||
            read_series(f, keys[c][1], G->norms[c], STEPS, err) < 0)
            goto out;
    rc = 0;
out:
    am_st_close(f);
    return rc;
}

static void close_golden(struct golden *G)
{
    free(G->tokens);
    free(G->targets);
}

/* The plan must run the golden batch as it is: one replica, one pipeline run per step whose
 * micro-batches are the B rows (1 row each with pp > 1, where pp_microbatch_size is 1; all B
 * at once with pp 1), T tokens each. */
static int check_shape(const struct am_plan *p, const struct golden *G, struct am_errors *err)
{
    if (p->dp != 1 || p->cp != 1 || p->ep != 1 || p->grad_accum != 1 ||
        p->microbatch_size * p->n_microbatches != G->B || p->seq_length != G->T)
        return am_errors_fail(err, "the plan must hold the golden batch of %lld x %lld tokens as it is: dp 1, cp 1, ep 1, one "
                    "accumulation step of %lld sequences (got dp %d, cp %d, ep %d, %ld accumulation step(s) of %ld "
                    "micro-batch(es) of %ld x %ld tokens): set step_scheduler.global_batch_size and local_batch_size "
                    "to %lld, distributed.pipeline.pp_microbatch_size 1 and dataset.seq_length %lld",
                    (long long)G->B, (long long)G->T, (long long)G->B, p->dp, p->cp, p->ep, p->grad_accum,
                    p->n_microbatches, p->microbatch_size, p->seq_length, (long long)G->B, (long long)G->T);
    return 0;
}

/* Counts one comparison of step `step`'s `what`; rank 0 prints it. */
static void compare(struct tally *t, const char *series, int step, const char *what, double got, double want,
                    bool relative)
{
    double diff = fabs(got - want) / (relative ? fabs(want) : 1.0);
    bool ok = diff <= (relative ? NORM_TOL : LOSS_TOL) && isfinite(got);
    double *worst = relative ? &t->norm_worst : &t->loss_worst;
    *worst = fmax(*worst, diff);
    t->checks++;
    t->failures += !ok;
    if (t->rank == 0)
        printf("%s step %d: %-9s got %.7f want %.7f %s %.2e%s\n", series, step + 1, what, got, want,
               relative ? "rel" : "diff", diff, ok ? "" : "  MISMATCH");
}

/* LoRA: every adapter element this rank holds (its tp slice) against the golden's final
 * adapters, one check per tensor (FINAL_TOL absolute); rank 0 prints the worst. */
static int compare_final(const struct am_model *m, const struct golden *G, struct tally *t, struct am_errors *err)
{
    struct am_st_file *f;
    if (am_st_open(G->golden, &f, err) < 0)
        return -1;
    int rc = 0, n = 0;
    double worst = 0;
    for (int i = 0; i < m->n_params && rc == 0; i++) {
        const struct am_param *p = &m->params[i];
        if (!am_model_is_lora(p))
            continue;
        char key[200], name[160];
        int64_t shape[2], cols = p->full_cols, lr = p->w.shape[0], lc = p->w.shape[1];
        int64_t *at = malloc((size_t)(p->full_rows * cols) * sizeof(int64_t));
        if (at) /* gpt_oss's experts' adapters: in their layer's ParamWrapper tensors */
            am_model_peft_place(m, p, name, sizeof(name), shape, at);
        snprintf(key, sizeof(key), "final.%s", at ? name : p->name);
        const struct am_st_info *gi = at ? am_st_find(f, key) : NULL;
        float *want = gi && gi->numel == shape[0] * (shape[1] > 0 ? shape[1] : 1)
                          ? malloc((size_t)gi->numel * sizeof(float)) : NULL;
        float *mine = malloc((size_t)(lr * lc) * sizeof(float));
        if (!want || !mine || am_st_read_f32(f, gi, 0, gi->numel, want, err) < 0) {
            rc = am_errors_fail(err, "%s: no %s of %lld x %lld", G->golden, key, (long long)shape[0],
                                (long long)shape[1]);
        } else {
            am_param_read(m, p, mine, 0, (size_t)(lr * lc));
            double diff = 0;
            for (int64_t y = 0; y < lr; y++)
                for (int64_t c = 0; c < lc; c++)
                    diff = fmax(diff, fabs((double)mine[y * lc + c] - want[at[(p->row0 + y) * cols + p->col0 + c]]));
            worst = fmax(worst, diff);
            t->checks++;
            t->failures += !(diff <= FINAL_TOL);
            if (!(diff <= FINAL_TOL) && t->rank == 0)
                printf("final %s: differs by %.2e  MISMATCH\n", p->name, diff);
            n++;
        }
        free(want);
        free(mine);
        free(at);
    }
    am_st_close(f);
    t->final_worst = fmax(t->final_worst, worst);
    if (rc == 0 && t->rank == 0)
        printf("final adapters: %d tensors on rank 0, largest difference %.2e (tolerance %.0e)\n", n, worst, FINAL_TOL);
    return rc;
}

/* One series: a fresh shard loaded from the case, 5 steps as train.c's run() takes them,
 * clipping at the recipe's max_norm when `clip`. Returns 0 (mismatches are counted in t), or
 * -1 with a message when the library or a communicator failed. */
static int run_series(struct dist *d, const struct golden *G, bool clip, struct tally *t, struct am_errors *err)
{
    const struct am_recipe *r = d->s->recipe;
    const struct am_plan *p = &d->s->plan;
    const char *series = clip ? "adamw_clip" : "adamw";
    struct am_model m = {0};
    struct am_pipe pipe = {0};
    struct am_optim optim = {0};
    struct am_model_shard sh;
    struct am_comm *pp = p->pp > 1 ? d->g.pp : NULL;
    char msg[1024];
    int rc = -1;
    /* am_train_build_model */
    if (am_pipe_init(&pipe, p, r, &d->s->coords, &sh, msg, sizeof(msg)) < 0) {
        am_errors_fail(err, "%s", msg);
        goto out;
    }
    if (G->lora) { /* as am-train's am_train_build_model */
        sh.lora_r = (int)r->peft.dim;
        sh.lora_alpha = (float)r->peft.alpha;
        sh.lora_targets = r->peft.targets & ((1u << AM_LORA_NTARGETS) - 1);
        sh.lora_experts = r->peft.experts;
        sh.lora_experts_r = r->peft.experts ? (int)r->peft.experts_dim : 0;
    }
    if (am_model_init(&m, &r->model, &sh, &d->dev, d->g.tp, pp, p->microbatch_size, p->seq_length, msg, sizeof(msg)) < 0 ||
        am_pipe_bind(&pipe, &m, p->microbatch_size, pp, p->pp > 1 ? d->g.pp_grad : NULL, msg, sizeof(msg)) < 0) {
        am_errors_fail(err, "%s", msg);
        goto out;
    }
    if (am_model_load_hf(&m, G->dir, err) < 0)
        goto out;
    if (G->lora) {
        char init[4200], up[4096];
        snprintf(up, sizeof(up), "%s", G->dir);
        snprintf(init, sizeof(init), "%s/adapter_init", dirname(up));
        if (am_model_load_peft(&m, init, err) < 0)
            goto out;
    }
    /* every parameter, or with LoRA the adapters alone: the gradient slab's span, as am-train */
    if (am_optim_init(&optim, &d->dev, m.grad_elems, m.store_dt, r) < 0) {
        am_errors_fail(err, "out of memory for the optimizer state of %zu parameters", m.grad_elems);
        goto out;
    }
    /* run() */
    float dloss_scale = (float)(1.0 / G->n_targets);
    for (int step = 0; step < STEPS; step++) {
        struct am_model_values v;
        am_model_begin_step(&m);
        if (am_pipe_run(&pipe, &m, G->tokens, G->targets, NULL, p->microbatch_size, dloss_scale, true, msg, sizeof(msg)) < 0 ||
            am_model_finish_grads(&m, msg, sizeof(msg)) < 0 || am_model_reduce_loss(&m, NULL, msg, sizeof(msg)) < 0 ||
            am_model_grad_sumsq(&m, msg, sizeof(msg)) < 0) {
            am_errors_fail(err, "%s step %d: %s", series, step + 1, msg);
            goto out;
        }
        am_optim_step(&optim, (char *)m.param_mem + m.grad_off * am_dtype_size(m.store_dt), m.grad_mem, AM_F32,
                      am_model_sumsq(&m), clip ? r->optim.max_grad_norm : 0, (float)am_lr_at(r, step));
        am_model_read_scalars(&m, &v);
        double norm = sqrt(v.sumsq);
        compare(t, series, step, "loss", v.loss_sum / G->n_targets, G->losses[clip][step], false);
        if (!G->lora) /* the LoRA golden has no grad norms */
            compare(t, series, step, "grad norm", norm, G->norms[clip][step], true);
    }
    rc = G->lora ? compare_final(&m, G, t, err) : 0;
out:
    am_optim_free(&optim);
    am_model_free(&m);
    am_pipe_free(&pipe);
    return rc;
}

/* Both series on this rank; 0, or -1 with the reason in err. */
static int run(struct dist *d, const char *name, struct tally *t, struct am_errors *err)
{
    const struct am_recipe *r = d->s->recipe;
    const struct am_plan *p = &d->s->plan;
    struct golden G;
    int rc = open_golden(&G, name, r, err);
    if (rc == 0)
        rc = check_shape(p, &G, err);
    if (rc == 0 && r->optim.max_grad_norm <= 0 && !G.lora)
        rc = am_errors_fail(err, "the recipe must clip (clip_grad_norm.max_norm 1.0) for the golden's clipped series");
    if (rc == 0)
        rc = am_groups_build(&d->g, d->s, AM_COMM_UCX, -1, NULL, NULL, err);
    if (rc == 0 && t->rank == 0)
        printf("golden tp%d pp%d %s: %s, %d virtual stage(s) per pp rank, sequence parallel %s, %lld x %lld tokens\n",
               p->tp, p->pp, name, am_pp_schedule_name(r->dist.pipeline.schedule), p->virtual_stages,
               r->dist.sequence_parallel ? "on" : "off", (long long)G.B, (long long)G.T);
    for (int clip = 0; rc == 0 && clip < (G.lora ? 1 : 2); clip++) /* LoRA: the golden has no clipped series */
        rc = run_series(d, &G, clip, t, err);
    close_golden(&G);
    return rc;
}

int main(int argc, char **argv)
{
    struct am_rank_setup s;
    struct am_errors err;
    am_errors_init(&err);
    int rc = am_rank_setup(&s, &err);
    if (rc < 0 || argc != 2) {
        if (s.info.rank == 0 || !s.boot) {
            if (argc != 2)
                fprintf(stderr, "usage: AM_TP=2 AM_PP=2 am-launch --nproc 4 RECIPE -- golden_dist CASE\n");
            for (size_t i = 0; i < err.n; i++)
                fprintf(stderr, "golden_dist: error: %s\n", err.msg[i]);
        }
        fflush(stderr);
        am_rank_setup_exit(&s, 1);
    }
    struct dist d = {.s = &s};
    char msg[256];
    if (am_dev_open(&d.dev, AM_DEV_CPU, -1, msg, sizeof(msg)) < 0) {
        fprintf(stderr, "golden_dist: %s\n", msg);
        return 1;
    }
    struct tally t = {.rank = s.info.rank};
    rc = run(&d, argv[1], &t, &err);
    for (size_t i = 0; i < err.n; i++)
        fprintf(stderr, "golden_dist: rank %d: error: %s\n", s.info.rank, err.msg[i]);
    fflush(stdout);
    if (rc < 0 && s.boot)
        am_boot_abort(s.boot, 1, err.n ? err.msg[0] : "golden_dist failed");
    if (t.rank == 0 && t.failures)
        printf("golden tp%d pp%d %s: %d of %d checks FAILED\n", s.plan.tp, s.plan.pp, argv[1], t.failures, t.checks);
    else if (t.rank == 0)
        printf("golden tp%d pp%d %s: %d checks passed (largest loss difference %.2e, grad norm %.2e relative)\n",
               s.plan.tp, s.plan.pp, argv[1], t.checks, t.loss_worst, t.norm_worst);
    else if (t.failures) /* rank 0 printed its own copy of the values; these are this rank's */
        fprintf(stderr, "golden_dist: rank %d: %d of %d checks FAILED\n", t.rank, t.failures, t.checks);
    fflush(stdout);
    am_groups_free(&d.g);
    am_errors_free(&err);
    am_rank_setup_exit(&s, t.failures != 0); /* collective: rank 0's lines are out before any rank exits */
}
