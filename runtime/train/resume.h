/* resume.h - what the trainer saves in a sharded checkpoint and restores from one
 * (ckpt/shard_ckpt.h holds the format).
 *
 * The training state of a rank is three arrays of the same layout: the master weights, and
 * AdamW's two moments, in the storage dtype (model.h; written fp32 on disk, bf16 ones widened
 * exactly, and rounded to the storage dtype as they are restored). With LoRA they hold the adapters alone (the frozen base is read from
 * the model's directory at every start). Their layout is the model's slab (every parameter of the rank,
 * whole or as its tensor-parallel slice, each group padded to group_align) or, with sharded
 * data parallelism (fsdp.h), the rank's flat shards of each group's padded span. Every run of
 * elements that belongs to a parameter is described by the rectangles of the full tensor it
 * holds, so a checkpoint saved at one layout loads into any other: each rank reads the
 * rectangles it now holds from the pieces that cover them, and every element it holds must be
 * covered. Everything else is a function of the step: the data loader's position (sample
 * indices are computed from the step, the global batch and the dataset's seed), the learning
 * rate (the schedule), the random numbers (am draws them from (seed, tensor, index) at
 * initialisation only); the manifest records them, and the optimizer's step count.
 *
 * Saving is collective over the job (the groups whose product is the job: tp, pp, dp, cp): ranks
 * holding a copy of another rank's state (data-parallel replicas) do not write. Rank 0
 * commits (shard_ckpt.h) once every rank has written, and every rank returns its result.
 */
#ifndef AM_RESUME_H
#define AM_RESUME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "fsdp.h"
#include "model.h"
#include "optim.h"
#include "plan.h"
#include "recipe.h"
#include "shard_ckpt.h"

struct am_train_state {
    struct am_model *m;
    struct am_fsdp *fsdp;     /* sharded data parallelism (its shards are the layout), or NULL */
    struct am_optim *optim;
    void *master;             /* device: the masters of the layout (fsdp->master or m->param_mem), optim->dt */
    size_t n;                 /* elements of each array */
    size_t base;              /* unsharded: the slab element the arrays start at (0; with LoRA the
                                 adapters' group, m->grad_off: the adapters and their moments are
                                 the state, the frozen base comes from the model directory) */
    struct am_comm *job[4];   /* tp, pp, dp, cp (NULL at cp 1): together every rank of the job */
    int rank, world;
    bool writes;              /* this rank's state is not a copy of a lower data-parallel rank's */
    bool bias_writes;         /* it writes its stage's selection biases when training updates them
                                 (model_io.h: the first data-parallel, tp and cp rank of the stage) */
    bool experts_only;        /* unsharded: it writes the experts' adapters alone (LoRA under ep: the
                                 rest is a copy of a lower data-parallel rank's) */
    const struct am_recipe *r;
    const struct am_plan *p;
    const char *tag;          /* the temporary directory's suffix (the job id) */
    am_sckpt_phase_fn hook;   /* fault injection inside the save, or NULL */
    void *hook_arg;
    /* Called on every rank once its shard is written, before the commit, to add files to the
     * temporary directory (the Hugging Face export: collective, as the caller's save is), or
     * NULL. 0, or -1 with a message. */
    int (*extra)(void *arg, const char *tmp_dir, char *err, size_t err_len);
    void *extra_arg;
};

/* v[0..n) replaced by its maximum over every rank of the job (collective over job[]). */
int am_train_job_max(const struct am_train_state *s, int32_t *v, size_t n, char *err, size_t err_len);

/* The model's hash as a checkpoint records it (FNV-1a of the config.json am writes for it). */
int am_train_model_hash(const struct am_model *m, char out[17], char *err, size_t err_len);

/* Saves the state after `step` steps as ROOT/step-N (collective over the job). *dir gets the
 * checkpoint's directory; *seconds the time the save took. */
int am_train_save(const struct am_train_state *s, long step, char *dir, size_t dir_len, double *seconds, char *err,
                  size_t err_len);

/* Restores the state from the checkpoint directory dir (every rank reads its own part): the
 * masters, the moments and the optimizer's step; *step is the step the checkpoint was saved
 * after. Refused with a message when the checkpoint is of another model, another global batch
 * or sequence length, damaged (sizes, checksums) or does not cover a parameter of this rank.
 * The caller then refreshes what derives from the masters (the compute copy; the model's full
 * masters with ZeRO 1 and 2). */
int am_train_restore(const struct am_train_state *s, const char *dir, long *step, char *err, size_t err_len);

#endif
