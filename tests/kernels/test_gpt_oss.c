/* test_gpt_oss.c - the CPU kernels' tests (kernels_test.h: how they are tested): gpt-oss's
 * attention sinks (composed with the attention kernels as the model composes them: forward,
 * then the sinks; the attention backward on the sinks' out and lse, then the sinks' backward)
 * and its clamped SwiGLU, against references in double and finite differences. */
#include "kernels_test.h"

/* ---- attention with sinks: GptOssAttention's eager softmax over [scores | sink] ---- */

struct sink_ctx {
    double *q, *k, *v, *s, *R;
    int64_t B, T, H, KVH, D, W;
};

/* out [B, T, H, D] of the reference (double) */
static void sink_ref(const struct sink_ctx *c, double *out)
{
    int64_t B = c->B, T = c->T, H = c->H, KVH = c->KVH, D = c->D;
    double scale = 1.0 / sqrt((double)D), *p = dalloc(T + 1);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            int64_t kh = h / (H / KVH);
            for (int64_t t = 0; t < T; t++) {
                int64_t lo = c->W > 0 && t - c->W + 1 > 0 ? t - c->W + 1 : 0;
                double m = c->s[h];
                for (int64_t j = lo; j <= t; j++) {
                    double a = 0.0;
                    for (int64_t i = 0; i < D; i++)
                        a += c->q[((b * T + t) * H + h) * D + i] * c->k[((b * T + j) * KVH + kh) * D + i];
                    p[j] = a * scale;
                    m = p[j] > m ? p[j] : m;
                }
                double l = exp(c->s[h] - m);
                for (int64_t j = lo; j <= t; j++)
                    l += p[j] = exp(p[j] - m);
                for (int64_t i = 0; i < D; i++) {
                    double o = 0.0;
                    for (int64_t j = lo; j <= t; j++)
                        o += p[j] / l * c->v[((b * T + j) * KVH + kh) * D + i];
                    out[((b * T + t) * H + h) * D + i] = o;
                }
            }
        }
    free(p);
}

static double sink_loss(void *p)
{
    struct sink_ctx *c = p;
    int64_t n = c->B * c->T * c->H * c->D;
    double *out = dalloc(n), L = 0.0;
    sink_ref(c, out);
    for (int64_t i = 0; i < n; i++)
        L += out[i] * c->R[i];
    free(out);
    return L;
}

static void test_attention_sinks(void **state)
{
    (void)state;
    struct rng r = {2808};
    int64_t windows[] = {0, 3};
    for (int w = 0; w < 2; w++) {
        int64_t B = 2, T = 7, H = 4, KVH = 2, D = 8, nq = B * T * H * D, nk = B * T * KVH * D;
        struct arr q = arr_rand(&r, nq, -1, 1), k = arr_rand(&r, nk, -1, 1), v = arr_rand(&r, nk, -1, 1);
        struct arr s = arr_rand(&r, H, -2, 2), out = arr_new(nq), lse = arr_new(B * H * T);
        s.f[0] = 30.0f; /* a sink that takes nearly all the weight */
        s.d[0] = 30.0;
        struct am_tensor tq = tview(&q, B, T, H, D), tk = tview(&k, B, T, KVH, D), tv = tview(&v, B, T, KVH, D);
        struct am_tensor to = tview(&out, B, T, H, D), tl = tview(&lse, B, H, T, 0), ts = tview(&s, H, 0, 0, 0);
        K->attention_forward(&kdev, &to, &tl, &tq, &tk, &tv, windows[w]);
        K->attention_sink_forward(&kdev, &to, &tl, &ts);
        struct arr R = arr_rand(&r, nq, -1, 1);
        struct sink_ctx c = {q.d, k.d, v.d, s.d, R.d, B, T, H, KVH, D, windows[w]};
        double *want = dalloc(nq);
        sink_ref(&c, want);
        expect_close_norm("attention with sinks forward", out.f, want, nq, 64 * (D + T) * U, 0);

        /* backward: the attention's on the sinks' out and lse, then the sinks' */
        struct arr dq = arr_rand(&r, nq, -1, 1), dk = arr_rand(&r, nk, -1, 1), dv = arr_rand(&r, nk, -1, 1);
        struct arr ds = arr_rand(&r, H, -1, 1);
        struct arr dq0 = arr_copy(&dq), dk0 = arr_copy(&dk), dv0 = arr_copy(&dv), ds0 = arr_copy(&ds);
        struct am_tensor tdq = tview(&dq, B, T, H, D), tdk = tview(&dk, B, T, KVH, D), tdv = tview(&dv, B, T, KVH, D);
        struct am_tensor tds = tview(&ds, H, 0, 0, 0), tR = tview(&R, B, T, H, D);
        K->attention_backward(&kdev, &tdq, &tdk, &tdv, &tR, &to, &tl, &tq, &tk, &tv, windows[w]);
        K->attention_sink_backward(&kdev, &tds, &tR, &to, &tl, &ts);
        struct {
            const char *what;
            struct arr *g, *g0;
            double *p;
            int64_t n;
        } cases[] = {{"attention with sinks dq vs finite differences", &dq, &dq0, q.d, nq},
                     {"attention with sinks dk vs finite differences", &dk, &dk0, k.d, nk},
                     {"attention with sinks dv vs finite differences", &dv, &dv0, v.d, nk},
                     {"attention with sinks dsinks vs finite differences", &ds, &ds0, s.d, H}};
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
            int64_t n = cases[i].n;
            double *fd = dalloc(n), *tol = dalloc(n);
            fd_grad(sink_loss, &c, cases[i].p, n, fd);
            double big = max_abs(fd, n);
            for (int64_t j = 0; j < n; j++)
                tol[j] = 64 * (D + T) * U * (big + 1.0) + 1e-8;
            expect_fd(cases[i].what, cases[i].g->f, cases[i].g0->d, fd, tol, n);
            free(fd);
            free(tol);
        }
        free(want);
        struct arr *all[] = {&q, &k, &v, &s, &out, &lse, &R, &dq, &dk, &dv, &ds, &dq0, &dk0, &dv0, &ds0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* ---- the clamped SwiGLU (GptOssExperts._apply_gate) ---- */

#define ALPHA 1.702
#define LIMIT 7.0

static double clamped(double g, double u)
{
    g = g > LIMIT ? LIMIT : g;
    u = u > LIMIT ? LIMIT : u < -LIMIT ? -LIMIT : u;
    return (u + 1.0) * g / (1.0 + exp(-(double)(float)ALPHA * g));
}

struct glu_ctx {
    double *g, *u, *R;
    int64_t n;
};

static double glu_loss(void *p)
{
    struct glu_ctx *c = p;
    double L = 0.0;
    for (int64_t i = 0; i < c->n; i++)
        L += clamped(c->g[i], c->u[i]) * c->R[i];
    return L;
}

static void test_swiglu_clamped(void **state)
{
    (void)state;
    struct rng r = {1702};
    int64_t n = 200;
    struct arr g = arr_rand(&r, n, -10, 10), u = arr_rand(&r, n, -10, 10), out = arr_new(n);
    struct am_tensor tg = tview(&g, n, 0, 0, 0), tu = tview(&u, n, 0, 0, 0), to = tview(&out, n, 0, 0, 0);
    K->swiglu_clamped_forward(&kdev, &to, &tg, &tu, (float)ALPHA, (float)LIMIT);
    double *want = dalloc(n), *tol = dalloc(n);
    for (int64_t i = 0; i < n; i++) {
        want[i] = clamped(g.d[i], u.d[i]);
        tol[i] = 16 * U * (fabs(want[i]) + 8 * fabs(g.d[i])) + 1e-30;
    }
    expect_close("clamped swiglu forward", out.f, want, tol, n);
    struct arr dout = arr_rand(&r, n, -1, 1), dg = arr_rand(&r, n, -1, 1), du = arr_rand(&r, n, -1, 1);
    struct arr dg0 = arr_copy(&dg), du0 = arr_copy(&du);
    struct am_tensor tdo = tview(&dout, n, 0, 0, 0), tdg = tview(&dg, n, 0, 0, 0), tdu = tview(&du, n, 0, 0, 0);
    K->swiglu_clamped_backward(&kdev, &tdg, &tdu, &tdo, &tg, &tu, (float)ALPHA, (float)LIMIT);
    struct glu_ctx c = {g.d, u.d, dout.d, n};
    double *fd = dalloc(n), *tg_ = dalloc(n);
    for (int64_t i = 0; i < n; i++) /* no input within 1e-3 of a clamp's end: the differences are exact there */
        tg_[i] = 64 * U * (1.0 + 8 * fabs(g.d[i])) * (fabs(u.d[i]) + 1.0) + 1e-6;
    fd_grad(glu_loss, &c, g.d, n, fd);
    expect_fd("clamped swiglu dgate vs finite differences", dg.f, dg0.d, fd, tg_, n);
    fd_grad(glu_loss, &c, u.d, n, fd);
    expect_fd("clamped swiglu dup vs finite differences", du.f, du0.d, fd, tg_, n);
    free(want);
    free(tol);
    free(fd);
    free(tg_);
    struct arr *all[] = {&g, &u, &out, &dout, &dg, &du, &dg0, &du0};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        arr_free(all[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_sinks),
        cmocka_unit_test(test_swiglu_clamped),
    };
    return cmocka_run_group_tests_name("kernels (cpu): gpt-oss", tests, kernels_test_setup, NULL);
}
