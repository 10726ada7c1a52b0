/* crossentropy.c - cross-entropy fused with the output projection, vocabulary-parallel,
 * in tiles of tokens x vocabulary so that the logits [N, V] never exist whole.
 *
 * x [N, C] final hidden states, w [V, C] this shard of the head (vocabulary ids
 * vocab_start .. vocab_start + V - 1), targets [N] (< 0: ignored). For a tile of rows and
 * vocabulary entries:
 *   logits = x_rows · w_vocabᵀ                               (sgemm into scratch)
 *   ce_stats:    m_i = max_v logit_iv,  s_i = Σ_v exp(logit_iv - m_i),
 *                t_i = logit_i,target (0 when the target is not in this shard)
 *                (over the vocabulary tiles with the online rescaling of s when m grows:
 *                 s <- s exp(m_old - m_new) + Σ_tile exp(logit - m_new))
 *   (the caller combines shards: M = max m, S = Σ s exp(m - M), T = Σ t,
 *    loss_i = log S + M - T)
 *   ce_backward: dlogit_iv = (exp(logit_iv - M_i - log S_i) - [v == target_i]) * scale
 *                for rows with a target, 0 for ignored rows; then
 *                dx_rows += dlogits · w_vocab,   dw_vocab += dlogitsᵀ · x_rows
 * The backward recomputes the logits (one more sgemm) instead of storing them; ce_fused,
 * for a head holding the whole vocabulary, does both in one pass over the logits.
 *
 * Gemma's final_logit_softcapping (ce_stats_softcap, ce_backward_softcap): each tile of
 * logits is capped where it is computed, logit <- c * tanh(logit / c) (transformers' order:
 * / c, tanh, * c), and the backward's dlogits are multiplied by 1 - (capped / c)².
 *
 * LoRA on the head (ce_stats_lora, ce_backward_lora): u [N, r] (the adapter's scaled
 * x · Aᵀ) and b [V, r] (this shard of lora_B) add u_rows · b_vocabᵀ to each tile of logits
 * (one more sgemm, before the cap); the backward adds du_rows += dlogits · b_vocab beside dx
 * and db_vocab += dlogitsᵀ · u_rows beside dw. Without u (NULL) nothing changes.
 *
 * Threads: ce_stats gives each thread whole chunks of rows (its own scratch, its own
 * sgemms). The backward works on one tile at a time with all threads: first each thread
 * takes a slice of the tile's vocabulary (its columns of the logits, its rows of dw: one
 * writer each), then, after a barrier, a slice of the tile's rows for dx (the sum over the
 * tile's vocabulary in one sgemm, tiles added in order). Nothing is summed across threads.
 * Rows per chunk are 256: OpenBLAS packs the weight tile once per sgemm, and below ~128
 * rows that packing costs more than the multiply.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu.h"

#define CE_ROWS 256                /* rows per chunk */
#define CE_TILE_FLOATS (1L << 21)  /* logits per scratch tile (8 MiB) */

static void check_ce(const char *kernel, const struct am_tensor *x, const struct am_tensor *w,
                     const struct am_tensor *targets)
{
    if (am_cols(x) != am_cols(w))
        am_cpu_fatal(kernel, "x (%s) has rows of %lld, w (%s) of %lld: both must be the hidden size", am_tname(x),
                     (long long)am_cols(x), am_tname(w), (long long)am_cols(w));
    if (am_tensor_numel(targets) != am_rows(x))
        am_cpu_fatal(kernel, "targets (%s) has %lld entries for %lld rows of x", am_tname(targets),
                     (long long)am_tensor_numel(targets), (long long)am_rows(x));
}

/* Vocabulary entries per tile for chunks of R rows (the whole shard when it fits). */
static int64_t vocab_tile(int64_t R, int64_t V)
{
    int64_t vt = CE_TILE_FLOATS / R / 16 * 16;
    if (vt < 256)
        vt = 256;
    return vt < V ? vt : V;
}

/* Folds one tile of a row's logits into its running max m and sum s. */
AM_HOT static void tile_stats(const float *restrict l, int64_t n, float *m, float *s)
{
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t v = 0; v < n; v++)
        mx = l[v] > mx ? l[v] : mx;
    if (mx > *m) { /* a new maximum: rescale what was summed so far */
        *s = *m == -INFINITY ? 0.0f : *s * am_expf(*m - mx);
        *m = mx;
    }
    float base = *m, sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t v = 0; v < n; v++)
        sum += am_expf(l[v] - base);
    *s += sum;
}

/* Caps rows [0, nr) x columns [a, b) of a tile of logits in place (cap > 0). */
static void cap_tile(float *restrict L, int64_t ld, int64_t nr, int64_t a, int64_t b, float cap)
{
    for (int64_t r = 0; r < nr; r++)
        for (int64_t v = a; v < b; v++)
            L[r * ld + v] = tanhf(L[r * ld + v] / cap) * cap;
}

/* ---- bf16: the fp32 kernels on widened chunks ---- */

/* Rows and vocabulary entries per chunk: am_cpu_chunk floats of x or w each, at least 256
 * (CE_ROWS: ce_fused's decision for a chunk is then its decision for the whole). */
static int64_t chunk_rows(const struct am_dev *dev, int64_t C, int64_t n)
{
    int64_t r = am_cpu_chunk(dev) / (C > 0 ? C : 1);
    r = r < CE_ROWS ? CE_ROWS : r;
    return r < n ? r : n > 0 ? n : 1;
}

static void check_ce_bf16(const char *kernel, const struct am_tensor *x, const struct am_tensor *w,
                          const struct am_tensor *targets)
{
    am_cpu_act(kernel, "x", x);
    am_cpu_same(kernel, "w", w, "x", x);
    am_cpu_i32(kernel, "targets", targets);
    check_ce(kernel, x, w, targets);
}

static void stats_f32(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                      const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *u,
                      const struct am_tensor *b, const struct am_tensor *targets, int64_t vocab_start, float cap);
static void backward_f32(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, struct am_tensor *du,
                         struct am_tensor *db, const struct am_tensor *x, const struct am_tensor *w,
                         const struct am_tensor *u, const struct am_tensor *b, const struct am_tensor *targets,
                         int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S, float dloss_scale,
                         float cap);

/* LoRA's u [N, r] and b [V, r] beside x and w (u NULL: none). */
static void check_lora(const char *kernel, const struct am_tensor *x, const struct am_tensor *w,
                       const struct am_tensor *u, const struct am_tensor *b)
{
    if (!u)
        return;
    am_cpu_same(kernel, "u", u, "x", x);
    am_cpu_same(kernel, "b", b, "x", x);
    AM_CHECK(am_rows(u) == am_rows(x) && am_rows(b) == am_rows(w) && am_cols(u) == am_cols(b),
             "u (%s) must be [%lld, r] and b (%s) [%lld, r]", am_tname(u), (long long)am_rows(x), am_tname(b),
             (long long)am_rows(w));
}

static void ce_stats_bf16(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                          const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *u,
                          const struct am_tensor *b, const struct am_tensor *targets, int64_t vocab_start, float cap)
{
    const char *kernel = "am_cpu_ce_stats";
    check_ce_bf16(kernel, x, w, targets);
    am_cpu_stat(kernel, "m", m);
    am_cpu_stat(kernel, "s", s);
    am_cpu_stat(kernel, "t", t);
    check_lora(kernel, x, w, u, b);
    int64_t N = am_rows(x), C = am_cols(x), V = am_rows(w), rk = u ? am_cols(u) : 0;
    AM_CHECK(am_tensor_numel(m) == N && am_tensor_numel(s) == N && am_tensor_numel(t) == N,
             "m (%s), s and t must have one entry per row of x (%lld)", am_tname(m), (long long)N);
    int64_t R = chunk_rows(dev, C, N), VC = chunk_rows(dev, C, V), wv = -1;
    float *ws = am_cpu_scratch(kernel, dev, R * C + VC * C + 3 * R + 64 + (rk ? (R + VC) * rk + 64 : 0));
    float *xb = am_cpu_carve(&ws, R * C), *wb = am_cpu_carve(&ws, VC * C), *m2 = am_cpu_carve(&ws, R);
    float *s2 = am_cpu_carve(&ws, R), *t2 = am_cpu_carve(&ws, R), *wf = NULL;
    float *ub = rk ? am_cpu_carve(&ws, R * rk) : NULL, *bb = rk ? am_cpu_carve(&ws, VC * rk) : NULL, *bf = NULL;
    for (int64_t r0 = 0; r0 < N; r0 += R) {
        int64_t nr = N - r0 < R ? N - r0 : R;
        struct am_tensor tx = am_f32_view(am_cpu_load(x, r0 * C, nr * C, xb), nr, C, 0, 0);
        struct am_tensor tu = am_f32_view(rk ? am_cpu_load(u, r0 * rk, nr * rk, ub) : NULL, nr, rk, 0, 0);
        struct am_tensor tg = am_tensor_view((int32_t *)targets->data + r0, AM_DEV_CPU, AM_I32, nr, 0, 0, 0);
        float *md = (float *)m->data + r0, *sd = (float *)s->data + r0, *td = (float *)t->data + r0;
        for (int64_t v0 = 0; v0 < V; v0 += VC) {
            int64_t vc = V - v0 < VC ? V - v0 : VC;
            if (wv != v0) { /* (one chunk of vocabulary: widened once for every row chunk) */
                wf = am_cpu_load(w, v0 * C, vc * C, wb);
                bf = rk ? am_cpu_load(b, v0 * rk, vc * rk, bb) : NULL;
            }
            wv = v0;
            struct am_tensor tw = am_f32_view(wf, vc, C, 0, 0), tb = am_f32_view(bf, vc, rk, 0, 0);
            bool first = v0 == 0;
            struct am_tensor tm = am_f32_view(first ? md : m2, nr, 0, 0, 0), ts = am_f32_view(first ? sd : s2, nr, 0, 0, 0);
            struct am_tensor tt = am_f32_view(first ? td : t2, nr, 0, 0, 0);
            stats_f32(dev, &tm, &ts, &tt, &tx, &tw, rk ? &tu : NULL, rk ? &tb : NULL, &tg, vocab_start + v0, cap);
            for (int64_t r = 0; !first && r < nr; r++) { /* combine, as the shards of a tp group */
                float mx = md[r] > m2[r] ? md[r] : m2[r];
                sd[r] = sd[r] * expf(md[r] - mx) + s2[r] * expf(m2[r] - mx);
                md[r] = mx;
                td[r] += t2[r];
            }
        }
    }
}

static void ce_backward_bf16(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, struct am_tensor *du,
                             struct am_tensor *db, const struct am_tensor *x, const struct am_tensor *w,
                             const struct am_tensor *u, const struct am_tensor *b, const struct am_tensor *targets,
                             int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S, float dloss_scale,
                             float cap)
{
    const char *kernel = "am_cpu_ce_backward";
    check_ce_bf16(kernel, x, w, targets);
    am_cpu_stat(kernel, "M", M);
    am_cpu_stat(kernel, "S", S);
    if (dx)
        am_cpu_same(kernel, "dx", dx, "x", x);
    if (dw)
        am_cpu_grad(kernel, "dw", dw, "x", x);
    check_lora(kernel, x, w, u, b);
    int64_t N = am_rows(x), C = am_cols(x), V = am_rows(w), rk = u ? am_cols(u) : 0;
    AM_CHECK(am_tensor_numel(M) == N && am_tensor_numel(S) == N, "M (%s) and S (%s) need one entry per row (%lld)",
             am_tname(M), am_tname(S), (long long)N);
    AM_CHECK(!dx || (am_rows(dx) == N && am_cols(dx) == C), "dx (%s) must have x's shape", am_tname(dx));
    AM_CHECK(!dw || (am_rows(dw) == V && am_cols(dw) == C), "dw (%s) must have w's shape", am_tname(dw));
    AM_CHECK(!rk || (du && db && am_rows(du) == N && am_cols(du) == rk && am_rows(db) == V && am_cols(db) == rk),
             "du and db must have u's and b's shapes");
    if (rk) {
        am_cpu_same(kernel, "du", du, "u", u);
        am_cpu_grad(kernel, "db", db, "u", u);
    }
    if ((!dx && !dw && !rk) || N == 0 || V == 0)
        return;
    int64_t R = chunk_rows(dev, C, N), VC = chunk_rows(dev, C, V), wv = -1;
    bool dw_bf16 = dw && dw->dtype == AM_BF16, db_bf16 = rk && db->dtype == AM_BF16;
    float *ws = am_cpu_scratch(kernel, dev, 2 * R * C + VC * C + (dw_bf16 ? V * C : 0) +
                                                (rk ? 2 * R * rk + VC * rk + (db_bf16 ? V * rk : 0) + 64 : 0) + 64);
    float *xb = am_cpu_carve(&ws, R * C), *dxb = am_cpu_carve(&ws, R * C), *wb = am_cpu_carve(&ws, VC * C), *wf = NULL;
    float *ub = rk ? am_cpu_carve(&ws, R * rk) : NULL, *dub = rk ? am_cpu_carve(&ws, R * rk) : NULL;
    float *bb = rk ? am_cpu_carve(&ws, VC * rk) : NULL, *bf = NULL;
    float *dbf = rk ? am_cpu_load(db, 0, V * rk, am_cpu_carve(&ws, db_bf16 ? V * rk : 0)) : NULL;
    float *dwf = dw ? am_cpu_load(dw, 0, V * C, ws) : NULL; /* f32: dw itself; bf16: widened, whole */
    for (int64_t r0 = 0; r0 < N; r0 += R) {
        int64_t nr = N - r0 < R ? N - r0 : R;
        struct am_tensor tx = am_f32_view(am_cpu_load(x, r0 * C, nr * C, xb), nr, C, 0, 0);
        struct am_tensor tdx = am_f32_view(dx ? am_cpu_load(dx, r0 * C, nr * C, dxb) : NULL, nr, C, 0, 0);
        struct am_tensor tu = am_f32_view(rk ? am_cpu_load(u, r0 * rk, nr * rk, ub) : NULL, nr, rk, 0, 0);
        struct am_tensor tdu = am_f32_view(rk ? am_cpu_load(du, r0 * rk, nr * rk, dub) : NULL, nr, rk, 0, 0);
        struct am_tensor tg = am_tensor_view((int32_t *)targets->data + r0, AM_DEV_CPU, AM_I32, nr, 0, 0, 0);
        struct am_tensor tM = am_f32_view((float *)M->data + r0, nr, 0, 0, 0);
        struct am_tensor tS = am_f32_view((float *)S->data + r0, nr, 0, 0, 0);
        for (int64_t v0 = 0; v0 < V; v0 += VC) {
            int64_t vc = V - v0 < VC ? V - v0 : VC;
            if (wv != v0) {
                wf = am_cpu_load(w, v0 * C, vc * C, wb);
                bf = rk ? am_cpu_load(b, v0 * rk, vc * rk, bb) : NULL;
            }
            wv = v0;
            struct am_tensor tw = am_f32_view(wf, vc, C, 0, 0), tb = am_f32_view(bf, vc, rk, 0, 0);
            struct am_tensor tdw = am_f32_view(dwf ? dwf + v0 * C : NULL, vc, C, 0, 0);
            struct am_tensor tdb = am_f32_view(dbf ? dbf + v0 * rk : NULL, vc, rk, 0, 0);
            backward_f32(dev, dx ? &tdx : NULL, dw ? &tdw : NULL, rk ? &tdu : NULL, rk ? &tdb : NULL, &tx, &tw,
                         rk ? &tu : NULL, rk ? &tb : NULL, &tg, vocab_start + v0, &tM, &tS, dloss_scale, cap);
        }
        if (dx)
            am_cpu_store(dx, r0 * C, nr * C, tdx.data);
        if (rk)
            am_cpu_store(du, r0 * rk, nr * rk, tdu.data);
    }
    if (dw)
        am_cpu_store(dw, 0, V * C, dwf);
    if (rk)
        am_cpu_store(db, 0, V * rk, dbf);
}

static bool ce_fused_bf16(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                          struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x, const struct am_tensor *w,
                          const struct am_tensor *targets, float dloss_scale)
{
    const char *kernel = "am_cpu_ce_fused";
    check_ce_bf16(kernel, x, w, targets);
    am_cpu_stat(kernel, "m", m);
    am_cpu_stat(kernel, "s", s);
    am_cpu_stat(kernel, "t", t);
    am_cpu_same(kernel, "dx", dx, "x", x);
    am_cpu_grad(kernel, "dw", dw, "x", x);
    int64_t N = am_rows(x), C = am_cols(x), V = am_rows(w);
    int64_t R0 = N < CE_ROWS ? N : CE_ROWS;
    if (R0 < 1 || vocab_tile(R0, V) < V || V * C > 4 * AM_BF16_CHUNK)
        return false;
    AM_CHECK(am_tensor_numel(m) == N && am_tensor_numel(s) == N && am_tensor_numel(t) == N,
             "m (%s), s and t must have one entry per row of x (%lld)", am_tname(m), (long long)N);
    AM_CHECK(am_rows(dx) == N && am_cols(dx) == C, "dx (%s) must have x's shape", am_tname(dx));
    AM_CHECK(am_rows(dw) == V && am_cols(dw) == C, "dw (%s) must have w's shape", am_tname(dw));
    int64_t R = chunk_rows(dev, C, N);
    float *ws = am_cpu_scratch(kernel, dev, 2 * R * C + (dw->dtype == AM_BF16 ? 2 : 1) * V * C + 64);
    float *xb = am_cpu_carve(&ws, R * C), *dxb = am_cpu_carve(&ws, R * C);
    struct am_tensor tw = am_f32_view(am_cpu_load(w, 0, V * C, am_cpu_carve(&ws, V * C)), V, C, 0, 0);
    float *dwf = am_cpu_load(dw, 0, V * C, ws);
    struct am_tensor tdw = am_f32_view(dwf, V, C, 0, 0);
    for (int64_t r0 = 0; r0 < N; r0 += R) {
        int64_t nr = N - r0 < R ? N - r0 : R;
        struct am_tensor tx = am_f32_view(am_cpu_load(x, r0 * C, nr * C, xb), nr, C, 0, 0);
        struct am_tensor tdx = am_f32_view(am_cpu_load(dx, r0 * C, nr * C, dxb), nr, C, 0, 0);
        struct am_tensor tg = am_tensor_view((int32_t *)targets->data + r0, AM_DEV_CPU, AM_I32, nr, 0, 0, 0);
        struct am_tensor tm = am_f32_view((float *)m->data + r0, nr, 0, 0, 0);
        struct am_tensor ts = am_f32_view((float *)s->data + r0, nr, 0, 0, 0);
        struct am_tensor tt = am_f32_view((float *)t->data + r0, nr, 0, 0, 0);
        bool done = am_cpu_ce_fused(dev, &tm, &ts, &tt, &tdx, &tdw, &tx, &tw, &tg, dloss_scale);
        AM_CHECK(done, "a chunk of %lld rows was refused where the whole was not (a bug)", (long long)nr);
        am_cpu_store(dx, r0 * C, nr * C, tdx.data);
    }
    am_cpu_store(dw, 0, V * C, dwf);
    return true;
}

void am_cpu_ce_stats(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t, const struct am_tensor *x,
                     const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start)
{
    am_cpu_ce_stats_softcap(dev, m, s, t, x, w, targets, vocab_start, 0.0f);
}

void am_cpu_ce_stats_softcap(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                             const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                             int64_t vocab_start, float cap)
{
    am_cpu_ce_stats_lora(dev, m, s, t, x, w, NULL, NULL, targets, vocab_start, cap);
}

void am_cpu_ce_stats_lora(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                          const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *u,
                          const struct am_tensor *b, const struct am_tensor *targets, int64_t vocab_start, float cap)
{
    if (am_not_f32(x) || am_not_f32(w) || (u && (am_not_f32(u) || am_not_f32(b))))
        ce_stats_bf16(dev, m, s, t, x, w, u, b, targets, vocab_start, cap);
    else
        stats_f32(dev, m, s, t, x, w, u, b, targets, vocab_start, cap);
}

static void stats_f32(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                      const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *u,
                      const struct am_tensor *b, const struct am_tensor *targets, int64_t vocab_start, float cap)
{
    float *md = F32(m), *sd = F32(s), *td = F32(t);
    const float *xd = F32(x), *wd = F32(w);
    const int32_t *tg = I32(targets);
    check_ce("am_cpu_ce_stats_softcap", x, w, targets);
    check_lora("am_cpu_ce_stats_lora", x, w, u, b);
    int64_t N = am_rows(x), C = am_cols(x), V = am_rows(w), rk = u ? am_cols(u) : 0;
    const float *ud = u ? F32(u) : NULL, *bd = u ? F32(b) : NULL;
    AM_CHECK(am_tensor_numel(m) == N && am_tensor_numel(s) == N && am_tensor_numel(t) == N,
             "m (%s), s and t must have one entry per row of x (%lld)", am_tname(m), (long long)N);
    int nth = omp_get_max_threads();
    int64_t R = CE_ROWS;
    if (nth > 1 && N < R * nth) /* fewer rows than threads x chunk: smaller chunks, one or more each */
        R = (N + nth - 1) / nth;
    if (R < 1)
        R = 1;
    int64_t VT = vocab_tile(R, V), nchunks = (N + R - 1) / R;
    bool fail = false;
#pragma omp parallel if (nchunks > 1 && N * V * C >= (1 << 20)) reduction(|| : fail)
    {
        float *L = malloc((size_t)(R * (VT > 0 ? VT : 1)) * sizeof(float));
        if (!L)
            fail = true;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < nchunks; c++) {
            if (!L)
                continue;
            int64_t r0 = c * R, nr = N - r0 < R ? N - r0 : R;
            for (int64_t r = 0; r < nr; r++) {
                md[r0 + r] = -INFINITY;
                sd[r0 + r] = 0.0f;
                td[r0 + r] = 0.0f;
            }
            for (int64_t v0 = 0; v0 < V; v0 += VT) {
                int64_t vt = V - v0 < VT ? V - v0 : VT;
                am_cpu_sgemm1(false, true, nr, vt, C, 1.0f, xd + r0 * C, C, wd + v0 * C, C, 0.0f, L, VT);
                if (rk)
                    am_cpu_sgemm1(false, true, nr, vt, rk, 1.0f, ud + r0 * rk, rk, bd + v0 * rk, rk, 1.0f, L, VT);
                if (cap > 0.0f)
                    cap_tile(L, VT, nr, 0, vt, cap);
                for (int64_t r = 0; r < nr; r++) {
                    tile_stats(L + r * VT, vt, md + r0 + r, sd + r0 + r);
                    int64_t tl = tg[r0 + r] < 0 ? -1 : (int64_t)tg[r0 + r] - vocab_start - v0;
                    if (tl >= 0 && tl < vt)
                        td[r0 + r] = L[r * VT + tl];
                }
            }
        }
        free(L);
    }
    AM_CHECK(!fail, "out of memory for %lld x %lld logits", (long long)R, (long long)VT);
}

/* Turns rows [0, nr) x columns [a, b) of a tile of logits (vocabulary v0.., rows ld apart)
 * into dlogits, in place. */
AM_HOT static void dlogits_slice(float *restrict L, int64_t ld, int64_t nr, int64_t a, int64_t b, int64_t v0,
                                 const int32_t *restrict tg, int64_t vocab_start, const float *restrict M,
                                 const float *restrict S, float scale, float cap)
{
    for (int64_t r = 0; r < nr; r++) {
        float *restrict l = L + r * ld;
        if (tg[r] < 0) {
            for (int64_t v = a; v < b; v++)
                l[v] = 0.0f;
            continue;
        }
        int64_t tl = (int64_t)tg[r] - vocab_start - v0; /* the target's column in this tile */
        float lse = M[r] + logf(S[r]);
        float at_target = tl >= a && tl < b ? l[tl] : 0.0f;
        if (cap > 0.0f) { /* l holds the capped logits u: through the cap, 1 - (u / c)² */
            for (int64_t v = a; v < b; v++) {
                float u = l[v], g = (am_expf(u - lse) - (v == tl ? 1.0f : 0.0f)) * scale;
                l[v] = g * (1.0f - (u / cap) * (u / cap));
            }
            continue;
        }
#pragma omp simd
        for (int64_t v = a; v < b; v++)
            l[v] = am_expf(l[v] - lse) * scale;
        if (tl >= a && tl < b)
            l[tl] = (am_expf(at_target - lse) - 1.0f) * scale;
    }
}

void am_cpu_ce_backward(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x,
                        const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start,
                        const struct am_tensor *M, const struct am_tensor *S, float dloss_scale)
{
    am_cpu_ce_backward_softcap(dev, dx, dw, x, w, targets, vocab_start, M, S, dloss_scale, 0.0f);
}

void am_cpu_ce_backward_softcap(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw,
                                const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                                int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S,
                                float dloss_scale, float cap)
{
    am_cpu_ce_backward_lora(dev, dx, dw, NULL, NULL, x, w, NULL, NULL, targets, vocab_start, M, S, dloss_scale, cap);
}

void am_cpu_ce_backward_lora(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, struct am_tensor *du,
                             struct am_tensor *db, const struct am_tensor *x, const struct am_tensor *w,
                             const struct am_tensor *u, const struct am_tensor *b, const struct am_tensor *targets,
                             int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S, float dloss_scale,
                             float cap)
{
    if (am_not_f32(dx) || am_not_f32(dw) || am_not_f32(x) || am_not_f32(w) ||
        (u && (am_not_f32(u) || am_not_f32(b) || am_not_f32(du) || am_not_f32(db))))
        ce_backward_bf16(dev, dx, dw, du, db, x, w, u, b, targets, vocab_start, M, S, dloss_scale, cap);
    else
        backward_f32(dev, dx, dw, du, db, x, w, u, b, targets, vocab_start, M, S, dloss_scale, cap);
}

static void backward_f32(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, struct am_tensor *du,
                         struct am_tensor *db, const struct am_tensor *x, const struct am_tensor *w,
                         const struct am_tensor *u, const struct am_tensor *lb, const struct am_tensor *targets,
                         int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S, float dloss_scale,
                         float cap)
{
    const float *xd = F32(x), *wd = F32(w), *Md = F32(M), *Sd = F32(S);
    const int32_t *tg = I32(targets);
    check_ce("am_cpu_ce_backward_softcap", x, w, targets);
    check_lora("am_cpu_ce_backward_lora", x, w, u, lb);
    int64_t N = am_rows(x), C = am_cols(x), V = am_rows(w), rk = u ? am_cols(u) : 0;
    AM_CHECK(am_tensor_numel(M) == N && am_tensor_numel(S) == N, "M (%s) and S (%s) need one entry per row (%lld)",
             am_tname(M), am_tname(S), (long long)N);
    float *dxd = dx ? F32(dx) : NULL, *dwd = dw ? F32(dw) : NULL;
    AM_CHECK(!dx || (am_rows(dx) == N && am_cols(dx) == C), "dx (%s) must have x's shape", am_tname(dx));
    AM_CHECK(!dw || (am_rows(dw) == V && am_cols(dw) == C), "dw (%s) must have w's shape", am_tname(dw));
    AM_CHECK(!rk || (du && db && am_rows(du) == N && am_cols(du) == rk && am_rows(db) == V && am_cols(db) == rk),
             "du and db must have u's and b's shapes");
    const float *ud = rk ? F32(u) : NULL, *bd = rk ? F32(lb) : NULL;
    float *dud = rk ? F32(du) : NULL, *dbd = rk ? F32(db) : NULL;
    if ((!dxd && !dwd && !rk) || N == 0 || V == 0)
        return;
    int64_t R = N < CE_ROWS ? N : CE_ROWS, VT = vocab_tile(R, V);
    float *L = malloc((size_t)(R * VT) * sizeof(float));
    AM_CHECK(L, "out of memory for %lld x %lld logits", (long long)R, (long long)VT);
#pragma omp parallel if (N * V * C >= (1 << 20))
    {
        int id = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int64_t r0 = 0; r0 < N; r0 += R) {
            int64_t nr = N - r0 < R ? N - r0 : R;
            const float *xc = xd + r0 * C;
            for (int64_t v0 = 0; v0 < V; v0 += VT) {
                int64_t vt = V - v0 < VT ? V - v0 : VT, a, b;
                /* this thread's columns of the tile: logits, dlogits, its rows of dw */
                am_split(vt, id, nth, 16, &a, &b);
                am_cpu_sgemm1(false, true, nr, b - a, C, 1.0f, xc, C, wd + (v0 + a) * C, C, 0.0f, L + a, VT);
                if (rk)
                    am_cpu_sgemm1(false, true, nr, b - a, rk, 1.0f, ud + r0 * rk, rk, bd + (v0 + a) * rk, rk, 1.0f,
                                  L + a, VT);
                if (cap > 0.0f)
                    cap_tile(L, VT, nr, a, b, cap);
                dlogits_slice(L, VT, nr, a, b, v0, tg + r0, vocab_start, Md + r0, Sd + r0, dloss_scale, cap);
                if (dwd)
                    am_cpu_sgemm1(true, false, b - a, C, nr, 1.0f, L + a, VT, xc, C, 1.0f, dwd + (v0 + a) * C, C);
                if (rk) /* db's rows of the slice += dlogitsᵀ · u */
                    am_cpu_sgemm1(true, false, b - a, rk, nr, 1.0f, L + a, VT, ud + r0 * rk, rk, 1.0f,
                                  dbd + (v0 + a) * rk, rk);
#pragma omp barrier
                /* this thread's rows of the tile: dx += dlogits · w over the tile's vocabulary */
                if (dxd) {
                    int64_t ra, rb;
                    am_split(nr, id, nth, 1, &ra, &rb);
                    am_cpu_sgemm1(false, false, rb - ra, C, vt, 1.0f, L + ra * VT, VT, wd + v0 * C, C, 1.0f,
                                  dxd + (r0 + ra) * C, C);
                }
                if (rk) { /* and du += dlogits · b */
                    int64_t ra, rb;
                    am_split(nr, id, nth, 1, &ra, &rb);
                    am_cpu_sgemm1(false, false, rb - ra, rk, vt, 1.0f, L + ra * VT, VT, bd + v0 * rk, rk, 1.0f,
                                  dud + (r0 + ra) * rk, rk);
                }
#pragma omp barrier
            }
        }
    }
    free(L);
}

/* The combination of the shards' statistics (kernels.h): libm's expf and logf, tokens in
 * order, so that the loss does not depend on the threads. */
void am_cpu_ce_rescale(const struct am_dev *dev, struct am_tensor *s, const struct am_tensor *m, const struct am_tensor *M)
{
    float *sv = F32(s);
    const float *mv = F32(m), *Mv = F32(M);
    int64_t n = am_tensor_numel(s);
    AM_CHECK(am_tensor_numel(m) == n && am_tensor_numel(M) == n, "s, m and M must have one value per token");
    for (int64_t i = 0; i < n; i++)
        sv[i] = sv[i] * expf(mv[i] - Mv[i]);
}

void am_cpu_ce_loss(const struct am_dev *dev, struct am_tensor *acc, const struct am_tensor *M, const struct am_tensor *S,
                    const struct am_tensor *T, const struct am_tensor *targets)
{
    double *out = F64_SCALAR(acc);
    const float *Mv = F32(M), *Sv = F32(S), *Tv = F32(T);
    const int32_t *tg = I32(targets);
    int64_t n = am_tensor_numel(M);
    AM_CHECK(am_tensor_numel(S) == n && am_tensor_numel(T) == n && am_tensor_numel(targets) == n,
             "M, S, T and targets must have one value per token");
    double sum = 0;
    for (int64_t i = 0; i < n; i++)
        if (tg[i] >= 0)
            sum += (double)logf(Sv[i]) + (double)Mv[i] - (double)Tv[i];
    *out += sum;
}

/* ce_stats + ce_backward over one tile per row chunk (the whole vocabulary: tp = 1). The
 * threads share each chunk as ce_backward does: columns for the logits, rows for the
 * statistics, columns again for dlogits and dw, rows for dx; barriers between. */
bool am_cpu_ce_fused(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t, struct am_tensor *dx,
                     struct am_tensor *dw, const struct am_tensor *x, const struct am_tensor *w,
                     const struct am_tensor *targets, float dloss_scale)
{
    if (am_not_f32(dx) || am_not_f32(dw) || am_not_f32(x) || am_not_f32(w))
        return ce_fused_bf16(dev, m, s, t, dx, dw, x, w, targets, dloss_scale);
    check_ce(__func__, x, w, targets);
    int64_t N = am_rows(x), C = am_cols(x), V = am_rows(w);
    int64_t R = N < CE_ROWS ? N : CE_ROWS;
    if (R < 1 || vocab_tile(R, V) < V)
        return false;
    AM_CHECK(am_tensor_numel(m) == N && am_tensor_numel(s) == N && am_tensor_numel(t) == N,
             "m (%s), s and t must have one entry per row of x (%lld)", am_tname(m), (long long)N);
    AM_CHECK(am_rows(dx) == N && am_cols(dx) == C, "dx (%s) must have x's shape", am_tname(dx));
    AM_CHECK(am_rows(dw) == V && am_cols(dw) == C, "dw (%s) must have w's shape", am_tname(dw));
    float *md = F32(m), *sd = F32(s), *td = F32(t), *dxd = F32(dx), *dwd = F32(dw);
    const float *xd = F32(x), *wd = F32(w);
    const int32_t *tg = I32(targets);
    float *L = malloc((size_t)(R * V) * sizeof(float));
    AM_CHECK(L, "out of memory for %lld x %lld logits", (long long)R, (long long)V);
#pragma omp parallel if (N * V * C >= (1 << 20))
    {
        int id = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int64_t r0 = 0; r0 < N; r0 += R) {
            int64_t nr = N - r0 < R ? N - r0 : R, a, b, ra, rb;
            const float *xc = xd + r0 * C;
            am_split(V, id, nth, 16, &a, &b);
            am_split(nr, id, nth, 1, &ra, &rb);
            am_cpu_sgemm1(false, true, nr, b - a, C, 1.0f, xc, C, wd + a * C, C, 0.0f, L + a, V);
#pragma omp barrier
            for (int64_t r = ra; r < rb; r++) { /* whole rows: max, sum of exp, target logit */
                md[r0 + r] = -INFINITY;
                sd[r0 + r] = 0.0f;
                tile_stats(L + r * V, V, md + r0 + r, sd + r0 + r);
                td[r0 + r] = tg[r0 + r] >= 0 && tg[r0 + r] < V ? L[r * V + tg[r0 + r]] : 0.0f;
            }
#pragma omp barrier
            dlogits_slice(L, V, nr, a, b, 0, tg + r0, 0, md + r0, sd + r0, dloss_scale, 0.0f);
            am_cpu_sgemm1(true, false, b - a, C, nr, 1.0f, L + a, V, xc, C, 1.0f, dwd + a * C, C);
#pragma omp barrier
            am_cpu_sgemm1(false, false, rb - ra, C, V, 1.0f, L + ra * V, V, wd, C, 1.0f, dxd + (r0 + ra) * C, C);
#pragma omp barrier
        }
    }
    free(L);
    return true;
}
