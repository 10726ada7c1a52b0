/* lora.c - a LoRA adapter's forward beside its backward (lora.h). */
#include "lora.h"

void am_lora_forward(const struct am_dev *d, const struct am_kernels *K, const struct am_lora *l,
                     struct am_tensor *y, const struct am_tensor *x, struct am_tensor *t, struct am_tensor *u)
{
    K->matmul_forward(d, t, x, l->a);
    K->matmul_forward(d, u, t, l->b);
    K->scale(d, u, l->scale);
    K->add(d, y, u);
}

void am_lora_backward(const struct am_dev *d, const struct am_kernels *K, const struct am_lora *l,
                      struct am_tensor *dx, const struct am_tensor *dy, const struct am_tensor *x,
                      const struct am_tensor *t, struct am_tensor *du, struct am_tensor *dt)
{
    K->copy(d, du, dy);
    K->scale(d, du, l->scale);
    K->zero(d, dt);
    K->matmul_backward(d, dt, l->gb, du, t, l->b); /* dt = du · B, gB += duᵀ · t */
    K->matmul_backward(d, dx, l->ga, dt, x, l->a); /* dx += dt · A, gA += dtᵀ · x */
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
