/* am-place - the rank program of `am-launch --dry-run`: every rank runs the start that
 * every rank program runs (rank_setup.h: bootstrap, recipe, topology, placement, plan),
 * then rank 0 prints the placement, one JSON line per rank, and all exit.
 *
 * Exit status: 0 placed; 1 the recipe, the topology or the placement failed (rank 0
 * prints why, once); 3 not started by am-launch.
 */
#include <stdio.h>
#include <stdlib.h>

#include "rank_setup.h"
#include "version.h"

int main(int argc, char **argv)
{
    if (am_version_option(argc, argv, "am-place"))
        return 0;
    struct am_errors err;
    struct am_rank_setup s;
    am_errors_init(&err);
    int rc = am_rank_setup(&s, &err);
    int booted = s.boot != NULL;
    if (!booted || s.info.rank == 0) {
        if (rc == 0 && am_rank_setup_print(&s, stdout) < 0) {
            fprintf(stderr, "am-place: cannot write the placement to stdout\n");
            rc = -1;
        }
        for (size_t i = 0; i < err.n; i++)
            fprintf(stderr, "am-place: error: %s\n", err.msg[i]);
        if (err.truncated)
            fprintf(stderr, "am-place: error: ... and %d more\n", err.truncated);
        fflush(stderr);
    }
    am_errors_free(&err);
    am_rank_setup_exit(&s, !booted ? 3 : rc < 0 ? 1 : 0);
}
