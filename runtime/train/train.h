/* train.h - the training loop of one rank.
 *
 * After am_rank_setup (launcher/rank_setup.h) has bootstrapped the rank, read the recipe
 * and placed the rank in the mesh, am_train builds the communicators (all groups at once,
 * in one order), the model shard, the data and the optimizer, and runs
 * step_scheduler.max_steps optimizer steps:
 *   for each of grad_accum micro-steps: local_batch samples through the pipeline schedule
 *   (pipeline.h; micro-batches of pp_microbatch_size, or one without pipelining), forward +
 *   backward (gradients accumulate, scaled so that their sum is the gradient of the global
 *   batch's mean token loss); tensor-parallel and tied-embedding gradient sums;
 *   data-parallel all-reduce of the gradients; global norm and clipping;
 *   AdamW with the scheduled learning rate; a step record in the rank's log; rank 0 prints
 *   one line per step; checkpoints every ckpt_every_steps when checkpoint.enabled.
 * Data: step s reads global samples [s * global_batch, (s + 1) * global_batch); data-parallel
 * rank r takes every dp-th from r (dataset.h, am_gpt_global_index), so any number of
 * data-parallel ranks computes the same gradient.
 */
#ifndef AM_TRAIN_H
#define AM_TRAIN_H

#include "errors.h"
#include "rank_setup.h"

/* Returns 0 when every step ran, -1 with the reason in err. */
int am_train(struct am_rank_setup *s, struct am_errors *err);

#endif
