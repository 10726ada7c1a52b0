/* rope.cu - rotary position embeddings, the tables and their application forward and
 * backward, computing what kernels/cpu/rope.c computes (the tables are the CPU's, bit for bit:
 * computed there on the host and uploaded), in fp32.
 */
#include <stdlib.h>

#include "common.cuh"

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

/* x [B, T, H, D]: one thread per (b, t, h, i < half) pair, rotated by sign * angle; half = D/2,
 * or R/2 for partial rotary (the first R dims of each head rotated, the rest left) */
template <typename X, typename Tb>
__global__ void rope_k(X *x, const Tb *tc, const Tb *ts, int64_t T, int64_t H, int64_t D, int64_t half, int64_t pairs,
                       float sign)
{
    AM_GRID_STRIDE(p, pairs)
    {
        int64_t i = p % half, rest = p / half, t = (rest / H) % T;
        X *x1 = x + rest * D;
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
    int64_t T = x->shape[1], H = x->shape[2], D = x->shape[3], half = am_cols(tcos);
    AM_CUDA_REQUIRE(k, D % 2 == 0 && half >= 1 && half <= D / 2 && am_cols(tsin) == half,
                    "head size %lld must be even and the tables [T, R/2] with R <= %lld, they are [.., %lld] and "
                    "[.., %lld]", (long long)D, (long long)D, (long long)half, (long long)am_cols(tsin));
    AM_CUDA_REQUIRE(k, am_rows(tcos) >= T && am_rows(tsin) >= T, "the tables cover %lld positions, x (%s) has %lld",
                    (long long)am_rows(tcos), am_tname(x), (long long)T);
    int64_t pairs = am_tensor_numel(x) / D * half;
    if (!pairs)
        return;
    cudaStream_t s = am_cuda_stream(d);
    unsigned g = am_blocks(pairs);
    if (xt == AM_F32)
        rope_k<<<g, AM_THREADS, 0, s>>>((float *)x->data, (const float *)tcos->data, (const float *)tsin->data, T, H, D,
                                        half, pairs, sign);
    else if (ct == AM_F32)
        rope_k<<<g, AM_THREADS, 0, s>>>((am_bf16_t *)x->data, (const float *)tcos->data, (const float *)tsin->data, T, H,
                                        D, half, pairs, sign);
    else
        rope_k<<<g, AM_THREADS, 0, s>>>((am_bf16_t *)x->data, (const am_bf16_t *)tcos->data,
                                        (const am_bf16_t *)tsin->data, T, H, D, half, pairs, sign);
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
