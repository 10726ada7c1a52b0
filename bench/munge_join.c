/* munge_join.c - what munge costs the boot server of a step started without PMIx
 * (launcher/boot_join.h): the server decodes and checks every rank's join credential, one
 * after the other, in its single poll loop. This times that loop's share alone.
 *
 *   munge_join N
 *
 * Encodes N join credentials (ranks 0..N-1 of one step; in a job each rank makes its own, in
 * parallel, so their time is not the server's), then decodes and checks them all in one
 * thread with am_join_verify, as the server does, and prints the time per credential and in
 * all. Needs a munged: AM_MUNGE_SOCKET names its socket (bench/munge_join.sh starts one).
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "boot_join.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv)
{
    int n = argc == 2 ? atoi(argv[1]) : 0;
    if (n < 1) {
        fprintf(stderr, "usage: munge_join N (ranks, >= 1)\n");
        return 2;
    }
    struct am_join_expect x = {.job = 4242, .step = 0, .size = n, .server = "n1:20042", .uid = getuid()};
    char **cred = calloc((size_t)n, sizeof(*cred)), err[512], payload[400];
    double t0 = now();
    for (int r = 0; r < n; r++) {
        am_join_payload(&x, r, payload, sizeof(payload));
        if (!(cred[r] = am_join_encode(payload, err, sizeof(err)))) {
            fprintf(stderr, "munge_join: rank %d: %s\n", r, err);
            return 1;
        }
    }
    double t1 = now();
    for (int r = 0; r < n; r++)
        if (am_join_verify(&x, cred[r], err, sizeof(err)) != r) {
            fprintf(stderr, "munge_join: rank %d refused: %s\n", r, err);
            return 1;
        }
    double t2 = now();
    printf("{\"ranks\": %d, \"encode_us_each\": %.1f, \"verify_us_each\": %.1f, \"verify_s_all\": %.3f}\n", n,
           1e6 * (t1 - t0) / n, 1e6 * (t2 - t1) / n, t2 - t1);
    for (int r = 0; r < n; r++)
        free(cred[r]);
    free(cred);
    return 0;
}
