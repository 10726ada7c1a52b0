/* fsdp.h - fully sharded data parallelism (FSDP2's flat shards, ZeRO-3) over the shard group.
 *
 * Each parameter group of the model (model.h: the embedding, each decoder layer, the final norm
 * with the head) is one flat span of the model's slabs, padded with zeros to a multiple of the
 * shard group's size D (am_model_shard.group_align). Rank r of the group keeps elements
 * [r * span / D, (r + 1) * span / D) of each group's span, for every group one after the other
 * in three slabs of its own: the master weights (in the model's storage dtype), the reduced
 * gradients (fp32; bf16 when am_fsdp_init is given bf16: FSDP2's sharded gradient in a bf16
 * parameter's dtype, grad_sync.h) and (the optimizer's, over the same slab) Adam's two moments.
 * The model's full masters and their compute copy are freed once the shards are taken from them.
 *
 * Weights: at the start of a step the master shards are cast to the compute dtype (mixed
 * precision with fp32 masters; when the masters are in the compute dtype, fp32 or bf16, the
 * masters themselves are gathered). Before a group's weights are read (the
 * model's group_use hook: its forward, its backward, the recompute of activation
 * checkpointing) the group is all-gathered in the compute dtype into one of a few gathered
 * buffers and its parameters' wc point there; the next group in the pass's direction (the
 * following one in forward, the previous decoder layer in backward) is prefetched, its
 * all-gather started, into another buffer. A mixture-of-experts layer's experts are a group of
 * their own that follows the layer's (moe.h) and comes with it, gathered and prefetched
 * together. There are two buffers (three when the head shares the embedding on this rank:
 * the head needs both groups; four with MoE layers: a layer and its experts, twice): the ones
 * in use and the ones prefetched, so that the gathered weights never exceed two layers; a group found gathered
 * (the recompute after its own backward began, the next micro-batch of 1F1B) is used as it
 * is. With reshard_after_forward false there is a buffer for every group of the rank: a group
 * gathered for its forward stays until the step ends (FSDP2's reshard_after_forward=False:
 * no gather for the backward, the whole model's weights in memory at the peak). Collectives
 * are issued in the order of the schedule, the same on every rank of the
 * shard group.
 *
 * Gradients (stages 2 and 3): the model keeps no full-size gradients; each group's live in a
 * per-group buffer while its backward runs and are reduce-scattered, in reduce_dtype, into the
 * group's shard (fp32, or rounded to bf16 and added in bf16) after every backward (with gradient
 * accumulation, every micro-batch: FSDP2's default, set_requires_gradient_sync(True)), HSDP's
 * replica all-reduce of each group's fp32 shard started as its last reduce-scatter of the step
 * completes (bf16 shards: each reduced shard all-reduced before it is added; grad_sync.h). The
 * gradient norm is the shards' sum of squares summed over the shard group, tp and pp
 * (am_model_grad_sumsq_shards); the optimizer steps the shards alone. Each group carries the
 * communicator its shard spans (G->comm, all-gathers and reduce-scatters; G->replicate for HSDP):
 * the dp_shard group, but for the experts with expert parallelism.
 *
 * Expert parallelism (ep > 1): the ranks of a shard group hold different experts, so a MoE
 * layer's experts group is sharded over the expert-data-parallel group instead (the ranks
 * that hold the same experts: dp x cp / ep of them; the trainer sets the group's comm
 * to it before am_fsdp_init), its all-gathers and its gradients' reduce-scatters go over that
 * group (one rank when ep = dp: a communicator of one, its collectives copies), and the
 * gradient norm's sum over the shard group still counts every expert once (dp_shard is the
 * ep groups x the expert-data-parallel groups: each ep rank's experts, over its own
 * expert-data-parallel ranks). With HSDP that group spans the replica groups (AutoModel's
 * ep_shard): the experts' shards are not all-reduced over the replicas (grad_sync.h), their
 * groups are padded to a multiple of both groups' sizes (am_model_shard.expert_align), and
 * the norm sums over the replicas too (am_model_grad_sumsq_shards).
 *
 * LoRA (the model's lora_r > 0: train/dp.h's LoRA table): every group but the adapters' is the
 * frozen base's. Those are sharded as above, weights only: no gradient shards (f->grads NULL),
 * nothing reduce-scattered (G->shard AM_SHARD_REPLICATED: grad_sync.c skips a frozen group);
 * in mixed precision the shards are kept in the compute dtype alone (f->master NULL: a frozen
 * master never changes, so its copy is rounded once, at init, as every step would round it).
 * The adapters' group is not sharded (no shard, no gathered buffer, never prefetched): the model
 * keeps it whole in slabs of its own (am_model_drop_weights). am_fsdp_publish, am_fsdp_take_grads
 * and am_fsdp_gather_masters are not for a LoRA model.
 *
 * A checkpoint gathers the masters of every group into a full slab (storage dtype) for the save
 * (am_fsdp_gather_masters), which the caller frees after it.
 *
 * ZeRO stages below 3 (megatron_fsdp's zero_dp_strategy) use the same shards with the
 * weights replicated: the model keeps its full weights (no gathering before use), the
 * optimizer steps the shards, and am_fsdp_publish all-gathers the updated master shards
 * into the model's full masters after each step. Stage 2 shards the gradients as above; stage
 * 1 accumulates them full-size, all-reduces them whole (as ddp) and am_fsdp_take_grads copies
 * the rank's shard of them.
 */
#ifndef AM_FSDP_H
#define AM_FSDP_H

#include <stdbool.h>
#include <stddef.h>

#include "comm.h"
#include "model.h"

struct am_fsdp {
    struct am_model *m;
    int stage;            /* ZeRO stage: 3 (fsdp2; megatron_fsdp 3), 2 or 1 (megatron_fsdp) */
    enum am_dtype grad_dt; /* the gradient shards': AM_F32, or AM_BF16 (from stage 2) */
    struct am_comm *comm; /* the shard group (the experts' with ep: their group's comm, model.h) */
    int rank, size;
    size_t n_shard;       /* this rank's elements: the sum of the groups' shards */
    void *master;         /* master shards [n_shard], storage dtype (NULL: LoRA's frozen base in mixed precision) */
    void *master_lp;      /* their copy in the compute dtype (stage 3 when it is not the storage dtype), else NULL */
    void *grads;          /* reduced gradient shards [n_shard] in grad_dt (accumulated over a step); NULL with LoRA */
    void *slot_mem;       /* n_slots gathered buffers of slot_elems in the compute dtype */
    size_t slot_elems;
    int n_slots;
    int *slot_group;                  /* [n_slots]: the group a buffer holds, or -1 */
    struct am_comm_req **slot_req;    /* its all-gather while in flight */
    long *slot_used;                  /* when it was last used (for the choice of a buffer) */
    long tick;
    double gather_wait_s;                          /* this step: seconds waiting for all-gathers */
};

/* Shards the model's groups over comm (the model was built with group_align = its size), or
 * over the communicator a group already carries (G->comm set by the caller: its span must be a
 * multiple of that group's size; the shard is that group's rank's), sets each group's strategy
 * (G->shard: AM_SHARD_SHARDED from stage 2, whose gradients grad_sync.h reduce-scatters, else
 * AM_SHARD_REPLICATED) and takes each shard of the weights init or load put in the model's
 * slabs; stage 3 then frees them, and the model's group_use hook must call am_fsdp_use.
 * grad_dt: the gradient shards' dtype (AM_BF16 from stage 2 only). Returns 0, or -1 with a
 * message. */
int am_fsdp_init(struct am_fsdp *f, struct am_model *m, struct am_comm *comm, int stage, bool reshard_after_forward,
                 enum am_dtype grad_dt, char *err, size_t err_len);
/* After the communicators are destroyed (requests still in flight go with them). */
void am_fsdp_free(struct am_fsdp *f);

/* Stages 1 and 2, after the optimizer: the master shards all-gathered into the model's masters
 * (collective over the shard group). */
int am_fsdp_publish(struct am_fsdp *f, char *err, size_t err_len);
/* Stage 1, after the all-reduce: the rank's shard of each group's gradients into f->grads. */
void am_fsdp_take_grads(struct am_fsdp *f);

/* The bytes it allocated, with the model's full weights that stages 1 and 2 keep: master
 * shards (and their compute copy), gathered buffers. */
size_t am_fsdp_weight_bytes(const struct am_fsdp *f);
size_t am_fsdp_gathered_bytes(const struct am_fsdp *f);

/* Before the step's first forward: the compute copy of the master shards; nothing gathered. */
void am_fsdp_begin_step(struct am_fsdp *f);
/* After the step's backward, before the optimizer writes the shards: waits for the
 * all-gathers still in flight (a prefetch nobody used) and forgets what is gathered. */
int am_fsdp_end_step(struct am_fsdp *f, char *err, size_t err_len);

/* Stage 3, for the model's group_use hook (model.h): group gathered, the next one prefetched. */
int am_fsdp_use(struct am_fsdp *f, int group, bool backward, char *err, size_t err_len);

/* Every group's master shards all-gathered into a new slab of the model's layout (storage dtype), the
 * parameters' w pointed into it (*slab: free it with am_fsdp_release_masters). Collective
 * over the shard group. */
int am_fsdp_gather_masters(struct am_fsdp *f, void **slab, char *err, size_t err_len);
void am_fsdp_release_masters(struct am_fsdp *f, void *slab);

#endif
