/* memory.c - host memory for the CPU backend: 64-byte aligned (one cache line, one
 * AVX-512 vector), zeroed, and plain copies for upload/download. */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

#define AM_ALIGN 64

/* Out of memory: told to the fault hook (kernels.h) with what the context holds, then NULL. */
static void *out_of_memory(const struct am_dev *dev, size_t bytes)
{
    struct am_dev_mem m;
    char msg[256];
    am_cpu_mem_stats(dev, &m);
    snprintf(msg, sizeof msg, "out of memory: %zu bytes asked for, %zu in use", bytes, m.in_use);
    struct am_dev_fault f = {.kind = AM_DEV_FAULT_OOM, .backend = "cpu", .ordinal = -1, .where = "am_cpu_alloc",
                             .error = "", .message = msg, .bytes_asked = bytes, .bytes_held = m.held,
                             .bytes_in_use = m.in_use};
    am_kernels_fault(&f);
    return NULL;
}

void *am_cpu_alloc(const struct am_dev *dev, size_t bytes)
{
    if (bytes > SIZE_MAX - AM_ALIGN)
        return out_of_memory(dev, bytes);
    size_t rounded = (bytes + AM_ALIGN - 1) / AM_ALIGN * AM_ALIGN; /* aligned_alloc wants a multiple */
    if (rounded == 0)
        rounded = AM_ALIGN;
    void *p = aligned_alloc(AM_ALIGN, rounded);
    if (!p)
        return out_of_memory(dev, bytes);
    memset(p, 0, rounded);
    am_cpu_account(dev, malloc_usable_size(p), false);
    return p;
}

void am_cpu_free(const struct am_dev *dev, void *p)
{
    if (p)
        am_cpu_account(dev, malloc_usable_size(p), true);
    free(p);
}

void am_cpu_upload(const struct am_dev *dev, void *dst, const void *host_src, size_t bytes)
{
    if (bytes)
        memcpy(dst, host_src, bytes);
}

void am_cpu_download(const struct am_dev *dev, void *host_dst, const void *src, size_t bytes)
{
    if (bytes)
        memcpy(host_dst, src, bytes);
}

void am_cpu_zero(const struct am_dev *dev, struct am_tensor *t)
{
    AM_CHECK(t && t->device == AM_DEV_CPU, "t is not a CPU tensor");
    size_t n = am_tensor_bytes(t);
    if (n)
        memset(t->data, 0, n);
}

void am_cpu_copy(const struct am_dev *dev, struct am_tensor *dst, const struct am_tensor *src)
{
    AM_CHECK(dst && src && dst->device == AM_DEV_CPU && src->device == AM_DEV_CPU, "dst and src must be CPU tensors");
    AM_CHECK(dst->dtype == src->dtype && am_tensor_numel(dst) == am_tensor_numel(src),
             "dst (%s) and src (%s) differ in dtype or size (%lld vs %lld elements)", am_tname(dst), am_tname(src),
             (long long)am_tensor_numel(dst), (long long)am_tensor_numel(src));
    size_t n = am_tensor_bytes(src);
    if (n && dst->data != src->data)
        memmove(dst->data, src->data, n);
}
