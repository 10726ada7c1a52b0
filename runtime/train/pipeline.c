/* pipeline.c - the executor of a pipeline schedule (pipeline.h). */
#include "pipeline.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

/* The part of the model this rank holds: its tp slice of the stages on its pp rank, in model
 * order, each with the slots the schedule needs for it. */
static void shard_of(const struct am_pipe *P, const struct am_plan *p, const struct am_recipe *r,
                     const struct am_coords *c, struct am_model_shard *sh)
{
    *sh = (struct am_model_shard){.tp = p->tp, .tp_rank = c->tp, .sequence_parallel = r->dist.sequence_parallel,
                                  .recompute = r->dist.activation_checkpointing,
                                  .compute = r->compute_dtype, .storage = r->optim.master_dtype,
                                  .params = r->param_dtype};
    for (int s = 0; s < p->n_stages; s++) {
        const struct am_stage *st = &p->stages[s];
        if (st->pp_rank != c->pp)
            continue;
        sh->chunks[sh->n_chunks] = (struct am_chunk){st->first_layer, st->n_layers, P->slots[sh->n_chunks]};
        sh->n_chunks++;
        sh->first_stage |= st->embedding;
        sh->last_stage |= st->head;
    }
}

int am_pipe_init(struct am_pipe *P, const struct am_plan *p, const struct am_recipe *r, const struct am_coords *c,
                 struct am_model_shard *sh, char *err, size_t err_len)
{
    enum am_pp_schedule kind = p->pp == 1 ? AM_PP_1F1B : r->dist.pipeline.schedule;
    int v = p->virtual_stages, n_micro = (int)p->n_microbatches;
    memset(P, 0, sizeof(*P));
    P->pp = p->pp;
    P->rank = c->pp;
    P->v = v;
    P->n_micro = n_micro;
    P->n_stages = p->n_stages;
    if (v > AM_MAX_CHUNKS)
        return am_fail(err, err_len, "pipeline: %d virtual stages per rank; the model holds at most %d", v,
                       AM_MAX_CHUNKS);
    P->actions = calloc((size_t)(2 * n_micro * v), sizeof(*P->actions));
    if (!P->actions)
        return am_fail(err, err_len, "pipeline: out of memory for a schedule of %d micro-batches", n_micro);
    P->n_actions = am_pipe_schedule(kind, P->pp, v, n_micro, P->rank, P->actions);
    if (P->n_actions < 0) {
        am_pipe_free(P);
        return am_fail(err, err_len, "pipeline: no %s schedule for pp %d, %d virtual stages, %d micro-batches",
                       am_pp_schedule_name(kind), P->pp, v, n_micro);
    }
    for (int k = 0; k < v; k++)
        P->slots[k] = am_pipe_slots(P->actions, P->n_actions, k);
    for (int i = 0; i < P->n_actions; i++)
        if (P->actions[i].kind == AM_PIPE_BACKWARD)
            P->last_bwd[P->actions[i].chunk] = i;
    shard_of(P, p, r, c, sh);
    return 0;
}

int am_pipe_bind(struct am_pipe *P, const struct am_model *m, int64_t batch, struct am_comm *fwd,
                 struct am_comm *bwd, char *err, size_t err_len)
{
    P->fwd = fwd;
    P->bwd = bwd;
    P->hidden = am_model_hidden_elems(m, batch);
    P->elem = am_dtype_size(m->act_dt);
    P->dtype = m->act_dt;
    if (P->pp == 1)
        return 0;
    /* the load-balancing loss's statistics after the hidden state (model.h), f32 */
    size_t trailer = am_model_pipe_trailer_bytes(m);
    if (trailer && (P->hidden * P->elem) % sizeof(float))
        return am_fail(err, err_len, "pipeline: a hidden state of %zu bytes is not a whole number of floats, which the "
                       "load-balancing loss's statistics follow (use an even hidden_size)", P->hidden * P->elem);
    P->hidden += trailer / P->elem; /* what travels: the hidden state and its trailer */
    P->n_bufs = P->v == 1 ? P->slots[0] : P->v * P->n_micro;
    size_t n = (size_t)P->n_bufs * P->hidden;
    P->recv_buf = m->K->alloc(m->dev, P->hidden * P->elem);
    P->out_bufs = m->K->alloc(m->dev, n * P->elem);
    P->grad_bufs = m->K->alloc(m->dev, n * P->elem);
    if (!P->recv_buf || !P->out_bufs || !P->grad_bufs)
        return am_fail(err, err_len, "pipeline: out of memory for %d hidden states of %zu elements", 1 + 2 * P->n_bufs,
                       P->hidden);
    P->dev = m->dev;
    return 0;
}

void am_pipe_free(struct am_pipe *P)
{
    if (P->dev) {
        P->dev->k->free(P->dev, P->recv_buf);
        P->dev->k->free(P->dev, P->out_bufs);
        P->dev->k->free(P->dev, P->grad_bufs);
    }
    free(P->actions);
    memset(P, 0, sizeof(*P));
}

size_t am_pipe_bytes(const struct am_pipe *P)
{
    if (P->pp == 1)
        return 0;
    return (1 + 2 * (size_t)P->n_bufs) * P->hidden * P->elem;
}

/* The buffer a micro-batch's hidden state goes out of (see am_pipe). With one chunk the
 * buffers are a ring of n_bufs: before one is reused, the send from it (n_bufs sends ago on
 * that group) is waited for. No rank can wait on another that way: a stage's sends forward
 * are taken by the next stage's forwards, which need nothing from this stage but the sends
 * before them, and its sends backward by the previous stage's backwards, which need nothing
 * but earlier sends either (with interleaving the chunks wrap around: there every micro-batch
 * and chunk has its own buffer). */
static char *buf_of(const struct am_pipe *P, struct am_comm *c, char *base, int chunk, int micro, char *err,
                    size_t err_len)
{
    size_t i = P->v == 1 ? (size_t)(micro % P->n_bufs) : (size_t)chunk * (size_t)P->n_micro + (size_t)micro;
    if (P->v == 1 && micro >= P->n_bufs && am_send_wait_keep(c, (size_t)P->n_bufs - 1, err, err_len) < 0)
        return NULL;
    return base + i * P->hidden * P->elem;
}

/* The pp rank of the stage before / after stage s (stage s is on rank s % pp). */
static int prev_rank(const struct am_pipe *P, int s) { return (s - 1) % P->pp; }
static int next_rank(const struct am_pipe *P, int s) { return (s + 1) % P->pp; }

static int run_forward(struct am_pipe *P, struct am_model *m, const struct am_pipe_action *a, const int32_t *tokens,
                       const int32_t *targets, const int32_t *starts, int64_t batch, float dloss_scale, char *err,
                       size_t err_len)
{
    int s = a->chunk * P->pp + P->rank;
    size_t N = (size_t)(batch * m->seq_len);
    const void *x_in = NULL;
    void *x_out = NULL;
    if (s < P->n_stages - 1 && !(x_out = buf_of(P, P->fwd, P->out_bufs, a->chunk, a->micro, err, err_len)))
        return -1;
    if (s > 0) {
        if (am_recv(P->fwd, P->recv_buf, P->hidden, P->dtype, prev_rank(P, s), err, err_len) < 0)
            return -1;
        x_in = P->recv_buf;
    }
    const int32_t *tok = tokens + a->micro * N, *tgt = targets + a->micro * N;
    const int32_t *st = starts ? starts + a->micro * N : NULL; /* packed sequences: the documents */
    am_model_set_micro(m, a->micro, batch); /* adapter dropout's sequences (model.h) */
    if (am_model_forward(m, a->chunk, a->micro % P->slots[a->chunk], batch, tok, tgt, st, x_in, x_out, dloss_scale,
                         err, err_len) < 0)
        return -1;
    if (x_out && am_isend(P->fwd, x_out, P->hidden, P->dtype, next_rank(P, s), err, err_len) < 0)
        return -1;
    return 0;
}

static int run_backward(struct am_pipe *P, struct am_model *m, const struct am_pipe_action *a, float dloss_scale,
                        bool final, char *err, size_t err_len)
{
    int s = a->chunk * P->pp + P->rank;
    const void *dy = NULL;
    void *dx = NULL;
    if (s > 0 && !(dx = buf_of(P, P->bwd, P->grad_bufs, a->chunk, a->micro, err, err_len)))
        return -1;
    if (s < P->n_stages - 1) {
        if (am_recv(P->bwd, P->recv_buf, P->hidden, P->dtype, next_rank(P, s), err, err_len) < 0)
            return -1;
        dy = P->recv_buf;
    }
    m->grads_final = final;
    int rc = am_model_backward(m, a->chunk, a->micro % P->slots[a->chunk], dy, dx, dloss_scale, err, err_len);
    m->grads_final = false;
    if (rc < 0)
        return -1;
    if (dx && am_isend(P->bwd, dx, P->hidden, P->dtype, prev_rank(P, s), err, err_len) < 0)
        return -1;
    return 0;
}

int am_pipe_run(struct am_pipe *P, struct am_model *m, const int32_t *tokens, const int32_t *targets,
                const int32_t *starts, int64_t batch, float dloss_scale, bool last_run, char *err, size_t err_len)
{
    for (int i = 0; i < P->n_actions; i++) {
        const struct am_pipe_action *a = &P->actions[i];
        int rc = a->kind == AM_PIPE_FORWARD
                     ? run_forward(P, m, a, tokens, targets, starts, batch, dloss_scale, err, err_len)
                     : run_backward(P, m, a, dloss_scale, last_run && i == P->last_bwd[a->chunk], err, err_len);
        if (rc < 0)
            return -1;
    }
    if (P->pp > 1 && am_send_wait(P->fwd, err, err_len) < 0)
        return -1;
    if (P->pp > 1 && am_send_wait(P->bwd, err, err_len) < 0)
        return -1;
    return 0;
}
