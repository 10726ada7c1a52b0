/* attention_block.c - attention of one block of queries against one block of keys, masked by
 * the tokens' positions, with its log-sum-exp merged into a running result (kernels.h:
 * attention_block_forward and attention_block_backward; context parallelism's ring attention).
 *
 * q [B, Tq, H, D], k [B, Tk, KVH, D]; v [B, Tk, KVH, Dv], out [B, Tq, H, Dv] (Dv: v's head
 * width, D's or another: multi-head latent attention's); query head h reads kv head h / (H / KVH);
 * qpos [Tq], kpos [Tk]: positions in the sequence. Query t sees key j when
 * kpos[j] <= qpos[t] (and kpos[j] > qpos[t] - W with a window of W), and with qstart (packed
 * sequences: [B, Tq], the position where the query row's document starts) kpos[j] >= qstart. For a row t, over the
 * keys it sees in this block (scale = 1/sqrt(D), or Gemma's query_pre_attn_scalar ** -0.5):
 *   s_j = scale q_t · k_j  (Gemma 2's soft cap c: s_j <- c tanh(s_j / c)),
 *   m = max_j s_j,  l = Σ_j exp(s_j - m)
 *   out_b = Σ_j exp(s_j - m) v_j / l,  lse_b = m + log l
 * and merged with what (out, lse) hold (lse = -inf: nothing yet):
 *   L = max(lse, lse_b),  a = exp(lse - L),  c = exp(lse_b - L)
 *   lse' = L + log(a + c),  out' = (a out + c out_b) / (a + c)
 * Backward with the rows' final out and lse (attention.c's formulas, restricted to the block):
 *   D_t = dout_t · out_t,  p_j = exp(s_j - lse_t),  ds_j = p_j (dout_t · v_j - D_t)
 *   dq_t += scale Σ_j ds_j k_j,  dk_j += scale ds_j q_t,  dv_j += p_j dout_t
 * (with the cap, ds_j also times the cap's derivative 1 - tanh², as attention.c's).
 *
 * In tiles of RT query rows against all of the block's keys, on OpenBLAS (one thread, called
 * from the task's OpenMP thread): S = scale Q Kᵀ [RT, Tk], masked and exponentiated in place,
 * then out_b = P V; backward also dP = dO Vᵀ, then dq += dS K, dk += dSᵀ Q, dv += Pᵀ dO. The
 * forward runs one (batch, head) per task, the backward one (batch, kv head) per task walking
 * every query head of its group, so dk and dv have one writer and every sum a fixed order (no
 * atomics; the same bits on any number of threads). A thread holds RT rows of scores (two in
 * backward), never Tq x Tk. A tile none of whose rows sees any key of the block (a sliding
 * window or a document that ends before the block's keys, the causal mask across the ring) is
 * skipped: its rows get what a fully masked row gets. With documents (packed sequences,
 * qstart) a tile's keys are narrowed to those from the first the tile may see (its rows'
 * earliest document start) to the last (its last row): the keys outside are masked for every
 * row of the tile, so the packed causal square costs its documents' blocks, not T x T.
 *
 * bf16 (q, k, v, and in backward dout and out, bf16; lse f32): a wrapper around the fp32
 * kernels, as attention.c's: for each chunk of sequences (every head), q, k, v (dout, out) are
 * widened into scratch and the fp32 kernel runs on them. The forward's out is f32 (the running
 * merge of a ring, kept in fp32 across blocks and rounded once by its owner) or, without
 * accumulate, bf16: computed into fp32 scratch and rounded once. The backward's dq, dk, dv are
 * f32 (sums over the ring's blocks kept in fp32 by their owner) or bf16: widened, the block's
 * terms added in fp32, rounded once per call. FlashAttention's semantics: scores, softmax
 * statistics and sums in fp32, one rounding of each output.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu.h"

struct blk_shape {
    int64_t B, Tq, Tk, H, KVH, D, DV; /* DV: v's and out's head width */
    float scale;
};

static struct blk_shape check_block(const char *kernel, const struct am_tensor *o, const struct am_tensor *lse,
                                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                    const struct am_tensor *qpos, const struct am_tensor *kpos,
                                    const struct am_tensor *qstart, float scale)
{
    AM_CHECK(q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && o->ndim == 4,
             "q (%s), k, v and out must be 4-d [B, T, heads, D] (called from %s)", am_tname(q), kernel);
    struct blk_shape s = {q->shape[0], q->shape[1], k->shape[1], q->shape[2], k->shape[2], q->shape[3], v->shape[3],
                          0.0f};
    for (int i = 0; i < 3; i++) {
        AM_CHECK(o->shape[i] == q->shape[i], "out (%s) must have q's shape (called from %s)", am_tname(o), kernel);
        AM_CHECK(v->shape[i] == k->shape[i], "v (%s) must have k's shape (called from %s)", am_tname(v), kernel);
    }
    AM_CHECK(s.DV > 0 && o->shape[3] == s.DV, "out (%s) must be as wide as v's heads (%s) (called from %s)", am_tname(o),
             am_tname(v), kernel);
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
    AM_CHECK(!qstart || (qstart->dtype == AM_I32 && am_tensor_numel(qstart) == s.B * s.Tq),
             "qstart (%s) must hold B x Tq = %lld int32 document starts (called from %s)", am_tname(qstart),
             (long long)(s.B * s.Tq), kernel);
    s.scale = scale > 0.0f ? scale : (float)(1.0 / sqrt((double)s.D));
    return s;
}

static inline bool sees(int32_t qp, int32_t kp, int64_t W, int32_t lo)
{
    return kp <= qp && kp >= lo && (W <= 0 || kp > qp - W);
}

/* The first position query row r (of B x Tq) may see: its document's start, or none. */
static inline int32_t start_of(const int32_t *qs, int64_t r) { return qs ? qs[r] : INT32_MIN; }

#define RT 64 /* query rows per tile */

/* The keys the nr query rows at positions qp (rows r0 .. r0 + nr - 1 of B x Tq, for their
 * document starts) may see: those between the lowest position any of the rows sees (the
 * earliest document start, or window's edge) and the highest (the last row). false: none, the
 * tile is fully masked. Else the tile's keys are [*j0, *j1): with documents (qs), from the first
 * such key of the block to the last (every key outside is masked for every row of the tile:
 * a packed sequence's causal square shrinks to its documents' blocks); without, all Tk (the
 * ring's blocks keep their sums' lengths). */
static bool tile_keys(const int32_t *restrict qp, const int32_t *restrict qs, int64_t r0, int64_t nr,
                      const int32_t *restrict kp, int64_t Tk, int64_t W, int64_t *j0, int64_t *j1)
{
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t i = 0; i < nr; i++) {
        int64_t first = start_of(qs, r0 + i);
        if (W > 0 && qp[i] - W + 1 > first)
            first = qp[i] - W + 1;
        lo = first < lo ? first : lo;
        hi = qp[i] > hi ? qp[i] : hi;
    }
    int64_t a = -1, z = -1;
    for (int64_t j = 0; j < Tk; j++)
        if (kp[j] >= lo && kp[j] <= hi) {
            a = a < 0 ? j : a;
            z = j;
        }
    *j0 = qs ? a : 0;
    *j1 = qs ? z + 1 : Tk;
    return a >= 0;
}

/* Row i of S (n scores, already scaled): capped (cap > 0: cap tanh(s / cap), Gemma 2's
 * order), masked to the keys the row sees and turned into exp(s - m); returns m (-inf: the
 * row sees no key, the row all zeros) and the sum in *sum. */
static float softmax_row(float *restrict S, int64_t n, int32_t qp, const int32_t *restrict kp, int64_t W, int32_t lo,
                         float cap, float *sum)
{
    float m = -INFINITY, l = 0.0f;
    if (cap > 0.0f)
        for (int64_t j = 0; j < n; j++)
            S[j] = tanhf(S[j] / cap) * cap;
    for (int64_t j = 0; j < n; j++) {
        S[j] = sees(qp, kp[j], W, lo) ? S[j] : -INFINITY;
        m = S[j] > m ? S[j] : m;
    }
    if (m == -INFINITY) {
        for (int64_t j = 0; j < n; j++)
            S[j] = 0.0f;
        *sum = 0.0f;
        return m;
    }
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < n; j++) {
        float p = am_expf(S[j] - m);
        S[j] = p;
        l += p;
    }
    *sum = l;
    return m;
}

/* ---- bf16: the fp32 kernels on widened chunks of sequences ---- */

/* Sequences per chunk: `per` floats of scratch each, within a few chunks' worth. */
static int64_t seqs_per_chunk(const struct am_dev *dev, int64_t per, int64_t B)
{
    int64_t bc = 4 * am_cpu_chunk(dev) / (per > 0 ? per : 1);
    return bc < 1 ? 1 : bc > B ? B : bc;
}

/* Sequences b0 .. b0 + nb - 1 of t ([B, T, heads, D]) as fp32 [nb, T, heads, D]: t's own memory
 * when t is f32, else widened into buf. */
static struct am_tensor chunk_of(const struct am_tensor *t, int64_t b0, int64_t nb, float *buf)
{
    int64_t per = t->shape[1] * t->shape[2] * t->shape[3];
    return am_f32_view(am_cpu_load(t, b0 * per, nb * per, buf), nb, t->shape[1], t->shape[2], t->shape[3]);
}

/* Writes back what chunk_of gave (a no-op for an f32 t): rounded once into t. */
static void chunk_store(struct am_tensor *t, int64_t b0, const struct am_tensor *f)
{
    int64_t per = t->shape[1] * t->shape[2] * t->shape[3];
    am_cpu_store(t, b0 * per, f->shape[0] * per, f->data);
}

/* The document starts of sequences b0 .. b0 + nb - 1, or NULL. */
static struct am_tensor starts_of(const struct am_tensor *qstart, int64_t b0, int64_t nb, int64_t Tq)
{
    return am_tensor_view((int32_t *)qstart->data + b0 * Tq, qstart->device, AM_I32, nb * Tq, 0, 0, 0);
}

static void block_forward_bf16(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse,
                               const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                               const struct am_tensor *qpos, const struct am_tensor *kpos,
                               const struct am_tensor *qstart, int64_t window, int accumulate, float scale,
                               float cap)
{
    const char *kernel = "am_cpu_attention_block_forward";
    am_cpu_act(kernel, "q", q);
    am_cpu_same(kernel, "k", k, "q", q);
    am_cpu_same(kernel, "v", v, "q", q);
    am_cpu_act(kernel, "out", out);
    am_cpu_stat(kernel, "lse", lse);
    struct blk_shape s = check_block(kernel, out, lse, q, k, v, qpos, kpos, qstart, scale);
    AM_CHECK(out->dtype == AM_F32 || (out->dtype == q->dtype && !accumulate),
             "out (%s) must be f32, or q's dtype without accumulate: a running merge across blocks stays fp32 "
             "(called from %s)", am_tname(out), kernel);
    int64_t qn = s.Tq * s.H * s.D, kn = s.Tk * s.KVH * s.D, on = s.Tq * s.H * s.DV, vn = s.Tk * s.KVH * s.DV;
    int64_t bc = seqs_per_chunk(dev, qn + on + kn + vn, s.B);
    float *ws = am_cpu_scratch(kernel, dev, bc * (qn + on + kn + vn) + 64);
    float *qb = am_cpu_carve(&ws, bc * qn), *ob = am_cpu_carve(&ws, bc * on), *kb = am_cpu_carve(&ws, bc * kn);
    float *vb = am_cpu_carve(&ws, bc * vn);
    for (int64_t b0 = 0; b0 < s.B; b0 += bc) {
        int64_t nb = s.B - b0 < bc ? s.B - b0 : bc;
        struct am_tensor tq = chunk_of(q, b0, nb, qb), tk = chunk_of(k, b0, nb, kb), tv = chunk_of(v, b0, nb, vb);
        struct am_tensor to = out->dtype == AM_F32 ? chunk_of(out, b0, nb, NULL)
                                                   : am_f32_view(ob, nb, s.Tq, s.H, s.DV); /* written whole */
        struct am_tensor tl = am_f32_view((float *)lse->data + b0 * s.H * s.Tq, nb, s.H, s.Tq, 0);
        struct am_tensor ts = qstart ? starts_of(qstart, b0, nb, s.Tq) : (struct am_tensor){0};
        am_cpu_attention_block_softcap_forward(dev, &to, &tl, &tq, &tk, &tv, qpos, kpos, qstart ? &ts : NULL, window,
                                               accumulate, scale, cap);
        chunk_store(out, b0, &to);
    }
}

static void block_backward_bf16(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk,
                                struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                const struct am_tensor *v, const struct am_tensor *qpos, const struct am_tensor *kpos,
                                const struct am_tensor *qstart, int64_t window, float scale, float cap)
{
    const char *kernel = "am_cpu_attention_block_backward";
    am_cpu_act(kernel, "q", q);
    const struct am_tensor *same[] = {k, v, out, dout};
    const char *names[] = {"k", "v", "out", "dout"};
    for (int i = 0; i < 4; i++)
        am_cpu_same(kernel, names[i], same[i], "q", q);
    am_cpu_act(kernel, "dq", dq);
    am_cpu_same(kernel, "dk", dk, "dq", dq);
    am_cpu_same(kernel, "dv", dv, "dq", dq);
    am_cpu_stat(kernel, "lse", lse);
    struct blk_shape s = check_block(kernel, out, lse, q, k, v, qpos, kpos, qstart, scale);
    AM_CHECK(dq->dtype == AM_F32 || dq->dtype == q->dtype, "dq (%s), dk and dv must be f32 or q's dtype (called "
             "from %s)", am_tname(dq), kernel);
    AM_CHECK(am_tensor_numel(dq) == am_tensor_numel(q) && am_tensor_numel(dout) == am_tensor_numel(out) &&
                 am_tensor_numel(dk) == am_tensor_numel(k) && am_tensor_numel(dv) == am_tensor_numel(v) &&
                 dq->ndim == 4 && dout->ndim == 4 && dk->ndim == 4 && dv->ndim == 4 && dout->shape[3] == s.DV &&
                 dv->shape[3] == s.DV,
             "dq (%s) and dout must have q's shape, dk (%s) and dv k's", am_tname(dq), am_tname(dk));
    int64_t qn = s.Tq * s.H * s.D, kn = s.Tk * s.KVH * s.D, on = s.Tq * s.H * s.DV, vn = s.Tk * s.KVH * s.DV;
    int64_t bc = seqs_per_chunk(dev, 2 * qn + 2 * on + 2 * kn + 2 * vn, s.B);
    float *ws = am_cpu_scratch(kernel, dev, bc * (2 * qn + 2 * on + 2 * kn + 2 * vn) + 128);
    float *qb = am_cpu_carve(&ws, bc * qn), *ob = am_cpu_carve(&ws, bc * on), *dob = am_cpu_carve(&ws, bc * on);
    float *dqb = am_cpu_carve(&ws, bc * qn), *kb = am_cpu_carve(&ws, bc * kn), *vb = am_cpu_carve(&ws, bc * vn);
    float *dkb = am_cpu_carve(&ws, bc * kn), *dvb = am_cpu_carve(&ws, bc * vn);
    for (int64_t b0 = 0; b0 < s.B; b0 += bc) {
        int64_t nb = s.B - b0 < bc ? s.B - b0 : bc;
        struct am_tensor tq = chunk_of(q, b0, nb, qb), to = chunk_of(out, b0, nb, ob);
        struct am_tensor tdo = chunk_of(dout, b0, nb, dob), tdq = chunk_of(dq, b0, nb, dqb);
        struct am_tensor tk = chunk_of(k, b0, nb, kb), tv = chunk_of(v, b0, nb, vb);
        struct am_tensor tdk = chunk_of(dk, b0, nb, dkb), tdv = chunk_of(dv, b0, nb, dvb);
        struct am_tensor tl = am_f32_view((float *)lse->data + b0 * s.H * s.Tq, nb, s.H, s.Tq, 0);
        struct am_tensor ts = qstart ? starts_of(qstart, b0, nb, s.Tq) : (struct am_tensor){0};
        am_cpu_attention_block_softcap_backward(dev, &tdq, &tdk, &tdv, &tdo, &to, &tl, &tq, &tk, &tv, qpos, kpos,
                                                qstart ? &ts : NULL, window, scale, cap);
        chunk_store(dq, b0, &tdq);
        chunk_store(dk, b0, &tdk);
        chunk_store(dv, b0, &tdv);
    }
}

/* ---- fp32 ---- */

void am_cpu_attention_block_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse,
                                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                    const struct am_tensor *qpos, const struct am_tensor *kpos,
                                    const struct am_tensor *qstart, int64_t window, int accumulate)
{
    am_cpu_attention_block_softcap_forward(dev, out, lse, q, k, v, qpos, kpos, qstart, window, accumulate, 0.0f, 0.0f);
}

void am_cpu_attention_block_softcap_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse,
                                            const struct am_tensor *q, const struct am_tensor *k,
                                            const struct am_tensor *v, const struct am_tensor *qpos,
                                            const struct am_tensor *kpos, const struct am_tensor *qstart,
                                            int64_t window, int accumulate, float scale, float cap)
{
    if (am_not_f32(out) || am_not_f32(q) || am_not_f32(k) || am_not_f32(v)) {
        block_forward_bf16(dev, out, lse, q, k, v, qpos, kpos, qstart, window, accumulate, scale, cap);
        return;
    }
    (void)dev;
    float *o = F32(out), *l = F32(lse);
    const float *qd = F32(q), *kd = F32(k), *vd = F32(v);
    const int32_t *qp = I32(qpos), *kp = I32(kpos);
    struct blk_shape s = check_block(__func__, out, lse, q, k, v, qpos, kpos, qstart, scale);
    const int32_t *qst = qstart ? I32(qstart) : NULL;
    int64_t B = s.B, Tq = s.Tq, Tk = s.Tk, H = s.H, D = s.D, DV = s.DV, G = H / s.KVH, qs = H * D, ks = s.KVH * D;
    int64_t os = H * DV, vs = s.KVH * DV;
    bool fail = false;
#pragma omp parallel if (B * H > 1 && B * H * Tq * Tk * D >= AM_PAR_MIN) reduction(|| : fail)
    {
        float *S = malloc(((size_t)RT * (size_t)Tk + (size_t)RT * (size_t)DV) * sizeof(float)); /* scores, out_b */
        if (!S)
            fail = true;
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                if (!S || Tk == 0)
                    continue;
                float *ob = S + RT * Tk;
                const float *kh = kd + b * Tk * ks + (h / G) * D, *vh = vd + b * Tk * vs + (h / G) * DV;
                for (int64_t t0 = 0; t0 < Tq; t0 += RT) {
                    int64_t nr = Tq - t0 < RT ? Tq - t0 : RT, j0, j1;
                    if (!tile_keys(qp + t0, qst, b * Tq + t0, nr, kp, Tk, window, &j0, &j1)) { /* every row masked */
                        for (int64_t t = t0; t < t0 + nr && !accumulate; t++) {
                            float *ot = o + (b * Tq + t) * os + h * DV;
                            for (int64_t d = 0; d < DV; d++)
                                ot[d] = 0.0f;
                            l[(b * H + h) * Tq + t] = -INFINITY;
                        }
                        continue;
                    }
                    int64_t n = j1 - j0; /* the tile's keys */
                    am_cpu_sgemm1(false, true, nr, n, D, s.scale, qd + (b * Tq + t0) * qs + h * D, qs, kh + j0 * ks,
                                  ks, 0.0f, S, n);
                    float m[RT], sum[RT];
                    for (int64_t i = 0; i < nr; i++)
                        m[i] = softmax_row(S + i * n, n, qp[t0 + i], kp + j0, window, start_of(qst, b * Tq + t0 + i),
                                           cap, &sum[i]);
                    am_cpu_sgemm1(false, false, nr, DV, n, 1.0f, S, n, vh + j0 * vs, vs, 0.0f, ob, DV);
                    for (int64_t i = 0; i < nr; i++) {
                        int64_t t = t0 + i;
                        float *ot = o + (b * Tq + t) * os + h * DV, *lt = l + (b * H + h) * Tq + t, *obi = ob + i * DV;
                        if (m[i] == -INFINITY) { /* no key of this block: nothing to merge */
                            if (!accumulate) {
                                for (int64_t d = 0; d < DV; d++)
                                    ot[d] = 0.0f;
                                *lt = -INFINITY;
                            }
                            continue;
                        }
                        float lb = m[i] + logf(sum[i]), inv = 1.0f / sum[i];
                        if (!accumulate || *lt == -INFINITY) {
                            for (int64_t d = 0; d < DV; d++)
                                ot[d] = obi[d] * inv;
                            *lt = lb;
                            continue;
                        }
                        float L = *lt > lb ? *lt : lb, a = am_expf(*lt - L), c = am_expf(lb - L), w = 1.0f / (a + c);
                        for (int64_t d = 0; d < DV; d++)
                            ot[d] = (a * ot[d] + c * obi[d] * inv) * w;
                        *lt = L + logf(a + c);
                    }
                }
            }
        free(S);
    }
    AM_CHECK(!fail, "out of memory for %d rows of %lld scores", RT, (long long)Tk);
}

void am_cpu_attention_block_backward(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk,
                                     struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                     const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                     const struct am_tensor *v, const struct am_tensor *qpos,
                                     const struct am_tensor *kpos, const struct am_tensor *qstart, int64_t window)
{
    am_cpu_attention_block_softcap_backward(dev, dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos, qstart, window, 0.0f,
                                            0.0f);
}

void am_cpu_attention_block_softcap_backward(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk,
                                             struct am_tensor *dv, const struct am_tensor *dout,
                                             const struct am_tensor *out, const struct am_tensor *lse,
                                             const struct am_tensor *q, const struct am_tensor *k,
                                             const struct am_tensor *v, const struct am_tensor *qpos,
                                             const struct am_tensor *kpos, const struct am_tensor *qstart,
                                             int64_t window, float scale, float cap)
{
    if (am_not_f32(q) || am_not_f32(k) || am_not_f32(v) || am_not_f32(out) || am_not_f32(dout) || am_not_f32(dq) ||
        am_not_f32(dk) || am_not_f32(dv)) {
        block_backward_bf16(dev, dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos, qstart, window, scale, cap);
        return;
    }
    (void)dev;
    float *dqd = F32(dq), *dkd = F32(dk), *dvd = F32(dv);
    const float *dod = F32(dout), *od = F32(out), *ld = F32(lse), *qd = F32(q), *kd = F32(k), *vd = F32(v);
    const int32_t *qp = I32(qpos), *kp = I32(kpos);
    struct blk_shape s = check_block(__func__, out, lse, q, k, v, qpos, kpos, qstart, scale);
    const int32_t *qst = qstart ? I32(qstart) : NULL;
    AM_CHECK(am_tensor_numel(dq) == am_tensor_numel(q) && am_tensor_numel(dout) == am_tensor_numel(out),
             "dq (%s) and dout (%s) must have q's shape", am_tname(dq), am_tname(dout));
    AM_CHECK(am_tensor_numel(dk) == am_tensor_numel(k) && am_tensor_numel(dv) == am_tensor_numel(v),
             "dk (%s) and dv (%s) must have k's shape", am_tname(dk), am_tname(dv));
    int64_t B = s.B, Tq = s.Tq, Tk = s.Tk, H = s.H, KVH = s.KVH, D = s.D, G = H / KVH, qs = H * D, ks = KVH * D;
    int64_t DV = s.DV, os = H * DV, vs = KVH * DV;
    bool fail = false;
#pragma omp parallel if (B * KVH > 1 && B * H * Tq * Tk * D >= AM_PAR_MIN) reduction(|| : fail)
    {
        float *P = malloc(2 * (size_t)RT * (size_t)Tk * sizeof(float)); /* p, then dp and ds */
        if (!P)
            fail = true;
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t kvh = 0; kvh < KVH; kvh++) {
                if (!P || Tk == 0)
                    continue;
                float *dS = P + RT * Tk;
                int64_t ko = b * Tk * ks + kvh * D, vo = b * Tk * vs + kvh * DV;
                for (int64_t h = kvh * G; h < (kvh + 1) * G; h++)
                    for (int64_t t0 = 0; t0 < Tq; t0 += RT) {
                        int64_t nr = Tq - t0 < RT ? Tq - t0 : RT, qo = (b * Tq + t0) * qs + h * D, j0, j1;
                        int64_t oo = (b * Tq + t0) * os + h * DV;
                        if (!tile_keys(qp + t0, qst, b * Tq + t0, nr, kp, Tk, window, &j0, &j1)) /* no term */
                            continue;
                        int64_t n = j1 - j0, kj = ko + j0 * ks, vj = vo + j0 * vs; /* the tile's keys */
                        const int32_t *kpj = kp + j0;
                        am_cpu_sgemm1(false, true, nr, n, D, s.scale, qd + qo, qs, kd + kj, ks, 0.0f, P, n);
                        am_cpu_sgemm1(false, true, nr, n, DV, 1.0f, dod + oo, os, vd + vj, vs, 0.0f, dS, n);
                        for (int64_t i = 0; i < nr; i++) {
                            int64_t t = t0 + i;
                            float *pr = P + i * n, *dr = dS + i * n, Lt = ld[(b * H + h) * Tq + t];
                            const float *dot_ = dod + oo + i * os, *ot = od + oo + i * os;
                            float Dt = 0.0f;
                            int32_t lo = start_of(qst, b * Tq + t);
                            for (int64_t d = 0; d < DV; d++)
                                Dt += dot_[d] * ot[d];
                            if (cap > 0.0f) /* through the cap: d tanh = 1 - tanh² */
                                for (int64_t j = 0; j < n; j++) {
                                    float th = tanhf(pr[j] / cap);
                                    float p = Lt != -INFINITY && sees(qp[t], kpj[j], window, lo)
                                                  ? am_expf(th * cap - Lt) : 0.0f;
                                    pr[j] = p;
                                    dr[j] = p * (dr[j] - Dt) * (1.0f - th * th) * s.scale;
                                }
                            else
                                for (int64_t j = 0; j < n; j++) {
                                    float p = Lt != -INFINITY && sees(qp[t], kpj[j], window, lo)
                                                  ? am_expf(pr[j] - Lt) : 0.0f;
                                    pr[j] = p;
                                    dr[j] = p * (dr[j] - Dt) * s.scale;
                                }
                        }
                        am_cpu_sgemm1(false, false, nr, D, n, 1.0f, dS, n, kd + kj, ks, 1.0f, dqd + qo, qs);
                        am_cpu_sgemm1(true, false, n, D, nr, 1.0f, dS, n, qd + qo, qs, 1.0f, dkd + kj, ks);
                        am_cpu_sgemm1(true, false, n, DV, nr, 1.0f, P, n, dod + oo, os, 1.0f, dvd + vj, vs);
                    }
            }
        free(P);
    }
    AM_CHECK(!fail, "out of memory for %d rows of %lld scores", 2 * RT, (long long)Tk);
}
