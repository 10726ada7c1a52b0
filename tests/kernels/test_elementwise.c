/* test_elementwise.c - the CPU kernels' tests (kernels_test.h: how they are tested): the
 * vectorisable exp, memory, the element-wise kernels, the device scalars and conversions.
 */
#include "kernels_test.h"
#include "cpu/cpu.h" /* the backend's private helpers (am_expf, am_cpu_set_chunk), used directly */

/* ---- the backend's vectorisable exp ---- */

static void test_expf(void **state)
{
    (void)state;
    /* over the whole normal range, against exp in double: Cephes' polynomial with the
     * Cody-Waite reduction stays within 2 ulp; 3u relative (1.5 ulp-ish) is what we assert */
    double worst = 0.0;
    for (int i = 0; i <= 2000000; i++) {
        float x = (float)(-87.3 + (88.7 + 87.3) * i / 2000000.0);
        double want = exp((double)x), rel = fabs((double)am_expf(x) - want) / want;
        worst = fmax(worst, rel);
    }
    if (getenv("AM_TEST_VERBOSE"))
        printf("    am_expf worst relative error %.3g (u = %.3g)\n", worst, U);
    assert_true(worst <= 3 * U);
    assert_true(am_expf(0.0f) == 1.0f);
    assert_true(am_expf(-INFINITY) == 0.0f);
    assert_true(am_expf(-100.0f) == 0.0f);
    assert_true(isinf(am_expf(89.0f)) && isinf(am_expf(INFINITY)));
    assert_true(isnan(am_expf(NAN)));
    assert_true(am_expf(88.7f) < INFINITY && am_expf(88.7f) > 3.3e38f);
}

/* ---- memory and element-wise ---- */

/* The device-scalar reductions, read back at once. */
static double sum_squares(const struct am_tensor *t)
{
    double acc = 0;
    struct am_tensor a = am_tensor_view(&acc, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
    K->sum_squares(&kdev, &a, t, 1.0);
    return acc;
}

static bool all_finite(const struct am_tensor *t)
{
    int32_t ok = 1;
    struct am_tensor f = am_tensor_view(&ok, AM_DEV_CPU, AM_I32, 1, 0, 0, 0);
    K->all_finite(&kdev, &f, t);
    return ok == 1;
}

static void test_memory(void **state)
{
    (void)state;
    assert_ptr_equal(am_kernels_for(AM_DEV_CPU), K);
#ifndef AM_HAVE_CUDA
    assert_null(am_kernels_for(AM_DEV_CUDA));
#endif
    assert_string_equal(K->name, "cpu");
    size_t sizes[] = {1, 3, 64, 1000, 1 << 20};
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        unsigned char *p = K->alloc(&kdev, sizes[s]);
        assert_non_null(p);
        assert_int_equal((uintptr_t)p % 64, 0);
        for (size_t i = 0; i < sizes[s]; i++)
            assert_int_equal(p[i], 0);
        K->free(&kdev, p);
    }
    float host[37], back[37];
    for (int i = 0; i < 37; i++)
        host[i] = (float)i * 0.5f - 3.0f;
    float *dev = K->alloc(&kdev, sizeof host), *dev2 = K->alloc(&kdev, sizeof host);
    K->upload(&kdev, dev, host, sizeof host);
    K->download(&kdev, back, dev, sizeof host);
    assert_memory_equal(host, back, sizeof host);
    struct am_tensor a = am_tensor_view(dev, AM_DEV_CPU, AM_F32, 37, 0, 0, 0);
    struct am_tensor b = am_tensor_view(dev2, AM_DEV_CPU, AM_F32, 37, 0, 0, 0);
    K->copy(&kdev, &b, &a);
    assert_memory_equal(dev2, host, sizeof host);
    K->zero(&kdev, &a);
    for (int i = 0; i < 37; i++)
        assert_true(dev[i] == 0.0f);
    K->free(&kdev, dev);
    K->free(&kdev, dev2);
}

static void test_elementwise(void **state)
{
    (void)state;
    struct rng r = {42};
    int64_t sizes[] = {1, 7, 1000, 5 * 65536 + 7};
    for (size_t c = 0; c < sizeof sizes / sizeof *sizes; c++) {
        int64_t n = sizes[c];
        struct arr a = arr_rand(&r, n, -2, 2), b = arr_rand(&r, n, -2, 2), a0 = arr_copy(&a);
        struct am_tensor ta = tview(&a, n, 0, 0, 0), tb = tview(&b, n, 0, 0, 0);
        /* add and scale do one fp32 operation per element: bitwise what C computes */
        K->add(&kdev, &ta, &tb);
        for (int64_t i = 0; i < n; i++)
            assert_true(a.f[i] == a0.f[i] + b.f[i]);
        K->scale(&kdev, &ta, 0.37f);
        for (int64_t i = 0; i < n; i++)
            assert_true(a.f[i] == (a0.f[i] + b.f[i]) * 0.37f);
        /* sum of squares: each square is exact in double and n double additions err by at
         * most n 2^-53 of the sum */
        double want = 0.0;
        for (int64_t i = 0; i < n; i++)
            want += b.d[i] * b.d[i];
        double got = sum_squares(&tb);
        assert_true(fabs(got - want) <= (double)n * 0x1p-53 * want);
        /* and it does not depend on the number of threads (fixed blocks, summed in order) */
        omp_set_num_threads(1);
        double one = sum_squares(&tb);
        omp_set_num_threads(3);
        double three = sum_squares(&tb);
        omp_set_num_threads(omp_get_num_procs());
        assert_memory_equal(&one, &three, sizeof one);
        assert_memory_equal(&one, &got, sizeof one);
        /* all_finite: NaN and both infinities anywhere, and the largest finite values */
        assert_true(all_finite(&tb));
        float keep0 = b.f[0], keepl = b.f[n - 1], keepm = b.f[n / 2];
        b.f[n - 1] = NAN;
        assert_false(all_finite(&tb));
        b.f[n - 1] = keepl;
        b.f[0] = INFINITY;
        assert_false(all_finite(&tb));
        b.f[0] = keep0;
        b.f[n / 2] = -INFINITY;
        assert_false(all_finite(&tb));
        b.f[n / 2] = -FLT_MAX;
        b.f[0] = FLT_MIN / 4; /* a denormal */
        assert_true(all_finite(&tb));
        b.f[n / 2] = keepm;
        b.f[0] = keep0;
        arr_free(&a);
        arr_free(&b);
        arr_free(&a0);
    }
}

/* The device scalars' contracts: sum_squares adds (Σ x²) / div to what acc holds; all_finite
 * only ever clears its flag; convert rounds f32 to bf16 to nearest even and widens exactly. */
static void test_scalars_and_convert(void **state)
{
    (void)state;
    float x[3] = {1.0f, -2.0f, 0.5f};
    struct am_tensor t = am_tensor_view(x, AM_DEV_CPU, AM_F32, 3, 0, 0, 0);
    double acc = 1.5;
    struct am_tensor a = am_tensor_view(&acc, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
    K->sum_squares(&kdev, &a, &t, 2.0);
    assert_true(acc == 1.5 + 5.25 / 2.0);
    int32_t flag = 7;
    struct am_tensor f = am_tensor_view(&flag, AM_DEV_CPU, AM_I32, 1, 0, 0, 0);
    K->all_finite(&kdev, &f, &t);
    assert_int_equal(flag, 7);
    x[1] = NAN;
    K->all_finite(&kdev, &f, &t);
    assert_int_equal(flag, 0);
    x[1] = 1.0f;
    K->all_finite(&kdev, &f, &t);
    assert_int_equal(flag, 0);

    /* f32 -> bf16: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 (rounds to even: 1); just above
     * it rounds up; -0, Inf and the largest bf16 stay; bf16 -> f32 is exact */
    float in[6] = {1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -0.0f, INFINITY, 0x1.fep127f, 3.0f + 0x1p-7f};
    uint16_t want[6] = {0x3f80, 0x3f81, 0x8000, 0x7f80, 0x7f7f, 0x4040};
    uint16_t bf[6];
    float back[6];
    struct am_tensor ti = am_tensor_view(in, AM_DEV_CPU, AM_F32, 6, 0, 0, 0);
    struct am_tensor tb = am_tensor_view(bf, AM_DEV_CPU, AM_BF16, 6, 0, 0, 0);
    struct am_tensor tf = am_tensor_view(back, AM_DEV_CPU, AM_F32, 6, 0, 0, 0);
    K->convert(&kdev, &tb, &ti);
    assert_memory_equal(bf, want, sizeof(want));
    K->convert(&kdev, &tf, &tb);
    for (int i = 0; i < 6; i++) {
        uint32_t u = (uint32_t)want[i] << 16;
        float w;
        memcpy(&w, &u, sizeof(w));
        assert_memory_equal(&back[i], &w, sizeof(w));
    }
    /* f64 <-> f32 */
    double dd = 0.1, d2;
    float ff;
    struct am_tensor td = am_tensor_view(&dd, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
    struct am_tensor tff = am_tensor_view(&ff, AM_DEV_CPU, AM_F32, 1, 0, 0, 0);
    struct am_tensor td2 = am_tensor_view(&d2, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
    K->convert(&kdev, &tff, &td);
    assert_true(ff == (float)0.1);
    K->convert(&kdev, &td2, &tff);
    assert_true(d2 == (double)(float)0.1);
}

static void test_bf16_elementwise(void **state)
{
    (void)state;
    struct rng r = {101};
    int64_t sizes[] = {7, 5 * 65536 + 7};
    for (size_t c = 0; c < 2; c++) {
        int64_t n = sizes[c];
        struct bt a = bt_rand(&r, n, -2, 2), b = bt_rand(&r, n, -2, 2), a0 = bt_copy(&a);
        struct am_tensor ta = hv(&a, n, 0, 0, 0), tb = hv(&b, n, 0, 0, 0), tbf = fv(&b, n, 0, 0, 0);
        struct am_tensor taf = fv(&a, n, 0, 0, 0);
        /* one fp32 addition, one rounding: bitwise */
        K->add(&kdev, &ta, &tb);
        for (int64_t i = 0; i < n; i++)
            assert_int_equal(a.h[i], am_f32_to_bf16(a0.f[i] + b.f[i]));
        memcpy(a.h, a0.h, (size_t)n * 2);
        K->add(&kdev, &ta, &tbf); /* bf16 += f32 */
        for (int64_t i = 0; i < n; i++)
            assert_int_equal(a.h[i], am_f32_to_bf16(a0.f[i] + b.f[i]));
        K->add(&kdev, &taf, &tb); /* f32 += bf16: exact widening, one fp32 addition */
        for (int64_t i = 0; i < n; i++)
            assert_true(a.f[i] == a0.f[i] + b.f[i]);
        memcpy(a.h, a0.h, (size_t)n * 2);
        K->scale(&kdev, &ta, 0.37f);
        for (int64_t i = 0; i < n; i++)
            assert_int_equal(a.h[i], am_f32_to_bf16(a0.f[i] * 0.37f));
        /* dropout's mask on bf16: the fp32 mask's factor (from a tensor of ones), one rounding */
        float *ones = malloc((size_t)n * sizeof(float));
        assert_non_null(ones);
        for (int64_t i = 0; i < n; i++)
            ones[i] = 1.0f;
        struct am_dropout dr = {.p = 0.2f, .seed = 9, .stream = 2, .seq_step = 1, .seq_len = n, .rows_per_seq = n,
                                .cols = 1};
        struct am_tensor tones = am_tensor_view(ones, AM_DEV_CPU, AM_F32, n, 1, 0, 0), tac = ta;
        tac.shape[1] = 1;
        memcpy(a.h, a0.h, (size_t)n * 2);
        K->dropout(&kdev, &tones, &dr);
        K->dropout(&kdev, &tac, &dr);
        for (int64_t i = 0; i < n; i++)
            assert_int_equal(a.h[i], am_f32_to_bf16(a0.f[i] * ones[i]));
        free(ones);
        K->copy(&kdev, &ta, &tb);
        assert_memory_equal(a.h, b.h, (size_t)n * 2);
        K->zero(&kdev, &ta);
        for (int64_t i = 0; i < n; i++)
            assert_int_equal(a.h[i], 0);
        /* the sum of squares of a bf16 tensor is that of its widening, bit for bit (the same
         * exact squares in double, the same blocks) */
        double sb = sum_squares(&tb), sf = sum_squares(&tbf);
        assert_memory_equal(&sb, &sf, sizeof sb);
        assert_true(all_finite(&tb));
        uint16_t keep = b.h[n - 1], bad[] = {0x7fc0, 0x7f80, 0xff80, 0x7f81};
        for (int i = 0; i < 4; i++) {
            b.h[n - 1] = bad[i];
            assert_false(all_finite(&tb));
        }
        b.h[n - 1] = 0x7f7f; /* the largest finite bf16 */
        assert_true(all_finite(&tb));
        b.h[n - 1] = keep;
        bt_free(&a);
        bt_free(&b);
        bt_free(&a0);
    }
}

/* copy_cols: a block of columns, plain, de-interleaved (perm 1) and back (perm -1), written and
 * accumulated, in fp32 and bf16; the other columns untouched. */
static void test_copy_cols(void **state)
{
    (void)state;
    enum { M = 3, NS = 10, ND = 9 };
    float src[M * NS], dst[M * ND], back[M * NS];
    for (int i = 0; i < M * NS; i++)
        src[i] = (float)(i + 1);
    for (int i = 0; i < M * ND; i++)
        dst[i] = -1.0f;
    struct am_tensor ts = am_tensor_view(src, AM_DEV_CPU, AM_F32, M, NS, 0, 0);
    struct am_tensor td = am_tensor_view(dst, AM_DEV_CPU, AM_F32, M, ND, 0, 0);
    K->copy_cols(&kdev, &td, 1, &ts, 2, 6, 1, false); /* dst[1 + j] = src[2 + p(j)], p = 0 2 4 1 3 5 */
    const int p[6] = {0, 2, 4, 1, 3, 5};
    for (int i = 0; i < M; i++) {
        assert_true(dst[i * ND] == -1.0f && dst[i * ND + 7] == -1.0f && dst[i * ND + 8] == -1.0f);
        for (int j = 0; j < 6; j++)
            assert_true(dst[i * ND + 1 + j] == src[i * NS + 2 + p[j]]);
    }
    for (int i = 0; i < M * NS; i++)
        back[i] = 0.5f;
    struct am_tensor tb = am_tensor_view(back, AM_DEV_CPU, AM_F32, M, NS, 0, 0);
    K->copy_cols(&kdev, &tb, 2, &td, 1, 6, -1, true); /* the inverse, added: back = 0.5 + src there */
    for (int i = 0; i < M; i++)
        for (int j = 0; j < NS; j++)
            assert_true(back[i * NS + j] == (j >= 2 && j < 8 ? 0.5f + src[i * NS + j] : 0.5f));
    K->copy_cols(&kdev, &td, 0, &ts, 7, 3, 0, false); /* plain */
    for (int i = 0; i < M; i++)
        for (int j = 0; j < 3; j++)
            assert_true(dst[i * ND + j] == src[i * NS + 7 + j]);
    uint16_t bs[M * NS], bd[M * ND];
    for (int i = 0; i < M * NS; i++)
        bs[i] = am_f32_to_bf16(src[i]);
    for (int i = 0; i < M * ND; i++)
        bd[i] = am_f32_to_bf16(0.25f);
    struct am_tensor bts = am_tensor_view(bs, AM_DEV_CPU, AM_BF16, M, NS, 0, 0);
    struct am_tensor btd = am_tensor_view(bd, AM_DEV_CPU, AM_BF16, M, ND, 0, 0);
    K->copy_cols(&kdev, &btd, 3, &bts, 0, 4, 1, true); /* bf16, added in fp32 and rounded once */
    for (int i = 0; i < M; i++)
        for (int j = 0; j < 4; j++)
            assert_true(bd[i * ND + 3 + j] == am_f32_to_bf16(0.25f + src[i * NS + (j < 2 ? 2 * j : 2 * (j - 2) + 1)]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_expf),
        cmocka_unit_test(test_memory),
        cmocka_unit_test(test_elementwise),
        cmocka_unit_test(test_scalars_and_convert),
        cmocka_unit_test(test_bf16_elementwise),
        cmocka_unit_test(test_copy_cols),
    };
    return cmocka_run_group_tests_name("kernels (cpu): element-wise", tests, kernels_test_setup, NULL);
}
