/* bench/allreduce_mpi - the peer of bench/allreduce: the same measurement over MPI_Allreduce
 * (built and run by bench/allreduce.sh with mpicc/mpirun; not part of the build).
 *
 *   mpirun -np N bench/allreduce_mpi [--min BYTES] [--max BYTES] [--step F] [--warmup W] [--iters I]
 *
 * For each size (fp32, sum, out of place): W warm-up calls, then I timed calls, each after a
 * barrier; a call's time is the slowest rank's. Rank 0 prints: bytes, median time in
 * microseconds, algbw and busbw in GB/s (busbw = algbw * 2 (n - 1) / n).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

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

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, p;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    size_t min = 1 << 20, max = 256 << 20;
    double step = 4;
    int warmup = 2, iters = 0;
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
        else {
            if (rank == 0)
                fprintf(stderr, "usage: allreduce_mpi [--min BYTES] [--max BYTES] [--step F] [--warmup W] [--iters I]\n");
            MPI_Finalize();
            return 2;
        }
    }
    size_t n_max = max / 4 ? max / 4 : 1;
    float *send = malloc(n_max * 4), *recv = malloc(n_max * 4);
    double *times = malloc(1000 * sizeof(double));
    if (!send || !recv || !times) {
        fprintf(stderr, "allreduce_mpi: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    for (size_t i = 0; i < n_max; i++)
        send[i] = (float)(i % 1000) * 0.001f;
    memset(recv, 0, n_max * 4);
    if (rank == 0)
        printf("# Open MPI MPI_Allreduce, fp32 sum, %d ranks: bytes time_us algbw_GBps busbw_GBps\n", p);
    for (double bytes_d = (double)min; bytes_d <= (double)max * 1.0001; bytes_d *= step) {
        size_t n = (size_t)bytes_d / 4, bytes = n * 4;
        int it = iters ? iters : bytes >= (64u << 20) ? 5 : bytes >= (4u << 20) ? 10 : bytes >= (64u << 10) ? 50 : 200;
        if (it > 1000)
            it = 1000;
        for (int w = 0; w < warmup; w++)
            MPI_Allreduce(send, recv, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (int i = 0; i < it; i++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allreduce(send, recv, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double dt = MPI_Wtime() - t0, slowest;
            MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            times[i] = slowest;
        }
        qsort(times, (size_t)it, sizeof(double), cmp_double);
        double t = it % 2 ? times[it / 2] : 0.5 * (times[it / 2 - 1] + times[it / 2]);
        double algbw = (double)bytes / t / 1e9, busbw = algbw * 2.0 * (p - 1) / p;
        if (rank == 0) {
            printf("%zu %.2f %.3f %.3f\n", bytes, t * 1e6, algbw, busbw);
            fflush(stdout);
        }
    }
    free(send);
    free(recv);
    free(times);
    MPI_Finalize();
    return 0;
}
