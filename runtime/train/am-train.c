/* am-train - the rank program: set up (bootstrap, recipe, placement), then train.
 * Started by am-launch, never by hand (it needs AM_BOOTSTRAP_FD).
 *
 * The log comes first (train.h, am_train_log_begin): the start record (host, job, rank) is
 * written before anything that can fail, and every error the rank prints is also its cause
 * record, so that am-diag names the rank, its host and the cause of a failure at any stage. */
#include <stdio.h>
#include <stdlib.h>

#include "rank_setup.h"
#include "train.h"
#include "util.h"
#include "version.h"

int main(int argc, char **argv)
{
    if (am_version_option(argc, argv, "am-train"))
        return 0;
    struct am_rank_setup s;
    struct am_errors err;
    struct am_log log;
    char msg[512];
    int log_rank;
    if (am_train_log_begin(&log, &log_rank, msg, sizeof(msg)) < 0)
        fprintf(stderr, "am-train: %s\n", msg);
    am_errors_init(&err);
    int rc = am_rank_setup(&s, &err);
    if (rc < 0 || getenv("AM_DRY_RUN")) {
        if (s.info.rank == 0 || !s.boot) {
            if (rc == 0)
                am_rank_setup_print(&s, stdout);
            for (size_t i = 0; i < err.n; i++)
                fprintf(stderr, "am-train: error: %s\n", err.msg[i]);
            if (rc < 0)
                am_train_log_failure(&log, log_rank, "setup", &err);
        }
        fflush(stdout);
        am_rank_setup_exit(&s, rc < 0);
    }
    rc = am_train(&s, &log, &err);
    if (rc < 0 && s.boot)
        am_boot_abort(s.boot, 1, err.n ? err.msg[0] : "am-train failed");
    am_rank_setup_end(&s);
    am_train_log_end(&log);
    am_errors_free(&err);
    return rc < 0 ? 1 : rc == AM_TRAIN_REQUEUE ? AM_EXIT_REQUEUE : 0;
}
