/* model.h - a Llama-style decoder (llama, mistral; MoE later) on one rank's shard.
 *
 * The model is written once over the kernel table (kernels/kernels.h) and tensors that carry
 * their device and dtype. A rank holds:
 *   - the layers of its pipeline stage (first_layer .. first_layer + n_layers - 1), plus the
 *     embedding on the first stage and the final norm and output head on the last;
 *   - its tensor-parallel slice of each matrix (Megatron's split): q, k, v, gate and up by
 *     output rows (column-parallel), o and down by input columns (row-parallel), the
 *     embedding and head by vocabulary rows; norms whole. With fewer kv heads than tp ranks
 *     each rank holds the one kv head its query heads use.
 * With tp > 1 the model calls the tp communicator where Megatron's f/g operators stand
 * (an all-reduce after the row-parallel matmuls and the embedding, one in backward before
 * the column-parallel inputs); with tp = 1 it calls nothing. With sequence parallelism the
 * residual stream, the norms and their inputs are split by token rows over the tp ranks,
 * and the all-reduces become an all-gather before each column-parallel block and a
 * reduce-scatter after each row-parallel one (their conjugates in backward); the norms'
 * weight gradients are then summed over tp in am_model_finish_grads.
 *
 * Parameters and their gradients live in two slabs (one allocation each) so that data
 * parallelism reduces gradients with one collective and the optimizer walks one array.
 * Parameter i is params[i] (value, gradient, Hugging Face name, how it is split).
 */
#ifndef AM_MODEL_H
#define AM_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "kernels.h"
#include "model_config.h"
#include "tensor.h"

/* How a parameter is split over tp: its full shape is shape[0] x shape[1] where split. */
enum am_split { AM_SPLIT_NONE, AM_SPLIT_ROWS, AM_SPLIT_COLS };

struct am_param {
    struct am_tensor w, g;
    char name[96];          /* Hugging Face name */
    enum am_split split;
    int64_t full_rows, full_cols; /* the unsplit shape (cols 0 for vectors) */
    int64_t row0, col0;     /* where this rank's slice starts in the full tensor */
    int copies_in_tp;       /* tp ranks holding this same tensor: 1 when split, tp for norms,
                               tp / kv heads for a kv projection shared by several ranks */
};

struct am_model_shard {
    int tp, tp_rank;
    bool sequence_parallel; /* the residual stream split over tp by token rows (Megatron's SP) */
    int first_layer, n_layers;
    bool first_stage, last_stage;
};

/* Saved activations of one layer for one micro-batch. */
struct am_layer_acts {
    struct am_tensor x_in, h1, rstd1, q, k, v, att, lse, x_mid, h2, rstd2, gate, up, act;
};

struct am_layer {
    struct am_param *attn_norm, *wq, *wk, *wv, *wo, *mlp_norm, *w_gate, *w_up, *w_down;
};

struct am_model {
    struct am_model_config cfg;
    struct am_model_shard sh;
    const struct am_kernels *K;
    struct am_comm *tp_comm; /* NULL when tp = 1 */

    int64_t heads, kv_heads, head_dim, inter; /* this rank's shard */
    int64_t vocab_start, vocab_shard;
    int64_t kv_head0;                          /* first kv head this rank holds */

    struct am_param *params;
    int n_params;
    void *param_mem, *grad_mem;
    size_t n_elems; /* parameters on this rank (all of them, in elements) */

    struct am_param *embed, *final_norm, *head; /* head == embed when tied and on the same rank */
    struct am_layer *layers;

    /* activations for one micro-batch of up to max_tokens tokens */
    int64_t max_tokens, seq_len;
    void *act_mem;
    struct am_layer_acts *acts;
    struct am_tensor x, dx, hf, rstdf, dhf, cos, sin, ce_m, ce_s, ce_t;
    struct am_tensor tokens, targets; /* int32 on the device */
    struct am_tensor scratch_q, scratch_kv_k, scratch_kv_v, scratch_c, scratch_mlp, scratch_att;
    struct am_tensor gathered, scratch_rows; /* sequence parallelism: [N, C] all-gathered, [N/tp, C] */
};

/* Builds the shard's parameters (zeroed) and activation buffers for micro-batches of up to
 * batch x seq_len tokens. Returns 0, or -1 with a message. */
int am_model_init(struct am_model *m, const struct am_model_config *cfg, const struct am_model_shard *sh,
                  const struct am_kernels *K, struct am_comm *tp_comm, int64_t batch, int64_t seq_len, char *err,
                  size_t err_len);
void am_model_free(struct am_model *m);

/* Random initialisation as transformers does it: linear and embedding weights from
 * N(0, initializer_range), norm weights 1. Each element is a function of (seed, name,
 * index in the full tensor), so every layout of tp and pp initialises the same model. */
void am_model_init_weights(struct am_model *m, uint64_t seed);

/* One micro-batch: tokens and targets are host int32 arrays of batch x seq_len (a target
 * < 0 is ignored). Runs forward and backward, accumulating gradients scaled so that the
 * loss is the sum of token losses times dloss_scale (1 / tokens in the global batch gives
 * the global mean). Returns the sum of this micro-batch's token losses in *loss_sum.
 * (Single pipeline stage; stages exchange activations in the pipeline schedule.) */
int am_model_step(struct am_model *m, const int32_t *tokens, const int32_t *targets, int64_t batch,
                  float dloss_scale, double *loss_sum, char *err, size_t err_len);

/* Forward only: logits are not produced; returns the summed token loss. */
int am_model_loss(struct am_model *m, const int32_t *tokens, const int32_t *targets, int64_t batch,
                  double *loss_sum, char *err, size_t err_len);

void am_model_zero_grad(struct am_model *m);

/* Completes the gradients of one optimizer step, after its last micro-batch (once: it sums
 * across tp ranks what they computed separately, the kv heads they share). Collective
 * over the tp group; nothing to do without tensor parallelism. */
int am_model_finish_grads(struct am_model *m, char *err, size_t err_len);

/* The squared L2 norm of all of the model's gradients on this tensor-parallel group:
 * sharded parameters summed over tp, replicated ones (norms; kv heads shared by several
 * ranks) counted once. Collective over the tp group. -1 with a message on a comm error. */
int am_model_grad_sumsq(struct am_model *m, double *sumsq, char *err, size_t err_len);

/* The index of a parameter by Hugging Face name, or -1. */
int am_model_find(const struct am_model *m, const char *name);

#endif
