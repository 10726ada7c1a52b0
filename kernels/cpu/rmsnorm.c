/* rmsnorm.c - RMSNorm as Hugging Face's LlamaRMSNorm computes it in fp32:
 *
 *   rstd_i  = 1 / sqrt(mean_j x_ij² + eps)
 *   out_ij  = w_j * (x_ij * rstd_i)        (torch rounds x * rstd first, then scales by w)
 *
 * backward, with g_ij = dout_ij * w_j and x̂_ij = x_ij * rstd_i:
 *   dx_ij  += rstd_i * (g_ij - x̂_ij * mean_k(g_ik * x̂_ik))
 *   dw_j   += Σ_i dout_ij * x̂_ij
 * The mean of squares is accumulated in double (then rounded once), which agrees with
 * torch's fp32 reduction to about an ulp and does not depend on C's blocking.
 * dx rows are independent (parallel over rows); dw sums over rows, so each thread owns a
 * slice of the columns and adds the rows in order (deterministic, no races).
 *
 * bf16 (x, out, w, dout, dx bf16; dw f32 or bf16; rstd f32): transformers' LlamaRMSNorm in
 * bf16, in its order, which is cheap to follow exactly:
 *   h = x.float(); h = h * rsqrt(mean(h²) + eps); return w * h.to(bf16)
 * i.e. out_ij = bf16(w_j * bf16(x_ij * rstd_i)): x̂ is rounded to bf16 before the product
 * with the bf16 weight, and the product (fp32, exact for two bf16 values) rounded again.
 * The backward widens its inputs (rows in chunks) and runs the fp32 backward above, so it
 * differentiates the forward without its two roundings (dw uses the unrounded x̂, dx the
 * unrounded dout * w where torch rounds each to bf16) and rounds dx (and a bf16 dw) once.
 */
#include <math.h>
#include <omp.h>

#include "cpu.h"
#include "half.h"

AM_HOT static void rmsnorm_row(float *restrict out, float *restrict rstd, const float *restrict x,
                               const float *restrict w, float eps, int64_t C)
{
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < C; j++)
        ss += (double)x[j] * (double)x[j];
    float r = 1.0f / sqrtf((float)(ss / (double)C) + eps);
    *rstd = r;
#pragma omp simd
    for (int64_t j = 0; j < C; j++)
        out[j] = w[j] * (x[j] * r);
}

AM_HOT static void rmsnorm_row_bf16(uint16_t *restrict out, float *restrict rstd, const uint16_t *restrict x,
                                    const uint16_t *restrict w, float eps, int64_t C)
{
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < C; j++) {
        double v = am_bf16_to_f32(x[j]);
        ss += v * v;
    }
    float r = 1.0f / sqrtf((float)(ss / (double)C) + eps);
    *rstd = r;
#pragma omp simd
    for (int64_t j = 0; j < C; j++) {
        float h = am_bf16_to_f32(am_f32_to_bf16(am_bf16_to_f32(x[j]) * r)); /* hidden_states.to(bf16) */
        out[j] = am_f32_to_bf16(am_bf16_to_f32(w[j]) * h);                 /* weight * that, in bf16 */
    }
}

static void check_fwd(const char *kernel, const struct am_tensor *out, const struct am_tensor *rstd,
                      const struct am_tensor *x, const struct am_tensor *w)
{
    int64_t N = am_rows(x), C = am_cols(x);
    AM_CHECK(am_tensor_numel(w) == C, "w (%s) has %lld elements for rows of %lld (called from %s)", am_tname(w),
             (long long)am_tensor_numel(w), (long long)C, kernel);
    AM_CHECK(am_tensor_numel(out) == N * C, "out (%s) must have x's shape (called from %s)", am_tname(out), kernel);
    AM_CHECK(am_tensor_numel(rstd) == N, "rstd (%s) has %lld elements for %lld rows (called from %s)", am_tname(rstd),
             (long long)am_tensor_numel(rstd), (long long)N, kernel);
}

static void rmsnorm_forward_bf16(struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                                 const struct am_tensor *w, float eps)
{
    const char *kernel = "am_cpu_rmsnorm_forward";
    am_cpu_act(kernel, "x", x);
    am_cpu_same(kernel, "w", w, "x", x);
    am_cpu_same(kernel, "out", out, "x", x);
    am_cpu_stat(kernel, "rstd", rstd);
    check_fwd(kernel, out, rstd, x, w);
    int64_t N = am_rows(x), C = am_cols(x);
    uint16_t *o = out->data;
    const uint16_t *xd = x->data, *wd = w->data;
    float *r = rstd->data;
#pragma omp parallel for schedule(static) if (N * C >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++)
        rmsnorm_row_bf16(o + i * C, r + i, xd + i * C, wd, eps, C);
}

void am_cpu_rmsnorm_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                            const struct am_tensor *w, float eps)
{
    if (am_not_f32(out) || am_not_f32(x) || am_not_f32(w)) {
        rmsnorm_forward_bf16(out, rstd, x, w, eps);
        return;
    }
    float *o = F32(out), *r = F32(rstd);
    const float *xd = F32(x), *wd = F32(w);
    int64_t N = am_rows(x), C = am_cols(x);
    AM_CHECK(am_tensor_numel(w) == C, "w (%s) has %lld elements for rows of %lld", am_tname(w),
             (long long)am_tensor_numel(w), (long long)C);
    AM_CHECK(am_tensor_numel(out) == N * C, "out (%s) must have x's shape", am_tname(out));
    AM_CHECK(am_tensor_numel(rstd) == N, "rstd (%s) has %lld elements for %lld rows", am_tname(rstd),
             (long long)am_tensor_numel(rstd), (long long)N);
#pragma omp parallel for schedule(static) if (N * C >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++)
        rmsnorm_row(o + i * C, r + i, xd + i * C, wd, eps, C);
}

AM_HOT static void rmsnorm_row_backward(float *restrict dx, const float *restrict dout, const float *restrict x,
                                        const float *restrict w, float r, int64_t C)
{
    /* mean_k(g_k x̂_k) = r/C Σ_k dout_k w_k x_k */
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < C; j++)
        dot += dout[j] * w[j] * x[j];
    float c = dot * r * r / (float)C; /* = mean(g x̂) * rstd, applied to x */
#pragma omp simd
    for (int64_t j = 0; j < C; j++)
        dx[j] += r * (dout[j] * w[j] - x[j] * c);
}

AM_HOT static void rmsnorm_dw_rows(float *restrict dw, const float *restrict dout, const float *restrict x,
                                   const float *restrict rstd, int64_t N, int64_t C, int64_t c0, int64_t c1)
{
    for (int64_t i = 0; i < N; i++) {
        const float *restrict d = dout + i * C, *restrict xi = x + i * C;
        float r = rstd[i];
#pragma omp simd
        for (int64_t j = c0; j < c1; j++)
            dw[j] += d[j] * (xi[j] * r);
    }
}

void am_cpu_rmsnorm_backward_rows(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw,
                                  const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                  const struct am_tensor *rstd, float w_offset, const char *kernel)
{
    am_cpu_act(kernel, "x", x);
    am_cpu_same(kernel, "w", w, "x", x);
    am_cpu_same(kernel, "dout", dout, "x", x);
    am_cpu_stat(kernel, "rstd", rstd);
    if (dx)
        am_cpu_same(kernel, "dx", dx, "x", x);
    if (dw)
        am_cpu_grad(kernel, "dw", dw, "x", x);
    int64_t N = am_rows(x), C = am_cols(x);
    AM_CHECK(am_tensor_numel(w) == C && am_tensor_numel(rstd) == N && am_tensor_numel(dout) == N * C,
             "w (%s) must be [%lld], rstd [%lld] and dout x's shape", am_tname(w), (long long)C, (long long)N);
    AM_CHECK(!dx || am_tensor_numel(dx) == N * C, "dx (%s) must have x's shape", am_tname(dx));
    AM_CHECK(!dw || am_tensor_numel(dw) == C, "dw (%s) must have w's shape", am_tname(dw));
    int64_t R = am_cpu_chunk(dev) / (C > 0 ? C : 1);
    R = R < 1 ? 1 : R > N ? N : R;
    float *ws = am_cpu_scratch(kernel, dev, 3 * R * C + 2 * C + 64);
    float *xb = am_cpu_carve(&ws, R * C), *db = am_cpu_carve(&ws, R * C), *dxb = am_cpu_carve(&ws, R * C);
    float *wf = am_cpu_carve(&ws, C);
    const float *wl = am_cpu_load(w, 0, C, wf); /* in place when w is f32: read, never written */
    for (int64_t j = 0; j < C; j++)
        wf[j] = wl[j] + w_offset;
    float *dwf = dw ? am_cpu_load(dw, 0, C, am_cpu_carve(&ws, C)) : NULL;
    struct am_tensor tw = am_f32_view(wf, C, 0, 0, 0), tdw = am_f32_view(dwf, C, 0, 0, 0);
    for (int64_t r0 = 0; r0 < N; r0 += R) {
        int64_t nr = N - r0 < R ? N - r0 : R;
        struct am_tensor tx = am_f32_view(am_cpu_load(x, r0 * C, nr * C, xb), nr, C, 0, 0);
        struct am_tensor td = am_f32_view(am_cpu_load(dout, r0 * C, nr * C, db), nr, C, 0, 0);
        struct am_tensor tr = am_f32_view((float *)rstd->data + r0, nr, 0, 0, 0);
        struct am_tensor tdx = am_f32_view(dx ? am_cpu_load(dx, r0 * C, nr * C, dxb) : NULL, nr, C, 0, 0);
        am_cpu_rmsnorm_backward(dev, dx ? &tdx : NULL, dw ? &tdw : NULL, &td, &tx, &tw, &tr);
        if (dx)
            am_cpu_store(dx, r0 * C, nr * C, tdx.data);
    }
    if (dw)
        am_cpu_store(dw, 0, C, dwf);
}

void am_cpu_rmsnorm_backward(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dout,
                             const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *rstd)
{
    if (am_not_f32(dx) || am_not_f32(dw) || am_not_f32(dout) || am_not_f32(x) || am_not_f32(w)) {
        am_cpu_rmsnorm_backward_rows(dev, dx, dw, dout, x, w, rstd, 0.0f, "am_cpu_rmsnorm_backward");
        return;
    }
    const float *d = F32(dout), *xd = F32(x), *wd = F32(w), *r = F32(rstd);
    int64_t N = am_rows(x), C = am_cols(x);
    AM_CHECK(am_tensor_numel(w) == C && am_tensor_numel(rstd) == N && am_tensor_numel(dout) == N * C,
             "w (%s) must be [%lld], rstd [%lld] and dout x's shape", am_tname(w), (long long)C, (long long)N);
    float *dxd = dx ? F32(dx) : NULL;
    float *dwd = dw ? F32(dw) : NULL;
    AM_CHECK(!dx || am_tensor_numel(dx) == N * C, "dx (%s) must have x's shape", am_tname(dx));
    AM_CHECK(!dw || am_tensor_numel(dw) == C, "dw (%s) must have w's shape", am_tname(dw));
#pragma omp parallel if (N * C >= AM_PAR_MIN)
    {
        if (dxd) {
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < N; i++)
                rmsnorm_row_backward(dxd + i * C, d + i * C, xd + i * C, wd, r[i], C);
        }
        if (dwd) {
            int64_t c0, c1;
            am_split(C, omp_get_thread_num(), omp_get_num_threads(), 16, &c0, &c1);
            rmsnorm_dw_rows(dwd, d, xd, r, N, C, c0, c1);
        }
    }
}
