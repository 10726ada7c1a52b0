/* train.h - the training loop of one rank.
 *
 * After am_rank_setup (rank/rank_setup.h) has bootstrapped the rank, read the recipe
 * and placed the rank in the mesh, am_train builds the communicators (all groups at once,
 * in one order), the model shard, the data and its data parallelism (dp.h: the optimizer's
 * state replicated or sharded), and runs
 * step_scheduler.max_steps optimizer steps:
 *   for each of grad_accum micro-steps: local_batch samples through the pipeline schedule
 *   (pipeline.h; micro-batches of pp_microbatch_size, or one without pipelining), forward +
 *   backward (gradients accumulate, scaled so that their sum is the gradient of the global
 *   batch's mean token loss); tensor-parallel and tied-embedding gradient sums;
 *   data-parallel reduction of the gradients (grad_sync.h); global norm and clipping;
 *   AdamW with the scheduled learning rate; a step record in the rank's log; rank 0 prints
 *   one line per step; checkpoints every ckpt_every_steps when checkpoint.enabled.
 * Data: step s reads global samples [s * global_batch, (s + 1) * global_batch); data-parallel
 * rank r takes every dp-th from r (dataset.h, am_gpt_global_index), so any number of
 * data-parallel ranks computes the same gradient.
 */
#ifndef AM_TRAIN_H
#define AM_TRAIN_H

#include "errors.h"
#include "log.h"
#include "rank_setup.h"

/* The rank program's first step, before anything that can fail (even the bootstrap): opens
 * the rank's log from what am-launch exported (AM_LOG_DIR, AM_JOB_ID, AM_RANK; *rank gets
 * AM_RANK, -1 when unset), writes a first start record
 *   {"type":"start","host":H,"pid":P,"rank":R,"job":J,"version":V,"time":T,"world":W,
 *    "local_rank":L,"recipe":AM_RECIPE}
 * (host: SLURMD_NODENAME under srun, else the host name, as am-launch names it) and installs
 * the crash handler (crash.h) without a flight recorder yet. am_train adds a second start
 * record once the rank is placed (coordinates, device, ...; am-diag merges the two).
 * Returns 0, or -1 with a message: then the rank has no log and prints its errors only. */
int am_train_log_begin(struct am_log *log, int *rank, char *err, size_t err_len);
/* A failure that ends the rank before training (stage "setup": am_rank_setup's bootstrap,
 * recipe, topology, placement or plan), printed on stderr by the rank: its cause record,
 *   {"type":"cause","cause":"error","stage":"setup","message":FIRST,"rank":R,"time":T
 *    [,"messages":[EVERY MESSAGE]]}
 * (the first report wins, crash.h). Nothing when err is empty or there is no log. */
void am_train_log_failure(struct am_log *log, int rank, const char *stage, const struct am_errors *err);
/* The crash handler off, the log closed. */
void am_train_log_end(struct am_log *log);

/* Writes to log (opened by am_train_log_begin; every error of its own setup, from the
 * device to the dataset, and of training becomes the rank's cause record). Returns 0 when
 * every step ran, AM_TRAIN_REQUEUE when the ranks saved and stopped on Slurm's warning
 * (preempt.h), -1 with the reason in err, each message also printed on stderr
 * ("am-train: rank R: error: MESSAGE") before the cause record is written. */
#define AM_TRAIN_REQUEUE 1
int am_train(struct am_rank_setup *s, struct am_log *log, struct am_errors *err);

#endif
