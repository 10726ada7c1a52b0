/* model_impl.h - private to runtime/model: what the model's files share. model.h stays the
 * trainer's contract; nothing outside runtime/model includes this file.
 *
 * The files, each one concept, and whom they call (no circle):
 *   model.c   am_model_init in its steps, the forward and backward of a pipeline chunk (the
 *             embedding, the layers, the head and the loss), the whole-model step; calls
 *             layer.c, tp.c, params.c, grads.c, moe.c, ring.c, packed.c
 *   layer.c   one decoder layer: its parameters, then its pieces and the layer itself, each
 *             forward beside its backward (norms, rotary embedding, LoRA adapters, attention,
 *             MLP); calls tp.c, params.c, moe.c, ring.c, lora.c
 *   mla.c     multi-head latent attention (deepseek_v3), the attention block of its layers; calls
 *             layer.c (rope, the attention itself, norms), tp.c
 *   moe.c     the mixture-of-experts block in place of a layer's MLP (moe.h); calls params.c
 *   grads.c   a step's gradients and device scalars: zeroed at its start, completed (tied and
 *             shared-kv sums), their squared norm, the loss summed over ranks, one read;
 *             calls tp.c, params.c, moe.c
 *   tp.c      tensor and sequence parallelism where Megatron's f and g operators stand (the
 *             counterpart of torchtitan's parallelize plan, kept outside the layer's math)
 *   params.c  the parameter registry, the slabs and the groups, the weights' initial values
 * Everything here runs on the model's device (kernels and collectives; no host math on
 * tensors). A function with err returns 0, or -1 with the message; one without returns -1 for
 * out of memory only, which am_model_init reports. The hooks of model.h (group_use, grad_use,
 * grad_ready) are called from model.c only.
 */
#ifndef AM_MODEL_IMPL_H
#define AM_MODEL_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"

/* ---- shapes (inline) ----------------------------------------------------------------- */

/* A view of the first `rows` rows of a [max_rows, ...] buffer. */
static inline struct am_tensor rows_of(const struct am_tensor *t, int64_t rows)
{
    struct am_tensor v = *t;
    v.shape[0] = rows;
    return v;
}

static inline int64_t am_rows_of(const struct am_tensor *t) { return t->shape[0]; }

/* Rows of the residual stream on this rank for n tokens: all, or 1/tp with sequence parallelism. */
static inline int64_t stream_rows(const struct am_model *m, int64_t n)
{
    return m->sh.sequence_parallel ? n / m->sh.tp : n;
}

/* A base weight's gradient, or NULL when LoRA freezes the base (its weight-gradient kernel
 * skipped: the base has no gradient memory, model.h). */
static inline struct am_tensor *base_grad(const struct am_model *m, const struct am_param *p)
{
    return m->sh.lora_r > 0 ? NULL : (struct am_tensor *)&p->g;
}

/* The rotary tables' scaling (kernels.h) of the model's rope_scaling (model_config.h). */
static inline struct am_rope_scaling am_model_rope_scaling(const struct am_model_config *cfg)
{
    return (struct am_rope_scaling){.type = cfg->rope_scaling.type,
                                    .factor = cfg->rope_scaling.factor,
                                    .low_freq_factor = cfg->rope_scaling.low_freq_factor,
                                    .high_freq_factor = cfg->rope_scaling.high_freq_factor,
                                    .original_max_position_embeddings = cfg->rope_scaling.original_max_position_embeddings,
                                    .beta_fast = cfg->rope_scaling.beta_fast,
                                    .beta_slow = cfg->rope_scaling.beta_slow,
                                    .attention_factor = cfg->rope_scaling.attention_factor,
                                    .mscale = cfg->rope_scaling.mscale,
                                    .mscale_all_dim = cfg->rope_scaling.mscale_all_dim,
                                    .no_truncate = cfg->rope_scaling.no_truncate};
}

/* ---- params.c: the registry, the slabs and the groups -------------------------------- */

/* Registers a parameter of local shape rows x cols (cols 0: a vector) in the current group. */
struct am_param *am_model_add_param(struct am_model *m, const char *name, int64_t rows, int64_t cols,
                                    enum am_split split, int64_t full_rows, int64_t full_cols, int64_t row0,
                                    int64_t col0);
/* Starts parameter group `kind` with the next parameter registered. */
void am_model_begin_group(struct am_model *m, enum am_pgroup_kind kind, int layer, const char *name);
/* A tied embedding split over the first and the last pipeline stage: each holds a copy. */
bool am_model_tied_across_stages(const struct am_model *m);
/* After every parameter is registered: the slabs (values, gradients, the compute copy),
 * each parameter's place in them, each group's span. -1: out of memory (the caller frees). */
int am_model_place_params(struct am_model *m);

/* ---- grads.c: the device scalars ----------------------------------------------------- */

/* Allocates the device scalars (model.h, scalars) in one block. -1: out of memory. */
int am_model_alloc_scalars(struct am_model *m);

/* ---- tp.c: tensor and sequence parallelism ------------------------------------------- */

/* t reduced in place over the tp group (none: t as it is); am_tp_sum with AM_SUM. */
int am_tp_reduce(struct am_model *m, struct am_tensor *t, enum am_comm_op op, char *err, size_t err_len);
int am_tp_sum(struct am_model *m, struct am_tensor *t, char *err, size_t err_len);
/* The input of a column-parallel product (f): the normalised rows themselves, or all of them
 * gathered from the tp group (sequence parallelism). Its backward: the input's gradient dh
 * (full rows, partial over tp) summed over tp in place, or reduce-scattered to this rank's
 * `rows` rows; *d is the result. */
int am_tp_column_input(struct am_model *m, struct am_tensor *h, int64_t N, struct am_tensor *in, char *err,
                       size_t err_len);
int am_tp_column_input_grad(struct am_model *m, struct am_tensor *dh, int64_t rows, struct am_tensor *d, char *err,
                            size_t err_len);
/* The output of a row-parallel product (g: full rows, partial sums over tp) added to the
 * residual x: all-reduced, or reduce-scattered to this rank's rows. Its backward: the output's
 * gradient in *dy, dx itself or all of its rows gathered. */
int am_tp_add_row_parallel(struct am_model *m, struct am_tensor *x, struct am_tensor *out, char *err,
                           size_t err_len);
int am_tp_row_parallel_grad(struct am_model *m, struct am_tensor *dx, int64_t N, struct am_tensor *dy, char *err,
                            size_t err_len);
/* The output of a row-parallel product reduced into `saved` (this rank's rows of the stream)
 * without adding it: all-reduced and copied, or reduce-scattered (Gemma's post norms). */
int am_tp_reduce_rows(struct am_model *m, struct am_tensor *out, struct am_tensor *saved, char *err,
                      size_t err_len);
/* Sequence parallelism alone: rank r of the tp group holds token rows [r N/tp, (r+1) N/tp). */
int am_sp_gather(struct am_model *m, const struct am_tensor *rows, struct am_tensor *full, char *err,
                 size_t err_len);

/* ---- layer.c: one decoder layer ------------------------------------------------------ */

/* Registers global layer l's parameters (local index `local`) into the current group, the
 * router and experts of a MoE layer too (moe.h); its LoRA adapters into the adapters' group. */
void am_layer_params(struct am_model *m, int l, int local);
void am_layer_lora_params(struct am_model *m, struct am_layer *L);
/* Projection t's adapter beside its base layer, when layer L has one (lora.h): y += its output
 * for input x (y: the base's output, before a row-parallel reduction); its backward adds the
 * input's gradient to dx and accumulates A's and B's. */
void am_layer_lora_forward(struct am_model *m, const struct am_layer *L, struct am_layer_acts *a, int t,
                           struct am_tensor *y, const struct am_tensor *x);
void am_layer_lora_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a, int t,
                            struct am_tensor *dx, const struct am_tensor *dy, const struct am_tensor *x);
/* The layer on the residual stream x (R rows), saving what backward needs in a; its
 * backward: dx holds the gradient of the layer's output and becomes that of its input. */
int am_layer_forward(struct am_model *m, const struct am_layer *L, struct am_layer_acts *a, struct am_tensor *x,
                     int64_t B, char *err, size_t err_len);
int am_layer_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a,
                      struct am_tensor *dx, int64_t B, char *err, size_t err_len);
/* RMSNorm as the model's family has it (the final norm's too): w (Llama), or 1 + w (Gemma).
 * Its backward takes the gradient of a column-parallel input (am_tp_column_input_grad) through
 * the norm into dx. */
void am_norm_forward(struct am_model *m, struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                     const struct am_param *norm);
int am_norm_backward(struct am_model *m, struct am_tensor *dx, struct am_param *norm, struct am_tensor *dh,
                     const struct am_tensor *x, const struct am_tensor *rstd, char *err, size_t err_len);
/* The norm's backward alone: dx += the gradient of its input x from dout's (its weight's gradient
 * accumulates). */
void am_norm_backward_local(struct am_model *m, struct am_tensor *dx, const struct am_param *norm,
                            const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *rstd);
/* Rotary embedding of q4 and k4 [B, T, heads, D] with the layer's tables (backward: of their
 * gradients). */
void am_layer_rope(struct am_model *m, const struct am_layer *L, struct am_tensor *q4, struct am_tensor *k4,
                   bool backward);
/* The attention of q4, k4, v4 (rope applied) into att4 and lse [B, heads, T] as the layer and
 * the model have it (cp ring, packed documents, window, scale, cap); its backward adds to dq4,
 * dk4 and dv4. */
int am_attend_forward(struct am_model *m, const struct am_layer *L, struct am_tensor *att4, struct am_tensor *lse,
                      struct am_tensor *q4, struct am_tensor *k4, struct am_tensor *v4, char *err, size_t err_len);
int am_attend_backward(struct am_model *m, const struct am_layer *L, struct am_tensor *dq4, struct am_tensor *dk4,
                       struct am_tensor *dv4, struct am_tensor *datt4, struct am_tensor *att4, struct am_tensor *lse,
                       struct am_tensor *q4, struct am_tensor *k4, struct am_tensor *v4, char *err, size_t err_len);

/* ---- mla.c: multi-head latent attention ---------------------------------------------- */

/* Elements of the model's scratch_mla (one micro-batch of max_tokens tokens). */
int64_t am_mla_scratch_elems(const struct am_model *m);
/* The attention block of a deepseek_v3 layer, from `in` (the normalised stream as the
 * column-parallel projections take it, all N rows) to o [N, C] (o_proj's output, partial over
 * tp), saving what backward needs in a. Its backward: from dy (o's gradient) into dh [N, C]
 * (zeroed here; the input's gradient, partial over tp). */
int am_mla_forward(struct am_model *m, const struct am_layer *L, struct am_layer_acts *a, const struct am_tensor *in,
                   struct am_tensor *o, int64_t B, char *err, size_t err_len);
int am_mla_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a,
                    const struct am_tensor *in, const struct am_tensor *dy, struct am_tensor *dh, int64_t B, char *err,
                    size_t err_len);

#endif
