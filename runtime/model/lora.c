/* lora.c - a LoRA adapter's forward beside its backward (lora.h). */
#include "lora.h"

/* t [N, cols] with `cols` columns (a view of scratch wider than it) */
static struct am_tensor cols_view(const struct am_tensor *t, int64_t N, int64_t cols)
{
    return am_tensor_view(t->data, t->device, t->dtype, N, cols, 0, 0);
}

void am_lora_forward(const struct am_dev *d, const struct am_kernels *K, const struct am_lora *l,
                     struct am_tensor *y, const struct am_tensor *x, struct am_tensor *t, struct am_tensor *u,
                     struct am_tensor *xd)
{
    struct am_tensor xm;
    if (l->drop && l->drop_pre) { /* t = (M ⊙ x) · Aᵀ */
        xm = cols_view(xd, x->shape[0], x->shape[1]);
        K->copy(d, &xm, x);
        K->dropout(d, &xm, l->drop);
        x = &xm;
    }
    K->matmul_forward(d, t, x, l->a);
    K->matmul_forward(d, u, t, l->b);
    K->scale(d, u, l->scale);
    if (l->drop && !l->drop_pre) /* y += M ⊙ (s · t · Bᵀ) */
        K->dropout(d, u, l->drop);
    K->add(d, y, u);
}

void am_lora_backward(const struct am_dev *d, const struct am_kernels *K, const struct am_lora *l,
                      struct am_tensor *dx, const struct am_tensor *dy, const struct am_tensor *x,
                      const struct am_tensor *t, struct am_tensor *du, struct am_tensor *dt, struct am_tensor *dxa)
{
    K->copy(d, du, dy);
    K->scale(d, du, l->scale);
    if (l->drop && !l->drop_pre)
        K->dropout(d, du, l->drop);
    K->zero(d, dt);
    K->matmul_backward(d, dt, l->gb, du, t, l->b); /* dt = du · B, gB += duᵀ · t */
    if (!(l->drop && l->drop_pre)) {
        K->matmul_backward(d, dx, l->ga, dt, x, l->a); /* dx += dt · A, gA += dtᵀ · x */
        return;
    }
    int64_t N = x->shape[0], in = x->shape[1];
    struct am_tensor xm = cols_view(du, N, in), dxm = cols_view(dxa, N, in); /* du is spent */
    K->copy(d, &xm, x);
    K->dropout(d, &xm, l->drop);
    if (dx)
        K->zero(d, &dxm);
    K->matmul_backward(d, dx ? &dxm : NULL, l->ga, dt, &xm, l->a); /* dxa = dt · A, gA += dtᵀ · (M ⊙ x) */
    if (!dx)
        return;
    K->dropout(d, &dxm, l->drop);
    K->add(d, dx, &dxm);
}

void am_lora_split(int64_t in, int64_t out, bool row_parallel, int tp, int rank, int64_t *a_cols, int64_t *a_col0,
                   int64_t *b_rows, int64_t *b_row0)
{
    if (tp < 1)
        tp = 1;
    *a_cols = row_parallel ? in / tp : in;
    *a_col0 = row_parallel ? rank * (in / tp) : 0;
    *b_rows = row_parallel ? out : out / tp;
    *b_row0 = row_parallel ? 0 : rank * (out / tp);
}
