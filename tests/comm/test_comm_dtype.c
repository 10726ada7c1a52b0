/* test_comm_dtype - the communicators' dtype conversions and host reductions (comm_impl.h),
 * bit for bit: bf16 and fp16 against references computed independently in double, over every
 * 16-bit pattern and a large sample of fp32 values; the reductions' commutativity, signed
 * zeros, NaN, integer wrap-around and avg's truncation. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "comm_impl.h"

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint64_t rng_state = 88172645463325252ull;
static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

/* fp16 value of a bit pattern, computed with ldexp (independent of the code under test) */
static double f16_ref(uint16_t h)
{
    int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp(m, -24);
    else
        v = ldexp(1024 + m, e - 25);
    return sign ? -v : v;
}

/* nearest fp16 to x (finite, x >= 0), ties to even; 0x7c00 (Inf) counts as 65536 */
static uint16_t f16_nearest(double x)
{
    uint16_t lo = 0, hi = 0x7c00;
    while (hi - lo > 1) { /* largest pattern with value <= x */
        uint16_t mid = (uint16_t)((lo + hi) / 2);
        if (f16_ref(mid) <= x)
            lo = mid;
        else
            hi = mid;
    }
    double vlo = f16_ref(lo), vhi = hi == 0x7c00 ? 65536.0 : f16_ref(hi);
    if (x - vlo < vhi - x)
        return lo;
    if (x - vlo > vhi - x)
        return hi;
    return (lo & 1) ? hi : lo;
}

/* nearest bf16 to a finite float, ties to even, by comparing the two neighbours in double */
static uint16_t bf16_nearest(float f)
{
    uint32_t u = bits(f);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
    double x = fabs((double)f), vlo = fabs((double)from_bits((uint32_t)lo << 16)),
           vhi = fabs((double)from_bits((uint32_t)hi << 16));
    if ((hi & 0x7fff) == 0x7f80) /* rounding up overflows to Inf */
        vhi = ldexp(1.0, 128);
    if (x - vlo < vhi - x)
        return lo;
    if (x - vlo > vhi - x)
        return hi;
    return (lo & 1) ? hi : lo;
}

static void test_bf16_roundtrip(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = am_bf16_to_f32((uint16_t)h);
        assert_int_equal(bits(f), h << 16);
        uint16_t back = am_f32_to_bf16(f);
        if (isnan(f))
            assert_true(isnan(am_bf16_to_f32(back)));
        else
            assert_int_equal(back, h);
    }
}

static void test_bf16_rounding(void **state)
{
    (void)state;
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = rnd() ^ (rnd() << 16);
        if (i % 4 == 0)
            u = (u & 0xffff0000u) | 0x8000u; /* exact ties */
        float f = from_bits(u);
        if (isnan(f)) {
            assert_true(isnan(am_bf16_to_f32(am_f32_to_bf16(f))));
            continue;
        }
        if (isinf(f))
            continue;
        assert_int_equal(am_f32_to_bf16(f), bf16_nearest(f));
    }
}

static void test_f16_decode_all(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        double ref = f16_ref((uint16_t)h);
        float f = am_f16_to_f32((uint16_t)h);
        if (isnan(ref)) {
            assert_true(isnan(f));
            assert_true(isnan(am_f16_to_f32(am_f32_to_f16(f))));
            continue;
        }
        assert_true((double)f == ref);
        assert_true(!signbit(f) == !signbit(ref));
        assert_int_equal(am_f32_to_f16(f), h); /* exact values round-trip */
    }
}

static void test_f16_rounding(void **state)
{
    (void)state;
    for (int i = 0; i < 400000; i++) {
        /* floats around fp16's range: exponents -30 .. 17, random mantissas, some ties */
        uint32_t exp = 127 - 30 + rnd() % 48, mant = rnd() & 0x7fffff;
        if (i % 4 == 0)
            mant = (mant & ~0x1fffu) | 0x1000u; /* halfway between two normal fp16 values */
        uint32_t sign = (rnd() & 1) << 31;
        float f = from_bits(sign | exp << 23 | mant);
        uint16_t want = f16_nearest(fabs((double)f)) | (uint16_t)(sign >> 16);
        assert_int_equal(am_f32_to_f16(f), want);
    }
    assert_int_equal(am_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(am_f32_to_f16(65520.0f), 0x7c00); /* the tie goes to even: Inf */
    assert_int_equal(am_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(am_f32_to_f16(-INFINITY), 0xfc00);
    assert_int_equal(am_f32_to_f16(0x1.0p-25f), 0x0000);  /* half the smallest subnormal: even */
    assert_int_equal(am_f32_to_f16(0x1.8p-25f), 0x0001);
    assert_int_equal(am_f32_to_f16(0x1.8p-24f), 0x0002);  /* 1.5 steps: tie to even (2) */
}

static int nan_at(const unsigned char *p, enum am_dtype t, size_t i)
{
    uint16_t h;
    float f;
    double d;
    switch (t) {
    case AM_F32:
        memcpy(&f, p + 4 * i, 4);
        return isnan(f);
    case AM_F64:
        memcpy(&d, p + 8 * i, 8);
        return isnan(d);
    case AM_BF16:
        memcpy(&h, p + 2 * i, 2);
        return isnan(am_bf16_to_f32(h));
    case AM_F16:
        memcpy(&h, p + 2 * i, 2);
        return isnan(am_f16_to_f32(h));
    default:
        return 0;
    }
}

/* reduce(a, b) and reduce(b, a) give the same bits, for every dtype and op */
static void test_reduce_commutative(void **state)
{
    (void)state;
    static const enum am_dtype ts[] = {AM_F32, AM_BF16, AM_F16, AM_I32, AM_I64, AM_F64};
    enum { N = 4096 };
    static unsigned char a[N * 8], b[N * 8], x[N * 8], y[N * 8];
    for (int i = 0; i < N * 8; i++) {
        a[i] = (unsigned char)rnd();
        b[i] = (unsigned char)rnd();
    }
    float special[] = {0.0f, -0.0f, 1.0f, -1.0f, NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 7; i++)
        for (int j = 0; j < 7; j++) {
            memcpy(a + 4 * (i * 7 + j), &special[i], 4);
            memcpy(b + 4 * (i * 7 + j), &special[j], 4);
        }
    for (int ti = 0; ti < 6; ti++)
        for (int op = AM_SUM; op <= AM_MAX; op++) {
            am_comm_reduce(x, a, b, N, ts[ti], (enum am_comm_op)op);
            am_comm_reduce(y, b, a, N, ts[ti], (enum am_comm_op)op);
            size_t es = am_dtype_size(ts[ti]);
            for (size_t i = 0; i < N; i++) {
                if (nan_at(x, ts[ti], i) && nan_at(y, ts[ti], i)) /* NaN payloads may differ */
                    continue;
                assert_memory_equal(x + es * i, y + es * i, es);
            }
        }
}

static void test_reduce_values(void **state)
{
    (void)state;
    float fa[] = {1.5f, -0.0f, 0.0f, 3.0f}, fb[] = {2.25f, 0.0f, -0.0f, NAN}, fo[4];
    am_comm_reduce(fo, fa, fb, 4, AM_F32, AM_SUM);
    assert_true(fo[0] == 3.75f);
    am_comm_reduce(fo, fa, fb, 4, AM_F32, AM_MAX);
    assert_true(fo[0] == 2.25f);
    assert_false(signbit(fo[1])); /* max(-0, +0) = +0 */
    assert_false(signbit(fo[2]));
    assert_true(isnan(fo[3]));    /* NaN wins */
    /* bf16: 1 + 2^-8 is a tie between 1 and 1 + 2^-7: rounds to even (1) */
    uint16_t ba = am_f32_to_bf16(1.0f), bb = am_f32_to_bf16(0x1.0p-8f), bo;
    am_comm_reduce(&bo, &ba, &bb, 1, AM_BF16, AM_SUM);
    assert_true(am_bf16_to_f32(bo) == 1.0f);
    bb = am_f32_to_bf16(0x1.8p-8f); /* above the tie: rounds up */
    am_comm_reduce(&bo, &ba, &bb, 1, AM_BF16, AM_SUM);
    assert_true(am_bf16_to_f32(bo) == 1.0f + 0x1.0p-7f);
    uint16_t ha = am_f32_to_f16(1000.0f), hb = am_f32_to_f16(0.25f), ho;
    am_comm_reduce(&ho, &ha, &hb, 1, AM_F16, AM_SUM); /* 1000.25: fp16 step is 0.5 there, tie to even */
    assert_true(am_f16_to_f32(ho) == 1000.0f);
    int32_t ia[] = {INT32_MAX, -5}, ib[] = {1, 3}, io[2];
    am_comm_reduce(io, ia, ib, 2, AM_I32, AM_SUM); /* wraps, no undefined behaviour */
    assert_int_equal(io[0], INT32_MIN);
    assert_int_equal(io[1], -2);
    int64_t la[] = {INT64_MAX, -7}, lb[] = {0, 9}, lo[2];
    am_comm_reduce(lo, la, lb, 2, AM_I64, AM_MAX);
    assert_true(lo[0] == INT64_MAX && lo[1] == 9);
    /* in place: out == a */
    am_comm_reduce(la, la, lb, 2, AM_I64, AM_SUM);
    assert_true(la[1] == 2);
    double da[] = {0.1, -0.0, NAN}, db[] = {0.2, 0.0, 1.0}, dout[3];
    am_comm_reduce(dout, da, db, 3, AM_F64, AM_SUM);
    assert_true(dout[0] == 0.1 + 0.2);
    am_comm_reduce(dout, da, db, 3, AM_F64, AM_MAX);
    assert_true(dout[0] == 0.2);
    assert_false(signbit(dout[1]));
    assert_true(isnan(dout[2]));
}

static void test_scale(void **state)
{
    (void)state;
    int32_t i[] = {-7, 7, 8};
    am_comm_scale(i, 3, AM_I32, 2);
    assert_int_equal(i[0], -3); /* toward zero */
    assert_int_equal(i[1], 3);
    assert_int_equal(i[2], 4);
    float f[] = {1.0f};
    am_comm_scale(f, 1, AM_F32, 3);
    assert_true(f[0] == 1.0f / 3.0f);
    uint16_t h = am_f32_to_f16(3.0f);
    am_comm_scale(&h, 1, AM_F16, 4);
    assert_true(am_f16_to_f32(h) == 0.75f);
    double d[] = {1.0};
    am_comm_scale(d, 1, AM_F64, 3);
    assert_true(d[0] == 1.0 / 3.0);
    assert_int_equal(am_dtype_size(AM_BF16), 2);
    assert_int_equal(am_dtype_size(AM_F64), 8);
    assert_string_equal(am_dtype_name(AM_I64), "int64");
    assert_string_equal(am_dtype_name(AM_F32), "fp32");
    assert_string_equal(am_dtype_torch_name(AM_BF16), "bfloat16");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_roundtrip),   cmocka_unit_test(test_bf16_rounding),
        cmocka_unit_test(test_f16_decode_all),   cmocka_unit_test(test_f16_rounding),
        cmocka_unit_test(test_reduce_commutative), cmocka_unit_test(test_reduce_values),
        cmocka_unit_test(test_scale),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
