/* gemma.c - the layers Gemma 2 and Gemma 3 add to a Llama-style decoder (kernels.h):
 *
 * rmsnorm_offset: Gemma2RMSNorm / Gemma3RMSNorm, all in fp32 and rounded once:
 *   out_ij = (x_ij * rstd_i) * (1 + w_j)
 *   i.e. rmsnorm (rmsnorm.c) with the fp32 weight 1 + w, which is also its backward: dx as
 *   rmsnorm's with 1 + w, dw_j += Σ_i dout_ij x̂_ij (d(1 + w) = dw). Rows go in chunks,
 *   widened into scratch (bf16) or read in place (fp32), through rmsnorm's fp32 kernels (the
 *   backward is rmsnorm.c's am_cpu_rmsnorm_backward_rows with the offset 1).
 *
 * geglu: out = gelu_tanh(gate) * up, torch's gelu(approximate="tanh") in fp32:
 *   inner = sqrt(2/pi) * (g + 0.044715 g³),  gelu = 0.5 g (1 + tanh(inner))
 *   backward: dup   += dout * gelu(g)
 *             dgate += dout * up * (0.5 (1 + tanh(inner))
 *                                   + 0.5 g (1 - tanh²(inner)) sqrt(2/pi) (1 + 3 * 0.044715 g²))
 *   (torch's GeluBackward formula). bf16: widened in blocks, each output rounded once.
 */
#include <math.h>
#include <omp.h>

#include "cpu.h"

/* ---- RMSNorm with weight 1 + w ---- */

static int64_t rows_per_chunk(const struct am_dev *dev, int64_t N, int64_t C)
{
    int64_t R = am_cpu_chunk(dev) / (C > 0 ? C : 1);
    return R < 1 ? 1 : R > N ? (N > 0 ? N : 1) : R;
}

/* 1 + w in fp32 (w f32 or bf16) */
static float *one_plus(const struct am_tensor *w, int64_t C, float *buf)
{
    const float *wf = am_cpu_load(w, 0, C, buf);
    for (int64_t j = 0; j < C; j++)
        buf[j] = 1.0f + wf[j];
    return buf;
}

void am_cpu_rmsnorm_offset_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *rstd,
                                   const struct am_tensor *x, const struct am_tensor *w, float eps)
{
    const char *kernel = "am_cpu_rmsnorm_offset_forward";
    am_cpu_act(kernel, "x", x);
    am_cpu_same(kernel, "w", w, "x", x);
    am_cpu_same(kernel, "out", out, "x", x);
    am_cpu_stat(kernel, "rstd", rstd);
    int64_t N = am_rows(x), C = am_cols(x);
    AM_CHECK(am_tensor_numel(w) == C, "w (%s) has %lld elements for rows of %lld", am_tname(w),
             (long long)am_tensor_numel(w), (long long)C);
    AM_CHECK(am_tensor_numel(out) == N * C, "out (%s) must have x's shape", am_tname(out));
    AM_CHECK(am_tensor_numel(rstd) == N, "rstd (%s) has %lld elements for %lld rows", am_tname(rstd),
             (long long)am_tensor_numel(rstd), (long long)N);
    int64_t R = rows_per_chunk(dev, N, C);
    float *ws = am_cpu_scratch(kernel, dev, 2 * R * C + C + 64);
    float *xb = am_cpu_carve(&ws, R * C), *ob = am_cpu_carve(&ws, R * C), *w1 = am_cpu_carve(&ws, C);
    one_plus(w, C, w1);
    struct am_tensor tw = am_f32_view(w1, C, 0, 0, 0);
    for (int64_t r0 = 0; r0 < N; r0 += R) {
        int64_t nr = N - r0 < R ? N - r0 : R;
        struct am_tensor tx = am_f32_view(am_cpu_load(x, r0 * C, nr * C, xb), nr, C, 0, 0);
        float *o = out->dtype == AM_F32 ? (float *)out->data + r0 * C : ob;
        struct am_tensor to = am_f32_view(o, nr, C, 0, 0), tr = am_f32_view((float *)rstd->data + r0, nr, 0, 0, 0);
        am_cpu_rmsnorm_forward(dev, &to, &tr, &tx, &tw, eps);
        am_cpu_store(out, r0 * C, nr * C, o);
    }
}

void am_cpu_rmsnorm_offset_backward(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw,
                                    const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                    const struct am_tensor *rstd)
{
    am_cpu_rmsnorm_backward_rows(dev, dx, dw, dout, x, w, rstd, 1.0f, "am_cpu_rmsnorm_offset_backward");
}

/* ---- GeGLU ---- */

#define GELU_BETA 0.7978845608028654f /* sqrt(2 / pi): torch's M_SQRT2 * M_2_SQRTPI * 0.5 */
#define GELU_KAPPA 0.044715f
#define GEGLU_BLOCK 16384

static inline float gelu_tanh(float g)
{
    float inner = GELU_BETA * (g + GELU_KAPPA * (g * g * g));
    return 0.5f * g * (1.0f + tanhf(inner));
}

static inline float gelu_tanh_grad(float g)
{
    float g2 = g * g, inner = GELU_BETA * (g + GELU_KAPPA * (g2 * g)), t = tanhf(inner);
    float left = 0.5f * g, right = 1.0f + t;
    float left_d = 0.5f * right, right_d = left * (1.0f - t * t) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * g2);
    return left_d + right_d;
}

AM_HOT static void geglu_fwd(float *restrict out, const float *restrict gate, const float *restrict up, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = gelu_tanh(gate[i]) * up[i];
}

AM_HOT static void geglu_bwd(float *restrict dgate, float *restrict dup, const float *restrict dout,
                             const float *restrict gate, const float *restrict up, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        if (dup)
            dup[i] += dout[i] * gelu_tanh(g);
        if (dgate)
            dgate[i] += dout[i] * up[i] * gelu_tanh_grad(g);
    }
}

/* Block b of t as fp32: t itself (f32) or widened into buf. */
static inline float *blk(const struct am_tensor *t, int64_t lo, int64_t len, float *buf)
{
    if (t->dtype == AM_F32)
        return (float *)t->data + lo;
    am_bf16_widen1(buf, (const uint16_t *)t->data + lo, len);
    return buf;
}

static inline void put(struct am_tensor *t, int64_t lo, int64_t len, const float *buf)
{
    if (t->dtype != AM_F32)
        am_bf16_narrow1((uint16_t *)t->data + lo, buf, len);
}

void am_cpu_geglu_forward(const struct am_dev *dev, struct am_tensor *out, const struct am_tensor *gate,
                          const struct am_tensor *up)
{
    const char *kernel = "am_cpu_geglu_forward";
    am_cpu_glu_check(kernel, out, gate, up);
    int64_t n = am_tensor_numel(out), nb = (n + GEGLU_BLOCK - 1) / GEGLU_BLOCK;
    float *ws = am_cpu_scratch(kernel, dev, (int64_t)omp_get_max_threads() * 3 * GEGLU_BLOCK);
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * GEGLU_BLOCK, len = n - lo < GEGLU_BLOCK ? n - lo : GEGLU_BLOCK;
        float *buf = ws + (size_t)omp_get_thread_num() * 3 * GEGLU_BLOCK;
        float *o = blk(out, lo, len, buf + 2 * GEGLU_BLOCK);
        geglu_fwd(o, blk(gate, lo, len, buf), blk(up, lo, len, buf + GEGLU_BLOCK), len);
        put(out, lo, len, o);
    }
}

void am_cpu_geglu_backward(const struct am_dev *dev, struct am_tensor *dgate, struct am_tensor *dup,
                           const struct am_tensor *dout, const struct am_tensor *gate, const struct am_tensor *up)
{
    const char *kernel = "am_cpu_geglu_backward";
    am_cpu_glu_check(kernel, dout, gate, up);
    AM_CHECK(!dgate || (dgate->dtype == gate->dtype && am_tensor_numel(dgate) == am_tensor_numel(gate)),
             "dgate (%s) must have gate's shape and dtype", am_tname(dgate));
    AM_CHECK(!dup || (dup->dtype == gate->dtype && am_tensor_numel(dup) == am_tensor_numel(up)),
             "dup (%s) must have up's shape and dtype", am_tname(dup));
    int64_t n = am_tensor_numel(dout), nb = (n + GEGLU_BLOCK - 1) / GEGLU_BLOCK;
    float *ws = am_cpu_scratch(kernel, dev, (int64_t)omp_get_max_threads() * 5 * GEGLU_BLOCK);
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * GEGLU_BLOCK, len = n - lo < GEGLU_BLOCK ? n - lo : GEGLU_BLOCK;
        float *buf = ws + (size_t)omp_get_thread_num() * 5 * GEGLU_BLOCK;
        float *dg = dgate ? blk(dgate, lo, len, buf + 3 * GEGLU_BLOCK) : NULL;
        float *du = dup ? blk(dup, lo, len, buf + 4 * GEGLU_BLOCK) : NULL;
        geglu_bwd(dg, du, blk(dout, lo, len, buf), blk(gate, lo, len, buf + GEGLU_BLOCK),
                  blk(up, lo, len, buf + 2 * GEGLU_BLOCK), len);
        if (dg)
            put(dgate, lo, len, dg);
        if (du)
            put(dup, lo, len, du);
    }
}
