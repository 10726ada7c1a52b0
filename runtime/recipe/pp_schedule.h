/* pp_schedule.h - pipeline schedules: which forward and backward a pipeline rank runs when.
 *
 * A step's n_micro micro-batches flow through n_stages = pp * v stages (stage s on pp rank
 * s % pp: chunk s / pp of that rank's model, model.h). A schedule is, per rank, the ordered
 * list of its forwards and backwards, named as in AutoModel (torch.distributed.pipelining)
 * and built as Megatron-LM builds them:
 *   gpipe            every forward, then every backward (micro-batches in order);
 *   1f1b             pp - rank - 1 warm-up forwards, then one forward and one backward in
 *                    turn, then the remaining backwards: at most pp - rank micro-batches in
 *                    flight on rank `rank`;
 *   interleaved1f1b  the same with v chunks per rank (Narayanan et al. 2021): forwards go
 *                    through the chunks one round of micro-batches at a time; warm-up of
 *                    (pp - rank - 1) * 2 + (v - 1) * round forwards (all of them when
 *                    n_micro == pp). A round is pp micro-batches when n_micro is a multiple
 *                    of pp; otherwise, as torch.distributed.pipelining's
 *                    ScheduleInterleaved1F1B counts it, n_micro / max(1, n_micro / pp)
 *                    (so fewer micro-batches than ranks make one round of all of them),
 *                    which must divide n_micro.
 * Backwards of one chunk come in the order of its forwards, so the micro-batches in flight on
 * a chunk are consecutive and micro-batch i can live in the chunk's slot i % slots.
 *
 * Pure functions: the planner uses them for its memory estimate (the activation peak of each
 * rank), the executor (pipeline.h) runs them.
 */
#ifndef AM_PP_SCHEDULE_H
#define AM_PP_SCHEDULE_H

#include "recipe.h"

enum am_pipe_kind { AM_PIPE_FORWARD, AM_PIPE_BACKWARD };

struct am_pipe_action {
    enum am_pipe_kind kind;
    int chunk; /* the rank's chunk: stage chunk * pp + rank */
    int micro;
};

/* The actions of pp rank `rank` (2 * n_micro * v of them) into out. v must be 1 but for
 * interleaved1f1b, which needs am_pipe_round(pp, n_micro) > 0. Returns the count, or -1 for
 * arguments outside those rules. */
int am_pipe_schedule(enum am_pp_schedule kind, int pp, int v, int n_micro, int rank, struct am_pipe_action *out);

/* Interleaved 1F1B's micro-batches per round: n_micro / max(1, n_micro / pp) (pp when n_micro
 * is a multiple of pp), or -1 when that does not divide n_micro (pp 4 and 9 micro-batches:
 * 2 rounds of 4.5). */
int am_pipe_round(int pp, int n_micro);

/* The most micro-batches chunk `chunk` holds at once (its forward done, its backward not
 * yet): the activation slots the model needs for it. */
int am_pipe_slots(const struct am_pipe_action *a, int n, int chunk);

/* The most micro-batches held at once over all chunks of the rank (its activation peak). */
int am_pipe_peak(const struct am_pipe_action *a, int n);

#endif
