/* pool_check.c - the CUDA backend's caching allocator (kernels/cuda/memory.cu) on a GPU:
 * size classes, reuse of a freed block, zeroed memory, the arena reserved up front and growth
 * past it, the counts of mem_stats, an allocation no device can serve reaching the fault hook
 * (kernels.h) as AM_DEV_FAULT_OOM with the bytes asked and the pool's counts, and a device
 * filled up: a request cudaMalloc cannot serve is served from a larger free block of the pool
 * (nothing given back to the device: no cudaFree while the context runs, common.cuh). Prints
 * one line per check (line-buffered) and a summary; exit 0 when all pass, 1 otherwise, 77
 * (SKIP) without an NVIDIA device, as gpu_check (probe.h). Run by tests/gpu/run. */
#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "probe.h"

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

/* the last fault the hook heard, its strings copied (they live only during the call: the
 * message is in the allocator's stack) */
static struct am_dev_fault seen;
static char seen_message[1024], seen_where[128], seen_error[256], seen_backend[16];
static int n_seen;
static void hook(void *arg, const struct am_dev_fault *f)
{
    (void)arg;
    seen = *f;
    snprintf(seen_message, sizeof seen_message, "%s", f->message ? f->message : "");
    snprintf(seen_where, sizeof seen_where, "%s", f->where ? f->where : "");
    snprintf(seen_error, sizeof seen_error, "%s", f->error ? f->error : "");
    snprintf(seen_backend, sizeof seen_backend, "%s", f->backend ? f->backend : "");
    seen.message = seen_message;
    seen.where = seen_where;
    seen.error = seen_error;
    seen.backend = seen_backend;
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

/* The device filled with blocks of 1 GiB, then 64 MiB, then 2 MiB, until cudaMalloc fails at
 * each (the hook hears those): one 1 GiB block freed, 600 MiB (a class the quarter's rule
 * would not take from it) are served from it, the pool holding no more than before. */
static void filled_device(const struct am_kernels *K, struct am_dev *d)
{
    enum { MAXB = 4096 };
    static void *blocks[MAXB];
    int n = 0, first_gib = -1;
    static const size_t steps[] = {(size_t)1 << 30, 64 * MIB, 2 * MIB};
    for (int s = 0; s < 3; s++)
        while (n < MAXB) {
            void *p = K->alloc(d, steps[s]);
            if (!p)
                break;
            if (s == 0 && first_gib < 0)
                first_gib = n;
            blocks[n++] = p;
        }
    struct am_dev_mem m;
    K->mem_stats(d, &m);
    check(first_gib >= 0 && n < MAXB, "the device filled: %d blocks, %zu bytes held of %zu", n, m.held, m.total);
    if (first_gib < 0 || n >= MAXB) {
        for (int i = 0; i < n; i++)
            K->free(d, blocks[i]);
        return;
    }
    void *gib = blocks[first_gib];
    K->free(d, gib);
    size_t held = m.held;
    void *p = K->alloc(d, 600 * MIB);
    K->mem_stats(d, &m);
    check(p == gib && m.held == held,
          "600 MiB on a full device: the freed 1 GiB block (%p, was %p), the pool still holds %zu bytes (%zu before)", p,
          gib, m.held, held);
    blocks[first_gib] = p;
    for (int i = 0; i < n; i++)
        if (blocks[i])
            K->free(d, blocks[i]);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    enum gpu_verdict verdict = gpu_probe("pool_check");
    if (verdict != GPU_RUN)
        return (int)verdict;
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
    K->free(&d, x);
    K->free(&d, y);
    K->free(&d, z);
    K->free(&d, after);
    K->close(&d);

    /* a full device */
    if (open_cuda(&d, K) < 0)
        return 1;
    filled_device(K, &d);
    am_kernels_set_fault_hook(NULL, NULL);
    K->close(&d);

    printf("pool_check: %d of %d checks passed\n", checks - failures, checks);
    return failures ? 1 : 0;
}
