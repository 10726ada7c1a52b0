/* attention.c - causal grouped-query attention, flash-style: a few query rows at a time.
 *
 * q [B, T, H, D], k [B, T, KVH, D]; v [B, T, KVH, Dv], out [B, T, H, Dv] (Dv: v's head width,
 * D's or another: multi-head latent attention's v_head_dim); query head h reads kv head
 * h / (H / KVH). For query row t of head h (scale = 1/sqrt(D)), over the keys it sees,
 * lo_t <= j <= t with lo_t = 0 (causal) or max(0, t - W + 1) with a sliding window of W
 * keys (Mistral's: transformers masks kv_idx <= q_idx - W):
 *   s_j   = scale * q_t · k_j             for lo_t <= j <= t
 *   m     = max_j s_j,  l = Σ_j exp(s_j - m)
 *   out_t = Σ_j exp(s_j - m) v_j / l,     lse_t = m + log l   (saved for backward)
 * backward, with p_j = exp(s_j - lse_t) recomputed from the saved lse:
 *   D_t    = dout_t · out_t               (= Σ_j p_j dp_j)
 *   dp_j   = dout_t · v_j
 *   ds_j   = p_j (dp_j - D_t)
 *   dq_t  += scale Σ_j ds_j k_j
 *   dk_j  += scale ds_j q_t,   dv_j += p_j dout_t
 *
 * How the work is laid out. A block is QB = 4 query rows: their scores (4 x T floats: never
 * the T x T matrix) come from register tiles (4 rows x 16 keys) summed over d, the four rows
 * share every load of k and v and every update of a dk, dv row, so the inner loops are
 * contiguous and vectorised, without horizontal sums; a block's rows run to the same padded
 * length and the keys beyond each row's own t are masked (weight 0). A thread walks QG = 4
 * blocks at a time (a group of 16 rows), each block's sums exactly as if it ran alone, but
 * interleaved so that each tile of 16 keys and each chunk of 16 value dims is read once for
 * the group, and each key's dk and dv take the four blocks' updates in order while in cache.
 * The head's k and v are packed first (a head's rows lie heads x D apart: walking them in
 * place strides by kilobytes): as tiles of 16 keys transposed [D][16] for the scores, as
 * chunks of 16 dims [T][16] for the weighted sums; the group's q and dout rows, and in the
 * backward the kv head's dk and dv rows, are copied back to back. With a
 * window a block starts at the first tile holding a key of its first row's window, and the
 * keys before each row's own lo_t are masked too; a window of T or more (or none) gives the
 * same bits as causal attention.
 * The forward runs one (batch, head) per task; the backward one (batch, kv head) per task,
 * which walks every query head of its group, so dk and dv of a shared kv head have a
 * single writer: no races, no atomics, sums in a fixed order (deterministic).
 *
 * Gemma (attention_softcap): the scale is given (query_pre_attn_scalar ** -0.5) and, with a cap
 * c > 0, each score is capped before the softmax, as transformers' eager_attention_forward:
 *   u_j = c * tanh((scale * q_t · k_j) / c)     in place of s_j above
 *   backward: ds_j as above from u_j, times (1 - tanh²) = 1 - (u_j / c)², before the scale.
 *
 * bf16 (q, k, v, out, dout, dq, dk, dv bf16; lse f32): a wrapper around the fp32 kernels
 * (so that changes to their arguments carry over): for each chunk of sequences and group of
 * kv heads, the chunk's q, k, v (and dout, out, dq, dk, dv) are widened into scratch, the fp32 kernel
 * runs on them, and out (dq, dk, dv) are rounded once. That is FlashAttention's semantics
 * (scores, softmax and sums in fp32, one rounding of the output); torch's math path in
 * bf16 rounds the scores and the probabilities too. Still never T x T: the scratch holds
 * a group's rows, T x (heads x D).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu.h"

#define QB 4  /* query rows per block */
#define KB 16 /* keys (or head dims) per register tile */
#define QG 4  /* blocks a group walks together */

/* 8 floats, GCC's vector extension: the tiles' sums live in registers (a float[16] summed
 * under `omp simd` stayed on the stack, a load and a store a multiply-add); v8u reads and
 * writes 8 floats at any float's alignment. Element-wise as the scalar code: a += q * k is
 * a multiply rounded, then an add rounded, in each lane (no contraction). */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

struct attn_shape {
    int64_t B, T, H, KVH, D, DV; /* DV: v's and out's head width */
    float scale;
};

/* Keys a block needs: 0..n-1, rounded up to whole tiles where T allows. */
static inline int64_t padded(int64_t n, int64_t T)
{
    int64_t np = (n + KB - 1) / KB * KB;
    return np < T ? np : T;
}

/* The first key row t sees: 0, or with a window of W > 0 keys, t - W + 1. */
static inline int64_t first_key(int64_t t, int64_t W) { return W > 0 && t - W + 1 > 0 ? t - W + 1 : 0; }

/* The first key a block from row t0 computes: its first row's, down to a whole tile. */
static inline int64_t block_start(int64_t t0, int64_t W) { return first_key(t0, W) / KB * KB; }

/* S[r, j] = Σ_d x_r[d] At[d, j] for the QB rows x_r and keys j < n (S rows lds apart,
 * At [D, ldt]): q_r · k_j (At = k transposed) or dout_r · v_j (At = v transposed). */
AM_INLINE void scores_block(float *restrict S, int64_t lds, const float *restrict At, int64_t ldt,
                                const float *const x[QB], int64_t D, int64_t n)
{
    const float *restrict x0 = x[0], *restrict x1 = x[1], *restrict x2 = x[2], *restrict x3 = x[3];
    int64_t j = 0;
    for (; j + KB <= n; j += KB) { /* the tile's 4 x 16 sums in eight registers of 8 lanes */
        v8 a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
        for (int64_t d = 0; d < D; d++) {
            const float *restrict k = At + d * ldt + j;
            v8 klo = *(const v8u *)k, khi = *(const v8u *)(k + 8);
            float q0 = x0[d], q1 = x1[d], q2 = x2[d], q3 = x3[d];
            a0 += q0 * klo, b0 += q0 * khi;
            a1 += q1 * klo, b1 += q1 * khi;
            a2 += q2 * klo, b2 += q2 * khi;
            a3 += q3 * klo, b3 += q3 * khi;
        }
        *(v8u *)(S + j) = a0, *(v8u *)(S + j + 8) = b0;
        *(v8u *)(S + lds + j) = a1, *(v8u *)(S + lds + j + 8) = b1;
        *(v8u *)(S + 2 * lds + j) = a2, *(v8u *)(S + 2 * lds + j + 8) = b2;
        *(v8u *)(S + 3 * lds + j) = a3, *(v8u *)(S + 3 * lds + j + 8) = b3;
    }
    for (; j < n; j++) { /* the last keys when T is not a multiple of KB */
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            float k = At[d * ldt + j];
            a0 += x0[d] * k;
            a1 += x1[d] * k;
            a2 += x2[d] * k;
            a3 += x3[d] * k;
        }
        S[j] = a0;
        S[lds + j] = a1;
        S[2 * lds + j] = a2;
        S[3 * lds + j] = a3;
    }
}

/* o_r[0..D) += Σ_{j<n} P[r, j] A[j, 0..D) for the QB rows o_r (A rows lda apart, P rows
 * ldp apart): out_r = Σ_j p_j v_j, or dq_r += Σ_j ds_j k_j. Tiles of 16 head dims of the
 * four rows accumulate in registers over j. */
AM_INLINE void pv_block(float *const o[QB], const float *restrict A, int64_t lda, const float *restrict P,
                            int64_t ldp, int64_t n, int64_t D)
{
    float *restrict o0 = o[0], *restrict o1 = o[1], *restrict o2 = o[2], *restrict o3 = o[3];
    const float *restrict P0 = P, *restrict P1 = P + ldp, *restrict P2 = P + 2 * ldp, *restrict P3 = P + 3 * ldp;
    int64_t dc = 0;
    for (; dc + KB <= D; dc += KB) { /* the four rows' 16 head dims in eight registers of 8 lanes */
        v8 a0 = *(v8u *)(o0 + dc), b0 = *(v8u *)(o0 + dc + 8), a1 = *(v8u *)(o1 + dc), b1 = *(v8u *)(o1 + dc + 8);
        v8 a2 = *(v8u *)(o2 + dc), b2 = *(v8u *)(o2 + dc + 8), a3 = *(v8u *)(o3 + dc), b3 = *(v8u *)(o3 + dc + 8);
        for (int64_t j = 0; j < n; j++) {
            const float *restrict a = A + j * lda + dc;
            v8 alo = *(const v8u *)a, ahi = *(const v8u *)(a + 8);
            float p0 = P0[j], p1 = P1[j], p2 = P2[j], p3 = P3[j];
            a0 += p0 * alo, b0 += p0 * ahi;
            a1 += p1 * alo, b1 += p1 * ahi;
            a2 += p2 * alo, b2 += p2 * ahi;
            a3 += p3 * alo, b3 += p3 * ahi;
        }
        *(v8u *)(o0 + dc) = a0, *(v8u *)(o0 + dc + 8) = b0, *(v8u *)(o1 + dc) = a1, *(v8u *)(o1 + dc + 8) = b1;
        *(v8u *)(o2 + dc) = a2, *(v8u *)(o2 + dc + 8) = b2, *(v8u *)(o3 + dc) = a3, *(v8u *)(o3 + dc + 8) = b3;
    }
    for (; dc < D; dc++) /* head sizes that are not a multiple of KB */
        for (int64_t j = 0; j < n; j++) {
            float a = A[j * lda + dc];
            o0[dc] += P0[j] * a;
            o1[dc] += P1[j] * a;
            o2[dc] += P2[j] * a;
            o3[dc] += P3[j] * a;
        }
}

/* Packed copies of one head (its rows lie heads x D apart in q, k and v, so that walking
 * keys or head dims in place strides by kilobytes and misses the caches):
 *   tiles:  At [ceil(T / KB)][D][KB], tile i the keys i KB .. i KB + KB - 1 transposed (the
 *           scores' keys or values; keys beyond T zero): tile i starts at i KB D.
 *   chunks: Ac [ceil(D / KB)][T][KB], chunk i the head dims i KB .. i KB + KB - 1 of every key
 *           (pv_block's keys or values; dims beyond D zero): chunk i starts at i KB T.
 * rows: [n][D] (the rows ld floats apart, back to back), and unpack_rows back. */
AM_HOT static void pack_tiles(float *restrict At, const float *restrict A, int64_t T, int64_t D, int64_t ld)
{
    for (int64_t j0 = 0; j0 < T; j0 += KB) {
        float *restrict t = At + j0 * D;
        if (T - j0 < KB) { /* the last keys */
            for (int64_t d = 0; d < D; d++)
                for (int64_t j = 0; j < KB; j++)
                    t[d * KB + j] = j0 + j < T ? A[(j0 + j) * ld + d] : 0.0f;
            continue;
        }
        for (int64_t d = 0; d < D; d++)
            for (int64_t j = 0; j < KB; j++)
                t[d * KB + j] = A[(j0 + j) * ld + d];
    }
}

AM_HOT static void pack_chunks(float *restrict Ac, const float *restrict A, int64_t T, int64_t D, int64_t ld)
{
    for (int64_t c = 0; c < D; c += KB) {
        int64_t w = D - c < KB ? D - c : KB;
        float *restrict dst = Ac + c * T;
        for (int64_t j = 0; j < T; j++) {
            if (w == KB) {
#pragma omp simd
                for (int64_t i = 0; i < KB; i++)
                    dst[j * KB + i] = A[j * ld + c + i];
                continue;
            }
            for (int64_t i = 0; i < KB; i++)
                dst[j * KB + i] = i < w ? A[j * ld + c + i] : 0.0f;
        }
    }
}

AM_INLINE void copy_row(float *restrict dst, const float *restrict src, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        dst[i] = src[i];
}

AM_HOT static void pack_rows(float *restrict dst, const float *restrict A, int64_t n, int64_t D, int64_t ld)
{
    for (int64_t j = 0; j < n; j++)
        copy_row(dst + j * D, A + j * ld, D);
}

AM_HOT static void unpack_rows(float *restrict A, const float *restrict src, int64_t n, int64_t D, int64_t ld)
{
    for (int64_t j = 0; j < n; j++)
        copy_row(A + j * ld, src + j * D, D);
}

/* Floats of a head's tiles or chunks */
static inline int64_t packed_size(int64_t T, int64_t D) { return (T + KB - 1) / KB * KB * ((D + KB - 1) / KB * KB); }

/* A group: up to QG blocks of QB rows, from row g0 of one (batch, head), each block computed as
 * it would be alone (the same sums in the same order, so the same bits), their loops
 * interleaved so that a tile of keys or a chunk of values, read once, serves every block of
 * the group. Block b: rows t0 .. t0 + nr - 1 (missing rows repeat the last one and write to
 * spare), keys j0 .. nmax - 1 with scores computed to np (a whole tile where T allows). */
struct qgroup {
    int nb;                                       /* blocks */
    int64_t t0[QG], nr[QG], nmax[QG], np[QG], j0[QG];
    int64_t jlo, jhi;                             /* the tiles any block computes: jlo .. jhi - 1 */
};

static struct qgroup group_of(int64_t g0, int64_t T, int64_t W)
{
    struct qgroup G = {.jlo = T};
    for (int b = 0; b < QG && g0 + b * QB < T; b++, G.nb++) {
        int64_t t0 = g0 + b * QB, nr = T - t0 < QB ? T - t0 : QB;
        G.t0[b] = t0, G.nr[b] = nr, G.nmax[b] = t0 + nr, G.np[b] = padded(t0 + nr, T), G.j0[b] = block_start(t0, W);
        G.jlo = G.j0[b] < G.jlo ? G.j0[b] : G.jlo;
        G.jhi = G.np[b] > G.jhi ? G.np[b] : G.jhi;
    }
    return G;
}

/* The group's rows of a head (rows ld floats apart, D wide) back to back in X [QG QB][D], a
 * missing row a copy of its block's last, and x[b][r] pointing at them. */
AM_HOT static void group_rows(float *restrict X, const float *x[QG][QB], const struct qgroup *G, const float *A, int64_t ld,
                       int64_t D)
{
    for (int b = 0; b < G->nb; b++)
        for (int r = 0; r < QB; r++) {
            float *dst = X + (b * QB + r) * D;
            int64_t t = G->t0[b] + (r < G->nr[b] ? r : G->nr[b] - 1);
            copy_row(dst, A + t * ld, D);
            x[b][r] = dst;
        }
}

/* S[b] (QB rows of T floats each block, QB T floats apart) = x[b] · the tiles' keys over D,
 * for each block's keys j0 .. np - 1, tile by tile. */
AM_INLINE void group_scores(float *restrict S, int64_t T, const float *restrict At, const float *const x[QG][QB],
                            int64_t D, const struct qgroup *G)
{
    for (int64_t j = G->jlo; j < G->jhi; j += KB)
        for (int b = 0; b < G->nb; b++)
            if (j >= G->j0[b] && j < G->np[b])
                scores_block(S + b * QB * T + j, T, At + j * D, KB, x[b], D, G->np[b] - j < KB ? G->np[b] - j : KB);
}

/* o[b] += P[b] · the chunks' rows, for each block's keys j0 .. nmax - 1, chunk by chunk
 * (D head dims). */
AM_INLINE void group_pv(float *const o[QG][QB], const float *restrict Ac, int64_t T, const float *restrict P,
                        int64_t D, const struct qgroup *G)
{
    for (int64_t c = 0; c < D; c += KB) {
        int64_t w = D - c < KB ? D - c : KB;
        for (int b = 0; b < G->nb; b++) {
            float *oc[QB];
            for (int r = 0; r < QB; r++)
                oc[r] = o[b][r] + c;
            pv_block(oc, Ac + c * T + G->j0[b] * KB, KB, P + b * QB * T + G->j0[b], T, G->nmax[b] - G->j0[b], w);
        }
    }
}

/* The forward of one group of one (batch, head). q: the head's first row (qs floats between
 * rows), out's (os apart, DV wide); kt: its kv head's k in tiles, vc: its v in chunks; lse: the
 * head's T values. S: QG QB rows of T floats; X: QG QB rows of D; spare: DV floats where
 * missing rows write. */
AM_HOT static void attn_forward_group(float *restrict out, float *restrict lse, const float *restrict q,
                                      const float *restrict kt, const float *restrict vc, int64_t g0, int64_t T,
                                      int64_t D, int64_t DV, int64_t qs, int64_t os, int64_t W, float scale, float cap,
                                      float *restrict S, float *restrict X, float *restrict spare)
{
    struct qgroup G = group_of(g0, T, W);
    const float *x[QG][QB];
    float *o[QG][QB];
    group_rows(X, x, &G, q, qs, D);
    for (int b = 0; b < G.nb; b++)
        for (int r = 0; r < QB; r++)
            o[b][r] = r < G.nr[b] ? out + (G.t0[b] + r) * os : spare;
    group_scores(S, T, kt, x, D, &G);
    float inv[QG][QB];
    for (int b = 0; b < G.nb; b++) {
        int64_t t0 = G.t0[b], nr = G.nr[b], np = G.np[b], j0 = G.j0[b];
        for (int r = 0; r < QB; r++) {
            float *restrict row = S + (b * QB + r) * T;
            int64_t n = r < nr ? t0 + r + 1 : 0, lo = first_key(t0 + r, W); /* keys lo..n-1 this row sees */
            float m = -INFINITY;
            if (cap > 0.0f) { /* Gemma 2: scores / cap, tanh, * cap (transformers' order) */
                for (int64_t j = j0; j < np; j++) {
                    row[j] = j >= lo && j < n ? tanhf(row[j] * scale / cap) * cap : -INFINITY;
                    m = row[j] > m ? row[j] : m;
                }
            } else {
#pragma omp simd reduction(max : m)
                for (int64_t j = j0; j < np; j++) {
                    row[j] = j >= lo && j < n ? row[j] * scale : -INFINITY;
                    m = row[j] > m ? row[j] : m;
                }
            }
            if (n == 0) { /* a missing row: no weights */
                for (int64_t j = j0; j < np; j++)
                    row[j] = 0.0f;
                inv[b][r] = 0.0f;
                continue;
            }
            float l = 0.0f;
#pragma omp simd reduction(+ : l)
            for (int64_t j = j0; j < np; j++) {
                float p = am_expf(row[j] - m);
                row[j] = p;
                l += p;
            }
            inv[b][r] = 1.0f / l;
            lse[t0 + r] = m + logf(l);
        }
        for (int r = 0; r < QB; r++)
            for (int64_t d = 0; d < DV; d++)
                o[b][r][d] = 0.0f;
    }
    group_pv(o, vc, T, S, DV, &G);
    for (int b = 0; b < G.nb; b++)
        for (int r = 0; r < G.nr[b]; r++)
            for (int64_t d = 0; d < DV; d++)
                o[b][r][d] *= inv[b][r];
}

/* dk_j += Σ_r ds_r q_r and dv_j += Σ_r p_r dout_r over one block's QB rows, for key j, or keys j
 * and j + 1 (two): each load of q_t and dout_t serves both. dk, dv: key j's rows; their next
 * rows ks, vs floats on. */
AM_INLINE void kv_update(float *restrict dkj, float *restrict dvj, int64_t ks, int64_t vs, const float *restrict S,
                         const float *restrict DS, int64_t T, int64_t j, const float *const xq[QB],
                         const float *const xd[QB], int64_t D, int64_t DV, bool two)
{
    const float *restrict q0 = xq[0], *restrict q1 = xq[1], *restrict q2 = xq[2], *restrict q3 = xq[3];
    const float *restrict d0 = xd[0], *restrict d1 = xd[1], *restrict d2 = xd[2], *restrict d3 = xd[3];
    float s0 = DS[j], s1 = DS[T + j], s2 = DS[2 * T + j], s3 = DS[3 * T + j];
    float p0 = S[j], p1 = S[T + j], p2 = S[2 * T + j], p3 = S[3 * T + j];
    if (two && DV == D) {
        float *restrict dkk = dkj + ks, *restrict dvk = dvj + vs;
        float u0 = DS[j + 1], u1 = DS[T + j + 1], u2 = DS[2 * T + j + 1], u3 = DS[3 * T + j + 1];
        float r0 = S[j + 1], r1 = S[T + j + 1], r2 = S[2 * T + j + 1], r3 = S[3 * T + j + 1];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) {
            float a0 = q0[d], a1 = q1[d], a2 = q2[d], a3 = q3[d], b0 = d0[d], b1 = d1[d], b2 = d2[d], b3 = d3[d];
            dkj[d] += s0 * a0 + s1 * a1 + s2 * a2 + s3 * a3;
            dvj[d] += p0 * b0 + p1 * b1 + p2 * b2 + p3 * b3;
            dkk[d] += u0 * a0 + u1 * a1 + u2 * a2 + u3 * a3;
            dvk[d] += r0 * b0 + r1 * b1 + r2 * b2 + r3 * b3;
        }
    } else if (two) { /* DV != D: dk over D, dv over DV */
        float *restrict dkk = dkj + ks, *restrict dvk = dvj + vs;
        float u0 = DS[j + 1], u1 = DS[T + j + 1], u2 = DS[2 * T + j + 1], u3 = DS[3 * T + j + 1];
        float r0 = S[j + 1], r1 = S[T + j + 1], r2 = S[2 * T + j + 1], r3 = S[3 * T + j + 1];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) {
            float a0 = q0[d], a1 = q1[d], a2 = q2[d], a3 = q3[d];
            dkj[d] += s0 * a0 + s1 * a1 + s2 * a2 + s3 * a3;
            dkk[d] += u0 * a0 + u1 * a1 + u2 * a2 + u3 * a3;
        }
#pragma omp simd
        for (int64_t d = 0; d < DV; d++) {
            float b0 = d0[d], b1 = d1[d], b2 = d2[d], b3 = d3[d];
            dvj[d] += p0 * b0 + p1 * b1 + p2 * b2 + p3 * b3;
            dvk[d] += r0 * b0 + r1 * b1 + r2 * b2 + r3 * b3;
        }
    } else {
#pragma omp simd
        for (int64_t d = 0; d < D; d++)
            dkj[d] += s0 * q0[d] + s1 * q1[d] + s2 * q2[d] + s3 * q3[d];
#pragma omp simd
        for (int64_t d = 0; d < DV; d++)
            dvj[d] += p0 * d0[d] + p1 * d1[d] + p2 * d2[d] + p3 * d3[d];
    }
}

/* The backward of one group of one (batch, query head); dk, dv belong to its kv head (the
 * caller runs every query head of a kv head on the same thread), rows D and DV floats apart.
 * kt, vt: k and v in tiles; kc: k in chunks; q, dq rows qs apart, dout, out os apart (DV
 * wide). S, DS: QG QB rows of T floats each; X: QG QB rows of D + DV floats; spare: D floats.
 * Each key's dk and dv take the group's blocks in order, as the blocks one after another did. */
AM_HOT static void attn_backward_group(float *restrict dq, float *restrict dk, float *restrict dv,
                                       const float *restrict dout, const float *restrict out,
                                       const float *restrict lse, const float *restrict q, const float *restrict kt,
                                       const float *restrict vt, const float *restrict kc, int64_t g0, int64_t T,
                                       int64_t D, int64_t DV, int64_t qs, int64_t os, int64_t W, float scale,
                                       float cap, float *restrict S, float *restrict DS, float *restrict X,
                                       float *restrict spare)
{
    struct qgroup G = group_of(g0, T, W);
    const float *xq[QG][QB], *xd[QG][QB];
    float *g[QG][QB];
    float Dt[QG][QB];
    group_rows(X, xq, &G, q, qs, D);
    group_rows(X + QG * QB * D, xd, &G, dout, os, DV);
    for (int b = 0; b < G.nb; b++)
        for (int r = 0; r < QB; r++) {
            int64_t t = G.t0[b] + (r < G.nr[b] ? r : G.nr[b] - 1);
            g[b][r] = r < G.nr[b] ? dq + (G.t0[b] + r) * qs : spare;
            const float *restrict dor = dout + t * os, *restrict oor = out + t * os;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < DV; d++)
                acc += dor[d] * oor[d];
            Dt[b][r] = acc;
        }
    group_scores(S, T, kt, xq, D, &G);  /* s_j  = q_t · k_j */
    group_scores(DS, T, vt, xd, DV, &G); /* dp_j = dout_t · v_j */
    for (int b = 0; b < G.nb; b++) {
        int64_t t0 = G.t0[b], nr = G.nr[b], np = G.np[b], j0 = G.j0[b];
        for (int r = 0; r < QB; r++) {
            float *restrict srow = S + (b * QB + r) * T, *restrict dsrow = DS + (b * QB + r) * T;
            int64_t n = r < nr ? t0 + r + 1 : 0, lo = first_key(t0 + r, W);
            float L = r < nr ? lse[t0 + r] : 0.0f, Dr = Dt[b][r];
            if (cap > 0.0f) { /* through the cap: d tanh = 1 - tanh² */
                for (int64_t j = j0; j < np; j++) {
                    float th = tanhf(srow[j] * scale / cap), u = th * cap;
                    float p = j >= lo && j < n ? am_expf(u - L) : 0.0f;
                    srow[j] = p;
                    dsrow[j] = p * (dsrow[j] - Dr) * (1.0f - th * th) * scale;
                }
                continue;
            }
#pragma omp simd
            for (int64_t j = j0; j < np; j++) {
                float p = j >= lo && j < n ? am_expf(srow[j] * scale - L) : 0.0f;
                srow[j] = p;
                dsrow[j] = p * (dsrow[j] - Dr) * scale; /* scale * ds_j */
            }
        }
    }
    group_pv(g, kc, T, DS, D, &G); /* dq_t += scale Σ_j ds_j k_j */
    /* dk_j += scale Σ_t ds_j q_t,  dv_j += Σ_t p_j dout_t: key by key (two at a time), the blocks in order */
    int64_t jend = G.nmax[G.nb - 1];
    for (int64_t j = G.jlo; j < jend; j += 2)
        for (int b = 0; b < G.nb; b++)
            if (j >= G.j0[b] && j < G.nmax[b])
                kv_update(dk + j * D, dv + j * DV, D, DV, S + b * QB * T, DS + b * QB * T, T, j, xq[b], xd[b], D, DV,
                          j + 1 < G.nmax[b]);
}

static struct attn_shape check_attention(const char *kernel, const struct am_tensor *o, const struct am_tensor *lse,
                                         const struct am_tensor *q, const struct am_tensor *k,
                                         const struct am_tensor *v)
{
    AM_CHECK(q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && o->ndim == 4,
             "q (%s), k, v and out must be 4-d [B, T, heads, D] (called from %s)", am_tname(q), kernel);
    struct attn_shape s = {q->shape[0], q->shape[1], q->shape[2], k->shape[2], q->shape[3], v->shape[3], 0.0f};
    for (int i = 0; i < 3; i++)
        AM_CHECK(o->shape[i] == q->shape[i], "out (%s) must have q's shape (called from %s)", am_tname(o), kernel);
    AM_CHECK(o->shape[3] == s.DV, "out (%s) must be as wide as v's heads, %lld (called from %s)", am_tname(o),
             (long long)s.DV, kernel);
    AM_CHECK(k->shape[0] == s.B && k->shape[1] == s.T && k->shape[3] == s.D,
             "k (%s) is [%lld, %lld, %lld, %lld]; q is [%lld, %lld, %lld, %lld]: B, T and D must match (called from %s)",
             am_tname(k), (long long)k->shape[0], (long long)k->shape[1], (long long)k->shape[2],
             (long long)k->shape[3], (long long)s.B, (long long)s.T, (long long)s.H, (long long)s.D, kernel);
    for (int i = 0; i < 3; i++)
        AM_CHECK(v->shape[i] == k->shape[i], "v (%s) must have k's shape (called from %s)", am_tname(v), kernel);
    AM_CHECK(s.DV > 0, "v (%s) has heads of width 0 (called from %s)", am_tname(v), kernel);
    AM_CHECK(s.KVH > 0 && s.H % s.KVH == 0, "%lld query heads are not a multiple of %lld kv heads (called from %s)",
             (long long)s.H, (long long)s.KVH, kernel);
    AM_CHECK(am_tensor_numel(lse) == s.B * s.H * s.T, "lse (%s) must be [B, H, T] = [%lld, %lld, %lld] (called from %s)",
             am_tname(lse), (long long)s.B, (long long)s.H, (long long)s.T, kernel);
    s.scale = (float)(1.0 / sqrt((double)s.D)); /* transformers' head_dim ** -0.5, as an fp32 operand */
    return s;
}

/* ---- bf16: the fp32 kernels on widened groups of heads ---- */

/* A chunk: sequences b0 .. b0 + nb - 1 and kv heads kv0 .. kv0 + kc - 1 (with their G query
 * heads each). kv heads per chunk: the scratch (per kv head: floats of q-shaped and k-shaped
 * rows) within a few chunks' worth, but enough query heads for every thread; sequences per
 * chunk: as many as fit beside, when a chunk holds every head (lse [B, H, T] is then one
 * contiguous piece). */
struct attn_chunk {
    int64_t KC, BC;
};

static struct attn_chunk chunking(const struct am_dev *dev, const struct attn_shape *s, int64_t qarrays,
                                  int64_t karrays)
{
    int64_t W = s->D > s->DV ? s->D : s->DV; /* the wider of the heads, for every array */
    int64_t G = s->H / s->KVH, per = s->T * W * (qarrays * G + karrays), budget = 4 * am_cpu_chunk(dev);
    int64_t kc = budget / (per > 0 ? per : 1), need = (omp_get_max_threads() + G - 1) / G;
    kc = kc < need ? need : kc;
    kc = kc < 1 ? 1 : kc > s->KVH ? s->KVH : kc;
    int64_t bc = kc == s->KVH ? budget / (per * kc > 0 ? per * kc : 1) : 1;
    bc = bc < 1 ? 1 : bc > s->B ? s->B : bc;
    return (struct attn_chunk){kc, bc};
}

/* Heads h0 .. h0 + hc - 1 of sequences b0 .. b0 + nb - 1 of a bf16 [B, T, heads, D] tensor,
 * as fp32 [nb, T, hc, D] in buf; and back, rounded. */
static struct am_tensor gather(const struct am_tensor *t, int64_t b0, int64_t nb, int64_t h0, int64_t hc, float *buf)
{
    int64_t T = t->shape[1], Ht = t->shape[2], D = t->shape[3];
    am_bf16_widen(buf, hc * D, (const uint16_t *)t->data + (b0 * T * Ht + h0) * D, Ht * D, nb * T, hc * D);
    return am_f32_view(buf, nb, T, hc, D);
}

static void scatter(struct am_tensor *t, int64_t b0, int64_t h0, const struct am_tensor *f)
{
    int64_t T = t->shape[1], Ht = t->shape[2], D = t->shape[3], nb = f->shape[0], hc = f->shape[2];
    am_bf16_narrow((uint16_t *)t->data + (b0 * T * Ht + h0) * D, Ht * D, f->data, hc * D, nb * T, hc * D);
}

static void attention_forward_bf16(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse,
                                   const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                   int64_t window, float scale, float cap)
{
    const char *kernel = "am_cpu_attention_forward";
    am_cpu_act(kernel, "q", q);
    am_cpu_same(kernel, "k", k, "q", q);
    am_cpu_same(kernel, "v", v, "q", q);
    am_cpu_same(kernel, "out", out, "q", q);
    am_cpu_stat(kernel, "lse", lse);
    struct attn_shape s = check_attention(kernel, out, lse, q, k, v);
    struct attn_chunk ch = chunking(dev, &s, 2, 2);
    int64_t G = s.H / s.KVH, qn = ch.BC * s.T * ch.KC * G * s.D, kn = ch.BC * s.T * ch.KC * s.D;
    int64_t on = ch.BC * s.T * ch.KC * G * s.DV, vn = ch.BC * s.T * ch.KC * s.DV; /* out's and v's */
    float *ws = am_cpu_scratch(kernel, dev, qn + on + kn + vn + 64);
    float *qb = am_cpu_carve(&ws, qn), *ob = am_cpu_carve(&ws, on), *kb = am_cpu_carve(&ws, kn);
    float *vb = am_cpu_carve(&ws, vn);
    for (int64_t b0 = 0; b0 < s.B; b0 += ch.BC)
        for (int64_t kv0 = 0; kv0 < s.KVH; kv0 += ch.KC) {
            int64_t nb = s.B - b0 < ch.BC ? s.B - b0 : ch.BC, kc = s.KVH - kv0 < ch.KC ? s.KVH - kv0 : ch.KC;
            int64_t h0 = kv0 * G, hc = kc * G;
            struct am_tensor tq = gather(q, b0, nb, h0, hc, qb), tk = gather(k, b0, nb, kv0, kc, kb);
            struct am_tensor tv = gather(v, b0, nb, kv0, kc, vb), to = am_f32_view(ob, nb, s.T, hc, s.DV);
            struct am_tensor tl = am_f32_view((float *)lse->data + (b0 * s.H + h0) * s.T, nb, hc, s.T, 0);
            am_cpu_attention_softcap_forward(dev, &to, &tl, &tq, &tk, &tv, window, scale, cap);
            scatter(out, b0, h0, &to);
        }
}

static void attention_backward_bf16(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk,
                                    struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                    const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                    const struct am_tensor *v, int64_t window, float scale, float cap)
{
    const char *kernel = "am_cpu_attention_backward";
    am_cpu_act(kernel, "q", q);
    const struct am_tensor *same[] = {k, v, out, dout, dq, dk, dv};
    const char *names[] = {"k", "v", "out", "dout", "dq", "dk", "dv"};
    for (int i = 0; i < 7; i++)
        am_cpu_same(kernel, names[i], same[i], "q", q);
    am_cpu_stat(kernel, "lse", lse);
    struct attn_shape s = check_attention(kernel, out, lse, q, k, v);
    AM_CHECK(am_tensor_numel(dq) == am_tensor_numel(q) && am_tensor_numel(dout) == am_tensor_numel(out) &&
                 am_tensor_numel(dk) == am_tensor_numel(k) && am_tensor_numel(dv) == am_tensor_numel(v) &&
                 dq->ndim == 4 && dout->ndim == 4 && dk->ndim == 4 && dv->ndim == 4 && dout->shape[3] == s.DV &&
                 dv->shape[3] == s.DV,
             "dq (%s) and dout must have q's shape, dk (%s) and dv k's", am_tname(dq), am_tname(dk));
    struct attn_chunk ch = chunking(dev, &s, 4, 4);
    int64_t G = s.H / s.KVH, qn = ch.BC * s.T * ch.KC * G * s.D, kn = ch.BC * s.T * ch.KC * s.D;
    int64_t on = ch.BC * s.T * ch.KC * G * s.DV, vn = ch.BC * s.T * ch.KC * s.DV; /* out's and v's */
    float *ws = am_cpu_scratch(kernel, dev, 2 * qn + 2 * on + 2 * kn + 2 * vn + 128);
    float *qb = am_cpu_carve(&ws, qn), *ob = am_cpu_carve(&ws, on), *dob = am_cpu_carve(&ws, on);
    float *dqb = am_cpu_carve(&ws, qn), *kb = am_cpu_carve(&ws, kn), *vb = am_cpu_carve(&ws, vn);
    float *dkb = am_cpu_carve(&ws, kn), *dvb = am_cpu_carve(&ws, vn);
    for (int64_t b0 = 0; b0 < s.B; b0 += ch.BC)
        for (int64_t kv0 = 0; kv0 < s.KVH; kv0 += ch.KC) {
            int64_t nb = s.B - b0 < ch.BC ? s.B - b0 : ch.BC, kc = s.KVH - kv0 < ch.KC ? s.KVH - kv0 : ch.KC;
            int64_t h0 = kv0 * G, hc = kc * G;
            struct am_tensor tq = gather(q, b0, nb, h0, hc, qb), to = gather(out, b0, nb, h0, hc, ob);
            struct am_tensor tdo = gather(dout, b0, nb, h0, hc, dob), tdq = gather(dq, b0, nb, h0, hc, dqb);
            struct am_tensor tk = gather(k, b0, nb, kv0, kc, kb), tv = gather(v, b0, nb, kv0, kc, vb);
            struct am_tensor tdk = gather(dk, b0, nb, kv0, kc, dkb), tdv = gather(dv, b0, nb, kv0, kc, dvb);
            struct am_tensor tl = am_f32_view((float *)lse->data + (b0 * s.H + h0) * s.T, nb, hc, s.T, 0);
            am_cpu_attention_softcap_backward(dev, &tdq, &tdk, &tdv, &tdo, &to, &tl, &tq, &tk, &tv, window, scale, cap);
            scatter(dq, b0, h0, &tdq);
            scatter(dk, b0, kv0, &tdk);
            scatter(dv, b0, kv0, &tdv);
        }
}

void am_cpu_attention_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *q,
                              const struct am_tensor *k, const struct am_tensor *v, int64_t window)
{
    am_cpu_attention_softcap_forward(dev, out, lse, q, k, v, window, 0.0f, 0.0f);
}

void am_cpu_attention_softcap_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse,
                                      const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                      int64_t window, float scale, float cap)
{
    if (am_not_f32(out) || am_not_f32(q) || am_not_f32(k) || am_not_f32(v)) {
        attention_forward_bf16(dev, out, lse, q, k, v, window, scale, cap);
        return;
    }
    float *o = F32(out), *l = F32(lse);
    const float *qd = F32(q), *kd = F32(k), *vd = F32(v);
    struct attn_shape s = check_attention(__func__, out, lse, q, k, v);
    if (scale > 0.0f)
        s.scale = scale;
    int64_t B = s.B, T = s.T, H = s.H, KVH = s.KVH, D = s.D, DV = s.DV, G = H / KVH;
    int64_t qs = H * D, ks = KVH * D, os = H * DV, vs = KVH * DV;
    bool fail = false;
#pragma omp parallel if (B * H > 1 && B * H * T * T * D >= AM_PAR_MIN) reduction(|| : fail)
    {
        /* a group's rows of scores and of q, the head's keys in tiles and values in chunks, a spare row */
        size_t tn = (size_t)packed_size(T, D), vn = (size_t)packed_size(T, DV);
        float *S = malloc(((size_t)(QG * QB) * (size_t)(T + D) + tn + vn + (size_t)DV) * sizeof(float));
        if (!S)
            fail = true;
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                if (!S)
                    continue;
                int64_t kvh = h / G;
                float *X = S + QG * QB * T, *kt = X + QG * QB * D, *vc = kt + tn, *spare = vc + vn;
                pack_tiles(kt, kd + b * T * ks + kvh * D, T, D, ks);
                pack_chunks(vc, vd + b * T * vs + kvh * DV, T, DV, vs);
                for (int64_t g0 = 0; g0 < T; g0 += QG * QB)
                    attn_forward_group(o + b * T * os + h * DV, l + (b * H + h) * T, qd + b * T * qs + h * D, kt, vc,
                                       g0, T, D, DV, qs, os, window, s.scale, cap, S, X, spare);
            }
        free(S);
    }
    AM_CHECK(!fail, "out of memory for %d rows of %lld scores", QB, (long long)T);
}

void am_cpu_attention_backward(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                               const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                               const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                               int64_t window)
{
    am_cpu_attention_softcap_backward(dev, dq, dk, dv, dout, out, lse, q, k, v, window, 0.0f, 0.0f);
}

void am_cpu_attention_softcap_backward(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk,
                                       struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                       const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                       const struct am_tensor *v, int64_t window, float scale, float cap)
{
    if (am_not_f32(dq) || am_not_f32(dk) || am_not_f32(dv) || am_not_f32(dout) || am_not_f32(out) || am_not_f32(q) ||
        am_not_f32(k) || am_not_f32(v)) {
        attention_backward_bf16(dev, dq, dk, dv, dout, out, lse, q, k, v, window, scale, cap);
        return;
    }
    float *dqd = F32(dq), *dkd = F32(dk), *dvd = F32(dv);
    const float *dod = F32(dout), *od = F32(out), *ld = F32(lse), *qd = F32(q), *kd = F32(k), *vd = F32(v);
    struct attn_shape s = check_attention(__func__, out, lse, q, k, v);
    AM_CHECK(am_tensor_numel(dq) == am_tensor_numel(q) && am_tensor_numel(dout) == am_tensor_numel(out),
             "dq (%s) and dout (%s) must have q's shape", am_tname(dq), am_tname(dout));
    AM_CHECK(am_tensor_numel(dk) == am_tensor_numel(k) && am_tensor_numel(dv) == am_tensor_numel(v),
             "dk (%s) and dv (%s) must have k's shape", am_tname(dk), am_tname(dv));
    if (scale > 0.0f)
        s.scale = scale;
    int64_t B = s.B, T = s.T, H = s.H, KVH = s.KVH, D = s.D, DV = s.DV, G = H / KVH;
    int64_t qs = H * D, ks = KVH * D, os = H * DV, vs = KVH * DV;
    bool fail = false;
#pragma omp parallel if (B * KVH > 1 && B * H * T * T * D >= AM_PAR_MIN) reduction(|| : fail)
    {
        /* a group's rows of p, of ds, of q and of dout, k in tiles and in chunks, v in tiles, the kv
         * head's dk and dv rows back to back, a spare row */
        size_t tk = (size_t)packed_size(T, D), tv = (size_t)packed_size(T, DV), rows = (size_t)(QG * QB);
        float *S = malloc((2 * rows * (size_t)T + rows * (size_t)(D + DV) + 2 * tk + tv + (size_t)(T * (D + DV)) +
                           (size_t)D) * sizeof(float));
        if (!S)
            fail = true;
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t kvh = 0; kvh < KVH; kvh++) {
                if (!S)
                    continue;
                int64_t ko = b * T * ks + kvh * D, vo = b * T * vs + kvh * DV;
                float *DS = S + QG * QB * T, *X = DS + QG * QB * T, *kt = X + QG * QB * (D + DV), *kc = kt + tk;
                float *vt = kc + tk, *dkh = vt + tv, *dvh = dkh + T * D, *spare = dvh + T * DV;
                pack_tiles(kt, kd + ko, T, D, ks);
                pack_chunks(kc, kd + ko, T, D, ks);
                pack_tiles(vt, vd + vo, T, DV, vs);
                pack_rows(dkh, dkd + ko, T, D, ks);
                pack_rows(dvh, dvd + vo, T, DV, vs);
                for (int64_t h = kvh * G; h < (kvh + 1) * G; h++) {
                    int64_t qo = b * T * qs + h * D, oo = b * T * os + h * DV;
                    for (int64_t g0 = 0; g0 < T; g0 += QG * QB)
                        attn_backward_group(dqd + qo, dkh, dvh, dod + oo, od + oo, ld + (b * H + h) * T, qd + qo, kt,
                                            vt, kc, g0, T, D, DV, qs, os, window, s.scale, cap, S, DS, X, spare);
                }
                unpack_rows(dkd + ko, dkh, T, D, ks);
                unpack_rows(dvd + vo, dvh, T, DV, vs);
            }
        free(S);
    }
    AM_CHECK(!fail, "out of memory for %d rows of %lld scores", 2 * QB, (long long)T);
}
