/* attention.cu - causal grouped-query attention, forward and backward: the backend's own
 * kernels (the reference and the fallback), and the choice between them and cuDNN's fused
 * attention (attention_cudnn.cu, in builds with cuDNN).
 *
 * Semantics: kernels/cpu/attention.c's (kernels.h has the contract). q [B, T, H, D],
 * k [B, T, KVH, D]; v [B, T, KVH, DV], out [B, T, H, DV] (DV: v's head width, D's or another:
 * multi-head latent attention's); query head h reads kv head h / (H / KVH); scale = 1/sqrt(D) (Gemma's
 * attention_softcap: the scale given, and each scaled score capped to cap * tanh(s / cap)
 * before the softmax, its backward times 1 - tanh²; cuDNN is not asked for those); the
 * query at t sees the keys lo_t <= j <= t, lo_t = 0, or t - W + 1 with a window of W keys;
 * lse [B, H, T] = m + log Σ_j exp(s_j - m) over the scaled scores s_j, natural log.
 * bf16 tensors are computed on in fp32 and each output is rounded once (FlashAttention's
 * semantics, the CPU kernel's); backward adds its fp32 sums onto dq, dk, dv and rounds once.
 *
 * Flash-attention tiling, fp32 on the CUDA cores (no tensor cores: the reference, not the
 * fast path), never more than a tile of scores in memory. A block has 8 warps; tiles of
 * 32 rows live in shared memory as fp32 with an odd row stride (D | 1, v's and dout's DV | 1), so that 32 lanes
 * reading 32 rows at one column hit 32 banks.
 *   - forward: a block takes 32 query rows of one (batch, head), 4 rows per warp, and walks
 *     the tiles of 32 keys its rows see (from the first row's window start to its last
 *     row). A lane computes the scores of one key for its warp's 4 rows, the online
 *     softmax updates each row's max and sum by warp shuffles, and the output rows
 *     (lane: head dims lane, lane + 32, ...) accumulate p · v in registers.
 *   - backward, three kernels: (1) Dt = dout_t · out_t per row ([B, H, T] fp32 in the
 *     context's scratch); (2) dk, dv: a block owns 32 keys of one (batch, kv head), 4 per
 *     warp, and walks every query head of its group and every tile of 32 queries that sees
 *     its keys (a lane: one query row), recomputing p = exp(s - lse) and
 *     ds = p (dp - Dt) scale, summing dv_j += p dout_t and dk_j += ds q_t in registers;
 *     (3) dq: a block takes 32 query rows as the forward does and sums dq_t += ds k_j over
 *     the key tiles. Each gradient element has one writer and sums its terms in a fixed
 *     order (heads, then tiles, then rows or keys in order): no atomics, run to run the
 *     same bits.
 * Head sizes up to 256 (registers per lane: ceil(max(D, DV) / 32) per row); 64 and 128 fill the lanes.
 *
 * Which path (attention_forward and attention_backward choose per call): AM_ATTN=own runs
 * these kernels; AM_ATTN=cudnn (the default in a build with cuDNN) runs cuDNN's fused
 * attention where it has the case (attention_cudnn.cu says which) and these kernels for the
 * others. The lse of either path is the same number, so a forward on one and a backward on
 * the other agree.
 */
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

#define ATT_WARPS 8
#define ATT_THREADS (ATT_WARPS * 32)
#define ATT_RPW 4                     /* query rows (forward, dq) or keys (dk, dv) per warp */
#define ATT_BQ (ATT_WARPS * ATT_RPW)  /* rows of a block: 32 */
#define ATT_BK 32                     /* keys of a tile (forward, dq) or queries of a tile (dk, dv): one per lane */
#define ATT_MAX_D 256
#define FULL 0xffffffffu

struct att_shape {
    int64_t B, T, H, KVH, D, DV; /* DV: v's and out's head width */
    float scale;
    float cap; /* Gemma 2's attn_logit_softcapping (0: none) */
};

/* A scaled score through Gemma's cap: cap * tanh(a / cap) (transformers' order), a itself
 * without one. */
__device__ __forceinline__ float att_capped(float a, float cap) { return cap > 0.0f ? tanhf(a / cap) * cap : a; }
/* The cap's derivative at a: 1 - tanh²(a / cap), 1 without one. */
__device__ __forceinline__ float att_cap_grad(float a, float cap)
{
    if (cap <= 0.0f)
        return 1.0f;
    float th = tanhf(a / cap);
    return 1.0f - th * th;
}

__device__ __forceinline__ bool att_visible(int64_t t, int64_t j, int64_t W) { return j <= t && (W <= 0 || j > t - W); }
__host__ __device__ __forceinline__ int64_t att_first_key(int64_t t, int64_t W) { return W > 0 && t - W + 1 > 0 ? t - W + 1 : 0; }

__device__ __forceinline__ float warp_max(float x)
{
    for (int o = 16; o > 0; o /= 2)
        x = fmaxf(x, __shfl_xor_sync(FULL, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o /= 2)
        x += __shfl_xor_sync(FULL, x, o);
    return x;
}

/* dst[r * ld + d] = src[(row0 + r) * stride + d] widened, for r < nvalid (0 for the rows
 * nvalid .. rows - 1); src points at the head's first element of row 0. */
template <typename T>
__device__ __forceinline__ void load_tile(float *dst, int ld, const T *src, int64_t row0, int nvalid, int rows, int64_t stride,
                                          int D)
{
    for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
        int r = i / D, d = i - r * D;
        dst[r * ld + d] = r < nvalid ? am_ld(src, (row0 + r) * stride + d) : 0.0f;
    }
}

/* ================= forward ================= */

template <typename T, int NT>
__global__ void __launch_bounds__(ATT_THREADS) attn_fwd_k(T *out, float *lse, const T *q, const T *k, const T *v, int64_t Tn,
                                                          int64_t H, int64_t KVH, int D, int DV, int64_t W, float scale,
                                                          float cap)
{
    extern __shared__ float sm[];
    const int ld = D | 1, ldv = DV | 1, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *Qs = sm, *Ks = Qs + ATT_BQ * ld, *Vs = Ks + ATT_BK * ld;
    const int64_t t0 = (int64_t)blockIdx.x * ATT_BQ, bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / KVH);
    const int64_t qs = H * D, ks = KVH * D, vs = KVH * DV;
    const T *qb = q + (b * Tn * H + h) * D, *kb = k + (b * Tn * KVH + kvh) * D, *vb = v + (b * Tn * KVH + kvh) * DV;
    const int nq = (int)(Tn - t0 < ATT_BQ ? Tn - t0 : ATT_BQ);
    const int64_t tlast = t0 + nq - 1;
    load_tile(Qs, ld, qb, t0, nq, ATT_BQ, qs, D);

    float m[ATT_RPW], l[ATT_RPW], acc[ATT_RPW][NT];
#pragma unroll
    for (int r = 0; r < ATT_RPW; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < NT; i++)
            acc[r][i] = 0.0f;
    }
    for (int64_t j0 = att_first_key(t0, W); j0 <= tlast; j0 += ATT_BK) {
        const int nk = (int)(tlast + 1 - j0 < ATT_BK ? tlast + 1 - j0 : ATT_BK);
        __syncthreads(); /* the previous tile is consumed (and Qs loaded) */
        load_tile(Ks, ld, kb, j0, nk, ATT_BK, ks, D);
        load_tile(Vs, ldv, vb, j0, nk, ATT_BK, vs, DV);
        __syncthreads();
        float s[ATT_RPW];
#pragma unroll
        for (int r = 0; r < ATT_RPW; r++)
            s[r] = 0.0f;
        const float *kr = Ks + lane * ld, *qr = Qs + warp * ATT_RPW * ld;
        for (int d = 0; d < D; d++) {
            float kv = kr[d];
#pragma unroll
            for (int r = 0; r < ATT_RPW; r++)
                s[r] += qr[r * ld + d] * kv;
        }
        const int64_t j = j0 + lane;
#pragma unroll
        for (int r = 0; r < ATT_RPW; r++) {
            const int64_t t = t0 + warp * ATT_RPW + r;
            bool ok = lane < nk && t <= tlast && att_visible(t, j, W);
            float sc = ok ? att_capped(s[r] * scale, cap) : -INFINITY;
            float mn = fmaxf(m[r], warp_max(sc));
            float p = mn == -INFINITY ? 0.0f : expf(sc - mn);
            float corr = mn == -INFINITY ? 1.0f : expf(m[r] - mn);
            l[r] = l[r] * corr + warp_sum(p);
            m[r] = mn;
#pragma unroll
            for (int i = 0; i < NT; i++)
                acc[r][i] *= corr;
            s[r] = p;
        }
        for (int jj = 0; jj < nk; jj++) {
            const float *vr = Vs + jj * ldv;
#pragma unroll
            for (int r = 0; r < ATT_RPW; r++) {
                float p = __shfl_sync(FULL, s[r], jj);
#pragma unroll
                for (int i = 0; i < NT; i++) {
                    int dd = lane + 32 * i;
                    if (dd < DV)
                        acc[r][i] += p * vr[dd];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ATT_RPW; r++) {
        const int64_t t = t0 + warp * ATT_RPW + r;
        if (t > tlast)
            continue;
        float inv = 1.0f / l[r];
        T *o = out + ((b * Tn + t) * H + h) * DV;
#pragma unroll
        for (int i = 0; i < NT; i++) {
            int dd = lane + 32 * i;
            if (dd < DV)
                am_st(o, dd, acc[r][i] * inv);
        }
        if (lane == 0)
            lse[(b * H + h) * Tn + t] = m[r] + logf(l[r]);
    }
}

/* ================= backward ================= */

/* Dt[b, h, t] = Σ_d dout · out: one warp per row (D: their head width, v's) */
template <typename T>
__global__ void attn_bwd_dot_k(float *Dt, const T *dout, const T *out, int64_t Tn, int64_t H, int D, int64_t rows)
{
    const int lane = threadIdx.x % 32;
    for (int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; row < rows;
         row += (int64_t)gridDim.x * blockDim.x / 32) {
        /* row = (b * Tn + t) * H + h, the [B, T, H] order of dout */
        const int64_t h = row % H, bt = row / H, t = bt % Tn, b = bt / Tn;
        float acc = 0.0f;
        for (int d = lane; d < D; d += 32)
            acc += am_ld(dout, row * D + d) * am_ld(out, row * D + d);
        acc = warp_sum(acc);
        if (lane == 0)
            Dt[(b * H + h) * Tn + t] = acc;
    }
}

/* dk, dv: a block owns ATT_BQ keys of one (batch, kv head), ATT_RPW per warp */
template <typename T, int NT>
__global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dkdv_k(T *dk, T *dv, const T *dout, const float *lse, const float *Dt,
                                                               const T *q, const T *k, const T *v, int64_t Tn, int64_t H,
                                                               int64_t KVH, int D, int DV, int64_t W, float scale, float cap)
{
    extern __shared__ float sm[];
    const int ld = D | 1, ldv = DV | 1, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *Ks = sm, *Vs = Ks + ATT_BQ * ld, *Qs = Vs + ATT_BQ * ldv, *Os = Qs + ATT_BK * ld, *Ls = Os + ATT_BK * ldv;
    float *Ds = Ls + ATT_BK;
    const int64_t j0 = (int64_t)blockIdx.x * ATT_BQ, bk = blockIdx.y, b = bk / KVH, kvh = bk % KVH, G = H / KVH;
    const int64_t qs = H * D, ks = KVH * D, os = H * DV, vs = KVH * DV;
    const int nk = (int)(Tn - j0 < ATT_BQ ? Tn - j0 : ATT_BQ);
    const int64_t jlast = j0 + nk - 1, tend = W > 0 && jlast + W - 1 < Tn - 1 ? jlast + W - 1 : Tn - 1;
    const T *kb = k + (b * Tn * KVH + kvh) * D, *vb = v + (b * Tn * KVH + kvh) * DV;
    load_tile(Ks, ld, kb, j0, nk, ATT_BQ, ks, D);
    load_tile(Vs, ldv, vb, j0, nk, ATT_BQ, vs, DV);

    float gk[ATT_RPW][NT], gv[ATT_RPW][NT];
#pragma unroll
    for (int r = 0; r < ATT_RPW; r++)
#pragma unroll
        for (int i = 0; i < NT; i++)
            gk[r][i] = gv[r][i] = 0.0f;
    const float *kr = Ks + warp * ATT_RPW * ld, *vr = Vs + warp * ATT_RPW * ldv;
    for (int64_t h = kvh * G; h < (kvh + 1) * G; h++) {
        const T *qb = q + (b * Tn * H + h) * D, *ob = dout + (b * Tn * H + h) * DV;
        const float *lb = lse + (b * H + h) * Tn, *db = Dt + (b * H + h) * Tn;
        for (int64_t t0 = j0; t0 <= tend; t0 += ATT_BK) {
            const int nq = (int)(tend + 1 - t0 < ATT_BK ? tend + 1 - t0 : ATT_BK);
            __syncthreads(); /* the previous tile is consumed (and Ks, Vs loaded) */
            load_tile(Qs, ld, qb, t0, nq, ATT_BK, qs, D);
            load_tile(Os, ldv, ob, t0, nq, ATT_BK, os, DV);
            if (threadIdx.x < ATT_BK) {
                Ls[threadIdx.x] = threadIdx.x < nq ? lb[t0 + threadIdx.x] : 0.0f;
                Ds[threadIdx.x] = threadIdx.x < nq ? db[t0 + threadIdx.x] : 0.0f;
            }
            __syncthreads();
            /* lane: query row t0 + lane; s = q · k_j, dp = dout · v_j for the warp's keys */
            float s[ATT_RPW], dp[ATT_RPW];
#pragma unroll
            for (int r = 0; r < ATT_RPW; r++)
                s[r] = dp[r] = 0.0f;
            const float *qr = Qs + lane * ld, *orow = Os + lane * ldv;
            for (int d = 0; d < D; d++) {
                float qv = qr[d];
#pragma unroll
                for (int r = 0; r < ATT_RPW; r++)
                    s[r] += qv * kr[r * ld + d];
            }
            for (int d = 0; d < DV; d++) {
                float ov = orow[d];
#pragma unroll
                for (int r = 0; r < ATT_RPW; r++)
                    dp[r] += ov * vr[r * ldv + d];
            }
            const int64_t t = t0 + lane;
#pragma unroll
            for (int r = 0; r < ATT_RPW; r++) {
                const int64_t j = j0 + warp * ATT_RPW + r;
                bool ok = lane < nq && warp * ATT_RPW + r < nk && att_visible(t, j, W);
                float a = s[r] * scale;
                float p = ok ? expf(att_capped(a, cap) - Ls[lane]) : 0.0f;
                s[r] = p;
                dp[r] = cap > 0.0f ? p * (dp[r] - Ds[lane]) * att_cap_grad(a, cap) * scale
                                   : p * (dp[r] - Ds[lane]) * scale; /* scale * ds */
            }
            for (int tt = 0; tt < nq; tt++) {
                const float *qt = Qs + tt * ld, *ot = Os + tt * ldv;
#pragma unroll
                for (int r = 0; r < ATT_RPW; r++) {
                    float p = __shfl_sync(FULL, s[r], tt), ds = __shfl_sync(FULL, dp[r], tt);
#pragma unroll
                    for (int i = 0; i < NT; i++) {
                        int dd = lane + 32 * i;
                        if (dd < DV)
                            gv[r][i] += p * ot[dd];
                        if (dd < D)
                            gk[r][i] += ds * qt[dd];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ATT_RPW; r++) {
        const int kr_ = warp * ATT_RPW + r;
        if (kr_ >= nk)
            continue;
        const int64_t off = ((b * Tn + j0 + kr_) * KVH + kvh) * D, offv = ((b * Tn + j0 + kr_) * KVH + kvh) * DV;
#pragma unroll
        for (int i = 0; i < NT; i++) {
            int dd = lane + 32 * i;
            if (dd < D)
                am_st(dk + off, dd, am_ld(dk + off, dd) + gk[r][i]);
            if (dd < DV)
                am_st(dv + offv, dd, am_ld(dv + offv, dd) + gv[r][i]);
        }
    }
}

/* dq: a block takes ATT_BQ query rows of one (batch, head), ATT_RPW per warp */
template <typename T, int NT>
__global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dq_k(T *dq, const T *dout, const float *lse, const float *Dt, const T *q,
                                                             const T *k, const T *v, int64_t Tn, int64_t H, int64_t KVH, int D,
                                                             int DV, int64_t W, float scale, float cap)
{
    extern __shared__ float sm[];
    const int ld = D | 1, ldv = DV | 1, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *Qs = sm, *Os = Qs + ATT_BQ * ld, *Ks = Os + ATT_BQ * ldv, *Vs = Ks + ATT_BK * ld;
    const int64_t t0 = (int64_t)blockIdx.x * ATT_BQ, bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / KVH);
    const int64_t qs = H * D, ks = KVH * D, os = H * DV, vs = KVH * DV;
    const T *qb = q + (b * Tn * H + h) * D, *ob = dout + (b * Tn * H + h) * DV;
    const T *kb = k + (b * Tn * KVH + kvh) * D, *vb = v + (b * Tn * KVH + kvh) * DV;
    const int nq = (int)(Tn - t0 < ATT_BQ ? Tn - t0 : ATT_BQ);
    const int64_t tlast = t0 + nq - 1;
    load_tile(Qs, ld, qb, t0, nq, ATT_BQ, qs, D);
    load_tile(Os, ldv, ob, t0, nq, ATT_BQ, os, DV);

    float L[ATT_RPW], Dr[ATT_RPW], acc[ATT_RPW][NT];
#pragma unroll
    for (int r = 0; r < ATT_RPW; r++) {
        const int64_t t = t0 + warp * ATT_RPW + r;
        L[r] = t <= tlast ? lse[(b * H + h) * Tn + t] : 0.0f;
        Dr[r] = t <= tlast ? Dt[(b * H + h) * Tn + t] : 0.0f;
#pragma unroll
        for (int i = 0; i < NT; i++)
            acc[r][i] = 0.0f;
    }
    for (int64_t j0 = att_first_key(t0, W); j0 <= tlast; j0 += ATT_BK) {
        const int nk = (int)(tlast + 1 - j0 < ATT_BK ? tlast + 1 - j0 : ATT_BK);
        __syncthreads();
        load_tile(Ks, ld, kb, j0, nk, ATT_BK, ks, D);
        load_tile(Vs, ldv, vb, j0, nk, ATT_BK, vs, DV);
        __syncthreads();
        float s[ATT_RPW], dp[ATT_RPW];
#pragma unroll
        for (int r = 0; r < ATT_RPW; r++)
            s[r] = dp[r] = 0.0f;
        const float *kr = Ks + lane * ld, *vr = Vs + lane * ldv;
        const float *qr = Qs + warp * ATT_RPW * ld, *orow = Os + warp * ATT_RPW * ldv;
        for (int d = 0; d < D; d++) {
            float kv = kr[d];
#pragma unroll
            for (int r = 0; r < ATT_RPW; r++)
                s[r] += qr[r * ld + d] * kv;
        }
        for (int d = 0; d < DV; d++) {
            float vv = vr[d];
#pragma unroll
            for (int r = 0; r < ATT_RPW; r++)
                dp[r] += orow[r * ldv + d] * vv;
        }
        const int64_t j = j0 + lane;
#pragma unroll
        for (int r = 0; r < ATT_RPW; r++) {
            const int64_t t = t0 + warp * ATT_RPW + r;
            bool ok = lane < nk && t <= tlast && att_visible(t, j, W);
            float a = s[r] * scale;
            float p = ok ? expf(att_capped(a, cap) - L[r]) : 0.0f;
            s[r] = cap > 0.0f ? p * (dp[r] - Dr[r]) * att_cap_grad(a, cap) * scale
                              : p * (dp[r] - Dr[r]) * scale; /* scale * ds */
        }
        for (int jj = 0; jj < nk; jj++) {
            const float *kj = Ks + jj * ld;
#pragma unroll
            for (int r = 0; r < ATT_RPW; r++) {
                float ds = __shfl_sync(FULL, s[r], jj);
#pragma unroll
                for (int i = 0; i < NT; i++) {
                    int dd = lane + 32 * i;
                    if (dd < D)
                        acc[r][i] += ds * kj[dd];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ATT_RPW; r++) {
        const int64_t t = t0 + warp * ATT_RPW + r;
        if (t > tlast)
            continue;
        T *g = dq + ((b * Tn + t) * H + h) * D;
#pragma unroll
        for (int i = 0; i < NT; i++) {
            int dd = lane + 32 * i;
            if (dd < D)
                am_st(g, dd, am_ld(g, dd) + acc[r][i]);
        }
    }
}

/* ================= launches ================= */

/* dynamic shared memory of a launch, allowed above the default 48 KiB once per kernel */
template <typename K> static void att_smem(const char *kn, K kernel, size_t bytes)
{
    if (bytes > 48 * 1024)
        am_cuda_check(kn, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                      "cudaFuncSetAttribute (shared memory)");
}

template <typename T, int NT>
static void launch_fwd(const char *kn, cudaStream_t st, const struct att_shape *s, void *out, float *lse, const void *q,
                       const void *k, const void *v, int64_t W)
{
    size_t smem = ((size_t)(ATT_BQ + ATT_BK) * (size_t)(s->D | 1) + (size_t)ATT_BK * (size_t)(s->DV | 1)) * sizeof(float);
    att_smem(kn, attn_fwd_k<T, NT>, smem);
    dim3 grid((unsigned)((s->T + ATT_BQ - 1) / ATT_BQ), (unsigned)(s->B * s->H));
    attn_fwd_k<T, NT><<<grid, ATT_THREADS, smem, st>>>((T *)out, lse, (const T *)q, (const T *)k, (const T *)v, s->T, s->H,
                                                       s->KVH, (int)s->D, (int)s->DV, W, s->scale, s->cap);
    AM_LAUNCHED(kn);
}

template <typename T, int NT>
static void launch_bwd(const char *kn, cudaStream_t st, const struct att_shape *s, void *dq, void *dk, void *dv,
                       const void *dout, const float *lse, const float *Dt, const void *q, const void *k, const void *v,
                       int64_t W)
{
    size_t ld = (size_t)(s->D | 1), ldv = (size_t)(s->DV | 1);
    size_t smem_kv = ((size_t)(ATT_BQ + ATT_BK) * (ld + ldv) + 2 * ATT_BK) * sizeof(float);
    size_t smem_q = (size_t)(ATT_BQ + ATT_BK) * (ld + ldv) * sizeof(float);
    att_smem(kn, attn_bwd_dkdv_k<T, NT>, smem_kv);
    att_smem(kn, attn_bwd_dq_k<T, NT>, smem_q);
    unsigned tiles = (unsigned)((s->T + ATT_BQ - 1) / ATT_BQ);
    attn_bwd_dkdv_k<T, NT><<<dim3(tiles, (unsigned)(s->B * s->KVH)), ATT_THREADS, smem_kv, st>>>(
        (T *)dk, (T *)dv, (const T *)dout, lse, Dt, (const T *)q, (const T *)k, (const T *)v, s->T, s->H, s->KVH, (int)s->D,
        (int)s->DV, W, s->scale, s->cap);
    AM_LAUNCHED(kn);
    attn_bwd_dq_k<T, NT><<<dim3(tiles, (unsigned)(s->B * s->H)), ATT_THREADS, smem_q, st>>>(
        (T *)dq, (const T *)dout, lse, Dt, (const T *)q, (const T *)k, (const T *)v, s->T, s->H, s->KVH, (int)s->D,
        (int)s->DV, W, s->scale, s->cap);
    AM_LAUNCHED(kn);
}

/* the instantiation for ceil(max(D, DV) / 32) registers per row (D, DV <= 256, checked) */
#define ATT_DISPATCH(NTV, CALL)                                                                                      \
    switch (NTV) {                                                                                                   \
    case 1: CALL(1); break;                                                                                          \
    case 2: CALL(2); break;                                                                                          \
    case 3: CALL(3); break;                                                                                          \
    case 4: CALL(4); break;                                                                                          \
    case 5: CALL(5); break;                                                                                          \
    case 6: CALL(6); break;                                                                                          \
    case 7: CALL(7); break;                                                                                          \
    default: CALL(8); break;                                                                                         \
    }

/* ================= checks and the entry points ================= */

static struct att_shape check_attention(const char *kn, const struct am_tensor *o, const struct am_tensor *lse,
                                        const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v)
{
    AM_CUDA_REQUIRE(kn, q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && o->ndim == 4,
                    "q (%s), k, v and out must be 4-d [B, T, heads, D]", am_tname(q));
    struct att_shape s = {q->shape[0], q->shape[1], q->shape[2], k->shape[2], q->shape[3], v->shape[3], 0.0f, 0.0f};
    for (int i = 0; i < 3; i++)
        AM_CUDA_REQUIRE(kn, o->shape[i] == q->shape[i], "out (%s) must have q's shape", am_tname(o));
    AM_CUDA_REQUIRE(kn, o->shape[3] == s.DV, "out (%s) must be as wide as v's heads, %lld", am_tname(o), (long long)s.DV);
    AM_CUDA_REQUIRE(kn, k->shape[0] == s.B && k->shape[1] == s.T && k->shape[3] == s.D,
                    "k (%s) is [%lld, %lld, %lld, %lld]; q is [%lld, %lld, %lld, %lld]: B, T and D must match", am_tname(k),
                    (long long)k->shape[0], (long long)k->shape[1], (long long)k->shape[2], (long long)k->shape[3],
                    (long long)s.B, (long long)s.T, (long long)s.H, (long long)s.D);
    for (int i = 0; i < 3; i++)
        AM_CUDA_REQUIRE(kn, v->shape[i] == k->shape[i], "v (%s) must have k's shape", am_tname(v));
    AM_CUDA_REQUIRE(kn, s.KVH > 0 && s.H % s.KVH == 0, "%lld query heads are not a multiple of %lld kv heads", (long long)s.H,
                    (long long)s.KVH);
    AM_CUDA_REQUIRE(kn, am_tensor_numel(lse) == s.B * s.H * s.T, "lse (%s) must be [B, H, T] = [%lld, %lld, %lld]",
                    am_tname(lse), (long long)s.B, (long long)s.H, (long long)s.T);
    AM_CUDA_REQUIRE(kn, s.D >= 1 && s.D <= ATT_MAX_D, "head size %lld: the CUDA attention takes 1 .. %d", (long long)s.D,
                    ATT_MAX_D);
    AM_CUDA_REQUIRE(kn, s.DV >= 1 && s.DV <= ATT_MAX_D, "v's head size %lld: the CUDA attention takes 1 .. %d",
                    (long long)s.DV, ATT_MAX_D);
    s.scale = (float)(1.0 / sqrt((double)s.D)); /* transformers' head_dim ** -0.5, as an fp32 operand */
    return s;
}

/* The limits of the backend's own kernels (their grid: B x H blocks in y, T / 32 in x), checked
 * once cuDNN has declined the call: cuDNN's fused attention has no such limit. */
static void check_own_grid(const char *kn, const struct att_shape *s)
{
    AM_CUDA_REQUIRE(kn, s->B * s->H <= 65535 && s->T < ((int64_t)1 << 36),
                    "B x H = %lld (at most 65535) and T = %lld: too large for the grid of the backend's own attention "
                    "kernels (cuDNN's fused attention, AM_ATTN=cudnn, has no such limit where it has the case: bf16, "
                    "head size 64 or 128)", (long long)(s->B * s->H), (long long)s->T);
}

/* AM_ATTN: true when cuDNN may run attention (a build with cuDNN, AM_ATTN unset or "cudnn");
 * "own" runs the backend's kernels; another value aborts (a typo must not pick a path). */
static bool want_cudnn(const char *kn)
{
    const char *e = getenv("AM_ATTN");
    if (e && *e && strcmp(e, "own") != 0 && strcmp(e, "cudnn") != 0)
        am_cuda_fatal(kn, "AM_ATTN=%s: the attention is AM_ATTN=cudnn (cuDNN's fused attention where it has the case, "
                      "the default) or AM_ATTN=own (the backend's kernels); unset it for the default", e);
#ifdef AM_HAVE_CUDNN
    return !(e && strcmp(e, "own") == 0);
#else
    return false;
#endif
}

static unsigned long long att_calls_own, att_calls_cudnn;

bool am_cuda_attention_has_cudnn(void)
{
#ifdef AM_HAVE_CUDNN
    return true;
#else
    return false;
#endif
}

void am_cuda_attention_calls(unsigned long long *own, unsigned long long *cudnn)
{
    *own = __atomic_load_n(&att_calls_own, __ATOMIC_RELAXED);
    *cudnn = __atomic_load_n(&att_calls_cudnn, __ATOMIC_RELAXED);
}

static void attention_forward(const char *kn, const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                              const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v, int64_t window,
                              float scale, float cap)
{
    am_cuda_ctx(kn, d);
    enum am_dtype dt = am_cuda_act(kn, "q", q);
    am_cuda_same(kn, "k", k, "q", q);
    am_cuda_same(kn, "v", v, "q", q);
    am_cuda_same(kn, "out", out, "q", q);
    am_cuda_stat(kn, "lse", lse);
    struct att_shape s = check_attention(kn, out, lse, q, k, v);
    if (!s.B || !s.T || !s.H)
        return;
    bool plain = scale <= 0.0f && cap <= 0.0f && s.DV == s.D; /* what cuDNN's case covers */
    if (scale > 0.0f)
        s.scale = scale;
    s.cap = cap > 0.0f ? cap : 0.0f;
#ifdef AM_HAVE_CUDNN
    if (want_cudnn(kn) && plain && am_cuda_attention_cudnn_forward(d, out, lse, q, k, v, window) == 0) {
        __atomic_fetch_add(&att_calls_cudnn, 1, __ATOMIC_RELAXED);
        return;
    }
#else
    want_cudnn(kn);
    (void)plain;
#endif
    check_own_grid(kn, &s);
    __atomic_fetch_add(&att_calls_own, 1, __ATOMIC_RELAXED);
    cudaStream_t st = am_cuda_stream(d);
    int nt = (int)(((s.D > s.DV ? s.D : s.DV) + 31) / 32);
    float *l = (float *)lse->data;
    if (dt == AM_F32) {
#define CALL(N) launch_fwd<float, N>(kn, st, &s, out->data, l, q->data, k->data, v->data, window)
        ATT_DISPATCH(nt, CALL)
#undef CALL
    } else {
#define CALL(N) launch_fwd<am_bf16_t, N>(kn, st, &s, out->data, l, q->data, k->data, v->data, window)
        ATT_DISPATCH(nt, CALL)
#undef CALL
    }
}

void am_cuda_attention_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *q,
                               const struct am_tensor *k, const struct am_tensor *v, int64_t window)
{
    attention_forward("am_cuda_attention_forward", d, out, lse, q, k, v, window, 0.0f, 0.0f);
}

void am_cuda_attention_softcap_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                       const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                       int64_t window, float scale, float softcap)
{
    attention_forward("am_cuda_attention_softcap_forward", d, out, lse, q, k, v, window, scale, softcap);
}

static void attention_backward(const char *kn, const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                               struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                               const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                               const struct am_tensor *v, int64_t window, float scale, float cap)
{
    am_cuda_ctx(kn, d);
    enum am_dtype dt = am_cuda_act(kn, "q", q);
    const struct am_tensor *same[] = {k, v, out, dout, dq, dk, dv};
    const char *names[] = {"k", "v", "out", "dout", "dq", "dk", "dv"};
    for (int i = 0; i < 7; i++)
        am_cuda_same(kn, names[i], same[i], "q", q);
    am_cuda_stat(kn, "lse", lse);
    struct att_shape s = check_attention(kn, out, lse, q, k, v);
    for (int i = 0; i < 4; i++) {
        AM_CUDA_REQUIRE(kn, dq->ndim == 4 && dq->shape[i] == q->shape[i] && dout->ndim == 4 && dout->shape[i] == out->shape[i],
                        "dq (%s) and dout (%s) must have q's shape", am_tname(dq), am_tname(dout));
        AM_CUDA_REQUIRE(kn, dk->ndim == 4 && dk->shape[i] == k->shape[i] && dv->ndim == 4 && dv->shape[i] == v->shape[i],
                        "dk (%s) and dv (%s) must have k's shape", am_tname(dk), am_tname(dv));
    }
    if (!s.B || !s.T || !s.H)
        return;
    bool plain = scale <= 0.0f && cap <= 0.0f && s.DV == s.D;
    if (scale > 0.0f)
        s.scale = scale;
    s.cap = cap > 0.0f ? cap : 0.0f;
#ifdef AM_HAVE_CUDNN
    if (want_cudnn(kn) && plain && am_cuda_attention_cudnn_backward(d, dq, dk, dv, dout, out, lse, q, k, v, window) == 0) {
        __atomic_fetch_add(&att_calls_cudnn, 1, __ATOMIC_RELAXED);
        return;
    }
#else
    want_cudnn(kn);
    (void)plain;
#endif
    check_own_grid(kn, &s);
    __atomic_fetch_add(&att_calls_own, 1, __ATOMIC_RELAXED);
    cudaStream_t st = am_cuda_stream(d);
    int64_t rows = s.B * s.T * s.H;
    float *Dt = (float *)am_cuda_scratch(kn, d, (size_t)rows * sizeof(float));
    int64_t rblocks = (rows + ATT_WARPS - 1) / ATT_WARPS;
    unsigned blocks = (unsigned)(rblocks < 65536 ? rblocks : 65536);
    if (dt == AM_F32)
        attn_bwd_dot_k<<<blocks, ATT_THREADS, 0, st>>>(Dt, (const float *)dout->data, (const float *)out->data, s.T, s.H,
                                                       (int)s.DV, rows);
    else
        attn_bwd_dot_k<<<blocks, ATT_THREADS, 0, st>>>(Dt, (const am_bf16_t *)dout->data, (const am_bf16_t *)out->data, s.T,
                                                       s.H, (int)s.DV, rows);
    AM_LAUNCHED(kn);
    int nt = (int)(((s.D > s.DV ? s.D : s.DV) + 31) / 32);
    const float *l = (const float *)lse->data;
    if (dt == AM_F32) {
#define CALL(N)                                                                                                      \
    launch_bwd<float, N>(kn, st, &s, dq->data, dk->data, dv->data, dout->data, l, Dt, q->data, k->data, v->data, window)
        ATT_DISPATCH(nt, CALL)
#undef CALL
    } else {
#define CALL(N)                                                                                                      \
    launch_bwd<am_bf16_t, N>(kn, st, &s, dq->data, dk->data, dv->data, dout->data, l, Dt, q->data, k->data, v->data,  \
                             window)
        ATT_DISPATCH(nt, CALL)
#undef CALL
    }
}

void am_cuda_attention_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                                const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                                const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v, int64_t window)
{
    attention_backward("am_cuda_attention_backward", d, dq, dk, dv, dout, out, lse, q, k, v, window, 0.0f, 0.0f);
}

void am_cuda_attention_softcap_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                        struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                        const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                        const struct am_tensor *v, int64_t window, float scale, float softcap)
{
    attention_backward("am_cuda_attention_softcap_backward", d, dq, dk, dv, dout, out, lse, q, k, v, window, scale,
                       softcap);
}
