/* tp.c - tensor and sequence parallelism (model_impl.h): the collectives over the tp group
 * where Megatron's f and g operators stand, each forward beside its backward.
 *
 * A column-parallel product (q, k, v, gate, up: split by output rows) takes the whole input
 * on every tp rank: f is the identity in forward and a sum over tp in backward. A
 * row-parallel product (o, down, the embedding: split by input columns or vocabulary rows)
 * leaves partial sums: g sums them over tp in forward and is the identity in backward. With
 * sequence parallelism the residual stream is split by token rows over the tp ranks: f
 * becomes an all-gather (its backward a reduce-scatter) and g a reduce-scatter (its backward
 * an all-gather). With tp = 1 nothing here calls a communicator.
 */
#include "model_impl.h"

/* Tensor-parallel collectives are on the critical path. On a GPU they go through the
 * non-blocking calls: the collective is enqueued after the kernels that wrote its buffer (an
 * event on the compute stream), and am_comm_wait makes the compute stream wait for its end on
 * the device, so the host goes on enqueuing kernels (no host wait per collective; the trainer's
 * am_comm_stream_wait once a step catches one that never completes). The CPU's blocking calls
 * stay as they are: the same bits either way (comm.h). */
static int tp_on_device(const struct am_model *m) { return m->dev->device == AM_DEV_CUDA; }

/* ---- the collectives ----------------------------------------------------------------- */

int am_tp_reduce(struct am_model *m, struct am_tensor *t, enum am_comm_op op, char *err, size_t err_len)
{
    if (!m->tp_comm)
        return 0;
    size_t n = (size_t)am_tensor_numel(t);
    if (tp_on_device(m)) {
        struct am_comm_req *q = NULL;
        return am_iallreduce(m->tp_comm, t->data, t->data, n, t->dtype, op, &q, err, err_len) < 0
                   ? -1
                   : am_comm_wait(q, err, err_len);
    }
    return am_allreduce(m->tp_comm, t->data, t->data, n, t->dtype, op, err, err_len);
}

int am_tp_sum(struct am_model *m, struct am_tensor *t, char *err, size_t err_len)
{
    return am_tp_reduce(m, t, AM_SUM, err, err_len);
}

int am_sp_gather(struct am_model *m, const struct am_tensor *rows, struct am_tensor *full, char *err,
                 size_t err_len)
{
    size_t n = (size_t)am_tensor_numel(rows);
    if (tp_on_device(m)) {
        struct am_comm_req *q = NULL;
        return am_iallgather(m->tp_comm, rows->data, full->data, n, rows->dtype, &q, err, err_len) < 0
                   ? -1
                   : am_comm_wait(q, err, err_len);
    }
    return am_allgather(m->tp_comm, rows->data, full->data, n, rows->dtype, err, err_len);
}

static int sp_scatter(struct am_model *m, const struct am_tensor *full, struct am_tensor *rows, char *err,
                      size_t err_len)
{
    size_t n = (size_t)am_tensor_numel(rows);
    if (tp_on_device(m)) {
        struct am_comm_req *q = NULL;
        return am_ireduce_scatter(m->tp_comm, full->data, rows->data, n, rows->dtype, AM_SUM, &q, err, err_len) < 0
                   ? -1
                   : am_comm_wait(q, err, err_len);
    }
    return am_reduce_scatter(m->tp_comm, full->data, rows->data, n, rows->dtype, AM_SUM, err, err_len);
}

/* ---- column-parallel input (f) ------------------------------------------------------- */

int am_tp_column_input(struct am_model *m, struct am_tensor *h, int64_t N, struct am_tensor *in, char *err,
                       size_t err_len)
{
    if (!m->sh.sequence_parallel) {
        *in = *h;
        return 0;
    }
    *in = rows_of(&m->gathered, N);
    return am_sp_gather(m, h, in, err, err_len);
}

int am_tp_column_input_grad(struct am_model *m, struct am_tensor *dh, int64_t rows, struct am_tensor *d, char *err,
                            size_t err_len)
{
    *d = *dh;
    if (m->sh.sequence_parallel) {
        *d = rows_of(&m->scratch_rows, rows);
        return sp_scatter(m, dh, d, err, err_len);
    }
    return am_tp_sum(m, dh, err, err_len);
}

/* ---- row-parallel output (g) --------------------------------------------------------- */

int am_tp_add_row_parallel(struct am_model *m, struct am_tensor *x, struct am_tensor *out, char *err,
                           size_t err_len)
{
    if (m->sh.sequence_parallel) {
        struct am_tensor rows = rows_of(&m->scratch_rows, am_rows_of(x));
        if (sp_scatter(m, out, &rows, err, err_len) < 0)
            return -1;
        m->K->add(m->dev, x, &rows);
        return 0;
    }
    if (am_tp_sum(m, out, err, err_len) < 0)
        return -1;
    m->K->add(m->dev, x, out);
    return 0;
}

int am_tp_row_parallel_grad(struct am_model *m, struct am_tensor *dx, int64_t N, struct am_tensor *dy, char *err,
                            size_t err_len)
{
    if (!m->sh.sequence_parallel) {
        *dy = *dx;
        return 0;
    }
    *dy = rows_of(&m->dhf, N); /* free once the head's gradient has gone into dx */
    return am_sp_gather(m, dx, dy, err, err_len);
}

int am_tp_reduce_rows(struct am_model *m, struct am_tensor *out, struct am_tensor *saved, char *err,
                      size_t err_len)
{
    if (m->sh.sequence_parallel)
        return sp_scatter(m, out, saved, err, err_len);
    if (am_tp_sum(m, out, err, err_len) < 0)
        return -1;
    m->K->copy(m->dev, saved, out);
    return 0;
}
