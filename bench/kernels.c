/* bench/kernels.c - every CPU kernel at the bench-small shapes (DESIGN.md: Llama, vocab 8192,
 * hidden 512, 4 layers, 8 heads, 4 kv heads, intermediate 1408, sequence 256, batch 4),
 * against OpenBLAS sgemm on this machine, and the training step they add up to.
 *
 *   bench/kernels [seconds per kernel, default 0.5]
 *   OMP_NUM_THREADS=1 AM_BENCH_CPUTIME=1 bench/kernels     (one core, CPU time: for a busy machine)
 *   bench/kernels --attention T [T ...]   (causal attention of one sequence of T tokens at
 *       bench-small's heads: the causal kernel against the block kernels that ring attention
 *       uses, over the same causal pairs; one timed call each, for long T)
 *
 * The peer is OpenBLAS's own threaded sgemm at the MLP's shape (1024 x 1408 x 512), with
 * as many threads as OpenMP uses. The step estimate sums each kernel's time times the
 * number of calls in one forward + backward + AdamW step; achieved GFLOP/s is DESIGN.md's
 * 6 * parameters * tokens / time. If OpenBLAS picked its Prescott kernels on a CPU with
 * AVX2/AVX-512 (OpenBLAS 0.3.21 does not know recent Xeons), set OPENBLAS_CORETYPE
 * (SkylakeX or Haswell): sgemm is then about five times faster.
 */
#include <cblas.h>
#include <stdbool.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

char *openblas_get_corename(void);

static struct am_dev kdev; /* the CPU's device context */
static const struct am_kernels *K; /* kdev.k */

/* The device-scalar reductions, read back at once. */
static double sum_squares(const struct am_tensor *t)
{
    double acc = 0;
    struct am_tensor a = am_tensor_view(&acc, AM_DEV_CPU, AM_F64, 1, 0, 0, 0);
    K->sum_squares(&kdev, &a, t, 1.0);
    return acc;
}

enum { NB = 4, NT = 256, NC = 512, NH = 8, NKV = 4, ND = 64, NI = 1408, NV = 8192, NL = 4, NN = NB * NT };

/* Wall-clock time; with AM_BENCH_CPUTIME=1, this process's CPU time instead, which on a
 * busy machine measures a single-threaded run (OMP_NUM_THREADS=1) without the time other
 * processes take from it (with more threads it would count OpenMP's spinning). */
static clockid_t bench_clock = CLOCK_MONOTONIC;

static double now(void)
{
    struct timespec ts;
    clock_gettime(bench_clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static float *buf(int64_t n, unsigned seed)
{
    float *p = K->alloc(&kdev, (size_t)n * sizeof(float));
    if (!p) {
        fprintf(stderr, "bench/kernels: out of memory for %lld floats\n", (long long)n);
        exit(1);
    }
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (float)((seed >> 8) & 0xFFFF) / 65536.0f - 0.5f;
    }
    return p;
}

static struct am_tensor f32(float *p, int64_t a, int64_t b, int64_t c, int64_t d)
{
    return am_tensor_view(p, AM_DEV_CPU, AM_F32, a, b, c, d);
}

/* A bf16 copy of n floats of p (the bench's bf16 tensors hold the same values rounded). */
static uint16_t *bbuf(const float *p, int64_t n)
{
    uint16_t *h = K->alloc(&kdev, (size_t)n * 2);
    if (!h) {
        fprintf(stderr, "bench/kernels: out of memory for %lld bf16 values\n", (long long)n);
        exit(1);
    }
    struct am_tensor src = am_tensor_view((void *)p, AM_DEV_CPU, AM_F32, n, 0, 0, 0);
    struct am_tensor dst = am_tensor_view(h, AM_DEV_CPU, AM_BF16, n, 0, 0, 0);
    K->convert(&kdev, &dst, &src);
    return h;
}

static struct am_tensor b16(uint16_t *p, int64_t a, int64_t b, int64_t c, int64_t d)
{
    return am_tensor_view(p, AM_DEV_CPU, AM_BF16, a, b, c, d);
}

static double seconds_per_call = 0.5;

/* Sets var to the seconds one evaluation of expr takes: the fastest of as many runs as fit
 * in seconds_per_call (after two warm-up runs). The minimum, not the mean: on a shared
 * 2-core machine the mean measures the neighbours. */
#define TIME(var, expr)                                                                                              \
    do {                                                                                                             \
        expr;                                                                                                        \
        expr;                                                                                                        \
        double best_ = 1e30, start_ = now();                                                                         \
        do {                                                                                                         \
            double t0_ = now();                                                                                      \
            expr;                                                                                                    \
            double t_ = now() - t0_;                                                                                 \
            best_ = t_ < best_ ? t_ : best_;                                                                         \
        } while (now() - start_ < seconds_per_call);                                                                 \
        var = best_;                                                                                                 \
    } while (0)

struct row {
    const char *name;
    double s, flops;
    int per_step;
};
static struct row make_row(const char *label, double secs, double fl, int count)
{
    struct row r = {label, secs, fl, count};
    return r;
}

static void print_row(const struct row *r, double peer)
{
    if (r->flops > 0)
        printf("  %-34s %9.3f ms %8.1f GFLOP/s %5.0f%% of sgemm  x%-3d\n", r->name, r->s * 1e3, r->flops / r->s / 1e9,
               100.0 * r->flops / r->s / 1e9 / peer, r->per_step);
    else
        printf("  %-34s %9.3f ms                               x%-3d\n", r->name, r->s * 1e3, r->per_step);
}

/* One sequence of T tokens, bench-small's heads: attention_forward/backward (the causal
 * kernels) against attention_block_forward/backward with positions 0..T-1 (the same pairs,
 * as a one-rank ring would run them). One call each: at long T a call takes seconds. */
static void long_attention(int64_t T)
{
    float *q = buf(T * NH * ND, 1), *k = buf(T * NKV * ND, 2), *v = buf(T * NKV * ND, 3), *o = buf(T * NH * ND, 4);
    float *lse = buf(NH * T, 5), *dq = buf(T * NH * ND, 6), *dk = buf(T * NKV * ND, 7), *dv = buf(T * NKV * ND, 8);
    int32_t *pos = K->alloc(&kdev, (size_t)T * sizeof(int32_t));
    if (!pos) {
        fprintf(stderr, "bench/kernels: out of memory for %lld positions\n", (long long)T);
        exit(1);
    }
    for (int64_t t = 0; t < T; t++)
        pos[t] = (int32_t)t;
    struct am_tensor tq = f32(q, 1, T, NH, ND), tk = f32(k, 1, T, NKV, ND), tv = f32(v, 1, T, NKV, ND);
    struct am_tensor to = f32(o, 1, T, NH, ND), tl = f32(lse, 1, NH, T, 0), tdq = f32(dq, 1, T, NH, ND);
    struct am_tensor tdk = f32(dk, 1, T, NKV, ND), tdv = f32(dv, 1, T, NKV, ND);
    struct am_tensor tp = am_tensor_view(pos, AM_DEV_CPU, AM_I32, T, 0, 0, 0);
    double pairs = (double)NH * T * (T + 1) / 2 * ND, s[4], t0 = now();
    K->attention_forward(&kdev, &to, &tl, &tq, &tk, &tv, 0);
    s[0] = now() - t0, t0 = now();
    K->attention_backward(&kdev, &tdq, &tdk, &tdv, &to, &to, &tl, &tq, &tk, &tv, 0);
    s[1] = now() - t0, t0 = now();
    K->attention_block_forward(&kdev, &to, &tl, &tq, &tk, &tv, &tp, &tp, 0, 0);
    s[2] = now() - t0, t0 = now();
    K->attention_block_backward(&kdev, &tdq, &tdk, &tdv, &to, &to, &tl, &tq, &tk, &tv, &tp, &tp, 0);
    s[3] = now() - t0;
    printf("  T %6lld  causal fwd %8.3f s %6.1f GFLOP/s  bwd %8.3f s %6.1f GFLOP/s | block fwd %8.3f s %6.1f "
           "GFLOP/s  bwd %8.3f s %6.1f GFLOP/s\n", (long long)T, s[0], 4 * pairs / s[0] / 1e9, s[1],
           10 * pairs / s[1] / 1e9, s[2], 4 * pairs / s[2] / 1e9, s[3], 10 * pairs / s[3] / 1e9);
    float *bufs[] = {q, k, v, o, lse, dq, dk, dv};
    for (int i = 0; i < 8; i++)
        K->free(&kdev, bufs[i]);
    K->free(&kdev, pos);
}

int main(int argc, char **argv)
{
    bool attention = argc > 1 && strcmp(argv[1], "--attention") == 0;
    if (argc > 1 && !attention)
        seconds_per_call = atof(argv[1]);
    if (getenv("AM_BENCH_CPUTIME") && strcmp(getenv("AM_BENCH_CPUTIME"), "1") == 0)
        bench_clock = CLOCK_PROCESS_CPUTIME_ID;
    int nth = omp_get_max_threads();
    char msg[256];
    if (am_dev_open(&kdev, AM_DEV_CPU, -1, msg, sizeof(msg)) < 0) {
        fprintf(stderr, "bench/kernels: %s\n", msg);
        return 1;
    }
    K = kdev.k; /* (the CPU backend sets OpenBLAS to one thread; the peer below resets it) */
    if (attention) {
        printf("causal attention of one sequence, %d heads, %d kv heads, head dim %d, %d OpenMP threads\n", NH, NKV,
               ND, nth);
        for (int i = 2; i < argc; i++)
            long_attention(atoll(argv[i]));
        return 0;
    }

    float *x = buf(NN * NI, 1), *w = buf(NI * NC, 2), *y = buf(NN * NI, 3);
    /* the peer: OpenBLAS's own threads */
    openblas_set_num_threads(nth);
    double peer_s;
    TIME(peer_s, cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, NN, NI, NC, 1.0f, x, NC, w, NC, 0.0f, y, NI));
    double peer = 2.0 * NN * NI * NC / peer_s / 1e9;
    K = am_kernels_for(AM_DEV_CPU);
    printf("bench-small kernels: %d OpenMP threads, OpenBLAS core %s\n", nth, openblas_get_corename());
    printf("  peer: OpenBLAS sgemm %dx%dx%d, %d threads: %.1f GFLOP/s\n", NN, NI, NC, nth, peer);
    const char *core = openblas_get_corename();
    if (core && (strcmp(core, "Prescott") == 0 || strcmp(core, "Core2") == 0 || strcmp(core, "Nehalem") == 0) &&
        __builtin_cpu_supports("avx2"))
        printf("  WARNING: OpenBLAS runs its %s kernels on a CPU with AVX2%s; set OPENBLAS_CORETYPE=%s\n", core,
               __builtin_cpu_supports("avx512f") ? " and AVX-512" : "",
               __builtin_cpu_supports("avx512f") ? "SkylakeX" : "Haswell");
    printf("\n");

    struct row rows[32];
    int nr = 0;
#define ADD(label, expr, fl, count)                                                                                  \
    do {                                                                                                             \
        double s_;                                                                                                   \
        TIME(s_, expr);                                                                                              \
        rows[nr++] = make_row(label, s_, (double)(fl), count);                                                   \
    } while (0)

    /* linear layers */
    struct {
        const char *fwd, *bwd;
        int64_t in, out;
    } lin[] = {{"matmul fwd q/o 512->512", "matmul bwd q/o 512->512", NC, NC},
               {"matmul fwd k/v 512->256", "matmul bwd k/v 512->256", NC, NKV * ND},
               {"matmul fwd gate/up 512->1408", "matmul bwd gate/up 512->1408", NC, NI},
               {"matmul fwd down 1408->512", "matmul bwd down 1408->512", NI, NC}};
    for (int l = 0; l < 4; l++) {
        struct am_tensor tx = f32(x, NN, lin[l].in, 0, 0), tw = f32(w, lin[l].out, lin[l].in, 0, 0);
        struct am_tensor ty = f32(y, NN, lin[l].out, 0, 0);
        float *dx = buf(NN * lin[l].in, 4), *dw = buf(lin[l].out * lin[l].in, 5);
        struct am_tensor tdx = f32(dx, NN, lin[l].in, 0, 0), tdw = f32(dw, lin[l].out, lin[l].in, 0, 0);
        int count = (l == 3 ? 1 : 2) * NL;
        double fl = 2.0 * NN * lin[l].in * lin[l].out;
        ADD(lin[l].fwd, K->matmul_forward(&kdev, &ty, &tx, &tw), fl, count);
        ADD(lin[l].bwd, K->matmul_backward(&kdev, &tdx, &tdw, &ty, &tx, &tw), 2 * fl, count);
        K->free(&kdev, dx);
        K->free(&kdev, dw);
    }

    /* attention */
    float *q = buf(NN * NH * ND, 6), *k = buf(NN * NKV * ND, 7), *v = buf(NN * NKV * ND, 8), *o = buf(NN * NH * ND, 9);
    float *lse = buf(NB * NH * NT, 10), *dq = buf(NN * NH * ND, 11), *dk = buf(NN * NKV * ND, 12), *dv = buf(NN * NKV * ND, 13);
    struct am_tensor tq = f32(q, NB, NT, NH, ND), tk = f32(k, NB, NT, NKV, ND), tv = f32(v, NB, NT, NKV, ND);
    struct am_tensor to = f32(o, NB, NT, NH, ND), tl = f32(lse, NB, NH, NT, 0), tdq = f32(dq, NB, NT, NH, ND);
    struct am_tensor tdk = f32(dk, NB, NT, NKV, ND), tdv = f32(dv, NB, NT, NKV, ND);
    double pairs = (double)NB * NH * NT * (NT + 1) / 2 * ND; /* (query, key, d) triples under the mask */
    ADD("attention fwd (causal, GQA 2)", K->attention_forward(&kdev, &to, &tl, &tq, &tk, &tv, 0), 4 * pairs, NL);
    ADD("attention bwd", K->attention_backward(&kdev, &tdq, &tdk, &tdv, &to, &to, &tl, &tq, &tk, &tv, 0), 10 * pairs, NL);

    /* rope */
    float *cs = buf(NT * ND / 2, 14), *sn = buf(NT * ND / 2, 15);
    struct am_tensor tcs = f32(cs, NT, ND / 2, 0, 0), tsn = f32(sn, NT, ND / 2, 0, 0);
    K->rope_tables(&kdev, &tcs, &tsn, 10000.0, NULL);
    /* per layer: forward on q and k (k half of q's size), backward on dq and dk */
    double rope_q;
    TIME(rope_q, K->rope_forward(&kdev, &tq, &tcs, &tsn));
    rows[nr++] = make_row("rope fwd+bwd on q, k (3x rope(q))", 3 * rope_q, 0, NL);

    /* rmsnorm, swiglu, residual add */
    float *r = buf(NN, 16), *nw = buf(NC, 17), *dnw = buf(NC, 18);
    struct am_tensor tx512 = f32(x, NN, NC, 0, 0), ty512 = f32(y, NN, NC, 0, 0), tr = f32(r, NN, 0, 0, 0);
    struct am_tensor tnw = f32(nw, NC, 0, 0, 0), tdnw = f32(dnw, NC, 0, 0, 0), tdq512 = f32(dq, NN, NC, 0, 0);
    ADD("rmsnorm fwd", K->rmsnorm_forward(&kdev, &ty512, &tr, &tx512, &tnw, 1e-5f), 0, 2 * NL + 1);
    ADD("rmsnorm bwd", K->rmsnorm_backward(&kdev, &tdq512, &tdnw, &ty512, &tx512, &tnw, &tr), 0, 2 * NL + 1);
    ADD("residual add [1024, 512]", K->add(&kdev, &ty512, &tx512), 0, 4 * NL);
    float *g = buf(NN * NI, 19), *u = buf(NN * NI, 20), *dg = buf(NN * NI, 21), *du = buf(NN * NI, 22);
    struct am_tensor tg = f32(g, NN, NI, 0, 0), tu = f32(u, NN, NI, 0, 0), tdg = f32(dg, NN, NI, 0, 0);
    struct am_tensor tdu = f32(du, NN, NI, 0, 0), tyI = f32(y, NN, NI, 0, 0);
    ADD("swiglu fwd", K->swiglu_forward(&kdev, &tyI, &tg, &tu), 0, NL);
    ADD("swiglu bwd", K->swiglu_backward(&kdev, &tdg, &tdu, &tyI, &tg, &tu), 0, NL);

    /* embedding, cross-entropy */
    int32_t *ids = malloc(NN * sizeof(int32_t));
    for (int i = 0; i < NN; i++)
        ids[i] = (int32_t)((i * 2654435761u) % NV);
    struct am_tensor tids = am_tensor_view(ids, AM_DEV_CPU, AM_I32, NN, 0, 0, 0);
    float *wte = buf(NV * NC, 23), *dwte = buf(NV * NC, 24);
    struct am_tensor twte = f32(wte, NV, NC, 0, 0), tdwte = f32(dwte, NV, NC, 0, 0);
    ADD("embedding fwd", K->embedding_forward(&kdev, &ty512, &tids, &twte, 0), 0, 1);
    ADD("embedding bwd", K->embedding_backward(&kdev, &tdwte, &ty512, &tids, 0), 0, 1);
    float *m = buf(NN, 25), *s = buf(NN, 26), *t = buf(NN, 27);
    struct am_tensor tm = f32(m, NN, 0, 0, 0), ts = f32(s, NN, 0, 0, 0), tt = f32(t, NN, 0, 0, 0);
    ADD("ce_stats (fused head 512->8192)", K->ce_stats(&kdev, &tm, &ts, &tt, &tx512, &twte, &tids, 0), 2.0 * NN * NV * NC, 1);
    ADD("ce_backward (recompute, dx, dw)",
        K->ce_backward(&kdev, &tdq512, &tdwte, &tx512, &twte, &tids, 0, &tm, &ts, 1.0f / NN), 6.0 * NN * NV * NC, 1);

    /* optimizer over every parameter (untied head) */
    int64_t params = 2LL * NV * NC + NL * (2LL * NC * NC + 2LL * NC * NKV * ND + 3LL * NC * NI + 2 * NC) + NC;
    float *p = buf(params, 28), *pg = buf(params, 29), *pm = buf(params, 30), *pv = buf(params, 31);
    struct am_tensor tp = f32(p, params, 0, 0, 0), tpg = f32(pg, params, 0, 0, 0), tpm = f32(pm, params, 0, 0, 0);
    struct am_tensor tpv = f32(pv, params, 0, 0, 0);
    for (int64_t i = 0; i < params; i++)
        pm[i] = pv[i] = 0.0f;
    ADD("adamw (all parameters)", K->adamw(&kdev, &tp, &tpg, &tpm, &tpv, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 10), 0, 1);
    ADD("sum_squares (grad norm)", sum_squares(&tpg), 0, 1);
    ADD("zero (gradients)", K->zero(&kdev, &tpg), 0, 1);

    double step = 0.0, matmul_s = 0.0, flops_matmul = 0.0;
    for (int i = 0; i < nr; i++) {
        print_row(&rows[i], peer);
        step += rows[i].s * rows[i].per_step;
        if (strncmp(rows[i].name, "matmul", 6) == 0 || strncmp(rows[i].name, "ce_", 3) == 0) {
            matmul_s += rows[i].s * rows[i].per_step;
            flops_matmul += rows[i].flops * rows[i].per_step;
        }
    }
    double tok = (double)NN / step, achieved = 6.0 * (double)params * NN / step / 1e9;
    printf("\n  step estimate (sum of kernels x calls): %.1f ms, %.0f tokens/s\n", step * 1e3, tok);
    printf("  parameters %.2fM; achieved 6*P*tokens/time = %.1f GFLOP/s = %.0f%% of sgemm (goal > 60%%)\n",
           (double)params / 1e6, achieved, 100.0 * achieved / peer);
    printf("  of which GEMM-shaped work (matmuls, fused head): %.1f ms at %.1f GFLOP/s\n", matmul_s * 1e3,
           flops_matmul / matmul_s / 1e9);

    /* ---- the same kernels with bf16 activations and weights (mixed precision: parameter
     * gradients f32, statistics f32), against their fp32 rows ---- */
    struct row brows[32];
    int nb = 0;
#define ADDB(label, expr, fl, count)                                                                                 \
    do {                                                                                                             \
        double s_;                                                                                                   \
        TIME(s_, expr);                                                                                              \
        brows[nb++] = make_row(label, s_, (double)(fl), count);                                                  \
    } while (0)
    uint16_t *hx = bbuf(x, NN * NI), *hw = bbuf(w, NI * NC), *hy = bbuf(y, NN * NI);
    for (int l = 0; l < 4; l++) {
        struct am_tensor tx = b16(hx, NN, lin[l].in, 0, 0), tw = b16(hw, lin[l].out, lin[l].in, 0, 0);
        struct am_tensor ty = b16(hy, NN, lin[l].out, 0, 0);
        float *dwf = buf(lin[l].out * lin[l].in, 5);
        uint16_t *hdx = bbuf(x, NN * lin[l].in);
        struct am_tensor tdx = b16(hdx, NN, lin[l].in, 0, 0), tdw = f32(dwf, lin[l].out, lin[l].in, 0, 0);
        int count = (l == 3 ? 1 : 2) * NL;
        double fl = 2.0 * NN * lin[l].in * lin[l].out;
        ADDB(lin[l].fwd, K->matmul_forward(&kdev, &ty, &tx, &tw), fl, count);
        ADDB(lin[l].bwd, K->matmul_backward(&kdev, &tdx, &tdw, &ty, &tx, &tw), 2 * fl, count);
        K->free(&kdev, dwf);
        K->free(&kdev, hdx);
    }
    uint16_t *hq = bbuf(q, NN * NH * ND), *hk = bbuf(k, NN * NKV * ND), *hv = bbuf(v, NN * NKV * ND);
    uint16_t *ho = bbuf(o, NN * NH * ND), *hdq = bbuf(dq, NN * NH * ND), *hdk = bbuf(dk, NN * NKV * ND);
    uint16_t *hdv = bbuf(dv, NN * NKV * ND);
    struct am_tensor bq = b16(hq, NB, NT, NH, ND), bk = b16(hk, NB, NT, NKV, ND), bv = b16(hv, NB, NT, NKV, ND);
    struct am_tensor bo = b16(ho, NB, NT, NH, ND), bdq = b16(hdq, NB, NT, NH, ND), bdk = b16(hdk, NB, NT, NKV, ND);
    struct am_tensor bdv = b16(hdv, NB, NT, NKV, ND);
    ADDB("attention fwd (causal, GQA 2)", K->attention_forward(&kdev, &bo, &tl, &bq, &bk, &bv, 0), 4 * pairs, NL);
    ADDB("attention bwd", K->attention_backward(&kdev, &bdq, &bdk, &bdv, &bo, &bo, &tl, &bq, &bk, &bv, 0), 10 * pairs, NL);
    uint16_t *hcs = bbuf(cs, NT * ND / 2), *hsn = bbuf(sn, NT * ND / 2);
    struct am_tensor bcs = b16(hcs, NT, ND / 2, 0, 0), bsn = b16(hsn, NT, ND / 2, 0, 0);
    TIME(rope_q, K->rope_forward(&kdev, &bq, &bcs, &bsn));
    brows[nb++] = make_row("rope fwd+bwd on q, k (3x rope(q))", 3 * rope_q, 0, NL);
    uint16_t *hnw = bbuf(nw, NC), *hx512 = bbuf(x, NN * NC), *hy512 = bbuf(y, NN * NC), *hdq512 = bbuf(dq, NN * NC);
    struct am_tensor bx512 = b16(hx512, NN, NC, 0, 0), by512 = b16(hy512, NN, NC, 0, 0), bnw = b16(hnw, NC, 0, 0, 0);
    struct am_tensor bdq512 = b16(hdq512, NN, NC, 0, 0);
    ADDB("rmsnorm fwd", K->rmsnorm_forward(&kdev, &by512, &tr, &bx512, &bnw, 1e-5f), 0, 2 * NL + 1);
    ADDB("rmsnorm bwd", K->rmsnorm_backward(&kdev, &bdq512, &tdnw, &by512, &bx512, &bnw, &tr), 0, 2 * NL + 1);
    ADDB("residual add [1024, 512]", K->add(&kdev, &by512, &bx512), 0, 4 * NL);
    uint16_t *hg = bbuf(g, NN * NI), *hu = bbuf(u, NN * NI), *hdg = bbuf(dg, NN * NI), *hdu = bbuf(du, NN * NI);
    struct am_tensor bg = b16(hg, NN, NI, 0, 0), bu = b16(hu, NN, NI, 0, 0), bdg = b16(hdg, NN, NI, 0, 0);
    struct am_tensor bdu = b16(hdu, NN, NI, 0, 0), byI = b16(hy, NN, NI, 0, 0);
    ADDB("swiglu fwd", K->swiglu_forward(&kdev, &byI, &bg, &bu), 0, NL);
    ADDB("swiglu bwd", K->swiglu_backward(&kdev, &bdg, &bdu, &byI, &bg, &bu), 0, NL);
    uint16_t *hwte = bbuf(wte, NV * NC);
    struct am_tensor bwte = b16(hwte, NV, NC, 0, 0);
    ADDB("embedding fwd", K->embedding_forward(&kdev, &by512, &tids, &bwte, 0), 0, 1);
    ADDB("embedding bwd (f32 dwte)", K->embedding_backward(&kdev, &tdwte, &by512, &tids, 0), 0, 1);
    ADDB("ce_stats (fused head 512->8192)", K->ce_stats(&kdev, &tm, &ts, &tt, &bx512, &bwte, &tids, 0), 2.0 * NN * NV * NC, 1);
    ADDB("ce_backward (recompute, dx, dw)",
         K->ce_backward(&kdev, &bdq512, &tdwte, &bx512, &bwte, &tids, 0, &tm, &ts, 1.0f / NN), 6.0 * NN * NV * NC, 1);
    for (int i = nr - 3; i < nr; i++) /* adamw, the gradient norm and zeroing stay on fp32 tensors */
        brows[nb++] = rows[i];

    printf("\nbf16 activations and weights, f32 parameter gradients (mixed precision), vs the fp32 rows:\n");
    double bstep = 0.0, bmm_s = 0.0, bflops = 0.0;
    for (int i = 0; i < nb; i++) {
        const struct row *fr = NULL;
        for (int j = 0; j < nr && !fr; j++)
            if (strncmp(rows[j].name, brows[i].name, 13) == 0)
                fr = &rows[j];
        if (brows[i].flops > 0)
            printf("  %-34s %9.3f ms %8.1f GFLOP/s  fp32 %6.1f  (%4.2fx its time)\n", brows[i].name, brows[i].s * 1e3,
                   brows[i].flops / brows[i].s / 1e9, fr ? fr->flops / fr->s / 1e9 : 0.0, fr ? brows[i].s / fr->s : 0.0);
        else
            printf("  %-34s %9.3f ms                   fp32 %7.3f ms (%4.2fx)\n", brows[i].name, brows[i].s * 1e3,
                   fr ? fr->s * 1e3 : 0.0, fr ? brows[i].s / fr->s : 0.0);
        bstep += brows[i].s * brows[i].per_step;
        if (strncmp(brows[i].name, "matmul", 6) == 0 || strncmp(brows[i].name, "ce_", 3) == 0) {
            bmm_s += brows[i].s * brows[i].per_step;
            bflops += brows[i].flops * brows[i].per_step;
        }
    }
    printf("\n  bf16 step estimate: %.1f ms, %.0f tokens/s (fp32 %.0f); GEMM-shaped work %.1f ms at %.1f GFLOP/s\n",
           bstep * 1e3, (double)NN / bstep, tok, bmm_s * 1e3, bflops / bmm_s / 1e9);
    return 0;
}
