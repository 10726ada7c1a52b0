/* adamw.cu - AdamW as kernels/cpu/adamw.c computes it (torch.optim.AdamW's single-tensor
 * path, fp32): the same scalars, computed on the host in double and rounded to fp32 where
 * torch rounds them, and the same element-wise order with the same explicit fmaf. With
 * IEEE division and square root (nvcc's default) and no other contraction (--fmad=false)
 * the result is the CPU backend's bit for bit.
 *
 * adamw_multi: the update of a list of tensors in as few launches as the kernel's arguments
 * allow (MT_MAX tensors each, every block taking MT_CHUNK elements of one tensor), each
 * block first deciding from the device scalars (the squared gradient norm, the finiteness
 * flag) whether the step is skipped and by what factor the gradients are clipped, in double
 * as the host would (IEEE sqrt and division, no contraction): nothing is read by the host.
 * The gradient is multiplied by that factor (1 when not clipping, which changes no bit)
 * before adamw's arithmetic, so that a tensor ends as scale then adamw leave it.
 *
 * bf16 parameters (param, m, v bf16; grad fp32 or bf16): kernels/cpu/adamw.c's bf16 step, op for op
 * (each of torch's tensor ops in fp32, rounded to bf16; the same fmaf, eps rounded to bf16),
 * so that the CPU and CUDA backends agree to the bit here too. That is torch's CPU
 * arithmetic: torch's CUDA AdamW (the foreach path) runs the same sequence of ops
 * (_foreach_mul_, _foreach_lerp_, _foreach_mul_, _foreach_addcmul_, _foreach_sqrt,
 * _foreach_div_, _foreach_add_, _foreach_addcdiv_, each rounded to bf16) but keeps eps in
 * fp32 in _foreach_add_ and computes addcmul and addcdiv as fma(value, t1 op t2, self), so
 * torch on a GPU differs from torch on the CPU (and from am) in the last bits of a few
 * elements, mostly where eps matters. A list may mix fp32 and bf16 tensors: each block takes
 * its tensor's path.
 *
 * A tensor with te & AM_TE_ADAM takes Transformer Engine's FusedAdam arithmetic, as
 * kernels/cpu/adamw.c writes it out (from TE's multi_tensor/adam.cu): fp32 throughout, no
 * contraction (--fmad=false; TE's own build contracts where nvcc chooses), param, m and v each
 * fp32 or bf16 (the gradient bf16 too with AM_TE_GRAD_BF16; the master kept as a bf16
 * parameter and its remainder with store_param_remainders), so that both backends agree to
 * the bit. */
#include <math.h>
#include <string.h>

#include "common.cuh"

struct adamw_scalars {
    float decay, w1, w1_minus_1, b2, c2, bc2_sqrt, eps, neg_step;
};

/* element i of one tensor, its gradient multiplied by gs first */
__device__ __forceinline__ void adamw_elem(float *p, const float *g, float *m, float *v, const struct adamw_scalars &k,
                                           float gs, int64_t i)
{
    float gi = g[i] * gs;
    float pi = p[i] * k.decay;
    float mi = k.w1 < 0.5f ? fmaf(k.w1, gi - m[i], m[i]) : fmaf(k.w1_minus_1, gi - m[i], gi);
    float vi = fmaf(k.c2 * gi, gi, v[i] * k.b2);
    float denom = sqrtf(vi) / k.bc2_sqrt + k.eps;
    p[i] = pi + (k.neg_step * mi) / denom;
    m[i] = mi;
    v[i] = vi;
}

/* element i of an fp32 or (bf) a bf16 tensor, widened to fp32 */
__device__ __forceinline__ float te_ld(const void *x, bool bf, int64_t i)
{
    return bf ? am_ld((const am_bf16_t *)x, i) : am_ld((const float *)x, i);
}

/* element i of a bf16 parameter, op for op as kernels/cpu/adamw.c's adamw_block_bf16: each
 * tensor op's result rounded to bf16 (am_round_bf16); eps16 is eps rounded to bf16; the
 * gradient fp32 or (g16) bf16 */
__device__ __forceinline__ void adamw_elem_bf16(am_bf16_t *p, const void *g, bool g16, am_bf16_t *m, am_bf16_t *v,
                                                const struct adamw_scalars &k, float gs, float eps16, int64_t i)
{
    float gi = am_round_bf16(am_round_bf16(te_ld(g, g16, i)) * gs);
    float pi = am_round_bf16(am_ld(p, i) * k.decay);
    float m0 = am_ld(m, i);
    float mi = am_round_bf16(k.w1 < 0.5f ? fmaf(k.w1, gi - m0, m0) : fmaf(k.w1_minus_1, gi - m0, gi));
    float vi = am_round_bf16(am_ld(v, i) * k.b2);
    vi = am_round_bf16(fmaf(k.c2 * gi, gi, vi));
    float denom = am_round_bf16(am_round_bf16(am_round_bf16(sqrtf(vi)) / k.bc2_sqrt) + eps16);
    am_st(p, i, pi + (k.neg_step * mi) / denom);
    am_st(m, i, mi);
    am_st(v, i, vi);
}

/* Transformer Engine's FusedAdam: its scalars as the floats its kernel takes */
struct te_scalars {
    float lr, b1, b2, c1, c2, bc1, bc2, eps, decay;
};

__device__ __forceinline__ void te_st(void *x, bool bf, int64_t i, float f)
{
    if (bf)
        am_st((am_bf16_t *)x, i, f);
    else
        am_st((float *)x, i, f);
}

/* element i, as kernels/cpu/adamw.c's te_block; rem: the masters' remainders (pd then holds the
 * bf16 parameters: kernels.h, am_adamw_tensor.rem), or NULL */
__device__ __forceinline__ void te_elem(void *pd, uint16_t *rem, const void *g, bool g16, void *md, void *vd, bool pb,
                                        bool mb, bool vb, unsigned te, const struct te_scalars &k, float gs, int64_t i)
{
    bool l2 = te & AM_TE_L2;
    float bc1 = te & AM_TE_NO_BIAS_CORR ? 1.0f : k.bc1, bc2 = te & AM_TE_NO_BIAS_CORR ? 1.0f : k.bc2;
    float g0 = te_ld(g, g16, i);
    float gi = te & AM_TE_GRAD_BF16 ? am_round_bf16(am_round_bf16(g0) * gs) : g0 * gs;
    float p, m = te_ld(md, mb, i), v = te_ld(vd, vb, i);
    if (rem) { /* half.h's am_te_master_join, on the device */
        uint16_t hi = ((const uint16_t *)pd)[i], lo = rem[i];
        p = __uint_as_float(((uint32_t)(uint16_t)(hi - ((lo & 0x8000u) ? 1u : 0u)) << 16) | lo);
    } else {
        p = te_ld(pd, pb, i);
    }
    if (l2)
        gi = gi + (k.decay * p);
    m = k.b1 * m + k.c1 * gi;
    v = k.b2 * v + k.c2 * gi * gi;
    float m_hat = m / bc1, v_hat = v / bc2;
    float denom = sqrtf(v_hat) + k.eps;
    float update = l2 ? m_hat / denom : (m_hat / denom) + (k.decay * p);
    p = p - (k.lr * update);
    if (rem) { /* half.h's am_te_master_split */
        uint32_t u = __float_as_uint(p);
        rem[i] = (uint16_t)(u & 0xffffu);
        ((uint16_t *)pd)[i] = (uint16_t)((u >> 16) + ((u & 0x8000u) ? 1u : 0u));
    } else {
        te_st(pd, pb, i, p);
    }
    te_st(md, mb, i, m);
    te_st(vd, vb, i, v);
}

static struct te_scalars te_scalars_for(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step)
{
    struct te_scalars k;
    k.lr = lr;
    k.b1 = beta1;
    k.b2 = beta2;
    k.c1 = 1.0f - beta1;
    k.c2 = 1.0f - beta2;
    k.bc1 = (float)(1.0 - pow((double)beta1, (double)step));
    k.bc2 = (float)(1.0 - pow((double)beta2, (double)step));
    k.eps = eps;
    k.decay = weight_decay;
    return k;
}

__global__ void adamw_k(float *p, const float *g, float *m, float *v, struct adamw_scalars k, int64_t n)
{
    AM_GRID_STRIDE(i, n) adamw_elem(p, g, m, v, k, 1.0f, i);
}

__global__ void adamw_bf16_k(am_bf16_t *p, const void *g, bool g16, am_bf16_t *m, am_bf16_t *v,
                             struct adamw_scalars k, int64_t n)
{
    float eps16 = am_round_bf16(k.eps);
    AM_GRID_STRIDE(i, n) adamw_elem_bf16(p, g, g16, m, v, k, 1.0f, eps16, i);
}

/* torch's scalars, from Python floats (double) rounded where they meet fp32 tensors */
static struct adamw_scalars adamw_scalars_for(const char *kn, float lr, float beta1, float beta2, float eps,
                                              float weight_decay, int64_t step)
{
    AM_CUDA_REQUIRE(kn, step >= 1, "step %lld: AdamW's bias correction counts steps from 1", (long long)step);
    double lr_d = lr, b1 = beta1, b2 = beta2;
    double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    struct adamw_scalars k;
    k.decay = (float)(1.0 - lr_d * (double)weight_decay);
    k.w1 = (float)(1.0 - b1);
    k.w1_minus_1 = k.w1 - 1.0f;
    k.b2 = beta2;
    k.c2 = (float)(1.0 - b2);
    k.bc2_sqrt = (float)sqrt(bc2);
    k.eps = eps;
    k.neg_step = (float)-(lr_d / bc1);
    return k;
}

/* param, m and v all f32 or all bf16, grad f32 (or bf16 for bf16 parameters: kernels.h) */
static int64_t adamw_check(const char *kn, const struct am_tensor *param, const struct am_tensor *grad,
                           const struct am_tensor *m, const struct am_tensor *v)
{
    if (param && param->dtype == AM_BF16) { /* bf16 storage: bf16 moments, an fp32 or bf16 gradient */
        am_cuda_tensor(kn, "param", param);
        const struct am_tensor *mv[2] = {m, v};
        for (int j = 0; j < 2; j++) {
            am_cuda_tensor(kn, j ? "v" : "m", mv[j]);
            if (mv[j]->dtype != AM_BF16)
                am_cuda_fatal(kn, "%s (%s) is %s but param (%s) is bf16: Adam's moments have the parameter's dtype "
                              "(torch.optim.AdamW on bf16 parameters keeps exp_avg and exp_avg_sq in bf16)",
                              j ? "v" : "m", am_tname(mv[j]), am_dtype_name(mv[j]->dtype), am_tname(param));
        }
        am_cuda_tensor(kn, "grad", grad);
        if (grad->dtype != AM_F32 && grad->dtype != AM_BF16)
            am_cuda_fatal(kn, "grad (%s) is %s; the gradient of a bf16 parameter is fp32 (rounded to bf16 by the "
                          "step as FSDP2's cast does) or bf16", am_tname(grad), am_dtype_name(grad->dtype));
    } else {
        if (param && param->dtype != AM_F32) {
            am_cuda_tensor(kn, "param", param);
            am_cuda_fatal(kn, "param (%s) is %s; AdamW steps fp32 or bf16 parameters", am_tname(param),
                          am_dtype_name(param->dtype));
        }
        am_cuda_data(kn, "param", param, AM_F32);
        am_cuda_data(kn, "m", m, AM_F32);
        am_cuda_data(kn, "v", v, AM_F32);
        am_cuda_data(kn, "grad", grad, AM_F32);
    }
    int64_t n = am_tensor_numel(param);
    AM_CUDA_REQUIRE(kn, am_tensor_numel(grad) == n && am_tensor_numel(m) == n && am_tensor_numel(v) == n,
                    "param (%s), grad, m and v must have the same number of elements", am_tname(param));
    return n;
}

/* a TE tensor: param, m and v each fp32 or bf16, grad fp32 (bf16 with AM_TE_GRAD_BF16) */
static void te_check(const char *kn, const struct am_adamw_tensor *t)
{
    const struct am_tensor *pmv[3] = {t->param, t->m, t->v};
    const char *names[3] = {"param", "m", "v"};
    for (int j = 0; j < 3; j++) {
        am_cuda_tensor(kn, names[j], pmv[j]);
        if (pmv[j]->dtype != AM_F32 && pmv[j]->dtype != AM_BF16)
            am_cuda_fatal(kn, "%s (%s) is %s; FusedAdam's arithmetic steps fp32 or bf16 masters and moments",
                          names[j], am_tname(pmv[j]), am_dtype_name(pmv[j]->dtype));
    }
    am_cuda_tensor(kn, "grad", t->grad);
    if (t->grad->dtype != AM_F32 && !(t->grad->dtype == AM_BF16 && (t->te & AM_TE_GRAD_BF16)))
        am_cuda_fatal(kn, "grad (%s) is %s; FusedAdam's gradient is fp32, or bf16 for bf16 model parameters "
                      "(AM_TE_GRAD_BF16)", am_tname(t->grad), am_dtype_name(t->grad->dtype));
    int64_t n = am_tensor_numel(t->param);
    AM_CUDA_REQUIRE(kn, am_tensor_numel(t->grad) == n && am_tensor_numel(t->m) == n && am_tensor_numel(t->v) == n,
                    "param (%s), grad, m and v must have the same number of elements", am_tname(t->param));
    if (t->rem) {
        am_cuda_tensor(kn, "rem", t->rem);
        AM_CUDA_REQUIRE(kn, t->param->dtype == AM_BF16 && t->rem->dtype == AM_BF16 && am_tensor_numel(t->rem) == n,
                        "rem (%s): a master kept as remainders takes a bf16 param (%s is %s) and %lld 16-bit "
                        "remainders", am_tname(t->rem), am_tname(t->param), am_dtype_name(t->param->dtype),
                        (long long)n);
    }
}

void am_cuda_adamw(const struct am_dev *d, struct am_tensor *param, const struct am_tensor *grad, struct am_tensor *m,
                   struct am_tensor *v, float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step)
{
    const char *kn = "am_cuda_adamw";
    am_cuda_ctx(kn, d);
    int64_t n = adamw_check(kn, param, grad, m, v);
    struct adamw_scalars k = adamw_scalars_for(kn, lr, beta1, beta2, eps, weight_decay, step);
    if (!n)
        return;
    if (param->dtype == AM_BF16)
        adamw_bf16_k<<<am_blocks(n), AM_THREADS, 0, am_cuda_stream(d)>>>(
            (am_bf16_t *)param->data, grad->data, grad->dtype == AM_BF16, (am_bf16_t *)m->data, (am_bf16_t *)v->data, k,
            n);
    else
        adamw_k<<<am_blocks(n), AM_THREADS, 0, am_cuda_stream(d)>>>((float *)param->data, (const float *)grad->data,
                                                                   (float *)m->data, (float *)v->data, k, n);
    AM_LAUNCHED(kn);
}

/* ---- adamw_multi ---- */
#define MT_MAX 32         /* tensors per launch: 2 KB of kernel arguments */
#define MT_CHUNK 16384    /* elements per block */

struct adamw_list {
    void *p[MT_MAX], *m[MT_MAX], *v[MT_MAX]; /* float, or am_bf16_t where bf16[i] */
    uint16_t *rem[MT_MAX];                   /* the masters' remainders, or NULL */
    const void *g[MT_MAX]; /* float, or am_bf16_t where g16[i] */
    int64_t n[MT_MAX];
    int64_t first_block[MT_MAX + 1]; /* tensor i's blocks are first_block[i] .. first_block[i + 1] - 1 */
    bool bf16[MT_MAX];
    bool m16[MT_MAX], v16[MT_MAX]; /* TE's tensors: m, v bf16 */
    bool g16[MT_MAX];              /* the gradient bf16 */
    unsigned char te[MT_MAX];      /* am_adamw_tensor.te */
    int count;
};

/* whether the step is taken, and the gradients' factor: kernels.h's rule, in double */
__device__ static bool step_factor(const double *ss64, const float *ss32, double max_norm, const int32_t *finite, float *gs)
{
    bool ok = !finite || *finite != 0;
    *gs = 1.0f;
    if (ss64 || ss32) {
        double ss = ss64 ? *ss64 : (double)*ss32;
        ok = ok && isfinite(ss);
        if (max_norm > 0) {
            double coef = max_norm / (sqrt(ss) + 1e-6);
            if (coef < 1.0)
                *gs = (float)coef;
        }
    }
    return ok;
}

__global__ void adamw_multi_k(struct adamw_list l, struct adamw_scalars k, struct te_scalars tk, const double *ss64,
                              const float *ss32, double max_norm, const int32_t *finite)
{
    __shared__ float gs_sh;
    __shared__ bool ok_sh;
    if (threadIdx.x == 0)
        ok_sh = step_factor(ss64, ss32, max_norm, finite, &gs_sh);
    __syncthreads();
    if (!ok_sh)
        return;
    float gs = gs_sh;
    int64_t b = blockIdx.x;
    int t = 0;
    while (t + 1 < l.count && b >= l.first_block[t + 1])
        t++;
    int64_t lo = (b - l.first_block[t]) * MT_CHUNK, hi = lo + MT_CHUNK < l.n[t] ? lo + MT_CHUNK : l.n[t];
    if (l.te[t] & AM_TE_ADAM) {
        for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
            te_elem(l.p[t], l.rem[t], l.g[t], l.g16[t], l.m[t], l.v[t], l.bf16[t], l.m16[t], l.v16[t], l.te[t], tk, gs, i);
        return;
    }
    if (l.bf16[t]) {
        float eps16 = am_round_bf16(k.eps);
        for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
            adamw_elem_bf16((am_bf16_t *)l.p[t], l.g[t], l.g16[t], (am_bf16_t *)l.m[t], (am_bf16_t *)l.v[t], k, gs,
                            eps16, i);
        return;
    }
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
        adamw_elem((float *)l.p[t], (const float *)l.g[t], (float *)l.m[t], (float *)l.v[t], k, gs, i);
}

void am_cuda_adamw_multi(const struct am_dev *d, const struct am_adamw_tensor *list, int n, const struct am_tensor *sumsq,
                         double max_norm, const struct am_tensor *finite, float lr, float beta1, float beta2, float eps,
                         float weight_decay, int64_t step)
{
    const char *kn = "am_cuda_adamw_multi";
    am_cuda_ctx(kn, d);
    AM_CUDA_REQUIRE(kn, n >= 0 && (n == 0 || list), "a list of %d tensors", n);
    for (int i = 0; i < n; i++) {
        if (list[i].te & AM_TE_ADAM)
            te_check(kn, &list[i]);
        else {
            AM_CUDA_REQUIRE(kn, !list[i].rem, "param (%s): remainders (rem) are FusedAdam's (AM_TE_ADAM)",
                            am_tname(list[i].param));
            adamw_check(kn, list[i].param, list[i].grad, list[i].m, list[i].v);
        }
    }
    AM_CUDA_REQUIRE(kn, max_norm <= 0 || sumsq, "clipping to max_norm %g needs the squared gradient norm (sumsq)",
                    max_norm);
    struct adamw_scalars k = adamw_scalars_for(kn, lr, beta1, beta2, eps, weight_decay, step);
    struct te_scalars tk = te_scalars_for(lr, beta1, beta2, eps, weight_decay, step);
    const double *ss64 = NULL;
    const float *ss32 = NULL;
    if (sumsq) {
        if (sumsq->dtype == AM_F32)
            ss32 = (const float *)am_cuda_scalar(kn, "sumsq", sumsq, AM_F32);
        else
            ss64 = (const double *)am_cuda_scalar(kn, "sumsq", sumsq, AM_F64);
    }
    const int32_t *fl = finite ? (const int32_t *)am_cuda_scalar(kn, "finite", finite, AM_I32) : NULL;
    struct adamw_list l;
    memset(&l, 0, sizeof l);
    int64_t blocks = 0;
    for (int i = 0; i <= n; i++) {
        int64_t ni = i < n ? am_tensor_numel(list[i].param) : 0;
        int64_t bi = (ni + MT_CHUNK - 1) / MT_CHUNK;
        AM_CUDA_REQUIRE(kn, bi <= INT32_MAX, "param (%s) has %lld elements: at most %lld in one tensor",
                        am_tname(list[i].param), (long long)ni, (long long)INT32_MAX * MT_CHUNK);
        if (l.count > 0 && (i == n || l.count == MT_MAX || blocks + bi > INT32_MAX)) { /* launch what is listed */
            l.first_block[l.count] = blocks;
            adamw_multi_k<<<(unsigned)blocks, AM_THREADS, 0, am_cuda_stream(d)>>>(l, k, tk, ss64, ss32, max_norm, fl);
            AM_LAUNCHED(kn);
            memset(&l, 0, sizeof l);
            blocks = 0;
        }
        if (i == n || ni == 0)
            continue;
        l.p[l.count] = list[i].param->data;
        l.rem[l.count] = list[i].rem ? (uint16_t *)list[i].rem->data : NULL;
        l.g[l.count] = list[i].grad->data;
        l.g16[l.count] = list[i].grad->dtype == AM_BF16;
        l.m[l.count] = list[i].m->data;
        l.v[l.count] = list[i].v->data;
        l.bf16[l.count] = list[i].param->dtype == AM_BF16;
        l.m16[l.count] = list[i].m->dtype == AM_BF16;
        l.v16[l.count] = list[i].v->dtype == AM_BF16;
        l.te[l.count] = (unsigned char)list[i].te;
        l.n[l.count] = ni;
        l.first_block[l.count] = blocks;
        l.count++;
        blocks += bi;
    }
}
