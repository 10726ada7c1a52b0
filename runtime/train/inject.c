/* inject.c - AM_FAULT (fault.h) at its points of the step (trainer.h). */
#include <math.h>

#include "comm.h"
#include "log.h"
#include "moe.h"
#include "trainer.h"
#include "util.h"

/* The "fault" record, written before the rank misbehaves: am-diag names the injected rank
 * and kind from it. */
static void fault_record(struct trainer *t, long step, const char *tensor)
{
    json_t *o = json_pack("{s:s,s:s,s:i,s:i,s:f}", "kind", am_fault_kind_name(t->fault.kind), "spec", t->fault.spec,
                          "rank", t->fault.rank, "step", (int)step, "time", am_wall_time());
    if (tensor)
        json_object_set_new(o, "tensor", json_string(tensor));
    am_log_record(t->log, "fault", o);
}

/* AM_FAULT at the start of a step: the record, then the fault (fault.h). */
void am_train_fault_step_start(struct trainer *t, long step)
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

/* AM_FAULT kind=hang-in-collective (dp's next all-reduce stalls), kind=kill-in-alltoall
 * (the rank dies inside the ep group's dispatch) and kind=expert-rows-oom (the growth of the
 * rows its experts receive fails: moe.h), armed before the step's passes. */
void am_train_fault_collectives(struct trainer *t, long step)
{
    const struct am_plan *p = t->p;
    if (p->dp > 1 && am_fault_due(&t->fault, t->s->info.rank, step, AM_FAULT_HANG_IN_COLLECTIVE)) {
        fault_record(t, step, NULL);
        am_comm_inject_stall(t->g.dp, am_comm_seq(t->g.dp) + 1);
    }
    if (p->ep > 1 && am_fault_due(&t->fault, t->s->info.rank, step, AM_FAULT_KILL_IN_ALLTOALL)) {
        fault_record(t, step, NULL); /* the ep group's next call exchanges counts, the one after dispatches */
        am_comm_inject_kill(t->g.ep, am_comm_seq(t->g.ep) + 2);
    }
    if (p->ep > 1 && am_fault_due(&t->fault, t->s->info.rank, step, AM_FAULT_EXPERT_ROWS_OOM)) {
        fault_record(t, step, NULL);
        am_moe_fail_growth(&t->model);
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
 * device's table (its failure reaches the device's fault hook, am_train_device_fault: the
 * "oom" cause record). */
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

/* At group's final gradients, before they are synchronised: kind=nan and kind=device-oom
 * in the group that holds the middle parameter. */
int am_train_fault_grad_ready(struct trainer *t, int group, char *err, size_t err_len)
{
    const struct am_pgroup *G = &t->model.groups[group];
    int mid = t->model.n_params / 2;
    if (mid >= G->first && mid < G->first + G->n) {
        fault_nan(t, t->step);
        if (fault_device_oom(t, t->step, err, err_len) < 0)
            return -1;
    }
    return 0;
}

/* AM_FAULT kill-in-save:PHASE (fault.h) */
void am_train_fault_in_save(void *arg, enum am_sckpt_phase phase)
{
    struct trainer *t = arg;
    if (am_fault_due(&t->fault, t->s->info.rank, t->step, AM_FAULT_KILL_IN_SAVE) && t->fault.code == (int)phase) {
        fault_record(t, t->step, NULL);
        am_fault_kill();
    }
}
