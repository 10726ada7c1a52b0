/* test_moe.c - the CPU kernels' tests (kernels_test.h: how they are tested): the mixture of
 * experts: routing, the auxiliary loss, permutation, combination, grouped GEMMs.
 */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels_test.h"

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
        K->moe_aux_stats(&kdev, &tcn, &tps, &tp, &ti, false);
        K->moe_aux_stats(&kdev, &tcn, &tps, &tp, &ti, false); /* accumulates: twice the counts */
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

/* DeepSeekMoE's router (glm4_moe) in double with the experts chosen fixed (idx): the sigmoid
 * scores, the chosen weights (renormalised or not, times scale) and L = Σ wts ⊙ R, plus with cnt
 * AutoModel's load-balancing term aux Σ_e cnt_e Σ_i q_ie (q = p / (Σ_e p + 1e-20) when renorm,
 * else p), whose gradient moe_route_sigmoid_backward computes (dwts = R). */
struct sig_ctx {
    double *logits, *R, *p, *w;
    const int32_t *idx;
    int64_t N, E, k;
    bool renorm;
    double scale;
    const double *cnt;
    double aux;
};

static double sig_loss(void *q)
{
    struct sig_ctx *c = q;
    double L = 0.0;
    for (int64_t i = 0; i < c->N; i++) {
        double ts = 1e-20;
        for (int64_t e = 0; e < c->E; e++)
            c->p[i * c->E + e] = 1.0 / (1.0 + exp(-c->logits[i * c->E + e]));
        for (int64_t j = 0; j < c->k; j++)
            ts += c->p[i * c->E + c->idx[i * c->k + j]];
        for (int64_t j = 0; j < c->k; j++) {
            double w = c->p[i * c->E + c->idx[i * c->k + j]];
            c->w[i * c->k + j] = (c->renorm ? w / ts : w) * c->scale;
            if (c->R)
                L += c->w[i * c->k + j] * c->R[i * c->k + j];
        }
        double all = 1e-20;
        for (int64_t e = 0; c->cnt && e < c->E; e++)
            all += c->p[i * c->E + e];
        for (int64_t e = 0; c->cnt && e < c->E; e++)
            L += c->aux * c->cnt[e] * (c->renorm ? c->p[i * c->E + e] / all : c->p[i * c->E + e]);
    }
    return L;
}

static int cmp_desc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void test_moe_route_sigmoid(void **state)
{
    (void)state;
    struct rng r = {67};
    struct {
        int64_t N, E, k;
        int groups, kept;
        bool renorm;
        float scale;
    } cases[] = {{29, 8, 2, 4, 2, true, 2.5f}, {17, 6, 3, 1, 1, false, 1.0f}, {11, 12, 2, 3, 1, true, 1.0f}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t N = cases[c].N, E = cases[c].E, k = cases[c].k, G = E / cases[c].groups;
        struct arr lg = arr_rand(&r, N * E, -3, 3), b = arr_rand(&r, E, -0.2, 0.2), p = arr_new(N * E);
        struct arr w = arr_new(N * k);
        int32_t *idx = calloc((size_t)(N * k), sizeof(int32_t));
        struct am_tensor tl = tview(&lg, N, E, 0, 0), tp = tview(&p, N, E, 0, 0), tw = tview(&w, N, k, 0, 0);
        struct am_tensor tb = tview(&b, E, 0, 0, 0), ti = am_tensor_view(idx, AM_DEV_CPU, AM_I32, N, k, 0, 0);
        K->moe_route_sigmoid_forward(&kdev, &tp, &ti, &tw, &tl, &tb, cases[c].groups, cases[c].kept, cases[c].renorm,
                                     cases[c].scale);
        /* the choice: the kept groups (the sum of their two best biased scores), then the k best
         * biased scores among their experts, in descending order */
        for (int64_t i = 0; i < N; i++) {
            double ch[16], gs[16], sorted[16], cand[16];
            for (int64_t e = 0; e < E; e++)
                ch[e] = 1.0 / (1.0 + exp(-lg.d[i * E + e])) + b.d[e];
            for (int g = 0; g < cases[c].groups; g++) {
                memcpy(sorted, ch + g * G, (size_t)G * sizeof(double));
                qsort(sorted, (size_t)G, sizeof(double), cmp_desc);
                gs[g] = sorted[0] + sorted[1];
            }
            memcpy(sorted, gs, (size_t)cases[c].groups * sizeof(double));
            qsort(sorted, (size_t)cases[c].groups, sizeof(double), cmp_desc);
            double cut = sorted[cases[c].kept - 1];
            int64_t n = 0;
            for (int64_t e = 0; e < E; e++)
                if (gs[e / G] >= cut)
                    cand[n++] = ch[e];
            qsort(cand, (size_t)n, sizeof(double), cmp_desc);
            for (int64_t j = 0; j < k; j++) {
                int32_t e = idx[i * k + j];
                assert_true(e >= 0 && e < E);
                assert_true(fabs(ch[e] - cand[j]) < 1e-6);
            }
        }
        struct sig_ctx ctx = {lg.d, NULL, dalloc(N * E), dalloc(N * k), idx, N, E, k, cases[c].renorm, cases[c].scale,
                              NULL, 0.0};
        sig_loss(&ctx);
        double *tol = dalloc(N * E);
        for (int64_t i = 0; i < N * E; i++)
            tol[i] = 8 * U * ctx.p[i];
        expect_close("moe sigmoid route scores", p.f, ctx.p, tol, N * E);
        for (int64_t i = 0; i < N * k; i++)
            tol[i] = (double)(k + 12) * U * ctx.w[i];
        expect_close("moe sigmoid route weights", w.f, ctx.w, tol, N * k);

        /* backward: dwts = R onto a random start, against finite differences */
        struct arr R = arr_rand(&r, N * k, -1, 1), dl = arr_rand(&r, N * E, -1, 1), dl0 = arr_copy(&dl);
        struct am_tensor tR = tview(&R, N, k, 0, 0), tdl = tview(&dl, N, E, 0, 0);
        K->moe_route_sigmoid_backward(&kdev, &tdl, &tR, &tp, &ti, NULL, 0.0f, cases[c].renorm, cases[c].scale);
        ctx.R = R.d;
        double *fd = dalloc(N * E), *tl_ = dalloc(N * E);
        fd_grad(sig_loss, &ctx, lg.d, N * E, fd);
        for (int64_t i = 0; i < N * E; i++)
            tl_[i] = (double)(4 * k + 16) * U * (1.0 + fabs(dl0.d[i]) + cases[c].scale);
        expect_fd("moe sigmoid route backward vs finite differences", dl.f, dl0.d, fd, tl_, N * E);
        /* AutoModel's load-balancing loss: the (normalised) scores' sums, and their gradient */
        struct arr cn = arr_new(E), ps = arr_new(E), dl2 = arr_rand(&r, N * E, -1, 1), dl20 = arr_copy(&dl2);
        struct am_tensor tcn = tview(&cn, E, 0, 0, 0), tps = tview(&ps, E, 0, 0, 0), tdl2 = tview(&dl2, N, E, 0, 0);
        K->zero(&kdev, &tcn);
        K->zero(&kdev, &tps);
        K->moe_aux_stats(&kdev, &tcn, &tps, &tp, &ti, cases[c].renorm);
        double *want_ps = dalloc(E), *want_cn = dalloc(E);
        for (int64_t i = 0; i < N; i++) {
            double all = 1e-20;
            for (int64_t e = 0; e < E; e++)
                all += ctx.p[i * E + e];
            for (int64_t e = 0; e < E; e++)
                want_ps[e] += cases[c].renorm ? ctx.p[i * E + e] / all : ctx.p[i * E + e];
            for (int64_t j = 0; j < k; j++)
                want_cn[idx[i * k + j]] += 1.0;
        }
        for (int64_t e = 0; e < E; e++)
            tol[e] = (double)(N + E + 8) * U * want_ps[e];
        expect_close("moe aux stats score sums", ps.f, want_ps, tol, E);
        for (int64_t e = 0; e < E; e++)
            assert_true(cn.f[e] == (float)want_cn[e]);
        K->moe_route_sigmoid_backward(&kdev, &tdl2, &tR, &tp, &ti, &tcn, 0.3f, cases[c].renorm, cases[c].scale);
        ctx.cnt = want_cn;
        ctx.aux = (double)0.3f;
        fd_grad(sig_loss, &ctx, lg.d, N * E, fd);
        for (int64_t i = 0; i < N * E; i++)
            tl_[i] = (double)(4 * k + 4 * E + 16) * U * (1.0 + fabs(dl20.d[i]) + cases[c].scale + (double)N * k);
        expect_fd("moe sigmoid route backward with the aux loss vs finite differences", dl2.f, dl20.d, fd, tl_, N * E);
        ctx.cnt = NULL;
        free(want_ps);
        free(want_cn);
        arr_free(&cn);
        arr_free(&ps);
        arr_free(&dl2);
        arr_free(&dl20);
        free(fd);
        free(tl_);
        free(tol);
        free(ctx.p);
        free(ctx.w);
        free(idx);
        struct arr *all[] = {&lg, &b, &p, &w, &R, &dl, &dl0};
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

/* grouped_matmul's rows: y (and dy, dx) must have a row per row of x, the counts' sum (a
 * caller's bug would otherwise write past y) */
static void grouped_rows_call(int which)
{
    float a[40] = {0}, b[64] = {0}, c[20] = {0};
    int64_t counts[2] = {3, 2};
    struct am_tensor x = am_tensor_view(a, AM_DEV_CPU, AM_F32, 5, 8, 0, 0);
    struct am_tensor w = am_tensor_view(b, AM_DEV_CPU, AM_F32, 2, 4, 8, 0);
    struct am_tensor y = am_tensor_view(c, AM_DEV_CPU, AM_F32, 4, 4, 0, 0); /* 4 rows, 5 wanted */
    struct am_tensor dy = am_tensor_view(c, AM_DEV_CPU, AM_F32, 5, 4, 0, 0);
    struct am_tensor dx = am_tensor_view(a, AM_DEV_CPU, AM_F32, 3, 8, 0, 0); /* 3 rows */
    y.name = "model.layers.0.mlp.experts.h";
    dx.name = "model.layers.0.mlp.experts.dx";
    if (which == 0)
        K->grouped_matmul_forward(&kdev, &y, &x, &w, counts);
    else if (which == 1)
        K->grouped_matmul_backward(&kdev, NULL, NULL, &y, &x, &w, counts);
    else
        K->grouped_matmul_backward(&kdev, &dx, NULL, &dy, &x, &w, counts);
}

static void test_grouped_rows_abort(void **state)
{
    (void)state;
    const char *want[][2] = {
        {"am_cpu_grouped_matmul_forward", "y (model.layers.0.mlp.experts.h) has 4 rows; the experts' counts add up to 5"},
        {"am_cpu_grouped_matmul_backward", "dy (model.layers.0.mlp.experts.h) has 4 rows; the experts' counts add up to 5"},
        {"am_cpu_grouped_matmul_backward", "dx (model.layers.0.mlp.experts.dx) has 3 rows; the experts' counts add up to 5"},
    };
    for (int c = 0; c < 3; c++)
        expect_abort(grouped_rows_call, c, want[c], 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_moe_route),
        cmocka_unit_test(test_moe_route_sigmoid),
        cmocka_unit_test(test_moe_dispatch),
        cmocka_unit_test(test_grouped_rows_abort),
    };
    return cmocka_run_group_tests_name("kernels (cpu): moe", tests, kernels_test_setup, NULL);
}
