/* dp.h - data parallelism behind one interface: the model's training state replicated on
 * every data-parallel rank, or sharded over them.
 *
 * am-plan's ZeRO stage (am_plan.zero_stage) chooses the implementation (dp.c):
 *   replicated (stage 0: ddp, fsdp2 over one shard, LoRA below stage 3): every rank holds the
 *     weights, the gradients and AdamW's moments whole; each group's gradients are all-reduced
 *     over its comm (grad_sync.h) and the optimizer steps the model's slabs (with LoRA the
 *     adapters' span, grad_off / grad_elems of model.h);
 *   sharded (stages 1 to 3: fsdp2, megatron_fsdp; fsdp.h): the optimizer steps this rank's
 *     flat shard of each group over the shard group (HSDP: within a replica group, the
 *     shards' gradients then all-reduced over the replicas). Stage 1 all-reduces full-size
 *     gradients and copies its shard of them; from stage 2 the groups are AM_SHARD_SHARDED,
 *     their gradients reduce-scattered into the shards from per-group buffers; stage 3 keeps
 *     the weights in shards too, each group gathered before it runs. Below stage 3 the updated
 *     master shards are all-gathered into the model's full weights after each step;
 *   LoRA's base sharded (stage 3 with LoRA: fsdp2, megatron_fsdp's zero_dp_strategy 3): the
 *     frozen base's groups held as stage 3 holds weights (flat shards over the shard group, in
 *     mixed precision in the compute dtype alone, each group gathered before it runs,
 *     prefetched, freed after use; no gradients, no reduce-scatter, no optimizer state), the
 *     adapters as the replicated table holds them (whole on every rank, their gradients
 *     all-reduced over grad_comm, AdamW's moments whole).
 * All are tables of the same operations; the trainer calls the functions below at fixed
 * points of its setup and step and never asks which one runs. Another way of holding the
 * state is another table in dp.c (and, for its gradients' reduction, a value of enum am_shard
 * that grad_sync.c dispatches on).
 */
#ifndef AM_DP_H
#define AM_DP_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "comm.h"
#include "fsdp.h"
#include "grad_sync.h"
#include "kernels.h"
#include "model.h"
#include "optim.h"
#include "recipe.h"
#include "resume.h"

struct am_dp_config {
    int zero;                  /* am_plan.zero_stage: 0 replicated, 1 to 3 sharded */
    struct am_comm *grad_comm; /* the gradients' data-parallel group (dp x cp), NULL when it is one rank */
    struct am_comm *shard;     /* sharded: the shard group (dp_shard x cp) */
    struct am_comm *replicate; /* sharded: HSDP's replicas of a shard, or NULL */
    struct am_comm *dp, *cp;   /* replicated: which rank writes a checkpoint (dp rank 0, cp rank 0; cp NULL at 1) */
    bool overlap;              /* reductions started in the backward (grad_sync.h) */
    bool reshard_after_forward;
    enum am_dtype reduce;      /* mp_policy.reduce_dtype */
    const struct am_dev *dev;
    const struct am_recipe *r; /* AdamW's settings, max_grad_norm */
    bool lora;                 /* LoRA: the model's base frozen, its adapters trained */
};

struct am_dp_ops;

struct am_dp {
    const struct am_dp_ops *ops; /* replicated or sharded (dp.c) */
    struct am_dp_config c;
    struct am_model *m;
    struct am_gsync sync;  /* the gradients' reduction (grad_sync.h) */
    struct am_fsdp fsdp;   /* sharded: the shards (fsdp.h) */
    struct am_optim optim; /* AdamW over what this rank steps */
};

/* Chooses the implementation for c->zero (nothing allocated), before the model is built: its
 * group_align is am_dp_group_align's. */
void am_dp_choose(struct am_dp *d, const struct am_dp_config *c);
int am_dp_group_align(const struct am_dp *d);
/* Once the model is built (its experts' groups' comm set: fsdp.h): the shards, AdamW's
 * moments, the gradients' reduction. Returns 0, or -1 with a message. */
int am_dp_init(struct am_dp *d, struct am_model *m, char *err, size_t err_len);
/* After the communicators are destroyed; also after a failed or no am_dp_init. */
void am_dp_free(struct am_dp *d);

/* What the model's hooks (model.h) call: before a group's weights are read (group_use),
 * before its gradients are written (grad_use), once they are final (grad_ready). The first
 * two are 0 where there is nothing to do. am_dp_grads_each_pass: grad_ready is wanted after
 * every backward of a group (sharded gradients), not only the step's last. */
int am_dp_group_use(struct am_dp *d, int group, bool backward, char *err, size_t err_len);
int am_dp_grad_use(struct am_dp *d, int group, char *err, size_t err_len);
int am_dp_grad_ready(struct am_dp *d, int group, char *err, size_t err_len);
bool am_dp_grads_each_pass(const struct am_dp *d);

/* The step: before its first forward; after its last backward (every reduction waited for,
 * the shards' gradients complete); the squared gradient norm into the model's device scalar
 * (am_model_grad_sumsq, or over the shards); the optimizer's update at lr, clipped with
 * max_grad_norm by that scalar (and the full weights refreshed below stage 3). */
void am_dp_begin_step(struct am_dp *d);
int am_dp_end_backward(struct am_dp *d, char *err, size_t err_len);
int am_dp_grad_sumsq(struct am_dp *d, char *err, size_t err_len);
int am_dp_update(struct am_dp *d, float lr, char *err, size_t err_len);

/* What the rank allocated, as am-plan counts it (the memory record): weights (masters and
 * their compute copy), gradients (fp32, or fsdp2's bf16 shards with bf16 parameters, and
 * their reduce_dtype copy), AdamW's moments, gathered groups, per-group gradient buffers
 * (with the staging buffer of bf16 shards). */
struct am_dp_bytes {
    size_t weights, grads, optimizer, gathered, grad_buffers;
};
void am_dp_bytes(const struct am_dp *d, struct am_dp_bytes *b);
/* The state is sharded (the memory record's "sharded"). */
bool am_dp_sharded(const struct am_dp *d);
/* The step record's keys of its own (sharded: "gather_wait_s"). */
void am_dp_record(const struct am_dp *d, json_t *rec);

/* Checkpoints (resume.h): the layout of the state this rank saves and restores (st's m,
 * fsdp, optim, master, n, base) and whether it writes it (a replica of a lower rank's does
 * not); after a restore, what derives from the masters (below stage 3 the full weights);
 * for the Hugging Face export the full fp32 weights in the model's parameters (stage 3: a
 * slab gathered for it, *slab, released after; else nothing, *slab NULL). */
void am_dp_state(struct am_dp *d, struct am_train_state *st);
int am_dp_restored(struct am_dp *d, char *err, size_t err_len);
int am_dp_gather_weights(struct am_dp *d, void **slab, char *err, size_t err_len);
void am_dp_release_weights(struct am_dp *d, void *slab);

#endif
