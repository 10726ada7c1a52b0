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
 */
#include <math.h>
#include <omp.h>

#include "cpu.h"

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

void am_cpu_rmsnorm_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                            const struct am_tensor *w, float eps)
{
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

void am_cpu_rmsnorm_backward(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dout,
                             const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *rstd)
{
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
