/* memory.cu - device memory: the caching allocator (common.cuh, struct am_cuda_pool) behind
 * alloc, free and the scratch; copies in stream order on the context's stream. alloc hands out
 * zeroed memory that every stream may use (zeroed on the context's stream and waited for);
 * free returns the block to the pool (no device call). download waits for the stream (the host
 * reads the bytes next); upload returns when host_src may be reused (pageable memory is staged
 * during the call; page-locked memory is waited for). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.cuh"

#define SMALL_STEP ((size_t)256)
#define LARGE_STEP ((size_t)2 << 20)
#define LARGE ((size_t)1 << 20)

static size_t size_class(size_t bytes)
{
    if (bytes == 0)
        bytes = 1;
    size_t step = bytes < LARGE ? SMALL_STEP : LARGE_STEP;
    return (bytes + step - 1) / step * step;
}

static int add_block(struct am_cuda_pool *P, char *p, size_t size, bool own)
{
    if (P->n == P->cap) {
        size_t cap = P->cap ? 2 * P->cap : 64;
        struct am_cuda_block *v = (struct am_cuda_block *)realloc(P->blocks, cap * sizeof(*v));
        if (!v)
            return -1;
        P->blocks = v;
        P->cap = cap;
    }
    P->blocks[P->n++] = am_cuda_block{p, size, false, own};
    return 0;
}

/* A free block of the class: the exact class, else the smallest that wastes at most a quarter
 * (any: the smallest free block that holds the class, whatever it wastes). */
static struct am_cuda_block *find_free(struct am_cuda_pool *P, size_t cls, bool any)
{
    struct am_cuda_block *best = NULL;
    for (size_t i = 0; i < P->n; i++) {
        struct am_cuda_block *b = &P->blocks[i];
        if (!b->free || b->size < cls || (!any && b->size > cls + cls / 4))
            continue;
        if (!best || b->size < best->size)
            best = b;
        if (b->size == cls)
            break;
    }
    return best;
}

static void *oom(const char *kernel, const struct am_dev *d, struct am_cuda_pool *P, size_t bytes, cudaError_t e)
{
    char msg[512];
    double gib = 1024.0 * 1024.0 * 1024.0;
    snprintf(msg, sizeof msg, "out of GPU memory on device %d: %zu bytes asked for (%.2f GiB); the allocator holds "
             "%.2f GiB, %.2f GiB of it in use; the device has %.2f GiB (%s)", d->ordinal, bytes, (double)bytes / gib,
             (double)P->held / gib, (double)P->in_use / gib, (double)P->total / gib, cudaGetErrorString(e));
    struct am_dev_fault f = {};
    f.kind = AM_DEV_FAULT_OOM;
    f.backend = "cuda";
    f.ordinal = d->ordinal;
    f.where = kernel;
    f.error = cudaGetErrorString(e);
    f.message = msg;
    f.bytes_asked = bytes;
    f.bytes_held = P->held;
    f.bytes_in_use = P->in_use;
    f.bytes_total = P->total;
    am_kernels_fault(&f);
    return NULL;
}

void *am_cuda_pool_get(const char *kernel, const struct am_dev *d, size_t bytes)
{
    struct am_cuda_pool *P = &am_cuda_ctx(kernel, d)->pool;
    if (bytes > (SIZE_MAX >> 1)) /* no device has it (and its class would not fit in a size_t) */
        return oom(kernel, d, P, bytes, cudaErrorMemoryAllocation);
    size_t cls = size_class(bytes);
    struct am_cuda_block *b = find_free(P, cls, false);
    if (!b && P->arena && P->arena_bytes - P->arena_used >= cls) {
        if (add_block(P, P->arena + P->arena_used, cls, false) < 0)
            am_cuda_fatal(kernel, "out of host memory for the allocator's list of blocks");
        P->arena_used += cls;
        b = &P->blocks[P->n - 1];
    }
    if (!b) {
        void *p = NULL;
        cudaError_t e = cudaMalloc(&p, cls);
        if (e == cudaErrorMemoryAllocation) { /* a larger free block, whatever it wastes (no cudaFree: common.cuh) */
            cudaGetLastError();
            b = find_free(P, cls, true);
            if (!b)
                return oom(kernel, d, P, bytes, e);
        } else {
            am_cuda_check(kernel, e, "cudaMalloc");
            if (add_block(P, (char *)p, cls, true) < 0)
                am_cuda_fatal(kernel, "out of host memory for the allocator's list of blocks");
            P->held += cls;
            b = &P->blocks[P->n - 1];
        }
    }
    b->free = false;
    P->in_use += b->size;
    if (P->in_use > P->peak)
        P->peak = P->in_use;
    return b->p;
}

void am_cuda_pool_put(const struct am_dev *d, void *p)
{
    struct am_cuda_pool *P = &am_cuda_ctx("am_cuda_free", d)->pool;
    for (size_t i = 0; i < P->n; i++)
        if (P->blocks[i].p == (char *)p && !P->blocks[i].free) {
            P->blocks[i].free = true;
            P->in_use -= P->blocks[i].size;
            return;
        }
    am_cuda_fatal("am_cuda_free", "%p was not allocated by this context (or was freed twice)", p);
}

void am_cuda_pool_release(struct am_cuda_ctx *c)
{
    struct am_cuda_pool *P = &c->pool;
    for (size_t i = 0; i < P->n; i++)
        if (P->blocks[i].own)
            cudaFree(P->blocks[i].p);
    if (P->arena)
        cudaFree(P->arena);
    free(P->blocks);
    size_t total = P->total;
    *P = am_cuda_pool{};
    P->total = total;
    c->scratch = NULL;
    c->scratch_bytes = 0;
}

int am_cuda_reserve(const struct am_dev *d, size_t bytes)
{
    struct am_cuda_pool *P = &am_cuda_ctx("am_cuda_reserve", d)->pool;
    if (P->arena || bytes == 0)
        return 0; /* once, before the first allocations */
    bytes = size_class(bytes);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    P->arena = (char *)p;
    P->arena_bytes = bytes;
    P->arena_used = 0;
    P->held += bytes;
    return 0;
}

void am_cuda_mem_stats(const struct am_dev *d, struct am_dev_mem *out)
{
    const struct am_cuda_pool *P = &am_cuda_ctx("am_cuda_mem_stats", d)->pool;
    out->held = P->held;
    out->in_use = P->in_use;
    out->peak = P->peak;
    out->total = P->total;
}

void *am_cuda_alloc(const struct am_dev *d, size_t bytes)
{
    const char *k = "am_cuda_alloc";
    am_cuda_ctx(k, d);
    void *p = am_cuda_pool_get(k, d, bytes);
    if (!p)
        return NULL;
    /* zeroed on the context's stream (cudaMemset would run on the legacy default stream,
     * which a non-blocking stream does not wait for), and waited for: zero for every stream.
     * Not the whole device: a communication stream may hold a collective that waits for a
     * peer; a block freed while another stream still used it would have to be freed after the
     * context's stream waited for that work (the communicators make it wait, comm.h) */
    am_cuda_check(k, cudaMemsetAsync(p, 0, bytes ? bytes : 1, am_cuda_stream(d)), "cudaMemsetAsync");
    am_cuda_check(k, cudaStreamSynchronize(am_cuda_stream(d)), "cudaStreamSynchronize");
    return p;
}

void am_cuda_free(const struct am_dev *d, void *p)
{
    am_cuda_ctx("am_cuda_free", d);
    if (p)
        am_cuda_pool_put(d, p);
}

void am_cuda_upload(const struct am_dev *d, void *dst, const void *host_src, size_t bytes)
{
    const char *k = "am_cuda_upload";
    am_cuda_ctx(k, d);
    if (!bytes)
        return;
    am_cuda_check(k, cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, am_cuda_stream(d)), "cudaMemcpyAsync");
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, host_src) == cudaSuccess && a.type == cudaMemoryTypeHost)
        am_cuda_check(k, cudaStreamSynchronize(am_cuda_stream(d)), "cudaStreamSynchronize");
    cudaGetLastError();
}

void am_cuda_download(const struct am_dev *d, void *host_dst, const void *src, size_t bytes)
{
    const char *k = "am_cuda_download";
    am_cuda_ctx(k, d);
    if (!bytes)
        return;
    am_cuda_check(k, cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, am_cuda_stream(d)), "cudaMemcpyAsync");
    am_cuda_check(k, cudaStreamSynchronize(am_cuda_stream(d)), "cudaStreamSynchronize");
}

void am_cuda_zero(const struct am_dev *d, struct am_tensor *t)
{
    const char *k = "am_cuda_zero";
    am_cuda_ctx(k, d);
    am_cuda_tensor(k, "t", t);
    size_t n = am_tensor_bytes(t);
    if (n)
        am_cuda_check(k, cudaMemsetAsync(t->data, 0, n, am_cuda_stream(d)), "cudaMemsetAsync");
}

void am_cuda_copy(const struct am_dev *d, struct am_tensor *dst, const struct am_tensor *src)
{
    const char *k = "am_cuda_copy";
    am_cuda_ctx(k, d);
    am_cuda_tensor(k, "dst", dst);
    am_cuda_tensor(k, "src", src);
    AM_CUDA_REQUIRE(k, dst->dtype == src->dtype && am_tensor_numel(dst) == am_tensor_numel(src),
                    "dst (%s) and src (%s) differ in dtype or size (%lld vs %lld elements)", am_tname(dst), am_tname(src),
                    (long long)am_tensor_numel(dst), (long long)am_tensor_numel(src));
    size_t n = am_tensor_bytes(src);
    if (n && dst->data != src->data)
        am_cuda_check(k, cudaMemcpyAsync(dst->data, src->data, n, cudaMemcpyDeviceToDevice, am_cuda_stream(d)),
                      "cudaMemcpyAsync");
}
