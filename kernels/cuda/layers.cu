/* layers.cu - the fused layer kernels: vocabulary-parallel embedding, RMSNorm (and Gemma's,
 * with the weight 1 + w), RoPE, SwiGLU and GeGLU, forward and backward, each computing what
 * its kernels/cpu/ counterpart computes (the formulas and the bf16 rounding points are
 * described there: rmsnorm.c, gemma.c, swiglu.c), in fp32.
 *
 * Determinism. The two reductions over tokens are done in a fixed order:
 *   - RMSNorm's dw: the rows are cut into RMS_SLABS fixed slabs, one fp32 partial row per
 *     slab (rows added in order), then one thread per column adds the partials in order to
 *     dw (rounded once when bf16);
 *   - the embedding backward: the in-shard tokens are sorted by row (CUB's radix sort,
 *     stable: each row's tokens stay in token order), then one block per row adds its
 *     tokens' gradients in token order onto the row, in fp32, rounding once: the CPU's
 *     order, so the result is the CPU's bit for bit. No atomics.
 */
#include <stdlib.h>

#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"

/* ================= embedding ================= */

template <typename T> __global__ void embed_fwd_k(T *out, const int32_t *ids, const T *wte, int64_t vocab_start, int64_t V,
                                                   int64_t N, int64_t C)
{
    AM_GRID_STRIDE(e, N * C)
    {
        int64_t i = e / C, c = e % C, r = (int64_t)ids[i] - vocab_start;
        out[e] = r >= 0 && r < V ? wte[r * C + c] : (T)0;
    }
}

void am_cuda_embedding_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *ids,
                               const struct am_tensor *wte, int64_t vocab_start)
{
    const char *k = "am_cuda_embedding_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "wte", wte);
    am_cuda_same(k, "out", out, "wte", wte);
    const int32_t *id = (const int32_t *)am_cuda_data(k, "ids", ids, AM_I32);
    AM_CUDA_REQUIRE(k, am_cols(out) == am_cols(wte), "out (%s) has rows of %lld, wte (%s) of %lld: both must be the hidden size",
                    am_tname(out), (long long)am_cols(out), am_tname(wte), (long long)am_cols(wte));
    AM_CUDA_REQUIRE(k, am_rows(out) == am_tensor_numel(ids), "out (%s) has %lld rows for %lld ids", am_tname(out),
                    (long long)am_rows(out), (long long)am_tensor_numel(ids));
    int64_t N = am_rows(out), C = am_cols(out), V = am_rows(wte);
    if (!N || !C)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        embed_fwd_k<<<am_blocks(N * C), AM_THREADS, 0, s>>>((uint32_t *)out->data, id, (const uint32_t *)wte->data,
                                                           vocab_start, V, N, C);
    else
        embed_fwd_k<<<am_blocks(N * C), AM_THREADS, 0, s>>>((am_bf16_t *)out->data, id, (const am_bf16_t *)wte->data,
                                                           vocab_start, V, N, C);
    AM_LAUNCHED(k);
}

/* key = the token's row in the shard, or V (sorted last, skipped) when out of the shard */
__global__ void embed_keys_k(uint32_t *key, int32_t *tok, const int32_t *ids, int64_t vocab_start, int64_t V, int64_t N)
{
    AM_GRID_STRIDE(i, N)
    {
        int64_t r = (int64_t)ids[i] - vocab_start;
        key[i] = (uint32_t)(r >= 0 && r < V ? r : V);
        tok[i] = (int32_t)i;
    }
}

/* one block per sorted position that starts a row's run; threads over the columns */
template <typename G, typename S>
__global__ void embed_bwd_k(G *dwte, const S *dout, const uint32_t *key, const int32_t *tok, int64_t V, int64_t N, int64_t C)
{
    for (int64_t p = blockIdx.x; p < N; p += gridDim.x) {
        uint32_t row = key[p];
        if (row >= (uint32_t)V || (p > 0 && key[p - 1] == row))
            continue;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = am_ld(dwte, (int64_t)row * C + c);
            for (int64_t q = p; q < N && key[q] == row; q++)
                acc += am_ld(dout, (int64_t)tok[q] * C + c);
            am_st(dwte, (int64_t)row * C + c, acc);
        }
    }
}

void am_cuda_embedding_backward(const struct am_dev *d, struct am_tensor *dwte, const struct am_tensor *dout,
                                const struct am_tensor *ids, int64_t vocab_start)
{
    const char *k = "am_cuda_embedding_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "dout", dout);
    am_cuda_grad(k, "dwte", dwte, "dout", dout);
    const int32_t *id = (const int32_t *)am_cuda_data(k, "ids", ids, AM_I32);
    AM_CUDA_REQUIRE(k, am_cols(dout) == am_cols(dwte), "dout (%s) has rows of %lld, dwte (%s) of %lld: both must be the hidden size",
                    am_tname(dout), (long long)am_cols(dout), am_tname(dwte), (long long)am_cols(dwte));
    AM_CUDA_REQUIRE(k, am_rows(dout) == am_tensor_numel(ids), "dout (%s) has %lld rows for %lld ids", am_tname(dout),
                    (long long)am_rows(dout), (long long)am_tensor_numel(ids));
    int64_t N = am_rows(dout), C = am_cols(dout), V = am_rows(dwte);
    AM_CUDA_REQUIRE(k, N < INT32_MAX && V < UINT32_MAX, "%lld tokens and %lld rows: the sort takes 32-bit keys", (long long)N,
                    (long long)V);
    if (!N || !C)
        return;
    cudaStream_t s = am_cuda_stream(d);
    int bits = 1;
    while (bits < 32 && ((uint64_t)1 << bits) <= (uint64_t)V)
        bits++;
    size_t tmp = 0;
    am_cuda_check(k, cub::DeviceRadixSort::SortPairs(NULL, tmp, (const uint32_t *)NULL, (uint32_t *)NULL,
                                                     (const int32_t *)NULL, (int32_t *)NULL, (int)N, 0, bits, s),
                  "cub::DeviceRadixSort::SortPairs (size)");
    size_t arr = ((size_t)N * 4 + 255) / 256 * 256;
    char *ws = (char *)am_cuda_scratch(k, d, 4 * arr + tmp);
    uint32_t *key_in = (uint32_t *)ws, *key_out = (uint32_t *)(ws + arr);
    int32_t *tok_in = (int32_t *)(ws + 2 * arr), *tok_out = (int32_t *)(ws + 3 * arr);
    embed_keys_k<<<am_blocks(N), AM_THREADS, 0, s>>>(key_in, tok_in, id, vocab_start, V, N);
    AM_LAUNCHED(k);
    am_cuda_check(k, cub::DeviceRadixSort::SortPairs(ws + 4 * arr, tmp, key_in, key_out, tok_in, tok_out, (int)N, 0, bits, s),
                  "cub::DeviceRadixSort::SortPairs");
    unsigned blocks = (unsigned)(N < 65536 ? N : 65536);
    if (dwte->dtype == AM_F32 && dt == AM_F32)
        embed_bwd_k<<<blocks, AM_THREADS, 0, s>>>((float *)dwte->data, (const float *)dout->data, key_out, tok_out, V, N, C);
    else if (dwte->dtype == AM_F32)
        embed_bwd_k<<<blocks, AM_THREADS, 0, s>>>((float *)dwte->data, (const am_bf16_t *)dout->data, key_out, tok_out, V, N, C);
    else
        embed_bwd_k<<<blocks, AM_THREADS, 0, s>>>((am_bf16_t *)dwte->data, (const am_bf16_t *)dout->data, key_out, tok_out, V,
                                                  N, C);
    AM_LAUNCHED(k);
}

/* ================= RMSNorm ================= */
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

void am_cuda_rmsnorm_offset_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd,
                                    const struct am_tensor *x, const struct am_tensor *w, float eps)
{
    rms_forward<true>("am_cuda_rmsnorm_offset_forward", d, out, rstd, x, w, eps);
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

void am_cuda_rmsnorm_offset_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                                     const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                     const struct am_tensor *rstd)
{
    rms_backward<true>("am_cuda_rmsnorm_offset_backward", d, dx, dw, dout, x, w, rstd);
}

/* ================= RoPE ================= */

void am_cuda_rope_tables(const struct am_dev *d, struct am_tensor *tcos, struct am_tensor *tsin, double theta,
                         const struct am_rope_scaling *scaling)
{
    const char *k = "am_cuda_rope_tables";
    am_cuda_ctx(k, d);
    am_cuda_data(k, "cos", tcos, AM_F32);
    am_cuda_data(k, "sin", tsin, AM_F32);
    int64_t T = am_rows(tcos), half = am_cols(tcos);
    AM_CUDA_REQUIRE(k, am_rows(tsin) == T && am_cols(tsin) == half, "cos (%s) and sin (%s) must both be [T, D/2]",
                    am_tname(tcos), am_tname(tsin));
    /* the CPU backend's tables, bit for bit: computed there on the host, then uploaded */
    size_t n = (size_t)(T * half);
    float *h = (float *)malloc(2 * (n ? n : 1) * sizeof(float));
    AM_CUDA_REQUIRE(k, h != NULL, "out of host memory for the tables (%zu floats)", 2 * n);
    struct am_tensor hc = am_tensor_view(h, AM_DEV_CPU, AM_F32, T, half, 0, 0);
    struct am_tensor hs = am_tensor_view(h + n, AM_DEV_CPU, AM_F32, T, half, 0, 0);
    hc.name = tcos->name;
    hs.name = tsin->name;
    am_kernels_cpu()->rope_tables(NULL, &hc, &hs, theta, scaling);
    cudaStream_t s = am_cuda_stream(d);
    am_cuda_check(k, cudaMemcpyAsync(tcos->data, h, n * sizeof(float), cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
    am_cuda_check(k, cudaMemcpyAsync(tsin->data, h + n, n * sizeof(float), cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
    am_cuda_check(k, cudaStreamSynchronize(s), "cudaStreamSynchronize"); /* before h is freed */
    free(h);
}

/* x [B, T, H, D]: one thread per (b, t, h, i < D/2) pair, rotated by sign * angle */
template <typename X, typename Tb>
__global__ void rope_k(X *x, const Tb *tc, const Tb *ts, int64_t T, int64_t H, int64_t half, int64_t pairs, float sign)
{
    AM_GRID_STRIDE(p, pairs)
    {
        int64_t i = p % half, rest = p / half, t = (rest / H) % T;
        X *x1 = x + rest * 2 * half;
        float a = am_ld(x1, i), b = am_ld(x1, i + half), c = am_ld(tc, t * half + i), s = sign * am_ld(ts, t * half + i);
        am_st(x1, i, a * c - b * s);
        am_st(x1, i + half, b * c + a * s);
    }
}

static void rope_apply(const char *k, const struct am_dev *d, struct am_tensor *x, const struct am_tensor *tcos,
                       const struct am_tensor *tsin, float sign)
{
    am_cuda_ctx(k, d);
    enum am_dtype xt = am_cuda_act(k, "x", x), ct = am_cuda_act(k, "cos", tcos);
    am_cuda_same(k, "sin", tsin, "cos", tcos);
    AM_CUDA_REQUIRE(k, xt == AM_BF16 || ct == AM_F32, "x (%s) is fp32 with bf16 tables: bf16 tables go with bf16 activations",
                    am_tname(x));
    AM_CUDA_REQUIRE(k, x->ndim == 4, "x (%s) must be [B, T, H, D], has %d dimensions", am_tname(x), x->ndim);
    int64_t T = x->shape[1], H = x->shape[2], D = x->shape[3], half = D / 2;
    AM_CUDA_REQUIRE(k, D % 2 == 0 && am_cols(tcos) == half && am_cols(tsin) == half,
                    "head size %lld must be even and the tables [T, %lld], they are [.., %lld]", (long long)D,
                    (long long)half, (long long)am_cols(tcos));
    AM_CUDA_REQUIRE(k, am_rows(tcos) >= T && am_rows(tsin) >= T, "the tables cover %lld positions, x (%s) has %lld",
                    (long long)am_rows(tcos), am_tname(x), (long long)T);
    int64_t pairs = am_tensor_numel(x) / 2;
    if (!pairs)
        return;
    cudaStream_t s = am_cuda_stream(d);
    unsigned g = am_blocks(pairs);
    if (xt == AM_F32)
        rope_k<<<g, AM_THREADS, 0, s>>>((float *)x->data, (const float *)tcos->data, (const float *)tsin->data, T, H, half,
                                        pairs, sign);
    else if (ct == AM_F32)
        rope_k<<<g, AM_THREADS, 0, s>>>((am_bf16_t *)x->data, (const float *)tcos->data, (const float *)tsin->data, T, H,
                                        half, pairs, sign);
    else
        rope_k<<<g, AM_THREADS, 0, s>>>((am_bf16_t *)x->data, (const am_bf16_t *)tcos->data,
                                        (const am_bf16_t *)tsin->data, T, H, half, pairs, sign);
    AM_LAUNCHED(k);
}

void am_cuda_rope_forward(const struct am_dev *d, struct am_tensor *x, const struct am_tensor *tcos, const struct am_tensor *tsin)
{
    rope_apply("am_cuda_rope_forward", d, x, tcos, tsin, 1.0f);
}

void am_cuda_rope_backward(const struct am_dev *d, struct am_tensor *dx, const struct am_tensor *tcos, const struct am_tensor *tsin)
{
    rope_apply("am_cuda_rope_backward", d, dx, tcos, tsin, -1.0f);
}

/* ================= SwiGLU and GeGLU ================= */

/* out = act(gate) * up; dup += dout * act(gate), dgate += dout * up * act'(gate) */
struct silu_op { /* SwiGLU: silu(g) = g * sigmoid(g) */
    __device__ static float f(float g) { return g / (1.0f + expf(-g)); }
    __device__ static float df(float g)
    {
        float sig = 1.0f / (1.0f + expf(-g));
        return sig * (1.0f + g * (1.0f - sig));
    }
};

#define GELU_BETA 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_KAPPA 0.044715f

struct gelu_tanh_op { /* GeGLU: torch's gelu(approximate="tanh") and its GeluBackward formula */
    __device__ static float f(float g)
    {
        float inner = GELU_BETA * (g + GELU_KAPPA * (g * g * g));
        return 0.5f * g * (1.0f + tanhf(inner));
    }
    __device__ static float df(float g)
    {
        float g2 = g * g, t = tanhf(GELU_BETA * (g + GELU_KAPPA * (g2 * g)));
        return 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * g2);
    }
};

template <class Op, typename T> __global__ void glu_fwd_k(T *out, const T *gate, const T *up, int64_t n)
{
    AM_GRID_STRIDE(i, n)
    am_st(out, i, Op::f(am_ld(gate, i)) * am_ld(up, i));
}

template <class Op, typename T>
__global__ void glu_bwd_k(T *dgate, T *dup, const T *dout, const T *gate, const T *up, int64_t n)
{
    AM_GRID_STRIDE(i, n)
    {
        float g = am_ld(gate, i), d = am_ld(dout, i);
        if (dup)
            am_st(dup, i, am_ld(dup, i) + d * Op::f(g));
        if (dgate)
            am_st(dgate, i, am_ld(dgate, i) + d * am_ld(up, i) * Op::df(g));
    }
}

static void glu_check(const char *k, const struct am_tensor *a, const struct am_tensor *gate, const struct am_tensor *up)
{
    if (am_tensor_numel(a) != am_tensor_numel(gate) || am_tensor_numel(up) != am_tensor_numel(gate))
        am_cuda_fatal(k, "gate (%s), up (%s) and %s must have the same shape (%lld, %lld, %lld elements)", am_tname(gate),
                      am_tname(up), am_tname(a), (long long)am_tensor_numel(gate), (long long)am_tensor_numel(up),
                      (long long)am_tensor_numel(a));
}

template <class Op>
static void glu_forward(const char *k, const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate,
                        const struct am_tensor *up)
{
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "gate", gate);
    am_cuda_same(k, "up", up, "gate", gate);
    am_cuda_same(k, "out", out, "gate", gate);
    glu_check(k, out, gate, up);
    int64_t n = am_tensor_numel(out);
    if (!n)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        glu_fwd_k<Op><<<am_blocks(n), AM_THREADS, 0, s>>>((float *)out->data, (const float *)gate->data,
                                                         (const float *)up->data, n);
    else
        glu_fwd_k<Op><<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)out->data, (const am_bf16_t *)gate->data,
                                                         (const am_bf16_t *)up->data, n);
    AM_LAUNCHED(k);
}

template <class Op>
static void glu_backward(const char *k, const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup,
                         const struct am_tensor *dout, const struct am_tensor *gate, const struct am_tensor *up)
{
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "gate", gate);
    am_cuda_same(k, "up", up, "gate", gate);
    am_cuda_same(k, "dout", dout, "gate", gate);
    if (dgate)
        am_cuda_same(k, "dgate", dgate, "gate", gate);
    if (dup)
        am_cuda_same(k, "dup", dup, "gate", gate);
    glu_check(k, dout, gate, up);
    AM_CUDA_REQUIRE(k, !dgate || am_tensor_numel(dgate) == am_tensor_numel(gate), "dgate (%s) must have gate's shape",
                    am_tname(dgate));
    AM_CUDA_REQUIRE(k, !dup || am_tensor_numel(dup) == am_tensor_numel(up), "dup (%s) must have up's shape", am_tname(dup));
    int64_t n = am_tensor_numel(dout);
    if (!n || (!dgate && !dup))
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        glu_bwd_k<Op><<<am_blocks(n), AM_THREADS, 0, s>>>(dgate ? (float *)dgate->data : NULL,
                                                         dup ? (float *)dup->data : NULL, (const float *)dout->data,
                                                         (const float *)gate->data, (const float *)up->data, n);
    else
        glu_bwd_k<Op><<<am_blocks(n), AM_THREADS, 0, s>>>(dgate ? (am_bf16_t *)dgate->data : NULL,
                                                         dup ? (am_bf16_t *)dup->data : NULL,
                                                         (const am_bf16_t *)dout->data, (const am_bf16_t *)gate->data,
                                                         (const am_bf16_t *)up->data, n);
    AM_LAUNCHED(k);
}

void am_cuda_swiglu_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up)
{
    glu_forward<silu_op>("am_cuda_swiglu_forward", d, out, gate, up);
}

void am_cuda_swiglu_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                             const struct am_tensor *gate, const struct am_tensor *up)
{
    glu_backward<silu_op>("am_cuda_swiglu_backward", d, dgate, dup, dout, gate, up);
}

void am_cuda_geglu_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up)
{
    glu_forward<gelu_tanh_op>("am_cuda_geglu_forward", d, out, gate, up);
}

void am_cuda_geglu_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                            const struct am_tensor *gate, const struct am_tensor *up)
{
    glu_backward<gelu_tanh_op>("am_cuda_geglu_backward", d, dgate, dup, dout, gate, up);
}
