/* test_adamw.c - the CPU kernels' tests (kernels_test.h: how they are tested): AdamW and its
 * multi-tensor step.
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adamw),
        cmocka_unit_test(test_adamw_multi),
    };
    return cmocka_run_group_tests_name("kernels (cpu): adamw", tests, kernels_test_setup, NULL);
}
