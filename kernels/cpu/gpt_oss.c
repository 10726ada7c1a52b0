/* gpt_oss.c - gpt-oss's attention sinks and clamped SwiGLU (kernels.h, "gpt-oss").
 *
 * Attention sinks. GptOssAttention appends a learned logit sink_h to every row's scores,
 * softmaxes [s_0 .. s_t | sink_h] and drops the sink's column: the row's weights are
 * p_j = exp(s_j - lse'), lse' = log(Σ_j exp(s_j) + exp(sink_h)) = logaddexp(lse, sink_h),
 * with lse the row's log-sum-exp over its keys alone (what the attention kernels save). So
 * the sink's attention is the plain one's rescaled, per row:
 *   out' = out exp(lse - lse'),   lse' = max + log(exp(lse - max) + exp(sink - max))
 * (max = max(lse, sink); lse = -inf, a row without keys, gives out' = 0). Given out' and lse'
 * the attention backward computes the sinks' model's dq, dk, dv: its p_j come from lse' and
 * its D_t = dout · out' = Σ_j p_j dp_j, the sink's term being p_sink · 0 (the sink has no
 * value). The sink's own gradient is ds_sink = p_sink (0 - D_t) for every row of its head:
 *   dsinks_h += -Σ_{b,t} exp(sink_h - lse'_{b,h,t}) (dout_{b,t,h} · out'_{b,t,h})
 * summed in double over (b, t) in order, one head per task (deterministic).
 *
 * Clamped SwiGLU (GptOssExperts._apply_gate; alpha 1.702, limit 7.0 in gpt-oss's config):
 *   g = min(gate, limit), u = clamp(up, -limit, limit), s = sigmoid(alpha g)
 *   out = (u + 1) * (g * s)
 *   backward (torch's clamp passes the gradient where lo <= x <= hi):
 *     dgate += dout (u + 1) (s + alpha g s (1 - s))    where gate <= limit
 *     dup   += dout g s                                 where -limit <= up <= limit
 * in fp32 as torch's separate operations; bf16 tensors are widened per element and each
 * output rounded once.
 */
#include <math.h>
#include <omp.h>

#include "cpu.h"
#include "half.h"

/* out [B, T, H, D], lse [B, H, T] f32, sinks [H] */
static void check_sink(const char *kernel, const struct am_tensor *out, const struct am_tensor *lse,
                       const struct am_tensor *sinks)
{
    am_cpu_act(kernel, "out", out);
    am_cpu_stat(kernel, "lse", lse);
    am_cpu_act(kernel, "sinks", sinks);
    if (out->ndim != 4)
        am_cpu_fatal(kernel, "out (%s) must be [B, T, H, D], has %d dimensions", am_tname(out), out->ndim);
    int64_t B = out->shape[0], T = out->shape[1], H = out->shape[2];
    if (am_tensor_numel(lse) != B * H * T)
        am_cpu_fatal(kernel, "lse (%s) must be [B, H, T] = %lld values, has %lld", am_tname(lse),
                     (long long)(B * H * T), (long long)am_tensor_numel(lse));
    if (am_tensor_numel(sinks) != H)
        am_cpu_fatal(kernel, "sinks (%s) must hold one value per head (%lld), has %lld", am_tname(sinks), (long long)H,
                     (long long)am_tensor_numel(sinks));
}

void am_cpu_attention_sink_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                   const struct am_tensor *sinks)
{
    (void)d;
    check_sink(__func__, out, lse, sinks);
    int64_t B = out->shape[0], T = out->shape[1], H = out->shape[2], D = out->shape[3];
    float *L = F32(lse);
#pragma omp parallel for collapse(2) schedule(static) if (B * T * H * D >= AM_PAR_MIN)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            float s = am_cpu_ld(sinks, h);
            for (int64_t t = 0; t < T; t++) {
                float *l = L + (b * H + h) * T + t;
                float m = *l > s ? *l : s;
                float l2 = m + logf(expf(*l - m) + expf(s - m)), f = expf(*l - l2);
                int64_t o = ((b * T + t) * H + h) * D;
                for (int64_t i = 0; i < D; i++)
                    am_cpu_st(out, o + i, am_cpu_ld(out, o + i) * f);
                *l = l2;
            }
        }
}

void am_cpu_attention_sink_backward(const struct am_dev *d, struct am_tensor *dsinks, const struct am_tensor *dout,
                                    const struct am_tensor *out, const struct am_tensor *lse,
                                    const struct am_tensor *sinks)
{
    (void)d;
    const char *kernel = __func__;
    check_sink(kernel, out, lse, sinks);
    am_cpu_same(kernel, "dout", dout, "out", out);
    am_cpu_stat(kernel, "dsinks", dsinks);
    int64_t B = out->shape[0], T = out->shape[1], H = out->shape[2], D = out->shape[3];
    if (am_tensor_numel(dout) != am_tensor_numel(out) || am_tensor_numel(dsinks) != H)
        am_cpu_fatal(kernel, "dout (%s) must have out's shape and dsinks (%s) one value per head (%lld)",
                     am_tname(dout), am_tname(dsinks), (long long)H);
    const float *L = F32(lse);
    float *ds = F32(dsinks);
#pragma omp parallel for schedule(static) if (B * T * H * D >= AM_PAR_MIN)
    for (int64_t h = 0; h < H; h++) {
        float s = am_cpu_ld(sinks, h);
        double acc = 0.0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                int64_t o = ((b * T + t) * H + h) * D;
                float dot = 0.0f;
                for (int64_t i = 0; i < D; i++)
                    dot += am_cpu_ld(dout, o + i) * am_cpu_ld(out, o + i);
                acc += (double)(expf(s - L[(b * H + h) * T + t]) * dot);
            }
        ds[h] -= (float)acc;
    }
}

void am_cpu_swiglu_clamped_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate,
                                   const struct am_tensor *up, float alpha, float limit)
{
    (void)d;
    am_cpu_glu_check(__func__, out, gate, up);
    int64_t n = am_tensor_numel(out);
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        float g = am_cpu_ld(gate, i), u = am_cpu_ld(up, i);
        g = g > limit ? limit : g;
        u = u > limit ? limit : u < -limit ? -limit : u;
        float ag = g * alpha, sig = 1.0f / (1.0f + am_expf(-ag)), glu = g * sig, u1 = u + 1.0f;
        am_cpu_st(out, i, u1 * glu);
    }
}

void am_cpu_swiglu_clamped_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup,
                                    const struct am_tensor *dout, const struct am_tensor *gate,
                                    const struct am_tensor *up, float alpha, float limit)
{
    (void)d;
    const char *kernel = __func__;
    am_cpu_glu_check(kernel, dout, gate, up);
    if (dgate) {
        am_cpu_same(kernel, "dgate", dgate, "gate", gate);
        AM_CHECK(am_tensor_numel(dgate) == am_tensor_numel(gate), "dgate (%s) must have gate's shape", am_tname(dgate));
    }
    if (dup) {
        am_cpu_same(kernel, "dup", dup, "gate", gate);
        AM_CHECK(am_tensor_numel(dup) == am_tensor_numel(up), "dup (%s) must have up's shape", am_tname(dup));
    }
    int64_t n = am_tensor_numel(dout);
#pragma omp parallel for schedule(static) if (n >= AM_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        float g0 = am_cpu_ld(gate, i), u0 = am_cpu_ld(up, i), dy = am_cpu_ld(dout, i);
        float g = g0 > limit ? limit : g0, u = u0 > limit ? limit : u0 < -limit ? -limit : u0;
        float ag = g * alpha, sig = 1.0f / (1.0f + am_expf(-ag)), glu = g * sig;
        if (dgate && g0 <= limit)
            am_cpu_st(dgate, i, am_cpu_ld(dgate, i) + dy * (u + 1.0f) * (sig + ag * (sig * (1.0f - sig))));
        if (dup && u0 >= -limit && u0 <= limit)
            am_cpu_st(dup, i, am_cpu_ld(dup, i) + dy * glu);
    }
}
