/* grad_sync.h - data-parallel gradient synchronisation, one parameter group at a time.
 *
 * Each parameter group of the model (model.h) is reduced over its data-parallel group as
 * soon as the backward has made its gradients final, the way its strategy (am_pgroup.shard)
 * says: AM_SHARD_REPLICATED and AM_SHARD_EXPERT all-reduced over the group's comm (dp, or the
 * experts' expert-data-parallel group), AM_SHARD_SHARDED reduce-scattered into its shard
 * (below). The model's grad_ready hook calls am_gsync_group, which completes the group's
 * tensor-parallel sums (am_model_group_finish), adds its squared gradients to the model's
 * local_sumsq scalar (so that a non-finite gradient is known to come from this rank before
 * any reduction mixes it with others'), and starts the all-reduce. am_gsync_finish, after
 * the backward, sums a tied embedding's two copies, reduces the groups that hold them, and
 * waits for every reduction: what it waits is the step's "waiting for gradient
 * communication after the backward" (wait_s).
 *
 * Sharded gradients (ZeRO stages 2 and 3, fsdp.h; am_gsync_init with shards): the model's
 * gradient slab is freed and a group's gradients live in one of a few per-group buffers only
 * while its backward runs. Before a backward writes a group's gradients (the model's grad_use
 * hook, am_gsync_use) the group takes a free buffer (or the oldest one whose reduce-scatter is
 * in flight, waiting for it) and its parameters' g point into it, zeroed; when its backward
 * ends (grad_ready after every backward: the model's grads_each_pass) its tp sums are done
 * and the buffer is reduce-scattered, in reduce_dtype, over the group's shard communicator
 * (G->comm) into the buffer's receive shard, which is added to the group's shard of the
 * shard slab once the reduce-scatter completes (oldest first, the same order on every rank,
 * so that a group's micro-batches are summed in their order). The shards are fp32, or bf16
 * (am_gsync_shards.dtype: FSDP2 with bf16 parameters, which keeps a sharded gradient in the
 * parameter's dtype): then each reduced shard is rounded to bf16 and added to the bf16 shard (the
 * sum in fp32, rounded once), as FSDP2 casts the reduce-scatter's output to the parameter's dtype
 * and adds it to the sharded .grad; at one micro-batch a step the shard is the reduced gradient
 * rounded to bf16, which is what the optimizer rounds an fp32 one to. With gradient accumulation
 * this reduce-scatters every micro-batch (FSDP2's set_requires_gradient_sync(True), its default):
 * n_microbatches reductions per step for gradients that take 1/dp_shard of the memory; accumulating
 * full-size gradients over the micro-batches and reducing once would keep a whole replica of them,
 * which is what sharding removes. The buffers: two (a group accumulating, the previous one
 * reducing), three when the head shares the embedding on this rank (the embedding's gradients
 * accumulate from the head's backward to the embedding's), four with mixture-of-experts layers (a
 * layer and its experts, twice), one more for a tied embedding split over two pipeline stages (its
 * copy is kept for the whole step and reduced in am_gsync_finish, after the two copies are summed),
 * each of the largest group's span.
 * A group whose shard communicator is one rank (the experts' with expert parallelism where ep
 * is dp: ep_shard 1) and whose reduction is fp32 takes none: its shard is its whole span, its
 * parameters' g point into it and its gradients accumulate there over the micro-batches, as
 * a single rank's do in its slab; after the step's last backward its sum is checked and added
 * to local_sumsq (which only tells whether this rank's gradients were finite), and there is
 * no reduce-scatter and no receive shard. With bf16 shards such a group's gradients are
 * written instead into one fp32 staging buffer (with its bf16 copy) of the largest such
 * group's span, zeroed when each of its backward passes starts; each backward pass's gradients
 * there are checked, added to local_sumsq, rounded to bf16 and added to the shard when the pass
 * ends (FSDP2's one-rank reduce-scatter, cast and +=). One buffer serves them all: these groups are
 * experts, and a backward pass (am_model_backward, one at a time on a rank whatever the pipeline
 * schedule) ends a MoE layer's experts' backward before it starts the previous layer's. The buffers
 * and receive shards are sized, and the MoE layers' four counted, over the groups that take them
 * (none: none allocated); a bf16 reduce_dtype keeps every group in a buffer (its reduction rounds
 * to bf16), and so do bf16 shards a group with replicas. HSDP (G->replicate; none for the
 * experts' groups with expert parallelism, whose expert-data-parallel group spans the replicas):
 * with fp32 shards, once a group's last reduce-scatter of the step has been added to its shard
 * (one accumulating in its shard: after its last backward), the shard is all-reduced over the
 * replicas, non-blocking (it runs while the backward goes on), waited for in am_gsync_finish;
 * with bf16 shards, as FSDP2 does, each backward's reduced shard is all-reduced over the replicas
 * in reduce_dtype (in its receive shard, when its reduce-scatter is completed, blocking) and the
 * sum rounded to bf16 and added. The
 * reduce-scatters are completed, and these all-reduces started, at points of the schedule only
 * (when the next group's reduce-scatter starts, when a buffer is needed, after the backward), never
 * on a request found complete, so that every rank issues its collectives in the same order across
 * groups (comm.h).
 *
 * Gradients are fp32 (but bf16 shards); with mp_policy.reduce_dtype bfloat16 each group is
 * rounded to bf16, all-reduced (reduce-scattered) in bf16, as FSDP2 reduces in its
 * reduce_dtype, and widened back after the wait (added to the shard).
 *
 * Overlapped (the default) the reductions are started in the backward and progress while it
 * goes on; blocking (AM_GRAD_OVERLAP=0), every group is reduced in am_gsync_finish (sharded:
 * each reduce-scatter, and the replicas' all-reduce, done where the overlapped one starts),
 * in the same order with the same calls, so that both give bit-identical gradients. Groups are
 * reduced in the order the backward finishes them, the same on every rank of a dp group
 * (they all run the same schedule).
 */
#ifndef AM_GRAD_SYNC_H
#define AM_GRAD_SYNC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "model.h"

/* Sharded gradients: the shard slab (each group's shard at its shard_offset, over G->comm,
 * which the caller set), its dtype (AM_F32 or AM_BF16) and the replicas' group (HSDP), or
 * NULL. */
struct am_gsync_shards {
    void *grads;
    size_t n_shard;
    enum am_dtype dtype;
    struct am_comm *replicate;
};

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
    /* sharded gradients (above) */
    void *shard_g;        /* the gradient shards (shard_dt), or NULL */
    size_t n_shard;
    enum am_dtype shard_dt;
    void *shard_lp;       /* HSDP with a bf16 reduce_dtype and fp32 shards: the shards' copy all-reduced */
    int n_bufs;
    size_t buf_elems, recv_elems; /* the largest span and shard of the groups that take a buffer */
    void *buf_mem;        /* n_bufs x buf_elems fp32 gradients */
    void *buf_lp;         /* bf16 reduce_dtype: their copy that is reduce-scattered, or NULL */
    void *recv_mem;       /* n_bufs x recv_elems in reduce_dtype: what the reduce-scatters write */
    bool *direct;         /* [n_groups]: accumulates in its shard (its shard group is one rank, fp32) */
    void *stage;          /* bf16 shards: the direct groups' fp32 gradients, stage_elems, then their bf16 copy */
    size_t stage_elems;
    bool *open;           /* [n_groups]: such a group's backward started, its g on its shard */
    int *buf_group;       /* [n_bufs]: the group accumulating there, or -1 */
    int *buf_sent;        /* [n_bufs]: the group whose reduce-scatter it is in, or -1 */
    bool *buf_final;      /* [n_bufs]: that was the group's last this step */
    long *buf_seq;        /* [n_bufs]: when it was started (oldest completed first) */
    long seq;
    struct am_comm_req **buf_req;
    void *finite;         /* [n_params] i32 on the device: 0 once a parameter's gradient was not finite */
    int32_t *ones;        /* [n_params] on the host */
};

/* overlap: start reductions in the backward. Sets each group's comm that is not
 * AM_SHARD_SHARDED to dp unless the caller set it (the experts' expert-data-parallel group
 * with expert parallelism; a replicated group whose comm has one rank is not all-reduced).
 * shards (NULL: no group AM_SHARD_SHARDED): sharded gradients (above): the model's gradient
 * slab is freed, and its hooks must call am_gsync_use (grad_use) and am_gsync_group after
 * every backward (grads_each_pass). */
int am_gsync_init(struct am_gsync *s, struct am_model *m, struct am_comm *dp, bool overlap, enum am_dtype reduce,
                  const struct am_gsync_shards *shards, char *err, size_t err_len);
void am_gsync_free(struct am_gsync *s);

/* The bytes it allocated beside the model's slab and the shard slab: the gradients' copies
 * in reduce_dtype (full-size; HSDP's of the shards), and apart (buffer_bytes) the per-group
 * buffers of sharded gradients with their reduce_dtype copies and receive shards, and the
 * staging buffer of bf16 shards. */
size_t am_gsync_bytes(const struct am_gsync *s);
size_t am_gsync_buffer_bytes(const struct am_gsync *s);

/* Before the step's first backward: the gradient shards zeroed (they accumulate). */
void am_gsync_begin_step(struct am_gsync *s);

/* For the model's grad_use hook: group's gradients in a buffer of their own (sharded). */
int am_gsync_use(struct am_gsync *s, int group, char *err, size_t err_len);

/* Group g's gradients are final (sharded: its backward ended): its tp sums, its share of
 * local_sumsq, and (overlapped) its reduction started. For the model's grad_ready hook. */
int am_gsync_group(struct am_gsync *s, int group, char *err, size_t err_len);

/* After the step's backward: tied copies, the groups not yet reduced, then every wait. */
int am_gsync_finish(struct am_gsync *s, char *err, size_t err_len);

/* Sharded gradients: the first parameter whose gradient was not finite this step (a read of
 * the device), -1 when none was; -2 when the gradients are the model's slab (read them). */
int am_gsync_first_nonfinite(struct am_gsync *s);

#endif
