/* cuda.cu - the CUDA backend's context (open, close, sync), its device scratch, and the
 * checks every kernel uses (cuda_impl.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

void am_cuda_fatal(const char *kernel, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", kernel);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
    abort();
}

void am_cuda_check(const char *kernel, cudaError_t e, const char *what)
{
    if (e != cudaSuccess)
        am_cuda_fatal(kernel, "CUDA error in %s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

struct am_cuda_ctx *am_cuda_ctx(const char *kernel, const struct am_dev *d)
{
    if (!d || d->device != AM_DEV_CUDA || !d->workspace || !d->stream)
        am_cuda_fatal(kernel, "not an open CUDA device context (am_dev_open(..., AM_DEV_CUDA, ...))");
    return (struct am_cuda_ctx *)d->workspace;
}

void *am_cuda_scratch(const char *kernel, const struct am_dev *d, size_t bytes)
{
    struct am_cuda_ctx *c = am_cuda_ctx(kernel, d);
    bytes = (bytes + 255) / 256 * 256;
    if (bytes == 0)
        bytes = 256;
    if (bytes > c->scratch_bytes) {
        cudaStream_t s = am_cuda_stream(d);
        if (c->scratch)
            am_cuda_check(kernel, cudaFreeAsync(c->scratch, s), "cudaFreeAsync (scratch)");
        c->scratch = NULL;
        c->scratch_bytes = 0;
        am_cuda_check(kernel, cudaMallocAsync(&c->scratch, bytes, s), "cudaMallocAsync (scratch)");
        c->scratch_bytes = bytes;
    }
    return c->scratch;
}

/* ---- tensor checks ---- */

void am_cuda_tensor(const char *kernel, const char *what, const struct am_tensor *t)
{
    if (!t)
        am_cuda_fatal(kernel, "%s is NULL", what);
    if (t->device != AM_DEV_CUDA)
        am_cuda_fatal(kernel, "%s (%s) is not a CUDA tensor", what, am_tname(t));
    if (t->ndim < 0 || t->ndim > AM_TENSOR_MAX_DIMS)
        am_cuda_fatal(kernel, "%s (%s) has %d dimensions (at most %d)", what, am_tname(t), t->ndim, AM_TENSOR_MAX_DIMS);
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] < 0)
            am_cuda_fatal(kernel, "%s (%s) has a negative dimension", what, am_tname(t));
    if (!t->data && am_tensor_numel(t) > 0)
        am_cuda_fatal(kernel, "%s (%s) has no data", what, am_tname(t));
}

void *am_cuda_data(const char *kernel, const char *what, const struct am_tensor *t, enum am_dtype dtype)
{
    am_cuda_tensor(kernel, what, t);
    if (t->dtype != dtype)
        am_cuda_fatal(kernel, "%s (%s) is %s, must be %s", what, am_tname(t), am_dtype_name(t->dtype),
                      am_dtype_name(dtype));
    return t->data;
}

void *am_cuda_scalar(const char *kernel, const char *what, const struct am_tensor *t, enum am_dtype dtype)
{
    void *p = am_cuda_data(kernel, what, t, dtype);
    if (am_tensor_numel(t) != 1)
        am_cuda_fatal(kernel, "%s (%s) has %lld elements; a device scalar has one", what, am_tname(t),
                      (long long)am_tensor_numel(t));
    return p;
}

enum am_dtype am_cuda_act(const char *kernel, const char *what, const struct am_tensor *t)
{
    am_cuda_tensor(kernel, what, t);
    if (t->dtype != AM_F32 && t->dtype != AM_BF16)
        am_cuda_fatal(kernel, "%s (%s) is %s; the CUDA backend takes fp32 or bf16 here (bf16 storage, fp32 arithmetic)",
                      what, am_tname(t), am_dtype_name(t->dtype));
    return t->dtype;
}

void am_cuda_same(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                  const struct am_tensor *ref)
{
    am_cuda_tensor(kernel, what, t);
    if (t->dtype != ref->dtype)
        am_cuda_fatal(kernel, "%s (%s) is %s but %s (%s) is %s: a kernel's activations and weights share one dtype "
                      "(fp32, or bf16 for mixed precision)", what, am_tname(t), am_dtype_name(t->dtype), refname,
                      am_tname(ref), am_dtype_name(ref->dtype));
}

void am_cuda_grad(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                  const struct am_tensor *ref)
{
    am_cuda_tensor(kernel, what, t);
    if (t->dtype == AM_F32 || (t->dtype == AM_BF16 && ref->dtype == AM_BF16))
        return;
    am_cuda_fatal(kernel, "%s (%s) is %s with %s (%s) %s: a parameter gradient is fp32, or bf16 when the activations "
                  "are bf16", what, am_tname(t), am_dtype_name(t->dtype), refname, am_tname(ref),
                  am_dtype_name(ref->dtype));
}

void am_cuda_stat(const char *kernel, const char *what, const struct am_tensor *t)
{
    am_cuda_tensor(kernel, what, t);
    if (t->dtype != AM_F32)
        am_cuda_fatal(kernel, "%s (%s) is %s; statistics saved for backward stay fp32, also with bf16 activations", what,
                      am_tname(t), am_dtype_name(t->dtype));
}

/* ---- the context ---- */

int am_cuda_open(struct am_dev *d, char *err, size_t err_len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        snprintf(err, err_len, "kernels (cuda): no CUDA device (cudaGetDeviceCount: %s)",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        cudaGetLastError(); /* clear the sticky error of the failed call */
        return -1;
    }
    if (d->ordinal < 0 || d->ordinal >= n) {
        snprintf(err, err_len, "kernels (cuda): device %d does not exist (this machine has %d: 0..%d)", d->ordinal, n,
                 n - 1);
        return -1;
    }
    const char *step = "cudaSetDevice";
    struct am_cuda_ctx *c = (struct am_cuda_ctx *)calloc(1, sizeof(*c));
    cudaStream_t s = NULL;
    cublasLtHandle_t h = NULL;
    if (!c) {
        snprintf(err, err_len, "kernels (cuda): out of host memory for the device context");
        return -1;
    }
    if ((e = cudaSetDevice(d->ordinal)) != cudaSuccess)
        goto fail;
    step = "cudaStreamCreateWithFlags";
    if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess)
        goto fail;
    step = "cudaMalloc (GEMM workspace)";
    if ((e = cudaMalloc(&c->gemm_ws, AM_CUDA_GEMM_WS_BYTES)) != cudaSuccess)
        goto fail;
    {
        cublasStatus_t bs = cublasLtCreate(&h);
        if (bs != CUBLAS_STATUS_SUCCESS) {
            snprintf(err, err_len, "kernels (cuda): device %d: cublasLtCreate: %s", d->ordinal, cublasLtGetStatusString(bs));
            cudaFree(c->gemm_ws);
            cudaStreamDestroy(s);
            free(c);
            return -1;
        }
    }
    d->stream = s;
    d->blas = h;
    d->workspace = c;
    d->workspace_bytes = AM_CUDA_GEMM_WS_BYTES;
    return 0;
fail:
    snprintf(err, err_len, "kernels (cuda): device %d: %s: %s", d->ordinal, step, cudaGetErrorString(e));
    cudaGetLastError();
    if (c->gemm_ws)
        cudaFree(c->gemm_ws);
    if (s)
        cudaStreamDestroy(s);
    free(c);
    return -1;
}

void am_cuda_close(struct am_dev *d)
{
    struct am_cuda_ctx *c = (struct am_cuda_ctx *)d->workspace;
    if (d->stream)
        cudaStreamSynchronize((cudaStream_t)d->stream);
#ifdef AM_HAVE_CUDNN
    am_cuda_attention_cudnn_close(d);
#endif
    if (c) {
        if (c->scratch)
            cudaFree(c->scratch);
        if (c->gemm_ws)
            cudaFree(c->gemm_ws);
        free(c);
    }
    if (d->blas)
        cublasLtDestroy((cublasLtHandle_t)d->blas);
    if (d->stream)
        cudaStreamDestroy((cudaStream_t)d->stream);
    d->workspace = NULL;
    d->blas = NULL;
    d->stream = NULL;
    d->workspace_bytes = 0;
}

void am_cuda_sync(const struct am_dev *d)
{
    am_cuda_ctx("am_cuda_sync", d);
    am_cuda_check("am_cuda_sync", cudaStreamSynchronize(am_cuda_stream(d)), "cudaStreamSynchronize");
}
