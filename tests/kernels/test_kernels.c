/* test_kernels.c - the CPU kernels against plain references written in double precision.
 *
 * Every forward is compared with a reference computed here, in double, from the same fp32
 * inputs; every backward with (a) a reference backward and (b) central finite differences
 * of a scalar loss, L = Σ out ⊙ R with R random, taken on the double-precision reference
 * forward (so the differences are accurate to ~1e-9 and the tolerance is the kernel's).
 * Backward kernels accumulate, so gradients start from random values and the expected
 * result is start + gradient.
 *
 * Tolerances. u = 2^-24 is fp32's unit roundoff. A dot product of K fp32 terms, however it
 * is blocked, errs by at most about K u Σ|a_k b_k| (the classic γ_K bound); where a
 * reference can carry Σ|terms| along (matmul, RMSNorm, cross-entropy) the bound is per
 * element and derived in the test; where the composition is long (attention) it is
 * normwise, max|err| <= c (D + T) u max|ref|, with the factor explained at the test.
 * Observed errors are one to three orders of magnitude below these bounds (run with
 * AM_TEST_VERBOSE=1 to print the worst error/tolerance ratio of every comparison); a
 * wrong index, sign, scale or GQA mapping gives errors of order 1.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <omp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef AM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "kernels.h"
#include "cpu/cpu.h" /* the backend's private am_expf, tested directly below */

#define U 5.9604644775390625e-08 /* 2^-24 */

static struct am_dev kdev; /* the CPU's device context */
static const struct am_kernels *K; /* kdev.k */

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

/* ---- helpers: random numbers, paired fp32/double arrays, comparisons, finite differences ---- */

struct rng {
    uint64_t s;
};

static double rng_uniform(struct rng *r, double lo, double hi) /* xorshift64*, 53 bits */
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    uint64_t v = r->s * 2685821657736338717ull;
    return lo + (hi - lo) * (double)(v >> 11) * (1.0 / 9007199254740992.0);
}

/* An fp32 array (what the kernel sees) with its exact double copy (what the reference sees). */
struct arr {
    float *f;
    double *d;
    int64_t n;
};

static struct arr arr_new(int64_t n)
{
    struct arr a = {K->alloc(&kdev, (size_t)n * sizeof(float)), calloc((size_t)(n ? n : 1), sizeof(double)), n};
    assert_non_null(a.f);
    assert_non_null(a.d);
    return a;
}

static struct arr arr_rand(struct rng *r, int64_t n, double lo, double hi)
{
    struct arr a = arr_new(n);
    for (int64_t i = 0; i < n; i++) {
        a.f[i] = (float)rng_uniform(r, lo, hi);
        a.d[i] = a.f[i];
    }
    return a;
}

static struct arr arr_copy(const struct arr *src)
{
    struct arr a = arr_new(src->n);
    memcpy(a.f, src->f, (size_t)src->n * sizeof(float));
    memcpy(a.d, src->d, (size_t)src->n * sizeof(double));
    return a;
}

static void arr_free(struct arr *a)
{
    K->free(&kdev, a->f);
    free(a->d);
    a->f = NULL;
    a->d = NULL;
}

static double *dalloc(int64_t n)
{
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    assert_non_null(p);
    return p;
}

static struct am_tensor tview(struct arr *a, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(a->f, AM_DEV_CPU, AM_F32, d0, d1, d2, d3);
}

static struct am_tensor ids_view(int32_t *p, int64_t n)
{
    return am_tensor_view(p, AM_DEV_CPU, AM_I32, n, 0, 0, 0);
}

static double max_abs(const double *x, int64_t n)
{
    double m = 0.0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs(x[i]));
    return m;
}

/* Asserts |got_i - want_i| <= tol_i for every i (NaN fails). */
static void expect_close(const char *what, const float *got, const double *want, const double *tol, int64_t n)
{
    double worst = 0.0;
    int64_t at = -1, bad = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]);
        double ratio = tol[i] > 0 ? e / tol[i] : (e > 0 ? INFINITY : 0.0);
        if (!(e <= tol[i]))
            bad++;
        if (!(ratio <= worst)) {
            worst = ratio;
            at = i;
        }
    }
    if (getenv("AM_TEST_VERBOSE"))
        printf("    %-44s n=%-7lld worst err/tol %.2e [%lld]\n", what, (long long)n, worst, (long long)at);
    if (bad) {
        print_error("%s: %lld of %lld elements out of tolerance; worst [%lld]: got %.9g want %.9g (|err| %.3g, tol %.3g)\n",
                    what, (long long)bad, (long long)n, (long long)at, (double)got[at], want[at],
                    fabs((double)got[at] - want[at]), tol[at]);
        fail();
    }
}

/* The same with one tolerance for all: rel * max|want| + abs. */
static void expect_close_norm(const char *what, const float *got, const double *want, int64_t n, double rel,
                              double abs_tol)
{
    double *tol = dalloc(n), t = rel * max_abs(want, n) + abs_tol;
    for (int64_t i = 0; i < n; i++)
        tol[i] = t;
    expect_close(what, got, want, tol, n);
    free(tol);
}

static void expect_bitwise(const char *what, const float *a, const float *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            print_error("%s: element %lld differs: %.9g vs %.9g\n", what, (long long)i, (double)a[i], (double)b[i]);
            fail();
        }
}

/* Central differences of loss() with respect to p[0..n), into fd. loss() is the double
 * reference forward, h = 1e-6: truncation error ~h² f''' / 6 ~ 1e-12 f''', cancellation
 * ~1e-16 |L| / h ~ 1e-10 |L|. */
typedef double (*loss_fn)(void *ctx);
static void fd_grad(loss_fn loss, void *ctx, double *p, int64_t n, double *fd)
{
    for (int64_t i = 0; i < n; i++) {
        double s = p[i], h = 1e-6 * fmax(1.0, fabs(s));
        volatile double up = s + h, dn = s - h;
        p[i] = up;
        double lp = loss(ctx);
        p[i] = dn;
        double lm = loss(ctx);
        p[i] = s;
        fd[i] = (lp - lm) / (up - dn);
    }
}

/* got (accumulated onto start) against start + fd, with the kernel's tolerance plus the
 * finite differences' own error (1e-7 of the largest derivative, far above ~1e-10). */
static void expect_fd(const char *what, const float *got, const double *start, const double *fd, const double *tol,
                      int64_t n)
{
    double *want = dalloc(n), *t = dalloc(n), slack = 1e-7 * (1.0 + max_abs(fd, n));
    for (int64_t i = 0; i < n; i++) {
        want[i] = (start ? start[i] : 0.0) + fd[i];
        t[i] = tol[i] + slack;
    }
    expect_close(what, got, want, t, n);
    free(want);
    free(t);
}

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

/* ---- matmul: y = x · wᵀ ---- */

static void ref_matmul(const double *x, const double *w, int64_t M, int64_t Kd, int64_t N, double *y, double *yabs)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0.0, a = 0.0;
            for (int64_t k = 0; k < Kd; k++) {
                s += x[i * Kd + k] * w[j * Kd + k];
                a += fabs(x[i * Kd + k] * w[j * Kd + k]);
            }
            y[i * N + j] = s;
            if (yabs)
                yabs[i * N + j] = a;
        }
}

struct mm_ctx {
    double *x, *w, *R, *y;
    int64_t M, K, N;
};

static double mm_loss(void *p)
{
    struct mm_ctx *c = p;
    ref_matmul(c->x, c->w, c->M, c->K, c->N, c->y, NULL);
    double L = 0.0;
    for (int64_t i = 0; i < c->M * c->N; i++)
        L += c->y[i] * c->R[i];
    return L;
}

static void test_matmul(void **state)
{
    (void)state;
    struct rng r = {7};
    int64_t cases[][3] = {{1, 1, 1}, {7, 5, 3}, {7, 13, 9}, {64, 96, 40}, {130, 70, 300}}; /* M, K, N */
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t M = cases[c][0], Kd = cases[c][1], N = cases[c][2];
        struct arr x = arr_rand(&r, M * Kd, -1, 1), w = arr_rand(&r, N * Kd, -1, 1), y = arr_new(M * N);
        struct arr dy = arr_rand(&r, M * N, -1, 1), dx = arr_rand(&r, M * Kd, -1, 1), dw = arr_rand(&r, N * Kd, -1, 1);
        struct arr dx0 = arr_copy(&dx), dw0 = arr_copy(&dw);
        for (int64_t i = 0; i < M * N; i++)
            y.f[i] = NAN; /* the forward overwrites */
        struct am_tensor tx = tview(&x, M, Kd, 0, 0), tw = tview(&w, N, Kd, 0, 0), ty = tview(&y, M, N, 0, 0);
        struct am_tensor tdy = tview(&dy, M, N, 0, 0), tdx = tview(&dx, M, Kd, 0, 0), tdw = tview(&dw, N, Kd, 0, 0);
        K->matmul_forward(&kdev, &ty, &tx, &tw);
        double *want = dalloc(M * N), *absr = dalloc(M * N), *tol = dalloc(M * N);
        ref_matmul(x.d, w.d, M, Kd, N, want, absr);
        /* sgemm's dot of K terms: |err| <= (K + 2) u Σ|x w| */
        for (int64_t i = 0; i < M * N; i++)
            tol[i] = (double)(Kd + 2) * U * absr[i];
        expect_close("matmul forward y", y.f, want, tol, M * N);

        K->matmul_backward(&kdev, &tdx, &tdw, &tdy, &tx, &tw);
        /* dx = dx0 + dy · w (N terms), dw = dw0 + dyᵀ · x (M terms); +1 term for dx0 */
        double *wdx = dalloc(M * Kd), *tdxl = dalloc(M * Kd), *wdw = dalloc(N * Kd), *tdwl = dalloc(N * Kd);
        for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < Kd; k++) {
                double s = dx0.d[i * Kd + k], a = fabs(s);
                for (int64_t j = 0; j < N; j++) {
                    s += dy.d[i * N + j] * w.d[j * Kd + k];
                    a += fabs(dy.d[i * N + j] * w.d[j * Kd + k]);
                }
                wdx[i * Kd + k] = s;
                tdxl[i * Kd + k] = (double)(N + 3) * U * a;
            }
        for (int64_t j = 0; j < N; j++)
            for (int64_t k = 0; k < Kd; k++) {
                double s = dw0.d[j * Kd + k], a = fabs(s);
                for (int64_t i = 0; i < M; i++) {
                    s += dy.d[i * N + j] * x.d[i * Kd + k];
                    a += fabs(dy.d[i * N + j] * x.d[i * Kd + k]);
                }
                wdw[j * Kd + k] = s;
                tdwl[j * Kd + k] = (double)(M + 3) * U * a;
            }
        expect_close("matmul backward dx", dx.f, wdx, tdxl, M * Kd);
        expect_close("matmul backward dw", dw.f, wdw, tdwl, N * Kd);

        if (M * Kd * N <= 2000) { /* finite differences of L = Σ y ⊙ dy */
            struct mm_ctx ctx = {x.d, w.d, dy.d, dalloc(M * N), M, Kd, N};
            double *fd = dalloc(M * Kd > N * Kd ? M * Kd : N * Kd);
            fd_grad(mm_loss, &ctx, x.d, M * Kd, fd);
            expect_fd("matmul dx vs finite differences", dx.f, dx0.d, fd, tdxl, M * Kd);
            fd_grad(mm_loss, &ctx, w.d, N * Kd, fd);
            expect_fd("matmul dw vs finite differences", dw.f, dw0.d, fd, tdwl, N * Kd);
            free(fd);
            free(ctx.y);
        }
        /* either gradient may be NULL: dw alone again adds the same dyᵀ·x once more */
        K->matmul_backward(&kdev, NULL, &tdw, &tdy, &tx, &tw);
        for (int64_t i = 0; i < N * Kd; i++) {
            wdw[i] += wdw[i] - dw0.d[i];
            tdwl[i] *= 2;
        }
        expect_close("matmul backward dw only (accumulates)", dw.f, wdw, tdwl, N * Kd);
        free(want);
        free(absr);
        free(tol);
        free(wdx);
        free(tdxl);
        free(wdw);
        free(tdwl);
        struct arr *all[] = {&x, &w, &y, &dy, &dx, &dw, &dx0, &dw0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* ---- embedding, vocabulary-parallel ---- */

static void test_embedding(void **state)
{
    (void)state;
    struct rng r = {11};
    int64_t cases[][3] = {{9, 37, 13}, {300, 64, 512}}; /* N, V, C */
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t N = cases[c][0], V = cases[c][1], C = cases[c][2], V0 = V / 2;
        int32_t *ids = malloc((size_t)N * sizeof(int32_t));
        for (int64_t i = 0; i < N; i++)
            ids[i] = (int32_t)(rng_uniform(&r, 0, 1) * (double)V) % (int32_t)V;
        ids[0] = ids[N - 1] = 3;                /* repeated ids add up */
        ids[1] = -1;                            /* out of the vocabulary: zero row, no gradient */
        ids[2] = (int32_t)V;                    /* one past the end */
        struct arr wte = arr_rand(&r, V * C, -1, 1), out = arr_new(N * C), dout = arr_rand(&r, N * C, -1, 1);
        struct am_tensor tids = ids_view(ids, N), twte = tview(&wte, V, C, 0, 0), tout = tview(&out, N, C, 0, 0);
        for (int64_t i = 0; i < N * C; i++)
            out.f[i] = NAN;
        K->embedding_forward(&kdev, &tout, &tids, &twte, 0);
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < C; j++) {
                float want = ids[i] >= 0 && ids[i] < V ? wte.f[ids[i] * C + j] : 0.0f;
                assert_true(out.f[i * C + j] == want);
            }
        /* two shards [0, V0) and [V0, V): the sum of their outputs is the whole table's, exactly */
        struct arr o1 = arr_new(N * C), o2 = arr_new(N * C);
        struct am_tensor to1 = tview(&o1, N, C, 0, 0), to2 = tview(&o2, N, C, 0, 0);
        struct am_tensor w1 = am_tensor_view(wte.f, AM_DEV_CPU, AM_F32, V0, C, 0, 0);
        struct am_tensor w2 = am_tensor_view(wte.f + V0 * C, AM_DEV_CPU, AM_F32, V - V0, C, 0, 0);
        K->embedding_forward(&kdev, &to1, &tids, &w1, 0);
        K->embedding_forward(&kdev, &to2, &tids, &w2, V0);
        for (int64_t i = 0; i < N * C; i++)
            o1.f[i] += o2.f[i];
        expect_bitwise("embedding: shards summed == unsharded", o1.f, out.f, N * C);

        /* backward: dwte = dwte0 + scatter-add of dout; at most N + 1 terms per element */
        struct arr dw = arr_rand(&r, V * C, -1, 1), dw0 = arr_copy(&dw);
        struct am_tensor tdw = tview(&dw, V, C, 0, 0), tdout = tview(&dout, N, C, 0, 0);
        K->embedding_backward(&kdev, &tdw, &tdout, &tids, 0);
        double *want = dalloc(V * C), *tol = dalloc(V * C);
        for (int64_t i = 0; i < V * C; i++) {
            want[i] = dw0.d[i];
            tol[i] = fabs(dw0.d[i]);
        }
        for (int64_t i = 0; i < N; i++)
            if (ids[i] >= 0 && ids[i] < V)
                for (int64_t j = 0; j < C; j++) {
                    want[ids[i] * C + j] += dout.d[i * C + j];
                    tol[ids[i] * C + j] += fabs(dout.d[i * C + j]);
                }
        for (int64_t i = 0; i < V * C; i++)
            tol[i] *= (double)(N + 1) * U;
        expect_close("embedding backward dwte", dw.f, want, tol, V * C);
        /* L = Σ out ⊙ dout is linear in wte: its derivative is the scatter itself */
        double *fd = dalloc(V * C);
        for (int64_t i = 0; i < N; i++)
            if (ids[i] >= 0 && ids[i] < V)
                for (int64_t j = 0; j < C; j++)
                    fd[ids[i] * C + j] += dout.d[i * C + j];
        expect_fd("embedding dwte vs derivative of Σ out·R", dw.f, dw0.d, fd, tol, V * C);
        /* sharded backward: each shard's rows equal the unsharded rows, bitwise (same order) */
        struct arr dws = arr_copy(&dw0);
        struct am_tensor d1 = am_tensor_view(dws.f, AM_DEV_CPU, AM_F32, V0, C, 0, 0);
        struct am_tensor d2 = am_tensor_view(dws.f + V0 * C, AM_DEV_CPU, AM_F32, V - V0, C, 0, 0);
        K->embedding_backward(&kdev, &d1, &tdout, &tids, 0);
        K->embedding_backward(&kdev, &d2, &tdout, &tids, V0);
        expect_bitwise("embedding backward: shards == unsharded", dws.f, dw.f, V * C);
        /* deterministic: one thread and three threads give the same bits */
        struct arr a1 = arr_copy(&dw0), a3 = arr_copy(&dw0);
        struct am_tensor ta1 = tview(&a1, V, C, 0, 0), ta3 = tview(&a3, V, C, 0, 0);
        omp_set_num_threads(1);
        K->embedding_backward(&kdev, &ta1, &tdout, &tids, 0);
        omp_set_num_threads(3);
        K->embedding_backward(&kdev, &ta3, &tdout, &tids, 0);
        omp_set_num_threads(omp_get_num_procs());
        expect_bitwise("embedding backward: 1 thread == 3 threads", a1.f, a3.f, V * C);
        expect_bitwise("embedding backward: 1 thread == default", a1.f, dw.f, V * C);
        free(want);
        free(tol);
        free(fd);
        free(ids);
        struct arr *all[] = {&wte, &out, &dout, &o1, &o2, &dw, &dw0, &dws, &a1, &a3};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* ---- RMSNorm ---- */

struct rms_ctx {
    double *x, *w, *R, *out;
    int64_t N, C;
    double eps;
};

static void ref_rmsnorm(const double *x, const double *w, int64_t N, int64_t C, double eps, double *out, double *rstd)
{
    for (int64_t i = 0; i < N; i++) {
        double ss = 0.0;
        for (int64_t j = 0; j < C; j++)
            ss += x[i * C + j] * x[i * C + j];
        double r = 1.0 / sqrt(ss / (double)C + eps);
        if (rstd)
            rstd[i] = r;
        for (int64_t j = 0; j < C; j++)
            out[i * C + j] = w[j] * x[i * C + j] * r;
    }
}

static double rms_loss(void *p)
{
    struct rms_ctx *c = p;
    ref_rmsnorm(c->x, c->w, c->N, c->C, c->eps, c->out, NULL);
    double L = 0.0;
    for (int64_t i = 0; i < c->N * c->C; i++)
        L += c->out[i] * c->R[i];
    return L;
}

static void test_rmsnorm(void **state)
{
    (void)state;
    struct rng r = {13};
    struct {
        int64_t N, C;
        float eps;
    } cases[] = {{1, 8, 1e-5f}, {7, 13, 1e-6f}, {64, 512, 1e-5f}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t N = cases[c].N, C = cases[c].C;
        double eps = cases[c].eps;
        struct arr x = arr_rand(&r, N * C, -2, 2), w = arr_rand(&r, C, 0.5, 1.5), out = arr_new(N * C);
        struct arr rstd = arr_new(N);
        for (int64_t j = 0; j < C; j++) { /* a row of small values, where eps matters */
            x.f[j] *= 1e-3f;
            x.d[j] = x.f[j];
        }
        struct am_tensor tx = tview(&x, N, C, 0, 0), tw = tview(&w, C, 0, 0, 0), to = tview(&out, N, C, 0, 0);
        struct am_tensor tr = tview(&rstd, N, 0, 0, 0);
        K->rmsnorm_forward(&kdev, &to, &tr, &tx, &tw, cases[c].eps);
        double *want = dalloc(N * C), *wr = dalloc(N), *tol = dalloc(N * C), *trs = dalloc(N);
        ref_rmsnorm(x.d, w.d, N, C, eps, want, wr);
        /* rstd: mean (double, rounded once), + eps, sqrt, reciprocal: 4 roundings; out: two
         * more products. Tolerances 5u and 8u relative. */
        for (int64_t i = 0; i < N; i++)
            trs[i] = 5 * U * wr[i];
        for (int64_t i = 0; i < N * C; i++)
            tol[i] = 8 * U * fabs(want[i]);
        expect_close("rmsnorm forward rstd", rstd.f, wr, trs, N);
        expect_close("rmsnorm forward out", out.f, want, tol, N * C);

        /* backward: dx_ij = r (g_ij - x_ij r² Σ_k g_ik x_ik / C), g = dout w; dw_j = Σ_i dout x r */
        struct arr dout = arr_rand(&r, N * C, -1, 1), dx = arr_rand(&r, N * C, -1, 1), dw = arr_rand(&r, C, -1, 1);
        struct arr dx0 = arr_copy(&dx), dw0 = arr_copy(&dw);
        struct am_tensor tdo = tview(&dout, N, C, 0, 0), tdx = tview(&dx, N, C, 0, 0), tdw = tview(&dw, C, 0, 0, 0);
        K->rmsnorm_backward(&kdev, &tdx, &tdw, &tdo, &tx, &tw, &tr);
        double *wdx = dalloc(N * C), *tdxl = dalloc(N * C), *wdw = dalloc(C), *tdwl = dalloc(C);
        for (int64_t j = 0; j < C; j++) {
            wdw[j] = dw0.d[j];
            tdwl[j] = fabs(dw0.d[j]);
        }
        for (int64_t i = 0; i < N; i++) {
            double rr = wr[i], dot = 0.0, adot = 0.0;
            for (int64_t k = 0; k < C; k++) {
                dot += dout.d[i * C + k] * w.d[k] * x.d[i * C + k];
                adot += fabs(dout.d[i * C + k] * w.d[k] * x.d[i * C + k]);
            }
            for (int64_t j = 0; j < C; j++) {
                double g = dout.d[i * C + j] * w.d[j], xv = x.d[i * C + j];
                wdx[i * C + j] = dx0.d[i * C + j] + rr * (g - xv * rr * rr * dot / (double)C);
                /* the C-term dot (C + 2) u, rstd 5u, and a handful of products: 10u */
                tdxl[i * C + j] = U * ((double)(C + 10) * rr * rr * rr * fabs(xv) * adot / (double)C +
                                       10 * rr * fabs(g) + fabs(wdx[i * C + j]));
                wdw[j] += dout.d[i * C + j] * xv * rr;
                tdwl[j] += fabs(dout.d[i * C + j] * xv * rr);
            }
        }
        for (int64_t j = 0; j < C; j++)
            tdwl[j] *= (double)(N + 8) * U; /* N-term sum, each term with rstd's 5u and 2 products */
        expect_close("rmsnorm backward dx", dx.f, wdx, tdxl, N * C);
        expect_close("rmsnorm backward dw", dw.f, wdw, tdwl, C);
        if (N * C <= 200) {
            struct rms_ctx ctx = {x.d, w.d, dout.d, dalloc(N * C), N, C, eps};
            double *fd = dalloc(N * C);
            fd_grad(rms_loss, &ctx, x.d, N * C, fd);
            expect_fd("rmsnorm dx vs finite differences", dx.f, dx0.d, fd, tdxl, N * C);
            fd_grad(rms_loss, &ctx, w.d, C, fd);
            expect_fd("rmsnorm dw vs finite differences", dw.f, dw0.d, fd, tdwl, C);
            free(fd);
            free(ctx.out);
        }
        /* deterministic across thread counts (dw is summed per column, rows in order) */
        struct arr a1 = arr_copy(&dx0), b1 = arr_copy(&dw0), a3 = arr_copy(&dx0), b3 = arr_copy(&dw0);
        struct am_tensor ta1 = tview(&a1, N, C, 0, 0), tb1 = tview(&b1, C, 0, 0, 0);
        struct am_tensor ta3 = tview(&a3, N, C, 0, 0), tb3 = tview(&b3, C, 0, 0, 0);
        omp_set_num_threads(1);
        K->rmsnorm_backward(&kdev, &ta1, &tb1, &tdo, &tx, &tw, &tr);
        omp_set_num_threads(3);
        K->rmsnorm_backward(&kdev, &ta3, &tb3, &tdo, &tx, &tw, &tr);
        omp_set_num_threads(omp_get_num_procs());
        expect_bitwise("rmsnorm backward dx: 1 thread == 3 threads", a1.f, a3.f, N * C);
        expect_bitwise("rmsnorm backward dw: 1 thread == 3 threads", b1.f, b3.f, C);
        free(want);
        free(wr);
        free(tol);
        free(trs);
        free(wdx);
        free(tdxl);
        free(wdw);
        free(tdwl);
        struct arr *all[] = {&x, &w, &out, &rstd, &dout, &dx, &dw, &dx0, &dw0, &a1, &b1, &a3, &b3};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* ---- RoPE tables ---- */

/* (A) The textbook definition in double: inv_freq_i = theta^(-2i/D), with Llama 3's
 * scaling (transformers' _compute_llama3_parameters) or linear scaling. */
static double ref_inv_freq(double theta, int64_t i, int64_t D, const struct am_rope_scaling *sc)
{
    double inv = 1.0 / pow(theta, (double)(2 * i) / (double)D);
    if (!sc || !sc->type)
        return inv;
    if (strcmp(sc->type, "linear") == 0)
        return inv / sc->factor;
    double old = (double)sc->original_max_position_embeddings;
    double low_wavelen = old / sc->low_freq_factor, high_wavelen = old / sc->high_freq_factor;
    double wavelen = 2 * M_PI / inv;
    if (wavelen < high_wavelen)
        return inv;
    if (wavelen > low_wavelen)
        return inv / sc->factor;
    double smooth = (old / wavelen - sc->low_freq_factor) / (sc->high_freq_factor - sc->low_freq_factor);
    return (1 - smooth) * inv / sc->factor + smooth * inv;
}

/* (B) What transformers computes, step by step in fp32 tensors (LlamaRotaryEmbedding):
 * written here from the Python source, separately from the kernel. Python scalars meet
 * fp32 tensors as fp32; `a / tensor` is tensor.reciprocal() * a. */
static float torch_inv_freq(double theta, int64_t i, int64_t D, const struct am_rope_scaling *sc)
{
    float expo = (float)(2 * i) / (float)D;                   /* arange(0, dim, 2).float() / dim */
    float powered = (float)pow((double)(float)theta, expo);   /* base ** tensor (correctly rounded) */
    float inv = 1.0f / powered;                               /* 1.0 / tensor */
    if (!sc || !sc->type)
        return inv;
    if (strcmp(sc->type, "linear") == 0)
        return inv / (float)sc->factor;                       /* inv_freq /= factor */
    double old = (double)sc->original_max_position_embeddings;
    float low_wl = (float)(old / sc->low_freq_factor), high_wl = (float)(old / sc->high_freq_factor);
    float wavelen = (1.0f / inv) * (float)(2 * M_PI);         /* 2 * math.pi / inv_freq */
    float llama = wavelen > low_wl ? inv / (float)sc->factor : inv;
    if (wavelen >= high_wl && wavelen <= low_wl) {
        float smooth = ((1.0f / wavelen) * (float)old - (float)sc->low_freq_factor) /
                       (float)(sc->high_freq_factor - sc->low_freq_factor);
        float a = (1.0f - smooth) * llama;
        llama = a / (float)sc->factor + smooth * llama;
    }
    return llama;
}

static void test_rope_tables(void **state)
{
    (void)state;
    struct am_rope_scaling llama31 = {"llama3", 8.0, 1.0, 4.0, 8192}; /* Llama 3.1's published settings */
    struct am_rope_scaling linear4 = {"linear", 4.0, 0, 0, 0};
    struct {
        double theta;
        int64_t D;
        const struct am_rope_scaling *sc;
    } cases[] = {{10000, 64, NULL},     {10000, 128, NULL},    {500000, 128, NULL}, {500000, 64, NULL},
                 {500000, 128, &llama31}, {10000, 64, &llama31}, {10000, 64, &linear4}};
    const int64_t T = 8192;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t D = cases[c].D, half = D / 2;
        struct arr co = arr_new(T * half), si = arr_new(T * half);
        struct am_tensor tc = tview(&co, T, half, 0, 0), ts = tview(&si, T, half, 0, 0);
        K->rope_tables(&kdev, &tc, &ts, cases[c].theta, cases[c].sc);
        /* (A) position 1 holds sin(inv_freq) and cos(inv_freq); for small angles sin keeps
         * inv_freq's relative precision. The kernel's fp32 inv_freq comes out of at most
         * ten fp32 operations (llama3's smoothing), each rounding once: 16u relative, plus
         * sin's own rounding. */
        double *wants = dalloc(half), *tol = dalloc(half);
        for (int64_t i = 0; i < half; i++) {
            double inv = ref_inv_freq(cases[c].theta, i, D, cases[c].sc);
            wants[i] = sin(inv);
            tol[i] = 16 * U * inv + U * fabs(wants[i]);
        }
        char what[160];
        snprintf(what, sizeof what, "rope inv_freq theta=%g D=%lld %s", cases[c].theta, (long long)D,
                 cases[c].sc ? cases[c].sc->type : "");
        expect_close(what, si.f + half, wants, tol, half);
        /* (B) every position up to 8191: angle = fp32(t * inv_freq) as torch forms it, cos
         * and sin of that angle. Agreement to 1e-6 requires the fp32 order: at position 8000
         * one ulp of inv_freq or of the angle moves cos by up to 5e-4. */
        double *wc = dalloc(T * half), *ws = dalloc(T * half);
        for (int64_t i = 0; i < half; i++) {
            float inv = torch_inv_freq(cases[c].theta, i, D, cases[c].sc);
            for (int64_t t = 0; t < T; t++) {
                float angle = (float)t * inv;
                wc[t * half + i] = cos((double)angle);
                ws[t * half + i] = sin((double)angle);
            }
        }
        snprintf(what, sizeof what, "rope cos theta=%g D=%lld %s", cases[c].theta, (long long)D,
                 cases[c].sc ? cases[c].sc->type : "");
        expect_close_norm(what, co.f, wc, T * half, 0.0, 1e-6);
        snprintf(what, sizeof what, "rope sin theta=%g D=%lld %s", cases[c].theta, (long long)D,
                 cases[c].sc ? cases[c].sc->type : "");
        expect_close_norm(what, si.f, ws, T * half, 0.0, 1e-6);
        free(wants);
        free(tol);
        free(wc);
        free(ws);
        arr_free(&co);
        arr_free(&si);
    }
    /* llama3 scaling leaves the highest frequencies alone and divides the lowest by 8 */
    struct arr co = arr_new(2 * 64), si = arr_new(2 * 64), co8 = arr_new(2 * 64), si8 = arr_new(2 * 64);
    struct am_tensor tc = tview(&co, 2, 64, 0, 0), ts = tview(&si, 2, 64, 0, 0);
    struct am_tensor tc8 = tview(&co8, 2, 64, 0, 0), ts8 = tview(&si8, 2, 64, 0, 0);
    K->rope_tables(&kdev, &tc, &ts, 500000, NULL);
    struct am_rope_scaling deflt = {"default", 0, 0, 0, 0}; /* rope_type "default": no scaling */
    K->rope_tables(&kdev, &tc8, &ts8, 500000, &deflt);
    expect_bitwise("rope: rope_type default == no scaling", si8.f, si.f, 2 * 64);
    K->rope_tables(&kdev, &tc8, &ts8, 500000, &llama31);
    assert_true(si8.f[64 + 0] == si.f[64 + 0]);                       /* wavelen 2π < 2048 */
    assert_true(fabs(si8.f[64 + 63] - si.f[64 + 63] / 8) < 1e-6 * si.f[64 + 63]); /* wavelen > 8192 */
    arr_free(&co);
    arr_free(&si);
    arr_free(&co8);
    arr_free(&si8);
}

/* ---- RoPE forward / backward ---- */

static void ref_rope(const double *x, const double *co, const double *si, int64_t B, int64_t T, int64_t H, int64_t D,
                     double sign, double *y, double *yabs)
{
    int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const double *xr = x + ((b * T + t) * H + h) * D;
                double *yr = y + ((b * T + t) * H + h) * D;
                for (int64_t i = 0; i < half; i++) {
                    double c = co[t * half + i], s = sign * si[t * half + i];
                    yr[i] = xr[i] * c - xr[i + half] * s;
                    yr[i + half] = xr[i + half] * c + xr[i] * s;
                    if (yabs) {
                        yabs[((b * T + t) * H + h) * D + i] = fabs(xr[i] * c) + fabs(xr[i + half] * s);
                        yabs[((b * T + t) * H + h) * D + i + half] = fabs(xr[i + half] * c) + fabs(xr[i] * s);
                    }
                }
            }
}

struct rope_ctx {
    double *x, *co, *si, *R, *y;
    int64_t B, T, H, D;
};

static double rope_loss(void *p)
{
    struct rope_ctx *c = p;
    ref_rope(c->x, c->co, c->si, c->B, c->T, c->H, c->D, 1.0, c->y, NULL);
    double L = 0.0;
    for (int64_t i = 0; i < c->B * c->T * c->H * c->D; i++)
        L += c->y[i] * c->R[i];
    return L;
}

static void test_rope(void **state)
{
    (void)state;
    struct rng r = {17};
    int64_t cases[][4] = {{2, 7, 3, 8}, {1, 1, 2, 4}, {2, 33, 4, 64}}; /* B, T, H, D */
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t B = cases[c][0], T = cases[c][1], H = cases[c][2], D = cases[c][3], n = B * T * H * D;
        int64_t TT = T + 9; /* tables longer than the sequence */
        struct arr co = arr_new(TT * D / 2), si = arr_new(TT * D / 2);
        struct am_tensor tc = tview(&co, TT, D / 2, 0, 0), ts = tview(&si, TT, D / 2, 0, 0);
        K->rope_tables(&kdev, &tc, &ts, 10000, NULL);
        for (int64_t i = 0; i < TT * D / 2; i++) {
            co.d[i] = co.f[i];
            si.d[i] = si.f[i];
        }
        struct arr x = arr_rand(&r, n, -1, 1), x0 = arr_copy(&x);
        struct am_tensor tx = tview(&x, B, T, H, D);
        K->rope_forward(&kdev, &tx, &tc, &ts);
        double *want = dalloc(n), *absr = dalloc(n), *tol = dalloc(n);
        ref_rope(x0.d, co.d, si.d, B, T, H, D, 1.0, want, absr);
        for (int64_t i = 0; i < n; i++) /* two products and a sum: 3 roundings */
            tol[i] = 3 * U * absr[i];
        expect_close("rope forward", x.f, want, tol, n);
        /* backward rotates dy in place by the opposite angle */
        struct arr g = arr_rand(&r, n, -1, 1), g0 = arr_copy(&g);
        struct am_tensor tg = tview(&g, B, T, H, D);
        K->rope_backward(&kdev, &tg, &tc, &ts);
        ref_rope(g0.d, co.d, si.d, B, T, H, D, -1.0, want, absr);
        for (int64_t i = 0; i < n; i++)
            tol[i] = 3 * U * absr[i];
        expect_close("rope backward", g.f, want, tol, n);
        if (n <= 512) {
            struct rope_ctx ctx = {x0.d, co.d, si.d, g0.d, dalloc(n), B, T, H, D};
            double *fd = dalloc(n);
            fd_grad(rope_loss, &ctx, x0.d, n, fd);
            expect_fd("rope backward vs finite differences", g.f, NULL, fd, tol, n);
            free(fd);
            free(ctx.y);
        }
        /* the backward undoes the forward (a rotation, cos² + sin² = 1 to 2u): 3 roundings
         * each way plus the tables' 2u, relative to the head's largest value */
        K->rope_backward(&kdev, &tx, &tc, &ts);
        double mx = max_abs(x0.d, n);
        for (int64_t i = 0; i < n; i++)
            tol[i] = 10 * U * mx;
        expect_close("rope backward(forward(x)) == x", x.f, x0.d, tol, n);
        free(want);
        free(absr);
        free(tol);
        struct arr *all[] = {&co, &si, &x, &x0, &g, &g0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* ---- causal grouped-query attention ---- */

struct attn_dims {
    int64_t B, T, H, KVH, D;
    int64_t W; /* sliding window (0: none): query t sees keys t - W < j <= t */
    const int32_t *start; /* packed sequences: [B, T], where row (b, t)'s document starts (NULL: at 0) */
};

/* The first key query t of sequence b sees. */
static int64_t ref_first_key(const struct attn_dims *s, int64_t b, int64_t t)
{
    int64_t lo = s->W > 0 && t - s->W + 1 > 0 ? t - s->W + 1 : 0;
    if (s->start && s->start[b * s->T + t] > lo)
        lo = s->start[b * s->T + t];
    return lo;
}

static void ref_attention(const struct attn_dims *s, const double *q, const double *k, const double *v, double *out,
                          double *lse)
{
    int64_t B = s->B, T = s->T, H = s->H, KVH = s->KVH, D = s->D, G = H / KVH;
    double scale = 1.0 / sqrt((double)D), *sc = dalloc(T);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                const double *qt = q + ((b * T + t) * H + h) * D;
                double m = -INFINITY;
                int64_t lo = ref_first_key(s, b, t);
                for (int64_t j = lo; j <= t; j++) {
                    const double *kj = k + ((b * T + j) * KVH + h / G) * D;
                    double dot = 0.0;
                    for (int64_t d = 0; d < D; d++)
                        dot += qt[d] * kj[d];
                    sc[j] = dot * scale;
                    m = fmax(m, sc[j]);
                }
                double l = 0.0;
                for (int64_t j = lo; j <= t; j++)
                    l += exp(sc[j] - m);
                double *ot = out + ((b * T + t) * H + h) * D;
                for (int64_t d = 0; d < D; d++) {
                    double acc = 0.0;
                    for (int64_t j = lo; j <= t; j++)
                        acc += exp(sc[j] - m) / l * v[((b * T + j) * KVH + h / G) * D + d];
                    ot[d] = acc;
                }
                if (lse)
                    lse[(b * H + h) * T + t] = m + log(l);
            }
    free(sc);
}

/* dq, dk, dv += the gradients of L = Σ out ⊙ dout (softmax backward written out plainly) */
static void ref_attention_backward(const struct attn_dims *s, const double *q, const double *k, const double *v,
                                   const double *dout, double *dq, double *dk, double *dv)
{
    int64_t B = s->B, T = s->T, H = s->H, KVH = s->KVH, D = s->D, G = H / KVH;
    double scale = 1.0 / sqrt((double)D), *p = dalloc(T), *dp = dalloc(T);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                int64_t qo = ((b * T + t) * H + h) * D;
                double m = -INFINITY, l = 0.0;
                int64_t lo = ref_first_key(s, b, t);
                for (int64_t j = lo; j <= t; j++) {
                    double dot = 0.0;
                    for (int64_t d = 0; d < D; d++)
                        dot += q[qo + d] * k[((b * T + j) * KVH + h / G) * D + d];
                    p[j] = dot * scale;
                    m = fmax(m, p[j]);
                }
                for (int64_t j = lo; j <= t; j++)
                    l += exp(p[j] - m);
                double sum_pdp = 0.0;
                for (int64_t j = lo; j <= t; j++) {
                    int64_t ko = ((b * T + j) * KVH + h / G) * D;
                    p[j] = exp(p[j] - m) / l;
                    dp[j] = 0.0;
                    for (int64_t d = 0; d < D; d++)
                        dp[j] += dout[qo + d] * v[ko + d];
                    sum_pdp += p[j] * dp[j];
                }
                for (int64_t j = lo; j <= t; j++) {
                    int64_t ko = ((b * T + j) * KVH + h / G) * D;
                    double ds = p[j] * (dp[j] - sum_pdp) * scale;
                    for (int64_t d = 0; d < D; d++) {
                        dq[qo + d] += ds * k[ko + d];
                        dk[ko + d] += ds * q[qo + d];
                        dv[ko + d] += p[j] * dout[qo + d];
                    }
                }
            }
    free(p);
    free(dp);
}

struct attn_ctx {
    struct attn_dims s;
    double *q, *k, *v, *R, *out;
};

static double attn_loss(void *p)
{
    struct attn_ctx *c = p;
    ref_attention(&c->s, c->q, c->k, c->v, c->out, NULL);
    double L = 0.0;
    for (int64_t i = 0; i < c->s.B * c->s.T * c->s.H * c->s.D; i++)
        L += c->out[i] * c->R[i];
    return L;
}

static void test_attention(void **state)
{
    (void)state;
    struct rng r = {19};
    struct attn_dims cases[] = {
        {2, 7, 4, 4, 8, 0, NULL}, /* H/KVH = 1 */
        {2, 7, 4, 2, 8, 0, NULL}, /* 2 */
        {1, 7, 4, 1, 8, 0, NULL}, /* 4 */
        {1, 1, 2, 1, 4, 0, NULL}, /* a single token */
        {2, 33, 8, 4, 16, 0, NULL}, /* several threads */
        {1, 64, 4, 2, 64, 0, NULL}, /* Llama's head size */
        /* sliding windows (Mistral's): shorter than T, across tiles of 16 keys, W = 1 (itself
         * only), W = T - 1, and W = T (the causal result, bit for bit: checked below) */
        {2, 7, 4, 2, 8, 3, NULL},
        {1, 7, 4, 1, 8, 1, NULL},
        {2, 33, 8, 4, 16, 5, NULL},
        {1, 50, 4, 2, 24, 20, NULL},
        {1, 40, 2, 1, 16, 39, NULL},
        {2, 33, 8, 4, 16, 33, NULL},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        struct attn_dims s = cases[c];
        int64_t nq = s.B * s.T * s.H * s.D, nk = s.B * s.T * s.KVH * s.D, nl = s.B * s.H * s.T;
        struct arr q = arr_rand(&r, nq, -1, 1), k = arr_rand(&r, nk, -1, 1), v = arr_rand(&r, nk, -1, 1);
        struct arr out = arr_new(nq), lse = arr_new(nl);
        struct am_tensor tq = tview(&q, s.B, s.T, s.H, s.D), tk = tview(&k, s.B, s.T, s.KVH, s.D);
        struct am_tensor tv = tview(&v, s.B, s.T, s.KVH, s.D), to = tview(&out, s.B, s.T, s.H, s.D);
        struct am_tensor tl = tview(&lse, s.B, s.H, s.T, 0);
        K->attention_forward(&kdev, &to, &tl, &tq, &tk, &tv, s.W);
        double *wo = dalloc(nq), *wl = dalloc(nl);
        ref_attention(&s, q.d, k.d, v.d, wo, wl);
        /* Normwise, 4 (D + T) u: a score is a D-term fp32 dot (<= D u relative to Σ|q k|,
         * which is <= sqrt(D) here, so the scores' error is <= D u in absolute terms); a
         * softmax weight inherits that error plus exp's 2 ulp and the T-term normalising
         * sum; the output adds a T-term weighted sum. The factor 4 covers the few products
         * between. For D = T = 64 this is 3e-5 of the largest value. */
        double rel = 4.0 * (double)(s.D + s.T) * U;
        char what[160];
        snprintf(what, sizeof what, "attention out B%lld T%lld H%lld KVH%lld D%lld W%lld", (long long)s.B,
                 (long long)s.T, (long long)s.H, (long long)s.KVH, (long long)s.D, (long long)s.W);
        expect_close_norm(what, out.f, wo, nq, rel, 0);
        snprintf(what, sizeof what, "attention lse T%lld H%lld KVH%lld", (long long)s.T, (long long)s.H,
                 (long long)s.KVH);
        expect_close_norm(what, lse.f, wl, nl, rel, rel);

        struct arr dout = arr_rand(&r, nq, -1, 1);
        struct arr dq = arr_rand(&r, nq, -1, 1), dk = arr_rand(&r, nk, -1, 1), dv = arr_rand(&r, nk, -1, 1);
        struct arr dq0 = arr_copy(&dq), dk0 = arr_copy(&dk), dv0 = arr_copy(&dv);
        struct am_tensor tdo = tview(&dout, s.B, s.T, s.H, s.D), tdq = tview(&dq, s.B, s.T, s.H, s.D);
        struct am_tensor tdk = tview(&dk, s.B, s.T, s.KVH, s.D), tdv = tview(&dv, s.B, s.T, s.KVH, s.D);
        K->attention_backward(&kdev, &tdq, &tdk, &tdv, &tdo, &to, &tl, &tq, &tk, &tv, s.W);
        double *gq = dalloc(nq), *gk = dalloc(nk), *gv = dalloc(nk);
        ref_attention_backward(&s, q.d, k.d, v.d, dout.d, gq, gk, gv);
        /* Normwise on the gradient itself (the accumulated start adds u of itself):
         * 4 (D + T H/KVH) u: dk and dv of a shared kv head sum over the group's rows. */
        int64_t G = s.H / s.KVH;
        double grel = 4.0 * (double)(s.D + s.T * G) * U;
        double *wq = dalloc(nq), *wk = dalloc(nk), *wv = dalloc(nk), *tq_ = dalloc(nq), *tk_ = dalloc(nk),
               *tv_ = dalloc(nk);
        double mq = max_abs(gq, nq), mk = max_abs(gk, nk), mv = max_abs(gv, nk);
        for (int64_t i = 0; i < nq; i++) {
            wq[i] = dq0.d[i] + gq[i];
            tq_[i] = grel * mq + U * fabs(wq[i]);
        }
        for (int64_t i = 0; i < nk; i++) {
            wk[i] = dk0.d[i] + gk[i];
            wv[i] = dv0.d[i] + gv[i];
            tk_[i] = grel * mk + U * fabs(wk[i]);
            tv_[i] = grel * mv + U * fabs(wv[i]);
        }
        snprintf(what, sizeof what, "attention dq T%lld H%lld KVH%lld D%lld", (long long)s.T, (long long)s.H,
                 (long long)s.KVH, (long long)s.D);
        expect_close(what, dq.f, wq, tq_, nq);
        snprintf(what, sizeof what, "attention dk T%lld H%lld KVH%lld D%lld", (long long)s.T, (long long)s.H,
                 (long long)s.KVH, (long long)s.D);
        expect_close(what, dk.f, wk, tk_, nk);
        snprintf(what, sizeof what, "attention dv T%lld H%lld KVH%lld D%lld", (long long)s.T, (long long)s.H,
                 (long long)s.KVH, (long long)s.D);
        expect_close(what, dv.f, wv, tv_, nk);
        if (nq <= 1024) {
            struct attn_ctx ctx = {s, q.d, k.d, v.d, dout.d, dalloc(nq)};
            double *fd = dalloc(nq);
            fd_grad(attn_loss, &ctx, q.d, nq, fd);
            expect_fd("attention dq vs finite differences", dq.f, dq0.d, fd, tq_, nq);
            /* and the reference backward against the same differences, tightly */
            for (int64_t i = 0; i < nq; i++)
                assert_true(fabs(gq[i] - fd[i]) <= 1e-7 * (1 + max_abs(fd, nq)));
            fd_grad(attn_loss, &ctx, k.d, nk, fd);
            expect_fd("attention dk vs finite differences", dk.f, dk0.d, fd, tk_, nk);
            fd_grad(attn_loss, &ctx, v.d, nk, fd);
            expect_fd("attention dv vs finite differences", dv.f, dv0.d, fd, tv_, nk);
            free(fd);
            free(ctx.out);
        }
        /* deterministic: one thread and three give the same bits */
        struct arr a1[3] = {arr_copy(&dq0), arr_copy(&dk0), arr_copy(&dv0)};
        struct arr a3[3] = {arr_copy(&dq0), arr_copy(&dk0), arr_copy(&dv0)};
        struct am_tensor t1q = tview(&a1[0], s.B, s.T, s.H, s.D), t1k = tview(&a1[1], s.B, s.T, s.KVH, s.D),
                         t1v = tview(&a1[2], s.B, s.T, s.KVH, s.D);
        struct am_tensor t3q = tview(&a3[0], s.B, s.T, s.H, s.D), t3k = tview(&a3[1], s.B, s.T, s.KVH, s.D),
                         t3v = tview(&a3[2], s.B, s.T, s.KVH, s.D);
        omp_set_num_threads(1);
        K->attention_backward(&kdev, &t1q, &t1k, &t1v, &tdo, &to, &tl, &tq, &tk, &tv, s.W);
        omp_set_num_threads(3);
        K->attention_backward(&kdev, &t3q, &t3k, &t3v, &tdo, &to, &tl, &tq, &tk, &tv, s.W);
        omp_set_num_threads(omp_get_num_procs());
        expect_bitwise("attention backward dq: 1 thread == 3 threads", a1[0].f, a3[0].f, nq);
        expect_bitwise("attention backward dk: 1 thread == 3 threads", a1[1].f, a3[1].f, nk);
        expect_bitwise("attention backward dv: 1 thread == 3 threads", a1[2].f, a3[2].f, nk);
        if (s.W >= s.T) { /* a window of T or more is no window: the same bits as without one */
            struct arr o0 = arr_new(nq), l0 = arr_new(nl), c1[3] = {arr_copy(&dq0), arr_copy(&dk0), arr_copy(&dv0)};
            struct am_tensor t0o = tview(&o0, s.B, s.T, s.H, s.D), t0l = tview(&l0, s.B, s.H, s.T, 0);
            struct am_tensor c1q = tview(&c1[0], s.B, s.T, s.H, s.D), c1k = tview(&c1[1], s.B, s.T, s.KVH, s.D),
                             c1v = tview(&c1[2], s.B, s.T, s.KVH, s.D);
            K->attention_forward(&kdev, &t0o, &t0l, &tq, &tk, &tv, 0);
            expect_bitwise("attention out: window >= T == no window", o0.f, out.f, nq);
            expect_bitwise("attention lse: window >= T == no window", l0.f, lse.f, nl);
            omp_set_num_threads(1);
            K->attention_backward(&kdev, &c1q, &c1k, &c1v, &tdo, &to, &tl, &tq, &tk, &tv, 0);
            omp_set_num_threads(omp_get_num_procs());
            for (int i = 0; i < 3; i++) {
                expect_bitwise("attention backward: window >= T == no window", c1[i].f, a1[i].f, i ? nk : nq);
                arr_free(&c1[i]);
            }
            arr_free(&o0);
            arr_free(&l0);
        }
        for (int i = 0; i < 3; i++) {
            arr_free(&a1[i]);
            arr_free(&a3[i]);
        }
        double *bufs[] = {wo, wl, gq, gk, gv, wq, wk, wv, tq_, tk_, tv_};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
            free(bufs[i]);
        struct arr *all[] = {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv, &dq0, &dk0, &dv0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* ---- SwiGLU ---- */

/* The bias: y += b exactly (one fp32 addition per element, bit for bit), db += Σ_i dy[i, :]
 * within the fp32 summation's bound (M u Σ|dy| per column) of the double sum, and the same
 * bits with one thread as with all of them (each column summed over the rows in order). */
static void test_bias(void **state)
{
    (void)state;
    struct rng r = {71};
    int64_t cases[][2] = {{1, 1}, {7, 13}, {300, 600}}; /* M, N: the last runs in parallel */
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t M = cases[c][0], N = cases[c][1];
        struct arr y = arr_rand(&r, M * N, -1, 1), b = arr_rand(&r, N, -1, 1);
        struct am_tensor ty = tview(&y, M, N, 0, 0), tb = tview(&b, N, 0, 0, 0);
        K->bias_forward(&kdev, &ty, &tb);
        for (int64_t i = 0; i < M * N; i++) {
            float want = (float)y.d[i] + (float)b.d[i % N];
            if (memcmp(&y.f[i], &want, 4) != 0) {
                print_error("bias forward [%lld]: got %.9g want %.9g\n", (long long)i, (double)y.f[i], (double)want);
                fail();
            }
        }
        struct arr dy = arr_rand(&r, M * N, -1, 1), db = arr_rand(&r, N, -1, 1);
        struct arr db1 = arr_copy(&db);
        double *want = dalloc(N), *tol = dalloc(N);
        for (int64_t j = 0; j < N; j++) {
            double sum = 0, mag = 0;
            for (int64_t i = 0; i < M; i++) {
                sum += dy.d[i * N + j];
                mag += fabs(dy.d[i * N + j]);
            }
            want[j] = db.d[j] + sum;
            tol[j] = (double)(M + 1) * U * (mag + fabs(db.d[j])) + U * fabs(want[j]);
        }
        struct am_tensor tdy = tview(&dy, M, N, 0, 0), tdb = tview(&db, N, 0, 0, 0), tdb1 = tview(&db1, N, 0, 0, 0);
        K->bias_backward(&kdev, &tdb, &tdy);
        expect_close("bias backward", db.f, want, tol, N);
        int threads = omp_get_max_threads();
        omp_set_num_threads(1);
        K->bias_backward(&kdev, &tdb1, &tdy);
        omp_set_num_threads(threads);
        expect_bitwise("bias backward, 1 thread against all", db1.f, db.f, N);
        free(want);
        free(tol);
        struct arr *all[] = {&y, &b, &dy, &db, &db1};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

struct swiglu_ctx {
    double *g, *u, *R;
    int64_t n;
};

/* ---- attention by blocks of keys (context parallelism's ring) ---- */

/* The zigzag split of T positions over cp ranks: 2 cp chunks of T / (2 cp), rank r holds
 * chunks r and 2 cp - 1 - r, in that order. pos[i]: the position of rank r's row i. */
static void zigzag_positions(int64_t T, int cp, int r, int32_t *pos)
{
    int64_t c = T / (2 * cp);
    for (int64_t i = 0; i < c; i++) {
        pos[i] = (int32_t)(r * c + i);
        pos[c + i] = (int32_t)((2 * cp - 1 - r) * c + i);
    }
}

/* rows pos[0..n) of a [B, T, Hx, D] array into [B, n, Hx, D] */
static void gather_rows(float *dst, const float *src, int64_t B, int64_t T, int64_t n, int64_t width,
                        const int32_t *pos)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++)
            memcpy(dst + (b * n + i) * width, src + (b * T + pos[i]) * width, (size_t)width * sizeof(float));
}

/* Every rank's queries against every rank's keys, block by block in ring order (rank r takes
 * the keys of rank r - s at step s, merging from step 1 on), must give full causal attention
 * (the double reference) on the rows each rank holds; the backward's dq, dk, dv summed over the
 * blocks must give its gradients. GQA, windows, 1 to 4 ranks, several rows per chunk, several
 * tiles of rows. */
static void test_attention_block(void **state)
{
    (void)state;
    struct rng r = {23};
    struct {
        struct attn_dims s;
        int cp;
        bool packed; /* several documents per sequence, of random lengths (qstart) */
    } cases[] = {
        {{2, 16, 4, 2, 8, 0, NULL}, 2, false},  {{1, 32, 4, 1, 16, 0, NULL}, 4, false},
        {{2, 24, 4, 4, 8, 0, NULL}, 3, false},  {{1, 16, 2, 1, 8, 0, NULL}, 1, false},
        {{2, 32, 4, 2, 8, 5, NULL}, 2, false},  {{1, 48, 8, 2, 16, 13, NULL}, 4, false},
        {{1, 64, 4, 2, 64, 0, NULL}, 2, false},
        {{1, 160, 4, 2, 16, 0, NULL}, 1, false},  /* tiles of 64 query rows: 3, the last partial */
        {{1, 288, 2, 1, 8, 40, NULL}, 2, false}, /* 144 rows a rank, a window across chunks */
        {{2, 48, 4, 2, 8, 0, NULL}, 1, true},   {{2, 48, 4, 2, 8, 0, NULL}, 2, true},
        {{3, 64, 4, 1, 16, 0, NULL}, 4, true},  {{2, 96, 4, 2, 8, 7, NULL}, 2, true},
        {{1, 160, 2, 1, 8, 0, NULL}, 1, true}, /* documents across tiles of rows */
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        struct attn_dims s = cases[ci].s;
        int cp = cases[ci].cp;
        int32_t *start = NULL; /* packed: each sequence cut into documents of 1 to T / 3 rows */
        if (cases[ci].packed) {
            start = calloc((size_t)(s.B * s.T), sizeof(int32_t));
            assert_non_null(start);
            for (int64_t b = 0; b < s.B; b++)
                for (int64_t t = 0, first = 0; t < s.T; t++) {
                    if (t > first && rng_uniform(&r, 0, 1) < 3.0 / (double)s.T)
                        first = t;
                    start[b * s.T + t] = (int32_t)first;
                }
            s.start = start;
        }
        int64_t B = s.B, T = s.T, H = s.H, KVH = s.KVH, D = s.D, Tl = T / cp, G = H / KVH;
        int64_t nq = B * T * H * D, nk = B * T * KVH * D, nl = B * H * T;
        struct arr q = arr_rand(&r, nq, -1, 1), k = arr_rand(&r, nk, -1, 1), v = arr_rand(&r, nk, -1, 1);
        struct arr dout = arr_rand(&r, nq, -1, 1);
        double *wo = dalloc(nq), *wl = dalloc(nl), *gq = dalloc(nq), *gk = dalloc(nk), *gv = dalloc(nk);
        ref_attention(&s, q.d, k.d, v.d, wo, wl);
        ref_attention_backward(&s, q.d, k.d, v.d, dout.d, gq, gk, gv);
        int64_t lq = B * Tl * H * D, lk = B * Tl * KVH * D, ll = B * H * Tl;
        /* per rank: its rows of q, k, v, dout; out, lse; dq, dk, dv; positions */
        float *mem = K->alloc(&kdev, (size_t)cp * (size_t)(4 * lq + 4 * lk + ll) * sizeof(float));
        int32_t *pos = K->alloc(&kdev, (size_t)(cp * Tl) * sizeof(int32_t));
        int32_t *qst = K->alloc(&kdev, (size_t)(B * T) * sizeof(int32_t)); /* each rank's rows' starts */
        assert_non_null(mem);
        assert_non_null(pos);
        assert_non_null(qst);
        struct am_tensor tq[4], tk[4], tv[4], tdo[4], to[4], tl[4], tdq[4], tdk[4], tdv[4], tp[4], ts[4];
        for (int x = 0; x < cp; x++) {
            float *m = mem + (size_t)x * (size_t)(4 * lq + 4 * lk + ll);
            zigzag_positions(T, cp, x, pos + x * Tl);
            tp[x] = am_tensor_view(pos + x * Tl, AM_DEV_CPU, AM_I32, Tl, 0, 0, 0);
            ts[x] = am_tensor_view(qst + x * B * Tl, AM_DEV_CPU, AM_I32, B * Tl, 0, 0, 0);
            for (int64_t b = 0; start && b < B; b++)
                for (int64_t i = 0; i < Tl; i++)
                    qst[x * B * Tl + b * Tl + i] = start[b * T + pos[x * Tl + i]];
            tq[x] = am_tensor_view(m, AM_DEV_CPU, AM_F32, B, Tl, H, D);
            tdo[x] = am_tensor_view(m + lq, AM_DEV_CPU, AM_F32, B, Tl, H, D);
            to[x] = am_tensor_view(m + 2 * lq, AM_DEV_CPU, AM_F32, B, Tl, H, D);
            tdq[x] = am_tensor_view(m + 3 * lq, AM_DEV_CPU, AM_F32, B, Tl, H, D);
            tk[x] = am_tensor_view(m + 4 * lq, AM_DEV_CPU, AM_F32, B, Tl, KVH, D);
            tv[x] = am_tensor_view(m + 4 * lq + lk, AM_DEV_CPU, AM_F32, B, Tl, KVH, D);
            tdk[x] = am_tensor_view(m + 4 * lq + 2 * lk, AM_DEV_CPU, AM_F32, B, Tl, KVH, D);
            tdv[x] = am_tensor_view(m + 4 * lq + 3 * lk, AM_DEV_CPU, AM_F32, B, Tl, KVH, D);
            tl[x] = am_tensor_view(m + 4 * lq + 4 * lk, AM_DEV_CPU, AM_F32, B, H, Tl, 0);
            gather_rows(tq[x].data, q.f, B, T, Tl, H * D, pos + x * Tl);
            gather_rows(tdo[x].data, dout.f, B, T, Tl, H * D, pos + x * Tl);
            gather_rows(tk[x].data, k.f, B, T, Tl, KVH * D, pos + x * Tl);
            gather_rows(tv[x].data, v.f, B, T, Tl, KVH * D, pos + x * Tl);
            K->zero(&kdev, &tdq[x]);
            K->zero(&kdev, &tdk[x]);
            K->zero(&kdev, &tdv[x]);
        }
        for (int x = 0; x < cp; x++)
            for (int st = 0; st < cp; st++) {
                int src = ((x - st) % cp + cp) % cp;
                K->attention_block_forward(&kdev, &to[x], &tl[x], &tq[x], &tk[src], &tv[src], &tp[x], &tp[src],
                                           start ? &ts[x] : NULL, s.W, st > 0);
            }
        for (int x = 0; x < cp; x++)
            for (int st = 0; st < cp; st++) {
                int src = ((x - st) % cp + cp) % cp;
                K->attention_block_backward(&kdev, &tdq[x], &tdk[src], &tdv[src], &tdo[x], &to[x], &tl[x], &tq[x],
                                            &tk[src], &tv[src], &tp[x], &tp[src], start ? &ts[x] : NULL, s.W);
            }
        /* the ranks' rows back in sequence order, against the reference (attention's
         * tolerances: a merge adds a few roundings per block, within the factor 4) */
        struct arr go = arr_new(nq), gl = arr_new(nl), dq = arr_new(nq), dk = arr_new(nk), dv = arr_new(nk);
        for (int x = 0; x < cp; x++)
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < Tl; i++) {
                    int64_t t = pos[x * Tl + i];
                    float *lo = (float *)to[x].data, *ld = (float *)tl[x].data;
                    memcpy(go.f + (b * T + t) * H * D, lo + (b * Tl + i) * H * D, (size_t)(H * D) * sizeof(float));
                    memcpy(dq.f + (b * T + t) * H * D, (float *)tdq[x].data + (b * Tl + i) * H * D,
                           (size_t)(H * D) * sizeof(float));
                    memcpy(dk.f + (b * T + t) * KVH * D, (float *)tdk[x].data + (b * Tl + i) * KVH * D,
                           (size_t)(KVH * D) * sizeof(float));
                    memcpy(dv.f + (b * T + t) * KVH * D, (float *)tdv[x].data + (b * Tl + i) * KVH * D,
                           (size_t)(KVH * D) * sizeof(float));
                    for (int64_t h = 0; h < H; h++)
                        gl.f[(b * H + h) * T + t] = ld[(b * H + h) * Tl + i];
                }
        double rel = 4.0 * (double)(s.D + s.T) * U, grel = 4.0 * (double)(s.D + s.T * G) * U;
        char what[160];
        snprintf(what, sizeof what, "ring attention out T%lld H%lld KVH%lld D%lld W%lld cp%d%s", (long long)T,
                 (long long)H, (long long)KVH, (long long)D, (long long)s.W, cp, start ? " packed" : "");
        expect_close_norm(what, go.f, wo, nq, rel, 0);
        snprintf(what, sizeof what, "ring attention lse T%lld cp%d", (long long)T, cp);
        expect_close_norm(what, gl.f, wl, nl, rel, rel);
        snprintf(what, sizeof what, "ring attention dq T%lld H%lld KVH%lld cp%d", (long long)T, (long long)H,
                 (long long)KVH, cp);
        expect_close_norm(what, dq.f, gq, nq, grel, 0);
        snprintf(what, sizeof what, "ring attention dk T%lld H%lld KVH%lld cp%d", (long long)T, (long long)H,
                 (long long)KVH, cp);
        expect_close_norm(what, dk.f, gk, nk, grel, 0);
        snprintf(what, sizeof what, "ring attention dv T%lld H%lld KVH%lld cp%d", (long long)T, (long long)H,
                 (long long)KVH, cp);
        expect_close_norm(what, dv.f, gv, nk, grel, 0);
        /* one rank holding all of it: the block kernel over one block is attention_forward */
        if (cp == 1 && s.W == 0 && !start) {
            struct arr o1 = arr_new(nq), l1 = arr_new(nl);
            struct am_tensor a = tview(&o1, B, T, H, D), al = tview(&l1, B, H, T, 0);
            struct am_tensor fq = tview(&q, B, T, H, D), fk = tview(&k, B, T, KVH, D), fv = tview(&v, B, T, KVH, D);
            K->attention_forward(&kdev, &a, &al, &fq, &fk, &fv, 0);
            for (int64_t i = 0; i < nq; i++)
                o1.d[i] = o1.f[i];
            expect_close_norm("block attention == attention_forward (cp 1)", go.f, o1.d, nq, 4.0 * (double)(D + T) * U,
                              0);
            arr_free(&o1);
            arr_free(&l1);
        }
        arr_free(&go);
        arr_free(&gl);
        arr_free(&dq);
        arr_free(&dk);
        arr_free(&dv);
        K->free(&kdev, mem);
        K->free(&kdev, pos);
        K->free(&kdev, qst);
        free(start);
        arr_free(&q);
        arr_free(&k);
        arr_free(&v);
        arr_free(&dout);
        free(wo);
        free(wl);
        free(gq);
        free(gk);
        free(gv);
    }
}

static double silu(double x) { return x / (1.0 + exp(-x)); }

static double swiglu_loss(void *p)
{
    struct swiglu_ctx *c = p;
    double L = 0.0;
    for (int64_t i = 0; i < c->n; i++)
        L += silu(c->g[i]) * c->u[i] * c->R[i];
    return L;
}

static void test_swiglu(void **state)
{
    (void)state;
    struct rng r = {23};
    int64_t sizes[] = {7 * 13, 64 * 1408};
    for (size_t c = 0; c < sizeof sizes / sizeof *sizes; c++) {
        int64_t n = sizes[c];
        struct arr g = arr_rand(&r, n, -6, 6), u = arr_rand(&r, n, -2, 2), out = arr_new(n);
        g.f[0] = -100.0f; /* exp(-g) overflows in fp32: silu -> -0 */
        g.f[1] = 100.0f;
        g.d[0] = g.f[0];
        g.d[1] = g.f[1];
        struct am_tensor tg = tview(&g, n, 0, 0, 0), tu = tview(&u, n, 0, 0, 0), to = tview(&out, n, 0, 0, 0);
        K->swiglu_forward(&kdev, &to, &tg, &tu);
        double *want = dalloc(n), *tol = dalloc(n);
        /* exp (2 ulp), 1 + e, the division and the product: 6 roundings; 8u relative, and
         * 1e-37 absolute where silu(g) underflows (g = -100: exp(100) is +Inf, silu -0) */
        for (int64_t i = 0; i < n; i++) {
            want[i] = silu(g.d[i]) * u.d[i];
            tol[i] = 8 * U * fabs(want[i]) + 1e-37;
        }
        expect_close("swiglu forward", out.f, want, tol, n);

        struct arr dout = arr_rand(&r, n, -1, 1), dg = arr_rand(&r, n, -1, 1), du = arr_rand(&r, n, -1, 1);
        struct arr dg0 = arr_copy(&dg), du0 = arr_copy(&du);
        struct am_tensor tdo = tview(&dout, n, 0, 0, 0), tdg = tview(&dg, n, 0, 0, 0), tdu = tview(&du, n, 0, 0, 0);
        K->swiglu_backward(&kdev, &tdg, &tdu, &tdo, &tg, &tu);
        double *wg = dalloc(n), *wu = dalloc(n), *tg_ = dalloc(n), *tu_ = dalloc(n);
        for (int64_t i = 0; i < n; i++) {
            double sig = 1.0 / (1.0 + exp(-g.d[i])), ds = sig * (1.0 + g.d[i] * (1.0 - sig));
            wg[i] = dg0.d[i] + dout.d[i] * u.d[i] * ds;
            wu[i] = du0.d[i] + dout.d[i] * silu(g.d[i]);
            /* 1 - sig cancels where sig -> 1: its absolute error (~6u) is multiplied by g;
             * the accumulation rounds once more, up to u of the result, the product's own
             * rounding another u */
            tg_[i] = U * (fabs(dout.d[i] * u.d[i]) * (10 * fabs(ds) + 8 * fabs(g.d[i]) * sig) + 2 * fabs(wg[i]));
            tu_[i] = U * (8 * fabs(dout.d[i] * silu(g.d[i])) + 2 * fabs(wu[i])) + 1e-37;
        }
        expect_close("swiglu backward dgate", dg.f, wg, tg_, n);
        expect_close("swiglu backward dup", du.f, wu, tu_, n);
        if (n <= 200) {
            struct swiglu_ctx ctx = {g.d, u.d, dout.d, n};
            double *fd = dalloc(n);
            fd_grad(swiglu_loss, &ctx, g.d, n, fd);
            expect_fd("swiglu dgate vs finite differences", dg.f, dg0.d, fd, tg_, n);
            fd_grad(swiglu_loss, &ctx, u.d, n, fd);
            expect_fd("swiglu dup vs finite differences", du.f, du0.d, fd, tu_, n);
            free(fd);
        }
        /* one of the two gradients may be NULL */
        K->swiglu_backward(&kdev, NULL, &tdu, &tdo, &tg, &tu);
        for (int64_t i = 0; i < n; i++) {
            wu[i] += wu[i] - du0.d[i];
            tu_[i] *= 2;
        }
        expect_close("swiglu backward dup only", du.f, wu, tu_, n);
        double *bufs[] = {want, tol, wg, wu, tg_, tu_};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
            free(bufs[i]);
        struct arr *all[] = {&g, &u, &out, &dout, &dg, &du, &dg0, &du0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* ---- mixture of experts: routing, aux loss, permutation, combination, grouped GEMMs ---- */

/* The router in double from the logits, with the experts chosen fixed (idx): probs, the top-k
 * weights (renormalised or not) and the loss L = Σ wts ⊙ R + aux Σ_e cnt_e Σ_i p_ie whose
 * gradient moe_route_backward computes (dwts = R). */
struct route_ctx {
    double *logits, *R, *cnt, *p, *w;
    const int32_t *idx;
    int64_t N, E, k;
    double aux;
    bool renorm;
};

static void ref_route(struct route_ctx *c)
{
    for (int64_t i = 0; i < c->N; i++) {
        double mx = -INFINITY, s = 0.0, ts = 0.0;
        for (int64_t e = 0; e < c->E; e++)
            mx = fmax(mx, c->logits[i * c->E + e]);
        for (int64_t e = 0; e < c->E; e++)
            s += exp(c->logits[i * c->E + e] - mx);
        for (int64_t e = 0; e < c->E; e++)
            c->p[i * c->E + e] = exp(c->logits[i * c->E + e] - mx) / s;
        for (int64_t j = 0; j < c->k; j++)
            ts += c->p[i * c->E + c->idx[i * c->k + j]];
        for (int64_t j = 0; j < c->k; j++)
            c->w[i * c->k + j] = c->p[i * c->E + c->idx[i * c->k + j]] / (c->renorm ? ts : 1.0);
    }
}

static double route_loss(void *p)
{
    struct route_ctx *c = p;
    ref_route(c);
    double L = 0.0;
    for (int64_t i = 0; i < c->N * c->k; i++)
        L += c->w[i] * c->R[i];
    for (int64_t i = 0; i < c->N; i++)
        for (int64_t e = 0; e < c->E; e++)
            L += c->aux * c->cnt[e] * c->p[i * c->E + e];
    return L;
}

static void test_moe_route(void **state)
{
    (void)state;
    struct rng r = {61};
    struct {
        int64_t N, E, k;
        bool renorm;
    } cases[] = {{37, 6, 2, true}, {23, 8, 3, false}, {5, 4, 1, true}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t N = cases[c].N, E = cases[c].E, k = cases[c].k;
        bool renorm = cases[c].renorm;
        struct arr lg = arr_rand(&r, N * E, -3, 3), p = arr_new(N * E), w = arr_new(N * k), cnt = arr_new(E);
        struct arr ps = arr_new(E);
        for (int64_t e = 0; e < E; e++) /* row 0: a tie between experts 1 and 3, the lower first */
            lg.f[e] = lg.d[e] = e == 1 || e == 3 ? 2.5 : -1.0;
        int32_t *idx = calloc((size_t)(N * k), sizeof(int32_t));
        struct am_tensor tl = tview(&lg, N, E, 0, 0), tp = tview(&p, N, E, 0, 0), tw = tview(&w, N, k, 0, 0);
        struct am_tensor ti = am_tensor_view(idx, AM_DEV_CPU, AM_I32, N, k, 0, 0);
        K->moe_route_forward(&kdev, &tp, &ti, &tw, &tl, renorm);
        /* the choice: descending probabilities, ties to the lower expert */
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < k; j++) {
                int32_t e = idx[i * k + j];
                assert_true(e >= 0 && e < E);
                for (int64_t f = 0; f < E; f++) {
                    bool chosen = false;
                    for (int64_t q = 0; q <= j; q++)
                        chosen |= idx[i * k + q] == f;
                    if (!chosen)
                        assert_true(lg.d[i * E + f] < lg.d[i * E + e] || (lg.d[i * E + f] == lg.d[i * E + e] && f > e));
                }
            }
        if (k >= 2)
            assert_true(idx[0] == 1 && idx[1] == 3);
        struct route_ctx ctx = {lg.d, NULL, NULL, dalloc(N * E), dalloc(N * k), idx, N, E, k, 0.0, renorm};
        ref_route(&ctx);
        /* exp, the sum of E terms and the division: (E + 4) u relative; the renormalisation
         * adds k + 2 roundings */
        double *tol = dalloc(N * E);
        for (int64_t i = 0; i < N * E; i++)
            tol[i] = (double)(E + 4) * U * ctx.p[i];
        expect_close("moe route probs", p.f, ctx.p, tol, N * E);
        for (int64_t i = 0; i < N * k; i++)
            tol[i] = (double)(E + k + 6) * U * ctx.w[i];
        expect_close("moe route weights", w.f, ctx.w, tol, N * k);

        /* backward: dwts = R, the aux loss's gradient aux * cnt, onto a random start */
        struct arr R = arr_rand(&r, N * k, -1, 1), dl = arr_rand(&r, N * E, -1, 1), dl0 = arr_copy(&dl);
        for (int64_t e = 0; e < E; e++)
            cnt.f[e] = (float)(cnt.d[e] = (double)((e * 7) % 5));
        float aux = 0.37f;
        struct am_tensor tR = tview(&R, N, k, 0, 0), tdl = tview(&dl, N, E, 0, 0), tc = tview(&cnt, E, 0, 0, 0);
        K->moe_route_backward(&kdev, &tdl, &tR, &tp, &ti, &tc, aux, renorm);
        ctx.R = R.d;
        ctx.cnt = cnt.d;
        ctx.aux = aux;
        double *fd = dalloc(N * E), *tl_ = dalloc(N * E);
        fd_grad(route_loss, &ctx, lg.d, N * E, fd);
        /* the gradient of a softmax row: sums of E and k terms of size max|dp| */
        for (int64_t i = 0; i < N * E; i++)
            tl_[i] = (double)(4 * E + 4 * k + 8) * U * (1.0 + fabs(dl0.d[i]) + aux * 5);
        expect_fd("moe route backward vs finite differences", dl.f, dl0.d, fd, tl_, N * E);

        /* the aux loss's statistics and value */
        struct am_tensor tcn = tview(&cnt, E, 0, 0, 0), tps = tview(&ps, E, 0, 0, 0);
        memset(cnt.f, 0, (size_t)E * sizeof(float));
        K->moe_aux_stats(&kdev, &tcn, &tps, &tp, &ti);
        K->moe_aux_stats(&kdev, &tcn, &tps, &tp, &ti); /* accumulates: twice the counts */
        double want_loss = 0.0, *wp = dalloc(E);
        for (int64_t e = 0; e < E; e++) {
            int64_t n = 0;
            for (int64_t i = 0; i < N * k; i++)
                n += idx[i] == e;
            assert_true(cnt.f[e] == (float)(2 * n));
            for (int64_t i = 0; i < N; i++)
                wp[e] += 2 * ctx.p[i * E + e];
            tol[e] = (double)(2 * N + E + 4) * U * wp[e];
            want_loss += 2.0 * (double)n * wp[e];
        }
        expect_close("moe aux psum", ps.f, wp, tol, E);
        double acc = 1.5;
        struct am_tensor ta = am_tensor_view(&acc, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
        K->moe_aux_loss(&kdev, &ta, &tcn, &tps, 0.25);
        assert_true(fabs(acc - (1.5 + 0.25 * want_loss)) <= 1e-5 * (1.0 + want_loss));
        free(wp);
        free(fd);
        free(tl_);
        free(tol);
        free(ctx.p);
        free(ctx.w);
        free(idx);
        struct arr *all[] = {&lg, &p, &w, &cnt, &ps, &R, &dl, &dl0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* plan, permute, the experts' SwiGLU as three grouped GEMMs, combine: against a reference that
 * runs each token through its k experts directly, forward and backward */
static void test_moe_dispatch(void **state)
{
    (void)state;
    struct rng r = {67};
    int64_t N = 29, E = 5, k = 2, C = 12, I = 9, S = N * k;
    int32_t *idx = calloc((size_t)S, sizeof(int32_t)), *pos = calloc((size_t)S, sizeof(int32_t));
    int32_t counts[5];
    for (int64_t i = 0; i < N; i++) { /* two distinct experts per token; expert 4 never chosen */
        idx[i * k] = (int32_t)(rng_uniform(&r, 0, 4)) % 4;
        idx[i * k + 1] = (idx[i * k] + 1 + (int32_t)rng_uniform(&r, 0, 3)) % 4;
    }
    struct am_tensor ti = am_tensor_view(idx, AM_DEV_CPU, AM_I32, N, k, 0, 0);
    struct am_tensor tpos = am_tensor_view(pos, AM_DEV_CPU, AM_I32, N, k, 0, 0);
    struct am_tensor tcnt = am_tensor_view(counts, AM_DEV_CPU, AM_I32, E, 0, 0, 0);
    K->moe_plan(&kdev, &tpos, &tcnt, &ti);
    /* stable: expert by expert, the slots in order within each */
    int64_t next = 0, hc[5];
    for (int64_t e = 0; e < E; e++) {
        hc[e] = 0;
        for (int64_t s = 0; s < S; s++)
            if (idx[s] == e) {
                assert_int_equal(pos[s], next++);
                hc[e]++;
            }
        assert_int_equal(counts[e], hc[e]);
    }
    assert_int_equal(counts[4], 0);

    struct arr x = arr_rand(&r, N * C, -1, 1), w1 = arr_rand(&r, E * I * C, -0.5, 0.5), w3 = arr_rand(&r, E * I * C, -0.5, 0.5);
    struct arr w2 = arr_rand(&r, E * C * I, -0.5, 0.5), wts = arr_rand(&r, S, 0.1, 1);
    struct arr xp = arr_new(S * C), g = arr_new(S * I), u = arr_new(S * I), a = arr_new(S * I), yp = arr_new(S * C);
    struct arr y = arr_new(N * C);
    struct am_tensor tx = tview(&x, N, C, 0, 0), txp = tview(&xp, S, C, 0, 0), tg = tview(&g, S, I, 0, 0);
    struct am_tensor tu = tview(&u, S, I, 0, 0), ta = tview(&a, S, I, 0, 0), typ = tview(&yp, S, C, 0, 0);
    struct am_tensor ty = tview(&y, N, C, 0, 0), twt = tview(&wts, N, k, 0, 0);
    struct am_tensor tw1 = tview(&w1, E, I, C, 0), tw3 = tview(&w3, E, I, C, 0), tw2 = tview(&w2, E, C, I, 0);
    K->moe_permute_forward(&kdev, &txp, &tx, &tpos);
    for (int64_t s = 0; s < S; s++)
        assert_memory_equal(xp.f + pos[s] * C, x.f + (s / k) * C, (size_t)C * sizeof(float));
    K->grouped_matmul_forward(&kdev, &tg, &txp, &tw1, hc);
    K->grouped_matmul_forward(&kdev, &tu, &txp, &tw3, hc);
    K->swiglu_forward(&kdev, &ta, &tg, &tu);
    K->grouped_matmul_forward(&kdev, &typ, &ta, &tw2, hc);
    K->moe_combine_forward(&kdev, &ty, &typ, &tpos, &twt);
    /* reference: y_i = Σ_j w_ij down_e(silu(gate_e x_i) up_e x_i), e = idx[i, j] */
    double *want = dalloc(N * C), *tol = dalloc(N * C), *hg = dalloc(I), *hu = dalloc(I);
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < k; j++) {
            int64_t e = idx[i * k + j];
            for (int64_t o = 0; o < I; o++) {
                hg[o] = hu[o] = 0;
                for (int64_t c = 0; c < C; c++) {
                    hg[o] += w1.d[(e * I + o) * C + c] * x.d[i * C + c];
                    hu[o] += w3.d[(e * I + o) * C + c] * x.d[i * C + c];
                }
            }
            for (int64_t c = 0; c < C; c++) {
                double s = 0;
                for (int64_t o = 0; o < I; o++)
                    s += w2.d[(e * C + c) * I + o] * silu(hg[o]) * hu[o];
                want[i * C + c] += wts.d[i * k + j] * s;
            }
        }
    /* three products of C or I terms over values of size ~1: a normwise bound */
    expect_close_norm("moe experts forward (plan, permute, grouped SwiGLU, combine)", y.f, want, N * C,
                      (double)(4 * (C + I) + 16) * U, 0);

    /* backward, chained as the model does, against finite differences of L = Σ y ⊙ R through
     * the double reference (x, the three weights and the routing weights) */
    struct arr R = arr_rand(&r, N * C, -1, 1), dyp = arr_new(S * C), dwt = arr_new(S), da = arr_new(S * I);
    struct arr dg = arr_new(S * I), du = arr_new(S * I), dxp = arr_new(S * C), dx = arr_new(N * C);
    struct arr dw1 = arr_new(E * I * C), dw3 = arr_new(E * I * C), dw2 = arr_new(E * C * I);
    struct am_tensor tR = tview(&R, N, C, 0, 0), tdyp = tview(&dyp, S, C, 0, 0), tdwt = tview(&dwt, N, k, 0, 0);
    struct am_tensor tda = tview(&da, S, I, 0, 0), tdg = tview(&dg, S, I, 0, 0), tdu = tview(&du, S, I, 0, 0);
    struct am_tensor tdxp = tview(&dxp, S, C, 0, 0), tdx = tview(&dx, N, C, 0, 0);
    struct am_tensor tdw1 = tview(&dw1, E, I, C, 0), tdw3 = tview(&dw3, E, I, C, 0), tdw2 = tview(&dw2, E, C, I, 0);
    K->moe_combine_backward(&kdev, &tdyp, &tdwt, &tR, &typ, &tpos, &twt);
    K->grouped_matmul_backward(&kdev, &tda, &tdw2, &tdyp, &ta, &tw2, hc);
    K->swiglu_backward(&kdev, &tdg, &tdu, &tda, &tg, &tu);
    K->grouped_matmul_backward(&kdev, &tdxp, &tdw1, &tdg, &txp, &tw1, hc);
    K->grouped_matmul_backward(&kdev, &tdxp, &tdw3, &tdu, &txp, &tw3, hc);
    K->moe_permute_backward(&kdev, &tdx, &tdxp, &tpos);
    double *fd = dalloc(E * I * C);
    struct {
        const char *what;
        struct arr *p, *got;
        int64_t n;
    } grads[] = {{"moe dx vs finite differences", &x, &dx, N * C},
                 {"moe dw1 (gate) vs finite differences", &w1, &dw1, E * I * C},
                 {"moe dw3 (up) vs finite differences", &w3, &dw3, E * I * C},
                 {"moe dw2 (down) vs finite differences", &w2, &dw2, E * C * I},
                 {"moe dwts vs finite differences", &wts, &dwt, S}};
    for (size_t q = 0; q < sizeof grads / sizeof *grads; q++) {
        struct arr *pp = grads[q].p;
        int64_t n = grads[q].n;
        for (int64_t i = 0; i < n; i++) {
            double s0 = pp->d[i], h = 1e-6;
            double Lv[2];
            for (int side = 0; side < 2; side++) {
                pp->d[i] = s0 + (side ? -h : h);
                double L = 0;
                for (int64_t t = 0; t < N; t++)
                    for (int64_t j = 0; j < k; j++) {
                        int64_t e = idx[t * k + j];
                        for (int64_t o = 0; o < I; o++) {
                            hg[o] = hu[o] = 0;
                            for (int64_t c = 0; c < C; c++) {
                                hg[o] += w1.d[(e * I + o) * C + c] * x.d[t * C + c];
                                hu[o] += w3.d[(e * I + o) * C + c] * x.d[t * C + c];
                            }
                        }
                        for (int64_t c = 0; c < C; c++) {
                            double s = 0;
                            for (int64_t o = 0; o < I; o++)
                                s += w2.d[(e * C + c) * I + o] * silu(hg[o]) * hu[o];
                            L += R.d[t * C + c] * wts.d[t * k + j] * s;
                        }
                    }
                Lv[side] = L;
            }
            pp->d[i] = s0;
            fd[i] = (Lv[0] - Lv[1]) / (2 * h);
        }
        double *tl = dalloc(n), m = max_abs(fd, n);
        for (int64_t i = 0; i < n; i++)
            tl[i] = (double)(8 * (C + I) + 32) * U * (1.0 + m);
        expect_fd(grads[q].what, grads[q].got->f, NULL, fd, tl, n);
        free(tl);
    }
    free(fd);
    free(want);
    free(tol);
    free(hg);
    free(hu);
    free(idx);
    free(pos);
    struct arr *all[] = {&x, &w1, &w3, &w2, &wts, &xp, &g, &u, &a, &yp, &y, &R, &dyp, &dwt, &da, &dg, &du, &dxp, &dx, &dw1, &dw3, &dw2};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        arr_free(all[i]);
}

/* ---- cross-entropy fused with the output projection ---- */

struct ce_case {
    int64_t N, C, V;
};

/* logits z = x · wᵀ and Σ|x w| per logit */
static void ref_logits(const double *x, const double *w, int64_t N, int64_t C, int64_t V, double *z, double *za)
{
    ref_matmul(x, w, N, C, V, z, za);
}

struct ce_ctx {
    double *x, *w, *z;
    const int32_t *tg;
    int64_t N, C, V;
    double scale;
};

/* L = scale Σ_{targets >= 0} (logsumexp(z_i) - z_i,target) */
static double ce_loss(void *p)
{
    struct ce_ctx *c = p;
    ref_logits(c->x, c->w, c->N, c->C, c->V, c->z, NULL);
    double L = 0.0;
    for (int64_t i = 0; i < c->N; i++) {
        if (c->tg[i] < 0)
            continue;
        double m = -INFINITY, s = 0.0;
        for (int64_t v = 0; v < c->V; v++)
            m = fmax(m, c->z[i * c->V + v]);
        for (int64_t v = 0; v < c->V; v++)
            s += exp(c->z[i * c->V + v] - m);
        L += c->scale * (log(s) + m - c->z[i * c->V + c->tg[i]]);
    }
    return L;
}

static void test_cross_entropy(void **state)
{
    (void)state;
    struct rng r = {29};
    /* the last case has more rows than a chunk (256) and more vocabulary than a tile of
     * logits (8 MiB: 8192 entries for 256 rows), so chunks and tiles are both crossed */
    struct ce_case cases[] = {{7, 13, 37}, {130, 32, 300}, {300, 64, 1000}, {600, 8, 9000}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t N = cases[c].N, C = cases[c].C, V = cases[c].V, V0 = V / 2 + 1;
        int32_t *tg = malloc((size_t)N * sizeof(int32_t));
        int64_t nvalid = 0;
        for (int64_t i = 0; i < N; i++)
            tg[i] = (int32_t)(rng_uniform(&r, 0, 1) * (double)V) % (int32_t)V;
        tg[1] = -100; /* ignored (Hugging Face's ignore_index) */
        tg[N - 1] = -1;
        for (int64_t i = 0; i < N; i++)
            nvalid += tg[i] >= 0;
        struct arr x = arr_rand(&r, N * C, -1, 1), w = arr_rand(&r, V * C, -1, 1);
        struct arr m = arr_new(N), s = arr_new(N), t = arr_new(N);
        struct am_tensor tx = tview(&x, N, C, 0, 0), tw = tview(&w, V, C, 0, 0), ttg = ids_view(tg, N);
        struct am_tensor tm = tview(&m, N, 0, 0, 0), ts = tview(&s, N, 0, 0, 0), tt = tview(&t, N, 0, 0, 0);
        K->ce_stats(&kdev, &tm, &ts, &tt, &tx, &tw, &ttg, 0);
        double *z = dalloc(N * V), *za = dalloc(N * V);
        ref_logits(x.d, w.d, N, C, V, z, za);
        double *wm = dalloc(N), *wsum = dalloc(N), *wt = dalloc(N), *tm_ = dalloc(N), *ts_ = dalloc(N),
               *tt_ = dalloc(N), *eps_row = dalloc(N), *wloss = dalloc(N);
        for (int64_t i = 0; i < N; i++) {
            double mx = -INFINITY, amax = 0.0, sum = 0.0;
            for (int64_t v = 0; v < V; v++) {
                mx = fmax(mx, z[i * V + v]);
                amax = fmax(amax, za[i * V + v]);
            }
            for (int64_t v = 0; v < V; v++)
                sum += exp(z[i * V + v] - mx);
            /* a logit errs by <= (C + 2) u Σ|x w| (sgemm): the max by as much; each term of
             * the sum by twice that (logit and max) plus exp's 2 ulp; the V-term sum adds
             * V u. eps_row is that relative error of a softmax term. */
            double dz = (double)(C + 2) * U * amax;
            eps_row[i] = 2 * dz + (double)(V + 4) * U;
            wm[i] = mx;
            tm_[i] = dz;
            wsum[i] = sum;
            ts_[i] = eps_row[i] * sum;
            wt[i] = tg[i] >= 0 ? z[i * V + tg[i]] : 0.0;
            tt_[i] = tg[i] >= 0 ? (double)(C + 2) * U * za[i * V + tg[i]] : 0.0;
            wloss[i] = log(sum) + mx - wt[i];
        }
        expect_close("ce_stats m", m.f, wm, tm_, N);
        expect_close("ce_stats s", s.f, wsum, ts_, N);
        expect_close("ce_stats t", t.f, wt, tt_, N);

        /* two vocabulary shards [0, V0) and [V0, V), combined as kernels.h says, give the
         * unsharded loss: M = max m, S = Σ s e^(m - M), T = Σ t, loss = log S + M - T */
        struct arr m1 = arr_new(N), s1 = arr_new(N), t1 = arr_new(N), m2 = arr_new(N), s2 = arr_new(N),
                   t2 = arr_new(N);
        struct am_tensor tm1 = tview(&m1, N, 0, 0, 0), ts1 = tview(&s1, N, 0, 0, 0), tt1 = tview(&t1, N, 0, 0, 0);
        struct am_tensor tm2 = tview(&m2, N, 0, 0, 0), ts2 = tview(&s2, N, 0, 0, 0), tt2 = tview(&t2, N, 0, 0, 0);
        struct am_tensor w1 = am_tensor_view(w.f, AM_DEV_CPU, AM_F32, V0, C, 0, 0);
        struct am_tensor w2 = am_tensor_view(w.f + V0 * C, AM_DEV_CPU, AM_F32, V - V0, C, 0, 0);
        K->ce_stats(&kdev, &tm1, &ts1, &tt1, &tx, &w1, &ttg, 0);
        K->ce_stats(&kdev, &tm2, &ts2, &tt2, &tx, &w2, &ttg, V0);
        struct arr Mc = arr_new(N), Sc = arr_new(N), lsh = arr_new(N), lun = arr_new(N);
        double *tl = dalloc(N);
        for (int64_t i = 0; i < N; i++) {
            float Mx = m1.f[i] > m2.f[i] ? m1.f[i] : m2.f[i];
            float Sx = s1.f[i] * expf(m1.f[i] - Mx) + s2.f[i] * expf(m2.f[i] - Mx);
            Mc.f[i] = Mx;
            Sc.f[i] = Sx;
            lsh.f[i] = logf(Sx) + Mx - (t1.f[i] + t2.f[i]);
            lun.f[i] = logf(s.f[i]) + m.f[i] - t.f[i];
            /* log S errs by eps_row, M and T by their logit errors, plus 4 roundings of
             * quantities up to |M| + |T| + |log S| */
            tl[i] = eps_row[i] + tm_[i] + tt_[i] + 4 * U * (fabs(wm[i]) + fabs(wt[i]) + fabs(log(wsum[i])));
            if (tg[i] < 0)
                tl[i] = INFINITY; /* no loss for ignored tokens */
        }
        expect_close("ce loss, unsharded", lun.f, wloss, tl, N);
        expect_close("ce loss, 2 vocabulary shards combined", lsh.f, wloss, tl, N);
        /* the same combination by the kernels, as the model runs it (the max and the sums are
         * the tp group's all-reduces, here by hand): ce_rescale each shard's s, sum them, and
         * ce_loss adds the loss of every token with a target to the scalar, bit for bit */
        {
            struct arr T = arr_new(N);
            for (int64_t i = 0; i < N; i++)
                T.f[i] = t1.f[i] + t2.f[i];
            struct am_tensor tMc = tview(&Mc, N, 0, 0, 0), tT = tview(&T, N, 0, 0, 0);
            K->ce_rescale(&kdev, &ts1, &tm1, &tMc);
            K->ce_rescale(&kdev, &ts2, &tm2, &tMc);
            K->add(&kdev, &ts1, &ts2);
            assert_memory_equal(s1.f, Sc.f, (size_t)N * sizeof(float));
            double acc = 0.25, want = 0.0;
            struct am_tensor ta = am_tensor_view(&acc, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
            K->ce_loss(&kdev, &ta, &tMc, &ts1, &tT, &ttg);
            for (int64_t i = 0; i < N; i++)
                if (tg[i] >= 0)
                    want += (double)logf(Sc.f[i]) + (double)Mc.f[i] - (double)T.f[i];
            assert_true(acc == 0.25 + want);
            arr_free(&T);
        }

        /* backward: dlogits = (softmax - onehot) * scale, dx += dlogits · w, dw += dlogitsᵀ · x */
        float scale = 1.0f / (float)nvalid;
        struct arr dx = arr_rand(&r, N * C, -1, 1), dw = arr_rand(&r, V * C, -1, 1);
        struct arr dx0 = arr_copy(&dx), dw0 = arr_copy(&dw);
        struct am_tensor tdx = tview(&dx, N, C, 0, 0), tdw = tview(&dw, V, C, 0, 0);
        struct am_tensor tM = tview(&m, N, 0, 0, 0), tS = tview(&s, N, 0, 0, 0);
        K->ce_backward(&kdev, &tdx, &tdw, &tx, &tw, &ttg, 0, &tM, &tS, scale);
        double *g = dalloc(N * V), *pa = dalloc(N * V);
        for (int64_t i = 0; i < N; i++)
            for (int64_t v = 0; v < V; v++) {
                double p = tg[i] >= 0 ? exp(z[i * V + v] - wm[i]) / wsum[i] : 0.0;
                g[i * V + v] = (p - (v == tg[i])) * scale;
                pa[i * V + v] = p * scale * (eps_row[i] + tm_[i] + ts_[i] / wsum[i]); /* |δ dlogit| */
            }
        double *wdx = dalloc(N * C), *tdxl = dalloc(N * C), *wdw = dalloc(V * C), *tdwl = dalloc(V * C);
        /* each gradient: its dlogits' errors carried through, plus the sgemm's (terms + 3) u
         * Σ|terms|, plus one rounding of the running value per piece the kernel adds in
         * (chunks of rows for dw, tiles of vocabulary for dx; at least 64 rows or 256
         * entries each, so at most N/64 + 2 and V/256 + 2 pieces) */
        for (int64_t i = 0; i < N; i++)
            for (int64_t k = 0; k < C; k++) {
                double acc = dx0.d[i * C + k], a = 0.0, e = 0.0;
                for (int64_t v = 0; v < V; v++) {
                    acc += g[i * V + v] * w.d[v * C + k];
                    a += fabs(g[i * V + v] * w.d[v * C + k]);
                    e += pa[i * V + v] * fabs(w.d[v * C + k]);
                }
                wdx[i * C + k] = acc;
                tdxl[i * C + k] = e + (double)(V + 3) * U * a + (double)(V / 256 + 2) * U * (fabs(acc) + fabs(dx0.d[i * C + k]));
            }
        for (int64_t v = 0; v < V; v++)
            for (int64_t k = 0; k < C; k++) {
                double acc = dw0.d[v * C + k], a = 0.0, e = 0.0;
                for (int64_t i = 0; i < N; i++) {
                    acc += g[i * V + v] * x.d[i * C + k];
                    a += fabs(g[i * V + v] * x.d[i * C + k]);
                    e += pa[i * V + v] * fabs(x.d[i * C + k]);
                }
                wdw[v * C + k] = acc;
                tdwl[v * C + k] = e + (double)(N + 3) * U * a + (double)(N / 64 + 2) * U * (fabs(acc) + fabs(dw0.d[v * C + k]));
            }
        expect_close("ce_backward dx", dx.f, wdx, tdxl, N * C);
        expect_close("ce_backward dw", dw.f, wdw, tdwl, V * C);
        if (N * C * V <= 5000) {
            struct ce_ctx ctx = {x.d, w.d, dalloc(N * V), tg, N, C, V, scale};
            double *fd = dalloc(V * C);
            fd_grad(ce_loss, &ctx, x.d, N * C, fd);
            expect_fd("ce dx vs finite differences", dx.f, dx0.d, fd, tdxl, N * C);
            fd_grad(ce_loss, &ctx, w.d, V * C, fd);
            expect_fd("ce dw vs finite differences", dw.f, dw0.d, fd, tdwl, V * C);
            free(fd);
            free(ctx.z);
        }
        /* ce_fused: the statistics and both gradients in one pass, within the same bounds;
         * a vocabulary larger than one tile of a 256-row chunk is refused untouched */
        {
            struct arr fm = arr_new(N), fs = arr_new(N), ft = arr_new(N), fdx = arr_copy(&dx0), fdw = arr_copy(&dw0);
            struct am_tensor tfm = tview(&fm, N, 0, 0, 0), tfs = tview(&fs, N, 0, 0, 0), tft = tview(&ft, N, 0, 0, 0);
            struct am_tensor tfdx = tview(&fdx, N, C, 0, 0), tfdw = tview(&fdw, V, C, 0, 0);
            bool done = K->ce_fused(&kdev, &tfm, &tfs, &tft, &tfdx, &tfdw, &tx, &tw, &ttg, scale);
            assert_int_equal(done, (N < 256 ? N : 256) * V <= (1L << 21));
            if (done) {
                expect_close("ce_fused m", fm.f, wm, tm_, N);
                expect_close("ce_fused s", fs.f, wsum, ts_, N);
                expect_close("ce_fused t", ft.f, wt, tt_, N);
                expect_close("ce_fused dx", fdx.f, wdx, tdxl, N * C);
                expect_close("ce_fused dw", fdw.f, wdw, tdwl, V * C);
            } else {
                assert_memory_equal(fdx.f, dx0.f, (size_t)(N * C) * sizeof(float));
                assert_memory_equal(fdw.f, dw0.f, (size_t)(V * C) * sizeof(float));
            }
            struct arr *fa[] = {&fm, &fs, &ft, &fdx, &fdw};
            for (size_t i = 0; i < sizeof fa / sizeof *fa; i++)
                arr_free(fa[i]);
        }
        /* sharded backward with the combined M and S: dx summed over the shards, dw
         * concatenated, equal the unsharded gradients (within both tolerances) */
        struct arr dxa = arr_copy(&dx0), dxb = arr_new(N * C), dws = arr_copy(&dw0);
        struct am_tensor tdxa = tview(&dxa, N, C, 0, 0), tdxb = tview(&dxb, N, C, 0, 0);
        struct am_tensor dws1 = am_tensor_view(dws.f, AM_DEV_CPU, AM_F32, V0, C, 0, 0);
        struct am_tensor dws2 = am_tensor_view(dws.f + V0 * C, AM_DEV_CPU, AM_F32, V - V0, C, 0, 0);
        struct am_tensor tMc = tview(&Mc, N, 0, 0, 0), tSc = tview(&Sc, N, 0, 0, 0);
        K->ce_backward(&kdev, &tdxa, &dws1, &tx, &w1, &ttg, 0, &tMc, &tSc, scale);
        K->ce_backward(&kdev, &tdxb, &dws2, &tx, &w2, &ttg, V0, &tMc, &tSc, scale);
        for (int64_t i = 0; i < N * C; i++) {
            dxa.f[i] += dxb.f[i];
            tdxl[i] *= 2;
        }
        for (int64_t i = 0; i < V * C; i++)
            tdwl[i] *= 2;
        expect_close("ce_backward dx, 2 shards summed", dxa.f, wdx, tdxl, N * C);
        expect_close("ce_backward dw, 2 shards", dws.f, wdw, tdwl, V * C);
        /* an ignored token contributes nothing: its dx row is untouched */
        for (int64_t k = 0; k < C; k++)
            assert_true(dx.f[1 * C + k] == dx0.f[1 * C + k]);
        free(tg);
        double *bufs[] = {z, za, wm, wsum, wt, tm_, ts_, tt_, eps_row, wloss, tl, g, pa, wdx, tdxl, wdw, tdwl};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
            free(bufs[i]);
        struct arr *all[] = {&x, &w, &m, &s, &t, &m1, &s1, &t1, &m2, &s2, &t2, &Mc, &Sc, &lsh, &lun,
                             &dx, &dw, &dx0, &dw0, &dxa, &dxb, &dws};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* ---- AdamW ---- */

struct adam_hp {
    float lr, b1, b2, eps, wd;
};

/* torch's _single_tensor_adamw for one element, op by op in fp32 (Python scalars in double,
 * rounded to fp32 where they meet a tensor), written from the Python source; lerp_ and
 * addcmul_ round once, as torch's vectorised CPU kernels (a fused multiply-add) do. */
static void torch_adamw_elem(float *p, float g, float *m, float *v, struct adam_hp h, int64_t step)
{
    double lr = h.lr, b1 = h.b1, b2 = h.b2;
    *p = *p * (float)(1.0 - lr * (double)h.wd);                    /* param.mul_(1 - lr * wd) */
    float w = (float)(1.0 - b1);                                    /* exp_avg.lerp_(grad, 1 - beta1) */
    *m = w < 0.5f ? fmaf(w, g - *m, *m) : fmaf(w - 1.0f, g - *m, g);
    *v = *v * h.b2;                                                 /* exp_avg_sq.mul_(beta2) */
    *v = fmaf((float)(1.0 - b2) * g, g, *v);                        /* .addcmul_(g, g, 1 - beta2) */
    double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    float denom = sqrtf(*v) / (float)sqrt(bc2) + h.eps;            /* (v.sqrt() / sqrt(bc2)).add_(eps) */
    *p = *p + ((float)-(lr / bc1) * *m) / denom;                    /* addcdiv_(m, denom, -lr / bc1) */
}

static void test_adamw(void **state)
{
    (void)state;
    struct rng r = {31};
    struct adam_hp hps[] = {
        {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f},
        {3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f},
        {1e-2f, 0.3f, 0.99f, 1e-6f, 0.0f}, /* Adam; beta1 < 0.5 takes torch's other lerp branch */
    };
    int64_t sizes[] = {1000, 100003};
    for (size_t hc = 0; hc < sizeof hps / sizeof *hps; hc++)
        for (size_t c = 0; c < sizeof sizes / sizeof *sizes; c++) {
            struct adam_hp h = hps[hc];
            int64_t n = sizes[c];
            struct arr p = arr_rand(&r, n, -1, 1), m = arr_new(n), v = arr_new(n);
            float *rp = malloc((size_t)n * sizeof(float)), *rm = calloc((size_t)n, sizeof(float)),
                  *rv = calloc((size_t)n, sizeof(float));
            double *dp = dalloc(n), *dm = dalloc(n), *dv = dalloc(n), *maxstep = dalloc(n);
            memcpy(rp, p.f, (size_t)n * sizeof(float));
            for (int64_t i = 0; i < n; i++)
                dp[i] = p.d[i];
            struct am_tensor tp = tview(&p, n, 0, 0, 0), tm = tview(&m, n, 0, 0, 0), tv = tview(&v, n, 0, 0, 0);
            for (int64_t step = 1; step <= 3; step++) {
                struct arr g = arr_rand(&r, n, -1, 1);
                if (step == 2)
                    for (int64_t i = 0; i < n; i += 7) { /* small gradients too, where eps matters */
                        g.f[i] *= 1e-6f;
                        g.d[i] = g.f[i];
                    }
                struct am_tensor tg = tview(&g, n, 0, 0, 0);
                K->adamw(&kdev, &tp, &tg, &tm, &tv, h.lr, h.b1, h.b2, h.eps, h.wd, step);
                for (int64_t i = 0; i < n; i++) {
                    torch_adamw_elem(&rp[i], g.f[i], &rm[i], &rv[i], h, step);
                    /* the textbook AdamW in double */
                    double b1 = h.b1, b2 = h.b2;
                    dp[i] -= (double)h.lr * (double)h.wd * dp[i];
                    dm[i] = b1 * dm[i] + (1 - b1) * g.d[i];
                    dv[i] = b2 * dv[i] + (1 - b2) * g.d[i] * g.d[i];
                    double mhat = dm[i] / (1 - pow(b1, (double)step)), vhat = dv[i] / (1 - pow(b2, (double)step));
                    double upd = (double)h.lr * mhat / (sqrt(vhat) + (double)h.eps);
                    dp[i] -= upd;
                    maxstep[i] = fmax(maxstep[i], fabs(upd));
                }
                arr_free(&g);
            }
            /* (1) the fp32 op-by-op reimplementation: the kernel performs the same IEEE
             * operations in the same order (vector sqrt, division and fma are correctly
             * rounded), so they agree to the bit */
            expect_bitwise("adamw param vs torch's fp32 order", p.f, rp, n);
            expect_bitwise("adamw exp_avg vs torch's fp32 order", m.f, rm, n);
            expect_bitwise("adamw exp_avg_sq vs torch's fp32 order", v.f, rv, n);
            /* (2) the textbook formula in double: 3 steps, each rounding the parameter (a few
             * u of |p|) and the update (about 12 fp32 operations: 16u of the update; the
             * moment estimates' rounding is relative to themselves) */
            double *tol = dalloc(n);
            for (int64_t i = 0; i < n; i++)
                tol[i] = 3 * (4 * U * fabs(dp[i]) + 16 * U * maxstep[i]);
            char what[96];
            snprintf(what, sizeof what, "adamw vs double formula lr=%g b1=%g wd=%g n=%lld", (double)h.lr,
                     (double)h.b1, (double)h.wd, (long long)n);
            expect_close(what, p.f, dp, tol, n);
            free(tol);
            free(rp);
            free(rm);
            free(rv);
            free(dp);
            free(dm);
            free(dv);
            free(maxstep);
            arr_free(&p);
            arr_free(&m);
            arr_free(&v);
        }
}

/* adamw_multi against what the trainer did before it: the norm read on the host, the
 * gradients scaled by (float)(max_norm / (norm + 1e-6)) when that is below 1, then adamw on
 * each tensor; bit for bit. Several tensors (one of 1 element, one over a block of 16384), fp64 and
 * fp32 norm scalars, clipping on, off and inactive, both lerp branches; the gradients are
 * left as they were; a zero flag, an Inf or a NaN norm skip the step (nothing written). */
static void test_adamw_multi(void **state)
{
    (void)state;
    struct rng r = {47};
    enum { NT = 4 };
    int64_t sizes[NT] = {1000, 1, 40000, 7};
    struct mt {
        struct arr p, g, m, v;        /* what adamw_multi updates */
        struct arr rp, rg, rm, rv;    /* the reference: scale + adamw per tensor */
        struct am_tensor tp, tg, tm, tv, trp, trg, trm, trv;
    } T[NT];
    struct am_adamw_tensor list[NT];
    for (int i = 0; i < NT; i++) {
        int64_t n = sizes[i];
        struct mt *t = &T[i];
        t->p = arr_rand(&r, n, -1, 1);
        t->m = arr_rand(&r, n, -0.1, 0.1);
        t->v = arr_rand(&r, n, 0, 0.01);
        t->g = arr_new(n);
        t->rp = arr_copy(&t->p);
        t->rm = arr_copy(&t->m);
        t->rv = arr_copy(&t->v);
        t->rg = arr_new(n);
        t->tp = tview(&t->p, n, 0, 0, 0);
        t->tg = tview(&t->g, n, 0, 0, 0);
        t->tm = tview(&t->m, n, 0, 0, 0);
        t->tv = tview(&t->v, n, 0, 0, 0);
        t->trp = tview(&t->rp, n, 0, 0, 0);
        t->trg = tview(&t->rg, n, 0, 0, 0);
        t->trm = tview(&t->rm, n, 0, 0, 0);
        t->trv = tview(&t->rv, n, 0, 0, 0);
        list[i] = (struct am_adamw_tensor){.param = &t->tp, .m = &t->tm, .v = &t->tv, .grad = &t->tg};
    }
    /* (max_norm, sumsq's dtype, beta1): clipping active (norms of ~100 and ~0.5), inactive,
     * off (no scalar), with fp32 scalars and with torch's other lerp branch */
    struct {
        double max_norm;
        int sumsq; /* 0: none, 1: f64, 2: f32 */
        float beta1;
        double gscale;
    } cases[] = {{1.0, 1, 0.9f, 1.0}, {0.3, 2, 0.9f, 0.01}, {1e6, 1, 0.9f, 1.0}, {0.0, 0, 0.9f, 1.0},
                 {0.0, 1, 0.9f, 1.0}, {2.0, 2, 0.3f, 1.0}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        double ss = 0;
        for (int i = 0; i < NT; i++)
            for (int64_t e = 0; e < sizes[i]; e++) {
                T[i].g.f[e] = T[i].rg.f[e] = (float)(rng_uniform(&r, -1, 1) * cases[c].gscale);
                ss += (double)T[i].g.f[e] * T[i].g.f[e];
            }
        double ss64 = ss;
        float ss32 = (float)ss;
        struct am_tensor s64 = am_tensor_view(&ss64, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
        struct am_tensor s32 = am_tensor_view(&ss32, AM_DEV_CPU, AM_F32, 1, 0, 0, 0);
        const struct am_tensor *sumsq = cases[c].sumsq == 1 ? &s64 : cases[c].sumsq == 2 ? &s32 : NULL;
        int64_t step = (int64_t)c + 1;
        /* the reference: the trainer's host arithmetic, then adamw per tensor */
        double norm = sqrt(cases[c].sumsq == 2 ? (double)ss32 : ss64);
        double coef = cases[c].max_norm / (norm + 1e-6);
        bool clipped = cases[c].max_norm > 0 && coef < 1.0;
        assert_true(clipped == (c == 0 || c == 1 || c == 5)); /* the cases do what they say */
        for (int i = 0; i < NT; i++) {
            if (clipped)
                K->scale(&kdev, &T[i].trg, (float)coef);
            K->adamw(&kdev, &T[i].trp, &T[i].trg, &T[i].trm, &T[i].trv, 1e-3f, cases[c].beta1, 0.95f, 1e-8f, 0.1f, step);
        }
        float *orig[NT];
        for (int i = 0; i < NT; i++) {
            orig[i] = malloc((size_t)(sizes[i] ? sizes[i] : 1) * sizeof(float));
            memcpy(orig[i], T[i].g.f, (size_t)sizes[i] * sizeof(float));
        }
        K->adamw_multi(&kdev, list, NT, sumsq, cases[c].max_norm, NULL, 1e-3f, cases[c].beta1, 0.95f, 1e-8f, 0.1f, step);
        for (int i = 0; i < NT; i++) {
            int64_t n = sizes[i];
            char what[96];
            snprintf(what, sizeof what, "adamw_multi case %zu tensor %d: param", c, i);
            expect_bitwise(what, T[i].p.f, T[i].rp.f, n);
            expect_bitwise("adamw_multi: exp_avg", T[i].m.f, T[i].rm.f, n);
            expect_bitwise("adamw_multi: exp_avg_sq", T[i].v.f, T[i].rv.f, n);
            expect_bitwise("adamw_multi: the gradients stay as they were", T[i].g.f, orig[i], n);
            free(orig[i]);
        }
    }
    /* a step that must not be taken: nothing written */
    float *before = malloc(3 * 40000 * sizeof(float));
    for (int k = 0; k < 4; k++) {
        double ss64 = k == 0 ? INFINITY : k == 1 ? NAN : 1.0;
        int32_t flag = k == 2 ? 0 : 1;
        struct am_tensor s64 = am_tensor_view(&ss64, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
        struct am_tensor fl = am_tensor_view(&flag, AM_DEV_CPU, AM_I32, 1, 0, 0, 0);
        struct mt *t = &T[2];
        memcpy(before, t->p.f, 40000 * sizeof(float));
        memcpy(before + 40000, t->m.f, 40000 * sizeof(float));
        memcpy(before + 80000, t->v.f, 40000 * sizeof(float));
        for (int64_t e = 0; e < 40000; e++)
            t->g.f[e] = (float)rng_uniform(&r, -1, 1);
        K->adamw_multi(&kdev, list, NT, k == 3 ? NULL : &s64, k == 3 ? 0.0 : 1.0, &fl, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 9);
        bool same = memcmp(before, t->p.f, 40000 * sizeof(float)) == 0 &&
                    memcmp(before + 40000, t->m.f, 40000 * sizeof(float)) == 0 &&
                    memcmp(before + 80000, t->v.f, 40000 * sizeof(float)) == 0;
        if (k < 3 && !same) {
            print_error("adamw_multi wrote the tensors of a skipped step (%s)\n",
                        k == 0 ? "norm Inf" : k == 1 ? "norm NaN" : "flag 0");
            fail();
        }
        if (k == 3 && same) {
            print_error("adamw_multi with the flag 1 and no norm did not update\n");
            fail();
        }
    }
    free(before);
    for (int i = 0; i < NT; i++) {
        struct arr *all[] = {&T[i].p, &T[i].g, &T[i].m, &T[i].v, &T[i].rp, &T[i].rg, &T[i].rm, &T[i].rv};
        for (size_t k = 0; k < sizeof all / sizeof *all; k++)
            arr_free(all[k]);
    }
}

/* ---- bf16 storage, fp32 arithmetic ----
 *
 * Every kernel with a bf16 path runs on random inputs rounded to bf16, and the fp32 kernel
 * (tested above against double) on the same values widened to fp32, which is exact. A bf16
 * output must be the fp32 output rounded once:
 *     |got - ref| <= 2^-8 |ref| + 2^-12 max|ref|                     (expect_bf16)
 * bf16 keeps 8 significant bits, so rounding to nearest errs by at most its unit roundoff
 * 2^-8 of |ref| (the worst case, at the bottom of a binade; 2^-9 at its top). The absolute
 * term covers a result that differs from ref in its last fp32 bits because the bf16 path
 * sums in another order (tiles of 512 in the matrix products, chunks of vocabulary in the
 * cross-entropy, rows grouped in the embedding's backward): 2^-12 max|ref| is 16 times below
 * one bf16 rounding of the largest element and far above those fp32 differences (about
 * K 2^-24 of the sum of |terms|, K <= 700 here). The fraction of outputs bitwise equal to
 * bf16(ref) is printed too (AM_TEST_VERBOSE=1: 100% wherever the kernel runs the same fp32
 * code on the same values), and where the semantics round twice (RMSNorm's forward: bf16(w * bf16(x * rstd)),
 * transformers' order) the test reproduces both roundings and compares bitwise.
 * An f32 parameter gradient with bf16 inputs (mixed precision) sees only the fp32
 * differences: |got - ref| <= 2^-16 max|ref| (expect_mixed); f32 statistics the same.
 * The worst error of each comparison, relative to max|ref|, is printed with AM_TEST_VERBOSE.
 */
#include "half.h"

#define B16_REL 0x1p-8
#define B16_ABS 0x1p-12
#define MIXED_ABS 0x1p-16

/* A bf16 array (what the kernel sees) and its exact fp32 widening (what the fp32 kernel sees). */
struct bt {
    uint16_t *h;
    float *f;
    int64_t n;
};

static struct bt bt_new(int64_t n)
{
    struct bt a = {K->alloc(&kdev, (size_t)n * 2), K->alloc(&kdev, (size_t)n * 4), n};
    assert_non_null(a.h);
    assert_non_null(a.f);
    return a;
}

static struct bt bt_rand(struct rng *r, int64_t n, double lo, double hi)
{
    struct bt a = bt_new(n);
    for (int64_t i = 0; i < n; i++) {
        a.h[i] = am_f32_to_bf16((float)rng_uniform(r, lo, hi));
        a.f[i] = am_bf16_to_f32(a.h[i]);
    }
    return a;
}

static struct bt bt_copy(const struct bt *s)
{
    struct bt a = bt_new(s->n);
    memcpy(a.h, s->h, (size_t)s->n * 2);
    memcpy(a.f, s->f, (size_t)s->n * 4);
    return a;
}

static void bt_free(struct bt *a)
{
    K->free(&kdev, a->h);
    K->free(&kdev, a->f);
}

static struct am_tensor hv(struct bt *a, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(a->h, AM_DEV_CPU, AM_BF16, d0, d1, d2, d3);
}

static struct am_tensor fv(struct bt *a, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(a->f, AM_DEV_CPU, AM_F32, d0, d1, d2, d3);
}

static void report(const char *what, int64_t n, double worst_rel, int64_t bitwise, int64_t bad, int64_t at,
                   double got, double want, double tol)
{
    if (getenv("AM_TEST_VERBOSE"))
        printf("    %-50s n=%-7lld max|err|/max|ref| %.2e, bitwise %.1f%%\n", what, (long long)n, worst_rel,
               n ? 100.0 * (double)bitwise / (double)n : 100.0);
    if (bad) {
        print_error("%s: %lld of %lld elements out of tolerance; worst [%lld]: got %.9g want %.9g (tol %.3g)\n", what,
                    (long long)bad, (long long)n, (long long)at, got, want, tol);
        fail();
    }
}

static void expect_bf16(const char *what, const uint16_t *got, const float *ref, int64_t n)
{
    double mx = 0.0, worst = 0.0, wr = 0.0;
    for (int64_t i = 0; i < n; i++)
        mx = fmax(mx, fabs((double)ref[i]));
    int64_t bad = 0, at = 0, same = 0;
    for (int64_t i = 0; i < n; i++) {
        double g = am_bf16_to_f32(got[i]), e = fabs(g - ref[i]), tol = B16_REL * fabs((double)ref[i]) + B16_ABS * mx;
        same += got[i] == am_f32_to_bf16(ref[i]);
        if (!(e <= tol)) {
            bad++;
            at = i;
        }
        if (!(e / tol <= worst)) {
            worst = e / tol;
            if (!bad)
                at = i;
        }
        wr = fmax(wr, mx > 0 ? e / mx : e);
    }
    report(what, n, wr, same, bad, at, n ? am_bf16_to_f32(got[at]) : 0, n ? ref[at] : 0,
           n ? B16_REL * fabs((double)ref[at]) + B16_ABS * mx : 0);
}

static void expect_mixed(const char *what, const float *got, const float *ref, int64_t n)
{
    double mx = 0.0, wr = 0.0;
    for (int64_t i = 0; i < n; i++)
        mx = fmax(mx, fabs((double)ref[i]));
    int64_t bad = 0, at = 0, same = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - ref[i]);
        same += memcmp(&got[i], &ref[i], 4) == 0;
        if (!(e <= MIXED_ABS * mx)) {
            bad++;
            at = i;
        }
        wr = fmax(wr, mx > 0 ? e / mx : e);
    }
    report(what, n, wr, same, bad, at, n ? got[at] : 0, n ? ref[at] : 0, MIXED_ABS * mx);
}

static struct am_tensor f32v(float *p, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(p, AM_DEV_CPU, AM_F32, d0, d1, d2, d3);
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

static void test_bf16_matmul(void **state)
{
    (void)state;
    struct rng r = {103};
    int64_t cases[][3] = {{1, 1, 1}, {7, 13, 9}, {600, 530, 700}}; /* M, K, N: the last crosses 512-tiles in each */
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t M = cases[c][0], Kd = cases[c][1], N = cases[c][2];
        struct bt x = bt_rand(&r, M * Kd, -1, 1), w = bt_rand(&r, N * Kd, -1, 1), y = bt_new(M * N);
        struct bt dy = bt_rand(&r, M * N, -1, 1), dx = bt_rand(&r, M * Kd, -1, 1), dw = bt_rand(&r, N * Kd, -1, 1);
        struct bt dx0 = bt_copy(&dx), dw0 = bt_copy(&dw);
        float *dwm = malloc((size_t)(N * Kd) * 4);
        memcpy(dwm, dw0.f, (size_t)(N * Kd) * 4);
        struct am_tensor tx = hv(&x, M, Kd, 0, 0), tw = hv(&w, N, Kd, 0, 0), ty = hv(&y, M, N, 0, 0);
        struct am_tensor txf = fv(&x, M, Kd, 0, 0), twf = fv(&w, N, Kd, 0, 0), tyf = fv(&y, M, N, 0, 0);
        K->matmul_forward(&kdev, &ty, &tx, &tw);
        K->matmul_forward(&kdev, &tyf, &txf, &twf);
        char what[96];
        snprintf(what, sizeof what, "bf16 matmul y %lldx%lldx%lld", (long long)M, (long long)Kd, (long long)N);
        expect_bf16(what, y.h, y.f, M * N);
        struct am_tensor tdy = hv(&dy, M, N, 0, 0), tdx = hv(&dx, M, Kd, 0, 0), tdw = hv(&dw, N, Kd, 0, 0);
        struct am_tensor tdyf = fv(&dy, M, N, 0, 0), tdxf = fv(&dx, M, Kd, 0, 0), tdwf = fv(&dw, N, Kd, 0, 0);
        struct am_tensor tdwm = f32v(dwm, N, Kd, 0, 0);
        K->matmul_backward(&kdev, &tdx, &tdw, &tdy, &tx, &tw);
        K->matmul_backward(&kdev, &tdxf, &tdwf, &tdyf, &txf, &twf);
        K->matmul_backward(&kdev, NULL, &tdwm, &tdy, &tx, &tw); /* mixed: f32 dw, bf16 inputs */
        snprintf(what, sizeof what, "bf16 matmul dx %lldx%lldx%lld", (long long)M, (long long)Kd, (long long)N);
        expect_bf16(what, dx.h, dx.f, M * Kd);
        snprintf(what, sizeof what, "bf16 matmul dw (bf16) %lldx%lldx%lld", (long long)M, (long long)Kd, (long long)N);
        expect_bf16(what, dw.h, dw.f, N * Kd);
        snprintf(what, sizeof what, "bf16 matmul dw (f32, mixed) %lldx%lldx%lld", (long long)M, (long long)Kd,
                 (long long)N);
        expect_mixed(what, dwm, dw.f, N * Kd);
        free(dwm);
        struct bt *all[] = {&x, &w, &y, &dy, &dx, &dw, &dx0, &dw0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            bt_free(all[i]);
    }
}

static void test_bf16_embedding(void **state)
{
    (void)state;
    struct rng r = {107};
    int64_t V = 50, C = 40, N = 300, start = 10;
    int32_t *ids = malloc((size_t)N * sizeof(int32_t));
    for (int64_t i = 0; i < N; i++)
        ids[i] = (int32_t)(rng_uniform(&r, 0, 70)); /* repeats, and ids outside the shard 10..59 */
    struct am_tensor tids = ids_view(ids, N);
    struct bt wte = bt_rand(&r, V * C, -1, 1), out = bt_rand(&r, N * C, -1, 1);
    struct am_tensor twte = hv(&wte, V, C, 0, 0), tout = hv(&out, N, C, 0, 0);
    K->embedding_forward(&kdev, &tout, &tids, &twte, start);
    for (int64_t i = 0; i < N; i++)
        for (int64_t c = 0; c < C; c++) {
            int64_t row = ids[i] - start;
            assert_int_equal(out.h[i * C + c], row >= 0 && row < V ? wte.h[row * C + c] : 0);
        }
    struct bt dout = bt_rand(&r, N * C, -1, 1), dw = bt_rand(&r, V * C, -1, 1);
    float *dwm = malloc((size_t)(V * C) * 4);
    memcpy(dwm, dw.f, (size_t)(V * C) * 4);
    struct am_tensor tdout = hv(&dout, N, C, 0, 0), tdw = hv(&dw, V, C, 0, 0), tdoutf = fv(&dout, N, C, 0, 0);
    struct am_tensor tdwf = fv(&dw, V, C, 0, 0), tdwm = f32v(dwm, V, C, 0, 0);
    K->embedding_backward(&kdev, &tdw, &tdout, &tids, start);
    K->embedding_backward(&kdev, &tdwf, &tdoutf, &tids, start);
    K->embedding_backward(&kdev, &tdwm, &tdout, &tids, start);
    expect_bf16("bf16 embedding dwte (bf16, rounded once per row)", dw.h, dw.f, V * C);
    expect_mixed("bf16 embedding dwte (f32, mixed)", dwm, dw.f, V * C);
    free(dwm);
    free(ids);
    bt_free(&wte);
    bt_free(&out);
    bt_free(&dout);
    bt_free(&dw);
}

static void test_bf16_rmsnorm(void **state)
{
    (void)state;
    struct rng r = {109};
    int64_t N = 37, C = 300;
    for (int chunked = 0; chunked < 2; chunked++) {
        am_cpu_set_chunk(&kdev, chunked ? 5 * C : 0); /* 5 rows a chunk: the backward in 8 pieces */
        struct bt x = bt_rand(&r, N * C, -2, 2), w = bt_rand(&r, C, 0.5, 1.5), out = bt_new(N * C);
        float *rs = malloc((size_t)N * 4), *rsf = malloc((size_t)N * 4);
        struct am_tensor tx = hv(&x, N, C, 0, 0), tw = hv(&w, C, 0, 0, 0), to = hv(&out, N, C, 0, 0);
        struct am_tensor txf = fv(&x, N, C, 0, 0), twf = fv(&w, C, 0, 0, 0), tof = fv(&out, N, C, 0, 0);
        struct am_tensor tr = f32v(rs, N, 0, 0, 0), trf = f32v(rsf, N, 0, 0, 0);
        K->rmsnorm_forward(&kdev, &to, &tr, &tx, &tw, 1e-5f);
        K->rmsnorm_forward(&kdev, &tof, &trf, &txf, &twf, 1e-5f);
        /* rstd: the same fp32 computation on the same values; out: transformers' order,
         * weight * (x * rstd).to(bf16) in bf16, bitwise; and within two roundings of fp32 */
        assert_memory_equal(rs, rsf, (size_t)N * 4);
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < C; j++) {
                float h = am_bf16_to_f32(am_f32_to_bf16(x.f[i * C + j] * rs[i]));
                assert_int_equal(out.h[i * C + j], am_f32_to_bf16(w.f[j] * h));
                double e = fabs((double)am_bf16_to_f32(out.h[i * C + j]) - out.f[i * C + j]);
                assert_true(e <= 2 * B16_REL * fabs((double)out.f[i * C + j]));
            }
        struct bt dout = bt_rand(&r, N * C, -1, 1), dx = bt_rand(&r, N * C, -1, 1), dw = bt_rand(&r, C, -1, 1);
        float *dwm = malloc((size_t)C * 4);
        memcpy(dwm, dw.f, (size_t)C * 4);
        struct am_tensor td = hv(&dout, N, C, 0, 0), tdx = hv(&dx, N, C, 0, 0), tdw = hv(&dw, C, 0, 0, 0);
        struct am_tensor tdf = fv(&dout, N, C, 0, 0), tdxf = fv(&dx, N, C, 0, 0), tdwf = fv(&dw, C, 0, 0, 0);
        struct am_tensor tdwm = f32v(dwm, C, 0, 0, 0);
        K->rmsnorm_backward(&kdev, &tdx, &tdw, &td, &tx, &tw, &tr);
        K->rmsnorm_backward(&kdev, &tdxf, &tdwf, &tdf, &txf, &twf, &trf);
        K->rmsnorm_backward(&kdev, NULL, &tdwm, &td, &tx, &tw, &tr);
        expect_bf16(chunked ? "bf16 rmsnorm dx (chunks of 5 rows)" : "bf16 rmsnorm dx", dx.h, dx.f, N * C);
        expect_bf16(chunked ? "bf16 rmsnorm dw (bf16, chunks)" : "bf16 rmsnorm dw (bf16)", dw.h, dw.f, C);
        expect_mixed(chunked ? "bf16 rmsnorm dw (f32, mixed, chunks)" : "bf16 rmsnorm dw (f32, mixed)", dwm, dw.f, C);
        free(dwm);
        free(rs);
        free(rsf);
        struct bt *all[] = {&x, &w, &out, &dout, &dx, &dw};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            bt_free(all[i]);
    }
    am_cpu_set_chunk(&kdev, 0);
}

static void test_bf16_rope(void **state)
{
    (void)state;
    struct rng r = {113};
    int64_t shapes[][4] = {{2, 19, 3, 16}, {2, 64, 4, 64}}; /* B, T, H, D; the second in parallel */
    for (int sc = 0; sc < 2; sc++) {
        int64_t B = shapes[sc][0], T = shapes[sc][1], H = shapes[sc][2], D = shapes[sc][3], half = D / 2;
        int64_t n = B * T * H * D;
        float *c = malloc((size_t)(T * half) * 4), *s = malloc((size_t)(T * half) * 4);
        struct am_tensor tc = f32v(c, T, half, 0, 0), ts = f32v(s, T, half, 0, 0);
        K->rope_tables(&kdev, &tc, &ts, 10000.0, NULL);
        struct bt cb = bt_new(T * half), sb = bt_new(T * half); /* the tables in bf16, as transformers uses them */
        struct am_tensor tcb = hv(&cb, T, half, 0, 0), tsb = hv(&sb, T, half, 0, 0);
        K->convert(&kdev, &tcb, &tc);
        K->convert(&kdev, &tsb, &ts);
        K->convert(&kdev, &(struct am_tensor){.data = cb.f, .dtype = AM_F32, .ndim = 1, .shape = {T * half}}, &tcb);
        K->convert(&kdev, &(struct am_tensor){.data = sb.f, .dtype = AM_F32, .ndim = 1, .shape = {T * half}}, &tsb);
        struct am_tensor tcbf = fv(&cb, T, half, 0, 0), tsbf = fv(&sb, T, half, 0, 0);
        for (int bt16 = 0; bt16 < 2; bt16++) {
            struct bt x = bt_rand(&r, n, -1, 1);
            struct am_tensor tx = hv(&x, B, T, H, D), txf = fv(&x, B, T, H, D);
            const struct am_tensor *C16 = bt16 ? &tcb : &tc, *S16 = bt16 ? &tsb : &ts;
            const struct am_tensor *C32 = bt16 ? &tcbf : &tc, *S32 = bt16 ? &tsbf : &ts;
            K->rope_forward(&kdev, &tx, C16, S16);
            K->rope_forward(&kdev, &txf, C32, S32);
            char what[96];
            snprintf(what, sizeof what, "bf16 rope fwd, %s tables, B%lld T%lld H%lld D%lld", bt16 ? "bf16" : "f32",
                     (long long)B, (long long)T, (long long)H, (long long)D);
            expect_bf16(what, x.h, x.f, n);
            for (int64_t i = 0; i < n; i++) /* the backward from the same (bf16) start */
                x.f[i] = am_bf16_to_f32(x.h[i]);
            K->rope_backward(&kdev, &tx, C16, S16);
            K->rope_backward(&kdev, &txf, C32, S32);
            snprintf(what, sizeof what, "bf16 rope bwd, %s tables, B%lld T%lld H%lld D%lld", bt16 ? "bf16" : "f32",
                     (long long)B, (long long)T, (long long)H, (long long)D);
            expect_bf16(what, x.h, x.f, n);
            bt_free(&x);
        }
        free(c);
        free(s);
        bt_free(&cb);
        bt_free(&sb);
    }
}

static void test_bf16_attention(void **state)
{
    (void)state;
    struct rng r = {127};
    struct attn_dims cases[] = {{2, 37, 4, 2, 16, 0, NULL}, {1, 64, 4, 1, 64, 0, NULL}, {2, 9, 6, 3, 8, 4, NULL}}; /* the last windowed */
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
        for (int chunked = 0; chunked < 2; chunked++) {
            struct attn_dims s = cases[ci];
            am_cpu_set_chunk(&kdev, chunked ? 1 : 0); /* one group of kv heads at a time */
            int64_t nq = s.B * s.T * s.H * s.D, nk = s.B * s.T * s.KVH * s.D, nl = s.B * s.H * s.T;
            struct bt q = bt_rand(&r, nq, -2, 2), k = bt_rand(&r, nk, -2, 2), v = bt_rand(&r, nk, -1, 1);
            struct bt out = bt_new(nq);
            float *l = malloc((size_t)nl * 4), *lf = malloc((size_t)nl * 4);
            struct am_tensor tq = hv(&q, s.B, s.T, s.H, s.D), tk = hv(&k, s.B, s.T, s.KVH, s.D);
            struct am_tensor tv = hv(&v, s.B, s.T, s.KVH, s.D), to = hv(&out, s.B, s.T, s.H, s.D);
            struct am_tensor tqf = fv(&q, s.B, s.T, s.H, s.D), tkf = fv(&k, s.B, s.T, s.KVH, s.D);
            struct am_tensor tvf = fv(&v, s.B, s.T, s.KVH, s.D), tof = fv(&out, s.B, s.T, s.H, s.D);
            struct am_tensor tl = f32v(l, s.B, s.H, s.T, 0), tlf = f32v(lf, s.B, s.H, s.T, 0);
            K->attention_forward(&kdev, &to, &tl, &tq, &tk, &tv, s.W);
            K->attention_forward(&kdev, &tof, &tlf, &tqf, &tkf, &tvf, s.W);
            char what[128];
            snprintf(what, sizeof what, "bf16 attention out B%lld T%lld H%lld KVH%lld D%lld%s", (long long)s.B,
                     (long long)s.T, (long long)s.H, (long long)s.KVH, (long long)s.D, chunked ? " (per kv head)" : "");
            expect_bf16(what, out.h, out.f, nq);
            expect_mixed("bf16 attention lse (f32)", l, lf, nl);
            /* backward from the same bf16 out (widened for the fp32 kernel) and lse */
            for (int64_t i = 0; i < nq; i++)
                out.f[i] = am_bf16_to_f32(out.h[i]);
            struct bt dout = bt_rand(&r, nq, -1, 1), dq = bt_rand(&r, nq, -1, 1), dk = bt_rand(&r, nk, -1, 1);
            struct bt dv = bt_rand(&r, nk, -1, 1);
            struct am_tensor tdo = hv(&dout, s.B, s.T, s.H, s.D), tdq = hv(&dq, s.B, s.T, s.H, s.D);
            struct am_tensor tdk = hv(&dk, s.B, s.T, s.KVH, s.D), tdv = hv(&dv, s.B, s.T, s.KVH, s.D);
            struct am_tensor tdof = fv(&dout, s.B, s.T, s.H, s.D), tdqf = fv(&dq, s.B, s.T, s.H, s.D);
            struct am_tensor tdkf = fv(&dk, s.B, s.T, s.KVH, s.D), tdvf = fv(&dv, s.B, s.T, s.KVH, s.D);
            K->attention_backward(&kdev, &tdq, &tdk, &tdv, &tdo, &to, &tl, &tq, &tk, &tv, s.W);
            K->attention_backward(&kdev, &tdqf, &tdkf, &tdvf, &tdof, &tof, &tl, &tqf, &tkf, &tvf, s.W);
            expect_bf16("bf16 attention dq", dq.h, dq.f, nq);
            expect_bf16("bf16 attention dk", dk.h, dk.f, nk);
            expect_bf16("bf16 attention dv", dv.h, dv.f, nk);
            free(l);
            free(lf);
            struct bt *all[] = {&q, &k, &v, &out, &dout, &dq, &dk, &dv};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                bt_free(all[i]);
        }
    am_cpu_set_chunk(&kdev, 0);
}

/* Elements of a bf16 result out of expect_bf16's tolerance (without failing): the perturbation checks. */
static int64_t bf16_out_of_tolerance(const uint16_t *got, const float *ref, int64_t n)
{
    double mx = 0.0;
    for (int64_t i = 0; i < n; i++)
        mx = fmax(mx, fabs((double)ref[i]));
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += !(fabs(am_bf16_to_f32(got[i]) - ref[i]) <= B16_REL * fabs((double)ref[i]) + B16_ABS * mx);
    return bad;
}

/* A bf16 result whose largest element is moved by 2 %: expect_bf16's tolerance must see it. */
static void expect_perturbation_caught(const char *what, struct bt *a, int64_t n)
{
    int64_t at = 0;
    for (int64_t i = 1; i < n; i++)
        at = fabsf(a->f[i]) > fabsf(a->f[at]) ? i : at;
    uint16_t keep = a->h[at];
    a->h[at] = am_f32_to_bf16(am_bf16_to_f32(keep) * 1.02f + 1e-3f);
    if (bf16_out_of_tolerance(a->h, a->f, n) == 0) {
        print_error("%s: a perturbation of element %lld by 2%% went unnoticed\n", what, (long long)at);
        fail();
    }
    a->h[at] = keep;
}

/* The block kernels in bf16 (q, k, v bf16) against the fp32 ones on the widened inputs, the
 * way ring.c and packed.c use them: the keys in cp blocks merged into an f32 running out (and
 * f32 dq, dk, dv sums), then rounded once; and one block with bf16 out, dq, dk, dv (packed
 * sequences without cp: rounded once per call). */
static void test_bf16_attention_block(void **state)
{
    (void)state;
    struct rng r = {139};
    struct {
        struct attn_dims s;
        int cp;
        bool packed;
    } cases[] = {
        {{2, 32, 4, 2, 16, 0, NULL}, 2, false}, {{1, 48, 4, 1, 64, 13, NULL}, 3, false},
        {{2, 48, 4, 2, 8, 0, NULL}, 2, true},   {{2, 96, 4, 2, 8, 7, NULL}, 1, true},
        {{1, 160, 2, 1, 8, 0, NULL}, 2, true},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
        for (int chunked = 0; chunked < 2; chunked++) {
            struct attn_dims s = cases[ci].s;
            int cp = cases[ci].cp;
            am_cpu_set_chunk(&kdev, chunked ? 1 : 0); /* one sequence at a time */
            int64_t B = s.B, T = s.T, H = s.H, KVH = s.KVH, D = s.D, Tk = T / cp;
            int64_t nq = B * T * H * D, nk = B * T * KVH * D, nl = B * H * T, kb = B * Tk * KVH * D;
            int32_t *pos = malloc((size_t)T * sizeof(int32_t)), *start = calloc((size_t)(B * T), sizeof(int32_t));
            assert_non_null(pos);
            assert_non_null(start);
            for (int64_t t = 0; t < T; t++)
                pos[t] = (int32_t)t;
            for (int64_t b = 0; cases[ci].packed && b < B; b++)
                for (int64_t t = 0, first = 0; t < T; t++) {
                    if (t > first && rng_uniform(&r, 0, 1) < 3.0 / (double)T)
                        first = t;
                    start[b * T + t] = (int32_t)first;
                }
            struct am_tensor tqs = am_tensor_view(start, AM_DEV_CPU, AM_I32, B * T, 0, 0, 0);
            struct am_tensor *qs = cases[ci].packed ? &tqs : NULL, tqp = am_tensor_view(pos, AM_DEV_CPU, AM_I32, T, 0, 0, 0);
            /* the keys in cp blocks of Tk positions: block c holds positions c Tk .. (c + 1) Tk - 1 */
            struct bt q = bt_rand(&r, nq, -2, 2), dout = bt_rand(&r, nq, -1, 1);
            struct bt kblk[3], vblk[3];
            for (int c = 0; c < cp; c++) {
                kblk[c] = bt_rand(&r, kb, -2, 2);
                vblk[c] = bt_rand(&r, kb, -1, 1);
            }
            float *o32 = malloc((size_t)nq * 4), *of = malloc((size_t)nq * 4), *l = malloc((size_t)nl * 4);
            float *lf = malloc((size_t)nl * 4);
            struct bt out = bt_new(nq);
            struct am_tensor to32 = f32v(o32, B, T, H, D), tof = f32v(of, B, T, H, D);
            struct am_tensor tl = f32v(l, B, H, T, 0), tlf = f32v(lf, B, H, T, 0);
            struct am_tensor tq = hv(&q, B, T, H, D), tqf = fv(&q, B, T, H, D);
            for (int c = 0; c < cp; c++) {
                struct am_tensor kp = am_tensor_view(pos + c * Tk, AM_DEV_CPU, AM_I32, Tk, 0, 0, 0);
                struct am_tensor tk = hv(&kblk[c], B, Tk, KVH, D), tv = hv(&vblk[c], B, Tk, KVH, D);
                struct am_tensor tkf = fv(&kblk[c], B, Tk, KVH, D), tvf = fv(&vblk[c], B, Tk, KVH, D);
                K->attention_block_forward(&kdev, &to32, &tl, &tq, &tk, &tv, &tqp, &kp, qs, s.W, c > 0);
                K->attention_block_forward(&kdev, &tof, &tlf, &tqf, &tkf, &tvf, &tqp, &kp, qs, s.W, c > 0);
            }
            char what[160];
            snprintf(what, sizeof what, "bf16 attention block out (f32 merge of %d) B%lld T%lld H%lld KVH%lld D%lld%s%s",
                     cp, (long long)B, (long long)T, (long long)H, (long long)KVH, (long long)D,
                     cases[ci].packed ? " packed" : "", chunked ? " (per sequence)" : "");
            expect_mixed(what, o32, of, nq);
            expect_mixed("bf16 attention block lse (f32)", l, lf, nl);
            for (int64_t i = 0; i < nq; i++) { /* rounded once, as ring.c does after the last block */
                out.h[i] = am_f32_to_bf16(o32[i]);
                out.f[i] = of[i];
            }
            expect_bf16("bf16 attention block out (rounded once)", out.h, out.f, nq);
            expect_perturbation_caught("bf16 attention block out", &out, nq);
            /* one block, out bf16 without accumulate (its keys: all T positions) */
            struct bt kall = bt_new(nk), vall = bt_new(nk), o1 = bt_new(nq);
            for (int64_t b = 0; b < B; b++)
                for (int c = 0; c < cp; c++) {
                    size_t rowb = (size_t)(Tk * KVH * D);
                    memcpy(kall.h + (b * T + c * Tk) * KVH * D, kblk[c].h + b * Tk * KVH * D, rowb * 2);
                    memcpy(kall.f + (b * T + c * Tk) * KVH * D, kblk[c].f + b * Tk * KVH * D, rowb * 4);
                    memcpy(vall.h + (b * T + c * Tk) * KVH * D, vblk[c].h + b * Tk * KVH * D, rowb * 2);
                    memcpy(vall.f + (b * T + c * Tk) * KVH * D, vblk[c].f + b * Tk * KVH * D, rowb * 4);
                }
            struct am_tensor tka = hv(&kall, B, T, KVH, D), tva = hv(&vall, B, T, KVH, D);
            struct am_tensor tkaf = fv(&kall, B, T, KVH, D), tvaf = fv(&vall, B, T, KVH, D);
            struct am_tensor to1 = hv(&o1, B, T, H, D), to1f = fv(&o1, B, T, H, D);
            K->attention_block_forward(&kdev, &to1, &tl, &tq, &tka, &tva, &tqp, &tqp, qs, s.W, 0);
            K->attention_block_forward(&kdev, &to1f, &tlf, &tqf, &tkaf, &tvaf, &tqp, &tqp, qs, s.W, 0);
            expect_bf16("bf16 attention block out (one block, bf16)", o1.h, o1.f, nq);
            expect_mixed("bf16 attention block lse (one block)", l, lf, nl);
            expect_perturbation_caught("bf16 attention block out (one block)", &o1, nq);
            /* backward from the bf16 out (widened for the fp32 kernel) and the lse */
            for (int64_t i = 0; i < nq; i++)
                o1.f[i] = am_bf16_to_f32(o1.h[i]);
            struct am_tensor tdo = hv(&dout, B, T, H, D), tdof = fv(&dout, B, T, H, D);
            /* the ring's way: f32 dq summed over the blocks, each block's f32 dk, dv, then rounded */
            float *dq32 = calloc((size_t)nq, 4), *dqf = calloc((size_t)nq, 4);
            float *dk32 = calloc((size_t)kb, 4), *dv32 = calloc((size_t)kb, 4), *dkf = calloc((size_t)kb, 4);
            float *dvf = calloc((size_t)kb, 4);
            struct am_tensor tdq32 = f32v(dq32, B, T, H, D), tdqf = f32v(dqf, B, T, H, D);
            struct am_tensor tdk32 = f32v(dk32, B, Tk, KVH, D), tdv32 = f32v(dv32, B, Tk, KVH, D);
            struct am_tensor tdkf = f32v(dkf, B, Tk, KVH, D), tdvf = f32v(dvf, B, Tk, KVH, D);
            for (int c = 0; c < cp; c++) {
                struct am_tensor kp = am_tensor_view(pos + c * Tk, AM_DEV_CPU, AM_I32, Tk, 0, 0, 0);
                struct am_tensor tk = hv(&kblk[c], B, Tk, KVH, D), tv = hv(&vblk[c], B, Tk, KVH, D);
                struct am_tensor tkf = fv(&kblk[c], B, Tk, KVH, D), tvf = fv(&vblk[c], B, Tk, KVH, D);
                memset(dk32, 0, (size_t)kb * 4);
                memset(dv32, 0, (size_t)kb * 4);
                memset(dkf, 0, (size_t)kb * 4);
                memset(dvf, 0, (size_t)kb * 4);
                K->attention_block_backward(&kdev, &tdq32, &tdk32, &tdv32, &tdo, &to1, &tl, &tq, &tk, &tv, &tqp, &kp,
                                            qs, s.W);
                K->attention_block_backward(&kdev, &tdqf, &tdkf, &tdvf, &tdof, &to1f, &tl, &tqf, &tkf, &tvf, &tqp,
                                            &kp, qs, s.W);
                expect_mixed("bf16 attention block dk (f32, one block's terms)", dk32, dkf, kb);
                expect_mixed("bf16 attention block dv (f32, one block's terms)", dv32, dvf, kb);
            }
            expect_mixed("bf16 attention block dq (f32 sum over the blocks)", dq32, dqf, nq);
            /* one block with bf16 dq, dk, dv: the terms added in fp32, rounded once */
            struct bt dq = bt_rand(&r, nq, -1, 1), dk = bt_rand(&r, nk, -1, 1), dv = bt_rand(&r, nk, -1, 1);
            struct am_tensor tdq = hv(&dq, B, T, H, D), tdk = hv(&dk, B, T, KVH, D), tdv = hv(&dv, B, T, KVH, D);
            struct am_tensor tdq1f = fv(&dq, B, T, H, D), tdk1f = fv(&dk, B, T, KVH, D), tdv1f = fv(&dv, B, T, KVH, D);
            K->attention_block_backward(&kdev, &tdq, &tdk, &tdv, &tdo, &to1, &tl, &tq, &tka, &tva, &tqp, &tqp, qs, s.W);
            K->attention_block_backward(&kdev, &tdq1f, &tdk1f, &tdv1f, &tdof, &to1f, &tl, &tqf, &tkaf, &tvaf, &tqp,
                                        &tqp, qs, s.W);
            expect_bf16("bf16 attention block dq (bf16)", dq.h, dq.f, nq);
            expect_bf16("bf16 attention block dk (bf16)", dk.h, dk.f, nk);
            expect_bf16("bf16 attention block dv (bf16)", dv.h, dv.f, nk);
            expect_perturbation_caught("bf16 attention block dq", &dq, nq);
            expect_perturbation_caught("bf16 attention block dk", &dk, nk);
            free(dq32);
            free(dqf);
            free(dk32);
            free(dv32);
            free(dkf);
            free(dvf);
            free(o32);
            free(of);
            free(l);
            free(lf);
            free(pos);
            free(start);
            for (int c = 0; c < cp; c++) {
                bt_free(&kblk[c]);
                bt_free(&vblk[c]);
            }
            struct bt *all[] = {&q, &dout, &out, &kall, &vall, &o1, &dq, &dk, &dv};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                bt_free(all[i]);
        }
    am_cpu_set_chunk(&kdev, 0);
}

static void test_bf16_swiglu(void **state)
{
    (void)state;
    struct rng r = {131};
    int64_t sizes[] = {1000, 40000}; /* one block; three blocks (of 16384) in parallel */
    for (size_t c = 0; c < 2; c++) {
        int64_t n = sizes[c];
        struct bt g = bt_rand(&r, n, -6, 6), u = bt_rand(&r, n, -2, 2), o = bt_new(n);
        struct am_tensor tg = hv(&g, n, 0, 0, 0), tu = hv(&u, n, 0, 0, 0), to = hv(&o, n, 0, 0, 0);
        struct am_tensor tgf = fv(&g, n, 0, 0, 0), tuf = fv(&u, n, 0, 0, 0), tof = fv(&o, n, 0, 0, 0);
        K->swiglu_forward(&kdev, &to, &tg, &tu);
        K->swiglu_forward(&kdev, &tof, &tgf, &tuf);
        expect_bf16("bf16 swiglu out", o.h, o.f, n);
        struct bt d = bt_rand(&r, n, -1, 1), dg = bt_rand(&r, n, -1, 1), du = bt_rand(&r, n, -1, 1);
        struct bt dg0 = bt_copy(&dg);
        struct am_tensor td = hv(&d, n, 0, 0, 0), tdg = hv(&dg, n, 0, 0, 0), tdu = hv(&du, n, 0, 0, 0);
        struct am_tensor tdf = fv(&d, n, 0, 0, 0), tdgf = fv(&dg, n, 0, 0, 0), tduf = fv(&du, n, 0, 0, 0);
        K->swiglu_backward(&kdev, &tdg, &tdu, &td, &tg, &tu);
        K->swiglu_backward(&kdev, &tdgf, &tduf, &tdf, &tgf, &tuf);
        expect_bf16("bf16 swiglu dgate", dg.h, dg.f, n);
        expect_bf16("bf16 swiglu dup", du.h, du.f, n);
        struct am_tensor tdg0 = hv(&dg0, n, 0, 0, 0), tdg0f = fv(&dg0, n, 0, 0, 0);
        K->swiglu_backward(&kdev, &tdg0, NULL, &td, &tg, &tu); /* a frozen up branch */
        K->swiglu_backward(&kdev, &tdg0f, NULL, &tdf, &tgf, &tuf);
        expect_bf16("bf16 swiglu dgate alone", dg0.h, dg0.f, n);
        struct bt *all[] = {&g, &u, &o, &d, &dg, &du, &dg0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            bt_free(all[i]);
    }
}

static void test_bf16_bias(void **state)
{
    (void)state;
    struct rng r = {137};
    int64_t M = 300, N = 600;
    struct bt y = bt_rand(&r, M * N, -1, 1), b = bt_rand(&r, N, -1, 1);
    struct am_tensor ty = hv(&y, M, N, 0, 0), tb = hv(&b, N, 0, 0, 0);
    struct am_tensor tyf = fv(&y, M, N, 0, 0), tbf = fv(&b, N, 0, 0, 0);
    K->bias_forward(&kdev, &ty, &tb);
    K->bias_forward(&kdev, &tyf, &tbf);
    expect_bf16("bf16 bias y", y.h, y.f, M * N);
    struct bt dy = bt_rand(&r, M * N, -1, 1), db = bt_rand(&r, N, -1, 1);
    float *dbm = malloc((size_t)N * 4);
    memcpy(dbm, db.f, (size_t)N * 4);
    struct am_tensor tdy = hv(&dy, M, N, 0, 0), tdb = hv(&db, N, 0, 0, 0), tdbm = f32v(dbm, N, 0, 0, 0);
    struct am_tensor tdyf = fv(&dy, M, N, 0, 0), tdbf = fv(&db, N, 0, 0, 0);
    K->bias_backward(&kdev, &tdb, &tdy);
    K->bias_backward(&kdev, &tdbm, &tdy); /* mixed: f32 db, bf16 dy */
    K->bias_backward(&kdev, &tdbf, &tdyf);
    expect_bf16("bf16 bias db (bf16)", db.h, db.f, N);
    expect_mixed("bf16 bias db (f32, mixed)", dbm, db.f, N);
    free(dbm);
    struct bt *all[] = {&y, &b, &dy, &db};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        bt_free(all[i]);
}

static void test_bf16_cross_entropy(void **state)
{
    (void)state;
    struct rng r = {137};
    int64_t N = 40, C = 24, V = 700;
    int32_t *tg = malloc((size_t)N * sizeof(int32_t));
    for (int64_t i = 0; i < N; i++)
        tg[i] = i % 7 == 3 ? -1 : (int32_t)rng_uniform(&r, 0, (double)V);
    struct am_tensor ttg = ids_view(tg, N);
    float scale = 1.0f / (float)N;
    for (int chunked = 0; chunked < 2; chunked++) {
        am_cpu_set_chunk(&kdev, chunked ? 256 * C : 0); /* vocabulary in 3 chunks, combined as shards */
        struct bt x = bt_rand(&r, N * C, -2, 2), w = bt_rand(&r, V * C, -1, 1);
        struct am_tensor tx = hv(&x, N, C, 0, 0), tw = hv(&w, V, C, 0, 0);
        struct am_tensor txf = fv(&x, N, C, 0, 0), twf = fv(&w, V, C, 0, 0);
        float *st = calloc((size_t)(6 * N), 4);
        struct am_tensor tm = f32v(st, N, 0, 0, 0), ts = f32v(st + N, N, 0, 0, 0), tt = f32v(st + 2 * N, N, 0, 0, 0);
        struct am_tensor tmf = f32v(st + 3 * N, N, 0, 0, 0), tsf = f32v(st + 4 * N, N, 0, 0, 0);
        struct am_tensor ttf = f32v(st + 5 * N, N, 0, 0, 0);
        K->ce_stats(&kdev, &tm, &ts, &tt, &tx, &tw, &ttg, 0);
        K->ce_stats(&kdev, &tmf, &tsf, &ttf, &txf, &twf, &ttg, 0);
        expect_mixed(chunked ? "bf16 ce_stats m (3 vocabulary chunks)" : "bf16 ce_stats m", st, st + 3 * N, N);
        expect_mixed(chunked ? "bf16 ce_stats s (3 vocabulary chunks)" : "bf16 ce_stats s", st + N, st + 4 * N, N);
        expect_mixed(chunked ? "bf16 ce_stats t (3 vocabulary chunks)" : "bf16 ce_stats t", st + 2 * N, st + 5 * N, N);
        struct bt dx = bt_rand(&r, N * C, -1, 1), dw = bt_rand(&r, V * C, -1, 1), dx0 = bt_copy(&dx), dw0 = bt_copy(&dw);
        float *dwm = malloc((size_t)(V * C) * 4);
        memcpy(dwm, dw.f, (size_t)(V * C) * 4);
        struct am_tensor tdx = hv(&dx, N, C, 0, 0), tdw = hv(&dw, V, C, 0, 0), tdxf = fv(&dx, N, C, 0, 0);
        struct am_tensor tdwf = fv(&dw, V, C, 0, 0), tdwm = f32v(dwm, V, C, 0, 0);
        K->ce_backward(&kdev, &tdx, &tdw, &tx, &tw, &ttg, 0, &tmf, &tsf, scale);
        K->ce_backward(&kdev, &tdxf, &tdwf, &txf, &twf, &ttg, 0, &tmf, &tsf, scale);
        K->ce_backward(&kdev, NULL, &tdwm, &tx, &tw, &ttg, 0, &tmf, &tsf, scale);
        expect_bf16("bf16 ce_backward dx", dx.h, dx.f, N * C);
        expect_bf16("bf16 ce_backward dw (bf16)", dw.h, dw.f, V * C);
        expect_mixed("bf16 ce_backward dw (f32, mixed)", dwm, dw.f, V * C);
        /* ce_fused: the same statistics and gradients in one pass, or refused as fp32 is */
        memcpy(dx.h, dx0.h, (size_t)(N * C) * 2);
        memcpy(dx.f, dx0.f, (size_t)(N * C) * 4);
        memcpy(dw.f, dw0.f, (size_t)(V * C) * 4);
        memcpy(dwm, dw0.f, (size_t)(V * C) * 4);
        memset(st, 0, (size_t)(3 * N) * 4);
        bool done = K->ce_fused(&kdev, &tm, &ts, &tt, &tdx, &tdwm, &tx, &tw, &ttg, scale);
        bool donef = K->ce_fused(&kdev, &tmf, &tsf, &ttf, &tdxf, &tdwf, &txf, &twf, &ttg, scale);
        assert_int_equal(done, donef);
        if (done) {
            expect_mixed("bf16 ce_fused m", st, st + 3 * N, N);
            expect_mixed("bf16 ce_fused s", st + N, st + 4 * N, N);
            expect_bf16("bf16 ce_fused dx", dx.h, dx.f, N * C);
            expect_mixed("bf16 ce_fused dw (f32, mixed)", dwm, dw.f, V * C);
        }
        free(dwm);
        free(st);
        struct bt *all[] = {&x, &w, &dx, &dw, &dx0, &dw0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            bt_free(all[i]);
    }
    am_cpu_set_chunk(&kdev, 0);
    free(tg);
}

/* A wrong dtype is a caller's bug: the kernel names itself, the tensor and the rule. */
static void bad_dtype_call(int which)
{
    uint16_t h[64] = {0};
    float f[64] = {0};
    struct am_tensor x16 = am_tensor_view(h, AM_DEV_CPU, AM_BF16, 4, 4, 0, 0);
    struct am_tensor xh = am_tensor_view(h, AM_DEV_CPU, AM_F16, 4, 4, 0, 0);
    struct am_tensor x32 = am_tensor_view(f, AM_DEV_CPU, AM_F32, 4, 4, 0, 0);
    struct am_tensor w16 = am_tensor_view(h + 16, AM_DEV_CPU, AM_BF16, 4, 4, 0, 0);
    struct am_tensor w32 = am_tensor_view(f + 16, AM_DEV_CPU, AM_F32, 4, 4, 0, 0);
    struct am_tensor y16 = am_tensor_view(h + 32, AM_DEV_CPU, AM_BF16, 4, 4, 0, 0);
    struct am_tensor dw16 = am_tensor_view(h + 48, AM_DEV_CPU, AM_BF16, 4, 4, 0, 0);
    struct am_tensor n16 = am_tensor_view(h + 16, AM_DEV_CPU, AM_BF16, 4, 0, 0, 0);
    struct am_tensor n32 = am_tensor_view(f + 16, AM_DEV_CPU, AM_F32, 4, 0, 0, 0);
    struct am_tensor r16 = am_tensor_view(h + 48, AM_DEV_CPU, AM_BF16, 4, 0, 0, 0);
    xh.name = "model.layers.0.mlp.act";
    dw16.name = "model.layers.0.mlp.up_proj.weight.grad";
    n32.name = "model.norm.weight";
    r16.name = "model.norm.rstd";
    switch (which) {
    case 0: K->matmul_forward(&kdev, &y16, &xh, &w16); break;                 /* f16 */
    case 1: K->matmul_backward(&kdev, NULL, &dw16, &x32, &x32, &w32); break;  /* bf16 dw, f32 x */
    case 2: K->rmsnorm_forward(&kdev, &y16, &n32, &x16, &n32, 1e-5f); break; /* f32 w, bf16 x */
    case 3: K->rmsnorm_forward(&kdev, &y16, &r16, &x16, &n16, 1e-5f); break; /* bf16 rstd */
    }
}

static void test_bf16_bad_dtype_aborts(void **state)
{
    (void)state;
    const char *want[][4] = {
        {"am_cpu_matmul_forward", "model.layers.0.mlp.act", "fp16", "fp32 or bf16"},
        {"am_cpu_matmul_backward", "model.layers.0.mlp.up_proj.weight.grad", "bf16 when the activations are bf16", ""},
        {"am_cpu_rmsnorm_forward", "model.norm.weight", "share one dtype", "fp32"},
        {"am_cpu_rmsnorm_forward", "model.norm.rstd", "statistics", "stay fp32"},
    };
    for (int c = 0; c < 4; c++) {
        int pipefd[2];
        assert_int_equal(pipe(pipefd), 0);
        fflush(stdout);
        fflush(stderr);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            dup2(pipefd[1], 2);
            bad_dtype_call(c);
            _exit(0);
        }
        close(pipefd[1]);
        char msg[1024] = {0};
        ssize_t got = 0, rd;
        while ((rd = read(pipefd[0], msg + got, sizeof msg - 1 - (size_t)got)) > 0)
            got += rd;
        close(pipefd[0]);
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (getenv("AM_TEST_VERBOSE"))
            printf("    %s", msg);
        assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
        for (int i = 0; i < 4; i++)
            if (!strstr(msg, want[c][i])) {
                print_error("case %d: \"%s\" not in: %s\n", c, want[c][i], msg);
                fail();
            }
    }
}

/* ---- a wrong shape is a caller's bug: the kernel names it and aborts ---- */

static void test_bad_shape_aborts(void **state)
{
    (void)state;
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(pipefd[1], 2);
        float a[6] = {0}, b[6] = {0}, c[4] = {0};
        struct am_tensor x = am_tensor_view(a, AM_DEV_CPU, AM_F32, 2, 3, 0, 0);
        struct am_tensor w = am_tensor_view(b, AM_DEV_CPU, AM_F32, 3, 2, 0, 0); /* K mismatch */
        struct am_tensor y = am_tensor_view(c, AM_DEV_CPU, AM_F32, 2, 2, 0, 0);
        w.name = "model.layers.0.mlp.up_proj.weight";
        K->matmul_forward(&kdev, &y, &x, &w);
        _exit(0);
    }
    close(pipefd[1]);
    char msg[512] = {0};
    ssize_t got = 0, rd;
    while ((rd = read(pipefd[0], msg + got, sizeof msg - 1 - (size_t)got)) > 0)
        got += rd;
    close(pipefd[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
    assert_non_null(strstr(msg, "am_cpu_matmul_forward"));
    assert_non_null(strstr(msg, "model.layers.0.mlp.up_proj.weight"));
}

/* The CUDA device context where there is no GPU (this test runs in CI, on CPUs): a build
 * without CUDA says so; a build with CUDA fails cleanly with "no CUDA device" and the
 * CUDA runtime's reason, leaving the context zeroed. The tables: the CPU's is complete, the
 * CUDA backend's names what it lacks (am_dev_open refuses it on a GPU for that). */
static void test_cuda_context(void **state)
{
    (void)state;
    char msg[512] = "", missing[512];
    struct am_dev d;
    memset(&d, 0x5a, sizeof d);
    assert_int_equal(am_kernels_missing(am_kernels_cpu(), missing, sizeof missing), 0);
    assert_string_equal(missing, "");
#ifdef AM_HAVE_CUDA
    const struct am_kernels *ck = am_kernels_for(AM_DEV_CUDA);
    assert_non_null(ck);
    assert_ptr_equal(ck, am_kernels_cuda());
    assert_string_equal(ck->name, "cuda");
    assert_int_equal(ck->device, AM_DEV_CUDA);
    int n = am_kernels_missing(ck, missing, sizeof missing);
    assert_int_equal(n, 0);
    assert_string_equal(missing, "");
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    int rc = am_dev_open(&d, AM_DEV_CUDA, 0, msg, sizeof msg);
    if (getenv("AM_TEST_VERBOSE"))
        fprintf(stderr, "am_dev_open(cuda): %d %s\n", rc, rc ? msg : "opened");
    if (e == cudaSuccess && ndev > 0) { /* a GPU machine: opened, or refused for what the table lacks */
        if (rc == 0) {
            am_dev_close(&d);
            return;
        }
        char want[600];
        snprintf(want, sizeof want, "kernels: the cuda backend lacks: %s", missing);
        assert_non_null(strstr(msg, want));
    } else {
        char want[300];
        snprintf(want, sizeof want, "kernels (cuda): no CUDA device (cudaGetDeviceCount: %s)",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        assert_int_equal(rc, -1);
        assert_string_equal(msg, want);
    }
#else
    assert_int_equal(am_dev_open(&d, AM_DEV_CUDA, 0, msg, sizeof msg), -1);
    assert_non_null(strstr(msg, "this build of am has no cuda backend"));
#endif
    assert_null(d.k);
    assert_null(d.stream);
    assert_null(d.workspace);
    /* a table with holes is refused by name, whatever the device */
    struct am_kernels holes = *am_kernels_cpu();
    holes.name = "holey";
    holes.rope_forward = NULL;
    holes.adamw = NULL;
    holes.adamw_multi = NULL;
    assert_int_equal(am_kernels_missing(&holes, missing, sizeof missing), 3);
    assert_string_equal(missing, "rope_forward, adamw, adamw_multi");
    char tiny[8];
    assert_int_equal(am_kernels_missing(&holes, tiny, sizeof tiny), 3); /* truncated, terminated */
    assert_true(strlen(tiny) < sizeof tiny);
}

static int setup(void **state)
{
    (void)state;
    char msg[256];
    if (am_dev_open(&kdev, AM_DEV_CPU, -1, msg, sizeof(msg)) < 0) {
        fprintf(stderr, "%s\n", msg);
        return 1;
    }
    K = kdev.k;
    return K ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_expf), cmocka_unit_test(test_memory),        cmocka_unit_test(test_elementwise), cmocka_unit_test(test_scalars_and_convert), cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_embedding),     cmocka_unit_test(test_rmsnorm),     cmocka_unit_test(test_rope_tables),
        cmocka_unit_test(test_rope),          cmocka_unit_test(test_attention),   cmocka_unit_test(test_attention_block),   cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_bias),
        cmocka_unit_test(test_moe_route), cmocka_unit_test(test_moe_dispatch),
        cmocka_unit_test(test_cross_entropy), cmocka_unit_test(test_adamw),       cmocka_unit_test(test_adamw_multi), cmocka_unit_test(test_bad_shape_aborts),
        cmocka_unit_test(test_bf16_elementwise), cmocka_unit_test(test_bf16_matmul), cmocka_unit_test(test_bf16_embedding),
        cmocka_unit_test(test_bf16_rmsnorm), cmocka_unit_test(test_bf16_rope), cmocka_unit_test(test_bf16_attention),
        cmocka_unit_test(test_bf16_attention_block),
        cmocka_unit_test(test_bf16_swiglu), cmocka_unit_test(test_bf16_bias), cmocka_unit_test(test_bf16_cross_entropy),
        cmocka_unit_test(test_bf16_bad_dtype_aborts), cmocka_unit_test(test_cuda_context),
    };
    return cmocka_run_group_tests_name("kernels (cpu)", tests, setup, NULL);
}
