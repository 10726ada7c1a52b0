/* test_swiglu.c - the CPU kernels' tests (kernels_test.h: how they are tested): SwiGLU. */
#include "kernels_test.h"

/* ---- SwiGLU ---- */

struct swiglu_ctx {
    double *g, *u, *R;
    int64_t n;
};

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_bf16_swiglu),
    };
    return cmocka_run_group_tests_name("kernels (cpu): swiglu", tests, kernels_test_setup, NULL);
}
