/* boot_bench - a rank program that times the bootstrap (bench/bootstrap.sh runs it under
 * am-launch): am_boot_init (hello), then an allgather of a 64-byte blob followed by a fence,
 * once cold and then ROUNDS more times. Rank 0 prints one line with the slowest rank's
 * times in milliseconds:
 *   ranks=N init_ms=.. first_ms=.. (init + first allgather + fence) round_ms=.. (median)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bootstrap.h"

#define ROUNDS 20
#define BLOB 64

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* put + fence + get of every rank's blob, then a fence: one round */
static int round_trip(struct am_boot *b, const char *key, int rank, int size, char *all, char *err,
                      size_t err_len)
{
    char mine[BLOB];
    memset(mine, 'a' + rank % 26, sizeof(mine));
    if (am_boot_allgather(b, key, mine, sizeof(mine), all, 60, err, err_len) < 0 ||
        am_boot_fence(b, 60, err, err_len) < 0)
        return -1;
    for (int r = 0; r < size; r++)
        if (all[(size_t)r * BLOB] != 'a' + r % 26) {
            snprintf(err, err_len, "%s: rank %d's blob came back wrong", key, r);
            return -1;
        }
    return 0;
}

int main(void)
{
    struct am_boot_info info;
    char err[512], key[32];
    double t0 = now_ms();
    struct am_boot *b = am_boot_init(&info, err, sizeof(err));
    if (!b) {
        fprintf(stderr, "boot_bench: %s\n", err);
        return 3;
    }
    double t_init = now_ms() - t0;
    snprintf(err, sizeof(err), "out of memory");
    char *all = malloc((size_t)info.size * BLOB);
    double rounds[ROUNDS], times[3];
    if (!all || round_trip(b, "bench0", info.rank, info.size, all, err, sizeof(err)) < 0)
        goto fail;
    double t_first = now_ms() - t0;
    for (int i = 0; i < ROUNDS; i++) {
        double s = now_ms();
        snprintf(key, sizeof(key), "bench%d", i + 1);
        if (round_trip(b, key, info.rank, info.size, all, err, sizeof(err)) < 0)
            goto fail;
        rounds[i] = now_ms() - s;
    }
    qsort(rounds, ROUNDS, sizeof(double), cmp);
    times[0] = t_init;
    times[1] = t_first;
    times[2] = rounds[ROUNDS / 2];
    double *every = malloc((size_t)info.size * sizeof(times));
    snprintf(err, sizeof(err), "out of memory");
    if (!every || am_boot_allgather(b, "times", times, sizeof(times), every, 60, err, sizeof(err)) < 0)
        goto fail;
    if (info.rank == 0) {
        double worst[3] = {0, 0, 0};
        for (int r = 0; r < info.size; r++)
            for (int k = 0; k < 3; k++)
                if (every[r * 3 + k] > worst[k])
                    worst[k] = every[r * 3 + k];
        printf("ranks=%d init_ms=%.3f first_ms=%.3f round_ms=%.3f\n", info.size, worst[0], worst[1], worst[2]);
    }
    free(every);
    free(all);
    am_boot_fini(b);
    return 0;
fail:
    fprintf(stderr, "boot_bench: rank %d: %s\n", info.rank, err);
    return 4;
}
