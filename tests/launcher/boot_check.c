/* boot_check - a rank program that exercises the bootstrap: hello, allgather, and (when
 * asked by BOOT_CHECK_FAIL=RANK:CODE) failing on purpose. Prints one line per rank. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bootstrap.h"

int main(void)
{
    struct am_boot_info info;
    char err[512];
    struct am_boot *b = am_boot_init(&info, err, sizeof(err));
    if (!b) {
        fprintf(stderr, "boot_check: %s\n", err);
        return 3;
    }
    const char *fail = getenv("BOOT_CHECK_FAIL");
    if (fail && atoi(fail) == info.rank) {
        const char *colon = strchr(fail, ':');
        return colon ? atoi(colon + 1) : 1;
    }
    int *all = calloc((size_t)info.size, sizeof(int));
    int mine = 1000 + info.rank;
    if (!all || am_boot_allgather(b, "x", &mine, sizeof(mine), all, 30) < 0) {
        fprintf(stderr, "boot_check: rank %d: %s\n", info.rank, am_boot_error(b));
        return 4;
    }
    for (int r = 0; r < info.size; r++)
        if (all[r] != 1000 + r) {
            fprintf(stderr, "boot_check: rank %d: got %d from rank %d\n", info.rank, all[r], r);
            return 5;
        }
    printf("rank %d/%d on %s (node %d/%d, local %d/%d) job %s: allgather ok\n", info.rank, info.size, info.host,
           info.node_id, info.n_nodes, info.local_rank, info.local_size, info.job_id);
    free(all);
    am_boot_fini(b);
    return 0;
}
