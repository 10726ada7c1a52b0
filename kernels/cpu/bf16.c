/* bf16.c - exact widening of bf16 to fp32 and round-to-nearest-even narrowing back (half.h's
 * am_f32_to_bf16, NaN kept quiet), of rows, blocks and a tensor's elements: what the CPU
 * backend's bf16 paths share (cpu.h says how they work). */
#include <omp.h>

#include "cpu.h"
#include "half.h"

AM_HOT static void widen_row(float *restrict d, const uint16_t *restrict s, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        d[i] = am_bits_f32((uint32_t)s[i] << 16);
}

AM_HOT static void narrow_row(uint16_t *restrict d, const float *restrict s, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        d[i] = am_f32_to_bf16(s[i]);
}

void am_bf16_widen1(float *dst, const uint16_t *src, int64_t n) { widen_row(dst, src, n); }
void am_bf16_narrow1(uint16_t *dst, const float *src, int64_t n) { narrow_row(dst, src, n); }

void am_bf16_widen(float *dst, int64_t ldd, const uint16_t *src, int64_t lds, int64_t rows, int64_t cols)
{
    if (ldd == cols && lds == cols) { /* contiguous: one long row, cut evenly over the threads */
        int64_t n = rows * cols;
#pragma omp parallel if (n >= AM_PAR_MIN)
        {
            int64_t lo, hi;
            am_split(n, omp_get_thread_num(), omp_get_num_threads(), 16, &lo, &hi);
            widen_row(dst + lo, src + lo, hi - lo);
        }
        return;
    }
#pragma omp parallel for schedule(static) if (rows * cols >= AM_PAR_MIN)
    for (int64_t r = 0; r < rows; r++)
        widen_row(dst + r * ldd, src + r * lds, cols);
}

void am_bf16_narrow(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols)
{
    if (ldd == cols && lds == cols) {
        int64_t n = rows * cols;
#pragma omp parallel if (n >= AM_PAR_MIN)
        {
            int64_t lo, hi;
            am_split(n, omp_get_thread_num(), omp_get_num_threads(), 16, &lo, &hi);
            narrow_row(dst + lo, src + lo, hi - lo);
        }
        return;
    }
#pragma omp parallel for schedule(static) if (rows * cols >= AM_PAR_MIN)
    for (int64_t r = 0; r < rows; r++)
        narrow_row(dst + r * ldd, src + r * lds, cols);
}

float *am_cpu_load(const struct am_tensor *t, int64_t off, int64_t n, float *buf)
{
    if (t->dtype == AM_F32)
        return (float *)t->data + off;
    am_bf16_widen(buf, n, (const uint16_t *)t->data + off, n, 1, n);
    return buf;
}

void am_cpu_store(struct am_tensor *t, int64_t off, int64_t n, const float *buf)
{
    if (t->dtype == AM_BF16)
        am_bf16_narrow((uint16_t *)t->data + off, n, buf, n, 1, n);
}
