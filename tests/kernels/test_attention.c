/* test_attention.c - the CPU kernels' tests (kernels_test.h: how they are tested): causal
 * grouped-query attention, and by blocks of keys (context parallelism's ring, packed
 * sequences), also with Gemma's scale and soft cap (attention_block_softcap), and with v's heads
 * narrower or wider than q's and k's (multi-head latent attention).
 */
#include "kernels_test.h"
#include "cpu/cpu.h" /* the backend's private helpers (am_expf, am_cpu_set_chunk), used directly */

/* ---- causal grouped-query attention ---- */

struct attn_dims {
    int64_t B, T, H, KVH, D;
    int64_t W; /* sliding window (0: none): query t sees keys t - W < j <= t */
    const int32_t *start; /* packed sequences: [B, T], where row (b, t)'s document starts (NULL: at 0) */
    float scale, cap;     /* Gemma (attention_block_softcap): the scores' scale (0: 1 / sqrt(D)) and soft
                             cap (0: none), u = cap tanh(scale q·k / cap) */
};

/* The scale of the scores, and a score of q · k = dot scaled and capped (th: the cap's tanh, 0
 * without one). */
static double ref_scale(const struct attn_dims *s) { return s->scale > 0 ? (double)s->scale : 1.0 / sqrt((double)s->D); }
static double ref_score(const struct attn_dims *s, double dot, double *th)
{
    double x = dot * ref_scale(s);
    *th = s->cap > 0 ? tanh(x / (double)s->cap) : 0.0;
    return s->cap > 0 ? *th * (double)s->cap : x;
}

/* The first key query t of sequence b sees. */
static int64_t ref_first_key(const struct attn_dims *s, int64_t b, int64_t t)
{
    int64_t lo = s->W > 0 && t - s->W + 1 > 0 ? t - s->W + 1 : 0;
    if (s->start && s->start[b * s->T + t] > lo)
        lo = s->start[b * s->T + t];
    return lo;
}

static void ref_attention(const struct attn_dims *s, const double *q, const double *k, const double *v, double *out,
                          double *lse)
{
    int64_t B = s->B, T = s->T, H = s->H, KVH = s->KVH, D = s->D, G = H / KVH;
    double *sc = dalloc(T), th;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                const double *qt = q + ((b * T + t) * H + h) * D;
                double m = -INFINITY;
                int64_t lo = ref_first_key(s, b, t);
                for (int64_t j = lo; j <= t; j++) {
                    const double *kj = k + ((b * T + j) * KVH + h / G) * D;
                    double dot = 0.0;
                    for (int64_t d = 0; d < D; d++)
                        dot += qt[d] * kj[d];
                    sc[j] = ref_score(s, dot, &th);
                    m = fmax(m, sc[j]);
                }
                double l = 0.0;
                for (int64_t j = lo; j <= t; j++)
                    l += exp(sc[j] - m);
                double *ot = out + ((b * T + t) * H + h) * D;
                for (int64_t d = 0; d < D; d++) {
                    double acc = 0.0;
                    for (int64_t j = lo; j <= t; j++)
                        acc += exp(sc[j] - m) / l * v[((b * T + j) * KVH + h / G) * D + d];
                    ot[d] = acc;
                }
                if (lse)
                    lse[(b * H + h) * T + t] = m + log(l);
            }
    free(sc);
}

/* dq, dk, dv += the gradients of L = Σ out ⊙ dout (softmax backward written out plainly) */
static void ref_attention_backward(const struct attn_dims *s, const double *q, const double *k, const double *v,
                                   const double *dout, double *dq, double *dk, double *dv)
{
    int64_t B = s->B, T = s->T, H = s->H, KVH = s->KVH, D = s->D, G = H / KVH;
    double scale = ref_scale(s), *p = dalloc(T), *dp = dalloc(T), *dth = dalloc(T), th;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                int64_t qo = ((b * T + t) * H + h) * D;
                double m = -INFINITY, l = 0.0;
                int64_t lo = ref_first_key(s, b, t);
                for (int64_t j = lo; j <= t; j++) {
                    double dot = 0.0;
                    for (int64_t d = 0; d < D; d++)
                        dot += q[qo + d] * k[((b * T + j) * KVH + h / G) * D + d];
                    p[j] = ref_score(s, dot, &th);
                    dth[j] = 1.0 - th * th; /* d u / d x through the cap (1 without) */
                    m = fmax(m, p[j]);
                }
                for (int64_t j = lo; j <= t; j++)
                    l += exp(p[j] - m);
                double sum_pdp = 0.0;
                for (int64_t j = lo; j <= t; j++) {
                    int64_t ko = ((b * T + j) * KVH + h / G) * D;
                    p[j] = exp(p[j] - m) / l;
                    dp[j] = 0.0;
                    for (int64_t d = 0; d < D; d++)
                        dp[j] += dout[qo + d] * v[ko + d];
                    sum_pdp += p[j] * dp[j];
                }
                for (int64_t j = lo; j <= t; j++) {
                    int64_t ko = ((b * T + j) * KVH + h / G) * D;
                    double ds = p[j] * (dp[j] - sum_pdp) * dth[j] * scale;
                    for (int64_t d = 0; d < D; d++) {
                        dq[qo + d] += ds * k[ko + d];
                        dk[ko + d] += ds * q[qo + d];
                        dv[ko + d] += p[j] * dout[qo + d];
                    }
                }
            }
    free(p);
    free(dp);
    free(dth);
}

/* The block kernels as the model calls them: attention_block_softcap_* with Gemma's scale and
 * cap, the plain entries otherwise. */
static void blk_forward(const struct attn_dims *s, struct am_tensor *out, struct am_tensor *lse,
                        const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                        const struct am_tensor *qpos, const struct am_tensor *kpos, const struct am_tensor *qstart,
                        int accumulate)
{
    if (s->scale > 0 || s->cap > 0)
        K->attention_block_softcap_forward(&kdev, out, lse, q, k, v, qpos, kpos, qstart, s->W, accumulate, s->scale,
                                           s->cap);
    else
        K->attention_block_forward(&kdev, out, lse, q, k, v, qpos, kpos, qstart, s->W, accumulate);
}

static void blk_backward(const struct attn_dims *s, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                         const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                         const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                         const struct am_tensor *qpos, const struct am_tensor *kpos, const struct am_tensor *qstart)
{
    if (s->scale > 0 || s->cap > 0)
        K->attention_block_softcap_backward(&kdev, dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos, qstart, s->W,
                                            s->scale, s->cap);
    else
        K->attention_block_backward(&kdev, dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos, qstart, s->W);
}

struct attn_ctx {
    struct attn_dims s;
    double *q, *k, *v, *R, *out;
};

static double attn_loss(void *p)
{
    struct attn_ctx *c = p;
    ref_attention(&c->s, c->q, c->k, c->v, c->out, NULL);
    double L = 0.0;
    for (int64_t i = 0; i < c->s.B * c->s.T * c->s.H * c->s.D; i++)
        L += c->out[i] * c->R[i];
    return L;
}

static void test_attention(void **state)
{
    (void)state;
    struct rng r = {19};
    struct attn_dims cases[] = {
        {2, 7, 4, 4, 8, 0, NULL, 0, 0}, /* H/KVH = 1 */
        {2, 7, 4, 2, 8, 0, NULL, 0, 0}, /* 2 */
        {1, 7, 4, 1, 8, 0, NULL, 0, 0}, /* 4 */
        {1, 1, 2, 1, 4, 0, NULL, 0, 0}, /* a single token */
        {2, 33, 8, 4, 16, 0, NULL, 0, 0}, /* several threads */
        {1, 64, 4, 2, 64, 0, NULL, 0, 0}, /* Llama's head size */
        /* sliding windows (Mistral's): shorter than T, across tiles of 16 keys, W = 1 (itself
         * only), W = T - 1, and W = T (the causal result, bit for bit: checked below) */
        {2, 7, 4, 2, 8, 3, NULL, 0, 0},
        {1, 7, 4, 1, 8, 1, NULL, 0, 0},
        {2, 33, 8, 4, 16, 5, NULL, 0, 0},
        {1, 50, 4, 2, 24, 20, NULL, 0, 0},
        {1, 40, 2, 1, 16, 39, NULL, 0, 0},
        {2, 33, 8, 4, 16, 33, NULL, 0, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        struct attn_dims s = cases[c];
        int64_t nq = s.B * s.T * s.H * s.D, nk = s.B * s.T * s.KVH * s.D, nl = s.B * s.H * s.T;
        struct arr q = arr_rand(&r, nq, -1, 1), k = arr_rand(&r, nk, -1, 1), v = arr_rand(&r, nk, -1, 1);
        struct arr out = arr_new(nq), lse = arr_new(nl);
        struct am_tensor tq = tview(&q, s.B, s.T, s.H, s.D), tk = tview(&k, s.B, s.T, s.KVH, s.D);
        struct am_tensor tv = tview(&v, s.B, s.T, s.KVH, s.D), to = tview(&out, s.B, s.T, s.H, s.D);
        struct am_tensor tl = tview(&lse, s.B, s.H, s.T, 0);
        K->attention_forward(&kdev, &to, &tl, &tq, &tk, &tv, s.W);
        double *wo = dalloc(nq), *wl = dalloc(nl);
        ref_attention(&s, q.d, k.d, v.d, wo, wl);
        /* Normwise, 4 (D + T) u: a score is a D-term fp32 dot (<= D u relative to Σ|q k|,
         * which is <= sqrt(D) here, so the scores' error is <= D u in absolute terms); a
         * softmax weight inherits that error plus exp's 2 ulp and the T-term normalising
         * sum; the output adds a T-term weighted sum. The factor 4 covers the few products
         * between. For D = T = 64 this is 3e-5 of the largest value. */
        double rel = 4.0 * (double)(s.D + s.T) * U;
        char what[160];
        snprintf(what, sizeof what, "attention out B%lld T%lld H%lld KVH%lld D%lld W%lld", (long long)s.B,
                 (long long)s.T, (long long)s.H, (long long)s.KVH, (long long)s.D, (long long)s.W);
        expect_close_norm(what, out.f, wo, nq, rel, 0);
        snprintf(what, sizeof what, "attention lse T%lld H%lld KVH%lld", (long long)s.T, (long long)s.H,
                 (long long)s.KVH);
        expect_close_norm(what, lse.f, wl, nl, rel, rel);

        struct arr dout = arr_rand(&r, nq, -1, 1);
        struct arr dq = arr_rand(&r, nq, -1, 1), dk = arr_rand(&r, nk, -1, 1), dv = arr_rand(&r, nk, -1, 1);
        struct arr dq0 = arr_copy(&dq), dk0 = arr_copy(&dk), dv0 = arr_copy(&dv);
        struct am_tensor tdo = tview(&dout, s.B, s.T, s.H, s.D), tdq = tview(&dq, s.B, s.T, s.H, s.D);
        struct am_tensor tdk = tview(&dk, s.B, s.T, s.KVH, s.D), tdv = tview(&dv, s.B, s.T, s.KVH, s.D);
        K->attention_backward(&kdev, &tdq, &tdk, &tdv, &tdo, &to, &tl, &tq, &tk, &tv, s.W);
        double *gq = dalloc(nq), *gk = dalloc(nk), *gv = dalloc(nk);
        ref_attention_backward(&s, q.d, k.d, v.d, dout.d, gq, gk, gv);
        /* Normwise on the gradient itself (the accumulated start adds u of itself):
         * 4 (D + T H/KVH) u: dk and dv of a shared kv head sum over the group's rows. */
        int64_t G = s.H / s.KVH;
        double grel = 4.0 * (double)(s.D + s.T * G) * U;
        double *wq = dalloc(nq), *wk = dalloc(nk), *wv = dalloc(nk), *tq_ = dalloc(nq), *tk_ = dalloc(nk),
               *tv_ = dalloc(nk);
        double mq = max_abs(gq, nq), mk = max_abs(gk, nk), mv = max_abs(gv, nk);
        for (int64_t i = 0; i < nq; i++) {
            wq[i] = dq0.d[i] + gq[i];
            tq_[i] = grel * mq + U * fabs(wq[i]);
        }
        for (int64_t i = 0; i < nk; i++) {
            wk[i] = dk0.d[i] + gk[i];
            wv[i] = dv0.d[i] + gv[i];
            tk_[i] = grel * mk + U * fabs(wk[i]);
            tv_[i] = grel * mv + U * fabs(wv[i]);
        }
        snprintf(what, sizeof what, "attention dq T%lld H%lld KVH%lld D%lld", (long long)s.T, (long long)s.H,
                 (long long)s.KVH, (long long)s.D);
        expect_close(what, dq.f, wq, tq_, nq);
        snprintf(what, sizeof what, "attention dk T%lld H%lld KVH%lld D%lld", (long long)s.T, (long long)s.H,
                 (long long)s.KVH, (long long)s.D);
        expect_close(what, dk.f, wk, tk_, nk);
        snprintf(what, sizeof what, "attention dv T%lld H%lld KVH%lld D%lld", (long long)s.T, (long long)s.H,
                 (long long)s.KVH, (long long)s.D);
        expect_close(what, dv.f, wv, tv_, nk);
        if (nq <= 1024) {
            struct attn_ctx ctx = {s, q.d, k.d, v.d, dout.d, dalloc(nq)};
            double *fd = dalloc(nq);
            fd_grad(attn_loss, &ctx, q.d, nq, fd);
            expect_fd("attention dq vs finite differences", dq.f, dq0.d, fd, tq_, nq);
            /* and the reference backward against the same differences, tightly */
            for (int64_t i = 0; i < nq; i++)
                assert_true(fabs(gq[i] - fd[i]) <= 1e-7 * (1 + max_abs(fd, nq)));
            fd_grad(attn_loss, &ctx, k.d, nk, fd);
            expect_fd("attention dk vs finite differences", dk.f, dk0.d, fd, tk_, nk);
            fd_grad(attn_loss, &ctx, v.d, nk, fd);
            expect_fd("attention dv vs finite differences", dv.f, dv0.d, fd, tv_, nk);
            free(fd);
            free(ctx.out);
        }
        /* deterministic: one thread and three give the same bits */
        struct arr a1[3] = {arr_copy(&dq0), arr_copy(&dk0), arr_copy(&dv0)};
        struct arr a3[3] = {arr_copy(&dq0), arr_copy(&dk0), arr_copy(&dv0)};
        struct am_tensor t1q = tview(&a1[0], s.B, s.T, s.H, s.D), t1k = tview(&a1[1], s.B, s.T, s.KVH, s.D),
                         t1v = tview(&a1[2], s.B, s.T, s.KVH, s.D);
        struct am_tensor t3q = tview(&a3[0], s.B, s.T, s.H, s.D), t3k = tview(&a3[1], s.B, s.T, s.KVH, s.D),
                         t3v = tview(&a3[2], s.B, s.T, s.KVH, s.D);
        omp_set_num_threads(1);
        K->attention_backward(&kdev, &t1q, &t1k, &t1v, &tdo, &to, &tl, &tq, &tk, &tv, s.W);
        omp_set_num_threads(3);
        K->attention_backward(&kdev, &t3q, &t3k, &t3v, &tdo, &to, &tl, &tq, &tk, &tv, s.W);
        omp_set_num_threads(omp_get_num_procs());
        expect_bitwise("attention backward dq: 1 thread == 3 threads", a1[0].f, a3[0].f, nq);
        expect_bitwise("attention backward dk: 1 thread == 3 threads", a1[1].f, a3[1].f, nk);
        expect_bitwise("attention backward dv: 1 thread == 3 threads", a1[2].f, a3[2].f, nk);
        if (s.W >= s.T) { /* a window of T or more is no window: the same bits as without one */
            struct arr o0 = arr_new(nq), l0 = arr_new(nl), c1[3] = {arr_copy(&dq0), arr_copy(&dk0), arr_copy(&dv0)};
            struct am_tensor t0o = tview(&o0, s.B, s.T, s.H, s.D), t0l = tview(&l0, s.B, s.H, s.T, 0);
            struct am_tensor c1q = tview(&c1[0], s.B, s.T, s.H, s.D), c1k = tview(&c1[1], s.B, s.T, s.KVH, s.D),
                             c1v = tview(&c1[2], s.B, s.T, s.KVH, s.D);
            K->attention_forward(&kdev, &t0o, &t0l, &tq, &tk, &tv, 0);
            expect_bitwise("attention out: window >= T == no window", o0.f, out.f, nq);
            expect_bitwise("attention lse: window >= T == no window", l0.f, lse.f, nl);
            omp_set_num_threads(1);
            K->attention_backward(&kdev, &c1q, &c1k, &c1v, &tdo, &to, &tl, &tq, &tk, &tv, 0);
            omp_set_num_threads(omp_get_num_procs());
            for (int i = 0; i < 3; i++) {
                expect_bitwise("attention backward: window >= T == no window", c1[i].f, a1[i].f, i ? nk : nq);
                arr_free(&c1[i]);
            }
            arr_free(&o0);
            arr_free(&l0);
        }
        for (int i = 0; i < 3; i++) {
            arr_free(&a1[i]);
            arr_free(&a3[i]);
        }
        double *bufs[] = {wo, wl, gq, gk, gv, wq, wk, wv, tq_, tk_, tv_};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
            free(bufs[i]);
        struct arr *all[] = {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv, &dq0, &dk0, &dv0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* ---- attention by blocks of keys (context parallelism's ring) ---- */

/* The zigzag split of T positions over cp ranks: 2 cp chunks of T / (2 cp), rank r holds
 * chunks r and 2 cp - 1 - r, in that order. pos[i]: the position of rank r's row i. */
static void zigzag_positions(int64_t T, int cp, int r, int32_t *pos)
{
    int64_t c = T / (2 * cp);
    for (int64_t i = 0; i < c; i++) {
        pos[i] = (int32_t)(r * c + i);
        pos[c + i] = (int32_t)((2 * cp - 1 - r) * c + i);
    }
}

/* rows pos[0..n) of a [B, T, Hx, D] array into [B, n, Hx, D] */
static void gather_rows(float *dst, const float *src, int64_t B, int64_t T, int64_t n, int64_t width,
                        const int32_t *pos)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++)
            memcpy(dst + (b * n + i) * width, src + (b * T + pos[i]) * width, (size_t)width * sizeof(float));
}

/* Every rank's queries against every rank's keys, block by block in ring order (rank r takes
 * the keys of rank r - s at step s, merging from step 1 on), must give full causal attention
 * (the double reference) on the rows each rank holds; the backward's dq, dk, dv summed over the
 * blocks must give its gradients. GQA, windows, 1 to 4 ranks, several rows per chunk, several
 * tiles of rows; Gemma's scale and soft cap with windows that cut across the ranks' chunks
 * (and whole tiles and blocks outside them), packed too (the window within each document);
 * without documents also against the non-ring kernel (attention_softcap_forward,
 * attention_softcap_backward) on the whole sequence. */
static void test_attention_block(void **state)
{
    (void)state;
    struct rng r = {23};
    struct {
        struct attn_dims s;
        int cp;
        bool packed; /* several documents per sequence, of random lengths (qstart) */
    } cases[] = {
        {{2, 16, 4, 2, 8, 0, NULL, 0, 0}, 2, false},  {{1, 32, 4, 1, 16, 0, NULL, 0, 0}, 4, false},
        {{2, 24, 4, 4, 8, 0, NULL, 0, 0}, 3, false},  {{1, 16, 2, 1, 8, 0, NULL, 0, 0}, 1, false},
        {{2, 32, 4, 2, 8, 5, NULL, 0, 0}, 2, false},  {{1, 48, 8, 2, 16, 13, NULL, 0, 0}, 4, false},
        {{1, 64, 4, 2, 64, 0, NULL, 0, 0}, 2, false},
        {{1, 160, 4, 2, 16, 0, NULL, 0, 0}, 1, false},  /* tiles of 64 query rows: 3, the last partial */
        {{1, 288, 2, 1, 8, 40, NULL, 0, 0}, 2, false}, /* 144 rows a rank, a window across chunks */
        {{2, 48, 4, 2, 8, 0, NULL, 0, 0}, 1, true},   {{2, 48, 4, 2, 8, 0, NULL, 0, 0}, 2, true},
        {{3, 64, 4, 1, 16, 0, NULL, 0, 0}, 4, true},  {{2, 96, 4, 2, 8, 7, NULL, 0, 0}, 2, true},
        {{1, 160, 2, 1, 8, 0, NULL, 0, 0}, 1, true}, /* documents across tiles of rows */
        /* Gemma: scale 24^-0.5 (Gemma 2's query_pre_attn_scalar), cap 1.0 (scores near it), or
         * Gemma 3's scale without a cap; windows shorter than a chunk */
        {{2, 32, 4, 2, 16, 5, NULL, 0.2041241f, 1.0f}, 2, false},
        {{1, 64, 4, 2, 16, 6, NULL, 0.2041241f, 1.0f}, 4, false},
        {{1, 256, 2, 1, 8, 24, NULL, 0.2041241f, 1.0f}, 2, false}, /* tiles of 64 rows past the window */
        {{1, 256, 2, 1, 8, 20, NULL, 0.25f, 0.0f}, 4, false},
        {{2, 48, 4, 2, 16, 0, NULL, 0.3f, 1.5f}, 3, false},
        {{2, 96, 4, 2, 8, 7, NULL, 0.2041241f, 1.0f}, 2, true},
        {{1, 160, 2, 1, 8, 30, NULL, 0.25f, 0.0f}, 2, true},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        struct attn_dims s = cases[ci].s;
        int cp = cases[ci].cp;
        int32_t *start = NULL; /* packed: each sequence cut into documents of 1 to T / 3 rows */
        if (cases[ci].packed) {
            start = calloc((size_t)(s.B * s.T), sizeof(int32_t));
            assert_non_null(start);
            for (int64_t b = 0; b < s.B; b++)
                for (int64_t t = 0, first = 0; t < s.T; t++) {
                    if (t > first && rng_uniform(&r, 0, 1) < 3.0 / (double)s.T)
                        first = t;
                    start[b * s.T + t] = (int32_t)first;
                }
            s.start = start;
        }
        int64_t B = s.B, T = s.T, H = s.H, KVH = s.KVH, D = s.D, Tl = T / cp, G = H / KVH;
        int64_t nq = B * T * H * D, nk = B * T * KVH * D, nl = B * H * T;
        struct arr q = arr_rand(&r, nq, -1, 1), k = arr_rand(&r, nk, -1, 1), v = arr_rand(&r, nk, -1, 1);
        struct arr dout = arr_rand(&r, nq, -1, 1);
        double *wo = dalloc(nq), *wl = dalloc(nl), *gq = dalloc(nq), *gk = dalloc(nk), *gv = dalloc(nk);
        ref_attention(&s, q.d, k.d, v.d, wo, wl);
        ref_attention_backward(&s, q.d, k.d, v.d, dout.d, gq, gk, gv);
        int64_t lq = B * Tl * H * D, lk = B * Tl * KVH * D, ll = B * H * Tl;
        /* per rank: its rows of q, k, v, dout; out, lse; dq, dk, dv; positions */
        float *mem = K->alloc(&kdev, (size_t)cp * (size_t)(4 * lq + 4 * lk + ll) * sizeof(float));
        int32_t *pos = K->alloc(&kdev, (size_t)(cp * Tl) * sizeof(int32_t));
        int32_t *qst = K->alloc(&kdev, (size_t)(B * T) * sizeof(int32_t)); /* each rank's rows' starts */
        assert_non_null(mem);
        assert_non_null(pos);
        assert_non_null(qst);
        struct am_tensor tq[4], tk[4], tv[4], tdo[4], to[4], tl[4], tdq[4], tdk[4], tdv[4], tp[4], ts[4];
        for (int x = 0; x < cp; x++) {
            float *m = mem + (size_t)x * (size_t)(4 * lq + 4 * lk + ll);
            zigzag_positions(T, cp, x, pos + x * Tl);
            tp[x] = am_tensor_view(pos + x * Tl, AM_DEV_CPU, AM_I32, Tl, 0, 0, 0);
            ts[x] = am_tensor_view(qst + x * B * Tl, AM_DEV_CPU, AM_I32, B * Tl, 0, 0, 0);
            for (int64_t b = 0; start && b < B; b++)
                for (int64_t i = 0; i < Tl; i++)
                    qst[x * B * Tl + b * Tl + i] = start[b * T + pos[x * Tl + i]];
            tq[x] = am_tensor_view(m, AM_DEV_CPU, AM_F32, B, Tl, H, D);
            tdo[x] = am_tensor_view(m + lq, AM_DEV_CPU, AM_F32, B, Tl, H, D);
            to[x] = am_tensor_view(m + 2 * lq, AM_DEV_CPU, AM_F32, B, Tl, H, D);
            tdq[x] = am_tensor_view(m + 3 * lq, AM_DEV_CPU, AM_F32, B, Tl, H, D);
            tk[x] = am_tensor_view(m + 4 * lq, AM_DEV_CPU, AM_F32, B, Tl, KVH, D);
            tv[x] = am_tensor_view(m + 4 * lq + lk, AM_DEV_CPU, AM_F32, B, Tl, KVH, D);
            tdk[x] = am_tensor_view(m + 4 * lq + 2 * lk, AM_DEV_CPU, AM_F32, B, Tl, KVH, D);
            tdv[x] = am_tensor_view(m + 4 * lq + 3 * lk, AM_DEV_CPU, AM_F32, B, Tl, KVH, D);
            tl[x] = am_tensor_view(m + 4 * lq + 4 * lk, AM_DEV_CPU, AM_F32, B, H, Tl, 0);
            gather_rows(tq[x].data, q.f, B, T, Tl, H * D, pos + x * Tl);
            gather_rows(tdo[x].data, dout.f, B, T, Tl, H * D, pos + x * Tl);
            gather_rows(tk[x].data, k.f, B, T, Tl, KVH * D, pos + x * Tl);
            gather_rows(tv[x].data, v.f, B, T, Tl, KVH * D, pos + x * Tl);
            K->zero(&kdev, &tdq[x]);
            K->zero(&kdev, &tdk[x]);
            K->zero(&kdev, &tdv[x]);
        }
        for (int x = 0; x < cp; x++)
            for (int st = 0; st < cp; st++) {
                int src = ((x - st) % cp + cp) % cp;
                blk_forward(&s, &to[x], &tl[x], &tq[x], &tk[src], &tv[src], &tp[x], &tp[src], start ? &ts[x] : NULL,
                            st > 0);
            }
        for (int x = 0; x < cp; x++)
            for (int st = 0; st < cp; st++) {
                int src = ((x - st) % cp + cp) % cp;
                blk_backward(&s, &tdq[x], &tdk[src], &tdv[src], &tdo[x], &to[x], &tl[x], &tq[x], &tk[src], &tv[src],
                             &tp[x], &tp[src], start ? &ts[x] : NULL);
            }
        /* the ranks' rows back in sequence order, against the reference (attention's
         * tolerances: a merge adds a few roundings per block, within the factor 4) */
        struct arr go = arr_new(nq), gl = arr_new(nl), dq = arr_new(nq), dk = arr_new(nk), dv = arr_new(nk);
        for (int x = 0; x < cp; x++)
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < Tl; i++) {
                    int64_t t = pos[x * Tl + i];
                    float *lo = (float *)to[x].data, *ld = (float *)tl[x].data;
                    memcpy(go.f + (b * T + t) * H * D, lo + (b * Tl + i) * H * D, (size_t)(H * D) * sizeof(float));
                    memcpy(dq.f + (b * T + t) * H * D, (float *)tdq[x].data + (b * Tl + i) * H * D,
                           (size_t)(H * D) * sizeof(float));
                    memcpy(dk.f + (b * T + t) * KVH * D, (float *)tdk[x].data + (b * Tl + i) * KVH * D,
                           (size_t)(KVH * D) * sizeof(float));
                    memcpy(dv.f + (b * T + t) * KVH * D, (float *)tdv[x].data + (b * Tl + i) * KVH * D,
                           (size_t)(KVH * D) * sizeof(float));
                    for (int64_t h = 0; h < H; h++)
                        gl.f[(b * H + h) * T + t] = ld[(b * H + h) * Tl + i];
                }
        double rel = 4.0 * (double)(s.D + s.T) * U, grel = 4.0 * (double)(s.D + s.T * G) * U;
        char what[160];
        snprintf(what, sizeof what, "ring attention out T%lld H%lld KVH%lld D%lld W%lld cp%d%s scale %g cap %g",
                 (long long)T, (long long)H, (long long)KVH, (long long)D, (long long)s.W, cp, start ? " packed" : "",
                 (double)s.scale, (double)s.cap);
        expect_close_norm(what, go.f, wo, nq, rel, 0);
        snprintf(what, sizeof what, "ring attention lse T%lld cp%d", (long long)T, cp);
        expect_close_norm(what, gl.f, wl, nl, rel, rel);
        snprintf(what, sizeof what, "ring attention dq T%lld H%lld KVH%lld cp%d", (long long)T, (long long)H,
                 (long long)KVH, cp);
        expect_close_norm(what, dq.f, gq, nq, grel, 0);
        snprintf(what, sizeof what, "ring attention dk T%lld H%lld KVH%lld cp%d", (long long)T, (long long)H,
                 (long long)KVH, cp);
        expect_close_norm(what, dk.f, gk, nk, grel, 0);
        snprintf(what, sizeof what, "ring attention dv T%lld H%lld KVH%lld cp%d", (long long)T, (long long)H,
                 (long long)KVH, cp);
        expect_close_norm(what, dv.f, gv, nk, grel, 0);
        /* Gemma: the ring against the non-ring kernel on the whole sequence (out, lse, and the
         * gradients from that out and lse) */
        if ((s.scale > 0 || s.cap > 0) && !start) {
            struct arr o1 = arr_new(nq), l1 = arr_new(nl), q1 = arr_new(nq), k1 = arr_new(nk), v1 = arr_new(nk);
            struct am_tensor a = tview(&o1, B, T, H, D), al = tview(&l1, B, H, T, 0);
            struct am_tensor fq = tview(&q, B, T, H, D), fk = tview(&k, B, T, KVH, D), fv = tview(&v, B, T, KVH, D);
            struct am_tensor fdo = tview(&dout, B, T, H, D), g1 = tview(&q1, B, T, H, D), gk1 = tview(&k1, B, T, KVH, D);
            struct am_tensor gv1 = tview(&v1, B, T, KVH, D);
            K->attention_softcap_forward(&kdev, &a, &al, &fq, &fk, &fv, s.W, s.scale, s.cap);
            K->zero(&kdev, &g1);
            K->zero(&kdev, &gk1);
            K->zero(&kdev, &gv1);
            K->attention_softcap_backward(&kdev, &g1, &gk1, &gv1, &fdo, &a, &al, &fq, &fk, &fv, s.W, s.scale, s.cap);
            struct arr *got[] = {&go, &gl, &dq, &dk, &dv}, *ref[] = {&o1, &l1, &q1, &k1, &v1};
            const char *names[] = {"out", "lse", "dq", "dk", "dv"};
            for (int i = 0; i < 5; i++) {
                for (int64_t e = 0; e < ref[i]->n; e++)
                    ref[i]->d[e] = ref[i]->f[e];
                snprintf(what, sizeof what, "ring attention %s == attention_softcap's (T%lld W%lld cp%d cap %g)",
                         names[i], (long long)T, (long long)s.W, cp, (double)s.cap);
                expect_close_norm(what, got[i]->f, ref[i]->d, ref[i]->n, i < 2 ? rel : grel, i == 1 ? rel : 0);
            }
            for (int i = 0; i < 5; i++)
                arr_free(ref[i]);
        }
        /* one rank holding all of it: the block kernel over one block is attention_forward */
        if (cp == 1 && s.W == 0 && !start && s.scale == 0 && s.cap == 0) {
            struct arr o1 = arr_new(nq), l1 = arr_new(nl);
            struct am_tensor a = tview(&o1, B, T, H, D), al = tview(&l1, B, H, T, 0);
            struct am_tensor fq = tview(&q, B, T, H, D), fk = tview(&k, B, T, KVH, D), fv = tview(&v, B, T, KVH, D);
            K->attention_forward(&kdev, &a, &al, &fq, &fk, &fv, 0);
            for (int64_t i = 0; i < nq; i++)
                o1.d[i] = o1.f[i];
            expect_close_norm("block attention == attention_forward (cp 1)", go.f, o1.d, nq, 4.0 * (double)(D + T) * U,
                              0);
            arr_free(&o1);
            arr_free(&l1);
        }
        arr_free(&go);
        arr_free(&gl);
        arr_free(&dq);
        arr_free(&dk);
        arr_free(&dv);
        K->free(&kdev, mem);
        K->free(&kdev, pos);
        K->free(&kdev, qst);
        free(start);
        arr_free(&q);
        arr_free(&k);
        arr_free(&v);
        arr_free(&dout);
        free(wo);
        free(wl);
        free(gq);
        free(gk);
        free(gv);
    }
}

static void test_bf16_attention(void **state)
{
    (void)state;
    struct rng r = {127};
    struct attn_dims cases[] = {{2, 37, 4, 2, 16, 0, NULL, 0, 0}, {1, 64, 4, 1, 64, 0, NULL, 0, 0}, {2, 9, 6, 3, 8, 4, NULL, 0, 0}}; /* the last windowed */
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
        for (int chunked = 0; chunked < 2; chunked++) {
            struct attn_dims s = cases[ci];
            am_cpu_set_chunk(&kdev, chunked ? 1 : 0); /* one group of kv heads at a time */
            int64_t nq = s.B * s.T * s.H * s.D, nk = s.B * s.T * s.KVH * s.D, nl = s.B * s.H * s.T;
            struct bt q = bt_rand(&r, nq, -2, 2), k = bt_rand(&r, nk, -2, 2), v = bt_rand(&r, nk, -1, 1);
            struct bt out = bt_new(nq);
            float *l = malloc((size_t)nl * 4), *lf = malloc((size_t)nl * 4);
            struct am_tensor tq = hv(&q, s.B, s.T, s.H, s.D), tk = hv(&k, s.B, s.T, s.KVH, s.D);
            struct am_tensor tv = hv(&v, s.B, s.T, s.KVH, s.D), to = hv(&out, s.B, s.T, s.H, s.D);
            struct am_tensor tqf = fv(&q, s.B, s.T, s.H, s.D), tkf = fv(&k, s.B, s.T, s.KVH, s.D);
            struct am_tensor tvf = fv(&v, s.B, s.T, s.KVH, s.D), tof = fv(&out, s.B, s.T, s.H, s.D);
            struct am_tensor tl = f32v(l, s.B, s.H, s.T, 0), tlf = f32v(lf, s.B, s.H, s.T, 0);
            K->attention_forward(&kdev, &to, &tl, &tq, &tk, &tv, s.W);
            K->attention_forward(&kdev, &tof, &tlf, &tqf, &tkf, &tvf, s.W);
            char what[128];
            snprintf(what, sizeof what, "bf16 attention out B%lld T%lld H%lld KVH%lld D%lld%s", (long long)s.B,
                     (long long)s.T, (long long)s.H, (long long)s.KVH, (long long)s.D, chunked ? " (per kv head)" : "");
            expect_bf16(what, out.h, out.f, nq);
            expect_mixed("bf16 attention lse (f32)", l, lf, nl);
            /* backward from the same bf16 out (widened for the fp32 kernel) and lse */
            for (int64_t i = 0; i < nq; i++)
                out.f[i] = am_bf16_to_f32(out.h[i]);
            struct bt dout = bt_rand(&r, nq, -1, 1), dq = bt_rand(&r, nq, -1, 1), dk = bt_rand(&r, nk, -1, 1);
            struct bt dv = bt_rand(&r, nk, -1, 1);
            struct am_tensor tdo = hv(&dout, s.B, s.T, s.H, s.D), tdq = hv(&dq, s.B, s.T, s.H, s.D);
            struct am_tensor tdk = hv(&dk, s.B, s.T, s.KVH, s.D), tdv = hv(&dv, s.B, s.T, s.KVH, s.D);
            struct am_tensor tdof = fv(&dout, s.B, s.T, s.H, s.D), tdqf = fv(&dq, s.B, s.T, s.H, s.D);
            struct am_tensor tdkf = fv(&dk, s.B, s.T, s.KVH, s.D), tdvf = fv(&dv, s.B, s.T, s.KVH, s.D);
            K->attention_backward(&kdev, &tdq, &tdk, &tdv, &tdo, &to, &tl, &tq, &tk, &tv, s.W);
            K->attention_backward(&kdev, &tdqf, &tdkf, &tdvf, &tdof, &tof, &tl, &tqf, &tkf, &tvf, s.W);
            expect_bf16("bf16 attention dq", dq.h, dq.f, nq);
            expect_bf16("bf16 attention dk", dk.h, dk.f, nk);
            expect_bf16("bf16 attention dv", dv.h, dv.f, nk);
            free(l);
            free(lf);
            struct bt *all[] = {&q, &k, &v, &out, &dout, &dq, &dk, &dv};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                bt_free(all[i]);
        }
    am_cpu_set_chunk(&kdev, 0);
}

/* Elements of a bf16 result out of expect_bf16's tolerance (without failing): the perturbation checks. */
static int64_t bf16_out_of_tolerance(const uint16_t *got, const float *ref, int64_t n)
{
    double mx = 0.0;
    for (int64_t i = 0; i < n; i++)
        mx = fmax(mx, fabs((double)ref[i]));
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += !(fabs(am_bf16_to_f32(got[i]) - ref[i]) <= B16_REL * fabs((double)ref[i]) + B16_ABS * mx);
    return bad;
}

/* A bf16 result whose largest element is moved by 2 %: expect_bf16's tolerance must see it. */
static void expect_perturbation_caught(const char *what, struct bt *a, int64_t n)
{
    int64_t at = 0;
    for (int64_t i = 1; i < n; i++)
        at = fabsf(a->f[i]) > fabsf(a->f[at]) ? i : at;
    uint16_t keep = a->h[at];
    a->h[at] = am_f32_to_bf16(am_bf16_to_f32(keep) * 1.02f + 1e-3f);
    if (bf16_out_of_tolerance(a->h, a->f, n) == 0) {
        print_error("%s: a perturbation of element %lld by 2%% went unnoticed\n", what, (long long)at);
        fail();
    }
    a->h[at] = keep;
}

/* The block kernels in bf16 (q, k, v bf16) against the fp32 ones on the widened inputs, the
 * way ring.c and packed.c use them: the keys in cp blocks merged into an f32 running out (and
 * f32 dq, dk, dv sums), then rounded once; and one block with bf16 out, dq, dk, dv (packed
 * sequences without cp: rounded once per call). Gemma's scale and soft cap too. */
static void test_bf16_attention_block(void **state)
{
    (void)state;
    struct rng r = {139};
    struct {
        struct attn_dims s;
        int cp;
        bool packed;
    } cases[] = {
        {{2, 32, 4, 2, 16, 0, NULL, 0, 0}, 2, false}, {{1, 48, 4, 1, 64, 13, NULL, 0, 0}, 3, false},
        {{2, 48, 4, 2, 8, 0, NULL, 0, 0}, 2, true},   {{2, 96, 4, 2, 8, 7, NULL, 0, 0}, 1, true},
        {{1, 160, 2, 1, 8, 0, NULL, 0, 0}, 2, true},
        /* Gemma 2's scale and cap, Gemma 3's scale alone, with windows within a block */
        {{2, 64, 4, 2, 16, 6, NULL, 0.2041241f, 1.0f}, 2, false}, {{2, 96, 4, 2, 8, 7, NULL, 0.25f, 0.0f}, 2, true},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
        for (int chunked = 0; chunked < 2; chunked++) {
            struct attn_dims s = cases[ci].s;
            int cp = cases[ci].cp;
            am_cpu_set_chunk(&kdev, chunked ? 1 : 0); /* one sequence at a time */
            int64_t B = s.B, T = s.T, H = s.H, KVH = s.KVH, D = s.D, Tk = T / cp;
            int64_t nq = B * T * H * D, nk = B * T * KVH * D, nl = B * H * T, kb = B * Tk * KVH * D;
            int32_t *pos = malloc((size_t)T * sizeof(int32_t)), *start = calloc((size_t)(B * T), sizeof(int32_t));
            assert_non_null(pos);
            assert_non_null(start);
            for (int64_t t = 0; t < T; t++)
                pos[t] = (int32_t)t;
            for (int64_t b = 0; cases[ci].packed && b < B; b++)
                for (int64_t t = 0, first = 0; t < T; t++) {
                    if (t > first && rng_uniform(&r, 0, 1) < 3.0 / (double)T)
                        first = t;
                    start[b * T + t] = (int32_t)first;
                }
            struct am_tensor tqs = am_tensor_view(start, AM_DEV_CPU, AM_I32, B * T, 0, 0, 0);
            struct am_tensor *qs = cases[ci].packed ? &tqs : NULL, tqp = am_tensor_view(pos, AM_DEV_CPU, AM_I32, T, 0, 0, 0);
            /* the keys in cp blocks of Tk positions: block c holds positions c Tk .. (c + 1) Tk - 1 */
            struct bt q = bt_rand(&r, nq, -2, 2), dout = bt_rand(&r, nq, -1, 1);
            struct bt kblk[3], vblk[3];
            for (int c = 0; c < cp; c++) {
                kblk[c] = bt_rand(&r, kb, -2, 2);
                vblk[c] = bt_rand(&r, kb, -1, 1);
            }
            float *o32 = malloc((size_t)nq * 4), *of = malloc((size_t)nq * 4), *l = malloc((size_t)nl * 4);
            float *lf = malloc((size_t)nl * 4);
            struct bt out = bt_new(nq);
            struct am_tensor to32 = f32v(o32, B, T, H, D), tof = f32v(of, B, T, H, D);
            struct am_tensor tl = f32v(l, B, H, T, 0), tlf = f32v(lf, B, H, T, 0);
            struct am_tensor tq = hv(&q, B, T, H, D), tqf = fv(&q, B, T, H, D);
            for (int c = 0; c < cp; c++) {
                struct am_tensor kp = am_tensor_view(pos + c * Tk, AM_DEV_CPU, AM_I32, Tk, 0, 0, 0);
                struct am_tensor tk = hv(&kblk[c], B, Tk, KVH, D), tv = hv(&vblk[c], B, Tk, KVH, D);
                struct am_tensor tkf = fv(&kblk[c], B, Tk, KVH, D), tvf = fv(&vblk[c], B, Tk, KVH, D);
                blk_forward(&s, &to32, &tl, &tq, &tk, &tv, &tqp, &kp, qs, c > 0);
                blk_forward(&s, &tof, &tlf, &tqf, &tkf, &tvf, &tqp, &kp, qs, c > 0);
            }
            char what[160];
            snprintf(what, sizeof what,
                     "bf16 attention block out (f32 merge of %d) B%lld T%lld H%lld KVH%lld D%lld%s%s scale %g cap %g",
                     cp, (long long)B, (long long)T, (long long)H, (long long)KVH, (long long)D,
                     cases[ci].packed ? " packed" : "", chunked ? " (per sequence)" : "", (double)s.scale,
                     (double)s.cap);
            expect_mixed(what, o32, of, nq);
            expect_mixed("bf16 attention block lse (f32)", l, lf, nl);
            for (int64_t i = 0; i < nq; i++) { /* rounded once, as ring.c does after the last block */
                out.h[i] = am_f32_to_bf16(o32[i]);
                out.f[i] = of[i];
            }
            expect_bf16("bf16 attention block out (rounded once)", out.h, out.f, nq);
            expect_perturbation_caught("bf16 attention block out", &out, nq);
            /* one block, out bf16 without accumulate (its keys: all T positions) */
            struct bt kall = bt_new(nk), vall = bt_new(nk), o1 = bt_new(nq);
            for (int64_t b = 0; b < B; b++)
                for (int c = 0; c < cp; c++) {
                    size_t rowb = (size_t)(Tk * KVH * D);
                    memcpy(kall.h + (b * T + c * Tk) * KVH * D, kblk[c].h + b * Tk * KVH * D, rowb * 2);
                    memcpy(kall.f + (b * T + c * Tk) * KVH * D, kblk[c].f + b * Tk * KVH * D, rowb * 4);
                    memcpy(vall.h + (b * T + c * Tk) * KVH * D, vblk[c].h + b * Tk * KVH * D, rowb * 2);
                    memcpy(vall.f + (b * T + c * Tk) * KVH * D, vblk[c].f + b * Tk * KVH * D, rowb * 4);
                }
            struct am_tensor tka = hv(&kall, B, T, KVH, D), tva = hv(&vall, B, T, KVH, D);
            struct am_tensor tkaf = fv(&kall, B, T, KVH, D), tvaf = fv(&vall, B, T, KVH, D);
            struct am_tensor to1 = hv(&o1, B, T, H, D), to1f = fv(&o1, B, T, H, D);
            blk_forward(&s, &to1, &tl, &tq, &tka, &tva, &tqp, &tqp, qs, 0);
            blk_forward(&s, &to1f, &tlf, &tqf, &tkaf, &tvaf, &tqp, &tqp, qs, 0);
            expect_bf16("bf16 attention block out (one block, bf16)", o1.h, o1.f, nq);
            expect_mixed("bf16 attention block lse (one block)", l, lf, nl);
            expect_perturbation_caught("bf16 attention block out (one block)", &o1, nq);
            /* backward from the bf16 out (widened for the fp32 kernel) and the lse */
            for (int64_t i = 0; i < nq; i++)
                o1.f[i] = am_bf16_to_f32(o1.h[i]);
            struct am_tensor tdo = hv(&dout, B, T, H, D), tdof = fv(&dout, B, T, H, D);
            /* the ring's way: f32 dq summed over the blocks, each block's f32 dk, dv, then rounded */
            float *dq32 = calloc((size_t)nq, 4), *dqf = calloc((size_t)nq, 4);
            float *dk32 = calloc((size_t)kb, 4), *dv32 = calloc((size_t)kb, 4), *dkf = calloc((size_t)kb, 4);
            float *dvf = calloc((size_t)kb, 4);
            struct am_tensor tdq32 = f32v(dq32, B, T, H, D), tdqf = f32v(dqf, B, T, H, D);
            struct am_tensor tdk32 = f32v(dk32, B, Tk, KVH, D), tdv32 = f32v(dv32, B, Tk, KVH, D);
            struct am_tensor tdkf = f32v(dkf, B, Tk, KVH, D), tdvf = f32v(dvf, B, Tk, KVH, D);
            for (int c = 0; c < cp; c++) {
                struct am_tensor kp = am_tensor_view(pos + c * Tk, AM_DEV_CPU, AM_I32, Tk, 0, 0, 0);
                struct am_tensor tk = hv(&kblk[c], B, Tk, KVH, D), tv = hv(&vblk[c], B, Tk, KVH, D);
                struct am_tensor tkf = fv(&kblk[c], B, Tk, KVH, D), tvf = fv(&vblk[c], B, Tk, KVH, D);
                memset(dk32, 0, (size_t)kb * 4);
                memset(dv32, 0, (size_t)kb * 4);
                memset(dkf, 0, (size_t)kb * 4);
                memset(dvf, 0, (size_t)kb * 4);
                blk_backward(&s, &tdq32, &tdk32, &tdv32, &tdo, &to1, &tl, &tq, &tk, &tv, &tqp, &kp, qs);
                blk_backward(&s, &tdqf, &tdkf, &tdvf, &tdof, &to1f, &tl, &tqf, &tkf, &tvf, &tqp, &kp, qs);
                expect_mixed("bf16 attention block dk (f32, one block's terms)", dk32, dkf, kb);
                expect_mixed("bf16 attention block dv (f32, one block's terms)", dv32, dvf, kb);
            }
            expect_mixed("bf16 attention block dq (f32 sum over the blocks)", dq32, dqf, nq);
            /* one block with bf16 dq, dk, dv: the terms added in fp32, rounded once */
            struct bt dq = bt_rand(&r, nq, -1, 1), dk = bt_rand(&r, nk, -1, 1), dv = bt_rand(&r, nk, -1, 1);
            struct am_tensor tdq = hv(&dq, B, T, H, D), tdk = hv(&dk, B, T, KVH, D), tdv = hv(&dv, B, T, KVH, D);
            struct am_tensor tdq1f = fv(&dq, B, T, H, D), tdk1f = fv(&dk, B, T, KVH, D), tdv1f = fv(&dv, B, T, KVH, D);
            blk_backward(&s, &tdq, &tdk, &tdv, &tdo, &to1, &tl, &tq, &tka, &tva, &tqp, &tqp, qs);
            blk_backward(&s, &tdq1f, &tdk1f, &tdv1f, &tdof, &to1f, &tl, &tqf, &tkaf, &tvaf, &tqp, &tqp, qs);
            expect_bf16("bf16 attention block dq (bf16)", dq.h, dq.f, nq);
            expect_bf16("bf16 attention block dk (bf16)", dk.h, dk.f, nk);
            expect_bf16("bf16 attention block dv (bf16)", dv.h, dv.f, nk);
            expect_perturbation_caught("bf16 attention block dq", &dq, nq);
            expect_perturbation_caught("bf16 attention block dk", &dk, nk);
            free(dq32);
            free(dqf);
            free(dk32);
            free(dv32);
            free(dkf);
            free(dvf);
            free(o32);
            free(of);
            free(l);
            free(lf);
            free(pos);
            free(start);
            for (int c = 0; c < cp; c++) {
                bt_free(&kblk[c]);
                bt_free(&vblk[c]);
            }
            struct bt *all[] = {&q, &dout, &out, &kall, &vall, &o1, &dq, &dk, &dv};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                bt_free(all[i]);
        }
    am_cpu_set_chunk(&kdev, 0);
}

/* ---- v's head width apart from q's and k's (multi-head latent attention's v_head_dim) ----
 * With v [B, T, KVH, DV] and out [B, T, H, DV], the causal kernels give the bits they give when
 * every head is padded with zero columns to W = max(D, DV) (the scale given, 1 / sqrt(D)): out,
 * lse, dq, dk and dv in their own columns; the zero columns add zero terms at the end of each
 * sum. The block kernels' products run on OpenBLAS, whose kernels group a sum's terms by the
 * matrices' widths: the same terms, summed in another order, so there within fp32 rounding
 * (2^-20 of the largest element; bf16: one rounding, 2^-8). Causal and block kernels, fp32 and
 * bf16. */

/* rows of w values, as rows of W with zeros after (the bf16 bits and their widening) */
static struct bt pad_cols(const struct bt *a, int64_t rows, int64_t w, int64_t W)
{
    struct bt p = bt_new(rows * W);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < W; j++) {
            p.h[i * W + j] = j < w ? a->h[i * w + j] : 0;
            p.f[i * W + j] = j < w ? a->f[i * w + j] : 0.0f;
        }
    return p;
}

static void expect_cols(const char *what, const struct bt *got, const struct bt *padded, int64_t rows, int64_t w,
                        int64_t W, bool bf16, bool exact)
{
    int64_t bad = 0;
    double mx = 0.0;
    for (int64_t i = 0; i < rows * W; i++) {
        double a = bf16 ? am_bf16_to_f32(padded->h[i]) : padded->f[i];
        mx = fabs(a) > mx ? fabs(a) : mx;
    }
    double tol = (bf16 ? 0x1p-8 : 0x1p-20) * mx;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < w; j++) {
            double g = bf16 ? am_bf16_to_f32(got->h[i * w + j]) : got->f[i * w + j];
            double e = bf16 ? am_bf16_to_f32(padded->h[i * W + j]) : padded->f[i * W + j];
            bad += exact ? (bf16 ? got->h[i * w + j] != padded->h[i * W + j]
                                 : memcmp(&got->f[i * w + j], &padded->f[i * W + j], sizeof(float)) != 0)
                         : !(fabs(g - e) <= tol);
        }
    if (bad)
        fail_msg("%s: %lld elements differ from the zero-padded heads' (of %lld)", what, (long long)bad,
                 (long long)(rows * w));
}

static void test_attention_v_width(void **state)
{
    (void)state;
    struct rng r = {211};
    struct {
        int64_t B, T, H, KVH, D, DV, W;
    } cases[] = {{2, 37, 4, 2, 24, 16, 0}, {1, 29, 4, 4, 16, 40, 0}, {2, 21, 6, 3, 12, 8, 5}};
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
        for (int bf16 = 0; bf16 < 2; bf16++)
            for (int block = 0; block < 2; block++) {
                int64_t B = cases[ci].B, T = cases[ci].T, H = cases[ci].H, KVH = cases[ci].KVH, D = cases[ci].D;
                int64_t DV = cases[ci].DV, W = D > DV ? D : DV, win = cases[ci].W;
                int64_t qr = B * T * H, kr = B * T * KVH, nl = B * H * T;
                float scale = (float)(1.0 / sqrt((double)D));
                struct bt q = bt_rand(&r, qr * D, -2, 2), k = bt_rand(&r, kr * D, -2, 2), v = bt_rand(&r, kr * DV, -1, 1);
                struct bt dout = bt_rand(&r, qr * DV, -1, 1), dq = bt_rand(&r, qr * D, -1, 1);
                struct bt dk = bt_rand(&r, kr * D, -1, 1), dv = bt_rand(&r, kr * DV, -1, 1), out = bt_new(qr * DV);
                struct bt qp = pad_cols(&q, qr, D, W), kp = pad_cols(&k, kr, D, W), vp = pad_cols(&v, kr, DV, W);
                struct bt dop = pad_cols(&dout, qr, DV, W), dqp = pad_cols(&dq, qr, D, W);
                struct bt dkp = pad_cols(&dk, kr, D, W), dvp = pad_cols(&dv, kr, DV, W), outp = bt_new(qr * W);
                float *l = malloc((size_t)nl * 4), *lp = malloc((size_t)nl * 4);
                int32_t *pos = malloc((size_t)T * 4);
                for (int64_t t = 0; t < T; t++)
                    pos[t] = (int32_t)t;
                struct am_tensor (*view)(struct bt *, int64_t, int64_t, int64_t, int64_t) = bf16 ? hv : fv;
                struct am_tensor tq = view(&q, B, T, H, D), tk = view(&k, B, T, KVH, D), tv = view(&v, B, T, KVH, DV);
                struct am_tensor to = view(&out, B, T, H, DV), tdo = view(&dout, B, T, H, DV);
                struct am_tensor tdq = view(&dq, B, T, H, D), tdk = view(&dk, B, T, KVH, D), tdv = view(&dv, B, T, KVH, DV);
                struct am_tensor pq = view(&qp, B, T, H, W), pk = view(&kp, B, T, KVH, W), pv = view(&vp, B, T, KVH, W);
                struct am_tensor po = view(&outp, B, T, H, W), pdo = view(&dop, B, T, H, W);
                struct am_tensor pdq = view(&dqp, B, T, H, W), pdk = view(&dkp, B, T, KVH, W), pdv = view(&dvp, B, T, KVH, W);
                struct am_tensor tl = f32v(l, B, H, T, 0), tlp = f32v(lp, B, H, T, 0);
                struct am_tensor pos_t = am_tensor_view(pos, AM_DEV_CPU, AM_I32, T, 0, 0, 0);
                if (block) {
                    K->attention_block_softcap_forward(&kdev, &to, &tl, &tq, &tk, &tv, &pos_t, &pos_t, NULL, win, 0, scale, 0.0f);
                    K->attention_block_softcap_forward(&kdev, &po, &tlp, &pq, &pk, &pv, &pos_t, &pos_t, NULL, win, 0, scale,
                                                       0.0f);
                } else {
                    K->attention_softcap_forward(&kdev, &to, &tl, &tq, &tk, &tv, win, scale, 0.0f);
                    K->attention_softcap_forward(&kdev, &po, &tlp, &pq, &pk, &pv, win, scale, 0.0f);
                }
                char what[160];
                snprintf(what, sizeof what, "%s %s attention, D %lld, DV %lld%s: ", bf16 ? "bf16" : "fp32",
                         block ? "block" : "causal", (long long)D, (long long)DV, win ? ", windowed" : "");
                char w2[200];
                snprintf(w2, sizeof w2, "%sout", what);
                expect_cols(w2, &out, &outp, qr, DV, W, bf16, !block);
                if (!block)
                    assert_memory_equal(l, lp, (size_t)nl * 4);
                if (block) {
                    K->attention_block_softcap_backward(&kdev, &tdq, &tdk, &tdv, &tdo, &to, &tl, &tq, &tk, &tv, &pos_t, &pos_t,
                                                        NULL, win, scale, 0.0f);
                    K->attention_block_softcap_backward(&kdev, &pdq, &pdk, &pdv, &pdo, &po, &tlp, &pq, &pk, &pv, &pos_t,
                                                        &pos_t, NULL, win, scale, 0.0f);
                } else {
                    K->attention_softcap_backward(&kdev, &tdq, &tdk, &tdv, &tdo, &to, &tl, &tq, &tk, &tv, win, scale, 0.0f);
                    K->attention_softcap_backward(&kdev, &pdq, &pdk, &pdv, &pdo, &po, &tlp, &pq, &pk, &pv, win, scale, 0.0f);
                }
                snprintf(w2, sizeof w2, "%sdq", what);
                expect_cols(w2, &dq, &dqp, qr, D, W, bf16, !block);
                snprintf(w2, sizeof w2, "%sdk", what);
                expect_cols(w2, &dk, &dkp, kr, D, W, bf16, !block);
                snprintf(w2, sizeof w2, "%sdv", what);
                expect_cols(w2, &dv, &dvp, kr, DV, W, bf16, !block);
                struct bt *all[] = {&q, &k, &v, &dout, &dq, &dk, &dv, &out, &qp, &kp, &vp, &dop, &dqp, &dkp, &dvp, &outp};
                for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                    bt_free(all[i]);
                free(l);
                free(lp);
                free(pos);
            }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_attention_block),
        cmocka_unit_test(test_bf16_attention),
        cmocka_unit_test(test_bf16_attention_block),
        cmocka_unit_test(test_attention_v_width),
    };
    return cmocka_run_group_tests_name("kernels (cpu): attention", tests, kernels_test_setup, NULL);
}
