/* kernels.h - the math of a Llama-style transformer, forward beside backward, behind one
 * table of functions per device. The model never calls a backend directly: it asks
 * am_kernels_for(device) for the table and calls through it.
 *
 * Conventions (the same for every backend):
 *   - Shapes are given by the tensors; 2-d [rows, cols] row-major unless said otherwise.
 *     Activations are [N, C] with N = B * T tokens (batch-major), heads laid out as
 *     [B, T, H, D] (Hugging Face's layout before its transpose).
 *   - Backward functions ACCUMULATE (+=) into every gradient they write, activations'
 *     and parameters' alike: the caller zeroes gradient buffers once per step (llm.c's
 *     convention), which also makes residual connections and tied weights free.
 *   - Tensor parallelism is expressed by the caller (the sharded shapes and the collectives
 *     around the calls); the vocabulary-parallel pieces take the shard's first vocabulary id.
 *   - Parameters, gradients and activations are AM_T_F32 on the CPU backend; token ids
 *     and targets are AM_T_I32. A target < 0 is ignored (no loss, no gradient).
 * A tensor of the wrong device, dtype or shape is a bug in the caller: the backend names the
 * kernel, the tensor and the rule on stderr and aborts (the functions return no status).
 */
#ifndef AM_KERNELS_H
#define AM_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor.h"

struct am_rope_scaling {
    const char *type; /* NULL or "default" (none), "llama3", "linear" */
    double factor, low_freq_factor, high_freq_factor;
    long original_max_position_embeddings;
};

struct am_kernels {
    const char *name;
    enum am_device device;

    /* ---- memory ---- */
    void *(*alloc)(size_t bytes); /* zeroed; NULL when out of memory */
    void (*free)(void *p);
    void (*upload)(void *dst, const void *host_src, size_t bytes);
    void (*download)(void *host_dst, const void *src, size_t bytes);
    void (*zero)(struct am_tensor *t);
    void (*copy)(struct am_tensor *dst, const struct am_tensor *src);

    /* ---- element-wise and reductions ---- */
    void (*add)(struct am_tensor *dst, const struct am_tensor *src);      /* dst += src */
    void (*scale)(struct am_tensor *t, float s);                          /* t *= s */
    double (*sum_squares)(const struct am_tensor *t);                     /* in double */
    bool (*all_finite)(const struct am_tensor *t);

    /* ---- linear layers: y = x · wᵀ (torch.nn.Linear without bias) ----
     * x [M, K], w [N, K], y [M, N].  backward: dx += dy · w,  dw += dyᵀ · x (either NULL). */
    void (*matmul_forward)(struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w);
    void (*matmul_backward)(struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                            const struct am_tensor *x, const struct am_tensor *w);

    /* ---- embedding (vocabulary-parallel) ----
     * ids [N] int32; wte [V_shard, C] holds ids vocab_start .. vocab_start + V_shard - 1;
     * out [N, C]: the row for ids in the shard, zero for the others (the caller sums over tp). */
    void (*embedding_forward)(struct am_tensor *out, const struct am_tensor *ids, const struct am_tensor *wte,
                              int64_t vocab_start);
    void (*embedding_backward)(struct am_tensor *dwte, const struct am_tensor *dout, const struct am_tensor *ids,
                               int64_t vocab_start);

    /* ---- RMSNorm: out = x / sqrt(mean(x²) + eps) * w ----
     * x, out [N, C], w [C], rstd [N] (saved for backward, fp32). */
    void (*rmsnorm_forward)(struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                            const struct am_tensor *w, float eps);
    void (*rmsnorm_backward)(struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dout,
                             const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *rstd);

    /* ---- rotary position embedding, Hugging Face's rotate-half layout ----
     * rope_tables fills cos, sin [T, D/2] (on the backend's device) for positions 0..T-1 of a
     * head of size D, with
     * rope_theta and optional Llama 3 / linear scaling, exactly as transformers computes them.
     * x [B, T, H, D] is rotated in place; backward rotates the gradient by the opposite angle. */
    void (*rope_tables)(struct am_tensor *cos, struct am_tensor *sin, double theta,
                        const struct am_rope_scaling *scaling);
    void (*rope_forward)(struct am_tensor *x, const struct am_tensor *cos, const struct am_tensor *sin);
    void (*rope_backward)(struct am_tensor *dx, const struct am_tensor *cos, const struct am_tensor *sin);

    /* ---- causal grouped-query attention, softmax(q kᵀ / sqrt(D)) v ----
     * q, out [B, T, H, D]; k, v [B, T, KVH, D] with H a multiple of KVH (query head h reads
     * kv head h / (H / KVH)); lse [B, H, T] fp32 (log-sum-exp of each row, saved for
     * backward). Never materialises more than a few rows of scores per thread (never T x T).
     * window > 0: a sliding window (Mistral's sliding_window): the query at position t sees
     * the keys t - window < j <= t, itself and the window - 1 before it (transformers masks
     * kv_idx <= q_idx - window); window <= 0, or >= T: plain causal, j <= t. */
    void (*attention_forward)(struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *q,
                              const struct am_tensor *k, const struct am_tensor *v, int64_t window);
    void (*attention_backward)(struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                               const struct am_tensor *dout, const struct am_tensor *out,
                               const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                               const struct am_tensor *v, int64_t window);

    /* ---- SwiGLU: out = silu(gate) * up, all [N, I] ---- */
    void (*swiglu_forward)(struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up);
    void (*swiglu_backward)(struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                            const struct am_tensor *gate, const struct am_tensor *up);

    /* ---- cross-entropy fused with the output projection, vocabulary-parallel, in chunks ----
     * x [N, C] final hidden states, w [V_shard, C] the head's shard (ids vocab_start..),
     * targets [N] int32. Logits are computed chunk by chunk and never stored whole.
     *   ce_stats: for each token, over this shard: max logit m [N], sum of exp(logit - m)
     *     s [N], and the target's logit t [N] (0 when the target is not in the shard).
     *   The caller combines shards: M = max over tp of m; S = sum over tp of s * exp(m - M);
     *     T = sum over tp of t; loss_i = log S + M - T.
     *   ce_backward: with the combined M and S, dlogits = (softmax - onehot) * dloss_scale for
     *     tokens whose target >= 0; dx += dlogits · w (the caller sums dx over tp),
     *     dw += dlogitsᵀ · x. */
    void (*ce_stats)(struct am_tensor *m, struct am_tensor *s, struct am_tensor *t, const struct am_tensor *x,
                     const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start);
    void (*ce_backward)(struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x,
                        const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start,
                        const struct am_tensor *M, const struct am_tensor *S, float dloss_scale);
    /* ce_stats and ce_backward in one pass over the logits, for a head holding the whole
     * vocabulary (no tensor parallelism: M = m, S = s): each tile of logits is computed once
     * instead of twice. Writes m, s, t as ce_stats and accumulates dx, dw as ce_backward.
     * Returns false, having done nothing, when the vocabulary is too large for one tile of
     * the kernel's row chunk: then call ce_stats and ce_backward. */
    bool (*ce_fused)(struct am_tensor *m, struct am_tensor *s, struct am_tensor *t, struct am_tensor *dx,
                     struct am_tensor *dw, const struct am_tensor *x, const struct am_tensor *w,
                     const struct am_tensor *targets, float dloss_scale);

    /* ---- AdamW, PyTorch's torch.optim.AdamW semantics (decoupled weight decay, bias
     * correction with step >= 1); weight_decay 0 gives Adam. m, v are fp32 state. ---- */
    void (*adamw)(struct am_tensor *param, const struct am_tensor *grad, struct am_tensor *m, struct am_tensor *v,
                  float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step);
};

/* The table for a device, or NULL when this build has no such backend. */
const struct am_kernels *am_kernels_for(enum am_device device);

/* The CPU backend's table (kernels/cpu/). */
const struct am_kernels *am_kernels_cpu(void);

#endif
