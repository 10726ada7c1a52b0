/* groups.h - the communicators of a training rank: every group of the layout, built at once.
 *
 * All ranks of the job create the same groups in the same order (comm.h): the data-parallel
 * groups, the tensor-parallel groups, and the pipeline groups twice, the first set carrying
 * activations forward ("pp") and the second gradients back ("pp_grad"), so that each carries
 * one kind of message in one order at both ends (pipeline.h). A rank's own group of each
 * kind is dp, tp, pp and pp_grad (groups of one rank where that dimension is 1). With
 * dp_replicate above 1 and dp_shard x cp above 1 (HSDP) the dp_shard groups (dp_shard x cp within
 * a replica group: AutoModel's dp_shard_cp) and dp_replicate groups are built too (after the
 * others); otherwise dp_shard is dp x cp and dp_replicate NULL. With expert parallelism
 * (ep > 1) come last the ep groups (the ranks that split the experts between them) and the
 * expert-data-parallel groups (the ranks holding the same experts: dp x cp / ep, across the
 * replica groups with HSDP, as AutoModel's ep_shard), ep and edp;
 * both NULL at ep 1. With cp > 1 the cp
 * groups (the ring of context parallelism) and the dp x cp groups (over which the loss is summed
 * and the replicated weights' gradients reduced, and fsdp2 shards: AutoModel's dp_shard_cp)
 * follow; at cp 1 dp_cp is dp and cp NULL.
 */
#ifndef AM_GROUPS_H
#define AM_GROUPS_H

#include "comm.h"
#include "errors.h"
#include "placement.h"
#include "rank_setup.h"

struct am_groups {
    struct am_comm_ctx *ctx;
    struct am_group_set set;  /* every group of the job, in creation order */
    struct am_comm **comms;   /* comms[g]: this rank's handle of group g, or NULL */
    const char **names;       /* names[g]: "dp", "tp", "pp", "pp_grad", "dp_shard", "dp_replicate", "ep", "ep_shard", "cp",
                               * "dp_cp" */
    struct am_comm *dp, *tp, *pp, *pp_grad;
    struct am_comm *dp_shard, *dp_replicate; /* fully sharded data parallelism's groups (above) */
    struct am_comm *ep, *edp;                /* expert parallelism's groups (above) */
    struct am_comm *cp, *dp_cp;              /* context parallelism's ring, and dp x cp (above) */
};

/* Creates the context (backend UCX or NCCL on CUDA device `device`, the setup's timeout; flight
 * and hosts as in comm.h, either may be NULL) and every group. Collective over the job. Returns 0, or -1 with a message; free with
 * am_groups_free in either case. */
int am_groups_build(struct am_groups *g, const struct am_rank_setup *s, enum am_comm_backend backend, int device,
                    struct am_flight *flight, const char *const *hosts, struct am_errors *err);
void am_groups_free(struct am_groups *g);

/* The maximum over every rank of the job of `count` elements of dtype t: an all-reduce (max)
 * over each of job[0..4) in turn, the rank's tp, pp, dp and cp groups (together every rank of
 * the job; NULL groups and groups of one rank skipped). Collective over the job, for the
 * trainer's agreements and its step's maxima. a holds the rank's values and b is a buffer as
 * large (device memory with NCCL): each all-reduce reads one and writes the other, and *out gets
 * the one holding the result (a when no group has two ranks). 0, or -1 with the message of the
 * all-reduce that failed. */
int am_groups_job_max(struct am_comm *const job[4], void *a, void *b, size_t count, enum am_dtype t, void **out,
                      char *err, size_t err_len);

#endif
