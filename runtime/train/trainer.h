/* trainer.h - the state of one rank's training and what its files give each other; private
 * to runtime/train (am_train, train.h, is the way in).
 *
 *   train.c    am_train in order: what it checks and opens first, the setup, the model's
 *              hooks, the loop (forward and backward, the step's values, the optimizer, the
 *              records and saves), the end
 *   setup.c    the communicators, the watchdog, the model and its weights, data parallelism (dp.h)
 *   batch.c    the samples: the dataset or the packs, the loss mask, each step's micro-batches
 *   records.c  the rank log's records (start, groups, memory, step, cause), the device's fault
 *              hook, the step line and its MFU
 *   inject.c   AM_FAULT (fault.h) at its points of the step
 *   resume.c   the checkpoints: what is saved and restored (resume.h), when, with the Hugging
 *              Face export inside
 * Functions that can fail return 0, or -1 with the reason in the rank's error list
 * (errors.h), or in err where they take a message buffer (a hook's, the device peak's).
 */
#ifndef AM_TRAINER_H
#define AM_TRAINER_H

#include <stdbool.h>
#include <stdint.h>

#include "dataset.h"
#include "dp.h"
#include "errors.h"
#include "fault.h"
#include "flight.h"
#include "groups.h"
#include "kernels.h"
#include "log.h"
#include "model.h"
#include "pack.h"
#include "pipeline.h"
#include "rank_setup.h"
#include "tfevents.h"
#include "watchdog.h"

struct trainer {
    struct am_rank_setup *s;
    const struct am_recipe *r;
    const struct am_plan *p;
    struct am_dev dev;                  /* the rank's device: its kernels run there */
    const struct am_kernels *K;         /* dev.k */
    struct am_groups g;
    int dp_rank;
    struct am_model model;
    struct am_pipe pipe;
    struct am_dp dp;                    /* data parallelism: the optimizer's state, the gradients' reduction */
    struct am_gpt *data;
    struct am_gpt *mask;                /* the loss mask beside the data (PREFIX.mask, docs/data.md), or NULL */
    char **mask_paths;
    int32_t *mask_sample;
    struct am_log *log;                 /* opened by am_train_log_begin */
    struct am_tfevents tb;              /* rank 0's TensorBoard scalars (fd -1: none) */
    int32_t *sample, *tokens, *targets; /* host buffers for one pipeline run's micro-batches */
    struct am_packs *packs;             /* packed sequences (pack.h): the packs of whole documents, or NULL */
    int32_t *starts;                    /* packed: each row's document start, beside tokens and targets */
    int32_t *pack_rows;                 /* packed: one pack's tokens, targets and starts (3 x seq_length) */
    int32_t *pack_fill;                 /* packed: each sequence's rows before its pads (am_model_set_pack_fill) */
    int32_t *cp_pos;                    /* context parallelism: this rank's positions of a sequence, or NULL */
    struct am_comm *grad_dp;            /* the loss and replicated gradients are summed over it: dp x cp */
    char base_config[4096];
    /* diagnostics (docs/diagnostics.md) */
    struct am_flight flight;
    struct am_watchdog wd;
    struct am_fault fault;
    const char **hosts;                 /* host of each global rank */
    double comm_s;                      /* seconds in communication calls this step */
    double cpu_s;                       /* the process's CPU time over the step (all its threads) */
    struct {                            /* the step's maxima over the job's ranks (train.c) */
        double step_s;                  /* the largest step time */
        double work_s;                  /* the largest time outside communication calls (step_s - comm_s) */
        int work_rank;                  /* the rank that had it: the one the others waited for */
    } job_max;
    long step;                          /* the step being run (1-based) */
    long start_step;                    /* steps done before this run: checkpoint.restore_from's */
    bool comm_init_failed;              /* the communicators could not be made (NCCL: a "nccl" cause) */
    double peak_flops;                  /* the device's dense peak, FLOP/s (0: unknown: no MFU) */
    const char *peak_from;              /* where peak_flops came from, for the start record */
};

/* setup.c: the mesh's communicators (groups.h; the "groups" record), the watchdog on them;
 * the device's memory for the run reserved as the plan counts it; the model shard with its
 * weights (the recipe's checkpoint, else a random init; LoRA's adapters) and the data
 * parallelism it is built for (dp.h, chosen there); then the model's state for it. */
int am_train_build_comms(struct trainer *t, struct am_errors *err);
int am_train_start_watchdog(struct trainer *t, struct am_errors *err);
void am_train_reserve(struct trainer *t);
int am_train_build_model(struct trainer *t, struct am_errors *err);
int am_train_build_dp(struct trainer *t, struct am_errors *err);

/* batch.c: the dataset (or the packs) and the host buffers of a step's micro-batches; the
 * labels step `step` (0-based) counts over the global batch (a loss mask, packs); the
 * micro-batches of gradient-accumulation round `accum` into tokens, targets (and starts). */
int am_train_build_data(struct trainer *t, struct am_errors *err);
void am_train_free_data(struct trainer *t);
int am_train_count_labels(struct trainer *t, long step, int64_t *count, struct am_errors *err);
int am_train_read_microbatches(struct trainer *t, long step, int64_t accum, struct am_errors *err);

/* records.c: am-plan's memory estimate for this rank; the second start record (and rank 0's
 * TensorBoard file: docs/diagnostics.md), the groups, the memory allocated, each step's record
 * (step: 0-based, as the loop counts; on rank 0 also its numbers as TensorBoard scalars) and
 * line on rank 0; the device's peak for the MFU (AM_PEAK_TFLOPS, else a table of GPUs); the
 * device's fault hook (kernels.h); the rank's cause record for a failure (a communication
 * call's, else the message); a non-finite loss or norm as the cause and the error. */
double am_train_plan_bytes(const struct trainer *t);
void am_train_log_start(struct trainer *t);
void am_train_log_groups(struct trainer *t);
void am_train_log_memory(struct trainer *t);
void am_train_log_step(struct trainer *t, long step, double loss, double lr, double norm, double dt, int64_t labels);
void am_train_print_step(const struct trainer *t, long step, double loss, double lr, double norm, double dt,
                         double elapsed);
int am_train_device_peak(struct trainer *t, char *err, size_t err_len);
void am_train_device_fault(void *arg, const struct am_dev_fault *f);
void am_train_report_error(struct trainer *t, const char *message);
int am_train_nonfinite(struct trainer *t, long step, double loss, double norm, const char *origin,
                       struct am_errors *err);

/* inject.c: AM_FAULT at the start of step `step` (1-based); the collectives it arms before
 * the step's passes (a hang in dp's next all-reduce, a kill in ep's all-to-all); at a group's
 * final gradients (the middle parameter's group: a NaN, a device allocation that fails); the
 * checkpoint's phases (resume.h's hook). Each writes its "fault" record first. */
void am_train_fault_step_start(struct trainer *t, long step);
void am_train_fault_collectives(struct trainer *t, long step);
int am_train_fault_grad_ready(struct trainer *t, int group, char *err, size_t err_len);
void am_train_fault_in_save(void *arg, enum am_sckpt_phase phase);

/* resume.c: a checkpoint of the state after `step` steps (checkpoint.enabled); Slurm's warning
 * agreed at the end of a step (1: the ranks saved and stop; `saved`: the step's own save
 * did it); checkpoint.restore_from before the first step (start_step). */
int am_train_save_checkpoint(struct trainer *t, long step, struct am_errors *err);
int am_train_preempt_check(struct trainer *t, long step, bool saved, struct am_errors *err);
int am_train_restore_checkpoint(struct trainer *t, struct am_errors *err);

#endif
