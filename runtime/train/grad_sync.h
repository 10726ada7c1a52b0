/* grad_sync.h - data-parallel gradient synchronisation, one parameter group at a time.
 *
 * Each parameter group of the model (model.h) is reduced over its data-parallel group as
 * soon as the backward has made its gradients final: the model's grad_ready hook calls
 * am_gsync_group, which completes the group's tensor-parallel sums (am_model_group_finish),
 * adds its squared gradients to the model's local_sumsq scalar (so that a non-finite gradient
 * is known to come from this rank before any reduction mixes it with others'), and starts the
 * all-reduce. am_gsync_finish, after the backward, sums a tied embedding's two copies, reduces
 * the groups that hold them, and waits for every reduction: what it waits is the step's
 * "waiting for gradient communication after the backward" (wait_s).
 *
 * Gradients are fp32; with mp_policy.reduce_dtype bfloat16 each group is rounded to bf16,
 * all-reduced in bf16 (as FSDP2 reduces in its reduce_dtype) and widened back after the wait.
 *
 * Overlapped (the default) the reductions are started in the backward and progress while it
 * goes on; blocking (AM_GRAD_OVERLAP=0), every group is reduced in am_gsync_finish, in the
 * same order with the same calls, so that both give bit-identical gradients. Groups are
 * reduced in the order the backward finishes them, the same on every rank of a dp group
 * (they all run the same schedule).
 */
#ifndef AM_GRAD_SYNC_H
#define AM_GRAD_SYNC_H

#include <stdbool.h>
#include <stddef.h>

#include "comm.h"
#include "model.h"

struct am_gsync {
    struct am_model *m;
    struct am_comm *dp;   /* NULL: one data-parallel rank, nothing to reduce */
    bool overlap;
    enum am_dtype reduce; /* the all-reduce's dtype (mp_policy.reduce_dtype): f32, or bf16 */
    void *lp_mem;          /* bf16: the gradients' copy that is reduced (mirrors the grad slab) */
    unsigned char *state; /* [n_groups]: how far each group got this step (grad_sync.c) */
    struct am_comm_req **reqs; /* the reductions in flight, in the order they were started */
    size_t n_reqs;
    double wait_s;        /* this step: seconds in am_gsync_finish */
};

/* overlap: start reductions in the backward. Installs am_gsync_group as m's grad_ready hook
 * (a caller with a hook of its own calls am_gsync_group from it) and sets each group's comm. */
int am_gsync_init(struct am_gsync *s, struct am_model *m, struct am_comm *dp, bool overlap, enum am_dtype reduce,
                  char *err, size_t err_len);
void am_gsync_free(struct am_gsync *s);

/* Group g's gradients are final: its tp sums, its share of local_sumsq, and (overlapped) its
 * all-reduce started. The model's grad_ready hook. */
int am_gsync_group(void *s, int group, char *err, size_t err_len);

/* After the step's backward: tied copies, the groups not yet reduced, then every wait. */
int am_gsync_finish(struct am_gsync *s, char *err, size_t err_len);

#endif
