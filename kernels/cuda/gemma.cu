/* gemma.cu - the layers Gemma 2 and Gemma 3 add (kernels.h): RMSNorm with the weight 1 + w
 * and GeGLU, forward and backward, computing what kernels/cpu/gemma.c computes, in fp32:
 *   rmsnorm_offset: out = (x * rstd) * (1 + w), (1 + w) in fp32, the output rounded once;
 *     backward as layers.cu's RMSNorm with the weight 1 + w (dw in RMS_SLABS fixed slabs,
 *     rows in order, then the slabs in order: deterministic);
 *   geglu: out = gelu_tanh(gate) * up and its backward (torch's tanh-approximate GELU).
 */
#include "common.cuh"

#define GM_THREADS 256
#define GM_SLABS 64

__device__ static float gm_block_sum(float *v, float x)
{
    v[threadIdx.x] = x;
    for (unsigned w = blockDim.x / 2; w > 0; w /= 2) {
        __syncthreads();
        if (threadIdx.x < w)
            v[threadIdx.x] += v[threadIdx.x + w];
    }
    __syncthreads();
    float r = v[0];
    __syncthreads();
    return r;
}

__device__ static double gm_block_sum_d(double *v, double x)
{
    v[threadIdx.x] = x;
    for (unsigned w = blockDim.x / 2; w > 0; w /= 2) {
        __syncthreads();
        if (threadIdx.x < w)
            v[threadIdx.x] += v[threadIdx.x + w];
    }
    __syncthreads();
    double r = v[0];
    __syncthreads();
    return r;
}

/* one block per row */
template <typename T>
__global__ void rmso_fwd_k(T *out, float *rstd, const T *x, const T *w, float eps, int64_t N, int64_t C)
{
    __shared__ double v[GM_THREADS];
    for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
        const T *xi = x + i * C;
        double ss = 0.0;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            double a = am_ld(xi, j);
            ss += a * a;
        }
        ss = gm_block_sum_d(v, ss);
        float r = 1.0f / sqrtf((float)(ss / (double)C) + eps);
        if (threadIdx.x == 0)
            rstd[i] = r;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
            am_st(out + i * C, j, (am_ld(xi, j) * r) * (1.0f + am_ld(w, j)));
    }
}

template <typename T>
__global__ void rmso_bwd_dx_k(T *dx, const T *dout, const T *x, const T *w, const float *rstd, int64_t N, int64_t C)
{
    __shared__ float v[GM_THREADS];
    for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
        const T *di = dout + i * C, *xi = x + i * C;
        float dot = 0.0f;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
            dot += am_ld(di, j) * (1.0f + am_ld(w, j)) * am_ld(xi, j);
        dot = gm_block_sum(v, dot);
        float r = rstd[i], c = dot * r * r / (float)C;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
            am_st(dx + i * C, j, am_ld(dx + i * C, j) + r * (am_ld(di, j) * (1.0f + am_ld(w, j)) - am_ld(xi, j) * c));
    }
}

template <typename T>
__global__ void rmso_dw_part_k(float *part, const T *dout, const T *x, const float *rstd, int64_t N, int64_t C, int64_t per)
{
    int64_t b = blockIdx.y, r0 = b * per, r1 = r0 + per < N ? r0 + per : N;
    AM_GRID_STRIDE(c, C)
    {
        float acc = 0.0f;
        for (int64_t i = r0; i < r1; i++)
            acc += am_ld(dout, i * C + c) * (am_ld(x, i * C + c) * rstd[i]);
        part[b * C + c] = acc;
    }
}

template <typename G> __global__ void rmso_dw_sum_k(G *dw, const float *part, int64_t slabs, int64_t C)
{
    AM_GRID_STRIDE(c, C)
    {
        float acc = am_ld(dw, c);
        for (int64_t b = 0; b < slabs; b++)
            acc += part[b * C + c];
        am_st(dw, c, acc);
    }
}

static unsigned gm_rows_grid(int64_t N) { return (unsigned)(N < 65536 ? (N > 0 ? N : 1) : 65536); }

void am_cuda_rmsnorm_offset_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd,
                                    const struct am_tensor *x, const struct am_tensor *w, float eps)
{
    const char *k = "am_cuda_rmsnorm_offset_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "x", x);
    am_cuda_same(k, "w", w, "x", x);
    am_cuda_same(k, "out", out, "x", x);
    am_cuda_stat(k, "rstd", rstd);
    int64_t N = am_rows(x), C = am_cols(x);
    AM_CUDA_REQUIRE(k, am_tensor_numel(w) == C, "w (%s) has %lld elements for rows of %lld", am_tname(w),
                    (long long)am_tensor_numel(w), (long long)C);
    AM_CUDA_REQUIRE(k, am_tensor_numel(out) == N * C, "out (%s) must have x's shape", am_tname(out));
    AM_CUDA_REQUIRE(k, am_tensor_numel(rstd) == N, "rstd (%s) has %lld elements for %lld rows", am_tname(rstd),
                    (long long)am_tensor_numel(rstd), (long long)N);
    if (!N)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        rmso_fwd_k<<<gm_rows_grid(N), GM_THREADS, 0, s>>>((float *)out->data, (float *)rstd->data, (const float *)x->data,
                                                          (const float *)w->data, eps, N, C);
    else
        rmso_fwd_k<<<gm_rows_grid(N), GM_THREADS, 0, s>>>((am_bf16_t *)out->data, (float *)rstd->data,
                                                          (const am_bf16_t *)x->data, (const am_bf16_t *)w->data, eps, N, C);
    AM_LAUNCHED(k);
}

template <typename T>
static void rmso_backward(const char *k, const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                          const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                          const struct am_tensor *rstd, int64_t N, int64_t C)
{
    cudaStream_t s = am_cuda_stream(d);
    const T *dd = (const T *)dout->data, *xd = (const T *)x->data, *wd = (const T *)w->data;
    const float *r = (const float *)rstd->data;
    if (dx) {
        rmso_bwd_dx_k<<<gm_rows_grid(N), GM_THREADS, 0, s>>>((T *)dx->data, dd, xd, wd, r, N, C);
        AM_LAUNCHED(k);
    }
    if (dw) {
        int64_t slabs = N < GM_SLABS ? N : GM_SLABS, per = (N + slabs - 1) / slabs;
        slabs = (N + per - 1) / per;
        float *part = (float *)am_cuda_scratch(k, d, (size_t)slabs * (size_t)C * sizeof(float));
        dim3 grid((unsigned)((C + AM_THREADS - 1) / AM_THREADS), (unsigned)slabs);
        rmso_dw_part_k<<<grid, AM_THREADS, 0, s>>>(part, dd, xd, r, N, C, per);
        AM_LAUNCHED(k);
        if (dw->dtype == AM_F32)
            rmso_dw_sum_k<<<am_blocks(C), AM_THREADS, 0, s>>>((float *)dw->data, part, slabs, C);
        else
            rmso_dw_sum_k<<<am_blocks(C), AM_THREADS, 0, s>>>((am_bf16_t *)dw->data, part, slabs, C);
        AM_LAUNCHED(k);
    }
}

void am_cuda_rmsnorm_offset_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                                     const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                     const struct am_tensor *rstd)
{
    const char *k = "am_cuda_rmsnorm_offset_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "x", x);
    am_cuda_same(k, "w", w, "x", x);
    am_cuda_same(k, "dout", dout, "x", x);
    am_cuda_stat(k, "rstd", rstd);
    if (dx)
        am_cuda_same(k, "dx", dx, "x", x);
    if (dw)
        am_cuda_grad(k, "dw", dw, "x", x);
    int64_t N = am_rows(x), C = am_cols(x);
    AM_CUDA_REQUIRE(k, am_tensor_numel(w) == C && am_tensor_numel(rstd) == N && am_tensor_numel(dout) == N * C,
                    "w (%s) must be [%lld], rstd [%lld] and dout x's shape", am_tname(w), (long long)C, (long long)N);
    AM_CUDA_REQUIRE(k, !dx || am_tensor_numel(dx) == N * C, "dx (%s) must have x's shape", am_tname(dx));
    AM_CUDA_REQUIRE(k, !dw || am_tensor_numel(dw) == C, "dw (%s) must have w's shape", am_tname(dw));
    if (!N || !C)
        return;
    if (dt == AM_F32)
        rmso_backward<float>(k, d, dx, dw, dout, x, w, rstd, N, C);
    else
        rmso_backward<am_bf16_t>(k, d, dx, dw, dout, x, w, rstd, N, C);
}

/* ================= GeGLU ================= */

#define GELU_BETA 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_KAPPA 0.044715f

__device__ __forceinline__ float gm_gelu(float g)
{
    float inner = GELU_BETA * (g + GELU_KAPPA * (g * g * g));
    return 0.5f * g * (1.0f + tanhf(inner));
}

__device__ __forceinline__ float gm_gelu_grad(float g)
{
    float g2 = g * g, t = tanhf(GELU_BETA * (g + GELU_KAPPA * (g2 * g)));
    return 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * g2);
}

template <typename T> __global__ void geglu_fwd_k(T *out, const T *gate, const T *up, int64_t n)
{
    AM_GRID_STRIDE(i, n)
    am_st(out, i, gm_gelu(am_ld(gate, i)) * am_ld(up, i));
}

template <typename T> __global__ void geglu_bwd_k(T *dgate, T *dup, const T *dout, const T *gate, const T *up, int64_t n)
{
    AM_GRID_STRIDE(i, n)
    {
        float g = am_ld(gate, i), dv = am_ld(dout, i);
        if (dup)
            am_st(dup, i, am_ld(dup, i) + dv * gm_gelu(g));
        if (dgate)
            am_st(dgate, i, am_ld(dgate, i) + dv * am_ld(up, i) * gm_gelu_grad(g));
    }
}

static void geglu_check(const char *k, const struct am_tensor *a, const struct am_tensor *gate, const struct am_tensor *up)
{
    if (am_tensor_numel(a) != am_tensor_numel(gate) || am_tensor_numel(up) != am_tensor_numel(gate))
        am_cuda_fatal(k, "gate (%s), up (%s) and %s must have the same shape (%lld, %lld, %lld elements)", am_tname(gate),
                      am_tname(up), am_tname(a), (long long)am_tensor_numel(gate), (long long)am_tensor_numel(up),
                      (long long)am_tensor_numel(a));
}

void am_cuda_geglu_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up)
{
    const char *k = "am_cuda_geglu_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "gate", gate);
    am_cuda_same(k, "up", up, "gate", gate);
    am_cuda_same(k, "out", out, "gate", gate);
    geglu_check(k, out, gate, up);
    int64_t n = am_tensor_numel(out);
    if (!n)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        geglu_fwd_k<<<am_blocks(n), AM_THREADS, 0, s>>>((float *)out->data, (const float *)gate->data,
                                                       (const float *)up->data, n);
    else
        geglu_fwd_k<<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)out->data, (const am_bf16_t *)gate->data,
                                                       (const am_bf16_t *)up->data, n);
    AM_LAUNCHED(k);
}

void am_cuda_geglu_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                            const struct am_tensor *gate, const struct am_tensor *up)
{
    const char *k = "am_cuda_geglu_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "gate", gate);
    am_cuda_same(k, "up", up, "gate", gate);
    am_cuda_same(k, "dout", dout, "gate", gate);
    if (dgate)
        am_cuda_same(k, "dgate", dgate, "gate", gate);
    if (dup)
        am_cuda_same(k, "dup", dup, "gate", gate);
    geglu_check(k, dout, gate, up);
    AM_CUDA_REQUIRE(k, !dgate || am_tensor_numel(dgate) == am_tensor_numel(gate), "dgate (%s) must have gate's shape",
                    am_tname(dgate));
    AM_CUDA_REQUIRE(k, !dup || am_tensor_numel(dup) == am_tensor_numel(up), "dup (%s) must have up's shape", am_tname(dup));
    int64_t n = am_tensor_numel(dout);
    if (!n || (!dgate && !dup))
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        geglu_bwd_k<<<am_blocks(n), AM_THREADS, 0, s>>>(dgate ? (float *)dgate->data : NULL, dup ? (float *)dup->data : NULL,
                                                       (const float *)dout->data, (const float *)gate->data,
                                                       (const float *)up->data, n);
    else
        geglu_bwd_k<<<am_blocks(n), AM_THREADS, 0, s>>>(dgate ? (am_bf16_t *)dgate->data : NULL,
                                                       dup ? (am_bf16_t *)dup->data : NULL, (const am_bf16_t *)dout->data,
                                                       (const am_bf16_t *)gate->data, (const am_bf16_t *)up->data, n);
    AM_LAUNCHED(k);
}
