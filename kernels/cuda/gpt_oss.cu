/* gpt_oss.cu - gpt-oss's attention sinks and clamped SwiGLU, computing what
 * kernels/cpu/gpt_oss.c computes, in fp32 (bf16 tensors widened per element, each output
 * rounded once). The sinks' backward runs one block per head, its rows summed in a fixed
 * order (a per-thread double in row order, then a tree over the block): deterministic.
 */
#include "glu.cuh"

template <typename X, typename S>
__global__ void sink_fwd_k(X *out, float *lse, const S *sinks, int64_t B, int64_t T, int64_t H, int64_t D)
{
    AM_GRID_STRIDE(r, B * H * T)
    {
        int64_t t = r % T, h = (r / T) % H, b = r / (T * H);
        float l = lse[r], s = am_ld(sinks, h), m = l > s ? l : s;
        float l2 = m + logf(expf(l - m) + expf(s - m)), f = expf(l - l2);
        X *o = out + ((b * T + t) * H + h) * D;
        for (int64_t i = 0; i < D; i++)
            am_st(o, i, am_ld(o, i) * f);
        lse[r] = l2;
    }
}

#define SINK_THREADS 256

template <typename X, typename S>
__global__ void sink_bwd_k(float *dsinks, const X *dout, const X *out, const float *lse, const S *sinks, int64_t B,
                           int64_t T, int64_t H, int64_t D)
{
    __shared__ double part[SINK_THREADS];
    int64_t h = blockIdx.x;
    float s = am_ld(sinks, h);
    double acc = 0.0;
    for (int64_t r = threadIdx.x; r < B * T; r += SINK_THREADS) {
        int64_t b = r / T, t = r % T, o = ((b * T + t) * H + h) * D;
        float dot = 0.0f;
        for (int64_t i = 0; i < D; i++)
            dot += am_ld(dout, o + i) * am_ld(out, o + i);
        acc += (double)(expf(s - lse[(b * H + h) * T + t]) * dot);
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int w = SINK_THREADS / 2; w > 0; w /= 2) {
        if ((int)threadIdx.x < w)
            part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        dsinks[h] -= (float)part[0];
}

static void check_sink(const char *k, const struct am_dev *d, const struct am_tensor *out, const struct am_tensor *lse,
                       const struct am_tensor *sinks)
{
    am_cuda_ctx(k, d);
    am_cuda_act(k, "out", out);
    am_cuda_data(k, "lse", lse, AM_F32);
    am_cuda_act(k, "sinks", sinks);
    AM_CUDA_REQUIRE(k, out->ndim == 4, "out (%s) must be [B, T, H, D], has %d dimensions", am_tname(out), out->ndim);
    int64_t B = out->shape[0], T = out->shape[1], H = out->shape[2];
    AM_CUDA_REQUIRE(k, am_tensor_numel(lse) == B * H * T, "lse (%s) must be [B, H, T] = %lld values, has %lld",
                    am_tname(lse), (long long)(B * H * T), (long long)am_tensor_numel(lse));
    AM_CUDA_REQUIRE(k, am_tensor_numel(sinks) == H, "sinks (%s) must hold one value per head (%lld), has %lld",
                    am_tname(sinks), (long long)H, (long long)am_tensor_numel(sinks));
}

template <typename X>
static void sink_fwd(cudaStream_t st, struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *sinks, int64_t B,
                     int64_t T, int64_t H, int64_t D)
{
    int64_t n = B * H * T;
    if (sinks->dtype == AM_F32)
        sink_fwd_k<<<am_blocks(n), AM_THREADS, 0, st>>>((X *)out->data, (float *)lse->data,
                                                        (const float *)sinks->data, B, T, H, D);
    else
        sink_fwd_k<<<am_blocks(n), AM_THREADS, 0, st>>>((X *)out->data, (float *)lse->data,
                                                        (const am_bf16_t *)sinks->data, B, T, H, D);
}

void am_cuda_attention_sink_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                    const struct am_tensor *sinks)
{
    const char *k = "am_cuda_attention_sink_forward";
    check_sink(k, d, out, lse, sinks);
    int64_t B = out->shape[0], T = out->shape[1], H = out->shape[2], D = out->shape[3];
    if (B * T * H == 0)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (out->dtype == AM_F32)
        sink_fwd<float>(s, out, lse, sinks, B, T, H, D);
    else
        sink_fwd<am_bf16_t>(s, out, lse, sinks, B, T, H, D);
    AM_LAUNCHED(k);
}

template <typename X>
static void sink_bwd(cudaStream_t st, struct am_tensor *dsinks, const struct am_tensor *dout, const struct am_tensor *out,
                     const struct am_tensor *lse, const struct am_tensor *sinks, int64_t B, int64_t T, int64_t H, int64_t D)
{
    if (sinks->dtype == AM_F32)
        sink_bwd_k<<<(unsigned)H, SINK_THREADS, 0, st>>>((float *)dsinks->data, (const X *)dout->data,
                                                         (const X *)out->data, (const float *)lse->data,
                                                         (const float *)sinks->data, B, T, H, D);
    else
        sink_bwd_k<<<(unsigned)H, SINK_THREADS, 0, st>>>((float *)dsinks->data, (const X *)dout->data,
                                                         (const X *)out->data, (const float *)lse->data,
                                                         (const am_bf16_t *)sinks->data, B, T, H, D);
}

void am_cuda_attention_sink_backward(const struct am_dev *d, struct am_tensor *dsinks, const struct am_tensor *dout,
                                     const struct am_tensor *out, const struct am_tensor *lse,
                                     const struct am_tensor *sinks)
{
    const char *k = "am_cuda_attention_sink_backward";
    check_sink(k, d, out, lse, sinks);
    am_cuda_same(k, "dout", dout, "out", out);
    am_cuda_data(k, "dsinks", dsinks, AM_F32);
    int64_t B = out->shape[0], T = out->shape[1], H = out->shape[2], D = out->shape[3];
    AM_CUDA_REQUIRE(k, am_tensor_numel(dout) == am_tensor_numel(out) && am_tensor_numel(dsinks) == H,
                    "dout (%s) must have out's shape and dsinks (%s) one value per head (%lld)", am_tname(dout),
                    am_tname(dsinks), (long long)H);
    if (!H)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (out->dtype == AM_F32)
        sink_bwd<float>(s, dsinks, dout, out, lse, sinks, B, T, H, D);
    else
        sink_bwd<am_bf16_t>(s, dsinks, dout, out, lse, sinks, B, T, H, D);
    AM_LAUNCHED(k);
}

/* ---- the clamped SwiGLU ---- */

template <typename T>
__global__ void clamped_fwd_k(T *out, const T *gate, const T *up, int64_t n, float alpha, float limit)
{
    AM_GRID_STRIDE(i, n)
    {
        float g = am_ld(gate, i), u = am_ld(up, i);
        g = g > limit ? limit : g;
        u = u > limit ? limit : u < -limit ? -limit : u;
        float ag = g * alpha, sig = 1.0f / (1.0f + expf(-ag)), glu = g * sig, u1 = u + 1.0f;
        am_st(out, i, u1 * glu);
    }
}

template <typename T>
__global__ void clamped_bwd_k(T *dgate, T *dup, const T *dout, const T *gate, const T *up, int64_t n, float alpha,
                              float limit)
{
    AM_GRID_STRIDE(i, n)
    {
        float g0 = am_ld(gate, i), u0 = am_ld(up, i), dy = am_ld(dout, i);
        float g = g0 > limit ? limit : g0, u = u0 > limit ? limit : u0 < -limit ? -limit : u0;
        float ag = g * alpha, sig = 1.0f / (1.0f + expf(-ag)), glu = g * sig;
        if (dgate && g0 <= limit)
            am_st(dgate, i, am_ld(dgate, i) + dy * (u + 1.0f) * (sig + ag * (sig * (1.0f - sig))));
        if (dup && u0 >= -limit && u0 <= limit)
            am_st(dup, i, am_ld(dup, i) + dy * glu);
    }
}

void am_cuda_swiglu_clamped_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate,
                                    const struct am_tensor *up, float alpha, float limit)
{
    const char *k = "am_cuda_swiglu_clamped_forward";
    am_cuda_ctx(k, d);
    glu_check(k, "out", out, gate, up);
    int64_t n = am_tensor_numel(out);
    if (!n)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (gate->dtype == AM_F32)
        clamped_fwd_k<<<am_blocks(n), AM_THREADS, 0, s>>>((float *)out->data, (const float *)gate->data,
                                                          (const float *)up->data, n, alpha, limit);
    else
        clamped_fwd_k<<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)out->data, (const am_bf16_t *)gate->data,
                                                          (const am_bf16_t *)up->data, n, alpha, limit);
    AM_LAUNCHED(k);
}

void am_cuda_swiglu_clamped_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup,
                                     const struct am_tensor *dout, const struct am_tensor *gate,
                                     const struct am_tensor *up, float alpha, float limit)
{
    const char *k = "am_cuda_swiglu_clamped_backward";
    am_cuda_ctx(k, d);
    glu_check(k, "dout", dout, gate, up);
    glu_grads_check(k, dgate, dup, gate, up);
    int64_t n = am_tensor_numel(dout);
    if (!n || (!dgate && !dup))
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (gate->dtype == AM_F32)
        clamped_bwd_k<<<am_blocks(n), AM_THREADS, 0, s>>>(dgate ? (float *)dgate->data : NULL,
                                                          dup ? (float *)dup->data : NULL, (const float *)dout->data,
                                                          (const float *)gate->data, (const float *)up->data, n,
                                                          alpha, limit);
    else
        clamped_bwd_k<<<am_blocks(n), AM_THREADS, 0, s>>>(dgate ? (am_bf16_t *)dgate->data : NULL,
                                                          dup ? (am_bf16_t *)dup->data : NULL,
                                                          (const am_bf16_t *)dout->data, (const am_bf16_t *)gate->data,
                                                          (const am_bf16_t *)up->data, n, alpha, limit);
    AM_LAUNCHED(k);
}
