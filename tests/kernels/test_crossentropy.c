/* test_crossentropy.c - the CPU kernels' tests (kernels_test.h: how they are tested): the
 * cross-entropy fused with the output projection.
 */
#include "kernels_test.h"
#include "cpu/cpu.h" /* the backend's private helpers (am_expf, am_cpu_set_chunk), used directly */

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

/* LoRA on the head (ce_stats_lora, ce_backward_lora): the logits x · wᵀ + u · bᵀ are those of
 * the concatenations x' = [x | u], w' = [w | b], so the LoRA kernels must agree with
 * ce_stats_softcap / ce_backward_softcap on x' and w' (fp32, within the matmul's reordering:
 * 1e-5 of the largest): statistics, dx = dx'[:, :C], du = dx'[:, C:], db = dw'[:, C:]; without
 * and with a soft cap, two vocabulary shards. Then bf16 (x, w, u, b, du bf16; db fp32) against
 * the fp32 kernel on the widened values, whole and in vocabulary chunks. */
static void test_lora_cross_entropy(void **state)
{
    (void)state;
    struct rng r = {271};
    int64_t N = 37, C = 20, V = 600, R = 4, Ct = C + R, Vh = V / 2;
    int32_t *tg = malloc((size_t)N * sizeof(int32_t));
    for (int64_t i = 0; i < N; i++)
        tg[i] = i % 5 == 2 ? -1 : (int32_t)rng_uniform(&r, 0, (double)V);
    struct am_tensor ttg = ids_view(tg, N);
    float scale = 1.0f / (float)N;
    struct arr x = arr_rand(&r, N * C, -2, 2), w = arr_rand(&r, V * C, -1, 1), u = arr_rand(&r, N * R, -1, 1);
    struct arr b = arr_rand(&r, V * R, -1, 1), xc = arr_new(N * Ct), wc = arr_new(V * Ct);
    for (int64_t i = 0; i < N; i++)
        for (int64_t c = 0; c < Ct; c++)
            xc.f[i * Ct + c] = c < C ? x.f[i * C + c] : u.f[i * R + c - C];
    for (int64_t v = 0; v < V; v++)
        for (int64_t c = 0; c < Ct; c++)
            wc.f[v * Ct + c] = c < C ? w.f[v * C + c] : b.f[v * R + c - C];
    for (int capped = 0; capped < 2; capped++) {
        float cap = capped ? 2.0f : 0.0f;
        float *st = calloc((size_t)(6 * N), 4), *dx = calloc((size_t)(N * C), 4), *du = calloc((size_t)(N * R), 4);
        float *db = calloc((size_t)(V * R), 4), *dxc = calloc((size_t)(N * Ct), 4), *dwc = calloc((size_t)(V * Ct), 4);
        double *want = dalloc(V * Ct);
        for (int h = 0; h < 2; h++) {
            int64_t v0 = h * Vh;
            struct am_tensor tx = tview(&x, N, C, 0, 0), tu = tview(&u, N, R, 0, 0), txc = tview(&xc, N, Ct, 0, 0);
            struct am_tensor tw = f32v(w.f + v0 * C, Vh, C, 0, 0), tb = f32v(b.f + v0 * R, Vh, R, 0, 0);
            struct am_tensor twc = f32v(wc.f + v0 * Ct, Vh, Ct, 0, 0);
            struct am_tensor tm = f32v(st, N, 0, 0, 0), ts = f32v(st + N, N, 0, 0, 0), tt = f32v(st + 2 * N, N, 0, 0, 0);
            struct am_tensor tmc = f32v(st + 3 * N, N, 0, 0, 0), tsc = f32v(st + 4 * N, N, 0, 0, 0);
            struct am_tensor ttc = f32v(st + 5 * N, N, 0, 0, 0);
            K->ce_stats_lora(&kdev, &tm, &ts, &tt, &tx, &tw, &tu, &tb, &ttg, v0, cap);
            K->ce_stats_softcap(&kdev, &tmc, &tsc, &ttc, &txc, &twc, &ttg, v0, cap);
            for (int k = 0; k < 3; k++) {
                for (int64_t i = 0; i < N; i++)
                    want[i] = st[(3 + k) * N + i];
                expect_close_norm(k == 0 ? "ce_stats_lora m" : k == 1 ? "ce_stats_lora s" : "ce_stats_lora t",
                                  st + k * N, want, N, 1e-5, 1e-6);
            }
            struct am_tensor tdx = f32v(dx, N, C, 0, 0), tdu = f32v(du, N, R, 0, 0), tdb = f32v(db + v0 * R, Vh, R, 0, 0);
            struct am_tensor tdxc = f32v(dxc, N, Ct, 0, 0), tdwc = f32v(dwc + v0 * Ct, Vh, Ct, 0, 0);
            K->ce_backward_lora(&kdev, &tdx, NULL, &tdu, &tdb, &tx, &tw, &tu, &tb, &ttg, v0, &tmc, &tsc, scale, cap);
            K->ce_backward_softcap(&kdev, &tdxc, &tdwc, &txc, &twc, &ttg, v0, &tmc, &tsc, scale, cap);
        }
        for (int64_t i = 0; i < N * C; i++)
            want[i] = dxc[i / C * Ct + i % C];
        expect_close_norm("ce_backward_lora dx", dx, want, N * C, 1e-5, 0);
        for (int64_t i = 0; i < N * R; i++)
            want[i] = dxc[i / R * Ct + C + i % R];
        expect_close_norm("ce_backward_lora du", du, want, N * R, 1e-5, 0);
        for (int64_t i = 0; i < V * R; i++)
            want[i] = dwc[i / R * Ct + C + i % R];
        expect_close_norm("ce_backward_lora db", db, want, V * R, 1e-5, 0);
        free(want);
        free(st);
        free(dx);
        free(du);
        free(db);
        free(dxc);
        free(dwc);
    }
    /* bf16 against fp32 on the widened values */
    for (int chunked = 0; chunked < 2; chunked++) {
        am_cpu_set_chunk(&kdev, chunked ? 256 * C : 0); /* vocabulary in 3 chunks, combined as shards */
        struct bt hx = bt_rand(&r, N * C, -2, 2), hw = bt_rand(&r, V * C, -1, 1), hu = bt_rand(&r, N * R, -1, 1);
        struct bt hb = bt_rand(&r, V * R, -1, 1), hdx = bt_rand(&r, N * C, -1, 1), hdu = bt_rand(&r, N * R, -1, 1);
        struct am_tensor tx = hv(&hx, N, C, 0, 0), tw = hv(&hw, V, C, 0, 0), tu = hv(&hu, N, R, 0, 0);
        struct am_tensor tb = hv(&hb, V, R, 0, 0), txf = fv(&hx, N, C, 0, 0), twf = fv(&hw, V, C, 0, 0);
        struct am_tensor tuf = fv(&hu, N, R, 0, 0), tbf = fv(&hb, V, R, 0, 0);
        float *st = calloc((size_t)(6 * N), 4), *db = calloc((size_t)(V * R), 4), *dbf = calloc((size_t)(V * R), 4);
        struct am_tensor tm = f32v(st, N, 0, 0, 0), ts = f32v(st + N, N, 0, 0, 0), tt = f32v(st + 2 * N, N, 0, 0, 0);
        struct am_tensor tmf = f32v(st + 3 * N, N, 0, 0, 0), tsf = f32v(st + 4 * N, N, 0, 0, 0);
        struct am_tensor ttf = f32v(st + 5 * N, N, 0, 0, 0);
        K->ce_stats_lora(&kdev, &tm, &ts, &tt, &tx, &tw, &tu, &tb, &ttg, 0, 0.0f);
        K->ce_stats_lora(&kdev, &tmf, &tsf, &ttf, &txf, &twf, &tuf, &tbf, &ttg, 0, 0.0f);
        expect_mixed("bf16 ce_stats_lora m", st, st + 3 * N, N);
        expect_mixed("bf16 ce_stats_lora s", st + N, st + 4 * N, N);
        expect_mixed("bf16 ce_stats_lora t", st + 2 * N, st + 5 * N, N);
        struct am_tensor tdx = hv(&hdx, N, C, 0, 0), tdu = hv(&hdu, N, R, 0, 0), tdxf = fv(&hdx, N, C, 0, 0);
        struct am_tensor tduf = fv(&hdu, N, R, 0, 0), tdb = f32v(db, V, R, 0, 0), tdbf = f32v(dbf, V, R, 0, 0);
        K->ce_backward_lora(&kdev, &tdx, NULL, &tdu, &tdb, &tx, &tw, &tu, &tb, &ttg, 0, &tmf, &tsf, scale, 0.0f);
        K->ce_backward_lora(&kdev, &tdxf, NULL, &tduf, &tdbf, &txf, &twf, &tuf, &tbf, &ttg, 0, &tmf, &tsf, scale, 0.0f);
        expect_bf16("bf16 ce_backward_lora dx", hdx.h, hdx.f, N * C);
        expect_bf16("bf16 ce_backward_lora du", hdu.h, hdu.f, N * R);
        expect_mixed("bf16 ce_backward_lora db (f32, mixed)", db, dbf, V * R);
        free(st);
        free(db);
        free(dbf);
        struct bt *all[] = {&hx, &hw, &hu, &hb, &hdx, &hdu};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            bt_free(all[i]);
    }
    am_cpu_set_chunk(&kdev, 0);
    struct arr *all[] = {&x, &w, &u, &b, &xc, &wc};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        arr_free(all[i]);
    free(tg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cross_entropy),
        cmocka_unit_test(test_bf16_cross_entropy),
        cmocka_unit_test(test_lora_cross_entropy),
    };
    return cmocka_run_group_tests_name("kernels (cpu): crossentropy", tests, kernels_test_setup, NULL);
}
