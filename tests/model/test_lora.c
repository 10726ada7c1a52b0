/* test_lora.c - a LoRA adapter (runtime/model/lora.h) on the CPU kernels against references.
 *
 * 1. forward and backward of one adapter against a double-precision reference of the formulas
 *    in lora.h, and the reference's own gradients against central finite differences of
 *    L = Σ y ⊙ R (R random), so that a wrong formula is not shared by both;
 * 2. tensor parallelism, two ranks emulated: the adapter split as lora.h says for a
 *    column-parallel and for a row-parallel base layer; each rank's outputs and gradients,
 *    put together as the model puts them together (concatenated where split, summed where
 *    partial), equal the whole adapter's.
 * 3. dropout (lora.h): the kernels' mask is the same on every call, drops its rate, keeps with
 *    1 / (1 - p), and each piece of a tensor split as dp, cp and tp split it draws the whole
 *    tensor's elements; the adapter with dropout "pre" and "post" against the reference on
 *    the input or output masked by this test (its own draw of rng.h's am_rng_keep), forward
 *    and backward; and the tp split of 2 with dropout against the whole adapter's.
 * Tolerance: fp32 products of at most K = 48 terms of magnitude <= 1 in a chain of three
 * matmuls: 1e-5 relative to the largest reference value (observed ~1e-7); a wrong index,
 * scale or transpose errs by order 1.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "lora.h"
#include "rng.h"

enum { N = 6, IN = 8, OUT = 12, R = 4 };
static const float S = 2.5f; /* alpha / r */

static struct am_dev dev;
static const struct am_kernels *K;
static int failures;

static double urand(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return ((*s >> 8) & 0xffff) / 32768.0 - 1.0;
}

static void fill(float *p, int n, unsigned *s)
{
    for (int i = 0; i < n; i++)
        p[i] = (float)urand(s);
}

static struct am_tensor view(float *p, int64_t rows, int64_t cols)
{
    return am_tensor_view(p, AM_DEV_CPU, AM_F32, rows, cols, 0, 0);
}

static void check(const char *what, const float *got, const double *want, int n)
{
    double big = 1e-30, worst = 0;
    for (int i = 0; i < n; i++)
        big = fmax(big, fabs(want[i]));
    for (int i = 0; i < n; i++)
        worst = fmax(worst, fabs(got[i] - want[i]));
    if (worst > 1e-5 * big) {
        printf("FAIL: %s: max error %.3g, tolerance %.3g\n", what, worst, 1e-5 * big);
        failures++;
    } else {
        printf("ok: %s (max error %.2g of %.2g)\n", what, worst, big);
    }
}

/* the double reference: y = y0 + S (x Aᵀ) Bᵀ; with dy: gA, gB, dx (added to their starts) */
static void ref_forward(const float *x, const double *A, const double *B, const float *y0, double *y)
{
    for (int i = 0; i < N; i++)
        for (int o = 0; o < OUT; o++) {
            double acc = 0;
            for (int k = 0; k < R; k++) {
                double t = 0;
                for (int c = 0; c < IN; c++)
                    t += (double)x[i * IN + c] * A[k * IN + c];
                acc += t * B[o * R + k];
            }
            y[i * OUT + o] = y0[i * OUT + o] + S * acc;
        }
}

static void ref_backward(const float *x, const float *A, const float *B, const float *dy, const float *ga0,
                         const float *gb0, const float *dx0, double *ga, double *gb, double *dx)
{
    double t[N * R], dt[N * R];
    for (int i = 0; i < N; i++)
        for (int k = 0; k < R; k++) {
            t[i * R + k] = 0;
            dt[i * R + k] = 0;
            for (int c = 0; c < IN; c++)
                t[i * R + k] += (double)x[i * IN + c] * A[k * IN + c];
            for (int o = 0; o < OUT; o++)
                dt[i * R + k] += S * (double)dy[i * OUT + o] * B[o * R + k];
        }
    for (int o = 0; o < OUT; o++)
        for (int k = 0; k < R; k++) {
            gb[o * R + k] = gb0[o * R + k];
            for (int i = 0; i < N; i++)
                gb[o * R + k] += S * (double)dy[i * OUT + o] * t[i * R + k];
        }
    for (int k = 0; k < R; k++)
        for (int c = 0; c < IN; c++) {
            ga[k * IN + c] = ga0[k * IN + c];
            for (int i = 0; i < N; i++)
                ga[k * IN + c] += dt[i * R + k] * x[i * IN + c];
        }
    for (int i = 0; i < N; i++)
        for (int c = 0; c < IN; c++) {
            dx[i * IN + c] = dx0[i * IN + c];
            for (int k = 0; k < R; k++)
                dx[i * IN + c] += dt[i * R + k] * A[k * IN + c];
        }
}

/* L = Σ y ⊙ dy with the double forward, as a function of one entry of A, B or x */
static double loss(const float *x, const double *A, const double *B, const float *dy)
{
    static const float zero[N * OUT];
    double y[N * OUT], l = 0;
    ref_forward(x, A, B, zero, y);
    for (int i = 0; i < N * OUT; i++)
        l += y[i] * dy[i];
    return l;
}

static void finite_differences(const float *x, const float *A, const float *B, const float *dy)
{
    static const float z[R * OUT > N * IN ? R * OUT : N * IN];
    double ga[R * IN], gb[OUT * R], dx[N * IN], Ad[R * IN], Bd[OUT * R], h = 1e-4, worst = 0;
    float xs[N * IN];
    ref_backward(x, A, B, dy, z, z, z, ga, gb, dx);
    for (int i = 0; i < R * IN; i++)
        Ad[i] = A[i];
    for (int i = 0; i < OUT * R; i++)
        Bd[i] = B[i];
    for (int i = 0; i < R * IN; i++) {
        Ad[i] = A[i] + h;
        double lp = loss(x, Ad, Bd, dy);
        Ad[i] = A[i] - h;
        double lm = loss(x, Ad, Bd, dy);
        Ad[i] = A[i];
        worst = fmax(worst, fabs((lp - lm) / (2 * h) - ga[i]));
    }
    for (int i = 0; i < OUT * R; i++) {
        Bd[i] = B[i] + h;
        double lp = loss(x, Ad, Bd, dy);
        Bd[i] = B[i] - h;
        double lm = loss(x, Ad, Bd, dy);
        Bd[i] = B[i];
        worst = fmax(worst, fabs((lp - lm) / (2 * h) - gb[i]));
    }
    /* x is float: differences in double on a copy promoted through the reference */
    memcpy(xs, x, sizeof(xs));
    for (int i = 0; i < N * IN; i++) {
        float keep = xs[i];
        double lp, lm;
        xs[i] = keep + 0.0078125f; /* exact in fp32; L is linear in x, so the difference is exact */
        lp = loss(xs, Ad, Bd, dy);
        xs[i] = keep - 0.0078125f;
        lm = loss(xs, Ad, Bd, dy);
        xs[i] = keep;
        worst = fmax(worst, fabs((lp - lm) / (2 * 0.0078125) - dx[i]));
    }
    if (worst > 1e-6) {
        printf("FAIL: reference gradients against finite differences: max error %.3g\n", worst);
        failures++;
    } else {
        printf("ok: reference gradients against finite differences (max error %.2g)\n", worst);
    }
}

/* ---- 3. dropout ---------------------------------------------------------------------- */

enum { TR = 3 }; /* the adapter's N rows: two sequences of TR rows */
static const struct am_dropout DROP = {.p = 0.25f, .seed = 77, .stream = 9, .seq0 = 5, .seq_step = 2, .seq_len = TR,
                                       .rows_per_seq = TR};

/* this test's own draw: row i, column c of a tensor of `cols` columns (from col0), as lora.h says */
static float mask_at(const struct am_dropout *d, int64_t i, int64_t c)
{
    int64_t key = (d->seq0 + i / d->rows_per_seq * d->seq_step) * d->seq_len +
                  (d->pos ? d->pos[i % d->rows_per_seq] : i % d->rows_per_seq);
    return am_rng_keep(d->seed, d->stream, (uint64_t)(key * d->cols + d->col0 + c), d->p) ? 1.0f / (1.0f - d->p)
                                                                                         : 0.0f;
}

/* the kernel's mask: rate, scale, the same twice; pieces split as dp x cp x tp draw the whole's */
static void test_mask(void)
{
    enum { SEQS = 4, T = 8, F = 16, BIG = 64 * 1024 };
    static float big[BIG], again[BIG];
    struct am_dropout d = {.p = 0.1f, .seed = 3, .stream = 11, .seq0 = 0, .seq_step = 1, .seq_len = 64,
                           .rows_per_seq = 64, .cols = BIG / 64 / 8};
    for (int i = 0; i < BIG; i++)
        big[i] = again[i] = 1.0f;
    struct am_tensor tb = view(big, BIG / d.cols, d.cols), ta = view(again, BIG / d.cols, d.cols);
    K->dropout(&dev, &tb, &d);
    K->dropout(&dev, &ta, &d);
    int zeros = 0, odd = 0;
    for (int i = 0; i < BIG; i++) {
        zeros += big[i] == 0;
        odd += big[i] != 0 && big[i] != 1.0f / 0.9f;
    }
    double rate = (double)zeros / BIG, sigma = sqrt(0.1 * 0.9 / BIG);
    bool same = memcmp(big, again, sizeof(big)) == 0;
    printf("%s: mask: the same twice, %d kept values not 1 / (1 - p), rate %.4f (p 0.1, 5 sigma %.4f)\n",
           same && !odd && fabs(rate - 0.1) < 5 * sigma ? "ok" : "FAIL", odd, rate, 5 * sigma);
    failures += !(same && !odd && fabs(rate - 0.1) < 5 * sigma);
    d.stream = 12;
    for (int i = 0; i < BIG; i++)
        again[i] = 1.0f;
    K->dropout(&dev, &ta, &d); /* another stream (projection, layer): another mask */
    int differ = 0;
    for (int i = 0; i < BIG; i++)
        differ += (big[i] == 0) != (again[i] == 0);
    printf("%s: another stream draws another mask (%d of %d differ)\n", differ > 0 ? "ok" : "FAIL", differ, BIG);
    failures += differ == 0;

    /* the whole: SEQS sequences (global 10, 11, 12, 13) of T rows, F columns */
    static float whole[SEQS * T * F];
    for (int i = 0; i < SEQS * T * F; i++)
        whole[i] = 1.0f;
    struct am_dropout w = {.p = 0.5f, .seed = 3, .stream = 4, .seq0 = 10, .seq_step = 1, .seq_len = T,
                           .rows_per_seq = T, .cols = F};
    struct am_tensor tw = view(whole, SEQS * T, F);
    K->dropout(&dev, &tw, &w);
    static const int32_t zig[2][T / 2] = {{0, 1, 6, 7}, {2, 3, 4, 5}}; /* ring.h's zigzag, cp 2 */
    int bad = 0;
    for (int dp = 0; dp < 2; dp++)        /* dp rank: sequences 10 + dp, 12 + dp */
        for (int cp = 0; cp < 2; cp++)    /* cp rank: rows zig[cp] of each */
            for (int tp = 0; tp < 2; tp++) { /* tp rank: columns tp * F / 2 .. */
                static float piece[2 * (T / 2) * (F / 2)];
                for (int i = 0; i < 2 * (T / 2) * (F / 2); i++)
                    piece[i] = 1.0f;
                struct am_dropout q = w;
                q.seq0 = 10 + dp;
                q.seq_step = 2;
                q.rows_per_seq = T / 2;
                q.pos = zig[cp];
                q.col0 = tp * (F / 2);
                struct am_tensor tq = view(piece, 2 * (T / 2), F / 2);
                K->dropout(&dev, &tq, &q);
                for (int b = 0; b < 2; b++)
                    for (int i = 0; i < T / 2; i++)
                        for (int c = 0; c < F / 2; c++) {
                            int64_t row = (dp + 2 * b) * T + zig[cp][i], col = tp * (F / 2) + c;
                            bad += piece[(b * (T / 2) + i) * (F / 2) + c] != whole[row * F + col];
                        }
            }
    printf("%s: dp 2 x cp 2 x tp 2 pieces draw the whole mask's elements (%d differ)\n", bad ? "FAIL" : "ok", bad);
    failures += bad != 0;
}

/* one adapter with dropout against the reference on the masked input (pre) or output (post) */
static void test_adapter_dropout(const float *x, const float *A, const float *B, const double *Ad, const double *Bd,
                                 const float *y0, const float *dy, const float *ga0, const float *gb0, const float *dx0)
{
    static const float zero[N * OUT > N * IN ? N * OUT : N * IN];
    for (int pre = 0; pre < 2; pre++) {
        struct am_dropout d = DROP;
        d.cols = pre ? IN : OUT;
        static float y[N * OUT], t[N * R], u[N * OUT], du[N * OUT], dt[N * R], xd[N * IN], dxa[N * IN];
        static float ga[R * IN], gb[OUT * R], dx[N * IN], xm[N * IN], dym[N * OUT];
        double yr[N * OUT], gar[R * IN], gbr[OUT * R], dxr[N * IN];
        struct am_tensor tA = view((float *)A, R, IN), tB = view((float *)B, OUT, R), tx = view((float *)x, N, IN);
        struct am_tensor ty = view(y, N, OUT), tt = view(t, N, R), tu = view(u, N, OUT), tdu = view(du, N, OUT);
        struct am_tensor tdt = view(dt, N, R), txd = view(xd, N, IN), tdxa = view(dxa, N, IN);
        struct am_tensor tga = view(ga, R, IN), tgb = view(gb, OUT, R), tdx = view(dx, N, IN);
        struct am_tensor tdy = view((float *)dy, N, OUT);
        struct am_lora l = {.a = &tA, .b = &tB, .ga = &tga, .gb = &tgb, .scale = S, .drop = &d, .drop_pre = pre};
        memcpy(y, y0, sizeof(y));
        memcpy(ga, ga0, sizeof(ga));
        memcpy(gb, gb0, sizeof(gb));
        memcpy(dx, dx0, sizeof(dx));
        am_lora_forward(&dev, K, &l, &ty, &tx, &tt, &tu, &txd);
        am_lora_backward(&dev, K, &l, &tdx, &tdy, &tx, &tt, &tdu, &tdt, &tdxa);
        char what[96];
        const char *pos = pre ? "pre" : "post";
        if (pre) { /* y = y0 + S ((M ⊙ x) Aᵀ) Bᵀ; gA from M ⊙ x; dx = dx0 + M ⊙ (dt A) */
            for (int i = 0; i < N; i++)
                for (int c = 0; c < IN; c++)
                    xm[i * IN + c] = x[i * IN + c] * mask_at(&d, i, c);
            ref_forward(xm, Ad, Bd, y0, yr);
            ref_backward(xm, A, B, dy, ga0, gb0, zero, gar, gbr, dxr);
            for (int i = 0; i < N; i++)
                for (int c = 0; c < IN; c++)
                    dxr[i * IN + c] = dx0[i * IN + c] + mask_at(&d, i, c) * dxr[i * IN + c];
        } else { /* y = y0 + M ⊙ (S (x Aᵀ) Bᵀ); the backward from M ⊙ dy */
            ref_forward(x, Ad, Bd, zero, yr);
            for (int i = 0; i < N; i++)
                for (int o = 0; o < OUT; o++) {
                    yr[i * OUT + o] = y0[i * OUT + o] + mask_at(&d, i, o) * yr[i * OUT + o];
                    dym[i * OUT + o] = dy[i * OUT + o] * mask_at(&d, i, o);
                }
            ref_backward(x, A, B, dym, ga0, gb0, dx0, gar, gbr, dxr);
        }
        snprintf(what, sizeof(what), "dropout %s: forward", pos);
        check(what, y, yr, N * OUT);
        snprintf(what, sizeof(what), "dropout %s: gradient of A", pos);
        check(what, ga, gar, R * IN);
        snprintf(what, sizeof(what), "dropout %s: gradient of B", pos);
        check(what, gb, gbr, OUT * R);
        snprintf(what, sizeof(what), "dropout %s: gradient of x", pos);
        check(what, dx, dxr, N * IN);
    }
}

int main(void)
{
    char err[256];
    if (am_dev_open(&dev, AM_DEV_CPU, 0, err, sizeof(err)) < 0) {
        printf("FAIL: %s\n", err);
        return 1;
    }
    K = dev.k;
    unsigned seed = 12345;
    static float x[N * IN], A[R * IN], B[OUT * R], y0[N * OUT], y[N * OUT], dy[N * OUT];
    static float ga0[R * IN], gb0[OUT * R], dx0[N * IN], ga[R * IN], gb[OUT * R], dx[N * IN];
    static float t[N * R], u[N * OUT], du[N * OUT], dt[N * R];
    fill(x, N * IN, &seed);
    fill(A, R * IN, &seed);
    fill(B, OUT * R, &seed);
    fill(y0, N * OUT, &seed);
    fill(dy, N * OUT, &seed);
    fill(ga0, R * IN, &seed);
    fill(gb0, OUT * R, &seed);
    fill(dx0, N * IN, &seed);
    double Ad[R * IN], Bd[OUT * R], yr[N * OUT], gar[R * IN], gbr[OUT * R], dxr[N * IN];
    for (int i = 0; i < R * IN; i++)
        Ad[i] = A[i];
    for (int i = 0; i < OUT * R; i++)
        Bd[i] = B[i];

    /* 1. one adapter */
    struct am_tensor tx = view(x, N, IN), tA = view(A, R, IN), tB = view(B, OUT, R), ty = view(y, N, OUT);
    struct am_tensor tt = view(t, N, R), tu = view(u, N, OUT), tdy = view(dy, N, OUT), tdu = view(du, N, OUT);
    struct am_tensor tdt = view(dt, N, R), tga = view(ga, R, IN), tgb = view(gb, OUT, R), tdx = view(dx, N, IN);
    struct am_lora l = {.a = &tA, .b = &tB, .ga = &tga, .gb = &tgb, .scale = S};
    memcpy(y, y0, sizeof(y));
    am_lora_forward(&dev, K, &l, &ty, &tx, &tt, &tu, NULL);
    ref_forward(x, Ad, Bd, y0, yr);
    check("forward: y + s (x Aᵀ) Bᵀ", y, yr, N * OUT);
    memcpy(ga, ga0, sizeof(ga));
    memcpy(gb, gb0, sizeof(gb));
    memcpy(dx, dx0, sizeof(dx));
    am_lora_backward(&dev, K, &l, &tdx, &tdy, &tx, &tt, &tdu, &tdt, NULL);
    ref_backward(x, A, B, dy, ga0, gb0, dx0, gar, gbr, dxr);
    check("backward: gradient of A", ga, gar, R * IN);
    check("backward: gradient of B", gb, gbr, OUT * R);
    check("backward: gradient of x", dx, dxr, N * IN);
    finite_differences(x, A, B, dy);
    test_mask();
    test_adapter_dropout(x, A, B, Ad, Bd, y0, dy, ga0, gb0, dx0);

    /* 2. two tp ranks */
    for (int row_parallel = 0; row_parallel < 2; row_parallel++) {
        static float ys[N * OUT], gas[R * IN], gbs[OUT * R], dxs[N * IN];
        memset(ys, 0, sizeof(ys));
        memset(gas, 0, sizeof(gas));
        memset(gbs, 0, sizeof(gbs));
        memset(dxs, 0, sizeof(dxs));
        for (int rank = 0; rank < 2; rank++) {
            int64_t ac, a0, br, b0;
            am_lora_split(IN, OUT, row_parallel, 2, rank, &ac, &a0, &br, &b0);
            static float xr[N * IN], Ar[R * IN], Br[OUT * R], yrk[N * OUT], dyr[N * OUT];
            static float gar_[R * IN], gbr_[OUT * R], dxr_[N * IN], tr[N * R], ur[N * OUT], dur[N * OUT], dtr[N * R];
            for (int i = 0; i < N; i++)
                for (int c = 0; c < ac; c++)
                    xr[i * ac + c] = x[i * IN + a0 + c]; /* the rank's input columns (all of them: column-parallel) */
            for (int k = 0; k < R; k++)
                for (int c = 0; c < ac; c++)
                    Ar[k * ac + c] = A[k * IN + a0 + c];
            for (int o = 0; o < br; o++)
                for (int k = 0; k < R; k++)
                    Br[o * R + k] = B[(b0 + o) * R + k];
            for (int i = 0; i < N; i++)
                for (int o = 0; o < br; o++)
                    dyr[i * br + o] = dy[i * OUT + b0 + o]; /* the rank's output rows (all: row-parallel) */
            memset(yrk, 0, sizeof(yrk));
            memset(gar_, 0, sizeof(gar_));
            memset(gbr_, 0, sizeof(gbr_));
            memset(dxr_, 0, sizeof(dxr_));
            struct am_tensor vx = view(xr, N, ac), vA = view(Ar, R, ac), vB = view(Br, br, R), vy = view(yrk, N, br);
            struct am_tensor vt = view(tr, N, R), vu = view(ur, N, br), vdy = view(dyr, N, br), vdu = view(dur, N, br);
            struct am_tensor vdt = view(dtr, N, R), vga = view(gar_, R, ac), vgb = view(gbr_, br, R),
                             vdx = view(dxr_, N, ac);
            struct am_lora lr = {.a = &vA, .b = &vB, .ga = &vga, .gb = &vgb, .scale = S};
            am_lora_forward(&dev, K, &lr, &vy, &vx, &vt, &vu, NULL);
            am_lora_backward(&dev, K, &lr, &vdx, &vdy, &vx, &vt, &vdu, &vdt, NULL);
            /* put together: split tensors by place, partial ones summed */
            for (int i = 0; i < N; i++)
                for (int o = 0; o < br; o++)
                    ys[i * OUT + b0 + o] += yrk[i * br + o];
            for (int k = 0; k < R; k++)
                for (int c = 0; c < ac; c++)
                    gas[k * IN + a0 + c] += gar_[k * ac + c];
            for (int o = 0; o < br; o++)
                for (int k = 0; k < R; k++)
                    gbs[(b0 + o) * R + k] += gbr_[o * R + k];
            for (int i = 0; i < N; i++)
                for (int c = 0; c < ac; c++)
                    dxs[i * IN + a0 + c] += dxr_[i * ac + c];
        }
        static const float zero[N * OUT > N * IN ? N * OUT : N * IN];
        ref_forward(x, Ad, Bd, zero, yr);
        ref_backward(x, A, B, dy, zero, zero, zero, gar, gbr, dxr);
        char what[96];
        const char *kind = row_parallel ? "row-parallel" : "column-parallel";
        snprintf(what, sizeof(what), "tp 2, %s: y", kind);
        check(what, ys, yr, N * OUT);
        snprintf(what, sizeof(what), "tp 2, %s: gradient of A", kind);
        check(what, gas, gar, R * IN);
        snprintf(what, sizeof(what), "tp 2, %s: gradient of B", kind);
        check(what, gbs, gbr, OUT * R);
        snprintf(what, sizeof(what), "tp 2, %s: gradient of x", kind);
        check(what, dxs, dxr, N * IN);
    }
    am_dev_close(&dev);
    return failures ? 1 : 0;
}
