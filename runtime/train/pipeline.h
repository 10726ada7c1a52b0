/* pipeline.h - the executor of a pipeline schedule (pp_schedule.h) on one rank.
 *
 * The executor moves hidden states between neighbours over two groups of the pp ranks: one
 * for activations (forward), one for gradients (backward), so that each group carries one
 * kind of message in one order on both ends. Receives block; sends do not (am_isend), so no
 * two ranks can wait on each other: every schedule here is a valid order of the dependency
 * graph on every rank (tests/recipe/test_pp_schedule.c simulates them all). Sends go out of a
 * ring of as many buffers as the rank holds micro-batches, each reused once the send from it
 * is done; with interleaving, every micro-batch and chunk has its own buffer until the end of
 * the step.
 */
#ifndef AM_PIPELINE_H
#define AM_PIPELINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "model.h"
#include "plan.h"
#include "pp_schedule.h"

struct am_pipe {
    int pp, rank, v, n_micro, n_stages;
    struct am_pipe_action *actions;
    int n_actions;
    int slots[AM_MAX_CHUNKS];        /* per chunk: am_pipe_slots */
    int last_bwd[AM_MAX_CHUNKS];     /* per chunk: the index of its last backward action */
    size_t hidden;                   /* elements of one message: a hidden state (am_model_hidden_elems)
                                        and its trailer (am_model_pipe_trailer_bytes), in elem units */
    size_t elem;                     /* bytes of one element (the model's compute dtype) */
    enum am_dtype dtype;             /* the model's compute dtype, which elem is the size of */
    char *recv_buf;                  /* one hidden state, consumed by the model at once */
    int n_bufs;                      /* hidden states sent each way: slots (one chunk), or
                                        v * n_micro (interleaved), see buf_of in pipeline.c */
    char *out_bufs, *grad_bufs;     /* [n_bufs] hidden states sent forward / backward */
    struct am_comm *fwd, *bwd;       /* the pp group twice: activations, gradients (NULL: pp 1) */
    const struct am_dev *dev;        /* where the buffers live */
};

/* Builds this rank's schedule from the plan (its schedule, pp, virtual stages and
 * micro-batches; the rank's pp coordinate), and the part of the model the rank holds: its tp
 * slice of the stages on its pp rank, in model order, with the recipe's sequence parallelism
 * and activation checkpointing, and the activation slots the schedule needs per chunk.
 * Returns 0, or -1 with a message. */
int am_pipe_init(struct am_pipe *P, const struct am_plan *p, const struct am_recipe *r, const struct am_coords *c,
                 struct am_model_shard *sh, char *err, size_t err_len);
/* Allocates the hidden-state buffers for m (built with P's slots) and micro-batches of
 * `batch` sequences; fwd/bwd may be NULL when pp = 1. */
int am_pipe_bind(struct am_pipe *P, const struct am_model *m, int64_t batch, struct am_comm *fwd,
                 struct am_comm *bwd, char *err, size_t err_len);
void am_pipe_free(struct am_pipe *P);

/* Bytes of the hidden-state buffers (for the memory report). */
size_t am_pipe_bytes(const struct am_pipe *P);

/* Runs one schedule: forward and backward of every micro-batch i, whose tokens and targets
 * are tokens + i * batch * seq_len (host int32), and with packed sequences its document starts
 * starts + i * batch * seq_len (NULL without: model.h, am_model_forward). Gradients accumulate in m, token losses in
 * its loss scalar (last stage). last_run: the last run of the step (gradient accumulation),
 * whose last backward of each chunk sets m->grads_final (model.h, grad_ready). */
int am_pipe_run(struct am_pipe *P, struct am_model *m, const int32_t *tokens, const int32_t *targets,
                const int32_t *starts, int64_t batch, float dloss_scale, bool last_run, char *err, size_t err_len);

#endif
