/* adamw.c - AdamW exactly as torch.optim.AdamW's single-tensor path computes it (fp32
 * tensors, Python-float hyper-parameters; bf16 tensors: below), operation by operation:
 *
 *   param.mul_(1 - lr * weight_decay)
 *   exp_avg.lerp_(grad, 1 - beta1)                 m += (1 - beta1) * (g - m)
 *   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
 *   bias_correction1 = 1 - beta1 ** step,  bias_correction2 = 1 - beta2 ** step
 *   step_size = lr / bias_correction1
 *   denom = (exp_avg_sq.sqrt() / sqrt(bias_correction2)).add_(eps)
 *   param.addcdiv_(exp_avg, denom, value=-step_size)
 *
 * Scalar arithmetic is done in double (Python floats) and each scalar is rounded to fp32
 * where torch hands it to an fp32 kernel; the element-wise arithmetic is fp32 in the order
 * of torch's vectorised CPU kernels, which fuse two of the steps into one rounding (fmaf):
 *   lerp (weight < 0.5):   fma(weight, end - start, start)
 *   lerp (weight >= 0.5):  fma(weight - 1, end - start, end)
 *   addcmul:               fma(value * t1, t2, self)
 *   addcdiv:               self + (value * t1) / t2
 * With those, the result is torch's to the bit (checked against torch 2.15: 99.996% of the
 * parameters bitwise equal after a step, the rest within an ulp). fmaf is one instruction
 * in the AVX2 and AVX-512 clones; the baseline clone calls libm's (exact, slower).
 *
 * adamw_multi: the same update over a list of tensors, each gradient element first
 * multiplied by the clipping factor gs (1 when not clipping: x * 1 is x, bit for bit, so
 * adamw is adamw_multi's loop with gs = 1), the factor and the skip of a non-finite step
 * decided from the device scalars as kernels.h says (here they are host memory).
 *
 * bf16 parameters (param, m and v all bf16, grad fp32 or bf16): torch.optim.AdamW on bf16 storage
 * as NeMo AutoModel trains with FSDP2 (its moments take the parameter's dtype), each tensor
 * op's result rounded to bf16 (nearest even), the arithmetic inside an op in fp32 as torch's
 * CPU kernels do it for bf16 (widen, compute in float, narrow once):
 *
 *   g = bf16(grad)                              FSDP2's cast of the reduced gradient (a bf16
 *                                               gradient, FSDP2's sharded .grad, is that already:
 *                                               the same step as its fp32 value would give)
 *   g = bf16(g * gs)                            the clipping (x * 1 is x: no-op unclipped)
 *   p = bf16(p * decay)                         mul_: the scalar as an fp32 float
 *   m = bf16(lerp(m, g, w1))                    lerp_: the fp32 path's two fma branches
 *   v = bf16(v * beta2)                         mul_
 *   v = bf16(fma(c2 * g, g, v))                 addcmul_: (value * t1) * t2 + self, fused
 *   d = bf16(bf16(bf16(sqrt(v)) / bc2_sqrt) + bf16(eps))
 *                                               sqrt, div (true division), add_: add_ hands
 *                                               its scalar over as a bf16 tensor, so eps is
 *                                               rounded to bf16 first (mul_ and div do not)
 *   p = bf16(p + (neg_step * m) / d)            addcdiv_
 *
 * Checked against torch 2.15 (CPU, AVX2 build, foreach=False, 1 and 2 threads): 180 steps of
 * 6 hyper-parameter sets (beta1 0.9, 0.95, 0.5, 0.3 and 0 for both lerp branches, weight decay
 * 0 to 0.3, eps 1e-8 to 1e-3, clipping factors 1, 0.8, 0.37, 0.01, steps 1 to 2000, tensors of
 * 37, 1000 and 100003 elements, gradients from 1e-7 to 1), each step from torch's own state,
 * then 120 more on 4 threads and 5 to 65537 elements: 8,030,130 elements, param, exp_avg and
 * exp_avg_sq 100% bitwise equal (tests/kernels/adamw_bf16_torch.py and test_adamw check it
 * again). Without eps's rounding to bf16, 0.42% of the parameters differ (where eps matters);
 * with addcmul unfused, 0.0006% of exp_avg_sq; with addcdiv as fma(value, t1 / t2, self),
 * 0.0003% of the parameters. torch's CUDA foreach path rounds differently (_foreach_add_ keeps
 * eps in fp32; _foreach_addcmul_ and _foreach_addcdiv_ compute fma(value, t1 op t2, self));
 * kernels/cuda/adamw.cu computes this file's arithmetic, as it does for fp32.
 *
 * Transformer Engine's FusedAdam (a tensor with te & AM_TE_ADAM, kernels.h): the functors of
 * TransformerEngine's transformer_engine/common/multi_tensor/adam.cu (AdamFunctor,
 * AdamFunctorMaster, AdamFunctorMasterParamRemainder: one formula; multi_tensor_adam_cuda
 * computes the bias corrections; read at TransformerEngine d0067d0, 2026-08, with
 * transformer_engine/pytorch/optimizers/fused_adam.py for the options), with the scalars as
 * the floats its kernel takes (lr, beta1, beta2, eps, decay) and every value widened to fp32
 * (MATH_T float):
 *
 *   g   = grad                                    (bf16 model parameters: bf16(grad), then
 *                                                  bf16(g * gs) when clipped; else g * gs; the
 *                                                  gradient may then be bf16 itself)
 *   bc1 = 1 - beta1^step, bc2 = 1 - beta2^step    std::pow(float, int) in double, then fp32;
 *                                                  1 with bias_correction false
 *   L2 (adam_w_mode false):  g = g + (decay * p)
 *   m = beta1 * m + (1 - beta1) * g               (1 - beta1) in fp32
 *   v = beta2 * v + (1 - beta2) * g * g           ((1 - beta2) * g) * g
 *   m_hat = m / bc1,  v_hat = v / bc2
 *   denom = sqrtf(v_hat) + eps
 *   update = m_hat / denom                        AdamW: (m_hat / denom) + (decay * p)
 *   p = p - (lr * update)
 *
 * each op rounded to fp32, in that order; then p (the master), m and v stored, each rounded
 * once to its dtype (fp32, or bf16 nearest even as static_cast<bf16> and torch's copy_ round
 * TE's bf16 states). TE's own build is nvcc's default --fmad=true, which may contract
 * beta1 * m + (1 - beta1) * g and the like into fmas where the compiler chooses: this file
 * computes the source's arithmetic without contraction, so TE on a GPU may differ from it in
 * the last bit of such an op (tests/kernels/test_adamw.c checks it bit for bit against a
 * numpy float32 transcription of the functor, tests/kernels/adamw_te_ref.py).
 * With remainders (store_param_remainders, AdamFunctorMasterParamRemainder) p is the master
 * rebuilt from the bf16 parameter and its remainder, and the new master is split back into
 * the two (half.h, am_te_master_split: its high half rounded ties away from zero, as TE's
 * "round up" of the parameter when the remainder's top bit is set), bit for bit the master a
 * separate fp32 master would hold (test_adamw).
 */
#include <math.h>

#include "cpu.h"

struct adamw_scalars {
    float decay, w1, b2, c2, bc2_sqrt, eps, neg_step;
    float gs; /* the gradients' factor (clipping), 1 otherwise */
};

AM_HOT static void adamw_block(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                               struct adamw_scalars k, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i] * k.gs;
        float pi = p[i] * k.decay;
        float mi = fmaf(k.w1, gi - m[i], m[i]);
        float vi = fmaf(k.c2 * gi, gi, v[i] * k.b2);
        float denom = sqrtf(vi) / k.bc2_sqrt + k.eps;
        p[i] = pi + (k.neg_step * mi) / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

/* The same with torch's other lerp branch (weight >= 0.5, i.e. beta1 <= 0.5). */
AM_HOT static void adamw_block_lowbeta(float *restrict p, const float *restrict g, float *restrict m,
                                       float *restrict v, struct adamw_scalars k, float w1_minus_1, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i] * k.gs;
        float pi = p[i] * k.decay;
        float mi = fmaf(w1_minus_1, gi - m[i], gi);
        float vi = fmaf(k.c2 * gi, gi, v[i] * k.b2);
        float denom = sqrtf(vi) / k.bc2_sqrt + k.eps;
        p[i] = pi + (k.neg_step * mi) / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

#define ADAMW_BLOCK 16384

/* torch's scalars, from Python floats (double) rounded where they meet fp32 tensors */
static struct adamw_scalars adamw_scalars(const char *kernel, float lr, float beta1, float beta2, float eps,
                                          float weight_decay, int64_t step)
{
    if (step < 1)
        am_cpu_fatal(kernel, "step %lld: AdamW's bias correction counts steps from 1", (long long)step);
    double lr_d = lr, b1 = beta1, b2 = beta2;
    double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    double w1 = 1.0 - b1;
    struct adamw_scalars k = {
        .decay = (float)(1.0 - lr_d * (double)weight_decay),
        .w1 = (float)w1,
        .b2 = beta2,
        .c2 = (float)(1.0 - b2),
        .bc2_sqrt = (float)sqrt(bc2),
        .eps = eps,
        .neg_step = (float)-(lr_d / bc1),
        .gs = 1.0f,
    };
    return k;
}

static void adamw_check(const char *kernel, const struct am_tensor *param, const struct am_tensor *grad,
                        const struct am_tensor *m, const struct am_tensor *v)
{
    if (param && param->dtype == AM_BF16) { /* bf16 storage: bf16 moments, an fp32 or bf16 gradient */
        am_cpu_check(kernel, "param", param);
        const struct am_tensor *mv[2] = {m, v};
        for (int j = 0; j < 2; j++) {
            am_cpu_check(kernel, j ? "v" : "m", mv[j]);
            if (mv[j]->dtype != AM_BF16)
                am_cpu_fatal(kernel, "%s (%s) is %s but param (%s) is bf16: Adam's moments have the parameter's dtype "
                             "(torch.optim.AdamW on bf16 parameters keeps exp_avg and exp_avg_sq in bf16)",
                             j ? "v" : "m", am_tname(mv[j]), am_dtype_name(mv[j]->dtype), am_tname(param));
        }
        am_cpu_check(kernel, "grad", grad);
        if (grad->dtype != AM_F32 && grad->dtype != AM_BF16)
            am_cpu_fatal(kernel, "grad (%s) is %s; the gradient of a bf16 parameter is fp32 (rounded to bf16 by the "
                         "step as FSDP2's cast does) or bf16", am_tname(grad), am_dtype_name(grad->dtype));
    } else {
        if (param && param->dtype != AM_F32) {
            am_cpu_check(kernel, "param", param);
            am_cpu_fatal(kernel, "param (%s) is %s; AdamW steps fp32 or bf16 parameters", am_tname(param),
                         am_dtype_name(param->dtype));
        }
        am_cpu_f32(kernel, "param", param);
        am_cpu_f32(kernel, "m", m);
        am_cpu_f32(kernel, "v", v);
        am_cpu_f32(kernel, "grad", grad);
    }
    int64_t n = am_tensor_numel(param);
    if (am_tensor_numel(grad) != n || am_tensor_numel(m) != n || am_tensor_numel(v) != n)
        am_cpu_fatal(kernel, "param (%s), grad, m and v must have the same number of elements", am_tname(param));
}

static void adamw_run(float *p, const float *g, float *md, float *vd, struct adamw_scalars k, int64_t n)
{
    float w1_minus_1 = k.w1 - 1.0f;
    int64_t nb = (n + ADAMW_BLOCK - 1) / ADAMW_BLOCK;
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * ADAMW_BLOCK, len = n - lo < ADAMW_BLOCK ? n - lo : ADAMW_BLOCK;
        if (k.w1 < 0.5f)
            adamw_block(p + lo, g + lo, md + lo, vd + lo, k, len);
        else
            adamw_block_lowbeta(p + lo, g + lo, md + lo, vd + lo, k, w1_minus_1, len);
    }
}

/* ---- bf16 storage ---- */

/* x rounded to bf16 and widened back: a torch op's bf16 result, as the next op reads it */
AM_INLINE float rb(float x) { return am_bf16_to_f32(am_f32_to_bf16(x)); }

/* element i of an fp32 or (bf) a bf16 tensor, widened to fp32 */
AM_INLINE float ld(const void *x, bool bf, int64_t i)
{
    return bf ? am_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* g: fp32, or (g16) bf16: rb(g) is then g itself, the step the same bit for bit */
AM_HOT static void adamw_block_bf16(uint16_t *restrict p, const void *restrict g, bool g16, uint16_t *restrict m,
                                    uint16_t *restrict v, struct adamw_scalars k, float eps_bf16, int64_t n)
{
    bool small = k.w1 < 0.5f; /* torch's lerp branch (is_lerp_weight_small) */
    float coef = small ? k.w1 : k.w1 - 1.0f;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float gi = rb(rb(ld(g, g16, i)) * k.gs);
        float pi = rb(am_bf16_to_f32(p[i]) * k.decay);
        float m0 = am_bf16_to_f32(m[i]);
        float mi = rb(fmaf(coef, gi - m0, small ? m0 : gi));
        float vi = rb(am_bf16_to_f32(v[i]) * k.b2);
        vi = rb(fmaf(k.c2 * gi, gi, vi));
        float denom = rb(rb(rb(sqrtf(vi)) / k.bc2_sqrt) + eps_bf16);
        p[i] = am_f32_to_bf16(pi + (k.neg_step * mi) / denom);
        m[i] = am_f32_to_bf16(mi);
        v[i] = am_f32_to_bf16(vi);
    }
}

static void adamw_run_bf16(uint16_t *p, const void *g, bool g16, uint16_t *md, uint16_t *vd, struct adamw_scalars k,
                           int64_t n)
{
    float eps_bf16 = rb(k.eps);
    size_t gs = g16 ? 2 : 4;
    int64_t nb = (n + ADAMW_BLOCK - 1) / ADAMW_BLOCK;
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * ADAMW_BLOCK, len = n - lo < ADAMW_BLOCK ? n - lo : ADAMW_BLOCK;
        adamw_block_bf16(p + lo, (const char *)g + lo * gs, g16, md + lo, vd + lo, k, eps_bf16, len);
    }
}

/* ---- Transformer Engine's FusedAdam ---- */

struct te_scalars {
    float lr, b1, b2, c1, c2, bc1, bc2, eps, decay, gs;
};

static struct te_scalars te_scalars(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step,
                                    float gs, unsigned te)
{
    struct te_scalars k = {.lr = lr, .b1 = beta1, .b2 = beta2, .c1 = 1.0f - beta1, .c2 = 1.0f - beta2,
                           .bc1 = 1.0f, .bc2 = 1.0f, .eps = eps, .decay = weight_decay, .gs = gs};
    if (!(te & AM_TE_NO_BIAS_CORR)) {
        k.bc1 = (float)(1.0 - pow((double)beta1, (double)step));
        k.bc2 = (float)(1.0 - pow((double)beta2, (double)step));
    }
    return k;
}

AM_INLINE void te_st(void *x, bool bf, int64_t i, float f)
{
    if (bf)
        ((uint16_t *)x)[i] = am_f32_to_bf16(f);
    else
        ((float *)x)[i] = f;
}

/* rem: the masters' remainders (am_adamw_tensor.rem; pd then holds the bf16 parameters), or NULL */
static void te_block(void *pd, uint16_t *rem, const void *g, bool g16, void *md, void *vd, bool pb, bool mb, bool vb,
                     unsigned te, struct te_scalars k, int64_t n)
{
    bool l2 = te & AM_TE_L2, gb = te & AM_TE_GRAD_BF16;
    for (int64_t i = 0; i < n; i++) {
        float gi = gb ? rb(rb(ld(g, g16, i)) * k.gs) : ld(g, g16, i) * k.gs;
        float p = rem ? am_bits_f32(am_te_master_join(((uint16_t *)pd)[i], rem[i])) : ld(pd, pb, i);
        float m = ld(md, mb, i), v = ld(vd, vb, i);
        if (l2)
            gi = gi + (k.decay * p);
        m = k.b1 * m + k.c1 * gi;
        v = k.b2 * v + k.c2 * gi * gi;
        float m_hat = m / k.bc1, v_hat = v / k.bc2;
        float denom = sqrtf(v_hat) + k.eps;
        float update = l2 ? m_hat / denom : (m_hat / denom) + (k.decay * p);
        p = p - (k.lr * update);
        if (rem)
            am_te_master_split(am_f32_bits(p), (uint16_t *)pd + i, rem + i);
        else
            te_st(pd, pb, i, p);
        te_st(md, mb, i, m);
        te_st(vd, vb, i, v);
    }
}

static void te_tensor(const char *kernel, const struct am_adamw_tensor *t, struct te_scalars k)
{
    int64_t n = am_tensor_numel(t->param), nb = (n + ADAMW_BLOCK - 1) / ADAMW_BLOCK;
    bool pb = t->param->dtype == AM_BF16, mb = t->m->dtype == AM_BF16, vb = t->v->dtype == AM_BF16;
    char *p = am_cpu_data(kernel, "param", t->param, t->param->dtype), *m = am_cpu_data(kernel, "m", t->m, t->m->dtype),
         *v = am_cpu_data(kernel, "v", t->v, t->v->dtype);
    bool g16 = t->grad->dtype == AM_BF16;
    const char *g = am_cpu_data(kernel, "grad", t->grad, t->grad->dtype);
    uint16_t *rem = t->rem ? am_cpu_data(kernel, "rem", t->rem, AM_BF16) : NULL;
    size_t ps = pb ? 2 : 4, ms = mb ? 2 : 4, vs = vb ? 2 : 4, gs = g16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * ADAMW_BLOCK, len = n - lo < ADAMW_BLOCK ? n - lo : ADAMW_BLOCK;
        te_block(p + lo * ps, rem ? rem + lo : NULL, g + lo * gs, g16, m + lo * ms, v + lo * vs, pb, mb, vb, t->te, k,
                 len);
    }
}

/* a TE tensor: param, m and v each fp32 or bf16, grad fp32 (bf16 with AM_TE_GRAD_BF16) */
static void te_check(const char *kernel, const struct am_adamw_tensor *t)
{
    const struct am_tensor *pmv[3] = {t->param, t->m, t->v};
    const char *names[3] = {"param", "m", "v"};
    for (int j = 0; j < 3; j++) {
        am_cpu_check(kernel, names[j], pmv[j]);
        if (pmv[j]->dtype != AM_F32 && pmv[j]->dtype != AM_BF16)
            am_cpu_fatal(kernel, "%s (%s) is %s; FusedAdam's arithmetic steps fp32 or bf16 masters and moments",
                         names[j], am_tname(pmv[j]), am_dtype_name(pmv[j]->dtype));
    }
    am_cpu_check(kernel, "grad", t->grad);
    if (t->grad->dtype != AM_F32 && !(t->grad->dtype == AM_BF16 && (t->te & AM_TE_GRAD_BF16)))
        am_cpu_fatal(kernel, "grad (%s) is %s; FusedAdam's gradient is fp32, or bf16 for bf16 model parameters "
                     "(AM_TE_GRAD_BF16)", am_tname(t->grad), am_dtype_name(t->grad->dtype));
    int64_t n = am_tensor_numel(t->param);
    if (am_tensor_numel(t->grad) != n || am_tensor_numel(t->m) != n || am_tensor_numel(t->v) != n)
        am_cpu_fatal(kernel, "param (%s), grad, m and v must have the same number of elements", am_tname(t->param));
    if (t->rem) {
        am_cpu_check(kernel, "rem", t->rem);
        if (t->param->dtype != AM_BF16 || t->rem->dtype != AM_BF16 || am_tensor_numel(t->rem) != n)
            am_cpu_fatal(kernel, "rem (%s): a master kept as remainders takes a bf16 param (%s is %s) and %lld "
                         "16-bit remainders", am_tname(t->rem), am_tname(t->param), am_dtype_name(t->param->dtype),
                         (long long)n);
    }
}

/* one tensor of the list, on its dtype's path (adamw_check has checked it) */
static void adamw_tensor(const char *kernel, struct am_tensor *param, const struct am_tensor *grad, struct am_tensor *m,
                         struct am_tensor *v, struct adamw_scalars k)
{
    int64_t n = am_tensor_numel(param);
    if (param->dtype == AM_BF16)
        adamw_run_bf16(am_cpu_data(kernel, "param", param, AM_BF16), am_cpu_data(kernel, "grad", grad, grad->dtype),
                       grad->dtype == AM_BF16, am_cpu_data(kernel, "m", m, AM_BF16),
                       am_cpu_data(kernel, "v", v, AM_BF16), k, n);
    else
        adamw_run(am_cpu_f32(kernel, "param", param), am_cpu_f32(kernel, "grad", grad), am_cpu_f32(kernel, "m", m),
                  am_cpu_f32(kernel, "v", v), k, n);
}

void am_cpu_adamw(const struct am_dev *dev, struct am_tensor *param, const struct am_tensor *grad, struct am_tensor *m, struct am_tensor *v,
                  float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step)
{
    adamw_check(__func__, param, grad, m, v);
    struct adamw_scalars k = adamw_scalars(__func__, lr, beta1, beta2, eps, weight_decay, step);
    adamw_tensor(__func__, param, grad, m, v, k);
}

void am_cpu_adamw_multi(const struct am_dev *dev, const struct am_adamw_tensor *list, int n, const struct am_tensor *sumsq,
                        double max_norm, const struct am_tensor *finite, float lr, float beta1, float beta2, float eps,
                        float weight_decay, int64_t step)
{
    const char *kernel = __func__;
    AM_CHECK(n >= 0 && (n == 0 || list), "a list of %d tensors", n);
    for (int i = 0; i < n; i++) {
        if (list[i].te & AM_TE_ADAM)
            te_check(kernel, &list[i]);
        else {
            AM_CHECK(!list[i].rem, "param (%s): remainders (rem) are FusedAdam's (AM_TE_ADAM)", am_tname(list[i].param));
            adamw_check(kernel, list[i].param, list[i].grad, list[i].m, list[i].v);
        }
    }
    AM_CHECK(max_norm <= 0 || sumsq, "clipping to max_norm %g needs the squared gradient norm (sumsq)", max_norm);
    struct adamw_scalars k = adamw_scalars(kernel, lr, beta1, beta2, eps, weight_decay, step);
    bool ok = !finite || *(const int32_t *)am_cpu_data(kernel, "finite", finite, AM_I32) != 0;
    AM_CHECK(!finite || am_tensor_numel(finite) == 1, "finite (%s) has %lld elements; a device scalar has one",
             am_tname(finite), (long long)am_tensor_numel(finite));
    if (sumsq) {
        AM_CHECK(am_tensor_numel(sumsq) == 1, "sumsq (%s) has %lld elements; a device scalar has one", am_tname(sumsq),
                 (long long)am_tensor_numel(sumsq));
        double ss = sumsq->dtype == AM_F32 ? (double)*(const float *)am_cpu_data(kernel, "sumsq", sumsq, AM_F32)
                                           : *am_cpu_scalar_f64(kernel, "sumsq", sumsq);
        ok = ok && isfinite(ss);
        if (max_norm > 0) { /* kernels.h: the coefficient as the host computes it, in double */
            double coef = max_norm / (sqrt(ss) + 1e-6);
            if (coef < 1.0)
                k.gs = (float)coef;
        }
    }
    if (!ok)
        return; /* a non-finite step: nothing written */
    for (int i = 0; i < n; i++) {
        if (list[i].te & AM_TE_ADAM)
            te_tensor(kernel, &list[i], te_scalars(lr, beta1, beta2, eps, weight_decay, step, k.gs, list[i].te));
        else
            adamw_tensor(kernel, list[i].param, list[i].grad, list[i].m, list[i].v, k);
    }
}
