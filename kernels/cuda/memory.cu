/* memory.cu - device memory: cudaMalloc (zeroed before alloc returns; allocations are rare:
 * the model's slabs at start; free is cudaFree, which waits for the device), copies in stream order on the context's stream. download
 * waits for the stream (the host reads the bytes next); upload returns when host_src may be
 * reused (pageable memory is staged during the call; page-locked memory is waited for). */
#include "common.cuh"

void *am_cuda_alloc(const struct am_dev *d, size_t bytes)
{
    const char *k = "am_cuda_alloc";
    am_cuda_ctx(k, d);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        return NULL;
    }
    am_cuda_check(k, e, "cudaMalloc");
    /* zeroed on the context's stream (cudaMemset would run on the legacy default stream,
     * which a non-blocking stream does not wait for), and waited for: zero for every stream */
    am_cuda_check(k, cudaMemsetAsync(p, 0, bytes ? bytes : 1, am_cuda_stream(d)), "cudaMemsetAsync");
    am_cuda_check(k, cudaStreamSynchronize(am_cuda_stream(d)), "cudaStreamSynchronize");
    return p;
}

void am_cuda_free(const struct am_dev *d, void *p)
{
    const char *k = "am_cuda_free";
    am_cuda_ctx(k, d);
    if (p)
        am_cuda_check(k, cudaFree(p), "cudaFree");
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
