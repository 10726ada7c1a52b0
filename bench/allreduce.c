/* bench/allreduce - allreduce bus bandwidth of am's communicators (UCX backend, host memory),
 * measured the way nccl-tests measures it; bench/allreduce_mpi.c is the same loop over
 * MPI_Allreduce, and bench/allreduce.sh runs both side by side.
 *
 *   am-launch --nproc N RECIPE -- bench/allreduce [--min BYTES] [--max BYTES] [--step F]
 *                                                 [--warmup W] [--iters I]
 *
 * For each size (fp32, sum, out of place): W warm-up calls, then I timed calls, each after a
 * barrier; a call's time is the slowest rank's (an allreduce with MAX of the times). Rank 0
 * prints one line per size: bytes, median time in microseconds, algbw and busbw in GB/s, where
 * algbw = bytes / time and busbw = algbw * 2 (n - 1) / n (nccl-tests' definitions).
 * Sizes accept K, M, G suffixes (powers of 2). Default iterations scale with the size.
 *
 * --overlap: for each size, instead, how much of an allreduce hides behind computation when
 * it runs non-blocking (am_iallreduce, then compute, then am_comm_wait) against the same
 * work done one after the other (compute, then am_allreduce). The computation is a fixed
 * single-threaded loop over a 1 MiB array, sized to take about as long as the blocking
 * allreduce. Rank 0 prints: bytes, comm_ms (blocking allreduce alone), compute_ms (alone),
 * serial_ms, overlapped_ms, wait_ms (time left in am_comm_wait after the computation) and
 * hidden = (serial - overlapped) / min(comm, compute): 1 when the shorter one hides entirely.
 * Medians over the iterations, each the slowest rank's. --overlap-sleep: the same, but the
 * "computation" sleeps as long as the loop ran (one rank per core computing leaves the
 * communication thread no CPU of its own; a sleep stands for a GPU computing or for cores
 * the ranks leave free).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0)
        return -1;
    double mult = *end == 'K' || *end == 'k' ? 1024.0 : *end == 'M' || *end == 'm' ? 1048576.0
                : *end == 'G' || *end == 'g' ? 1073741824.0 : 1.0;
    if (mult != 1.0)
        end++;
    if (*end && strcmp(end, "B") != 0)
        return -1;
    *out = (size_t)(v * mult);
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The stand-in for a layer's backward: `reps` passes over a 1 MiB array (no calls into the
 * communicators). The result is returned so that the compiler keeps the work. */
static float compute(float *work, size_t n, int64_t reps, double sleep_per_rep)
{
    float acc = 0;
    if (sleep_per_rep > 0) {
        double s = sleep_per_rep * (double)reps;
        struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
        nanosleep(&ts, NULL);
        return 0;
    }
    for (int64_t r = 0; r < reps; r++)
        for (size_t i = 0; i < n; i++) {
            work[i] = work[i] * 0.999f + 0.001f;
            acc += work[i];
        }
    return acc;
}

/* The message of the communicator call that failed (one thread). */
static char cerr[AM_COMM_ERR_LEN];

/* The slowest rank's seconds. */
static int slowest(struct am_comm *c, double t, double *out)
{
    int64_t ns = (int64_t)(t * 1e9), max;
    if (am_allreduce(c, &ns, &max, 1, AM_I64, AM_MAX, cerr, sizeof(cerr)) < 0)
        return -1;
    *out = (double)max * 1e-9;
    return 0;
}

/* --overlap: see the top of the file. */
static int overlap_size(struct am_comm *c, const float *send, float *recv, size_t n, int it, int rank, int sleep)
{
    static float work[1 << 18];
    const size_t nw = sizeof(work) / sizeof(work[0]);
    double t_comm[1000], t_comp[1000], t_ser[1000], t_ovl[1000], t_wait[1000];
    volatile float sink = 0;
    /* the blocking allreduce's time, then enough compute passes to match it */
    for (int i = 0; i < it; i++) {
        if (am_barrier(c, cerr, sizeof(cerr)) < 0)
            return -1;
        double t0 = now();
        if (am_allreduce(c, send, recv, n, AM_F32, AM_SUM, cerr, sizeof(cerr)) < 0 ||
            slowest(c, now() - t0, &t_comm[i]) < 0)
            return -1;
    }
    double comm = median(t_comm, it);
    double t0 = now();
    sink += compute(work, nw, 20, 0);
    double per_rep = (now() - t0) / 20;
    int64_t mine = (int64_t)(comm / per_rep) + 1, reps;
    /* every rank computes the same amount */
    if (am_allreduce(c, &mine, &reps, 1, AM_I64, AM_MAX, cerr, sizeof(cerr)) < 0)
        return -1;
    for (int i = 0; i < it; i++) {
        struct am_comm_req *q;
        if (am_barrier(c, cerr, sizeof(cerr)) < 0)
            return -1;
        t0 = now();
        sink += compute(work, nw, reps, sleep ? per_rep : 0);
        if (slowest(c, now() - t0, &t_comp[i]) < 0 || am_barrier(c, cerr, sizeof(cerr)) < 0)
            return -1;
        t0 = now();
        sink += compute(work, nw, reps, sleep ? per_rep : 0);
        if (am_allreduce(c, send, recv, n, AM_F32, AM_SUM, cerr, sizeof(cerr)) < 0 ||
            slowest(c, now() - t0, &t_ser[i]) < 0 || am_barrier(c, cerr, sizeof(cerr)) < 0)
            return -1;
        t0 = now();
        if (am_iallreduce(c, send, recv, n, AM_F32, AM_SUM, &q, cerr, sizeof(cerr)) < 0)
            return -1;
        sink += compute(work, nw, reps, sleep ? per_rep : 0);
        double tw = now();
        if (am_comm_wait(q, cerr, sizeof(cerr)) < 0)
            return -1;
        double end = now();
        if (slowest(c, end - t0, &t_ovl[i]) < 0 || slowest(c, end - tw, &t_wait[i]) < 0)
            return -1;
    }
    double comp = median(t_comp, it), ser = median(t_ser, it), ovl = median(t_ovl, it), wait = median(t_wait, it);
    double shorter = comm < comp ? comm : comp;
    if (rank == 0) {
        printf("%zu %.2f %.2f %.2f %.2f %.2f %.2f\n", n * 4, comm * 1e3, comp * 1e3, ser * 1e3, ovl * 1e3, wait * 1e3,
               (ser - ovl) / shorter);
        fflush(stdout);
    }
    (void)sink;
    return 0;
}

int main(int argc, char **argv)
{
    size_t min = 1 << 20, max = 256 << 20;
    double step = 4;
    int warmup = 2, iters = 0, overlap = 0;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--min") && v && parse_size(v, &min) == 0)
            i++;
        else if (!strcmp(argv[i], "--max") && v && parse_size(v, &max) == 0)
            i++;
        else if (!strcmp(argv[i], "--step") && v && (step = atof(v)) > 1)
            i++;
        else if (!strcmp(argv[i], "--warmup") && v && (warmup = atoi(v)) >= 0)
            i++;
        else if (!strcmp(argv[i], "--iters") && v && (iters = atoi(v)) > 0)
            i++;
        else if (!strcmp(argv[i], "--overlap"))
            overlap = 1;
        else if (!strcmp(argv[i], "--overlap-sleep"))
            overlap = 2;
        else {
            fprintf(stderr, "usage: bench/allreduce [--min BYTES] [--max BYTES] [--step F] [--warmup W] [--iters I] [--overlap | --overlap-sleep]\n");
            return 2;
        }
    }
    struct am_boot_info info;
    char err[1024];
    struct am_boot *boot = am_boot_init(&info, err, sizeof(err));
    if (!boot) {
        fprintf(stderr, "bench/allreduce: %s\n", err);
        return 3;
    }
    struct am_comm_ctx *ctx = am_comm_ctx_init(AM_COMM_UCX, boot, &info, 0, 600, err, sizeof(err));
    if (!ctx) {
        fprintf(stderr, "bench/allreduce: %s\n", err);
        return 3;
    }
    int *world = malloc((size_t)info.size * sizeof(int));
    for (int r = 0; r < info.size; r++)
        world[r] = r;
    const int *groups[] = {world};
    int sizes[] = {info.size};
    const char *names[] = {"world"};
    struct am_comm *c = NULL;
    if (am_comm_create_groups(ctx, 1, groups, sizes, names, &c, err, sizeof(err)) < 0) {
        fprintf(stderr, "bench/allreduce: %s\n", err);
        return 3;
    }
    size_t n_max = max / 4 ? max / 4 : 1;
    float *send = malloc(n_max * 4), *recv = malloc(n_max * 4);
    double *times = malloc(1000 * sizeof(double));
    if (!send || !recv || !times) {
        fprintf(stderr, "bench/allreduce: out of memory for %zu bytes\n", max);
        return 3;
    }
    for (size_t i = 0; i < n_max; i++)
        send[i] = (float)(i % 1000) * 0.001f;
    memset(recv, 0, n_max * 4);
    int p = info.size, rc = 0;
    if (info.rank == 0 && overlap)
        printf("# am allreduce overlap (UCX backend), fp32 sum, %d ranks, computation %s: bytes comm_ms compute_ms "
               "serial_ms overlapped_ms wait_ms hidden\n", p, overlap == 2 ? "sleeping" : "on the CPU");
    else if (info.rank == 0)
        printf("# am allreduce (UCX backend), fp32 sum, %d ranks: bytes time_us algbw_GBps busbw_GBps\n", p);
    for (double bytes_d = (double)min; bytes_d <= (double)max * 1.0001; bytes_d *= step) {
        size_t n = (size_t)bytes_d / 4, bytes = n * 4;
        int it = iters ? iters : bytes >= (64u << 20) ? 5 : bytes >= (4u << 20) ? 10 : bytes >= (64u << 10) ? 50 : 200;
        if (it > 1000)
            it = 1000;
        for (int w = 0; w < warmup; w++)
            if (am_allreduce(c, send, recv, n, AM_F32, AM_SUM, cerr, sizeof(cerr)) < 0)
                goto fail;
        if (overlap) {
            if (overlap_size(c, send, recv, n, it < 5 ? 5 : it > 20 ? 20 : it, info.rank, overlap == 2) < 0)
                goto fail;
            continue;
        }
        for (int i = 0; i < it; i++) {
            if (am_barrier(c, cerr, sizeof(cerr)) < 0)
                goto fail;
            double t0 = now();
            if (am_allreduce(c, send, recv, n, AM_F32, AM_SUM, cerr, sizeof(cerr)) < 0)
                goto fail;
            int64_t ns = (int64_t)((now() - t0) * 1e9), slowest;
            if (am_allreduce(c, &ns, &slowest, 1, AM_I64, AM_MAX, cerr, sizeof(cerr)) < 0)
                goto fail;
            times[i] = (double)slowest * 1e-9;
        }
        qsort(times, (size_t)it, sizeof(double), cmp_double);
        double t = it % 2 ? times[it / 2] : 0.5 * (times[it / 2 - 1] + times[it / 2]);
        double algbw = (double)bytes / t / 1e9, busbw = algbw * 2.0 * (p - 1) / p;
        if (info.rank == 0) {
            printf("%zu %.2f %.3f %.3f\n", bytes, t * 1e6, algbw, busbw);
            fflush(stdout);
        }
    }
    goto out;
fail:
    fprintf(stderr, "bench/allreduce: rank %d: %s\n", info.rank, cerr);
    rc = 1;
out:
    am_comm_destroy(c);
    am_comm_ctx_fini(ctx);
    am_boot_fini(boot);
    free(world);
    free(send);
    free(recv);
    free(times);
    return rc;
}
