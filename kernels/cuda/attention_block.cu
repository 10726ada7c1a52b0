/* attention_block.cu - attention of one block of queries against one block of keys, masked
 * by the tokens' positions, merged into a running result by log-sum-exp (kernels.h:
 * attention_block_forward and attention_block_backward; kernels/cpu/attention_block.c has the
 * formulas and is the reference), and by the documents of packed sequences (qstart); with
 * Gemma's scale and soft cap (attention_block_softcap_*: score u = cap tanh(scale q·k / cap),
 * the backward's ds times 1 - tanh²).
 *
 * q [B, Tq, H, D], k [B, Tk, KVH, D]; v [B, Tk, KVH, DV], out [B, Tq, H, DV] (DV: v's head
 * width, D's or another: multi-head latent attention's). One warp per row, lanes over the head dims (lane, lane + 32, ...: up to 256 = 8 per lane),
 * dot products summed by warp shuffles. q, k, v, dout and out f32 or bf16 (one dtype), loaded
 * into fp32; the running out of the forward and dq, dk, dv f32, or bf16 where kernels.h allows
 * it (out without accumulate; a bf16 gradient element gets its block's sum added in fp32 and is
 * rounded once): scores, softmax statistics and sums all in fp32, as the CPU's. A plain kernel, not a tiled one: the
 * ring's correctness on the device, not its speed. Each row's loop runs over the span of keys
 * it sees (a key's, of the query rows that see it), found by the warp's lanes together: with
 * packed documents a row costs its document's keys, not the whole causal square.
 *   - forward: a warp per query row (b, t, h) walks the block's keys with an online softmax
 *     and merges its result into out and lse;
 *   - backward: Dt = dout_t · out_t per row, then dq (a warp per query row, over the keys)
 *     and dk, dv (a warp per key row (b, j, kv head), over the group's query heads and the
 *     rows): each gradient element has one writer and sums its terms in a fixed order (no
 *     atomics, run to run the same bits).
 */
#include <limits.h>

#include "common.cuh"

#define BLK_WARPS 8
#define BLK_THREADS (BLK_WARPS * 32)
#define BLK_MAX_NT 8 /* head dims per lane: D, DV <= 256 */
#define FULLMASK 0xffffffffu

struct blk_shape {
    int64_t B, Tq, Tk, H, KVH, D, DV; /* DV: v's and out's head width */
    float scale, cap; /* cap <= 0: no soft cap */
};

/* the score of a row against a key from q · k: scaled, and capped with a cap (the cap's
 * tanh in *th for the backward) */
__device__ __forceinline__ float blk_score(float dot, const struct blk_shape &s, float *th)
{
    float x = s.scale * dot;
    if (s.cap <= 0.0f) {
        *th = 0.0f;
        return x;
    }
    *th = tanhf(x / s.cap);
    return *th * s.cap;
}

__device__ __forceinline__ float blk_warp_sum(float x)
{
    for (int o = 16; o > 0; o /= 2)
        x += __shfl_xor_sync(FULLMASK, x, o);
    return x;
}

__device__ __forceinline__ bool blk_sees(int32_t qp, int32_t kp, int64_t W, int32_t lo)
{
    return kp <= qp && kp >= lo && (W <= 0 || kp > qp - W);
}

/* where the document of query row r (of B x Tq) starts (packed sequences), or no bound */
__device__ __forceinline__ int32_t blk_start(const int32_t *qs, int64_t r) { return qs ? qs[r] : INT32_MIN; }

/* The span [*a, *z] of indices 0 .. n - 1 for which ok(i) holds, found by the warp's lanes
 * together (every lane gets it; *a > *z: none). A row's loop over keys (or a key's over query
 * rows) runs over its span alone: a packed sequence's row reads its document's keys, not the
 * whole causal square; the indices outside are masked, so the sums are the same, bit for bit. */
template <typename F> __device__ __forceinline__ void blk_span(int64_t n, F ok, int64_t *a, int64_t *z)
{
    long long lo = LLONG_MAX, hi = -1;
    for (int64_t i = threadIdx.x % 32; i < n; i += 32)
        if (ok(i)) {
            lo = lo == LLONG_MAX ? (long long)i : lo;
            hi = (long long)i;
        }
    for (int o = 16; o > 0; o /= 2) {
        long long l2 = __shfl_xor_sync(FULLMASK, lo, o), h2 = __shfl_xor_sync(FULLMASK, hi, o);
        lo = l2 < lo ? l2 : lo;
        hi = h2 > hi ? h2 : hi;
    }
    *a = lo == LLONG_MAX ? 0 : (int64_t)lo;
    *z = (int64_t)hi;
}

/* a . b over the D head dims of two rows, summed over the warp (every lane gets it) */
template <typename T> __device__ __forceinline__ float blk_dot(const T *a, const T *b, int D)
{
    float acc = 0.0f;
    for (int d = threadIdx.x % 32; d < D; d += 32)
        acc += am_ld(a, d) * am_ld(b, d);
    return blk_warp_sum(acc);
}

template <typename T, typename O>
__global__ void __launch_bounds__(BLK_THREADS) blk_fwd_k(O *out, float *lse, const T *q, const T *k,
                                                          const T *v, const int32_t *qpos, const int32_t *kpos,
                                                          const int32_t *qs, struct blk_shape s, int64_t W,
                                                          int accumulate)
{
    int lane = threadIdx.x % 32, D = (int)s.D, DV = (int)s.DV;
    int64_t G = s.H / s.KVH, rows = s.B * s.Tq * s.H;
    for (int64_t row = (int64_t)blockIdx.x * BLK_WARPS + threadIdx.x / 32; row < rows;
         row += (int64_t)gridDim.x * BLK_WARPS) {
        int64_t h = row % s.H, t = (row / s.H) % s.Tq, b = row / (s.H * s.Tq);
        const T *qt = q + row * D;
        const T *kh = k + (b * s.Tk * s.KVH + h / G) * D, *vh = v + (b * s.Tk * s.KVH + h / G) * DV;
        float acc[BLK_MAX_NT], m = -INFINITY, l = 0.0f;
        int32_t lo = blk_start(qs, b * s.Tq + t), qp = qpos[t];
        for (int i = 0; i < BLK_MAX_NT; i++)
            acc[i] = 0.0f;
        int64_t j0, j1;
        blk_span(s.Tk, [&](int64_t j) { return blk_sees(qp, kpos[j], W, lo); }, &j0, &j1);
        for (int64_t j = j0; j <= j1; j++) {
            if (!blk_sees(qp, kpos[j], W, lo))
                continue;
            float th, sc = blk_score(blk_dot(qt, kh + j * s.KVH * D, D), s, &th);
            float mn = fmaxf(m, sc), a = expf(m - mn), p = expf(sc - mn);
            l = l * a + p;
            const T *vj = vh + j * s.KVH * DV;
            for (int i = 0; i < BLK_MAX_NT; i++) {
                int d = lane + 32 * i;
                if (d < DV)
                    acc[i] = acc[i] * a + p * am_ld(vj, d);
            }
            m = mn;
        }
        O *ot = out + row * DV;
        float *lt = lse + (b * s.H + h) * s.Tq + t;
        if (m == -INFINITY) { /* no key of this block */
            if (!accumulate) {
                for (int d = lane; d < DV; d += 32)
                    am_st(ot, d, 0.0f);
                if (lane == 0)
                    *lt = -INFINITY;
            }
            continue;
        }
        float lb = m + logf(l), inv = 1.0f / l, old = *lt;
        __syncwarp();
        if (!accumulate || old == -INFINITY) {
            for (int i = 0; i < BLK_MAX_NT; i++)
                if (lane + 32 * i < DV)
                    am_st(ot, lane + 32 * i, acc[i] * inv);
            if (lane == 0)
                *lt = lb;
            continue;
        }
        float L = fmaxf(old, lb), a = expf(old - L), c = expf(lb - L), w = 1.0f / (a + c);
        for (int i = 0; i < BLK_MAX_NT; i++) {
            int d = lane + 32 * i;
            if (d < DV)
                am_st(ot, d, (a * am_ld(ot, d) + c * acc[i] * inv) * w);
        }
        if (lane == 0)
            *lt = L + logf(a + c);
    }
}

/* Dt[b, h, t] = dout_t . out_t */
template <typename T> __global__ void blk_dot_k(float *Dt, const T *dout, const T *out, struct blk_shape s)
{
    int D = (int)s.DV; /* dout's and out's head width */
    int64_t rows = s.B * s.Tq * s.H;
    for (int64_t row = (int64_t)blockIdx.x * BLK_WARPS + threadIdx.x / 32; row < rows;
         row += (int64_t)gridDim.x * BLK_WARPS) {
        int64_t h = row % s.H, t = (row / s.H) % s.Tq, b = row / (s.H * s.Tq);
        float x = blk_dot(dout + row * D, out + row * D, D);
        if (threadIdx.x % 32 == 0)
            Dt[(b * s.H + h) * s.Tq + t] = x;
    }
}

template <typename T, typename G>
__global__ void __launch_bounds__(BLK_THREADS) blk_dq_k(G *dq, const T *dout, const float *lse, const float *Dt,
                                                         const T *q, const T *k, const T *v,
                                                         const int32_t *qpos, const int32_t *kpos, const int32_t *qs,
                                                         struct blk_shape s, int64_t W)
{
    int lane = threadIdx.x % 32, D = (int)s.D, DV = (int)s.DV;
    int64_t Gs = s.H / s.KVH, rows = s.B * s.Tq * s.H;
    for (int64_t row = (int64_t)blockIdx.x * BLK_WARPS + threadIdx.x / 32; row < rows;
         row += (int64_t)gridDim.x * BLK_WARPS) {
        int64_t h = row % s.H, t = (row / s.H) % s.Tq, b = row / (s.H * s.Tq);
        float L = lse[(b * s.H + h) * s.Tq + t], Dr = Dt[(b * s.H + h) * s.Tq + t];
        if (L == -INFINITY)
            continue;
        const T *qt = q + row * D, *dot_ = dout + row * DV;
        const T *kh = k + (b * s.Tk * s.KVH + h / Gs) * D, *vh = v + (b * s.Tk * s.KVH + h / Gs) * DV;
        float acc[BLK_MAX_NT];
        int32_t lo = blk_start(qs, b * s.Tq + t), qp = qpos[t];
        for (int i = 0; i < BLK_MAX_NT; i++)
            acc[i] = 0.0f;
        int64_t j0, j1;
        blk_span(s.Tk, [&](int64_t j) { return blk_sees(qp, kpos[j], W, lo); }, &j0, &j1);
        for (int64_t j = j0; j <= j1; j++) {
            if (!blk_sees(qp, kpos[j], W, lo))
                continue;
            const T *kj = kh + j * s.KVH * D;
            float th, p = expf(blk_score(blk_dot(qt, kj, D), s, &th) - L);
            float ds = p * (blk_dot(dot_, vh + j * s.KVH * DV, DV) - Dr) * (1.0f - th * th) * s.scale;
            for (int i = 0; i < BLK_MAX_NT; i++)
                if (lane + 32 * i < D)
                    acc[i] += ds * am_ld(kj, lane + 32 * i);
        }
        for (int i = 0; i < BLK_MAX_NT; i++)
            if (lane + 32 * i < D)
                am_st(dq, row * D + lane + 32 * i, am_ld(dq, row * D + lane + 32 * i) + acc[i]);
    }
}

template <typename T, typename G>
__global__ void __launch_bounds__(BLK_THREADS) blk_dkdv_k(G *dk, G *dv, const T *dout, const float *lse,
                                                           const float *Dt, const T *q, const T *k,
                                                           const T *v, const int32_t *qpos, const int32_t *kpos,
                                                           const int32_t *qs, struct blk_shape s, int64_t W)
{
    int lane = threadIdx.x % 32, D = (int)s.D, DV = (int)s.DV;
    int64_t Gs = s.H / s.KVH, rows = s.B * s.Tk * s.KVH;
    for (int64_t row = (int64_t)blockIdx.x * BLK_WARPS + threadIdx.x / 32; row < rows;
         row += (int64_t)gridDim.x * BLK_WARPS) {
        int64_t kvh = row % s.KVH, j = (row / s.KVH) % s.Tk, b = row / (s.KVH * s.Tk);
        const T *kj = k + row * D, *vj = v + row * DV;
        float gk[BLK_MAX_NT], gv[BLK_MAX_NT];
        for (int i = 0; i < BLK_MAX_NT; i++)
            gk[i] = gv[i] = 0.0f;
        int32_t kp = kpos[j];
        int64_t t0, t1; /* the query rows that may see the key */
        blk_span(s.Tq, [&](int64_t t) { return blk_sees(qpos[t], kp, W, blk_start(qs, b * s.Tq + t)); }, &t0, &t1);
        for (int64_t h = kvh * Gs; h < (kvh + 1) * Gs; h++)
            for (int64_t t = t0; t <= t1; t++) {
                float L = lse[(b * s.H + h) * s.Tq + t];
                if (L == -INFINITY || !blk_sees(qpos[t], kpos[j], W, blk_start(qs, b * s.Tq + t)))
                    continue;
                const T *qt = q + ((b * s.Tq + t) * s.H + h) * D, *dot_ = dout + ((b * s.Tq + t) * s.H + h) * DV;
                float th, p = expf(blk_score(blk_dot(qt, kj, D), s, &th) - L);
                float ds = p * (blk_dot(dot_, vj, DV) - Dt[(b * s.H + h) * s.Tq + t]) * (1.0f - th * th) * s.scale;
                for (int i = 0; i < BLK_MAX_NT; i++) {
                    int d = lane + 32 * i;
                    if (d < D)
                        gk[i] += ds * am_ld(qt, d);
                    if (d < DV)
                        gv[i] += p * am_ld(dot_, d);
                }
            }
        for (int i = 0; i < BLK_MAX_NT; i++) {
            int d = lane + 32 * i;
            if (d < D)
                am_st(dk, row * D + d, am_ld(dk, row * D + d) + gk[i]);
            if (d < DV)
                am_st(dv, row * DV + d, am_ld(dv, row * DV + d) + gv[i]);
        }
    }
}

/* q, k, v (and out in backward) of one dtype, f32 or bf16; out of the forward: f32, or q's
 * dtype without accumulate (checked by the callers) */
static struct blk_shape check_block(const char *kn, const struct am_tensor *o, const struct am_tensor *lse,
                                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                    const struct am_tensor *qpos, const struct am_tensor *kpos,
                                    const struct am_tensor *qstart, float scale, float cap)
{
    am_cuda_act(kn, "q", q);
    am_cuda_same(kn, "k", k, "q", q);
    am_cuda_same(kn, "v", v, "q", q);
    am_cuda_act(kn, "out", o);
    am_cuda_stat(kn, "lse", lse);
    am_cuda_data(kn, "qpos", qpos, AM_I32);
    am_cuda_data(kn, "kpos", kpos, AM_I32);
    AM_CUDA_REQUIRE(kn, q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && o->ndim == 4,
                    "q (%s), k, v and out must be 4-d [B, T, heads, D]", am_tname(q));
    struct blk_shape s = {q->shape[0], q->shape[1], k->shape[1], q->shape[2], k->shape[2], q->shape[3], v->shape[3],
                          0.0f, cap};
    for (int i = 0; i < 3; i++) {
        AM_CUDA_REQUIRE(kn, o->shape[i] == q->shape[i], "out (%s) must have q's shape", am_tname(o));
        AM_CUDA_REQUIRE(kn, v->shape[i] == k->shape[i], "v (%s) must have k's shape", am_tname(v));
    }
    AM_CUDA_REQUIRE(kn, o->shape[3] == s.DV, "out (%s) must be as wide as v's heads (%s)", am_tname(o), am_tname(v));
    AM_CUDA_REQUIRE(kn, k->shape[0] == s.B && k->shape[3] == s.D, "k (%s) must have q's B and D", am_tname(k));
    AM_CUDA_REQUIRE(kn, s.KVH > 0 && s.H % s.KVH == 0, "%lld query heads are not a multiple of %lld kv heads",
                    (long long)s.H, (long long)s.KVH);
    AM_CUDA_REQUIRE(kn, s.D <= 32 * BLK_MAX_NT, "head size %lld: at most %d", (long long)s.D, 32 * BLK_MAX_NT);
    AM_CUDA_REQUIRE(kn, s.DV >= 1 && s.DV <= 32 * BLK_MAX_NT, "v's head size %lld: 1 to %d", (long long)s.DV,
                    32 * BLK_MAX_NT);
    AM_CUDA_REQUIRE(kn, am_tensor_numel(lse) == s.B * s.H * s.Tq, "lse (%s) must be [B, H, Tq]", am_tname(lse));
    AM_CUDA_REQUIRE(kn, am_tensor_numel(qpos) == s.Tq && am_tensor_numel(kpos) == s.Tk,
                    "qpos (%s) and kpos (%s) must hold Tq and Tk positions", am_tname(qpos), am_tname(kpos));
    if (qstart) {
        am_cuda_data(kn, "qstart", qstart, AM_I32);
        AM_CUDA_REQUIRE(kn, am_tensor_numel(qstart) == s.B * s.Tq, "qstart (%s) must hold B x Tq document starts",
                        am_tname(qstart));
    }
    s.scale = scale > 0.0f ? scale : (float)(1.0 / sqrt((double)s.D));
    return s;
}

static unsigned blk_blocks(int64_t rows)
{
    int64_t n = (rows + BLK_WARPS - 1) / BLK_WARPS;
    return (unsigned)(n < 65536 ? (n > 0 ? n : 1) : 65536);
}

template <typename T, typename O>
static void blk_fwd(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *q,
                    const struct am_tensor *k, const struct am_tensor *v, const struct am_tensor *qpos,
                    const struct am_tensor *kpos, const int32_t *qs, struct blk_shape s, int64_t window,
                    int accumulate, int64_t rows)
{
    blk_fwd_k<T, O><<<blk_blocks(rows), BLK_THREADS, 0, am_cuda_stream(d)>>>(
        (O *)out->data, (float *)lse->data, (const T *)q->data, (const T *)k->data, (const T *)v->data,
        (const int32_t *)qpos->data, (const int32_t *)kpos->data, qs, s, window, accumulate);
}

void am_cuda_attention_block_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                     const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                     const struct am_tensor *qpos, const struct am_tensor *kpos,
                                     const struct am_tensor *qstart, int64_t window, int accumulate)
{
    am_cuda_attention_block_softcap_forward(d, out, lse, q, k, v, qpos, kpos, qstart, window, accumulate, 0.0f, 0.0f);
}

void am_cuda_attention_block_softcap_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                             const struct am_tensor *q, const struct am_tensor *k,
                                             const struct am_tensor *v, const struct am_tensor *qpos,
                                             const struct am_tensor *kpos, const struct am_tensor *qstart,
                                             int64_t window, int accumulate, float scale, float softcap)
{
    const char *kn = "am_cuda_attention_block_forward";
    am_cuda_ctx(kn, d);
    struct blk_shape s = check_block(kn, out, lse, q, k, v, qpos, kpos, qstart, scale, softcap);
    AM_CUDA_REQUIRE(kn, out->dtype == AM_F32 || (out->dtype == q->dtype && !accumulate),
                    "out (%s) must be f32, or q's dtype without accumulate (the running merge stays fp32)",
                    am_tname(out));
    const int32_t *qs = qstart ? (const int32_t *)qstart->data : NULL;
    int64_t rows = s.B * s.Tq * s.H;
    if (!rows)
        return;
    bool bq = q->dtype == AM_BF16, bo = out->dtype == AM_BF16;
    if (!bq)
        blk_fwd<float, float>(d, out, lse, q, k, v, qpos, kpos, qs, s, window, accumulate, rows);
    else if (!bo)
        blk_fwd<am_bf16_t, float>(d, out, lse, q, k, v, qpos, kpos, qs, s, window, accumulate, rows);
    else
        blk_fwd<am_bf16_t, am_bf16_t>(d, out, lse, q, k, v, qpos, kpos, qs, s, window, accumulate, rows);
    AM_LAUNCHED(kn);
}

template <typename T, typename G>
static void blk_bwd(const char *kn, cudaStream_t st, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                    const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v, float *Dt,
                    const int32_t *qp, const int32_t *kp, const int32_t *qs, struct blk_shape s, int64_t window,
                    int64_t rows, int64_t krows)
{
    blk_dot_k<T><<<blk_blocks(rows), BLK_THREADS, 0, st>>>(Dt, (const T *)dout->data, (const T *)out->data, s);
    AM_LAUNCHED(kn);
    blk_dq_k<T, G><<<blk_blocks(rows), BLK_THREADS, 0, st>>>((G *)dq->data, (const T *)dout->data,
                                                             (const float *)lse->data, Dt, (const T *)q->data,
                                                             (const T *)k->data, (const T *)v->data, qp, kp, qs, s,
                                                             window);
    AM_LAUNCHED(kn);
    blk_dkdv_k<T, G><<<blk_blocks(krows), BLK_THREADS, 0, st>>>((G *)dk->data, (G *)dv->data, (const T *)dout->data,
                                                                (const float *)lse->data, Dt, (const T *)q->data,
                                                                (const T *)k->data, (const T *)v->data, qp, kp, qs, s,
                                                                window);
    AM_LAUNCHED(kn);
}

void am_cuda_attention_block_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                      struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                      const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                      const struct am_tensor *v, const struct am_tensor *qpos,
                                      const struct am_tensor *kpos, const struct am_tensor *qstart, int64_t window)
{
    am_cuda_attention_block_softcap_backward(d, dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos, qstart, window, 0.0f,
                                             0.0f);
}

void am_cuda_attention_block_softcap_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                              struct am_tensor *dv, const struct am_tensor *dout,
                                              const struct am_tensor *out, const struct am_tensor *lse,
                                              const struct am_tensor *q, const struct am_tensor *k,
                                              const struct am_tensor *v, const struct am_tensor *qpos,
                                              const struct am_tensor *kpos, const struct am_tensor *qstart,
                                              int64_t window, float scale, float softcap)
{
    const char *kn = "am_cuda_attention_block_backward";
    am_cuda_ctx(kn, d);
    struct blk_shape s = check_block(kn, out, lse, q, k, v, qpos, kpos, qstart, scale, softcap);
    const int32_t *qs = qstart ? (const int32_t *)qstart->data : NULL;
    am_cuda_same(kn, "out", out, "q", q);
    am_cuda_same(kn, "dout", dout, "q", q);
    am_cuda_act(kn, "dq", dq);
    am_cuda_same(kn, "dk", dk, "dq", dq);
    am_cuda_same(kn, "dv", dv, "dq", dq);
    AM_CUDA_REQUIRE(kn, dq->dtype == AM_F32 || dq->dtype == q->dtype,
                    "dq (%s), dk and dv must be f32 or q's dtype", am_tname(dq));
    AM_CUDA_REQUIRE(kn, am_tensor_numel(dq) == am_tensor_numel(q) && am_tensor_numel(dout) == am_tensor_numel(out),
                    "dq (%s) and dout (%s) must have q's shape", am_tname(dq), am_tname(dout));
    AM_CUDA_REQUIRE(kn, am_tensor_numel(dk) == am_tensor_numel(k) && am_tensor_numel(dv) == am_tensor_numel(v),
                    "dk (%s) and dv (%s) must have k's shape", am_tname(dk), am_tname(dv));
    int64_t rows = s.B * s.Tq * s.H, krows = s.B * s.Tk * s.KVH;
    if (!rows || !krows)
        return;
    cudaStream_t st = am_cuda_stream(d);
    float *Dt = (float *)am_cuda_scratch(kn, d, (size_t)rows * sizeof(float));
    const int32_t *qp = (const int32_t *)qpos->data, *kp = (const int32_t *)kpos->data;
    bool bq = q->dtype == AM_BF16, bg = dq->dtype == AM_BF16;
    if (!bq)
        blk_bwd<float, float>(kn, st, dq, dk, dv, dout, out, lse, q, k, v, Dt, qp, kp, qs, s, window, rows, krows);
    else if (!bg)
        blk_bwd<am_bf16_t, float>(kn, st, dq, dk, dv, dout, out, lse, q, k, v, Dt, qp, kp, qs, s, window, rows,
                                  krows);
    else
        blk_bwd<am_bf16_t, am_bf16_t>(kn, st, dq, dk, dv, dout, out, lse, q, k, v, Dt, qp, kp, qs, s, window, rows,
                                      krows);
}
