/* adamw.cu - AdamW as kernels/cpu/adamw.c computes it (torch.optim.AdamW's single-tensor
 * path, fp32): the same scalars, computed on the host in double and rounded to fp32 where
 * torch rounds them, and the same element-wise order with the same explicit fmaf. With
 * IEEE division and square root (nvcc's default) and no other contraction (--fmad=false)
 * the result is the CPU backend's bit for bit.
 *
 * Multi-tensor: one call updates one tensor (the table's signature); a caller with many
 * small tensors in one slab calls it once on the slab. */
#include <math.h>

#include "common.cuh"

struct adamw_scalars {
    float decay, w1, w1_minus_1, b2, c2, bc2_sqrt, eps, neg_step;
};

__global__ void adamw_k(float *p, const float *g, float *m, float *v, struct adamw_scalars k, int64_t n)
{
    AM_GRID_STRIDE(i, n)
    {
        float gi = g[i];
        float pi = p[i] * k.decay;
        float mi = k.w1 < 0.5f ? fmaf(k.w1, gi - m[i], m[i]) : fmaf(k.w1_minus_1, gi - m[i], gi);
        float vi = fmaf(k.c2 * gi, gi, v[i] * k.b2);
        float denom = sqrtf(vi) / k.bc2_sqrt + k.eps;
        p[i] = pi + (k.neg_step * mi) / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

void am_cuda_adamw(const struct am_dev *d, struct am_tensor *param, const struct am_tensor *grad, struct am_tensor *m,
                   struct am_tensor *v, float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step)
{
    const char *kn = "am_cuda_adamw";
    am_cuda_ctx(kn, d);
    float *p = (float *)am_cuda_data(kn, "param", param, AM_F32), *md = (float *)am_cuda_data(kn, "m", m, AM_F32);
    float *vd = (float *)am_cuda_data(kn, "v", v, AM_F32);
    const float *g = (const float *)am_cuda_data(kn, "grad", grad, AM_F32);
    int64_t n = am_tensor_numel(param);
    AM_CUDA_REQUIRE(kn, am_tensor_numel(grad) == n && am_tensor_numel(m) == n && am_tensor_numel(v) == n,
                    "param (%s), grad, m and v must have the same number of elements", am_tname(param));
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
    if (!n)
        return;
    adamw_k<<<am_blocks(n), AM_THREADS, 0, am_cuda_stream(d)>>>(p, g, md, vd, k, n);
    AM_LAUNCHED(kn);
}
