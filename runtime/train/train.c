/* train.c - the training of one rank (train.h): am_train's setup in order, the model's
 * hooks, the loop and its step, the end (trainer.h names the files that hold the rest). */
#include "train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "crash.h"
#include "moe.h"
#include "optim.h"
#include "preempt.h"
#include "trainer.h"
#include "util.h"

/* ---- what the rank opens first: its diagnostics and its device --------------------------- */

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

/* ---- the model's hooks (model.h), installed once ----------------------------------------- */

/* Each is data parallelism's (dp.h); a group's final gradients meet AM_FAULT (inject.c) first. */
static int group_use(void *arg, int group, bool backward, char *err, size_t err_len)
{
    struct trainer *t = arg;
    return am_dp_group_use(&t->dp, group, backward, err, err_len);
}

static int grad_use(void *arg, int group, char *err, size_t err_len)
{
    struct trainer *t = arg;
    return am_dp_grad_use(&t->dp, group, err, err_len);
}

static int grad_ready(void *arg, int group, char *err, size_t err_len)
{
    struct trainer *t = arg;
    if (am_train_fault_grad_ready(t, group, err, err_len) < 0)
        return -1;
    return am_dp_grad_ready(&t->dp, group, err, err_len);
}

static void install_hooks(struct trainer *t)
{
    struct am_model_hooks h = {.group_use = group_use, .grad_use = grad_use, .grad_ready = grad_ready,
                               .grads_each_pass = am_dp_grads_each_pass(&t->dp), .arg = t};
    am_model_set_hooks(&t->model, &h);
}

/* ---- one step ---------------------------------------------------------------------------- */

/* Forward and backward of every micro-batch of the step, gradients synchronised over dp. */
static int forward_backward(struct trainer *t, long step, float dloss_scale, struct am_errors *err)
{
    const struct am_plan *p = t->p;
    char msg[1024];
    am_model_begin_step(&t->model);
    am_dp_begin_step(&t->dp);
    am_train_fault_collectives(t, step);
    for (int64_t a = 0; a < p->grad_accum; a++) {
        if (am_train_read_microbatches(t, step - 1, a, err) < 0)
            return -1;
        /* adapter dropout: the global index of the first sequence read (batch.c), the next dp apart */
        int64_t b = p->microbatch_size * p->n_microbatches;
        am_model_set_batch_seq(&t->model, am_gpt_global_index(step - 1, p->global_batch, t->dp_rank, p->dp, a * b),
                               p->dp);
        am_model_set_pack_fill(&t->model, t->pack_fill); /* packed: the pads the MoE gate leaves out */
        if (am_pipe_run(&t->pipe, &t->model, t->tokens, t->targets, t->starts, p->microbatch_size, dloss_scale,
                        a == p->grad_accum - 1, msg, sizeof(msg)) < 0)
            return am_errors_fail(err, "step %ld: %s", step, msg);
    }
    t->model.where = (struct am_model_where){AM_PHASE_GRAD_SYNC, AM_WHERE_NONE};
    if (am_dp_end_backward(&t->dp, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "step %ld: %s", step, msg);
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
        am_dp_grad_sumsq(&t->dp, msg, sizeof(msg)) < 0)
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
        return am_train_nonfinite(t, step, *loss, sqrt(v.local_sumsq), "local", err);
    if (isfinite(*loss) && isfinite(*norm))
        return 0;
    if (reduced)
        am_fault_sleep(t->wd.timeout_s);
    return am_train_nonfinite(t, step, *loss, *norm, reduced ? "reduced" : "local", err);
}

/* The step's maxima over the job (trainer.h, job_max): every rank's step time and time
 * outside communication calls, AM_MODEL_JOB_MAX i64 reduced over the job (am_groups_job_max)
 * through the model's device scalars. A step
 * time >= 0 orders as its double's bits do; the time outside communication is packed as
 * microseconds << 24 | (2^24 - 1 - rank), so the maximum names its rank (the lowest of a tie). */
static int job_maxima(struct trainer *t, long step, double dt, struct am_errors *err)
{
    struct am_model *m = &t->model;
    struct am_comm *groups[4] = {t->g.tp, t->g.pp, t->g.dp, t->g.cp};
    const int64_t ranks = (int64_t)1 << 24;
    double work = dt - t->comm_s > 0 ? dt - t->comm_s : 0;
    int64_t v[AM_MODEL_JOB_MAX];
    char msg[1024];
    memcpy(&v[0], &dt, sizeof(double));
    v[1] = (int64_t)llround(work * 1e6) * ranks + (ranks - 1 - t->s->info.rank);
    void *a = m->scalars.job_max[0].data, *b = m->scalars.job_max[1].data, *max;
    t->K->upload(&t->dev, a, v, sizeof(v));
    if (am_groups_job_max(groups, a, b, AM_MODEL_JOB_MAX, AM_I64, &max, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "step %ld: the step's maxima over the job: %s", step, msg);
    t->K->download(&t->dev, v, max, sizeof(v));
    memcpy(&t->job_max.step_s, &v[0], sizeof(double));
    t->job_max.work_s = (double)(v[1] / ranks) / 1e6;
    t->job_max.work_rank = (int)(ranks - 1 - v[1] % ranks);
    return 0;
}

/* AutoModel's selection-bias update (moe.h; docs/training.md), after the optimizer's step as
 * its train loop calls update_moe_gate_bias: every held MoE layer's loads of the step summed
 * over dp x cp in one all-reduce, then the same update of the biases on every rank. */
static int update_bias(struct trainer *t, long step, struct am_errors *err)
{
    size_t n;
    char msg[1024];
    void *loads = am_moe_bias_loads(&t->model, &n);
    if (!loads)
        return 0;
    if (t->p->dp * t->p->cp > 1 && (am_allreduce(t->g.dp_cp, loads, loads, n, AM_I64, AM_SUM, msg, sizeof(msg)) < 0 ||
                                     am_comm_stream_wait(t->g.dp_cp, msg, sizeof(msg)) < 0))
        return am_errors_fail(err, "step %ld: the experts' loads for the selection bias: %s", step, msg);
    am_moe_bias_update(&t->model);
    return 0;
}

/* The steps from start_step to max_steps: each step's passes, its values, the optimizer, its
 * record and line, the checkpoints and Slurm's warning; the last state saved at the end. */
static int run(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    const struct am_plan *p = t->p;
    struct am_model *m = &t->model;
    char msg[1024];
    float dloss_scale = (float)(1.0 / ((double)p->global_batch * (double)p->seq_length));
    double t0 = am_mono_time();
    int rank = t->s->info.rank;
    for (long step = t->start_step; step < r->steps.max_steps; step++) {
        double ts = am_mono_time(), cs = am_cpu_time(), loss = 0, norm = 0;
        t->step = step + 1;
        am_crash_set_step(step + 1);
        double busy0 = am_comm_ctx_busy_s(t->g.ctx);
        am_train_fault_step_start(t, step + 1);
        double lr = am_lr_at(r, step);
        /* the loss is the mean over the labels it counts: every token's, or with a loss mask
         * or packed sequences the targets of the global batch (AutoModel's normalisation by its
         * num_label_tokens) */
        int64_t labels = p->global_batch * p->seq_length;
        if ((t->mask || t->packs) && am_train_count_labels(t, step, &labels, err) < 0)
            return -1;
        if (t->mask || t->packs)
            dloss_scale = labels ? (float)(1.0 / (double)labels) : 0.0f;
        if (forward_backward(t, step + 1, dloss_scale, err) < 0 || reduce_values(t, step + 1, err) < 0)
            return -1;
        m->where = (struct am_model_where){AM_PHASE_OPTIMIZER, AM_WHERE_NONE};
        /* clipped to max_norm / (norm + 1e-6) when below 1, or skipped when the norm is not
         * finite, on the device: enqueued before the one read of the step's values */
        if (am_dp_update(&t->dp, (float)lr, msg, sizeof(msg)) < 0)
            return am_errors_fail(err, "step %ld: %s", step + 1, msg);
        if (step_values(t, step + 1, labels ? (double)labels : 1.0, &loss, &norm, err) < 0 ||
            update_bias(t, step + 1, err) < 0)
            return -1;
        double dt = am_mono_time() - ts;
        t->cpu_s = am_cpu_time() - cs;
        t->comm_s = am_comm_ctx_busy_s(t->g.ctx) - busy0;
        if (job_maxima(t, step + 1, dt, err) < 0)
            return -1;
        am_train_log_step(t, step, loss, lr, norm, dt, labels);
        if (rank == 0)
            am_train_print_step(t, step, loss, lr, norm, dt, am_mono_time() - t0);
        bool saved = r->ckpt.enabled && r->steps.ckpt_every > 0 && (step + 1) % r->steps.ckpt_every == 0;
        if (saved && am_train_save_checkpoint(t, step + 1, err) < 0)
            return -1;
        int stop =
            r->ckpt.enabled && step + 1 < r->steps.max_steps ? am_train_preempt_check(t, step + 1, saved, err) : 0;
        if (stop != 0)
            return stop; /* -1, or 1: saved for a requeue */
    }
    if (r->ckpt.enabled && t->start_step < r->steps.max_steps && /* a restored end is saved already */
        (r->steps.ckpt_every <= 0 || r->steps.max_steps % r->steps.ckpt_every != 0))
        return am_train_save_checkpoint(t, r->steps.max_steps, err);
    return 0;
}

/* ---- the rank's training ----------------------------------------------------------------- */

int am_train(struct am_rank_setup *s, struct am_log *log, struct am_errors *err)
{
    struct trainer t = {.s = s, .r = s->recipe, .p = &s->plan, .log = log, .tb = {.fd = -1}};
    char msg[512];
    int rc = -1;
    if (setup_diagnostics(&t, err) < 0 || open_device(&t, err) < 0)
        goto out;
    am_crash_set_flight(&t.flight);
    am_kernels_set_fault_hook(am_train_device_fault, &t);
    if (am_train_device_peak(&t, msg, sizeof(msg)) < 0) {
        am_errors_fail(err, "%s", msg);
        goto out;
    }
    am_train_log_start(&t);
    if (t.r->ckpt.enabled && am_preempt_install(msg, sizeof(msg)) < 0) {
        am_errors_fail(err, "%s", msg);
        goto out;
    }
    if (am_train_build_comms(&t, err) < 0 || am_train_start_watchdog(&t, err) < 0)
        goto out;
    /* the device's memory for the run reserved at once, as the plan counts it */
    am_train_reserve(&t);
    if (am_train_build_model(&t, err) < 0 || am_train_build_data(&t, err) < 0 || am_train_build_dp(&t, err) < 0)
        goto out;
    install_hooks(&t);
    am_train_log_memory(&t);
    if (am_train_restore_checkpoint(&t, err) < 0)
        goto out;
    rc = run(&t, err);
out:
    am_watchdog_stop(&t.wd);
    /* printed before the cause record: a rank stopped by the job's teardown between the two
     * has printed whatever its log names */
    for (size_t i = 0; i < err->n; i++)
        fprintf(stderr, "am-train: rank %d: error: %s\n", s->info.rank, err->msg[i]);
    if (rc < 0 && t.log->fd >= 0 && err->n)
        am_train_report_error(&t, err->msg[0]);
    am_crash_set_flight(NULL); /* freed below */
    am_kernels_set_fault_hook(NULL, NULL);
    /* the communicators first: a request or a send still under way (a step that failed in
     * its backward) writes into or reads from the gradients and the pipeline's buffers until
     * its group is destroyed */
    am_groups_free(&t.g);
    am_dp_free(&t.dp);
    am_model_free(&t.model);
    am_pipe_free(&t.pipe);
    am_train_free_data(&t);
    am_flight_free(&t.flight);
    am_tfevents_close(&t.tb);
    free(t.hosts);
    am_dev_close(&t.dev);
    return rc;
}
