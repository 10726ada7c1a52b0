/* test_gemma_kernels.c - the kernels Gemma 2 and Gemma 3 add (kernels.h: rmsnorm_offset, geglu,
 * attention_softcap, ce_stats_softcap / ce_backward_softcap) on the CPU, against references
 * written here in double from the same fp32 inputs, and every backward against central finite
 * differences of L = Σ out ⊙ R on the double reference (as the other tests/kernels/test_*.c,
 * kernels_test.h).
 *
 * Tolerances are normwise, rel * max|reference| + a floor, with rel a small multiple of fp32's
 * unit roundoff u = 2^-24 times the length of the longest sum (stated at each check); a wrong
 * index, sign, scale, cap or window gives errors of order 1. With the cap and the scale at
 * their "none" values the new entry points must give the old kernels' bits exactly.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "kernels.h"

#define U 5.9604644775390625e-08 /* 2^-24 */

static struct am_dev kdev;
static const struct am_kernels *K;

struct rng {
    uint64_t s;
};

static double urand(struct rng *r, double lo, double hi)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    uint64_t v = r->s * 2685821657736338717ull;
    return lo + (hi - lo) * (double)(v >> 11) * (1.0 / 9007199254740992.0);
}

/* fp32 values and their exact double copy */
struct arr {
    float *f;
    double *d;
    int64_t n;
};

static struct arr arr_rand(struct rng *r, int64_t n, double lo, double hi)
{
    struct arr a = {calloc((size_t)n, sizeof(float)), calloc((size_t)n, sizeof(double)), n};
    assert_non_null(a.f);
    assert_non_null(a.d);
    for (int64_t i = 0; i < n; i++) {
        a.f[i] = (float)urand(r, lo, hi);
        a.d[i] = a.f[i];
    }
    return a;
}

static void arr_free(struct arr *a)
{
    free(a->f);
    free(a->d);
}

static struct am_tensor tv(void *p, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(p, AM_DEV_CPU, AM_F32, d0, d1, d2, d3);
}

static double max_abs(const double *x, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs(x[i]));
    return m;
}

/* |got - want| <= rel * max|want| + abs for all (NaN fails) */
static void expect_close(const char *what, const float *got, const double *want, int64_t n, double rel, double abs_tol)
{
    double tol = rel * max_abs(want, n) + abs_tol, worst = 0;
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]);
        if (!(e <= worst)) {
            worst = e;
            at = i;
        }
    }
    if (getenv("AM_TEST_VERBOSE"))
        printf("    %-48s n=%-6lld worst err/tol %.2e\n", what, (long long)n, worst / tol);
    if (!(worst <= tol)) {
        print_error("%s: element %lld: got %.9g want %.9g (|err| %.3g > tol %.3g)\n", what, (long long)at,
                    (double)got[at], want[at], worst, tol);
        fail();
    }
}

typedef double (*loss_fn)(void *ctx);

/* central differences of loss with respect to p[0..n) */
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

/* ---- RMSNorm with the weight 1 + w ---- */

struct rms_ctx {
    double *x, *w, *R;
    int64_t N, C;
    double eps;
};

static double rms_ref(struct rms_ctx *c, double *out)
{
    double L = 0;
    for (int64_t i = 0; i < c->N; i++) {
        double ss = 0;
        for (int64_t j = 0; j < c->C; j++)
            ss += c->x[i * c->C + j] * c->x[i * c->C + j];
        double r = 1.0 / sqrt(ss / (double)c->C + c->eps);
        for (int64_t j = 0; j < c->C; j++) {
            double o = c->x[i * c->C + j] * r * (1.0 + c->w[j]);
            if (out)
                out[i * c->C + j] = o;
            L += o * c->R[i * c->C + j];
        }
    }
    return L;
}

static double rms_loss(void *p) { return rms_ref(p, NULL); }

static void test_rmsnorm_offset(void **state)
{
    (void)state;
    struct rng r = {31};
    int64_t N = 6, C = 40;
    struct arr x = arr_rand(&r, N * C, -2, 2), w = arr_rand(&r, C, -0.5, 0.5), R = arr_rand(&r, N * C, -1, 1);
    float *out = calloc((size_t)(N * C), sizeof(float)), rstd[6];
    double *want = calloc((size_t)(N * C), sizeof(double));
    struct am_tensor tx = tv(x.f, N, C, 0, 0), tw = tv(w.f, C, 0, 0, 0), to = tv(out, N, C, 0, 0), tr = tv(rstd, N, 0, 0, 0);
    struct rms_ctx ctx = {x.d, w.d, R.d, N, C, 1e-6};
    K->rmsnorm_offset_forward(&kdev, &to, &tr, &tx, &tw, 1e-6f);
    rms_ref(&ctx, want);
    /* a sum of C squares (in double), then three roundings per element */
    expect_close("rmsnorm_offset forward", out, want, N * C, 8 * U, 0);

    /* backward: dx, dw accumulate onto random starts */
    struct arr dx = arr_rand(&r, N * C, -1, 1), dw = arr_rand(&r, C, -1, 1);
    double *sx = calloc((size_t)(N * C), sizeof(double)), *sw = calloc((size_t)C, sizeof(double));
    memcpy(sx, dx.d, (size_t)(N * C) * sizeof(double));
    memcpy(sw, dw.d, (size_t)C * sizeof(double));
    struct am_tensor tdx = tv(dx.f, N, C, 0, 0), tdw = tv(dw.f, C, 0, 0, 0), tR = tv(R.f, N, C, 0, 0);
    K->rmsnorm_offset_backward(&kdev, &tdx, &tdw, &tR, &tx, &tw, &tr);
    double *fd = calloc((size_t)(N * C), sizeof(double));
    fd_grad(rms_loss, &ctx, x.d, N * C, fd);
    for (int64_t i = 0; i < N * C; i++)
        fd[i] += sx[i];
    /* sums of C products per row: C u of their magnitude, plus the differences' 1e-7 */
    expect_close("rmsnorm_offset dx vs finite differences", dx.f, fd, N * C, 4 * C * U + 1e-7, 1e-7);
    fd_grad(rms_loss, &ctx, w.d, C, fd);
    for (int64_t j = 0; j < C; j++)
        fd[j] += sw[j];
    expect_close("rmsnorm_offset dw vs finite differences", dw.f, fd, C, 4 * N * U + 1e-7, 1e-7);

    /* the same as rmsnorm with the weight 1 + w, bit for bit (what it is defined as) */
    float w1[40], out2[240], rstd2[6];
    for (int64_t j = 0; j < C; j++)
        w1[j] = 1.0f + w.f[j];
    struct am_tensor tw1 = tv(w1, C, 0, 0, 0), to2 = tv(out2, N, C, 0, 0), tr2 = tv(rstd2, N, 0, 0, 0);
    K->rmsnorm_forward(&kdev, &to2, &tr2, &tx, &tw1, 1e-6f);
    assert_memory_equal(out, out2, sizeof(out2));

    /* bf16: x, w, out bf16; the output rounded once from the fp32 result */
    uint16_t xb[240], wb[40], ob[240];
    float wantb[240];
    for (int64_t i = 0; i < N * C; i++)
        xb[i] = am_f32_to_bf16(x.f[i]);
    for (int64_t j = 0; j < C; j++)
        wb[j] = am_f32_to_bf16(w.f[j]);
    struct am_tensor bx = am_tensor_view(xb, AM_DEV_CPU, AM_BF16, N, C, 0, 0);
    struct am_tensor bw = am_tensor_view(wb, AM_DEV_CPU, AM_BF16, C, 0, 0, 0);
    struct am_tensor bo = am_tensor_view(ob, AM_DEV_CPU, AM_BF16, N, C, 0, 0);
    K->rmsnorm_offset_forward(&kdev, &bo, &tr, &bx, &bw, 1e-6f);
    float xf[240], wf[40];
    for (int64_t i = 0; i < N * C; i++)
        xf[i] = am_bf16_to_f32(xb[i]);
    for (int64_t j = 0; j < C; j++)
        wf[j] = am_bf16_to_f32(wb[j]);
    struct am_tensor fx = tv(xf, N, C, 0, 0), fw = tv(wf, C, 0, 0, 0), fo = tv(wantb, N, C, 0, 0);
    K->rmsnorm_offset_forward(&kdev, &fo, &tr2, &fx, &fw, 1e-6f);
    for (int64_t i = 0; i < N * C; i++)
        assert_int_equal(ob[i], am_f32_to_bf16(wantb[i]));
    free(out);
    free(want);
    free(sx);
    free(sw);
    free(fd);
    struct arr *all[] = {&x, &w, &R, &dx, &dw};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        arr_free(all[i]);
}

/* ---- GeGLU ---- */

static double gelu_tanh(double g) { return 0.5 * g * (1.0 + tanh(sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g))); }

struct geglu_ctx {
    double *g, *u, *R;
    int64_t n;
};

static double geglu_loss(void *p)
{
    struct geglu_ctx *c = p;
    double L = 0;
    for (int64_t i = 0; i < c->n; i++)
        L += gelu_tanh(c->g[i]) * c->u[i] * c->R[i];
    return L;
}

static void test_geglu(void **state)
{
    (void)state;
    struct rng r = {37};
    int64_t n = 257;
    struct arr g = arr_rand(&r, n, -6, 6), u = arr_rand(&r, n, -2, 2), R = arr_rand(&r, n, -1, 1);
    float *out = calloc((size_t)n, sizeof(float));
    double *want = calloc((size_t)n, sizeof(double)), *fd = calloc((size_t)n, sizeof(double));
    struct am_tensor tg = tv(g.f, n, 0, 0, 0), tu = tv(u.f, n, 0, 0, 0), to = tv(out, n, 0, 0, 0);
    K->geglu_forward(&kdev, &to, &tg, &tu);
    for (int64_t i = 0; i < n; i++)
        want[i] = gelu_tanh(g.d[i]) * u.d[i];
    /* tanhf (a few ulp) and about eight roundings, where 1 + tanh cancels for g << 0 */
    expect_close("geglu forward", out, want, n, 16 * U, 1e-7);
    struct arr dg = arr_rand(&r, n, -1, 1), du = arr_rand(&r, n, -1, 1);
    double *sg = calloc((size_t)n, sizeof(double)), *su = calloc((size_t)n, sizeof(double));
    memcpy(sg, dg.d, (size_t)n * sizeof(double));
    memcpy(su, du.d, (size_t)n * sizeof(double));
    struct am_tensor tdg = tv(dg.f, n, 0, 0, 0), tdu = tv(du.f, n, 0, 0, 0), tR = tv(R.f, n, 0, 0, 0);
    K->geglu_backward(&kdev, &tdg, &tdu, &tR, &tg, &tu);
    struct geglu_ctx ctx = {g.d, u.d, R.d, n};
    fd_grad(geglu_loss, &ctx, g.d, n, fd);
    for (int64_t i = 0; i < n; i++)
        fd[i] += sg[i];
    expect_close("geglu dgate vs finite differences", dg.f, fd, n, 32 * U + 1e-7, 1e-7);
    fd_grad(geglu_loss, &ctx, u.d, n, fd);
    for (int64_t i = 0; i < n; i++)
        fd[i] += su[i];
    expect_close("geglu dup vs finite differences", du.f, fd, n, 16 * U + 1e-7, 1e-7);
    /* dgate alone: the same dgate increment again */
    float before[257];
    memcpy(before, dg.f, sizeof(before));
    K->geglu_backward(&kdev, &tdg, NULL, &tR, &tg, &tu);
    for (int64_t i = 0; i < n; i++)
        want[i] = 2.0 * (double)before[i] - sg[i];
    expect_close("geglu dgate alone", dg.f, want, n, 8 * U, 1e-7);
    free(out);
    free(want);
    free(fd);
    free(sg);
    free(su);
    struct arr *all[] = {&g, &u, &R, &dg, &du};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        arr_free(all[i]);
}

/* ---- attention with Gemma's scale and soft-cap ---- */

struct att_ctx {
    double *q, *k, *v, *R;
    int64_t B, T, H, KVH, D, W;
    double scale, cap;
};

static double att_ref(struct att_ctx *c, double *out)
{
    int64_t B = c->B, T = c->T, H = c->H, KVH = c->KVH, D = c->D, G = H / KVH;
    double L = 0, *p = calloc((size_t)T, sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j < T; j++) {
                    bool ok = j <= t && (c->W <= 0 || j > t - c->W);
                    double s = 0;
                    for (int64_t d = 0; d < D; d++)
                        s += c->q[((b * T + t) * H + h) * D + d] * c->k[((b * T + j) * KVH + h / G) * D + d];
                    s *= c->scale;
                    if (c->cap > 0)
                        s = c->cap * tanh(s / c->cap);
                    p[j] = ok ? s : -INFINITY;
                    mx = fmax(mx, p[j]);
                }
                for (int64_t j = 0; j < T; j++)
                    sum += p[j] = exp(p[j] - mx);
                for (int64_t d = 0; d < D; d++) {
                    double o = 0;
                    for (int64_t j = 0; j < T; j++)
                        o += p[j] / sum * c->v[((b * T + j) * KVH + h / G) * D + d];
                    int64_t at = ((b * T + t) * H + h) * D + d;
                    if (out)
                        out[at] = o;
                    L += o * c->R[at];
                }
            }
    free(p);
    return L;
}

static double att_loss(void *p) { return att_ref(p, NULL); }

static void test_attention_softcap(void **state)
{
    (void)state;
    struct rng r = {41};
    int64_t B = 2, T = 11, H = 4, KVH = 2, D = 8, W = 4, nq = B * T * H * D, nk = B * T * KVH * D;
    struct arr q = arr_rand(&r, nq, -2, 2), k = arr_rand(&r, nk, -2, 2), v = arr_rand(&r, nk, -1, 1);
    struct arr R = arr_rand(&r, nq, -1, 1);
    float *out = calloc((size_t)nq, sizeof(float)), *lse = calloc((size_t)(B * H * T), sizeof(float));
    double *want = calloc((size_t)nq, sizeof(double));
    struct am_tensor tq = tv(q.f, B, T, H, D), tk = tv(k.f, B, T, KVH, D), tvv = tv(v.f, B, T, KVH, D);
    struct am_tensor to = tv(out, B, T, H, D), tl = tv(lse, B, H, T, 0), tR = tv(R.f, B, T, H, D);
    float scale = 0.3f, cap = 1.5f; /* scores up to 0.3 * 8 * 4 = 9.6: the cap of 1.5 bites */
    for (int pass = 0; pass < 2; pass++) { /* a sliding window of 4, then plain causal */
        int64_t win = pass == 0 ? W : 0;
        struct att_ctx ctx = {q.d, k.d, v.d, R.d, B, T, H, KVH, D, win, scale, cap};
        K->attention_softcap_forward(&kdev, &to, &tl, &tq, &tk, &tvv, win, scale, cap);
        att_ref(&ctx, want);
        /* dot products of D terms, tanhf, exp and a weighted sum of T values */
        expect_close(pass == 0 ? "attention_softcap forward (window)" : "attention_softcap forward", out, want, nq,
                     8 * (D + T) * U, 0);
        float *dq = calloc((size_t)nq, sizeof(float)), *dk = calloc((size_t)nk, sizeof(float));
        float *dv = calloc((size_t)nk, sizeof(float));
        struct am_tensor tdq = tv(dq, B, T, H, D), tdk = tv(dk, B, T, KVH, D), tdv = tv(dv, B, T, KVH, D);
        K->attention_softcap_backward(&kdev, &tdq, &tdk, &tdv, &tR, &to, &tl, &tq, &tk, &tvv, win, scale, cap);
        double *fd = calloc((size_t)nq, sizeof(double));
        fd_grad(att_loss, &ctx, q.d, nq, fd);
        expect_close("attention_softcap dq vs finite differences", dq, fd, nq, 16 * (D + T) * U + 1e-7, 1e-7);
        fd_grad(att_loss, &ctx, k.d, nk, fd);
        expect_close("attention_softcap dk vs finite differences", dk, fd, nk, 16 * (D + T) * U + 1e-7, 1e-7);
        fd_grad(att_loss, &ctx, v.d, nk, fd);
        expect_close("attention_softcap dv vs finite differences", dv, fd, nk, 16 * (D + T) * U + 1e-7, 1e-7);
        free(fd);
        free(dq);
        free(dk);
        free(dv);
    }
    /* without the cap, with the scale 0 (1 / sqrt(D)): attention_forward, bit for bit */
    float *out2 = calloc((size_t)nq, sizeof(float)), *lse2 = calloc((size_t)(B * H * T), sizeof(float));
    struct am_tensor to2 = tv(out2, B, T, H, D), tl2 = tv(lse2, B, H, T, 0);
    K->attention_softcap_forward(&kdev, &to, &tl, &tq, &tk, &tvv, W, 0.0f, 0.0f);
    K->attention_forward(&kdev, &to2, &tl2, &tq, &tk, &tvv, W);
    assert_memory_equal(out, out2, (size_t)nq * sizeof(float));
    assert_memory_equal(lse, lse2, (size_t)(B * H * T) * sizeof(float));
    /* and the scale alone (Gemma 3): the reference without a cap */
    struct att_ctx plain = {q.d, k.d, v.d, R.d, B, T, H, KVH, D, W, scale, 0};
    K->attention_softcap_forward(&kdev, &to, &tl, &tq, &tk, &tvv, W, scale, 0.0f);
    att_ref(&plain, want);
    expect_close("attention_softcap forward (scale, no cap)", out, want, nq, 8 * (D + T) * U, 0);
    free(out);
    free(lse);
    free(out2);
    free(lse2);
    free(want);
    struct arr *all[] = {&q, &k, &v, &R};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        arr_free(all[i]);
}

/* ---- cross-entropy on capped logits, vocabulary-parallel ---- */

struct ce_ctx {
    double *x, *w;
    const int32_t *tg;
    int64_t N, C, V;
    double cap, scale;
};

static double ce_ref(void *p)
{
    struct ce_ctx *c = p;
    double L = 0;
    for (int64_t i = 0; i < c->N; i++) {
        if (c->tg[i] < 0)
            continue;
        double mx = -INFINITY, *l = calloc((size_t)c->V, sizeof(double)), s = 0;
        for (int64_t v = 0; v < c->V; v++) {
            double z = 0;
            for (int64_t j = 0; j < c->C; j++)
                z += c->x[i * c->C + j] * c->w[v * c->C + j];
            l[v] = c->cap * tanh(z / c->cap);
            mx = fmax(mx, l[v]);
        }
        for (int64_t v = 0; v < c->V; v++)
            s += exp(l[v] - mx);
        L += (log(s) + mx - l[c->tg[i]]) * c->scale;
        free(l);
    }
    return L;
}

static void test_ce_softcap(void **state)
{
    (void)state;
    struct rng r = {43};
    int64_t N = 9, C = 12, V = 30, Vh = V / 2;
    struct arr x = arr_rand(&r, N * C, -1, 1), w = arr_rand(&r, V * C, -1, 1);
    int32_t tg[9] = {3, 29, -1, 0, 17, 15, 14, 8, 22};
    float cap = 2.0f, scale = 0.25f;
    struct ce_ctx ctx = {x.d, w.d, tg, N, C, V, cap, scale};
    /* two vocabulary shards of 15, combined as the model combines tp ranks */
    float m[2][9], s[2][9], t[2][9], M[9], S[9], T[9];
    struct am_tensor tx = tv(x.f, N, C, 0, 0), tt = am_tensor_view(tg, AM_DEV_CPU, AM_I32, N, 0, 0, 0);
    for (int h = 0; h < 2; h++) {
        struct am_tensor tw = tv(w.f + h * Vh * C, Vh, C, 0, 0), tm = tv(m[h], N, 0, 0, 0), ts = tv(s[h], N, 0, 0, 0);
        struct am_tensor tT = tv(t[h], N, 0, 0, 0);
        K->ce_stats_softcap(&kdev, &tm, &ts, &tT, &tx, &tw, &tt, h * Vh, cap);
    }
    for (int64_t i = 0; i < N; i++) {
        M[i] = fmaxf(m[0][i], m[1][i]);
        S[i] = s[0][i] * expf(m[0][i] - M[i]) + s[1][i] * expf(m[1][i] - M[i]);
        T[i] = t[0][i] + t[1][i];
    }
    double acc = 0;
    struct am_tensor ta = am_tensor_view(&acc, AM_DEV_CPU, AM_F64, 1, 0, 0, 0), tM = tv(M, N, 0, 0, 0);
    struct am_tensor tS = tv(S, N, 0, 0, 0), tT = tv(T, N, 0, 0, 0);
    K->ce_loss(&kdev, &ta, &tM, &tS, &tT, &tt);
    double want = ce_ref(&ctx) / scale;
    if (getenv("AM_TEST_VERBOSE"))
        printf("    ce_softcap loss %.9g, reference %.9g\n", acc, want);
    assert_true(fabs(acc - want) <= 64 * (C + V) * U * fabs(want));
    /* backward, per shard, against finite differences of the scaled loss */
    float *dx = calloc((size_t)(N * C), sizeof(float)), *dw = calloc((size_t)(V * C), sizeof(float));
    for (int h = 0; h < 2; h++) {
        struct am_tensor tw = tv(w.f + h * Vh * C, Vh, C, 0, 0), tdx = tv(dx, N, C, 0, 0);
        struct am_tensor tdw = tv(dw + h * Vh * C, Vh, C, 0, 0);
        K->ce_backward_softcap(&kdev, &tdx, &tdw, &tx, &tw, &tt, h * Vh, &tM, &tS, scale, cap);
    }
    double *fd = calloc((size_t)(V * C), sizeof(double));
    fd_grad(ce_ref, &ctx, x.d, N * C, fd);
    expect_close("ce_backward_softcap dx vs finite differences", dx, fd, N * C, 16 * (C + V) * U + 1e-7, 1e-8);
    fd_grad(ce_ref, &ctx, w.d, V * C, fd);
    expect_close("ce_backward_softcap dw vs finite differences", dw, fd, V * C, 16 * (C + N) * U + 1e-7, 1e-8);
    /* cap 0: ce_stats, bit for bit */
    float m2[9], s2[9], t2[9];
    struct am_tensor tw = tv(w.f, V, C, 0, 0), a1 = tv(m[0], N, 0, 0, 0), b1 = tv(s[0], N, 0, 0, 0), c1 = tv(t[0], N, 0, 0, 0);
    struct am_tensor a2 = tv(m2, N, 0, 0, 0), b2 = tv(s2, N, 0, 0, 0), c2 = tv(t2, N, 0, 0, 0);
    K->ce_stats_softcap(&kdev, &a1, &b1, &c1, &tx, &tw, &tt, 0, 0.0f);
    K->ce_stats(&kdev, &a2, &b2, &c2, &tx, &tw, &tt, 0);
    assert_memory_equal(m[0], m2, sizeof(m2));
    assert_memory_equal(s[0], s2, sizeof(s2));
    assert_memory_equal(t[0], t2, sizeof(t2));
    free(dx);
    free(dw);
    free(fd);
    arr_free(&x);
    arr_free(&w);
}

/* ---- bf16: each kernel widens its bf16 operands, runs the fp32 path and rounds each output
 * once, so on bf16 inputs it gives the fp32 path's result rounded, bit for bit ---- */

static void to_bf16(const float *src, uint16_t *b, float *widened, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        b[i] = am_f32_to_bf16(src[i]);
        widened[i] = am_bf16_to_f32(b[i]);
    }
}

static void expect_rounded(const char *what, const uint16_t *got, const float *f32, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (got[i] != am_f32_to_bf16(f32[i])) {
            print_error("%s: element %lld: bf16 %#x, the fp32 path rounded %#x\n", what, (long long)i, got[i],
                        am_f32_to_bf16(f32[i]));
            fail();
        }
}

static void test_bf16(void **state)
{
    (void)state;
    struct rng r = {47};
    enum { N = 96 };
    struct arr g = arr_rand(&r, N, -4, 4), u = arr_rand(&r, N, -2, 2), d = arr_rand(&r, N, -1, 1);
    uint16_t gb[N], ub[N], db[N], ob[N], dgb[N], dub[N];
    float gf[N], uf[N], df[N], of[N], dgf[N] = {0}, duf[N] = {0};
    to_bf16(g.f, gb, gf, N);
    to_bf16(u.f, ub, uf, N);
    to_bf16(d.f, db, df, N);
    struct am_tensor bg = am_tensor_view(gb, AM_DEV_CPU, AM_BF16, N, 0, 0, 0), bu = am_tensor_view(ub, AM_DEV_CPU, AM_BF16, N, 0, 0, 0);
    struct am_tensor bd = am_tensor_view(db, AM_DEV_CPU, AM_BF16, N, 0, 0, 0), bo = am_tensor_view(ob, AM_DEV_CPU, AM_BF16, N, 0, 0, 0);
    struct am_tensor tg = tv(gf, N, 0, 0, 0), tu = tv(uf, N, 0, 0, 0), td = tv(df, N, 0, 0, 0), to = tv(of, N, 0, 0, 0);
    K->geglu_forward(&kdev, &bo, &bg, &bu);
    K->geglu_forward(&kdev, &to, &tg, &tu);
    expect_rounded("geglu forward bf16", ob, of, N);
    memset(dgb, 0, sizeof dgb);
    memset(dub, 0, sizeof dub);
    struct am_tensor bdg = am_tensor_view(dgb, AM_DEV_CPU, AM_BF16, N, 0, 0, 0), bdu = am_tensor_view(dub, AM_DEV_CPU, AM_BF16, N, 0, 0, 0);
    struct am_tensor tdg = tv(dgf, N, 0, 0, 0), tdu = tv(duf, N, 0, 0, 0);
    K->geglu_backward(&kdev, &bdg, &bdu, &bd, &bg, &bu);
    K->geglu_backward(&kdev, &tdg, &tdu, &td, &tg, &tu);
    expect_rounded("geglu backward dgate bf16", dgb, dgf, N);
    expect_rounded("geglu backward dup bf16", dub, duf, N);

    /* attention_softcap: [1, 12, 2, 8] q, [1, 12, 1, 8] k, v */
    enum { T = 12, H = 2, D = 8, NQ = T * H * D, NK = T * D };
    struct arr q = arr_rand(&r, NQ, -2, 2), k = arr_rand(&r, NK, -2, 2), v = arr_rand(&r, NK, -1, 1);
    uint16_t qb[NQ], kb[NK], vb[NK], aob[NQ];
    float qf[NQ], kf[NK], vf[NK], aof[NQ], lse[H * T], lse2[H * T];
    to_bf16(q.f, qb, qf, NQ);
    to_bf16(k.f, kb, kf, NK);
    to_bf16(v.f, vb, vf, NK);
    struct am_tensor bq = am_tensor_view(qb, AM_DEV_CPU, AM_BF16, 1, T, H, D), bk = am_tensor_view(kb, AM_DEV_CPU, AM_BF16, 1, T, 1, D);
    struct am_tensor bv = am_tensor_view(vb, AM_DEV_CPU, AM_BF16, 1, T, 1, D), bao = am_tensor_view(aob, AM_DEV_CPU, AM_BF16, 1, T, H, D);
    struct am_tensor fq = tv(qf, 1, T, H, D), fk = tv(kf, 1, T, 1, D), fv = tv(vf, 1, T, 1, D), fao = tv(aof, 1, T, H, D);
    struct am_tensor tl = tv(lse, 1, H, T, 0), tl2 = tv(lse2, 1, H, T, 0);
    K->attention_softcap_forward(&kdev, &bao, &tl, &bq, &bk, &bv, 5, 0.3f, 1.5f);
    K->attention_softcap_forward(&kdev, &fao, &tl2, &fq, &fk, &fv, 5, 0.3f, 1.5f);
    expect_rounded("attention_softcap forward bf16", aob, aof, NQ);
    assert_memory_equal(lse, lse2, sizeof lse);

    /* the softcap cross-entropy's statistics from bf16 x and w */
    enum { CN = 5, CC = 8, CV = 20 };
    struct arr x = arr_rand(&r, CN * CC, -1, 1), w = arr_rand(&r, CV * CC, -1, 1);
    uint16_t xb[CN * CC], wb[CV * CC];
    float xf[CN * CC], wf[CV * CC], m1[CN], s1[CN], t1[CN], m2[CN], s2[CN], t2[CN];
    int32_t tgt[CN] = {1, 19, -1, 7, 0};
    to_bf16(x.f, xb, xf, CN * CC);
    to_bf16(w.f, wb, wf, CV * CC);
    struct am_tensor bx = am_tensor_view(xb, AM_DEV_CPU, AM_BF16, CN, CC, 0, 0), bw = am_tensor_view(wb, AM_DEV_CPU, AM_BF16, CV, CC, 0, 0);
    struct am_tensor fx = tv(xf, CN, CC, 0, 0), fw = tv(wf, CV, CC, 0, 0), tt = am_tensor_view(tgt, AM_DEV_CPU, AM_I32, CN, 0, 0, 0);
    struct am_tensor a1 = tv(m1, CN, 0, 0, 0), b1 = tv(s1, CN, 0, 0, 0), c1 = tv(t1, CN, 0, 0, 0);
    struct am_tensor a2 = tv(m2, CN, 0, 0, 0), b2 = tv(s2, CN, 0, 0, 0), c2 = tv(t2, CN, 0, 0, 0);
    K->ce_stats_softcap(&kdev, &a1, &b1, &c1, &bx, &bw, &tt, 0, 2.0f);
    K->ce_stats_softcap(&kdev, &a2, &b2, &c2, &fx, &fw, &tt, 0, 2.0f);
    assert_memory_equal(m1, m2, sizeof m1);
    assert_memory_equal(s1, s2, sizeof s1);
    assert_memory_equal(t1, t2, sizeof t1);
    struct arr *all[] = {&g, &u, &d, &q, &k, &v, &x, &w};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        arr_free(all[i]);
}

int main(void)
{
    char err[256];
    if (am_dev_open(&kdev, AM_DEV_CPU, 0, err, sizeof(err)) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    K = kdev.k;
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_rmsnorm_offset), cmocka_unit_test(test_geglu),
                                       cmocka_unit_test(test_attention_softcap), cmocka_unit_test(test_ce_softcap),
                                       cmocka_unit_test(test_bf16)};
    int rc = cmocka_run_group_tests_name("gemma kernels", tests, NULL, NULL);
    am_dev_close(&kdev);
    return rc;
}
