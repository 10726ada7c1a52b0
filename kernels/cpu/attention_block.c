/* attention_block.c - attention of one block of queries against one block of keys, masked by
 * the tokens' positions, with its log-sum-exp merged into a running result (kernels.h:
 * attention_block_forward and attention_block_backward; context parallelism's ring attention).
 *
 * q, out [B, Tq, H, D]; k, v [B, Tk, KVH, D]; query head h reads kv head h / (H / KVH);
 * qpos [Tq], kpos [Tk]: positions in the sequence. Query t sees key j when
 * kpos[j] <= qpos[t] (and kpos[j] > qpos[t] - W with a window of W). For a row t, over the
 * keys it sees in this block (scale = 1/sqrt(D)):
 *   s_j = scale q_t · k_j,  m = max_j s_j,  l = Σ_j exp(s_j - m)
 *   out_b = Σ_j exp(s_j - m) v_j / l,  lse_b = m + log l
 * and merged with what (out, lse) hold (lse = -inf: nothing yet):
 *   L = max(lse, lse_b),  a = exp(lse - L),  c = exp(lse_b - L)
 *   lse' = L + log(a + c),  out' = (a out + c out_b) / (a + c)
 * Backward with the rows' final out and lse (attention.c's formulas, restricted to the block):
 *   D_t = dout_t · out_t,  p_j = exp(s_j - lse_t),  ds_j = p_j (dout_t · v_j - D_t)
 *   dq_t += scale Σ_j ds_j k_j,  dk_j += scale ds_j q_t,  dv_j += p_j dout_t
 *
 * Plain loops, one query row at a time: the forward runs one (batch, head) per task, the
 * backward one (batch, kv head) per task walking every query head of its group, so dk and dv
 * have one writer and every sum a fixed order (no atomics; the same bits on any number of
 * threads). A thread holds one row of Tk scores, never Tq x Tk.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu.h"

struct blk_shape {
    int64_t B, Tq, Tk, H, KVH, D;
    float scale;
};

static struct blk_shape check_block(const char *kernel, const struct am_tensor *o, const struct am_tensor *lse,
                                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                    const struct am_tensor *qpos, const struct am_tensor *kpos)
{
    AM_CHECK(q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && o->ndim == 4,
             "q (%s), k, v and out must be 4-d [B, T, heads, D] (called from %s)", am_tname(q), kernel);
    struct blk_shape s = {q->shape[0], q->shape[1], k->shape[1], q->shape[2], k->shape[2], q->shape[3], 0.0f};
    for (int i = 0; i < 4; i++) {
        AM_CHECK(o->shape[i] == q->shape[i], "out (%s) must have q's shape (called from %s)", am_tname(o), kernel);
        AM_CHECK(v->shape[i] == k->shape[i], "v (%s) must have k's shape (called from %s)", am_tname(v), kernel);
    }
    AM_CHECK(k->shape[0] == s.B && k->shape[3] == s.D, "k (%s) must have q's B and D (called from %s)", am_tname(k),
             kernel);
    AM_CHECK(s.KVH > 0 && s.H % s.KVH == 0, "%lld query heads are not a multiple of %lld kv heads (called from %s)",
             (long long)s.H, (long long)s.KVH, kernel);
    AM_CHECK(am_tensor_numel(lse) == s.B * s.H * s.Tq,
             "lse (%s) must be [B, H, Tq] = [%lld, %lld, %lld] (called from %s)", am_tname(lse), (long long)s.B,
             (long long)s.H, (long long)s.Tq, kernel);
    AM_CHECK(am_tensor_numel(qpos) == s.Tq && am_tensor_numel(kpos) == s.Tk,
             "qpos (%s) and kpos (%s) must hold Tq = %lld and Tk = %lld positions (called from %s)", am_tname(qpos),
             am_tname(kpos), (long long)s.Tq, (long long)s.Tk, kernel);
    s.scale = (float)(1.0 / sqrt((double)s.D));
    return s;
}

static inline bool sees(int32_t qp, int32_t kp, int64_t W) { return kp <= qp && (W <= 0 || kp > qp - W); }

static inline float dot(const float *restrict a, const float *restrict b, int64_t D)
{
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; d++)
        acc += a[d] * b[d];
    return acc;
}

void am_cpu_attention_block_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse,
                                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                    const struct am_tensor *qpos, const struct am_tensor *kpos, int64_t window,
                                    int accumulate)
{
    (void)dev;
    float *o = F32(out), *l = F32(lse);
    const float *qd = F32(q), *kd = F32(k), *vd = F32(v);
    const int32_t *qp = I32(qpos), *kp = I32(kpos);
    struct blk_shape s = check_block(__func__, out, lse, q, k, v, qpos, kpos);
    int64_t B = s.B, Tq = s.Tq, Tk = s.Tk, H = s.H, D = s.D, G = H / s.KVH, qs = H * D, ks = s.KVH * D;
    bool fail = false;
#pragma omp parallel if (B * H > 1 && B * H * Tq * Tk * D >= AM_PAR_MIN) reduction(|| : fail)
    {
        float *S = malloc(((size_t)Tk + (size_t)D) * sizeof(float)); /* a row's scores, its block output */
        if (!S)
            fail = true;
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                if (!S)
                    continue;
                float *ob = S + Tk;
                const float *kh = kd + b * Tk * ks + (h / G) * D, *vh = vd + b * Tk * ks + (h / G) * D;
                for (int64_t t = 0; t < Tq; t++) {
                    const float *qt = qd + (b * Tq + t) * qs + h * D;
                    float *ot = o + (b * Tq + t) * qs + h * D, *lt = l + (b * H + h) * Tq + t;
                    float m = -INFINITY;
                    for (int64_t j = 0; j < Tk; j++) {
                        S[j] = sees(qp[t], kp[j], window) ? s.scale * dot(qt, kh + j * ks, D) : -INFINITY;
                        m = S[j] > m ? S[j] : m;
                    }
                    if (m == -INFINITY) { /* no key of this block: nothing to merge */
                        if (!accumulate) {
                            for (int64_t d = 0; d < D; d++)
                                ot[d] = 0.0f;
                            *lt = -INFINITY;
                        }
                        continue;
                    }
                    float sum = 0.0f;
                    for (int64_t d = 0; d < D; d++)
                        ob[d] = 0.0f;
                    for (int64_t j = 0; j < Tk; j++) {
                        if (S[j] == -INFINITY)
                            continue;
                        float p = am_expf(S[j] - m);
                        const float *vj = vh + j * ks;
                        sum += p;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++)
                            ob[d] += p * vj[d];
                    }
                    float lb = m + logf(sum), inv = 1.0f / sum;
                    if (!accumulate || *lt == -INFINITY) {
                        for (int64_t d = 0; d < D; d++)
                            ot[d] = ob[d] * inv;
                        *lt = lb;
                        continue;
                    }
                    float L = *lt > lb ? *lt : lb, a = am_expf(*lt - L), c = am_expf(lb - L), w = 1.0f / (a + c);
                    for (int64_t d = 0; d < D; d++)
                        ot[d] = (a * ot[d] + c * ob[d] * inv) * w;
                    *lt = L + logf(a + c);
                }
            }
        free(S);
    }
    AM_CHECK(!fail, "out of memory for a row of %lld scores", (long long)Tk);
}

void am_cpu_attention_block_backward(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk,
                                     struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                     const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                     const struct am_tensor *v, const struct am_tensor *qpos,
                                     const struct am_tensor *kpos, int64_t window)
{
    (void)dev;
    float *dqd = F32(dq), *dkd = F32(dk), *dvd = F32(dv);
    const float *dod = F32(dout), *od = F32(out), *ld = F32(lse), *qd = F32(q), *kd = F32(k), *vd = F32(v);
    const int32_t *qp = I32(qpos), *kp = I32(kpos);
    struct blk_shape s = check_block(__func__, out, lse, q, k, v, qpos, kpos);
    AM_CHECK(am_tensor_numel(dq) == am_tensor_numel(q) && am_tensor_numel(dout) == am_tensor_numel(q),
             "dq (%s) and dout (%s) must have q's shape", am_tname(dq), am_tname(dout));
    AM_CHECK(am_tensor_numel(dk) == am_tensor_numel(k) && am_tensor_numel(dv) == am_tensor_numel(k),
             "dk (%s) and dv (%s) must have k's shape", am_tname(dk), am_tname(dv));
    int64_t B = s.B, Tq = s.Tq, Tk = s.Tk, H = s.H, KVH = s.KVH, D = s.D, G = H / KVH, qs = H * D, ks = KVH * D;
#pragma omp parallel for collapse(2) schedule(static) if (B * KVH > 1 && B * H * Tq * Tk * D >= AM_PAR_MIN)
    for (int64_t b = 0; b < B; b++)
        for (int64_t kvh = 0; kvh < KVH; kvh++) {
            int64_t ko = b * Tk * ks + kvh * D;
            for (int64_t h = kvh * G; h < (kvh + 1) * G; h++)
                for (int64_t t = 0; t < Tq; t++) {
                    int64_t qo = (b * Tq + t) * qs + h * D;
                    const float *qt = qd + qo, *dot_ = dod + qo;
                    float *dqt = dqd + qo, Lt = ld[(b * H + h) * Tq + t];
                    if (Lt == -INFINITY)
                        continue;
                    float Dt = dot(dot_, od + qo, D);
                    for (int64_t j = 0; j < Tk; j++) {
                        if (!sees(qp[t], kp[j], window))
                            continue;
                        const float *kj = kd + ko + j * ks, *vj = vd + ko + j * ks;
                        float *dkj = dkd + ko + j * ks, *dvj = dvd + ko + j * ks;
                        float p = am_expf(s.scale * dot(qt, kj, D) - Lt);
                        float ds = p * (dot(dot_, vj, D) - Dt) * s.scale;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) {
                            dqt[d] += ds * kj[d];
                            dkj[d] += ds * qt[d];
                            dvj[d] += p * dot_[d];
                        }
                    }
                }
        }
}
