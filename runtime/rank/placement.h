/* placement.h - which rank takes which place in the device mesh, so that every
 * tensor-parallel group lies inside one NVLink domain.
 *
 * Ranks have two numberings:
 *   physical  the bootstrap's rank (Slurm's task id under srun): where the rank runs
 *             depends on Slurm's task distribution (block, cyclic, arbitrary, ...);
 *   mesh      the planner's rank (plan.h): rank = ((((pp*R + dp_replicate)*S + dp_shard)*C
 *             + cp)*T + tp, tp innermost, so tensor-parallel groups are runs of T
 *             consecutive mesh ranks.
 * The placement maps one to the other. Every rank contributes where it is (host, node,
 * local rank, GPU, NVLink domain: struct am_place_rank, gathered with am_boot_allgather)
 * and then computes the same mapping from the same data:
 *   1. sort the ranks by (node id, local rank);
 *   2. take the domains in the order their first rank appears, and in each domain its
 *      ranks in that order;
 *   3. cut each domain's list into runs of tp ranks and hand the runs out in that order:
 *      run g holds mesh ranks g*tp .. g*tp+tp-1.
 * So a TP group never leaves a domain, consecutive groups fill one domain (and node)
 * before the next (cp and data-parallel neighbours stay close), and when Slurm's order is
 * already node-major (block distribution) mesh rank = physical rank.
 * This works if and only if every domain holds a multiple of tp ranks; otherwise
 * am_place_build fails with the domains at fault and what to change. The planner's
 * NVLink rule gets the greatest common divisor of the domains' rank counts
 * (am_place_world): tp fits every domain exactly when it divides that number.
 */
#ifndef AM_PLACEMENT_H
#define AM_PLACEMENT_H

#include <stdint.h>

#include "errors.h"
#include "plan.h"
#include "topology.h"

#define AM_PLACE_HOST_MAX 128

/* What one rank contributes: fixed size, so it can be all-gathered as bytes. */
struct am_place_rank {
    char host[AM_PLACE_HOST_MAX];
    char domain[AM_DOMAIN_MAX];
    int32_t node_id, local_rank;
    int32_t gpu; /* -1: none */
};

struct am_placement {
    int size, tp;
    int *mesh_of;     /* [physical rank] -> mesh rank */
    int *physical_of; /* [mesh rank] -> physical rank */
    int n_domains;
};

/* The world for am_plan_build: size, nodes (distinct node ids), gpus_per_node (ranks per
 * node when every node has the same number, else 0), nvlink_domain (the gcd of the
 * domains' rank counts); gpu_mem is left 0. */
void am_place_world(const struct am_place_rank *ranks, int n, struct am_world *w);

/* Builds the mapping for tensor-parallel size tp. Returns 0, or -1 with the reason in err
 * (naming the domains whose rank count is not a multiple of tp, and what to change). Free
 * with am_place_free in both cases. */
int am_place_build(const struct am_place_rank *ranks, int n, int tp, struct am_placement *pl, struct am_errors *err);
void am_place_free(struct am_placement *pl);

/* Mesh coordinates of physical rank `rank`. */
void am_place_coords(const struct am_plan *p, const struct am_placement *pl, int rank, struct am_coords *c);
/* The PHYSICAL ranks of `rank`'s group of kind g, in group order (a member's index is its
 * rank in the group); returns how many (members holds p->world entries). */
int am_place_group(const struct am_plan *p, const struct am_placement *pl, enum am_group g, int rank, int *members);

/* Every group of the given kinds, ready for am_comm_create_groups (comm.h): the same list
 * in the same order on every rank. Groups of one kind follow each other, ordered by their
 * lowest mesh rank; each lists physical ranks in group order. */
struct am_group_set {
    int n;                      /* groups */
    const int *const *groups;   /* groups[i]: physical ranks */
    const int *sizes;
    const char *const *names;   /* "tp", "dp", ... (am_group_name) */
    const enum am_group *kinds;
    void *storage;              /* one allocation behind all of the above */
};
int am_place_groups(const struct am_plan *p, const struct am_placement *pl, const enum am_group *kinds, int n_kinds,
                    struct am_group_set *set, struct am_errors *err);
void am_group_set_free(struct am_group_set *set);

#endif
