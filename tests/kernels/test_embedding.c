/* test_embedding.c - the CPU kernels' tests (kernels_test.h: how they are tested): the
 * vocabulary-parallel embedding.
 */
#include "kernels_test.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embedding),
        cmocka_unit_test(test_bf16_embedding),
    };
    return cmocka_run_group_tests_name("kernels (cpu): embedding", tests, kernels_test_setup, NULL);
}
