/* cuda.cu - the CUDA backend's context (open, close, sync), its device scratch, and the
 * checks every kernel uses (cuda_impl.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

/* Tells the fault hook (kernels.h), prints the message on stderr and aborts. */
[[noreturn]] static void fault_abort(enum am_dev_fault_kind kind, const char *kernel, const char *error,
                                     const char *fmt, va_list ap)
{
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    int dev = -1;
    if (cudaGetDevice(&dev) != cudaSuccess)
        dev = -1;
    struct am_dev_fault f = {};
    f.kind = kind;
    f.backend = "cuda";
    f.ordinal = dev;
    f.where = kernel;
    f.error = error ? error : "";
    f.message = msg;
    am_kernels_fault(&f);
    fprintf(stderr, "%s: %s\n", kernel, msg);
    fflush(stderr);
    abort();
}

void am_cuda_fatal(const char *kernel, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fault_abort(AM_DEV_FAULT_BUG, kernel, "", fmt, ap);
}

void am_cuda_device_error(const char *kernel, const char *error, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fault_abort(AM_DEV_FAULT_ERROR, kernel, error, fmt, ap);
}

void am_cuda_check(const char *kernel, cudaError_t e, const char *what)
{
    if (e != cudaSuccess)
        am_cuda_device_error(kernel, cudaGetErrorString(e), "CUDA error in %s: %s (%s)", what, cudaGetErrorString(e),
                             cudaGetErrorName(e));
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
        /* in stream order: the old scratch goes back to the pool after the kernels that use
         * it, which run on this stream before any later user of its block */
        if (c->scratch)
            am_cuda_pool_put(d, c->scratch);
        c->scratch = NULL;
        c->scratch_bytes = 0;
        c->scratch = am_cuda_pool_get(kernel, d, bytes);
        if (!c->scratch)
            am_cuda_fatal(kernel, "out of GPU memory for %zu bytes of scratch", bytes);
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
    {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, d->ordinal) == cudaSuccess) {
            snprintf(d->name, sizeof d->name, "%.95s", prop.name);
            d->cc_major = prop.major;
            d->cc_minor = prop.minor;
        }
        cudaGetLastError();
    }
    {
        size_t free_b = 0, total_b = 0;
        if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
            c->pool.total = total_b;
        cudaGetLastError();
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
        am_cuda_pool_release(c);
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
