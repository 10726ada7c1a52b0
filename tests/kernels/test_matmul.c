/* test_matmul.c - the CPU kernels' tests (kernels_test.h: how they are tested): linear layers
 * (y = x · wᵀ) and their bias.
 */
#include "kernels_test.h"

/* ---- matmul: y = x · wᵀ ---- */

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_bias),
        cmocka_unit_test(test_bf16_matmul),
        cmocka_unit_test(test_bf16_bias),
    };
    return cmocka_run_group_tests_name("kernels (cpu): matmul", tests, kernels_test_setup, NULL);
}
