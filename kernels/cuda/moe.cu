/* moe.cu - mixture of experts on the GPU (kernels.h has the contract, kernels/cpu/moe.c the
 * same arithmetic on the CPU): the router's softmax and top-k (one thread per token), the
 * load-balancing statistics (one thread per expert, rows in order: run to run equal), the
 * stable counting sort of the slots (one block, one thread per expert), the permutation and
 * the weighted combination (one thread per element), and the experts' linear layers as one
 * cuBLASLt product per expert with rows (the counts are on the host).
 */
#include "common.cuh"

__device__ __forceinline__ float ldv(const void *p, bool bf, int64_t i)
{
    return bf ? am_ld((const am_bf16_t *)p, i) : am_ld((const float *)p, i);
}

__device__ __forceinline__ void stv(void *p, bool bf, int64_t i, float v)
{
    if (bf)
        am_st((am_bf16_t *)p, i, v);
    else
        am_st((float *)p, i, v);
}

static void want2(const char *k, const char *what, const struct am_tensor *t, int64_t rows, int64_t cols)
{
    am_cuda_tensor(k, what, t);
    AM_CUDA_REQUIRE(k, am_rows(t) == rows && am_cols(t) == cols, "%s (%s) must be [%lld, %lld], not [%lld, %lld]", what,
                    am_tname(t), (long long)rows, (long long)cols, (long long)am_rows(t), (long long)am_cols(t));
}

__global__ void route_fwd_k(float *p, int32_t *ix, float *w, const void *logits, bool bf, int64_t N, int64_t E, int64_t k,
                            bool renorm)
{
    AM_GRID_STRIDE(i, N)
    {
        float *pr = p + i * E, mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            pr[e] = ldv(logits, bf, i * E + e);
            mx = pr[e] > mx ? pr[e] : mx;
        }
        for (int64_t e = 0; e < E; e++) {
            pr[e] = expf(pr[e] - mx);
            sum += pr[e];
        }
        for (int64_t e = 0; e < E; e++)
            pr[e] /= sum;
        float tsum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int best = -1;
            for (int64_t e = 0; e < E; e++) {
                bool taken = false;
                for (int64_t q = 0; q < j; q++)
                    taken |= ix[i * k + q] == e;
                if (!taken && (best < 0 || pr[e] > pr[best]))
                    best = (int)e;
            }
            ix[i * k + j] = best;
            w[i * k + j] = pr[best];
            tsum += pr[best];
        }
        if (renorm)
            for (int64_t j = 0; j < k; j++)
                w[i * k + j] /= tsum;
    }
}

void am_cuda_moe_route_forward(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx, struct am_tensor *wts,
                               const struct am_tensor *logits, bool renorm)
{
    const char *k = "am_cuda_moe_route_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "logits", logits);
    int64_t N = am_rows(logits), E = am_cols(logits), K = am_cols(idx);
    float *p = (float *)am_cuda_data(k, "probs", probs, AM_F32), *w = (float *)am_cuda_data(k, "wts", wts, AM_F32);
    int32_t *ix = (int32_t *)am_cuda_data(k, "idx", idx, AM_I32);
    want2(k, "probs", probs, N, E);
    want2(k, "idx", idx, N, K);
    want2(k, "wts", wts, N, K);
    AM_CUDA_REQUIRE(k, K >= 1 && K <= E, "idx (%s) has %lld columns: 1 to the %lld experts", am_tname(idx), (long long)K,
                    (long long)E);
    if (!N)
        return;
    route_fwd_k<<<am_blocks(N), AM_THREADS, 0, am_cuda_stream(d)>>>(p, ix, w, logits->data, dt == AM_BF16, N, E, K, renorm);
    AM_LAUNCHED(k);
}

/* the gradient of probs[i, e] from the top-k weights and the aux loss (kernels.h) */
__device__ __forceinline__ float route_dp(const float *pr, const int32_t *ix, const float *dw, const float *cnt, float aux,
                                          int64_t k, bool renorm, float s, float dot, int64_t e)
{
    float g = cnt ? aux * cnt[e] : 0.0f;
    for (int64_t j = 0; j < k; j++)
        if (ix[j] == e)
            g += renorm ? (dw[j] - dot) / s : dw[j];
    (void)pr;
    return g;
}

__global__ void route_bwd_k(void *dl, bool bf, const float *p, const int32_t *ix, const float *dw, const float *cnt, float aux,
                            int64_t N, int64_t E, int64_t k, bool renorm)
{
    AM_GRID_STRIDE(i, N)
    {
        const float *pr = p + i * E, *dwi = dw + i * k;
        const int32_t *ixi = ix + i * k;
        float s = 0.0f, dot = 0.0f;
        for (int64_t j = 0; j < k; j++)
            s += pr[ixi[j]];
        for (int64_t j = 0; j < k; j++)
            dot += dwi[j] * (pr[ixi[j]] / s);
        float pd = 0.0f;
        for (int64_t e = 0; e < E; e++)
            pd += pr[e] * route_dp(pr, ixi, dwi, cnt, aux, k, renorm, s, dot, e);
        for (int64_t e = 0; e < E; e++)
            stv(dl, bf, i * E + e,
                ldv(dl, bf, i * E + e) + pr[e] * (route_dp(pr, ixi, dwi, cnt, aux, k, renorm, s, dot, e) - pd));
    }
}

void am_cuda_moe_route_backward(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                                const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                                float aux_scale, bool renorm)
{
    const char *k = "am_cuda_moe_route_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "dlogits", dlogits);
    int64_t N = am_rows(dlogits), E = am_cols(dlogits), K = am_cols(idx);
    const float *p = (const float *)am_cuda_data(k, "probs", probs, AM_F32);
    const float *dw = (const float *)am_cuda_data(k, "dwts", dwts, AM_F32);
    const float *c = cnt ? (const float *)am_cuda_data(k, "cnt", cnt, AM_F32) : NULL;
    const int32_t *ix = (const int32_t *)am_cuda_data(k, "idx", idx, AM_I32);
    want2(k, "probs", probs, N, E);
    want2(k, "idx", idx, N, K);
    want2(k, "dwts", dwts, N, K);
    AM_CUDA_REQUIRE(k, !cnt || am_tensor_numel(cnt) == E, "cnt (%s) must hold the %lld experts' counts", am_tname(cnt),
                    (long long)E);
    if (!N)
        return;
    route_bwd_k<<<am_blocks(N), AM_THREADS, 0, am_cuda_stream(d)>>>(dlogits->data, dt == AM_BF16, p, ix, dw, c, aux_scale,
                                                                     N, E, K, renorm);
    AM_LAUNCHED(k);
}

__global__ void aux_stats_k(float *cnt, float *psum, const float *p, const float *den, const int32_t *ix, int64_t N,
                            int64_t E, int64_t k)
{
    AM_GRID_STRIDE(e, E)
    {
        float s = 0.0f, c = 0.0f;
        for (int64_t i = 0; i < N; i++)
            s += den ? p[i * E + e] / den[i] : p[i * E + e];
        for (int64_t i = 0; i < N * k; i++)
            c += ix[i] == e ? 1.0f : 0.0f;
        psum[e] += s;
        cnt[e] += c;
    }
}

/* each row's Σ p + 1e-20 (moe_aux_stats' renorm), one thread per row */
__global__ void row_den_k(float *den, const float *p, int64_t N, int64_t E)
{
    AM_GRID_STRIDE(i, N)
    {
        float s = 0.0f;
        for (int64_t e = 0; e < E; e++)
            s += p[i * E + e];
        den[i] = s + 1e-20f;
    }
}

/* DeepSeekMoE's router (kernels.h), one thread per token: the groups kept as a bit mask (n_group
 * <= 64), the experts taken found in idx's earlier columns, as route_fwd_k does */
__device__ __forceinline__ float group_score(const float *pr, const float *bias, int64_t g, int64_t G)
{
    float a = -INFINITY, b = -INFINITY; /* the two largest biased scores of group g */
    for (int64_t e = g * G; e < (g + 1) * G; e++) {
        float v = pr[e] + bias[e];
        if (v > a) {
            b = a;
            a = v;
        } else if (v > b) {
            b = v;
        }
    }
    return a + b;
}

__global__ void route_sig_fwd_k(float *p, int32_t *ix, float *w, const void *logits, bool bf, const float *bias, int64_t N,
                                int64_t E, int64_t k, int n_group, int topk_group, bool renorm, float scale)
{
    AM_GRID_STRIDE(i, N)
    {
        float *pr = p + i * E;
        int64_t G = E / n_group;
        for (int64_t e = 0; e < E; e++)
            pr[e] = 1.0f / (1.0f + expf(-ldv(logits, bf, i * E + e)));
        unsigned long long kept = 0;
        for (int j = 0; j < topk_group; j++) {
            int best = -1;
            float bv = 0.0f;
            for (int g = 0; g < n_group; g++) {
                if (kept >> g & 1ull)
                    continue;
                float v = group_score(pr, bias, g, G);
                if (best < 0 || v > bv)
                    best = g, bv = v;
            }
            kept |= 1ull << best;
        }
        float tsum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int best = -1;
            for (int64_t e = 0; e < E; e++) {
                bool taken = !(kept >> (e / G) & 1ull);
                for (int64_t q = 0; q < j; q++)
                    taken |= ix[i * k + q] == e;
                if (!taken && (best < 0 || pr[e] + bias[e] > pr[best] + bias[best]))
                    best = (int)e;
            }
            ix[i * k + j] = best;
            w[i * k + j] = pr[best];
            tsum += pr[best];
        }
        for (int64_t j = 0; j < k; j++)
            w[i * k + j] = (renorm ? w[i * k + j] / (tsum + 1e-20f) : w[i * k + j]) * scale;
    }
}

void am_cuda_moe_route_sigmoid_forward(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx,
                                       struct am_tensor *wts, const struct am_tensor *logits, const struct am_tensor *bias,
                                       int n_group, int topk_group, bool renorm, float scale)
{
    const char *k = "am_cuda_moe_route_sigmoid_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "logits", logits);
    int64_t N = am_rows(logits), E = am_cols(logits), K = am_cols(idx);
    float *p = (float *)am_cuda_data(k, "probs", probs, AM_F32), *w = (float *)am_cuda_data(k, "wts", wts, AM_F32);
    const float *b = (const float *)am_cuda_data(k, "bias", bias, AM_F32);
    int32_t *ix = (int32_t *)am_cuda_data(k, "idx", idx, AM_I32);
    want2(k, "probs", probs, N, E);
    want2(k, "idx", idx, N, K);
    want2(k, "wts", wts, N, K);
    AM_CUDA_REQUIRE(k, am_tensor_numel(bias) == E, "bias (%s) must hold the %lld experts' selection biases",
                    am_tname(bias), (long long)E);
    AM_CUDA_REQUIRE(k, n_group >= 1 && n_group <= 64 && E % n_group == 0 && E / n_group >= 2 && topk_group >= 1 &&
                           topk_group <= n_group,
                    "n_group %d (at most 64) must divide the %lld experts into groups of 2 or more, topk_group %d be 1 "
                    "to n_group", n_group, (long long)E, topk_group);
    AM_CUDA_REQUIRE(k, K >= 1 && K <= (int64_t)topk_group * (E / n_group),
                    "idx (%s) has %lld columns: 1 to the %lld experts of the kept groups", am_tname(idx), (long long)K,
                    (long long)topk_group * (E / n_group));
    if (!N)
        return;
    route_sig_fwd_k<<<am_blocks(N), AM_THREADS, 0, am_cuda_stream(d)>>>(p, ix, w, logits->data, dt == AM_BF16, b, N, E, K,
                                                                         n_group, topk_group, renorm, scale);
    AM_LAUNCHED(k);
}

__global__ void route_sig_bwd_k(void *dl, bool bf, const float *p, const int32_t *ix, const float *dw, const float *cnt,
                                float aux, int64_t N, int64_t E, int64_t k, bool renorm, float scale)
{
    AM_GRID_STRIDE(i, N)
    {
        const float *pr = p + i * E, *dwi = dw + i * k;
        const int32_t *ixi = ix + i * k;
        float s = 1e-20f, dot = 0.0f;
        for (int64_t j = 0; j < k; j++)
            s += pr[ixi[j]];
        for (int64_t j = 0; j < k; j++)
            dot += dwi[j] * pr[ixi[j]];
        for (int64_t j = 0; j < k; j++) {
            int64_t e = ixi[j];
            float dp = renorm ? scale * (dwi[j] / s - dot / (s * s)) : scale * dwi[j];
            stv(dl, bf, i * E + e, ldv(dl, bf, i * E + e) + dp * pr[e] * (1.0f - pr[e]));
        }
        if (!cnt)
            continue;
        /* AutoModel's load-balancing loss (kernels.h), as the CPU's */
        float S = 1e-20f, gq = 0.0f;
        for (int64_t e = 0; renorm && e < E; e++)
            S += pr[e];
        for (int64_t e = 0; renorm && e < E; e++)
            gq += aux * cnt[e] * (pr[e] / S);
        for (int64_t e = 0; e < E; e++) {
            float dp = renorm ? (aux * cnt[e] - gq) / S : aux * cnt[e];
            stv(dl, bf, i * E + e, ldv(dl, bf, i * E + e) + dp * pr[e] * (1.0f - pr[e]));
        }
    }
}

void am_cuda_moe_route_sigmoid_backward(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                                        const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                                        float aux_scale, bool renorm, float scale)
{
    const char *k = "am_cuda_moe_route_sigmoid_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "dlogits", dlogits);
    int64_t N = am_rows(dlogits), E = am_cols(dlogits), K = am_cols(idx);
    const float *p = (const float *)am_cuda_data(k, "probs", probs, AM_F32);
    const float *dw = (const float *)am_cuda_data(k, "dwts", dwts, AM_F32);
    const int32_t *ix = (const int32_t *)am_cuda_data(k, "idx", idx, AM_I32);
    want2(k, "probs", probs, N, E);
    want2(k, "idx", idx, N, K);
    want2(k, "dwts", dwts, N, K);
    const float *c = cnt ? (const float *)am_cuda_data(k, "cnt", cnt, AM_F32) : NULL;
    AM_CUDA_REQUIRE(k, !cnt || am_tensor_numel(cnt) == E, "cnt (%s) must hold the %lld experts' counts", am_tname(cnt),
                    (long long)E);
    if (!N)
        return;
    route_sig_bwd_k<<<am_blocks(N), AM_THREADS, 0, am_cuda_stream(d)>>>(dlogits->data, dt == AM_BF16, p, ix, dw, c,
                                                                         aux_scale, N, E, K, renorm, scale);
    AM_LAUNCHED(k);
}

void am_cuda_moe_aux_stats(const struct am_dev *d, struct am_tensor *cnt, struct am_tensor *psum, const struct am_tensor *probs,
                           const struct am_tensor *idx, bool renorm)
{
    const char *k = "am_cuda_moe_aux_stats";
    am_cuda_ctx(k, d);
    int64_t N = am_rows(probs), E = am_cols(probs), K = am_cols(idx);
    float *c = (float *)am_cuda_data(k, "cnt", cnt, AM_F32), *ps = (float *)am_cuda_data(k, "psum", psum, AM_F32);
    const float *p = (const float *)am_cuda_data(k, "probs", probs, AM_F32);
    const int32_t *ix = (const int32_t *)am_cuda_data(k, "idx", idx, AM_I32);
    want2(k, "idx", idx, N, K);
    AM_CUDA_REQUIRE(k, am_tensor_numel(cnt) == E && am_tensor_numel(psum) == E, "cnt (%s) and psum (%s) must hold %lld experts",
                    am_tname(cnt), am_tname(psum), (long long)E);
    float *den = NULL;
    if (renorm && N > 0) {
        den = (float *)am_cuda_scratch(k, d, (size_t)N * sizeof(float));
        row_den_k<<<am_blocks(N), AM_THREADS, 0, am_cuda_stream(d)>>>(den, p, N, E);
        AM_LAUNCHED(k);
    }
    aux_stats_k<<<am_blocks(E), AM_THREADS, 0, am_cuda_stream(d)>>>(c, ps, p, den, ix, N, E, K);
    AM_LAUNCHED(k);
}

__global__ void aux_loss_k(double *acc, const float *cnt, const float *psum, int64_t E, double scale)
{
    double s = 0.0;
    for (int64_t e = 0; e < E; e++)
        s += (double)cnt[e] * (double)psum[e];
    *acc += scale * s;
}

void am_cuda_moe_aux_loss(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *cnt, const struct am_tensor *psum,
                          double scale)
{
    const char *k = "am_cuda_moe_aux_loss";
    am_cuda_ctx(k, d);
    double *a = (double *)am_cuda_scalar(k, "acc", acc, AM_F64);
    const float *c = (const float *)am_cuda_data(k, "cnt", cnt, AM_F32), *ps = (const float *)am_cuda_data(k, "psum", psum, AM_F32);
    AM_CUDA_REQUIRE(k, am_tensor_numel(cnt) == am_tensor_numel(psum), "cnt (%s) and psum (%s) must have the same length",
                    am_tname(cnt), am_tname(psum));
    aux_loss_k<<<1, 1, 0, am_cuda_stream(d)>>>(a, c, ps, am_tensor_numel(cnt), scale);
    AM_LAUNCHED(k);
}

/* one block, thread e counts expert e's slots, thread 0 takes the prefix sums, thread e hands
 * out its rows to its slots in slot order */
__global__ void plan_k(int32_t *pos, int32_t *counts, const int32_t *ix, int64_t S, int64_t E)
{
    extern __shared__ int32_t off[];
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
        int32_t c = 0;
        for (int64_t i = 0; i < S; i++)
            c += ix[i] == e;
        counts[e] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t o = 0;
        for (int64_t e = 0; e < E; e++) {
            off[e] = o;
            o += counts[e];
        }
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
        int32_t o = off[e];
        for (int64_t i = 0; i < S; i++)
            if (ix[i] == e)
                pos[i] = o++;
    }
}

void am_cuda_moe_plan(const struct am_dev *d, struct am_tensor *pos, struct am_tensor *counts, const struct am_tensor *idx)
{
    const char *k = "am_cuda_moe_plan";
    am_cuda_ctx(k, d);
    int64_t S = am_tensor_numel(idx), E = am_tensor_numel(counts);
    int32_t *ps = (int32_t *)am_cuda_data(k, "pos", pos, AM_I32), *ct = (int32_t *)am_cuda_data(k, "counts", counts, AM_I32);
    const int32_t *ix = (const int32_t *)am_cuda_data(k, "idx", idx, AM_I32);
    AM_CUDA_REQUIRE(k, am_tensor_numel(pos) == S, "pos (%s) must have idx's %lld slots", am_tname(pos), (long long)S);
    AM_CUDA_REQUIRE(k, E >= 1 && E <= 8192, "counts (%s): %lld experts (1 to 8192 on one rank)", am_tname(counts),
                    (long long)E);
    plan_k<<<1, 1024, (size_t)E * sizeof(int32_t), am_cuda_stream(d)>>>(ps, ct, ix, S, E);
    AM_LAUNCHED(k);
}

__global__ void permute_fwd_k(void *xp, const void *x, bool bf, const int32_t *pos, int64_t S, int64_t C, int64_t k)
{
    AM_GRID_STRIDE(i, S * C)
    {
        int64_t s = i / C, c = i % C;
        stv(xp, bf, (int64_t)pos[s] * C + c, ldv(x, bf, (s / k) * C + c));
    }
}

void am_cuda_moe_permute_forward(const struct am_dev *d, struct am_tensor *xp, const struct am_tensor *x, const struct am_tensor *pos)
{
    const char *k = "am_cuda_moe_permute_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "x", x);
    am_cuda_same(k, "xp", xp, "x", x);
    int64_t N = am_rows(x), C = am_cols(x), K = am_cols(pos);
    const int32_t *ps = (const int32_t *)am_cuda_data(k, "pos", pos, AM_I32);
    want2(k, "pos", pos, N, K);
    want2(k, "xp", xp, N * K, C);
    if (!N || !C)
        return;
    permute_fwd_k<<<am_blocks(N * K * C), AM_THREADS, 0, am_cuda_stream(d)>>>(xp->data, x->data, dt == AM_BF16, ps, N * K, C, K);
    AM_LAUNCHED(k);
}

__global__ void permute_bwd_k(void *dx, const void *dxp, bool bf, const int32_t *pos, int64_t N, int64_t C, int64_t k)
{
    AM_GRID_STRIDE(i, N * C)
    {
        int64_t t = i / C, c = i % C;
        float s = ldv(dx, bf, i);
        for (int64_t j = 0; j < k; j++)
            s += ldv(dxp, bf, (int64_t)pos[t * k + j] * C + c);
        stv(dx, bf, i, s);
    }
}

void am_cuda_moe_permute_backward(const struct am_dev *d, struct am_tensor *dx, const struct am_tensor *dxp, const struct am_tensor *pos)
{
    const char *k = "am_cuda_moe_permute_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "dx", dx);
    am_cuda_same(k, "dxp", dxp, "dx", dx);
    int64_t N = am_rows(dx), C = am_cols(dx), K = am_cols(pos);
    const int32_t *ps = (const int32_t *)am_cuda_data(k, "pos", pos, AM_I32);
    want2(k, "pos", pos, N, K);
    want2(k, "dxp", dxp, N * K, C);
    if (!N || !C)
        return;
    permute_bwd_k<<<am_blocks(N * C), AM_THREADS, 0, am_cuda_stream(d)>>>(dx->data, dxp->data, dt == AM_BF16, ps, N, C, K);
    AM_LAUNCHED(k);
}

__global__ void combine_fwd_k(void *y, const void *yp, bool bf, const int32_t *pos, const float *w, int64_t N, int64_t C,
                              int64_t k)
{
    AM_GRID_STRIDE(i, N * C)
    {
        int64_t t = i / C, c = i % C;
        float s = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            float v = ldv(yp, bf, (int64_t)pos[t * k + j] * C + c) * w[t * k + j];
            s += bf ? am_round_bf16(v) : v;
        }
        stv(y, bf, i, s);
    }
}

void am_cuda_moe_combine_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *yp, const struct am_tensor *pos,
                                 const struct am_tensor *wts)
{
    const char *k = "am_cuda_moe_combine_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "yp", yp);
    am_cuda_same(k, "y", y, "yp", yp);
    int64_t N = am_rows(y), C = am_cols(y), K = am_cols(pos);
    const int32_t *ps = (const int32_t *)am_cuda_data(k, "pos", pos, AM_I32);
    const float *w = (const float *)am_cuda_data(k, "wts", wts, AM_F32);
    want2(k, "pos", pos, N, K);
    want2(k, "wts", wts, N, K);
    want2(k, "yp", yp, N * K, C);
    if (!N || !C)
        return;
    combine_fwd_k<<<am_blocks(N * C), AM_THREADS, 0, am_cuda_stream(d)>>>(y->data, yp->data, dt == AM_BF16, ps, w, N, C, K);
    AM_LAUNCHED(k);
}

__global__ void combine_bwd_dyp_k(void *dyp, const void *dy, bool bf, const int32_t *pos, const float *w, int64_t S, int64_t C,
                                  int64_t k)
{
    AM_GRID_STRIDE(i, S * C)
    {
        int64_t s = i / C, c = i % C, r = (int64_t)pos[s] * C + c;
        stv(dyp, bf, r, ldv(dyp, bf, r) + w[s] * ldv(dy, bf, (s / k) * C + c));
    }
}

__global__ void combine_bwd_dw_k(float *dw, const void *dy, const void *yp, bool bf, const int32_t *pos, int64_t S, int64_t C,
                                 int64_t k)
{
    AM_GRID_STRIDE(s, S)
    {
        int64_t r = pos[s];
        float dot = 0.0f;
        for (int64_t c = 0; c < C; c++)
            dot += ldv(dy, bf, (s / k) * C + c) * ldv(yp, bf, r * C + c);
        dw[s] += dot;
    }
}

void am_cuda_moe_combine_backward(const struct am_dev *d, struct am_tensor *dyp, struct am_tensor *dwts, const struct am_tensor *dy,
                                  const struct am_tensor *yp, const struct am_tensor *pos, const struct am_tensor *wts)
{
    const char *k = "am_cuda_moe_combine_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "dy", dy);
    am_cuda_same(k, "yp", yp, "dy", dy);
    am_cuda_same(k, "dyp", dyp, "dy", dy);
    int64_t N = am_rows(dy), C = am_cols(dy), K = am_cols(pos);
    const int32_t *ps = (const int32_t *)am_cuda_data(k, "pos", pos, AM_I32);
    const float *w = (const float *)am_cuda_data(k, "wts", wts, AM_F32);
    float *dw = (float *)am_cuda_data(k, "dwts", dwts, AM_F32);
    want2(k, "pos", pos, N, K);
    want2(k, "wts", wts, N, K);
    want2(k, "dwts", dwts, N, K);
    want2(k, "yp", yp, N * K, C);
    want2(k, "dyp", dyp, N * K, C);
    if (!N || !C)
        return;
    cudaStream_t s = am_cuda_stream(d);
    combine_bwd_dw_k<<<am_blocks(N * K), AM_THREADS, 0, s>>>(dw, dy->data, yp->data, dt == AM_BF16, ps, N * K, C, K);
    AM_LAUNCHED(k);
    combine_bwd_dyp_k<<<am_blocks(N * K * C), AM_THREADS, 0, s>>>(dyp->data, dy->data, dt == AM_BF16, ps, w, N * K, C, K);
    AM_LAUNCHED(k);
}

static struct am_tensor rows_at(const struct am_tensor *t, int64_t r0, int64_t rows)
{
    int64_t C = am_cols(t);
    return am_tensor_view((char *)t->data + (size_t)(r0 * C) * am_dtype_size(t->dtype), t->device, t->dtype, rows, C, 0, 0);
}

static struct am_tensor expert_w(const struct am_tensor *w, int64_t e)
{
    int64_t n = w->shape[1], kk = w->shape[2];
    return am_tensor_view((char *)w->data + (size_t)(e * n * kk) * am_dtype_size(w->dtype), w->device, w->dtype, n, kk, 0, 0);
}

/* x's rows are the counts' sum; so are the rows of out (y, dy, dx: what the experts' GEMMs
 * write or read per row of x; NULL: none) */
static void check_grouped(const char *k, const struct am_tensor *x, const struct am_tensor *w, const int64_t *counts,
                          const char *out_name, const struct am_tensor *out)
{
    am_cuda_tensor(k, "w", w);
    AM_CUDA_REQUIRE(k, w->ndim == 3, "w (%s) must be [E, Nout, K] (the experts' weights back to back)", am_tname(w));
    int64_t total = 0;
    for (int64_t e = 0; e < w->shape[0]; e++)
        total += counts[e];
    AM_CUDA_REQUIRE(k, total == am_rows(x), "the experts' counts add up to %lld rows; x (%s) has %lld", (long long)total,
                    am_tname(x), (long long)am_rows(x));
    if (!out)
        return;
    am_cuda_tensor(k, out_name, out);
    AM_CUDA_REQUIRE(k, am_rows(out) == total,
                    "%s (%s) has %lld rows; the experts' counts add up to %lld (a row of %s per row of x)", out_name,
                    am_tname(out), (long long)am_rows(out), (long long)total, out_name);
}

void am_cuda_grouped_matmul_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w,
                                    const int64_t *counts)
{
    check_grouped("am_cuda_grouped_matmul_forward", x, w, counts, "y", y);
    int64_t r0 = 0;
    for (int64_t e = 0; e < w->shape[0]; r0 += counts[e], e++) {
        if (!counts[e])
            continue;
        struct am_tensor ye = rows_at(y, r0, counts[e]), xe = rows_at(x, r0, counts[e]), we = expert_w(w, e);
        am_cuda_matmul_forward(d, &ye, &xe, &we);
    }
}

void am_cuda_grouped_matmul_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                                     const struct am_tensor *x, const struct am_tensor *w, const int64_t *counts)
{
    const char *k = "am_cuda_grouped_matmul_backward";
    check_grouped(k, x, w, counts, "dy", dy);
    check_grouped(k, x, w, counts, "dx", dx);
    AM_CUDA_REQUIRE(k, !dw || (dw->ndim == 3 && am_tensor_numel(dw) == am_tensor_numel(w)), "dw (%s) must have w's shape",
                    am_tname(dw));
    int64_t r0 = 0;
    for (int64_t e = 0; e < w->shape[0]; r0 += counts[e], e++) {
        if (!counts[e])
            continue;
        struct am_tensor dye = rows_at(dy, r0, counts[e]), xe = rows_at(x, r0, counts[e]), we = expert_w(w, e);
        struct am_tensor dxe = dx ? rows_at(dx, r0, counts[e]) : we, dwe = dw ? expert_w(dw, e) : we;
        am_cuda_matmul_backward(d, dx ? &dxe : NULL, dw ? &dwe : NULL, &dye, &xe, &we);
    }
}
