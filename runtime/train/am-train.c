/* am-train - the rank program: set up (bootstrap, recipe, placement), then train.
 * Started by am-launch, never by hand (it needs AM_BOOTSTRAP_FD).
 *
 * The log comes first (train.h, am_train_log_begin): the start record (host, job, rank) is
 * written before anything that can fail, and every error the rank prints is also its cause
 * record, so that am-diag names the rank, its host and the cause of a failure at any stage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rank_setup.h"
#include "train.h"
#include "util.h"
#include "version.h"

static const char help[] =
    "usage: am-launch --nproc N RECIPE          (am-launch starts am-train on each rank)\n"
    "       srun --mpi=pmix am-launch RECIPE\n"
    "am-train is the rank program: it trains the recipe on its rank and is started by am-launch,\n"
    "never by hand (it needs the launcher's AM_BOOTSTRAP_FD).\n"
    "  --help       this text\n"
    "  --version    am's version and what the build has\n"
    "Settings from the environment:\n"
    "  AM_TENSORBOARD_DIR DIR|none  rank 0's TensorBoard files (default <log dir>/<job id>/tensorboard)\n"
    "  AM_WATCHDOG_S S              the collective watchdog's timeout (default dist_env.timeout_minutes)\n"
    "  AM_FLIGHT_RECORDER_SIZE N    entries of the flight recorder (default 1024)\n"
    "  AM_PEAK_TFLOPS T             the device's peak for the MFU\n"
    "  AM_DEVICE cpu                train on the CPU on a GPU machine\n"
    "  AM_FAULT rank=R,step=S,kind=K  inject a fault (docs/diagnostics.md)\n";

int main(int argc, char **argv)
{
    if (am_version_option(argc, argv, "am-train"))
        return 0;
    if (argc >= 2 && strcmp(argv[1], "--help") == 0) {
        fputs(help, stdout);
        return 0;
    }
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
