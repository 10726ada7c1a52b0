/* am-train - the rank program: set up (bootstrap, recipe, placement), then train.
 * Started by am-launch, never by hand (it needs AM_BOOTSTRAP_FD). */
#include <stdio.h>
#include <stdlib.h>

#include "rank_setup.h"
#include "train.h"

int main(void)
{
    struct am_rank_setup s;
    struct am_errors err;
    am_errors_init(&err);
    int rc = am_rank_setup(&s, &err);
    if (rc < 0 || getenv("AM_DRY_RUN")) {
        if (s.info.rank == 0 || !s.boot) {
            if (rc == 0)
                am_rank_setup_print(&s, stdout);
            for (size_t i = 0; i < err.n; i++)
                fprintf(stderr, "am-train: error: %s\n", err.msg[i]);
        }
        fflush(stdout);
        am_rank_setup_exit(&s, rc < 0);
    }
    rc = am_train(&s, &err);
    for (size_t i = 0; i < err.n; i++)
        fprintf(stderr, "am-train: rank %d: error: %s\n", s.info.rank, err.msg[i]);
    if (rc < 0 && s.boot)
        am_boot_abort(s.boot, 1, err.n ? err.msg[0] : "am-train failed");
    am_rank_setup_end(&s);
    am_errors_free(&err);
    return rc < 0 ? 1 : 0;
}
