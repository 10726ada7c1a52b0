/* common.cuh - what the CUDA backend's .cu files share: the context's state, the checks
 * (cuda.cu defines them), bf16 loads and stores, launch sizes. */
#ifndef AM_KERNELS_CUDA_COMMON_CUH
#define AM_KERNELS_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_impl.h"

/* ---- the context's state (d->workspace) ---- */
#define AM_CUDA_GEMM_WS_BYTES ((size_t)32 << 20)
#define AM_CUDA_GEMM_CACHE 64

struct am_cuda_gemm_key {
    int ta, tb;                  /* op(A), op(B) transposed */
    int64_t m, n, k, lda, ldb, ldc;
    int atype, ctype;            /* cudaDataType_t of A (= B) and of C (= D) */
    int beta_one;                /* beta 1 (accumulate) or 0 */
    int align;                   /* the pointers' common alignment, bytes (up to 16) */
};

struct am_cuda_gemm_entry {
    struct am_cuda_gemm_key key;
    cublasLtMatmulAlgo_t algo;
    bool used;
};

/* The caching allocator (memory.cu). Device memory comes from one arena reserved up front
 * (reserve: the plan's estimate for the rank) and, past it, from cudaMalloc one block at a
 * time; a freed block stays with the pool and serves the next request of its size class
 * (256 B steps below 1 MiB, 2 MiB steps above: a class wastes at most 2 MiB or 25 % of the
 * request, whichever less). Blocks are used on the context's stream (and the communication
 * streams that wait for it): a block freed on the host is reused by work enqueued after the
 * free on that stream, so in stream order; alloc (zeroed memory for any stream) waits for the
 * context's stream before it hands a block out. When cudaMalloc fails the pool serves the
 * request from the smallest free block that holds it, whatever that wastes; without one the
 * request fails: the fault hook hears AM_DEV_FAULT_OOM with what was asked and what the pool
 * holds. The pool gives nothing back to the device before close: cudaFree waits for the whole
 * device, a collective on a communication stream waiting for a peer included (a hang no
 * watchdog breaks), so it never runs while the context does. */
struct am_cuda_block {
    char *p;
    size_t size;           /* its size class */
    bool free;
    bool own;              /* cudaMalloc'ed alone (else carved from the arena) */
};

struct am_cuda_pool {
    char *arena;           /* reserved up front (NULL: none) */
    size_t arena_bytes, arena_used;
    struct am_cuda_block *blocks; /* every block made so far */
    size_t n, cap;
    size_t held;           /* arena + own blocks */
    size_t in_use, peak;   /* handed out, not freed */
    size_t total;          /* the device's memory (cudaMemGetInfo at open) */
};

struct am_cuda_ctx {
    void *gemm_ws;        /* cuBLASLt's workspace (d->workspace_bytes) */
    struct am_cuda_pool pool; /* device memory (alloc, free, scratch) */
    void *scratch;        /* device scratch from the pool, grown in stream order (am_cuda_scratch) */
    size_t scratch_bytes;
    struct am_cuda_gemm_entry gemm[AM_CUDA_GEMM_CACHE]; /* algorithm per shape, filled round robin */
    int gemm_next;
    void *attn;           /* attention_cudnn.cu's state (cuDNN handle, plans); NULL until used */
};

/* ---- checks (cuda.cu) ----
 * am_cuda_fatal: the caller's bug (a tensor of the wrong device, dtype or shape: the fault
 * hook hears AM_DEV_FAULT_BUG); am_cuda_device_error: the device or a library on it failed (a
 * CUDA call, cuBLASLt, cuDNN: AM_DEV_FAULT_ERROR, with error the library's text for it, which
 * the trainer records as a `cuda` cause). Both abort after telling the hook. */
[[noreturn]] void am_cuda_fatal(const char *kernel, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
[[noreturn]] void am_cuda_device_error(const char *kernel, const char *error, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* aborts naming the kernel, what failed and cudaGetErrorString(e) unless e is cudaSuccess */
void am_cuda_check(const char *kernel, cudaError_t e, const char *what);
/* after a launch: the launch's error, if any */
#define AM_LAUNCHED(kernel) am_cuda_check((kernel), cudaGetLastError(), "kernel launch")
/* the context's state and stream, after checking that d is an open CUDA context */
struct am_cuda_ctx *am_cuda_ctx(const char *kernel, const struct am_dev *d);
static inline cudaStream_t am_cuda_stream(const struct am_dev *d) { return (cudaStream_t)d->stream; }
/* The pool (memory.cu): get a block of at least bytes in stream order (not zeroed; NULL when
 * the device has no more, after telling the fault hook), put one back, give everything back
 * to the device (close). */
void *am_cuda_pool_get(const char *kernel, const struct am_dev *d, size_t bytes);
void am_cuda_pool_put(const struct am_dev *d, void *p);
void am_cuda_pool_release(struct am_cuda_ctx *c);
/* bytes of device scratch, valid in stream order until the next call that takes scratch */
void *am_cuda_scratch(const char *kernel, const struct am_dev *d, size_t bytes);

/* ---- GEMM on cuBLASLt (matmul.cu) ----
 * C[m,n] = op(A) op(B) + beta C, column-major (a row-major [r, c] matrix is a column-major
 * [c, r] one: matmul.cu shows the transposition), A and B of atype (f32 or bf16), C (= D,
 * in place) of ctype, compute fp32 (never TF32), beta 0 or 1; the algorithm is chosen once
 * per shape and cached in the context. Enqueued on d's stream. */
void am_cuda_gemm(const char *kernel, const struct am_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t kk,
                  const void *A, int64_t lda, const void *B, int64_t ldb, enum am_dtype atype, void *C, int64_t ldc,
                  enum am_dtype ctype, float beta);

/* ---- Gemma's RMSNorm on RMSNorm's kernels (rmsnorm.cu; gemma.cu calls them): the weight
 * 1 + w in fp32; k names the caller in argument errors ---- */
void am_cuda_rms_offset_forward(const char *k, const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd,
                                const struct am_tensor *x, const struct am_tensor *w, float eps);
void am_cuda_rms_offset_backward(const char *k, const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                                 const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                 const struct am_tensor *rstd);

static inline const char *am_tname(const struct am_tensor *t) { return t && t->name ? t->name : "(unnamed)"; }
static inline int64_t am_cols(const struct am_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }
static inline int64_t am_rows(const struct am_tensor *t)
{
    int64_t c = am_cols(t);
    return c ? am_tensor_numel(t) / c : 0;
}
/* A CUDA tensor with data (any dtype). */
void am_cuda_tensor(const char *kernel, const char *what, const struct am_tensor *t);
/* ... of this dtype; its data */
void *am_cuda_data(const char *kernel, const char *what, const struct am_tensor *t, enum am_dtype dtype);
/* ... one element of this dtype (a device scalar) */
void *am_cuda_scalar(const char *kernel, const char *what, const struct am_tensor *t, enum am_dtype dtype);
/* the dtype rules of kernels/cpu/cpu.h: an activation is f32 or bf16 (returned); same: t has
 * ref's dtype; grad: f32, or bf16 with bf16 activations; stat: f32 */
enum am_dtype am_cuda_act(const char *kernel, const char *what, const struct am_tensor *t);
void am_cuda_same(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                  const struct am_tensor *ref);
void am_cuda_grad(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                  const struct am_tensor *ref);
void am_cuda_stat(const char *kernel, const char *what, const struct am_tensor *t);
#define AM_CUDA_REQUIRE(kernel, cond, ...)                                                                           \
    do {                                                                                                             \
        if (!(cond))                                                                                                 \
            am_cuda_fatal((kernel), __VA_ARGS__);                                                                    \
    } while (0)

/* ---- bf16 storage, fp32 arithmetic ---- */
typedef uint16_t am_bf16_t;

__device__ __forceinline__ float am_ld(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float am_ld(const am_bf16_t *p, int64_t i) { return __uint_as_float((uint32_t)p[i] << 16); }
/* round to nearest even, NaN kept a quiet NaN: the CPU's am_f32_to_bf16 (half.h) bit for bit */
__device__ __forceinline__ am_bf16_t am_to_bf16(float f)
{
    uint32_t x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (am_bf16_t)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (am_bf16_t)(x >> 16);
}
/* f rounded to bf16 and widened back */
__device__ __forceinline__ float am_round_bf16(float f) { return __uint_as_float((uint32_t)am_to_bf16(f) << 16); }
__device__ __forceinline__ void am_st(float *p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void am_st(am_bf16_t *p, int64_t i, float v) { p[i] = am_to_bf16(v); }

/* ---- launches: grid-stride loops over n items ---- */
#define AM_THREADS 256
static inline unsigned am_blocks(int64_t n)
{
    int64_t b = (n + AM_THREADS - 1) / AM_THREADS;
    return (unsigned)(b < 1 ? 1 : b > 65536 ? 65536 : b);
}
#define AM_GRID_STRIDE(i, n)                                                                                         \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

#endif
