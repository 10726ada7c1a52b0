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
 * Fully sharded data parallelism (fsdp.h, am_gsync_set_shards): a sharded group's gradients
 * are reduce-scattered instead, its padded span of the gradient slab into the group's flat
 * shard of the shard slab, once per step (the full-size gradients accumulate locally over the
 * micro-batches: FSDP2's no-sync accumulation).
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
    void *shard_g;         /* sharded groups: the fp32 gradient shards (fsdp.h), or NULL */
    void *shard_lp;        /* bf16: the shards the reduce-scatter writes, widened into shard_g */
    size_t n_shard;
    struct am_comm *shard;     /* the group the shards are reduce-scattered over (dp_shard) */
    struct am_comm *replicate; /* HSDP: the replicas' group the shards are then all-reduced over, or NULL */
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
/* The gradient shards of the sharded groups: n_shard fp32 on the device (each group's at its
 * shard_offset), reduce-scattered over `shard`; with `replicate` (HSDP) the whole shard slab
 * is then all-reduced over the replicas in am_gsync_finish, after the reduce-scatters (one
 * call, not overlapped). With a bf16 reduce_dtype their bf16 copy is allocated here. */
int am_gsync_set_shards(struct am_gsync *s, void *shard_grads, size_t n_shard, struct am_comm *shard,
                        struct am_comm *replicate, char *err, size_t err_len);

/* Group g's gradients are final: its tp sums, its share of local_sumsq, and (overlapped) its
 * all-reduce started. The model's grad_ready hook. */
int am_gsync_group(void *s, int group, char *err, size_t err_len);

/* After the step's backward: tied copies, the groups not yet reduced, then every wait. */
int am_gsync_finish(struct am_gsync *s, char *err, size_t err_len);

#endif
