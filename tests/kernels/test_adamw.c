/* test_adamw.c - the CPU kernels' tests (kernels_test.h: how they are tested): AdamW and its
 * multi-tensor step, on fp32 and on bf16 parameters.
 */
#include "kernels_test.h"

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


/* ---- bf16 parameters: torch.optim.AdamW on bf16 storage (kernels/cpu/adamw.c) ---- */

/* x rounded to bf16 and widened back: a torch op's bf16 result */
static float r16(float x) { return am_bf16_to_f32(am_f32_to_bf16(x)); }

/* One element of a bf16 parameter, written op by op from torch's _single_tensor_adamw: the
 * fp32 gradient cast to bf16 (FSDP2), multiplied by the clipping factor gs (a bf16 tensor
 * times a float), then each tensor op computed in fp32 and rounded to bf16; add_(eps) rounds
 * eps to bf16 first. Checked once against torch 2.15 (CPU, foreach=False; the steps of
 * 6 hyper-parameter sets, both lerp branches, clipping factors 1 to 0.01, 37 to 100003
 * elements, 1 and 2 threads, then 4 threads on 5 to 65537 elements): 8,030,130 parameters,
 * exp_avg and exp_avg_sq, 100% bitwise equal. To check again: test_adamw_bf16_torch. */
static void torch_adamw_bf16_elem(uint16_t *p16, float g32, uint16_t *m16, uint16_t *v16, struct adam_hp h, float gs,
                                  int64_t step)
{
    double lr = h.lr, b1 = h.b1, b2 = h.b2;
    float g = r16(g32);                                              /* grad.to(bf16) */
    g = r16(g * gs);                                                 /* clip: grad.mul_(coef) */
    float p = r16(am_bf16_to_f32(*p16) * (float)(1.0 - lr * (double)h.wd)); /* param.mul_(1 - lr * wd) */
    float m = am_bf16_to_f32(*m16), w = (float)(1.0 - b1);           /* exp_avg.lerp_(grad, 1 - beta1) */
    m = r16(w < 0.5f ? fmaf(w, g - m, m) : fmaf(w - 1.0f, g - m, g));
    float v = r16(am_bf16_to_f32(*v16) * h.b2);                      /* exp_avg_sq.mul_(beta2) */
    v = r16(fmaf((float)(1.0 - b2) * g, g, v));                      /* .addcmul_(g, g, 1 - beta2) */
    double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    float denom = r16(sqrtf(v));                                     /* exp_avg_sq.sqrt() */
    denom = r16(denom / (float)sqrt(bc2));                           /* / bias_correction2_sqrt */
    denom = r16(denom + r16(h.eps));                                 /* .add_(eps) */
    *p16 = am_f32_to_bf16(p + ((float)-(lr / bc1) * m) / denom);     /* addcdiv_(m, denom, -step_size) */
    *m16 = am_f32_to_bf16(m);
    *v16 = am_f32_to_bf16(v);
}

static void expect_bits16(const char *what, const uint16_t *got, const uint16_t *want, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (got[i] != want[i]) {
            print_error("%s: [%lld] got %.9g (0x%04x), want %.9g (0x%04x)\n", what, (long long)i,
                        (double)am_bf16_to_f32(got[i]), got[i], (double)am_bf16_to_f32(want[i]), want[i]);
            fail();
        }
}

/* fp32 gradients of every scale, down to where eps decides the denominator */
static void grad_fill(struct rng *r, float *g, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        g[i] = (float)(rng_uniform(r, -1, 1) * pow(10.0, rng_uniform(r, -7, 0)));
}

/* adamw on bf16 parameters against the emulation above, bit for bit: 4 steps (the moments
 * from zero, then from random values at a later step), both lerp branches (beta1 0.3 and
 * 0.5 take the second), with and without weight decay, small tensors and one over several
 * blocks of the kernel. And a loose check that it is AdamW: one step from zero moments
 * lands within a few bf16 roundings of the fp32 kernel's step on the same values. */
static void test_adamw_bf16(void **state)
{
    (void)state;
    struct rng r = {53};
    struct adam_hp hps[] = {
        {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f},
        {3e-4f, 0.95f, 0.95f, 1e-6f, 0.1f},
        {1e-2f, 0.3f, 0.99f, 1e-8f, 0.0f},
        {5e-3f, 0.5f, 0.98f, 1e-5f, 0.05f},
    };
    int64_t sizes[] = {37, 1000, 70001};
    for (size_t hc = 0; hc < sizeof hps / sizeof *hps; hc++)
        for (size_t c = 0; c < sizeof sizes / sizeof *sizes; c++) {
            struct adam_hp h = hps[hc];
            int64_t n = sizes[c];
            struct bt p = bt_rand(&r, n, -1, 1), m = bt_rand(&r, n, 0, 0), v = bt_rand(&r, n, 0, 0);
            struct bt rp = bt_copy(&p), rm = bt_copy(&m), rv = bt_copy(&v);
            float *g = malloc((size_t)n * sizeof(float));
            struct am_tensor tp = hv(&p, n, 0, 0, 0), tm = hv(&m, n, 0, 0, 0), tv = hv(&v, n, 0, 0, 0),
                             tg = f32v(g, n, 0, 0, 0);
            /* the fp32 kernel's first step on the same values, for the loose check */
            struct arr fp = arr_new(n), fm = arr_new(n), fv32 = arr_new(n), fg = arr_new(n);
            int64_t steps[] = {1, 2, 977, 978};
            for (int s = 0; s < 4; s++) {
                grad_fill(&r, g, n);
                if (s == 2) /* random moments, as a long run leaves them */
                    for (int64_t i = 0; i < n; i++) {
                        m.h[i] = rm.h[i] = am_f32_to_bf16((float)(rng_uniform(&r, -1, 1) * pow(10.0, rng_uniform(&r, -6, -1))));
                        v.h[i] = rv.h[i] = am_f32_to_bf16((float)pow(10.0, rng_uniform(&r, -14, -2)));
                    }
                if (s == 0) {
                    for (int64_t i = 0; i < n; i++) {
                        fp.f[i] = am_bf16_to_f32(p.h[i]);
                        fg.f[i] = r16(g[i]);
                    }
                    struct am_tensor a = tview(&fp, n, 0, 0, 0), b = tview(&fg, n, 0, 0, 0), cm = tview(&fm, n, 0, 0, 0),
                                     cv = tview(&fv32, n, 0, 0, 0);
                    K->adamw(&kdev, &a, &b, &cm, &cv, h.lr, h.b1, h.b2, h.eps, h.wd, 1);
                }
                K->adamw(&kdev, &tp, &tg, &tm, &tv, h.lr, h.b1, h.b2, h.eps, h.wd, steps[s]);
                for (int64_t i = 0; i < n; i++)
                    torch_adamw_bf16_elem(&rp.h[i], g[i], &rm.h[i], &rv.h[i], h, 1.0f, steps[s]);
                char what[96];
                snprintf(what, sizeof what, "adamw bf16 param (b1 %g wd %g n %lld step %lld)", (double)h.b1,
                         (double)h.wd, (long long)n, (long long)steps[s]);
                expect_bits16(what, p.h, rp.h, n);
                expect_bits16("adamw bf16 exp_avg", m.h, rm.h, n);
                expect_bits16("adamw bf16 exp_avg_sq", v.h, rv.h, n);
                if (s == 0) /* bf16(p * decay) and bf16 of an update of about lr: 2 roundings of |p|,
                             * the update's (bf16 moments and denominator, eps rounded) within 5% */
                    for (int64_t i = 0; i < n; i++) {
                        double got = am_bf16_to_f32(p.h[i]), want = fp.f[i];
                        if (fabs(got - want) > 0x1p-7 * fabs(want) + 0.05 * h.lr) {
                            print_error("adamw bf16 [%lld]: %.9g, the fp32 step gives %.9g\n", (long long)i, got, want);
                            fail();
                        }
                    }
            }
            free(g);
            struct bt *b16[] = {&p, &m, &v, &rp, &rm, &rv};
            for (size_t k = 0; k < sizeof b16 / sizeof *b16; k++)
                bt_free(b16[k]);
            arr_free(&fp);
            arr_free(&fm);
            arr_free(&fv32);
            arr_free(&fg);
        }
}

/* adamw_multi on a list mixing bf16 and fp32 parameters: clipping on (the bf16 gradients
 * multiplied by the factor after their cast, the fp32 ones as scale would), off and
 * inactive, both lerp branches; each bf16 tensor bit for bit as the emulation, each fp32
 * tensor as scale + adamw; the gradients are left as they were; a zero flag, an Inf or a
 * NaN norm write nothing. */
static void test_adamw_multi_bf16(void **state)
{
    (void)state;
    struct rng r = {59};
    enum { NT = 4 };
    int64_t sizes[NT] = {1000, 1, 40000, 7};
    bool is16[NT] = {true, true, false, true};
    struct bt p16[NT], m16[NT], v16[NT], rp16[NT], rm16[NT], rv16[NT];
    struct arr p32[NT], m32[NT], v32[NT], rp32[NT], rm32[NT], rv32[NT], g[NT], rg[NT];
    struct am_tensor tp[NT], tm[NT], tv[NT], tg[NT], trp[NT], trm[NT], trv[NT], trg[NT];
    struct am_adamw_tensor list[NT];
    for (int i = 0; i < NT; i++) {
        int64_t n = sizes[i];
        g[i] = arr_new(n);
        rg[i] = arr_new(n);
        tg[i] = tview(&g[i], n, 0, 0, 0);
        trg[i] = tview(&rg[i], n, 0, 0, 0);
        if (is16[i]) {
            p16[i] = bt_rand(&r, n, -1, 1);
            m16[i] = bt_rand(&r, n, -0.1, 0.1);
            v16[i] = bt_rand(&r, n, 0, 0.01);
            rp16[i] = bt_copy(&p16[i]);
            rm16[i] = bt_copy(&m16[i]);
            rv16[i] = bt_copy(&v16[i]);
            tp[i] = hv(&p16[i], n, 0, 0, 0);
            tm[i] = hv(&m16[i], n, 0, 0, 0);
            tv[i] = hv(&v16[i], n, 0, 0, 0);
        } else {
            p32[i] = arr_rand(&r, n, -1, 1);
            m32[i] = arr_rand(&r, n, -0.1, 0.1);
            v32[i] = arr_rand(&r, n, 0, 0.01);
            rp32[i] = arr_copy(&p32[i]);
            rm32[i] = arr_copy(&m32[i]);
            rv32[i] = arr_copy(&v32[i]);
            tp[i] = tview(&p32[i], n, 0, 0, 0);
            tm[i] = tview(&m32[i], n, 0, 0, 0);
            tv[i] = tview(&v32[i], n, 0, 0, 0);
            trp[i] = tview(&rp32[i], n, 0, 0, 0);
            trm[i] = tview(&rm32[i], n, 0, 0, 0);
            trv[i] = tview(&rv32[i], n, 0, 0, 0);
        }
        list[i] = (struct am_adamw_tensor){.param = &tp[i], .m = &tm[i], .v = &tv[i], .grad = &tg[i]};
    }
    struct {
        double max_norm;
        float beta1;
        double gscale;
    } cases[] = {{1.0, 0.9f, 1.0}, {0.3, 0.9f, 0.01}, {1e6, 0.9f, 1.0}, {0.0, 0.9f, 1.0}, {2.0, 0.3f, 1.0}};
    struct adam_hp h = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        double ss = 0;
        for (int i = 0; i < NT; i++)
            for (int64_t e = 0; e < sizes[i]; e++) {
                g[i].f[e] = rg[i].f[e] = (float)(rng_uniform(&r, -1, 1) * cases[c].gscale);
                ss += (double)g[i].f[e] * g[i].f[e];
            }
        struct am_tensor s64 = am_tensor_view(&ss, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
        int64_t step = (int64_t)c + 1;
        double coef = cases[c].max_norm / (sqrt(ss) + 1e-6);
        bool clipped = cases[c].max_norm > 0 && coef < 1.0;
        assert_true(clipped == (c == 0 || c == 1 || c == 4)); /* the cases do what they say */
        h.b1 = cases[c].beta1;
        for (int i = 0; i < NT; i++) {
            if (is16[i]) {
                for (int64_t e = 0; e < sizes[i]; e++)
                    torch_adamw_bf16_elem(&rp16[i].h[e], rg[i].f[e], &rm16[i].h[e], &rv16[i].h[e], h,
                                          clipped ? (float)coef : 1.0f, step);
                continue;
            }
            if (clipped)
                K->scale(&kdev, &trg[i], (float)coef);
            K->adamw(&kdev, &trp[i], &trg[i], &trm[i], &trv[i], h.lr, h.b1, h.b2, h.eps, h.wd, step);
        }
        K->adamw_multi(&kdev, list, NT, &s64, cases[c].max_norm, NULL, h.lr, h.b1, h.b2, h.eps, h.wd, step);
        for (int i = 0; i < NT; i++) {
            int64_t n = sizes[i];
            char what[96];
            snprintf(what, sizeof what, "adamw_multi bf16 case %zu tensor %d: param", c, i);
            if (is16[i]) {
                expect_bits16(what, p16[i].h, rp16[i].h, n);
                expect_bits16("adamw_multi bf16: exp_avg", m16[i].h, rm16[i].h, n);
                expect_bits16("adamw_multi bf16: exp_avg_sq", v16[i].h, rv16[i].h, n);
                expect_bitwise("adamw_multi bf16: the gradients stay as they were", g[i].f, rg[i].f, n);
            } else {
                expect_bitwise(what, p32[i].f, rp32[i].f, n);
                expect_bitwise("adamw_multi: exp_avg", m32[i].f, rm32[i].f, n);
                expect_bitwise("adamw_multi: exp_avg_sq", v32[i].f, rv32[i].f, n);
            }
        }
    }
    /* a step that must not be taken writes no bf16 tensor */
    size_t bytes = 3 * 1000 * sizeof(uint16_t);
    uint16_t *before = malloc(bytes), *after = malloc(bytes);
    for (int k = 0; k < 3; k++) {
        double ss = k == 0 ? INFINITY : k == 1 ? NAN : 1.0;
        int32_t flag = k == 2 ? 0 : 1;
        struct am_tensor s64 = am_tensor_view(&ss, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
        struct am_tensor fl = am_tensor_view(&flag, AM_DEV_CPU, AM_I32, 1, 0, 0, 0);
        memcpy(before, p16[0].h, 2000);
        memcpy(before + 1000, m16[0].h, 2000);
        memcpy(before + 2000, v16[0].h, 2000);
        K->adamw_multi(&kdev, list, NT, &s64, 1.0, &fl, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 9);
        memcpy(after, p16[0].h, 2000);
        memcpy(after + 1000, m16[0].h, 2000);
        memcpy(after + 2000, v16[0].h, 2000);
        if (memcmp(before, after, bytes) != 0) {
            print_error("adamw_multi wrote the bf16 tensors of a skipped step (%s)\n",
                        k == 0 ? "norm Inf" : k == 1 ? "norm NaN" : "flag 0");
            fail();
        }
    }
    free(before);
    free(after);
    for (int i = 0; i < NT; i++) {
        arr_free(&g[i]);
        arr_free(&rg[i]);
        if (is16[i]) {
            struct bt *all[] = {&p16[i], &m16[i], &v16[i], &rp16[i], &rm16[i], &rv16[i]};
            for (size_t k = 0; k < sizeof all / sizeof *all; k++)
                bt_free(all[k]);
        } else {
            struct arr *all[] = {&p32[i], &m32[i], &v32[i], &rp32[i], &rm32[i], &rv32[i]};
            for (size_t k = 0; k < sizeof all / sizeof *all; k++)
                arr_free(all[k]);
        }
    }
}

/* A bf16 gradient (FSDP2's sharded gradient of a bf16 parameter, train/grad_sync.h) steps a
 * bf16 parameter, and a FusedAdam tensor with AM_TE_GRAD_BF16 of every dtype combination, bit
 * for bit as its fp32 gradient would (the step rounds that to bf16 first): two lists, one
 * with the fp32 gradients, one with them rounded to bf16, from the same state; clipped, not
 * clipped, both lerp branches, several steps; a list mixing both gradient dtypes. The fp32
 * gradients are not bf16 values, so the cases compare two different inputs' steps. */
static void test_adamw_grad_bf16(void **state)
{
    (void)state;
    struct rng r = {83};
    enum { NT = 9 }; /* torch's AdamW on bf16 parameters, then FusedAdam on dtypes 0 to 7 */
    int64_t n = 3001;
    struct bt p[2][NT], m[2][NT], v[2][NT];
    struct bt g16[NT];
    float *g32[NT];
    struct am_tensor tp[2][NT], tm[2][NT], tv[2][NT], tg[2][NT];
    struct am_adamw_tensor list[2][NT];
    for (int i = 0; i < NT; i++) {
        g32[i] = malloc((size_t)n * sizeof(float));
        g16[i] = bt_new(n);
        int dt = i == 0 ? 7 : i - 1; /* bits: param, m, v bf16 */
        struct bt p0 = bt_rand(&r, n, -1, 1), m0 = bt_rand(&r, n, -0.01, 0.01), v0 = bt_rand(&r, n, 0, 1e-4);
        for (int k = 0; k < 2; k++) {
            p[k][i] = bt_copy(&p0);
            m[k][i] = bt_copy(&m0);
            v[k][i] = bt_copy(&v0);
            tp[k][i] = dt & 1 ? hv(&p[k][i], n, 0, 0, 0) : fv(&p[k][i], n, 0, 0, 0);
            tm[k][i] = dt & 2 ? hv(&m[k][i], n, 0, 0, 0) : fv(&m[k][i], n, 0, 0, 0);
            tv[k][i] = dt & 4 ? hv(&v[k][i], n, 0, 0, 0) : fv(&v[k][i], n, 0, 0, 0);
            tg[k][i] = k ? hv(&g16[i], n, 0, 0, 0) : f32v(g32[i], n, 0, 0, 0);
            unsigned te = i == 0 ? 0 : AM_TE_ADAM | AM_TE_GRAD_BF16 | (i % 2 ? AM_TE_L2 : 0);
            list[k][i] = (struct am_adamw_tensor){.param = &tp[k][i], .m = &tm[k][i], .v = &tv[k][i],
                                                  .grad = &tg[k][i], .te = te};
        }
        bt_free(&p0);
        bt_free(&m0);
        bt_free(&v0);
    }
    struct {
        double max_norm;
        float beta1;
    } cases[] = {{1.0, 0.9f}, {0.0, 0.9f}, {0.05, 0.3f}, {1e6, 0.3f}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        double ss = 0;
        for (int i = 0; i < NT; i++) {
            grad_fill(&r, g32[i], n);
            for (int64_t e = 0; e < n; e++) {
                g16[i].h[e] = am_f32_to_bf16(g32[i][e]);
                g16[i].f[e] = am_bf16_to_f32(g16[i].h[e]);
                ss += (double)g32[i][e] * g32[i][e];
            }
        }
        struct am_tensor s64 = am_tensor_view(&ss, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
        int64_t step = (int64_t)c + 1;
        for (int k = 0; k < 2; k++)
            K->adamw_multi(&kdev, list[k], NT, &s64, cases[c].max_norm, NULL, 1e-3f, cases[c].beta1, 0.95f, 1e-8f,
                           0.1f, step);
        for (int i = 0; i < NT; i++) {
            char what[96];
            snprintf(what, sizeof what, "adamw_multi, a bf16 gradient vs its fp32 value: case %zu tensor %d", c, i);
            struct bt *x[3][2] = {{&p[0][i], &p[1][i]}, {&m[0][i], &m[1][i]}, {&v[0][i], &v[1][i]}};
            for (int j = 0; j < 3; j++) {
                const struct am_tensor *t = j == 0 ? &tp[0][i] : j == 1 ? &tm[0][i] : &tv[0][i];
                if (t->dtype == AM_BF16)
                    expect_bits16(what, x[j][1]->h, x[j][0]->h, n);
                else
                    expect_bitwise(what, x[j][1]->f, x[j][0]->f, n);
            }
        }
    }
    for (int i = 0; i < NT; i++) {
        free(g32[i]);
        bt_free(&g16[i]);
        for (int k = 0; k < 2; k++) {
            bt_free(&p[k][i]);
            bt_free(&m[k][i]);
            bt_free(&v[k][i]);
        }
    }
}

/* What adamw refuses: bf16 parameters with fp32 moments, an fp32 parameter with a bf16 gradient,
 * fp16 ones, a FusedAdam tensor with a bf16 gradient without AM_TE_GRAD_BF16, remainders beside
 * an fp32 parameter. */
static void bad_adamw_call(int which)
{
    uint16_t h[12] = {0};
    float f[12] = {0};
    struct am_tensor p16 = am_tensor_view(h, AM_DEV_CPU, AM_BF16, 4, 0, 0, 0);
    struct am_tensor b16 = am_tensor_view(h + 4, AM_DEV_CPU, AM_BF16, 4, 0, 0, 0);
    struct am_tensor ph = am_tensor_view(h + 8, AM_DEV_CPU, AM_F16, 4, 0, 0, 0);
    struct am_tensor f32 = am_tensor_view(f, AM_DEV_CPU, AM_F32, 4, 0, 0, 0);
    struct am_tensor f32b = am_tensor_view(f + 4, AM_DEV_CPU, AM_F32, 4, 0, 0, 0);
    p16.name = "model.embed_tokens.weight";
    struct am_adamw_tensor l = {.param = &p16, .m = &b16, .v = &f32b, .grad = &f32};
    switch (which) {
    case 0: K->adamw(&kdev, &p16, &f32, &f32b, &b16, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.f, 1); break; /* f32 m */
    case 1: K->adamw(&kdev, &f32, &b16, &f32b, &f32b, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.f, 1); break; /* bf16 grad */
    case 2: K->adamw(&kdev, &ph, &f32, &f32, &f32, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.f, 1); break;    /* f16 param */
    case 3: K->adamw_multi(&kdev, &l, 1, NULL, 0, NULL, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.f, 1); break; /* f32 v */
    case 4: /* FusedAdam, a bf16 gradient without bf16 model parameters */
        l = (struct am_adamw_tensor){.param = &f32, .m = &f32b, .v = &b16, .grad = &p16, .te = AM_TE_ADAM};
        K->adamw_multi(&kdev, &l, 1, NULL, 0, NULL, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.f, 1);
        break;
    case 5: /* FusedAdam's remainders beside an fp32 parameter (a whole master) */
        f32.name = "model.norm.weight";
        l = (struct am_adamw_tensor){.param = &f32, .m = &f32b, .v = &f32b, .grad = &f32b, .rem = &b16,
                                     .te = AM_TE_ADAM};
        K->adamw_multi(&kdev, &l, 1, NULL, 0, NULL, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.f, 1);
        break;
    }
}

static void test_adamw_bad_dtype_aborts(void **state)
{
    (void)state;
    const char *want[][3] = {
        {"am_cpu_adamw", "m (", "model.embed_tokens.weight) is bf16: Adam's moments have the parameter's dtype"},
        {"am_cpu_adamw", "grad (", "is bf16"},
        {"am_cpu_adamw", "is fp16", "AdamW steps fp32 or bf16 parameters"},
        {"am_cpu_adamw_multi", "v (", "is fp32 but param (model.embed_tokens.weight) is bf16"},
        {"am_cpu_adamw_multi", "grad (model.embed_tokens.weight) is bf16",
         "FusedAdam's gradient is fp32, or bf16 for bf16 model parameters"},
        {"am_cpu_adamw_multi", "a master kept as remainders takes a bf16 param",
         "(model.norm.weight is fp32) and 4 16-bit remainders"},
    };
    for (int c = 0; c < 6; c++)
        expect_abort(bad_adamw_call, c, want[c], 3);
}

/* The emulation and the kernel against torch's own steps, where a reference file is given:
 *   python3 tests/kernels/adamw_bf16_torch.py /tmp/adamw_bf16.bin   (torch 2.15, the golden venv)
 *   AM_ADAMW_TORCH_REF=/tmp/adamw_bf16.bin tests/kernels/test_adamw
 * Each record: torch's state before and after one step; both must match it bit for bit. */
static void test_adamw_bf16_torch(void **state)
{
    (void)state;
    const char *path = getenv("AM_ADAMW_TORCH_REF");
    if (!path || !*path)
        skip();
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    int64_t hdr[2];
    float hp[6];
    long long recs = 0, total = 0;
    while (fread(hdr, sizeof(int64_t), 2, f) == 2) {
        assert_int_equal(fread(hp, sizeof(float), 6, f), 6);
        int64_t n = hdr[0], step = hdr[1];
        struct adam_hp h = {hp[0], hp[1], hp[2], hp[3], hp[4]};
        float gs = hp[5], *g = malloc((size_t)n * sizeof(float));
        uint16_t *a[9];
        assert_int_equal(fread(g, sizeof(float), (size_t)n, f), (size_t)n);
        for (int k = 0; k < 6; k++) {
            a[k] = malloc((size_t)n * sizeof(uint16_t));
            assert_int_equal(fread(a[k], sizeof(uint16_t), (size_t)n, f), (size_t)n);
        }
        for (int k = 6; k < 9; k++) /* the emulation's p, m, v */
            a[k] = memcpy(malloc((size_t)n * sizeof(uint16_t)), a[k - 6], (size_t)n * sizeof(uint16_t));
        for (int64_t i = 0; i < n; i++)
            torch_adamw_bf16_elem(&a[6][i], g[i], &a[7][i], &a[8][i], h, gs, step);
        struct am_tensor tp = am_tensor_view(a[0], AM_DEV_CPU, AM_BF16, n, 0, 0, 0),
                         tm = am_tensor_view(a[1], AM_DEV_CPU, AM_BF16, n, 0, 0, 0),
                         tv = am_tensor_view(a[2], AM_DEV_CPU, AM_BF16, n, 0, 0, 0), tg = f32v(g, n, 0, 0, 0);
        /* the clipping factor gs through a norm: max_norm / (sqrt(4) + 1e-6) rounds to gs */
        double ss = 4.0, max_norm = gs == 1.0f ? 0.0 : (double)gs * (2.0 + 1e-6);
        assert_true(gs == 1.0f || (float)(max_norm / (sqrt(ss) + 1e-6)) == gs);
        struct am_tensor s64 = am_tensor_view(&ss, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
        struct am_adamw_tensor l = {.param = &tp, .m = &tm, .v = &tv, .grad = &tg};
        K->adamw_multi(&kdev, &l, 1, &s64, max_norm, NULL, h.lr, h.b1, h.b2, h.eps, h.wd, step);
        char what[96];
        snprintf(what, sizeof what, "record %lld (n %lld, step %lld, beta1 %g, gs %g): param", recs, (long long)n,
                 (long long)step, (double)h.b1, (double)gs);
        expect_bits16(what, a[0], a[3], n);
        expect_bits16("exp_avg", a[1], a[4], n);
        expect_bits16("exp_avg_sq", a[2], a[5], n);
        expect_bits16("the emulation's param", a[6], a[3], n);
        expect_bits16("the emulation's exp_avg", a[7], a[4], n);
        expect_bits16("the emulation's exp_avg_sq", a[8], a[5], n);
        for (int k = 0; k < 9; k++)
            free(a[k]);
        free(g);
        recs++;
        total += n;
    }
    fclose(f);
    assert_true(recs > 0);
    if (getenv("AM_TEST_VERBOSE"))
        printf("    %lld torch steps, %lld elements: param, exp_avg, exp_avg_sq bitwise equal\n", recs, total);
}

/* ---- Transformer Engine's FusedAdam (am_adamw_tensor.te) ---- */

/* TE's functor for one element, written from transformer_engine/common/multi_tensor/adam.cu
 * (every value widened to fp32, one rounding per op; kernels/cpu/adamw.c's header has the
 * formula); p, m, v are rounded to bf16 after where p16, m16, v16 */
static void te_adam_elem(float *p, float g, float *m, float *v, struct adam_hp h, float gs, int64_t step, unsigned te,
                         bool p16, bool m16, bool v16)
{
    float bc1 = 1.0f, bc2 = 1.0f;
    if (!(te & AM_TE_NO_BIAS_CORR)) {
        bc1 = (float)(1.0 - pow((double)h.b1, (double)step));
        bc2 = (float)(1.0 - pow((double)h.b2, (double)step));
    }
    g = te & AM_TE_GRAD_BF16 ? r16(r16(g) * gs) : g * gs;
    float pp = *p, mm = *m, vv = *v;
    if (te & AM_TE_L2)
        g = g + h.wd * pp;
    mm = h.b1 * mm + (1.0f - h.b1) * g;
    vv = h.b2 * vv + (1.0f - h.b2) * g * g;
    float m_hat = mm / bc1, v_hat = vv / bc2, denom = sqrtf(v_hat) + h.eps;
    float update = te & AM_TE_L2 ? m_hat / denom : m_hat / denom + h.wd * pp;
    pp = pp - h.lr * update;
    *p = p16 ? r16(pp) : pp;
    *m = m16 ? r16(mm) : mm;
    *v = v16 ? r16(vv) : vv;
}

/* a float array as a tensor of dtype dt (bf16: a copy, rounded) */
static struct am_tensor te_view(float *x, uint16_t **h16, bool bf, int64_t n)
{
    if (!bf) {
        *h16 = NULL;
        return f32v(x, n, 0, 0, 0);
    }
    *h16 = malloc((size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++)
        (*h16)[i] = am_f32_to_bf16(x[i]);
    return am_tensor_view(*h16, AM_DEV_CPU, AM_BF16, n, 0, 0, 0);
}

/* what a tensor holds, widened */
static void te_read(float *out, const float *x, const uint16_t *h16, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = h16 ? am_bf16_to_f32(h16[i]) : x[i];
}

static void expect_f32_bits(const char *what, const float *got, const float *want, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
            print_error("%s [%lld]: %.9g, want %.9g\n", what, (long long)i, (double)got[i], (double)want[i]);
            fail();
        }
}

/* One adamw_multi call over one TE tensor (param, m, v of the dtypes bits dt: 1, 2, 4), from
 * the values given in p, m, v, clipped to gs through a norm as test_adamw_bf16_torch does;
 * the results widened into p, m, v. */
static void te_kernel_step(float *p, const float *g, float *m, float *v, int64_t n, int dt, struct adam_hp h, float gs,
                           int64_t step, unsigned te)
{
    uint16_t *h16[3];
    struct am_tensor tp = te_view(p, &h16[0], dt & 1, n), tm = te_view(m, &h16[1], dt & 2, n),
                     tv = te_view(v, &h16[2], dt & 4, n), tg = f32v((float *)g, n, 0, 0, 0);
    double ss = 4.0, max_norm = gs == 1.0f ? 0.0 : (double)gs * (2.0 + 1e-6);
    assert_true(gs == 1.0f || (float)(max_norm / (sqrt(ss) + 1e-6)) == gs);
    struct am_tensor s64 = am_tensor_view(&ss, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
    struct am_adamw_tensor l = {.param = &tp, .m = &tm, .v = &tv, .grad = &tg, .te = te};
    K->adamw_multi(&kdev, &l, 1, &s64, max_norm, NULL, h.lr, h.b1, h.b2, h.eps, h.wd, step);
    te_read(p, p, h16[0], n);
    te_read(m, m, h16[1], n);
    te_read(v, v, h16[2], n);
    for (int k = 0; k < 3; k++)
        free(h16[k]);
}

/* The kernel against the emulation: every dtype combination of param, m and v, both
 * adam_w_mode settings, with and without bias correction, fp32 and bf16 model gradients,
 * clipped and not, several steps from one state. */
static void test_adamw_te(void **state)
{
    (void)state;
    struct rng r = {71};
    struct adam_hp hps[] = {{1e-5f, 0.9f, 0.999f, 1e-8f, 0.0f}, {2e-4f, 0.9f, 0.95f, 1e-8f, 0.1f},
                            {1e-3f, 0.3f, 0.99f, 1e-3f, 0.3f}};
    unsigned tes[] = {AM_TE_ADAM, AM_TE_ADAM | AM_TE_L2, AM_TE_ADAM | AM_TE_NO_BIAS_CORR, AM_TE_ADAM | AM_TE_GRAD_BF16,
                      AM_TE_ADAM | AM_TE_L2 | AM_TE_GRAD_BF16};
    int64_t n = 1000;
    float *p = malloc(n * sizeof(float)), *m = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float)),
          *g = malloc(n * sizeof(float)), *rp = malloc(n * sizeof(float)), *rm = malloc(n * sizeof(float)),
          *rv = malloc(n * sizeof(float));
    for (int dt = 0; dt < 8; dt++)
        for (size_t hc = 0; hc < sizeof hps / sizeof *hps; hc++)
            for (size_t t = 0; t < sizeof tes / sizeof *tes; t++) {
                for (int64_t i = 0; i < n; i++) {
                    p[i] = (float)rng_uniform(&r, -0.1, 0.1);
                    m[i] = v[i] = 0;
                    if (dt & 1)
                        p[i] = r16(p[i]);
                }
                memcpy(rp, p, n * sizeof(float));
                memcpy(rm, m, n * sizeof(float));
                memcpy(rv, v, n * sizeof(float));
                int64_t steps[] = {1, 2, 3, 500};
                for (int s = 0; s < 4; s++) {
                    grad_fill(&r, g, n);
                    float gs = s == 1 ? 0.37f : 1.0f;
                    te_kernel_step(p, g, m, v, n, dt, hps[hc], gs, steps[s], tes[t]);
                    for (int64_t i = 0; i < n; i++)
                        te_adam_elem(&rp[i], g[i], &rm[i], &rv[i], hps[hc], gs, steps[s], tes[t], dt & 1, dt & 2, dt & 4);
                    char what[96];
                    snprintf(what, sizeof what, "te adam param (dtypes %d, hp %zu, te %u, step %lld)", dt, hc, tes[t],
                             (long long)steps[s]);
                    expect_f32_bits(what, p, rp, n);
                    expect_f32_bits("te adam exp_avg", m, rm, n);
                    expect_f32_bits("te adam exp_avg_sq", v, rv, n);
                }
            }
    float *all[] = {p, m, v, g, rp, rm, rv};
    for (size_t k = 0; k < sizeof all / sizeof *all; k++)
        free(all[k]);
}

/* store_param_remainders (am_adamw_tensor.rem): TE's split of an fp32 master into a bf16
 * parameter and a 16-bit remainder loses nothing (join(split(u)) is u for every pattern tried,
 * the parameter the master rounded to nearest with ties away from zero), and a step on the two
 * is bit for bit the step on the fp32 master (its m and v too), for every moment dtype, both
 * weight-decay modes, clipped and not, over several steps; the masters drawn with every low
 * half, ties (0x8000) and carries into the exponent among them. */
static void test_adamw_te_remainders(void **state)
{
    (void)state;
    struct rng r = {79};
    int64_t n = 4096;
    struct adam_hp hps[] = {{2e-4f, 0.9f, 0.95f, 1e-8f, 0.1f}, {1e-2f, 0.3f, 0.99f, 1e-3f, 0.3f}};
    unsigned tes[] = {AM_TE_ADAM | AM_TE_GRAD_BF16, AM_TE_ADAM | AM_TE_L2 | AM_TE_GRAD_BF16};
    float *p = malloc(n * sizeof(float)), *m = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float)),
          *g = malloc(n * sizeof(float)), *m2 = malloc(n * sizeof(float)), *v2 = malloc(n * sizeof(float));
    uint16_t *hi = malloc(n * sizeof(uint16_t)), *lo = malloc(n * sizeof(uint16_t));
    int ties = 0;
    for (int dt = 0; dt < 4; dt++)
        for (size_t hc = 0; hc < sizeof hps / sizeof *hps; hc++)
            for (size_t t = 0; t < sizeof tes / sizeof *tes; t++) {
                for (int64_t i = 0; i < n; i++) {
                    uint32_t u;
                    p[i] = (float)rng_uniform(&r, -0.1, 0.1);
                    memcpy(&u, &p[i], sizeof u);
                    if (i % 8 == 0) /* a tie; every 64th also a carry: the high half's mantissa all ones */
                        u = (u & 0xffff0000u) | 0x8000u | (i % 64 == 0 ? 0x007f0000u : 0);
                    else if (i % 8 == 1)
                        u = (u & 0xffff0000u) | (i % 16 == 1 ? 0x7fffu : 0xffffu);
                    memcpy(&p[i], &u, sizeof u);
                    am_te_master_split(u, &hi[i], &lo[i]);
                    assert_true(am_te_master_join(hi[i], lo[i]) == u);
                    float h = am_bf16_to_f32(hi[i]);
                    if ((u & 0xffffu) == 0x8000u) { /* away from zero */
                        assert_true(fabsf(h) > fabsf(p[i]));
                        ties++;
                    } else {
                        assert_true(hi[i] == am_f32_to_bf16(p[i])); /* nearest */
                    }
                    m[i] = v[i] = m2[i] = v2[i] = 0;
                }
                for (int64_t step = 1; step <= 4; step++) {
                    grad_fill(&r, g, n);
                    float gs = step == 2 ? 0.37f : 1.0f;
                    /* the fp32 master */
                    te_kernel_step(p, g, m, v, n, dt << 1, hps[hc], gs, step, tes[t]);
                    /* the bf16 parameter and its remainders */
                    uint16_t *h16[2];
                    struct am_tensor tp = am_tensor_view(hi, AM_DEV_CPU, AM_BF16, n, 0, 0, 0),
                                     tr = am_tensor_view(lo, AM_DEV_CPU, AM_BF16, n, 0, 0, 0),
                                     tm = te_view(m2, &h16[0], dt & 1, n), tv = te_view(v2, &h16[1], dt & 2, n),
                                     tg = f32v(g, n, 0, 0, 0);
                    double ss = 4.0, max_norm = gs == 1.0f ? 0.0 : (double)gs * (2.0 + 1e-6);
                    struct am_tensor s64 = am_tensor_view(&ss, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
                    struct am_adamw_tensor l = {.param = &tp, .m = &tm, .v = &tv, .grad = &tg, .rem = &tr, .te = tes[t]};
                    K->adamw_multi(&kdev, &l, 1, &s64, max_norm, NULL, hps[hc].lr, hps[hc].b1, hps[hc].b2,
                                   hps[hc].eps, hps[hc].wd, step);
                    te_read(m2, m2, h16[0], n);
                    te_read(v2, v2, h16[1], n);
                    free(h16[0]);
                    free(h16[1]);
                    float *joined = malloc(n * sizeof(float));
                    for (int64_t i = 0; i < n; i++) {
                        uint32_t u = am_te_master_join(hi[i], lo[i]);
                        memcpy(&joined[i], &u, sizeof u);
                    }
                    char what[96];
                    snprintf(what, sizeof what, "remainders' master (moments %d, hp %zu, te %u, step %lld)", dt, hc,
                             tes[t], (long long)step);
                    expect_f32_bits(what, joined, p, n);
                    expect_f32_bits("remainders' exp_avg", m2, m, n);
                    expect_f32_bits("remainders' exp_avg_sq", v2, v, n);
                    free(joined);
                }
            }
    assert_true(ties >= 16 * 512);
    float *all[] = {p, m, v, g, m2, v2};
    for (size_t k = 0; k < sizeof all / sizeof *all; k++)
        free(all[k]);
    free(hi);
    free(lo);
}

/* FusedAdam with fp32 masters and moments, decay 0, is Adam: torch's AdamW and TE's formulas
 * differ only in how they round (TE divides m and v by the bias corrections, torch scales the
 * step), so one step from the same state agrees to a few ulps of the update */
static void test_adamw_te_vs_torch(void **state)
{
    (void)state;
    struct rng r = {73};
    int64_t n = 5000;
    struct adam_hp h = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f};
    float *p = malloc(n * sizeof(float)), *m = calloc(n, sizeof(float)), *v = calloc(n, sizeof(float)),
          *g = malloc(n * sizeof(float)), *tp = malloc(n * sizeof(float)), *tm = calloc(n, sizeof(float)),
          *tv = calloc(n, sizeof(float));
    for (int64_t i = 0; i < n; i++)
        tp[i] = p[i] = (float)rng_uniform(&r, -0.1, 0.1);
    for (int64_t step = 1; step <= 20; step++) {
        grad_fill(&r, g, n);
        te_kernel_step(p, g, m, v, n, 0, h, 1.0f, step, AM_TE_ADAM);
        for (int64_t i = 0; i < n; i++)
            torch_adamw_elem(&tp[i], g[i], &tm[i], &tv[i], h, step);
    }
    for (int64_t i = 0; i < n; i++)
        if (fabsf(p[i] - tp[i]) > 1e-6f * fabsf(tp[i]) + 20 * 1e-3f * 1e-5f) {
            print_error("te vs torch [%lld]: %.9g vs %.9g\n", (long long)i, (double)p[i], (double)tp[i]);
            fail();
        }
    float *all[] = {p, m, v, g, tp, tm, tv};
    for (size_t k = 0; k < sizeof all / sizeof *all; k++)
        free(all[k]);
}

/* The kernel against tests/kernels/adamw_te_ref.py's numpy transcription of TE's functor,
 * where a reference file is given:
 *   python3 tests/kernels/adamw_te_ref.py /tmp/adamw_te.bin   (numpy: the golden venv)
 *   AM_ADAMW_TE_REF=/tmp/adamw_te.bin tests/kernels/test_adamw
 * Each record: one step's state before and after; the kernel must match it bit for bit. */
static void test_adamw_te_ref(void **state)
{
    (void)state;
    const char *path = getenv("AM_ADAMW_TE_REF");
    if (!path || !*path)
        skip();
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    int64_t hdr[4];
    float hp[6];
    long long recs = 0, total = 0;
    while (fread(hdr, sizeof(int64_t), 4, f) == 4) {
        assert_int_equal(fread(hp, sizeof(float), 6, f), 6);
        int64_t n = hdr[0], step = hdr[1];
        struct adam_hp h = {hp[0], hp[1], hp[2], hp[3], hp[4]};
        float *a[7];
        for (int k = 0; k < 7; k++) {
            a[k] = malloc((size_t)n * sizeof(float));
            assert_int_equal(fread(a[k], sizeof(float), (size_t)n, f), (size_t)n);
        }
        te_kernel_step(a[1], a[0], a[2], a[3], n, (int)hdr[3], h, hp[5], step, (unsigned)hdr[2]);
        char what[128];
        snprintf(what, sizeof what, "record %lld (n %lld, step %lld, te %lld, dtypes %lld, gs %g): param", recs,
                 (long long)n, (long long)step, (long long)hdr[2], (long long)hdr[3], (double)hp[5]);
        expect_f32_bits(what, a[1], a[4], n);
        expect_f32_bits("exp_avg", a[2], a[5], n);
        expect_f32_bits("exp_avg_sq", a[3], a[6], n);
        for (int k = 0; k < 7; k++)
            free(a[k]);
        recs++;
        total += n;
    }
    fclose(f);
    assert_true(recs > 0);
    if (getenv("AM_TEST_VERBOSE"))
        printf("    %lld FusedAdam steps, %lld elements: param, exp_avg, exp_avg_sq bitwise equal\n", recs, total);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adamw),
        cmocka_unit_test(test_adamw_multi),
        cmocka_unit_test(test_adamw_bf16),
        cmocka_unit_test(test_adamw_multi_bf16),
        cmocka_unit_test(test_adamw_grad_bf16),
        cmocka_unit_test(test_adamw_bad_dtype_aborts),
        cmocka_unit_test(test_adamw_bf16_torch),
        cmocka_unit_test(test_adamw_te),
        cmocka_unit_test(test_adamw_te_remainders),
        cmocka_unit_test(test_adamw_te_vs_torch),
        cmocka_unit_test(test_adamw_te_ref),
    };
    return cmocka_run_group_tests_name("kernels (cpu): adamw", tests, kernels_test_setup, NULL);
}
