/* comm_reduce.c - the host reductions of comm_impl.h (am_comm_reduce, am_comm_scale): what the
 * UCX transport computes on the bytes it receives (NCCL reduces on the device). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "comm_impl.h"

/* max that is commutative bit for bit: NaN wins, and max(+0, -0) = +0 either way. */
static inline float fmax_sym(float a, float b)
{
    if (a > b)
        return a;
    if (b > a)
        return b;
    if (a == b)
        return a == 0 ? a + b : a;
    return a != a ? a : b;
}

static inline double fmax_sym_f64(double a, double b)
{
    if (a > b)
        return a;
    if (b > a)
        return b;
    if (a == b)
        return a == 0 ? a + b : a;
    return a != a ? a : b;
}

#define REDUCE_LOOP(T, EXPR)                                                                   \
    do {                                                                                       \
        T *o_ = out;                                                                           \
        const T *a_ = a, *b_ = b;                                                              \
        for (size_t i = 0; i < n; i++) {                                                       \
            T x = a_[i], y = b_[i];                                                            \
            o_[i] = (EXPR);                                                                    \
        }                                                                                      \
    } while (0)

/* The hot loops of the large reductions, written with GCC/Clang vector types (eight lanes;
 * SSE pairs by default, one AVX2 register in the avx2 clone picked at load time) because -O2
 * does not vectorise loops with a remainder. out may equal a or b exactly, never partially:
 * each block is loaded whole before it is stored. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

HOT static void sum_f32(float *out, const float *a, const float *b, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v8f x0, x1, y0, y1;
        memcpy(&x0, a + i, 32);
        memcpy(&x1, a + i + 8, 32);
        memcpy(&y0, b + i, 32);
        memcpy(&y1, b + i + 8, 32);
        x0 += y0;
        x1 += y1;
        memcpy(out + i, &x0, 32);
        memcpy(out + i + 8, &x1, 32);
    }
    for (; i < n; i++)
        out[i] = a[i] + b[i];
}

/* bf16 sum: widen (shift), add in fp32, round to nearest even; NaN stays a quiet NaN */
HOT static void sum_bf16(uint16_t *out, const uint16_t *a, const uint16_t *b, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8u x, y;
        for (int j = 0; j < 8; j++) {
            x[j] = (uint32_t)a[i + j] << 16;
            y[j] = (uint32_t)b[i + j] << 16;
        }
        v8f f = (v8f)x + (v8f)y;
        v8u u = (v8u)f;
        v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        v8u nan = (v8u)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
        v8u r = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
        for (int j = 0; j < 8; j++)
            out[i + j] = (uint16_t)r[j];
    }
    for (; i < n; i++)
        out[i] = am_f32_to_bf16(am_bf16_to_f32(a[i]) + am_bf16_to_f32(b[i]));
}

void am_comm_reduce(void *out, const void *a, const void *b, size_t n, enum am_dtype t, enum am_comm_op op)
{
    int max = op == AM_MAX;
    switch (t) {
    case AM_F32:
        if (max)
            REDUCE_LOOP(float, fmax_sym(x, y));
        else
            sum_f32(out, a, b, n);
        break;
    case AM_BF16:
        if (max)
            REDUCE_LOOP(uint16_t, am_f32_to_bf16(fmax_sym(am_bf16_to_f32(x), am_bf16_to_f32(y))));
        else
            sum_bf16(out, a, b, n);
        break;
    case AM_F16:
        if (max)
            REDUCE_LOOP(uint16_t, am_f32_to_f16(fmax_sym(am_f16_to_f32(x), am_f16_to_f32(y))));
        else
            REDUCE_LOOP(uint16_t, am_f32_to_f16(am_f16_to_f32(x) + am_f16_to_f32(y)));
        break;
    case AM_I32: /* sums wrap around (two's complement) instead of overflowing */
        if (max)
            REDUCE_LOOP(int32_t, x > y ? x : y);
        else
            REDUCE_LOOP(int32_t, (int32_t)((uint32_t)x + (uint32_t)y));
        break;
    case AM_I64:
        if (max)
            REDUCE_LOOP(int64_t, x > y ? x : y);
        else
            REDUCE_LOOP(int64_t, (int64_t)((uint64_t)x + (uint64_t)y));
        break;
    case AM_F64:
        if (max)
            REDUCE_LOOP(double, fmax_sym_f64(x, y));
        else
            REDUCE_LOOP(double, x + y);
        break;
    }
}

void am_comm_scale(void *buf, size_t n, enum am_dtype t, int divisor)
{
    switch (t) {
    case AM_F32: {
        float *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] /= (float)divisor;
        break;
    }
    case AM_BF16: {
        uint16_t *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] = am_f32_to_bf16(am_bf16_to_f32(p[i]) / (float)divisor);
        break;
    }
    case AM_F16: {
        uint16_t *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] = am_f32_to_f16(am_f16_to_f32(p[i]) / (float)divisor);
        break;
    }
    case AM_I32: {
        int32_t *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] /= divisor;
        break;
    }
    case AM_I64: {
        int64_t *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] /= divisor;
        break;
    }
    case AM_F64: {
        double *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] /= divisor;
        break;
    }
    }
}
