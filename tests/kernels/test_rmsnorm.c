/* test_rmsnorm.c - the CPU kernels' tests (kernels_test.h: how they are tested): RMSNorm. */
#include "kernels_test.h"
#include "cpu/cpu.h" /* the backend's private helpers (am_expf, am_cpu_set_chunk), used directly */

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_bf16_rmsnorm),
    };
    return cmocka_run_group_tests_name("kernels (cpu): rmsnorm", tests, kernels_test_setup, NULL);
}
