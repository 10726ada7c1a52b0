/* swiglu.c - the gated MLP's activation: out = silu(gate) * up, all [N, I].
 *
 *   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))          (torch's F.silu, in fp32)
 *   backward: dup   += dout * silu(g)
 *             dgate += dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
 *
 * bf16 (every tensor bf16): blocks widened, the fp32 loops, each output rounded once: out =
 * bf16(silu(g) * up) where torch in bf16 rounds silu(g) and then the product (two
 * roundings); the backward's dgate and dup are rounded once each after their fp32 +=.
 */
#include <omp.h>

#include "cpu.h"

static void check(const char *kernel, const struct am_tensor *a, const struct am_tensor *gate,
                  const struct am_tensor *up)
{
    if (am_tensor_numel(a) != am_tensor_numel(gate) || am_tensor_numel(up) != am_tensor_numel(gate))
        am_cpu_fatal(kernel, "gate (%s), up (%s) and %s must have the same shape (%lld, %lld, %lld elements)",
                     am_tname(gate), am_tname(up), am_tname(a), (long long)am_tensor_numel(gate),
                     (long long)am_tensor_numel(up), (long long)am_tensor_numel(a));
}

AM_HOT static void swiglu_fwd(float *restrict out, const float *restrict gate, const float *restrict up, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + am_expf(-g)) * up[i];
    }
}

/* dgate and dup may each be NULL (a frozen branch); the three cases are separate loops so
 * that each vectorises without masked stores. */
AM_HOT static void swiglu_bwd(float *restrict dgate, float *restrict dup, const float *restrict dout,
                              const float *restrict gate, const float *restrict up, int64_t n)
{
    if (dgate && dup) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float g = gate[i], den = 1.0f + am_expf(-g), sig = 1.0f / den;
            dup[i] += dout[i] * (g / den);
            dgate[i] += dout[i] * up[i] * (sig * (1.0f + g * (1.0f - sig)));
        }
    } else if (dgate) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float g = gate[i], sig = 1.0f / (1.0f + am_expf(-g));
            dgate[i] += dout[i] * up[i] * (sig * (1.0f + g * (1.0f - sig)));
        }
    } else if (dup) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float g = gate[i];
            dup[i] += dout[i] * (g / (1.0f + am_expf(-g)));
        }
    }
}

/* Big tensors go in blocks of this many elements, one block per task. */
#define SWIGLU_BLOCK 16384

/* bf16: the fp32 loops above on blocks of SWIGLU_BLOCK, one block per task as in fp32, each
 * block's operands widened into the thread's slice of the scratch and its outputs narrowed. */
static inline const float *blk(const struct am_tensor *t, int64_t lo, int64_t len, float *buf)
{
    am_bf16_widen1(buf, (const uint16_t *)t->data + lo, len);
    return buf;
}

static void swiglu_forward_bf16(const struct am_dev *dev, struct am_tensor *out, const struct am_tensor *gate,
                                const struct am_tensor *up)
{
    const char *kernel = "am_cpu_swiglu_forward";
    am_cpu_act(kernel, "gate", gate);
    am_cpu_same(kernel, "up", up, "gate", gate);
    am_cpu_same(kernel, "out", out, "gate", gate);
    check(kernel, out, gate, up);
    int64_t n = am_tensor_numel(out), nb = (n + SWIGLU_BLOCK - 1) / SWIGLU_BLOCK;
    float *ws = am_cpu_scratch(kernel, dev, (int64_t)omp_get_max_threads() * 3 * SWIGLU_BLOCK);
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * SWIGLU_BLOCK, len = n - lo < SWIGLU_BLOCK ? n - lo : SWIGLU_BLOCK;
        float *buf = ws + (size_t)omp_get_thread_num() * 3 * SWIGLU_BLOCK, *o = buf + 2 * SWIGLU_BLOCK;
        swiglu_fwd(o, blk(gate, lo, len, buf), blk(up, lo, len, buf + SWIGLU_BLOCK), len);
        am_bf16_narrow1((uint16_t *)out->data + lo, o, len);
    }
}

static void swiglu_backward_bf16(const struct am_dev *dev, struct am_tensor *dgate, struct am_tensor *dup,
                                 const struct am_tensor *dout, const struct am_tensor *gate, const struct am_tensor *up)
{
    const char *kernel = "am_cpu_swiglu_backward";
    am_cpu_act(kernel, "gate", gate);
    am_cpu_same(kernel, "up", up, "gate", gate);
    am_cpu_same(kernel, "dout", dout, "gate", gate);
    if (dgate)
        am_cpu_same(kernel, "dgate", dgate, "gate", gate);
    if (dup)
        am_cpu_same(kernel, "dup", dup, "gate", gate);
    check(kernel, dout, gate, up);
    AM_CHECK(!dgate || am_tensor_numel(dgate) == am_tensor_numel(gate), "dgate (%s) must have gate's shape",
             am_tname(dgate));
    AM_CHECK(!dup || am_tensor_numel(dup) == am_tensor_numel(up), "dup (%s) must have up's shape", am_tname(dup));
    int64_t n = am_tensor_numel(dout), nb = (n + SWIGLU_BLOCK - 1) / SWIGLU_BLOCK;
    float *ws = am_cpu_scratch(kernel, dev, (int64_t)omp_get_max_threads() * 5 * SWIGLU_BLOCK);
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * SWIGLU_BLOCK, len = n - lo < SWIGLU_BLOCK ? n - lo : SWIGLU_BLOCK;
        float *buf = ws + (size_t)omp_get_thread_num() * 5 * SWIGLU_BLOCK;
        float *dg = dgate ? (float *)blk(dgate, lo, len, buf + 3 * SWIGLU_BLOCK) : NULL;
        float *du = dup ? (float *)blk(dup, lo, len, buf + 4 * SWIGLU_BLOCK) : NULL;
        swiglu_bwd(dg, du, blk(dout, lo, len, buf), blk(gate, lo, len, buf + SWIGLU_BLOCK),
                   blk(up, lo, len, buf + 2 * SWIGLU_BLOCK), len);
        if (dg)
            am_bf16_narrow1((uint16_t *)dgate->data + lo, dg, len);
        if (du)
            am_bf16_narrow1((uint16_t *)dup->data + lo, du, len);
    }
}

void am_cpu_swiglu_forward(const struct am_dev *dev, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up)
{
    if (am_not_f32(out) || am_not_f32(gate) || am_not_f32(up)) {
        swiglu_forward_bf16(dev, out, gate, up);
        return;
    }
    float *o = F32(out);
    const float *g = F32(gate), *u = F32(up);
    check(__func__, out, gate, up);
    int64_t n = am_tensor_numel(out), nb = (n + SWIGLU_BLOCK - 1) / SWIGLU_BLOCK;
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * SWIGLU_BLOCK, len = n - lo < SWIGLU_BLOCK ? n - lo : SWIGLU_BLOCK;
        swiglu_fwd(o + lo, g + lo, u + lo, len);
    }
}

void am_cpu_swiglu_backward(const struct am_dev *dev, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                            const struct am_tensor *gate, const struct am_tensor *up)
{
    if (am_not_f32(dgate) || am_not_f32(dup) || am_not_f32(dout) || am_not_f32(gate) || am_not_f32(up)) {
        swiglu_backward_bf16(dev, dgate, dup, dout, gate, up);
        return;
    }
    const float *d = F32(dout), *g = F32(gate), *u = F32(up);
    float *dg = dgate ? F32(dgate) : NULL, *du = dup ? F32(dup) : NULL;
    check(__func__, dout, gate, up);
    AM_CHECK(!dgate || am_tensor_numel(dgate) == am_tensor_numel(gate), "dgate (%s) must have gate's shape",
             am_tname(dgate));
    AM_CHECK(!dup || am_tensor_numel(dup) == am_tensor_numel(up), "dup (%s) must have up's shape", am_tname(dup));
    int64_t n = am_tensor_numel(dout), nb = (n + SWIGLU_BLOCK - 1) / SWIGLU_BLOCK;
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * SWIGLU_BLOCK, len = n - lo < SWIGLU_BLOCK ? n - lo : SWIGLU_BLOCK;
        swiglu_bwd(dg ? dg + lo : NULL, du ? du + lo : NULL, d + lo, g + lo, u + lo, len);
    }
}
