/* moe.c - mixture of experts on the CPU (kernels.h has the contract): the router's softmax
 * and top-k with their backward, the load-balancing loss's statistics, the stable counting
 * sort of the routed slots, the permutation to expert order and the weighted combination back,
 * and the experts' linear layers in one call (matmul on each expert's rows).
 *
 * Activations are f32 or bf16 (read widened, each output rounded once); the router's
 * statistics are f32 and computed in fp32 as transformers' softmax(logits.float()). Rows are
 * independent, so the row loops run in parallel; the sums over rows (moe_aux_stats) and over
 * a token's slots (the combination, the permutation's backward) take a fixed order.
 */
#include <omp.h>

#include "cpu.h"
#include "half.h"

/* the shape checks the kernels share: rows x cols of a 2-d tensor */
static void want2(const char *kernel, const char *what, const struct am_tensor *t, int64_t rows, int64_t cols)
{
    am_cpu_check(kernel, what, t);
    AM_CHECK(am_rows(t) == rows && am_cols(t) == cols, "%s (%s) must be [%lld, %lld], not [%lld, %lld]", what,
             am_tname(t), (long long)rows, (long long)cols, (long long)am_rows(t), (long long)am_cols(t));
}

void am_cpu_moe_route_forward(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx, struct am_tensor *wts,
                              const struct am_tensor *logits, bool renorm)
{
    (void)d;
    am_cpu_act(__func__, "logits", logits);
    int64_t N = am_rows(logits), E = am_cols(logits), k = am_cols(idx);
    float *p = F32(probs), *w = F32(wts);
    int32_t *ix = (int32_t *)I32(idx);
    want2(__func__, "probs", probs, N, E);
    want2(__func__, "idx", idx, N, k);
    want2(__func__, "wts", wts, N, k);
    AM_CHECK(k >= 1 && k <= E, "idx (%s) has %lld columns: 1 to the %lld experts", am_tname(idx), (long long)k,
             (long long)E);
#pragma omp parallel for schedule(static) if (N * E >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++) {
        float *pr = p + i * E, mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            pr[e] = am_cpu_ld(logits, i * E + e);
            mx = pr[e] > mx ? pr[e] : mx;
        }
        for (int64_t e = 0; e < E; e++) {
            pr[e] = expf(pr[e] - mx);
            sum += pr[e];
        }
        for (int64_t e = 0; e < E; e++)
            pr[e] /= sum;
        float tsum = 0.0f;
        for (int64_t j = 0; j < k; j++) { /* the j-th largest: ties to the lower expert */
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

void am_cpu_moe_route_backward(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                               const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                               float aux_scale, bool renorm)
{
    am_cpu_act(__func__, "dlogits", dlogits);
    int64_t N = am_rows(dlogits), E = am_cols(dlogits), k = am_cols(idx);
    const float *p = F32(probs), *dw = F32(dwts), *c = cnt ? F32(cnt) : NULL;
    const int32_t *ix = I32(idx);
    want2(__func__, "probs", probs, N, E);
    want2(__func__, "idx", idx, N, k);
    want2(__func__, "dwts", dwts, N, k);
    AM_CHECK(!cnt || am_tensor_numel(cnt) == E, "cnt (%s) must hold the %lld experts' counts", am_tname(cnt),
             (long long)E);
    float *scratch = am_cpu_scratch(__func__, d, (int64_t)omp_get_max_threads() * E);
#pragma omp parallel for schedule(static) if (N * E >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++) {
        float *dp = scratch + (size_t)omp_get_thread_num() * (size_t)E;
        const float *pr = p + i * E;
        for (int64_t e = 0; e < E; e++)
            dp[e] = c ? aux_scale * c[e] : 0.0f;
        float s = 0.0f, dot = 0.0f;
        for (int64_t j = 0; j < k; j++)
            s += pr[ix[i * k + j]];
        for (int64_t j = 0; j < k; j++) /* Σ dw_j w_j with w_j = p_j / s */
            dot += dw[i * k + j] * (pr[ix[i * k + j]] / s);
        for (int64_t j = 0; j < k; j++)
            dp[ix[i * k + j]] += renorm ? (dw[i * k + j] - dot) / s : dw[i * k + j];
        float pd = 0.0f; /* the softmax's backward: dl_e = p_e (dp_e - Σ_f p_f dp_f) */
        for (int64_t e = 0; e < E; e++)
            pd += pr[e] * dp[e];
        for (int64_t e = 0; e < E; e++)
            am_cpu_st(dlogits, i * E + e, am_cpu_ld(dlogits, i * E + e) + pr[e] * (dp[e] - pd));
    }
}

/* The index of the largest of v[0..n) not yet taken (taken[i] set), ties to the lower index. */
static int64_t best_free(const float *v, const bool *taken, int64_t n)
{
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best]))
            best = i;
    return best;
}

void am_cpu_moe_route_sigmoid_forward(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx,
                                      struct am_tensor *wts, const struct am_tensor *logits, const struct am_tensor *bias,
                                      int n_group, int topk_group, bool renorm, float scale)
{
    (void)d;
    am_cpu_act(__func__, "logits", logits);
    int64_t N = am_rows(logits), E = am_cols(logits), k = am_cols(idx);
    float *p = F32(probs), *w = F32(wts);
    const float *bs = F32(bias);
    int32_t *ix = (int32_t *)I32(idx);
    want2(__func__, "probs", probs, N, E);
    want2(__func__, "idx", idx, N, k);
    want2(__func__, "wts", wts, N, k);
    AM_CHECK(am_tensor_numel(bias) == E, "bias (%s) must hold the %lld experts' selection biases", am_tname(bias),
             (long long)E);
    AM_CHECK(n_group >= 1 && E % n_group == 0 && E / n_group >= 2 && topk_group >= 1 && topk_group <= n_group,
             "n_group %d must divide the %lld experts into groups of 2 or more, topk_group %d be 1 to n_group", n_group,
             (long long)E, topk_group);
    int64_t G = E / n_group;
    AM_CHECK(k >= 1 && k <= (int64_t)topk_group * G, "idx (%s) has %lld columns: 1 to the %lld experts of the kept groups",
             am_tname(idx), (long long)k, (long long)topk_group * G);
#pragma omp parallel for schedule(static) if (N * E >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++) {
        float *pr = p + i * E, choice[E], gscore[n_group];
        bool taken[E], gtaken[n_group];
        for (int64_t e = 0; e < E; e++) {
            pr[e] = 1.0f / (1.0f + expf(-am_cpu_ld(logits, i * E + e)));
            choice[e] = pr[e] + bs[e];
            taken[e] = false;
        }
        for (int g = 0; g < n_group; g++) { /* a group's score: its two largest biased scores */
            int64_t a = best_free(choice + g * G, taken + g * G, G);
            taken[g * G + a] = true;
            int64_t b = best_free(choice + g * G, taken + g * G, G);
            taken[g * G + a] = false;
            gscore[g] = choice[g * G + a] + choice[g * G + b];
            gtaken[g] = false;
        }
        for (int j = 0; j < topk_group; j++) /* the kept groups */
            gtaken[best_free(gscore, gtaken, n_group)] = true;
        for (int64_t e = 0; e < E; e++) /* the other groups' experts cannot be chosen */
            taken[e] = !gtaken[e / G];
        float tsum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = best_free(choice, taken, E);
            taken[best] = true;
            ix[i * k + j] = (int32_t)best;
            w[i * k + j] = pr[best];
            tsum += pr[best];
        }
        for (int64_t j = 0; j < k; j++)
            w[i * k + j] = (renorm ? w[i * k + j] / (tsum + 1e-20f) : w[i * k + j]) * scale;
    }
}

void am_cpu_moe_route_sigmoid_backward(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                                       const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                                       float aux_scale, bool renorm, float scale)
{
    (void)d;
    am_cpu_act(__func__, "dlogits", dlogits);
    int64_t N = am_rows(dlogits), E = am_cols(dlogits), k = am_cols(idx);
    const float *p = F32(probs), *dw = F32(dwts), *c = cnt ? F32(cnt) : NULL;
    const int32_t *ix = I32(idx);
    want2(__func__, "probs", probs, N, E);
    want2(__func__, "idx", idx, N, k);
    want2(__func__, "dwts", dwts, N, k);
    AM_CHECK(!cnt || am_tensor_numel(cnt) == E, "cnt (%s) must hold the %lld experts' counts", am_tname(cnt),
             (long long)E);
#pragma omp parallel for schedule(static) if (N * E >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++) {
        const float *pr = p + i * E;
        float s = 1e-20f, dot = 0.0f; /* w_j = scale p_j / s with s = Σ p + 1e-20 (renorm) */
        for (int64_t j = 0; j < k; j++)
            s += pr[ix[i * k + j]];
        for (int64_t j = 0; j < k; j++)
            dot += dw[i * k + j] * pr[ix[i * k + j]];
        for (int64_t j = 0; j < k; j++) {
            int64_t e = ix[i * k + j];
            float dp = renorm ? scale * (dw[i * k + j] / s - dot / (s * s)) : scale * dw[i * k + j];
            am_cpu_st(dlogits, i * E + e, am_cpu_ld(dlogits, i * E + e) + dp * pr[e] * (1.0f - pr[e]));
        }
        if (!c)
            continue;
        /* AutoModel's load-balancing loss: g_e = aux_scale cnt[e] on every score q_e, q = p / (Σ p
         * + 1e-20) when renorm (else p), taken back through the normalisation and the sigmoid */
        float S = 1e-20f, gq = 0.0f;
        for (int64_t e = 0; renorm && e < E; e++)
            S += pr[e];
        for (int64_t e = 0; renorm && e < E; e++)
            gq += aux_scale * c[e] * (pr[e] / S);
        for (int64_t e = 0; e < E; e++) {
            float dp = renorm ? (aux_scale * c[e] - gq) / S : aux_scale * c[e];
            am_cpu_st(dlogits, i * E + e, am_cpu_ld(dlogits, i * E + e) + dp * pr[e] * (1.0f - pr[e]));
        }
    }
}

void am_cpu_moe_aux_stats(const struct am_dev *d, struct am_tensor *cnt, struct am_tensor *psum, const struct am_tensor *probs,
                          const struct am_tensor *idx, bool renorm)
{
    int64_t N = am_rows(probs), E = am_cols(probs), k = am_cols(idx);
    float *c = F32(cnt), *ps = F32(psum);
    const float *p = F32(probs);
    const int32_t *ix = I32(idx);
    want2(__func__, "idx", idx, N, k);
    AM_CHECK(am_tensor_numel(cnt) == E && am_tensor_numel(psum) == E, "cnt (%s) and psum (%s) must hold %lld experts",
             am_tname(cnt), am_tname(psum), (long long)E);
    float *den = renorm ? am_cpu_scratch(__func__, d, N > 0 ? N : 1) : NULL; /* each row's Σ p + 1e-20 */
    for (int64_t i = 0; renorm && i < N; i++) {
        float s = 0.0f;
        for (int64_t e = 0; e < E; e++)
            s += p[i * E + e];
        den[i] = s + 1e-20f;
    }
    for (int64_t e = 0; e < E; e++) {
        float s = 0.0f;
        for (int64_t i = 0; i < N; i++)
            s += renorm ? p[i * E + e] / den[i] : p[i * E + e];
        ps[e] += s;
    }
    for (int64_t i = 0; i < N * k; i++)
        c[ix[i]] += 1.0f;
}

void am_cpu_moe_aux_loss(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *cnt, const struct am_tensor *psum,
                         double scale)
{
    (void)d;
    double *a = F64_SCALAR(acc), s = 0.0;
    const float *c = F32(cnt), *ps = F32(psum);
    AM_CHECK(am_tensor_numel(cnt) == am_tensor_numel(psum), "cnt (%s) and psum (%s) must have the same length",
             am_tname(cnt), am_tname(psum));
    for (int64_t e = 0; e < am_tensor_numel(cnt); e++)
        s += (double)c[e] * (double)ps[e];
    *a += scale * s;
}

void am_cpu_moe_plan(const struct am_dev *d, struct am_tensor *pos, struct am_tensor *counts, const struct am_tensor *idx)
{
    (void)d;
    int64_t S = am_tensor_numel(idx), E = am_tensor_numel(counts);
    const int32_t *ix = I32(idx);
    int32_t *ps = (int32_t *)I32(pos), *ct = (int32_t *)I32(counts);
    AM_CHECK(am_tensor_numel(pos) == S, "pos (%s) must have idx's %lld slots", am_tname(pos), (long long)S);
    memset(ct, 0, (size_t)E * sizeof(*ct));
    for (int64_t i = 0; i < S; i++) {
        AM_CHECK(ix[i] >= 0 && ix[i] < E, "idx (%s) holds expert %d, not one of the %lld", am_tname(idx), ix[i],
                 (long long)E);
        ct[ix[i]]++;
    }
    int32_t *next = (int32_t *)am_cpu_scratch(__func__, d, E); /* each expert's next row */
    int32_t off = 0;
    for (int64_t e = 0; e < E; e++) {
        next[e] = off;
        off += ct[e];
    }
    for (int64_t i = 0; i < S; i++)
        ps[i] = next[ix[i]]++;
}

/* f32 rows of the permutation's and the combination's loops: each element's sum takes the
 * same terms in the same order as the element-wise loops below them (no contraction: mul,
 * then add, each rounded), a row at a time so that the inner loops are contiguous. */
AM_HOT static void add_row(float *restrict o, const float *restrict a, int64_t C)
{
#pragma omp simd
    for (int64_t c = 0; c < C; c++)
        o[c] += a[c];
}

AM_HOT static void add_row_scaled(float *restrict o, const float *restrict a, float w, int64_t C)
{
#pragma omp simd
    for (int64_t c = 0; c < C; c++)
        o[c] += a[c] * w;
}

/* Token i's slots in the combination's backward: dyp[r] += w_j dy, dwts[j] += dy · yp[r] (the
 * dot over c in order, from 0); four slots' dots at a time, each its own chain of adds. */
AM_HOT static void combine_backward_row(float *restrict dyp, float *restrict dw, const float *restrict g,
                                        const float *restrict yp, const int32_t *ps, const float *w, int64_t k,
                                        int64_t C)
{
    int64_t j = 0;
    for (; j + 4 <= k; j += 4) {
        const float *restrict y0 = yp + (int64_t)ps[j] * C, *restrict y1 = yp + (int64_t)ps[j + 1] * C;
        const float *restrict y2 = yp + (int64_t)ps[j + 2] * C, *restrict y3 = yp + (int64_t)ps[j + 3] * C;
        float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
        for (int64_t c = 0; c < C; c++) {
            d0 += g[c] * y0[c];
            d1 += g[c] * y1[c];
            d2 += g[c] * y2[c];
            d3 += g[c] * y3[c];
        }
        dw[j] += d0, dw[j + 1] += d1, dw[j + 2] += d2, dw[j + 3] += d3;
    }
    for (; j < k; j++) {
        const float *restrict y0 = yp + (int64_t)ps[j] * C;
        float d0 = 0.0f;
        for (int64_t c = 0; c < C; c++)
            d0 += g[c] * y0[c];
        dw[j] += d0;
    }
    for (j = 0; j < k; j++) /* w_j g is g w_j, the same product */
        add_row_scaled(dyp + (int64_t)ps[j] * C, g, w[j], C);
}

void am_cpu_moe_permute_forward(const struct am_dev *d, struct am_tensor *xp, const struct am_tensor *x, const struct am_tensor *pos)
{
    (void)d;
    am_cpu_act(__func__, "x", x);
    am_cpu_same(__func__, "xp", xp, "x", x);
    int64_t N = am_rows(x), C = am_cols(x), k = am_cols(pos);
    const int32_t *ps = I32(pos);
    want2(__func__, "pos", pos, N, k);
    want2(__func__, "xp", xp, N * k, C);
    size_t es = am_dtype_size(x->dtype);
#pragma omp parallel for schedule(static) if (N * k * C >= AM_PAR_MIN)
    for (int64_t s = 0; s < N * k; s++)
        memcpy((char *)xp->data + (size_t)ps[s] * (size_t)C * es, (const char *)x->data + (size_t)(s / k) * (size_t)C * es,
               (size_t)C * es);
}

void am_cpu_moe_permute_backward(const struct am_dev *d, struct am_tensor *dx, const struct am_tensor *dxp, const struct am_tensor *pos)
{
    (void)d;
    am_cpu_act(__func__, "dx", dx);
    am_cpu_same(__func__, "dxp", dxp, "dx", dx);
    int64_t N = am_rows(dx), C = am_cols(dx), k = am_cols(pos);
    const int32_t *ps = I32(pos);
    want2(__func__, "pos", pos, N, k);
    want2(__func__, "dxp", dxp, N * k, C);
    if (dx->dtype == AM_F32) { /* the same sums, a slot's row at a time (vectorised over c) */
        float *dxd = F32(dx);
        const float *dpd = F32(dxp);
#pragma omp parallel for schedule(static) if (N * k * C >= AM_PAR_MIN)
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < k; j++)
                add_row(dxd + i * C, dpd + (int64_t)ps[i * k + j] * C, C);
        return;
    }
#pragma omp parallel for schedule(static) if (N * k * C >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++)
        for (int64_t c = 0; c < C; c++) {
            float s = am_cpu_ld(dx, i * C + c);
            for (int64_t j = 0; j < k; j++)
                s += am_cpu_ld(dxp, (int64_t)ps[i * k + j] * C + c);
            am_cpu_st(dx, i * C + c, s);
        }
}

void am_cpu_moe_combine_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *yp, const struct am_tensor *pos,
                                const struct am_tensor *wts)
{
    (void)d;
    am_cpu_act(__func__, "yp", yp);
    am_cpu_same(__func__, "y", y, "yp", yp);
    int64_t N = am_rows(y), C = am_cols(y), k = am_cols(pos);
    const int32_t *ps = I32(pos);
    const float *w = F32(wts);
    want2(__func__, "pos", pos, N, k);
    want2(__func__, "wts", wts, N, k);
    want2(__func__, "yp", yp, N * k, C);
    bool bf = y->dtype != AM_F32;
    if (!bf) { /* the same sums from 0, a slot's row at a time (vectorised over c) */
        float *yd = F32(y);
        const float *ypd = F32(yp);
#pragma omp parallel for schedule(static) if (N * k * C >= AM_PAR_MIN)
        for (int64_t i = 0; i < N; i++) {
            for (int64_t c = 0; c < C; c++)
                yd[i * C + c] = 0.0f;
            for (int64_t j = 0; j < k; j++)
                add_row_scaled(yd + i * C, ypd + (int64_t)ps[i * k + j] * C, w[i * k + j], C);
        }
        return;
    }
#pragma omp parallel for schedule(static) if (N * k * C >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++)
        for (int64_t c = 0; c < C; c++) {
            float s = 0.0f;
            for (int64_t j = 0; j < k; j++) { /* transformers: index_add_ of yp * w, in the activations' dtype */
                float t = am_cpu_ld(yp, (int64_t)ps[i * k + j] * C + c) * w[i * k + j];
                s += bf ? am_bf16_to_f32(am_f32_to_bf16(t)) : t;
            }
            am_cpu_st(y, i * C + c, s);
        }
}

void am_cpu_moe_combine_backward(const struct am_dev *d, struct am_tensor *dyp, struct am_tensor *dwts, const struct am_tensor *dy,
                                 const struct am_tensor *yp, const struct am_tensor *pos, const struct am_tensor *wts)
{
    (void)d;
    am_cpu_act(__func__, "dy", dy);
    am_cpu_same(__func__, "yp", yp, "dy", dy);
    am_cpu_same(__func__, "dyp", dyp, "dy", dy);
    int64_t N = am_rows(dy), C = am_cols(dy), k = am_cols(pos);
    const int32_t *ps = I32(pos);
    const float *w = F32(wts);
    float *dw = F32(dwts);
    want2(__func__, "pos", pos, N, k);
    want2(__func__, "wts", wts, N, k);
    want2(__func__, "dwts", dwts, N, k);
    want2(__func__, "yp", yp, N * k, C);
    want2(__func__, "dyp", dyp, N * k, C);
    if (dy->dtype == AM_F32) {
        const float *dyd = F32(dy), *ypd = F32(yp);
        float *dypd = F32(dyp);
#pragma omp parallel for schedule(static) if (N * k * C >= AM_PAR_MIN)
        for (int64_t i = 0; i < N; i++)
            combine_backward_row(dypd, dw + i * k, dyd + i * C, ypd, ps + i * k, w + i * k, k, C);
        return;
    }
#pragma omp parallel for schedule(static) if (N * k * C >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < k; j++) {
            int64_t r = ps[i * k + j];
            float dot = 0.0f;
            for (int64_t c = 0; c < C; c++) {
                float g = am_cpu_ld(dy, i * C + c);
                dot += g * am_cpu_ld(yp, r * C + c);
                am_cpu_st(dyp, r * C + c, am_cpu_ld(dyp, r * C + c) + w[i * k + j] * g);
            }
            dw[i * k + j] += dot;
        }
}

/* Expert e's rows of a [S, cols] tensor and its [Nout, K] matrix of w [E, Nout, K]. */
static struct am_tensor rows_at(const struct am_tensor *t, int64_t r0, int64_t rows)
{
    int64_t C = am_cols(t);
    return am_tensor_view((char *)t->data + (size_t)(r0 * C) * am_dtype_size(t->dtype), t->device, t->dtype,
                          rows, C, 0, 0);
}

static struct am_tensor expert_w(const struct am_tensor *w, int64_t e)
{
    int64_t n = w->shape[1], k = w->shape[2];
    return am_tensor_view((char *)w->data + (size_t)(e * n * k) * am_dtype_size(w->dtype), w->device, w->dtype, n, k, 0,
                          0);
}

static int64_t check_grouped(const char *kernel, const struct am_tensor *x, const struct am_tensor *w,
                             const int64_t *counts)
{
    am_cpu_check(kernel, "w", w);
    AM_CHECK(w->ndim == 3, "w (%s) must be [E, Nout, K] (the experts' weights back to back)", am_tname(w));
    int64_t total = 0;
    for (int64_t e = 0; e < w->shape[0]; e++)
        total += counts[e];
    AM_CHECK(total == am_rows(x), "the experts' counts add up to %lld rows; x (%s) has %lld", (long long)total,
             am_tname(x), (long long)am_rows(x));
    return total;
}

void am_cpu_grouped_matmul_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w,
                                   const int64_t *counts)
{
    int64_t total = check_grouped(__func__, x, w, counts);
    am_cpu_check(__func__, "y", y);
    AM_CHECK(am_rows(y) == total, "y (%s) has %lld rows; the experts' counts add up to %lld (a row of y per row of x)",
             am_tname(y), (long long)am_rows(y), (long long)total);
    int64_t r0 = 0;
    for (int64_t e = 0; e < w->shape[0]; r0 += counts[e], e++) {
        if (!counts[e])
            continue;
        struct am_tensor ye = rows_at(y, r0, counts[e]), xe = rows_at(x, r0, counts[e]), we = expert_w(w, e);
        am_cpu_matmul_forward(d, &ye, &xe, &we);
    }
}

void am_cpu_grouped_matmul_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                                    const struct am_tensor *x, const struct am_tensor *w, const int64_t *counts)
{
    int64_t total = check_grouped(__func__, x, w, counts);
    am_cpu_check(__func__, "dy", dy);
    AM_CHECK(am_rows(dy) == total,
             "dy (%s) has %lld rows; the experts' counts add up to %lld (a row of dy per row of x)", am_tname(dy),
             (long long)am_rows(dy), (long long)total);
    if (dx)
        am_cpu_check(__func__, "dx", dx);
    AM_CHECK(!dx || am_rows(dx) == total,
             "dx (%s) has %lld rows; the experts' counts add up to %lld (a row of dx per row of x)", am_tname(dx),
             (long long)am_rows(dx), (long long)total);
    AM_CHECK(!dw || (dw->ndim == 3 && am_tensor_numel(dw) == am_tensor_numel(w)), "dw (%s) must have w's shape",
             am_tname(dw));
    int64_t r0 = 0;
    for (int64_t e = 0; e < w->shape[0]; r0 += counts[e], e++) {
        if (!counts[e])
            continue;
        struct am_tensor dye = rows_at(dy, r0, counts[e]), xe = rows_at(x, r0, counts[e]), we = expert_w(w, e);
        struct am_tensor dxe = dx ? rows_at(dx, r0, counts[e]) : (struct am_tensor){0}, dwe = dw ? expert_w(dw, e) : we;
        am_cpu_matmul_backward(d, dx ? &dxe : NULL, dw ? &dwe : NULL, &dye, &xe, &we);
    }
}
