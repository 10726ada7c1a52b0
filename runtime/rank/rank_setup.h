/* rank_setup.h - what every rank program does first, before any communicator exists.
 *
 * am_rank_setup is collective over all ranks of the job:
 *   1. bootstrap: connect to am-launch (AM_BOOTSTRAP_FD), learn rank, size, node, host;
 *   2. recipe: AM_RECIPE, with AM_TP, AM_PP, AM_EP, AM_CP as overrides of
 *      distributed.{tp,pp,ep,cp}_size when set and not empty (what the SPANK plugin
 *      exports for --am-tp ...);
 *   3. topology: this rank's GPU and NVLink domain (topology.h);
 *   4. all-gather of every rank's place and of whether steps 2-3 worked for it;
 *   5. placement (placement.h) for the recipe's tp_size, then the plan (plan.h) for the
 *      world the ranks form (size, nodes, ranks per node, NVLink domain: am_place_world).
 * Steps 5 run on identical data everywhere, so every rank reaches the same verdict; a
 * failure of one rank in steps 2-3 is known to all after step 4. Either way every rank
 * returns -1 together, and rank 0's error list is the one to print: its own messages in
 * full, then the first message of each other rank that failed differently, once per
 * distinct message ("rank 2 on n2 (and 1 other rank): ..."). Only a failure of step 1
 * leaves a rank alone (s->boot is NULL then).
 *
 * A rank program's start:
 *
 *   struct am_rank_setup s;
 *   struct am_errors err;
 *   am_errors_init(&err);
 *   int rc = am_rank_setup(&s, &err);
 *   if (rc < 0 || getenv("AM_DRY_RUN")) {
 *       if (s.info.rank == 0 || !s.boot)   print err, or am_rank_setup_print(&s, stdout)
 *       am_rank_setup_exit(&s, rc < 0);    collective: rank 0 has printed before anyone exits
 *   }
 *   ... s.coords, am_place_groups(&s.plan, &s.place, ...) -> am_comm_create_groups ...
 *   am_rank_setup_end(&s);
 */
#ifndef AM_RANK_SETUP_H
#define AM_RANK_SETUP_H

#include <stdio.h>

#include "bootstrap.h"
#include "placement.h"
#include "plan.h"
#include "recipe.h"
#include "topology.h"

struct am_rank_setup {
    struct am_boot *boot;        /* NULL when the bootstrap failed */
    struct am_boot_info info;
    struct am_recipe *recipe;    /* NULL when it could not be read */
    struct am_rank_topo topo;    /* this rank's GPU and domain */
    struct am_place_rank *ranks; /* [physical rank]: where every rank is */
    struct am_world world;
    struct am_plan plan;
    struct am_placement place;
    struct am_coords coords;     /* this rank's place in the mesh */
    double timeout_s;            /* for every bootstrap wait: dist_env.timeout_minutes */
    int ready;                   /* the plan and placement are valid */
};

int am_rank_setup(struct am_rank_setup *s, struct am_errors *err);

/* The dry run's output: one JSON line per rank, in rank order (any rank can print it):
 * {"rank":R,"host":"n1","domain":"n1:0","local_rank":L,"gpu":G,"mesh_rank":M,
 *  "coords":{"pp":..,"dp_replicate":..,"dp_shard":..,"cp":..,"tp":..,"ep":..},
 *  "groups":{"tp":[...],"pp":[...],"dp":[...],"ep":[...]}}
 * Groups list physical ranks in group order. Returns 0, or -1 when writing failed. */
int am_rank_setup_print(const struct am_rank_setup *s, FILE *f);

/* Releases everything (not collective). Safe after a failed am_rank_setup. */
void am_rank_setup_end(struct am_rank_setup *s);

/* Ends the program where every rank stops together (a dry run, or a failure every rank
 * knows of). Collective: waits until every rank got here, so what rank 0 printed is out
 * before any rank exits; releases everything; exits with status. With status != 0 rank 0
 * exits first and alone, so its supervisor alone reports the failure and stops the job;
 * the others give it AM_SETUP_STOP_GRACE_S seconds to stop them, then exit by themselves.
 * After a failed bootstrap (s->boot NULL) it just exits. */
#define AM_SETUP_STOP_GRACE_S 10
void am_rank_setup_exit(struct am_rank_setup *s, int status) __attribute__((noreturn));

#endif
