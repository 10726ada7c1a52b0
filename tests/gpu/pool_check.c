/* pool_check.c - the CUDA backend's caching allocator (kernels/cuda/memory.cu) on a GPU:
 * size classes, reuse of a freed block, zeroed memory, the arena reserved up front and growth
 * past it, the counts of mem_stats, and an allocation no device can serve reaching the fault
 * hook (kernels.h) as AM_DEV_FAULT_OOM with the bytes asked and the pool's counts. Prints one
 * line per check and a summary; exit 0 when all pass, 1 otherwise, 77 (SKIP) without a CUDA
 * device. Run by tests/gpu/run. */
#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static int failures, checks;

static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("%-4s ", ok ? "ok" : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    checks++;
    failures += !ok;
}

static struct am_dev_fault seen;
static int n_seen;
static void hook(void *arg, const struct am_dev_fault *f)
{
    (void)arg;
    seen = *f;
    n_seen++;
}

static int open_cuda(struct am_dev *d, const struct am_kernels *K)
{
    char err[512];
    memset(d, 0, sizeof *d);
    d->k = K;
    d->device = AM_DEV_CUDA;
    d->ordinal = 0;
    if (K->open(d, err, sizeof err) < 0) {
        fprintf(stderr, "pool_check: %s\n", err);
        return -1;
    }
    return 0;
}

#define MIB ((size_t)1 << 20)

int main(void)
{
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("skipped: no CUDA device (cudaGetDeviceCount: %s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 77;
    }
    const struct am_kernels *K = am_kernels_cuda();
    struct am_dev d;
    struct am_dev_mem m;
    if (open_cuda(&d, K) < 0)
        return 1;

    /* size classes, zeroed memory, reuse */
    unsigned char *a = K->alloc(&d, 1000);
    K->mem_stats(&d, &m);
    check(a && m.in_use == 1024 && m.held == 1024 && m.total > 0,
          "1000 bytes take the 1024-byte class: in use %zu, held %zu, device %zu", m.in_use, m.held, m.total);
    unsigned char host[1000];
    memset(host, 0xab, sizeof host);
    K->download(&d, host, a, sizeof host);
    int zero = 1;
    for (size_t i = 0; i < sizeof host; i++)
        zero &= host[i] == 0;
    check(zero, "alloc hands out zeroed memory");
    memset(host, 0x5a, sizeof host);
    K->upload(&d, a, host, sizeof host);
    K->free(&d, a);
    K->mem_stats(&d, &m);
    check(m.in_use == 0 && m.held == 1024 && m.peak == 1024, "free keeps the block: in use %zu, held %zu, peak %zu",
          m.in_use, m.held, m.peak);
    unsigned char *b = K->alloc(&d, 900);
    K->mem_stats(&d, &m);
    check(b == a && m.held == 1024, "900 bytes reuse the freed 1024-byte block (%p, was %p), held %zu", (void *)b,
          (void *)a, m.held);
    K->download(&d, host, b, sizeof host);
    zero = 1;
    for (size_t i = 0; i < 900; i++)
        zero &= host[i] == 0;
    check(zero, "a reused block is zeroed again");
    unsigned char *c = K->alloc(&d, 3 * MIB);
    K->mem_stats(&d, &m);
    check(c && m.in_use == 1024 + 4 * MIB, "3 MiB take the 4 MiB class (2 MiB steps above 1 MiB): in use %zu",
          m.in_use);
    K->free(&d, b);
    K->free(&d, c);
    K->close(&d);

    /* the arena reserved up front, and growth past it */
    if (open_cuda(&d, K) < 0)
        return 1;
    check(K->reserve(&d, 64 * MIB) == 0, "reserve 64 MiB");
    K->mem_stats(&d, &m);
    check(m.held == 64 * MIB && m.in_use == 0, "held %zu after the reservation, in use %zu", m.held, m.in_use);
    void *x = K->alloc(&d, 40 * MIB), *y = K->alloc(&d, 20 * MIB);
    K->mem_stats(&d, &m);
    check(x && y && m.held == 64 * MIB && m.in_use == 60 * MIB,
          "40 + 20 MiB from the arena: held %zu (unchanged), in use %zu", m.held, m.in_use);
    void *z = K->alloc(&d, 10 * MIB);
    K->mem_stats(&d, &m);
    check(z && m.held == 74 * MIB && m.in_use == 70 * MIB, "10 MiB more grow the pool past the arena: held %zu, in use %zu",
          m.held, m.in_use);

    /* an allocation no device can serve: NULL, and the hook hears it */
    am_kernels_set_fault_hook(hook, NULL);
    size_t huge = (size_t)1 << 50;
    void *h = K->alloc(&d, huge);
    K->mem_stats(&d, &m);
    check(!h && n_seen == 1 && seen.kind == AM_DEV_FAULT_OOM && seen.bytes_asked == huge &&
              seen.bytes_in_use == m.in_use && seen.bytes_held == m.held && seen.bytes_total == m.total &&
              strcmp(seen.backend, "cuda") == 0 && strcmp(seen.where, "am_cuda_alloc") == 0,
          "1 PiB: NULL; the hook heard OOM once (%d) with %zu bytes asked, in use %zu, held %zu: \"%s\"", n_seen,
          seen.bytes_asked, seen.bytes_in_use, seen.bytes_held, seen.message ? seen.message : "");
    void *after = K->alloc(&d, MIB);
    check(after != NULL, "the device still allocates after the failure");
    am_kernels_set_fault_hook(NULL, NULL);
    K->free(&d, x);
    K->free(&d, y);
    K->free(&d, z);
    K->free(&d, after);
    K->close(&d);

    printf("pool_check: %d of %d checks passed\n", checks - failures, checks);
    return failures ? 1 : 0;
}
