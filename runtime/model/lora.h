/* lora.h - a LoRA adapter beside a linear layer (the peft library's and AutoModel's LoRA).
 *
 * A linear layer y = x · Wᵀ (W [out, in]) with an adapter computes
 *     t = x · Aᵀ                  A [r, in]   (lora_A)
 *     y = x · Wᵀ + s · (t · Bᵀ)   B [out, r]  (lora_B),  s = alpha / r
 * with W frozen: only A and B are trained. B starts at zero, so the adapted model starts as
 * the base model; A starts random (xavier normal or kaiming uniform, recipe.h).
 *
 * Backward, from dy [N, out]: du = s · dy, dB += duᵀ · t, dt = du · B, dA += dtᵀ · x,
 * dx += dt · A. The base layer's own backward adds dy · W to dx and computes no gradient for W.
 *
 * Tensor parallelism follows the base layer so that the adapter adds no collective:
 *   - column-parallel base (q, k, v, gate, up; W split by output rows): B split by rows with
 *     W, A whole on every tp rank. t is the same on every rank; each rank's y rows get its
 *     rows of B. In backward each rank's dt is the part of its rows (dt = Σ over ranks): its
 *     dA and its dx are partial sums. dx is summed over tp by the base's backward (the
 *     all-reduce before a column-parallel input); dA is summed over tp with the other partial
 *     gradients (am_param.partial_in_tp).
 *   - row-parallel base (o, down; W split by input columns): A split by columns with W, B
 *     whole. Each rank's t is a partial sum, and so is its s · t · Bᵀ, added to the base's
 *     partial y before the base's all-reduce (or reduce-scatter) sums them. In backward dy is
 *     whole on every rank: dt is too, each rank's dA columns and dx columns are its own, and
 *     its dB = duᵀ · t_rank is a partial sum (partial_in_tp).
 *
 * Dropout (AutoModel's `dropout`, `dropout_position`; training only): a mask M of 0 and
 * 1 / (1 - p) (kernels.h's dropout: a function of the seed, the layer, the projection and each
 * element's sequence, position and feature in the whole tensor, the same in every layout):
 *   - "post" (AutoModel's default): on the adapter's output, y = x · Wᵀ + M ⊙ (s · t · Bᵀ);
 *     backward from du = M ⊙ (s · dy). Beside a row-parallel base each tp rank masks its
 *     partial sum with the same mask, so the sum is masked.
 *   - "pre": on the adapter's input, t = (M ⊙ x) · Aᵀ; backward gA += dtᵀ · (M ⊙ x) and
 *     dx += M ⊙ (dt · A), M ⊙ x drawn again (it is not kept).
 *
 * In bf16 the rounding follows peft's module order: t and t · Bᵀ rounded as matmul outputs,
 * the scaling rounded, then added to y.
 */
#ifndef AM_LORA_H
#define AM_LORA_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels.h"
#include "tensor.h"

struct am_lora {
    const struct am_tensor *a, *b;   /* the values computed with: A [r, in_rank], B [out_rank, r] */
    struct am_tensor *ga, *gb;       /* their gradients (fp32), accumulated */
    float scale;                     /* alpha / r */
    const struct am_dropout *drop;   /* dropout's mask over x's columns (pre) or y's (post); NULL: none */
    bool drop_pre;
};

/* y [N, out_rank] += s · ((x · Aᵀ) · Bᵀ). t [N, r] receives x · Aᵀ (kept for the backward);
 * u [N, out_rank] is scratch, and xd [N, in_rank] with dropout "pre" (M ⊙ x; else unused).
 * x, y, t, u, xd in the compute dtype. */
void am_lora_forward(const struct am_dev *d, const struct am_kernels *K, const struct am_lora *l,
                     struct am_tensor *y, const struct am_tensor *x, struct am_tensor *t, struct am_tensor *u,
                     struct am_tensor *xd);

/* The backward above: dx [N, in_rank] += dt · A; ga += dtᵀ · x; gb += duᵀ · t. du [N, out_rank]
 * and dt [N, r] are scratch (compute dtype), and with dropout "pre" du holds M ⊙ x after its
 * use and dxa [N, in_rank] (scratch) holds dt · A before its mask (du and dxa: in_rank
 * columns at least then). dx may be NULL (only the adapter's gradients). */
void am_lora_backward(const struct am_dev *d, const struct am_kernels *K, const struct am_lora *l,
                      struct am_tensor *dx, const struct am_tensor *dy, const struct am_tensor *x,
                      const struct am_tensor *t, struct am_tensor *du, struct am_tensor *dt, struct am_tensor *dxa);

/* The shapes of A and B on tp rank `rank` of `tp` for a base layer of in x out (full sizes)
 * split as column-parallel (row_parallel false) or row-parallel: a_cols (A [r, a_cols]),
 * b_rows (B [b_rows, r]), and where this rank's slice starts in the full A (a_col0) and B
 * (b_row0). */
void am_lora_split(int64_t in, int64_t out, bool row_parallel, int tp, int rank, int64_t *a_cols, int64_t *a_col0,
                   int64_t *b_rows, int64_t *b_row0);

#endif
