/* elementwise.c - dst += src, t *= s, dropout's mask, dtype conversion, the sum of squares (for the
 * gradient norm) and the finiteness check (for NaN/Inf detection), parallel over the cores
 * for large tensors.
 *
 * bf16: add takes any mix of f32 and bf16 (dst += src in fp32, rounded once when dst is
 * bf16), scale a bf16 tensor (one rounding), sum_squares and all_finite read bf16 tensors
 * (widened exactly; a bf16 is finite unless its exponent bits are all ones). */
#include <omp.h>
#include <string.h>

#include "cpu.h"
#include "half.h"
#include "rng.h"

AM_HOT static void add_bf16_block(void *restrict dst, enum am_dtype dt, const void *restrict src, enum am_dtype st,
                                  int64_t n)
{
    if (dt == AM_BF16 && st == AM_BF16) {
        uint16_t *restrict d = dst;
        const uint16_t *restrict s = src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            d[i] = am_f32_to_bf16(am_bf16_to_f32(d[i]) + am_bf16_to_f32(s[i]));
    } else if (dt == AM_BF16) {
        uint16_t *restrict d = dst;
        const float *restrict s = src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            d[i] = am_f32_to_bf16(am_bf16_to_f32(d[i]) + s[i]);
    } else {
        float *restrict d = dst;
        const uint16_t *restrict s = src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            d[i] += am_bf16_to_f32(s[i]);
    }
}

static void add_bf16(struct am_tensor *dst, const struct am_tensor *src, int64_t n)
{
    const char *kernel = "am_cpu_add";
    enum am_dtype dt = am_cpu_act(kernel, "dst", dst), st = am_cpu_act(kernel, "src", src);
    size_t ds = am_dtype_size(dt), ss = am_dtype_size(st);
#pragma omp parallel if (n >= AM_PAR_MIN)
    {
        int64_t lo, hi;
        am_split(n, omp_get_thread_num(), omp_get_num_threads(), 16, &lo, &hi);
        add_bf16_block((char *)dst->data + (size_t)lo * ds, dt, (const char *)src->data + (size_t)lo * ss, st, hi - lo);
    }
}

AM_HOT static void scale_bf16(uint16_t *restrict d, float s, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        d[i] = am_f32_to_bf16(am_bf16_to_f32(d[i]) * s);
}

static void same_size(const char *kernel, const struct am_tensor *a, const struct am_tensor *b)
{
    if (am_tensor_numel(a) != am_tensor_numel(b))
        am_cpu_fatal(kernel, "dst (%s) has %lld elements, src (%s) %lld: they must match", am_tname(a),
                     (long long)am_tensor_numel(a), am_tname(b), (long long)am_tensor_numel(b));
}

void am_cpu_add(const struct am_dev *dev, struct am_tensor *dst, const struct am_tensor *src)
{
    if (am_not_f32(dst) || am_not_f32(src)) {
        same_size(__func__, dst, src);
        add_bf16(dst, src, am_tensor_numel(dst));
        return;
    }
    float *restrict d = F32(dst);
    const float *restrict s = F32(src);
    same_size(__func__, dst, src);
    int64_t n = am_tensor_numel(dst);
#pragma omp parallel for simd schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t i = 0; i < n; i++)
        d[i] += s[i];
}

void am_cpu_scale(const struct am_dev *dev, struct am_tensor *t, float s)
{
    if (am_not_f32(t)) {
        uint16_t *d = am_cpu_data(__func__, "t", t, AM_BF16);
        int64_t n = am_tensor_numel(t);
#pragma omp parallel if (n >= AM_PAR_MIN)
        {
            int64_t lo, hi;
            am_split(n, omp_get_thread_num(), omp_get_num_threads(), 16, &lo, &hi);
            scale_bf16(d + lo, s, hi - lo);
        }
        return;
    }
    float *restrict d = F32(t);
    int64_t n = am_tensor_numel(t);
#pragma omp parallel for simd schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t i = 0; i < n; i++)
        d[i] *= s;
}

/* Dropout's mask (kernels.h): each row's key from its sequence and position, each element
 * kept or zeroed by its own counter, so the threads' split changes nothing. */
void am_cpu_dropout(const struct am_dev *dev, struct am_tensor *t, const struct am_dropout *dr)
{
    (void)dev;
    enum am_dtype dt = am_cpu_act(__func__, "t", t);
    int64_t F = t->shape[1] ? t->shape[1] : 1, N = am_tensor_numel(t) / F;
    float keep = 1.0f / (1.0f - dr->p);
#pragma omp parallel for schedule(static) if (N * F >= AM_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        int64_t b = n / dr->rows_per_seq, i = n % dr->rows_per_seq;
        int64_t key = (dr->seq0 + b * dr->seq_step) * dr->seq_len + (dr->pos ? dr->pos[i] : i);
        uint64_t base = (uint64_t)key * (uint64_t)dr->cols + (uint64_t)dr->col0;
        for (int64_t f = 0; f < F; f++) {
            float s = am_rng_keep(dr->seed, dr->stream, base + (uint64_t)f, dr->p) ? keep : 0.0f;
            if (dt == AM_BF16) {
                uint16_t *d = (uint16_t *)t->data + n * F + f;
                *d = am_f32_to_bf16(am_bf16_to_f32(*d) * s);
            } else {
                ((float *)t->data)[n * F + f] *= s;
            }
        }
    }
}

/* Σ x², each square exact in double and summed in double. The sum is cut into fixed
 * blocks whose partial sums are added in order, so the result does not depend on the
 * number of threads (the gradient norm is bitwise reproducible). */
#define SS_MAX_BLOCKS 1024

AM_HOT static double sum_squares_block(const float *restrict x, int64_t n)
{
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++)
        acc += (double)x[i] * (double)x[i];
    return acc;
}

AM_HOT static double sum_squares_block_bf16(const uint16_t *restrict x, int64_t n)
{
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) {
        double v = am_bf16_to_f32(x[i]);
        acc += v * v;
    }
    return acc;
}

void am_cpu_convert(const struct am_dev *dev, struct am_tensor *dst, const struct am_tensor *src)
{
    same_size(__func__, dst, src);
    int64_t n = am_tensor_numel(dst);
    enum am_dtype to = dst->dtype, from = src->dtype;
    if (to == from) {
        am_cpu_copy(dev, dst, src);
        return;
    }
    void *o = am_cpu_data(__func__, "dst", dst, to);
    const void *i = am_cpu_data(__func__, "src", src, from);
    if (from == AM_F32 && to == AM_BF16) {
        const float *restrict a = i;
        uint16_t *restrict b = o;
#pragma omp parallel for simd schedule(static) if (n >= AM_PAR_MIN)
        for (int64_t k = 0; k < n; k++)
            b[k] = am_f32_to_bf16(a[k]);
    } else if (from == AM_BF16 && to == AM_F32) {
        const uint16_t *restrict a = i;
        float *restrict b = o;
#pragma omp parallel for simd schedule(static) if (n >= AM_PAR_MIN)
        for (int64_t k = 0; k < n; k++)
            b[k] = am_bf16_to_f32(a[k]);
    } else if (from == AM_F64 && to == AM_F32) {
        const double *a = i;
        float *b = o;
        for (int64_t k = 0; k < n; k++)
            b[k] = (float)a[k];
    } else if (from == AM_F32 && to == AM_F64) {
        const float *a = i;
        double *b = o;
        for (int64_t k = 0; k < n; k++)
            b[k] = a[k];
    } else {
        am_cpu_fatal(__func__, "no conversion from %s's dtype to %s's (fp32 <-> bf16, fp32 <-> fp64)", am_tname(src),
                     am_tname(dst));
    }
}

void am_cpu_sum_squares(const struct am_dev *dev, struct am_tensor *acc, const struct am_tensor *t, double div)
{
    double *out = F64_SCALAR(acc);
    bool bf = am_not_f32(t);
    const void *x = bf ? am_cpu_data(__func__, "t", t, AM_BF16) : F32(t);
    int64_t n = am_tensor_numel(t);
    int64_t block = 65536;
    if (n > block * SS_MAX_BLOCKS)
        block = (n + SS_MAX_BLOCKS - 1) / SS_MAX_BLOCKS;
    int64_t nb = (n + block - 1) / block;
    double part[SS_MAX_BLOCKS];
#pragma omp parallel for schedule(static) if (nb > 1)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
        part[b] = bf ? sum_squares_block_bf16((const uint16_t *)x + lo, hi - lo)
                     : sum_squares_block((const float *)x + lo, hi - lo);
    }
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++)
        total += part[b];
    *out += total / div;
}

/* A float is finite unless its exponent bits are all ones (Inf and NaN). */
AM_HOT static bool all_finite_block(const float *restrict x, int64_t n)
{
    uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        bad |= (uint32_t)((u & 0x7F800000u) == 0x7F800000u);
    }
    return bad == 0;
}

AM_HOT static bool all_finite_block_bf16(const uint16_t *restrict x, int64_t n)
{
    uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; i++)
        bad |= (uint32_t)((x[i] & 0x7F80u) == 0x7F80u);
    return bad == 0;
}

void am_cpu_all_finite(const struct am_dev *dev, struct am_tensor *flag, const struct am_tensor *t)
{
    int32_t *ok = am_cpu_data(__func__, "flag", flag, AM_I32);
    bool bf = am_not_f32(t);
    const void *x = bf ? am_cpu_data(__func__, "t", t, AM_BF16) : F32(t);
    int64_t n = am_tensor_numel(t);
    int64_t block = 1 << 18;
    int64_t nb = (n + block - 1) / block;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (nb > 1)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
        bad |= bf ? !all_finite_block_bf16((const uint16_t *)x + lo, hi - lo)
                  : !all_finite_block((const float *)x + lo, hi - lo);
    }
    if (bad)
        *ok = 0;
}

/* kernels.h: a block of columns, optionally de-interleaved (perm 1) or interleaved (perm -1). */
/* One fp32 row of copy_cols (kernels.h): d[j] (or d[p(j)]) = s[j] (or s[p(j)]), or += */
AM_INLINE void copy_cols_row(float *restrict d, const float *restrict s, int64_t width, int perm, bool accumulate)
{
    int64_t half = width / 2;
    if (perm == 0 && !accumulate) {
        memcpy(d, s, (size_t)width * sizeof(float));
        return;
    }
    if (perm == 0) {
#pragma omp simd
        for (int64_t j = 0; j < width; j++)
            d[j] += s[j];
        return;
    }
    for (int64_t j = 0; j < half; j++) { /* p(j) = 2j for j < half, 2(j - half) + 1 after */
        int64_t dj = perm < 0 ? 2 * j : j, sj = perm > 0 ? 2 * j : j;
        int64_t dk = perm < 0 ? 2 * j + 1 : half + j, sk = perm > 0 ? 2 * j + 1 : half + j;
        d[dj] = accumulate ? d[dj] + s[sj] : s[sj];
        d[dk] = accumulate ? d[dk] + s[sk] : s[sk];
    }
}

void am_cpu_copy_cols(const struct am_dev *dev, struct am_tensor *dst, int64_t dst_col, const struct am_tensor *src,
                      int64_t src_col, int64_t width, int perm, bool accumulate)
{
    (void)dev;
    const char *kernel = __func__;
    enum am_dtype dt = am_cpu_act(kernel, "dst", dst), st = am_cpu_act(kernel, "src", src);
    int64_t M = am_rows(dst), Nd = am_cols(dst), Ns = am_cols(src);
    AM_CHECK(dt == st, "dst (%s) and src (%s) must have one dtype", am_tname(dst), am_tname(src));
    AM_CHECK(am_rows(src) == M, "dst (%s) has %lld rows, src (%s) %lld: they must match", am_tname(dst), (long long)M,
             am_tname(src), (long long)am_rows(src));
    AM_CHECK(width >= 0 && dst_col >= 0 && src_col >= 0 && dst_col + width <= Nd && src_col + width <= Ns &&
                 (perm == 0 || width % 2 == 0),
             "columns [%lld, +%lld) of dst (%s, %lld wide) from [%lld, +%lld) of src (%s, %lld wide), perm %d: out of "
             "range (or an odd width to interleave)",
             (long long)dst_col, (long long)width, am_tname(dst), (long long)Nd, (long long)src_col, (long long)width,
             am_tname(src), (long long)Ns, perm);
    int64_t half = width / 2;
    bool bf = dt == AM_BF16;
    if (!bf) { /* fp32: whole rows of plain copies, or the two halves of an interleave */
        float *d0 = (float *)dst->data + dst_col;
        const float *s0 = (const float *)src->data + src_col;
#pragma omp parallel for schedule(static) if (M * width >= AM_PAR_MIN)
        for (int64_t i = 0; i < M; i++)
            copy_cols_row(d0 + i * Nd, s0 + i * Ns, width, perm, accumulate);
        return;
    }
#pragma omp parallel for schedule(static) if (M * width >= AM_PAR_MIN)
    for (int64_t i = 0; i < M; i++) {
        for (int64_t j = 0; j < width; j++) {
            int64_t pj = perm == 0 ? j : j < half ? 2 * j : 2 * (j - half) + 1;
            int64_t dj = dst_col + (perm < 0 ? pj : j), sj = src_col + (perm > 0 ? pj : j);
            if (bf) {
                uint16_t *d = (uint16_t *)dst->data + i * Nd + dj;
                uint16_t s = ((const uint16_t *)src->data)[i * Ns + sj];
                *d = accumulate ? am_f32_to_bf16(am_bf16_to_f32(*d) + am_bf16_to_f32(s)) : s;
            } else {
                float *d = (float *)dst->data + i * Nd + dj;
                float s = ((const float *)src->data)[i * Ns + sj];
                *d = accumulate ? *d + s : s;
            }
        }
    }
}
