/* rmsnorm.cu - RMSNorm, forward and backward, computing what kernels/cpu/rmsnorm.c computes
 * (the formula and the bf16 rounding points are described there), in fp32; its kernels also
 * run Gemma's RMSNorm with the weight 1 + w (gemma.cu, am_cuda_rms_offset_*).
 *
 * Determinism: dw's reduction over tokens is done in a fixed order: the rows are cut into
 * RMS_SLABS fixed slabs, one fp32 partial row per slab (rows added in order), then one thread
 * per column adds the partials in order to dw (rounded once when bf16). No atomics.
 */
#include "common.cuh"

#define RMS_THREADS 256
#define RMS_SLABS 64

template <typename R> __device__ static R block_sum_t(R *v, R x)
{
    v[threadIdx.x] = x;
    for (unsigned w = blockDim.x / 2; w > 0; w /= 2) {
        __syncthreads();
        if (threadIdx.x < w)
            v[threadIdx.x] += v[threadIdx.x + w];
    }
    __syncthreads();
    R r = v[0];
    __syncthreads();
    return r;
}

/* the weight of column j: w_j, or Gemma's 1 + w_j in fp32 (OFF) */
template <bool OFF, typename T> __device__ __forceinline__ float rms_w(const T *w, int64_t j)
{
    return OFF ? 1.0f + am_ld(w, j) : am_ld(w, j);
}

/* one block per row */
template <bool OFF, typename T>
__global__ void rms_fwd_k(T *out, float *rstd, const T *x, const T *w, float eps, int64_t N, int64_t C)
{
    __shared__ double v[RMS_THREADS];
    for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
        const T *xi = x + i * C;
        double ss = 0.0;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            double a = am_ld(xi, j);
            ss += a * a;
        }
        ss = block_sum_t(v, ss);
        float r = 1.0f / sqrtf((float)(ss / (double)C) + eps);
        if (threadIdx.x == 0)
            rstd[i] = r;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            float h = am_ld(xi, j) * r;
            if constexpr (!OFF && sizeof(T) == 2) /* transformers rounds Llama's hidden_states to bf16 before
                                                   * the weight; Gemma's norm stays in fp32 to the end */
                h = am_round_bf16(h);
            am_st(out + i * C, j, rms_w<OFF>(w, j) * h);
        }
    }
}

/* dx rows: one block per row */
template <bool OFF, typename T> __global__ void rms_bwd_dx_k(T *dx, const T *dout, const T *x, const T *w, const float *rstd, int64_t N,
                                                    int64_t C)
{
    __shared__ float v[RMS_THREADS];
    for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
        const T *di = dout + i * C, *xi = x + i * C;
        float dot = 0.0f;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
            dot += am_ld(di, j) * rms_w<OFF>(w, j) * am_ld(xi, j);
        dot = block_sum_t(v, dot);
        float r = rstd[i], c = dot * r * r / (float)C;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
            am_st(dx + i * C, j, am_ld(dx + i * C, j) + r * (am_ld(di, j) * rms_w<OFF>(w, j) - am_ld(xi, j) * c));
    }
}

/* dw partials: slab b sums rows [b*per, (b+1)*per) in order into part[b][c] */
template <typename T> __global__ void rms_bwd_dw_part_k(float *part, const T *dout, const T *x, const float *rstd, int64_t N,
                                                         int64_t C, int64_t per)
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

template <typename G> __global__ void rms_bwd_dw_sum_k(G *dw, const float *part, int64_t slabs, int64_t C)
{
    AM_GRID_STRIDE(c, C)
    {
        float acc = am_ld(dw, c);
        for (int64_t b = 0; b < slabs; b++)
            acc += part[b * C + c];
        am_st(dw, c, acc);
    }
}

static unsigned rows_grid(int64_t N) { return (unsigned)(N < 65536 ? (N > 0 ? N : 1) : 65536); }

template <bool OFF>
static void rms_forward(const char *k, const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd,
                        const struct am_tensor *x, const struct am_tensor *w, float eps)
{
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
        rms_fwd_k<OFF><<<rows_grid(N), RMS_THREADS, 0, s>>>((float *)out->data, (float *)rstd->data,
                                                            (const float *)x->data, (const float *)w->data, eps, N, C);
    else
        rms_fwd_k<OFF><<<rows_grid(N), RMS_THREADS, 0, s>>>((am_bf16_t *)out->data, (float *)rstd->data,
                                                            (const am_bf16_t *)x->data, (const am_bf16_t *)w->data, eps,
                                                            N, C);
    AM_LAUNCHED(k);
}

void am_cuda_rmsnorm_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                             const struct am_tensor *w, float eps)
{
    rms_forward<false>("am_cuda_rmsnorm_forward", d, out, rstd, x, w, eps);
}

template <bool OFF, typename T>
static void rms_backward_t(const char *k, const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                         const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                         const struct am_tensor *rstd, int64_t N, int64_t C)
{
    cudaStream_t s = am_cuda_stream(d);
    const T *dd = (const T *)dout->data, *xd = (const T *)x->data, *wd = (const T *)w->data;
    const float *r = (const float *)rstd->data;
    if (dx) {
        rms_bwd_dx_k<OFF><<<rows_grid(N), RMS_THREADS, 0, s>>>((T *)dx->data, dd, xd, wd, r, N, C);
        AM_LAUNCHED(k);
    }
    if (dw) {
        int64_t slabs = N < RMS_SLABS ? N : RMS_SLABS, per = (N + slabs - 1) / slabs;
        slabs = (N + per - 1) / per;
        float *part = (float *)am_cuda_scratch(k, d, (size_t)slabs * (size_t)C * sizeof(float));
        dim3 grid((unsigned)((C + AM_THREADS - 1) / AM_THREADS), (unsigned)slabs);
        rms_bwd_dw_part_k<<<grid, AM_THREADS, 0, s>>>(part, dd, xd, r, N, C, per);
        AM_LAUNCHED(k);
        if (dw->dtype == AM_F32)
            rms_bwd_dw_sum_k<<<am_blocks(C), AM_THREADS, 0, s>>>((float *)dw->data, part, slabs, C);
        else
            rms_bwd_dw_sum_k<<<am_blocks(C), AM_THREADS, 0, s>>>((am_bf16_t *)dw->data, part, slabs, C);
        AM_LAUNCHED(k);
    }
}

template <bool OFF>
static void rms_backward(const char *k, const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                         const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                         const struct am_tensor *rstd)
{
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
        rms_backward_t<OFF, float>(k, d, dx, dw, dout, x, w, rstd, N, C);
    else
        rms_backward_t<OFF, am_bf16_t>(k, d, dx, dw, dout, x, w, rstd, N, C);
}

void am_cuda_rmsnorm_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dout,
                              const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *rstd)
{
    rms_backward<false>("am_cuda_rmsnorm_backward", d, dx, dw, dout, x, w, rstd);
}

/* Gemma's RMSNorm (gemma.cu): the kernels above with the fp32 weight 1 + w */
void am_cuda_rms_offset_forward(const char *k, const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd,
                                const struct am_tensor *x, const struct am_tensor *w, float eps)
{
    rms_forward<true>(k, d, out, rstd, x, w, eps);
}

void am_cuda_rms_offset_backward(const char *k, const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                                 const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                 const struct am_tensor *rstd)
{
    rms_backward<true>(k, d, dx, dw, dout, x, w, rstd);
}
