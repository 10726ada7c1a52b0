/* gpu_check.c - every CUDA kernel against the CPU kernel (the reference, tested on its own by
 * tests/kernels/test_*, one program per kernel family) on fresh random inputs, forward and
 * backward, fp32 and bf16.
 *
 * Each case fills its inputs at random (xorshift, seed AM_GPU_SEED or the clock), gives the
 * same bytes to both backends (gradients start random too: backward kernels accumulate; but
 * the attention's, below), runs the kernel on each and compares every output by its relative
 * L2 norm, ||gpu - cpu|| / ||cpu||: at most 1e-5 for the fp32 paths, 1e-2 for the bf16 paths
 * (a bf16 output differs by at most an ulp, 2^-8 relative, where the two sum in a different
 * order). A summary table is printed last; exit 0 when every row passes, 1 otherwise, 77
 * (SKIP) when the machine has no NVIDIA device (probe.h: any other CUDA error FAILs, naming
 * it; the driver's and the runtime's versions come first). Run by tests/gpu/run; small shapes
 * but for the cross-entropy's, which cross its row and vocabulary chunks (some seconds of CPU
 * reference). stdout is line-buffered and each case prints its name ("case ...") before it
 * runs, so that an abort on an asynchronous fault (run it with CUDA_LAUNCH_BLOCKING=1 to have
 * the fault name its kernel: tests/gpu/run --blocking) still shows every row before it and the
 * case it died in.
 *
 * Attention runs on each of its paths (AM_ATTN=own, and AM_ATTN=cudnn in a build with
 * cuDNN), and a row per case checks which path ran (cuda_impl.h counts the calls). Its
 * backward (and the soft-capped one's) starts from zero gradients, so that the rows compare
 * what the backward computes, not the random values it adds to (7-93 % of the norm: a 10 %
 * error in dq passed 1e-2 so), within 5e-3 in bf16: a 1 % error fails (--self-test shows it);
 * then it runs again onto its own result, on both devices, to check that it accumulates.
 *
 *   gpu_check               the cases (a GPU machine)
 *   gpu_check --probe       the versions and the verdict only: exit 0 (a device), 77, 1
 *   gpu_check --self-test   the checks themselves, no GPU needed: the probe's verdict on every
 *                           kind of machine; the attention case run on the CPU against the CPU
 *                           passes, against the CPU with its backward's result off by 1 %
 *                           fails on every gradient row; the CUDA backend's argument checks
 *                           that abort before the device is touched (grouped_matmul's output
 *                           rows, the own attention's grid limit) name what is wrong
 *
 * The CUDA context is opened through the backend's own open (not am_dev_open), so that the
 * kernels it has are checked while the table still lacks some (am_dev_open refuses those). */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda/cuda_impl.h" /* which attention path ran */
#include "half.h"
#include "kernels.h"
#include "probe.h"

/* the tolerances of the relative L2 norm (see above) */
#define TOL_F32 1e-5
#define TOL_BF16 1e-2
#define TOL_ATTN_BWD_BF16 5e-3 /* the attention's gradients from zero: a 1 % error fails */

/* each case's name before it runs (stdout is line-buffered) */
static void begin(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void begin(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("case ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}
#define RUN(...) (begin("%s", #__VA_ARGS__), __VA_ARGS__)

static struct am_dev cpu, gpu;
static const struct am_kernels *KC, *KG;
static uint64_t rng_state;

static double urand(double lo, double hi)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    uint64_t v = rng_state * 2685821657736338717ull;
    return lo + (hi - lo) * (double)(v >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- a tensor on both devices ---- */
struct pair {
    struct am_tensor c, g;
};

static struct pair pair_new(enum am_dtype dt, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    struct pair p;
    p.c = am_tensor_view(NULL, AM_DEV_CPU, dt, d0, d1, d2, d3);
    p.g = am_tensor_view(NULL, gpu.device, dt, d0, d1, d2, d3); /* the CPU in --self-test */
    size_t b = am_tensor_bytes(&p.c);
    p.c.data = KC->alloc(&cpu, b);
    p.g.data = KG->alloc(&gpu, b);
    if (!p.c.data || !p.g.data) {
        fprintf(stderr, "gpu_check: out of memory for %zu bytes\n", b);
        exit(1);
    }
    return p;
}

static void pair_free(struct pair *p)
{
    KC->free(&cpu, p->c.data);
    KG->free(&gpu, p->g.data);
}

static void pair_upload(struct pair *p) { KG->upload(&gpu, p->g.data, p->c.data, am_tensor_bytes(&p->c)); }

/* uniform in [lo, hi), rounded to the dtype; the same bytes on the GPU */
static void pair_fill(struct pair *p, double lo, double hi)
{
    int64_t n = am_tensor_numel(&p->c);
    for (int64_t i = 0; i < n; i++) {
        double v = urand(lo, hi);
        switch (p->c.dtype) {
        case AM_F32: ((float *)p->c.data)[i] = (float)v; break;
        case AM_BF16: ((uint16_t *)p->c.data)[i] = am_f32_to_bf16((float)v); break;
        case AM_F64: ((double *)p->c.data)[i] = v; break;
        case AM_I32: ((int32_t *)p->c.data)[i] = (int32_t)floor(v); break;
        default: fprintf(stderr, "gpu_check: no fill for %s\n", am_dtype_name(p->c.dtype)); exit(1);
        }
    }
    pair_upload(p);
}

static struct pair rnd(enum am_dtype dt, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    struct pair p = pair_new(dt, d0, d1, d2, d3);
    pair_fill(&p, -1.0, 1.0);
    return p;
}

static double elem(const struct am_tensor *t, const void *data, int64_t i)
{
    switch (t->dtype) {
    case AM_F32: return ((const float *)data)[i];
    case AM_BF16: return am_bf16_to_f32(((const uint16_t *)data)[i]);
    case AM_F64: return ((const double *)data)[i];
    case AM_I32: return ((const int32_t *)data)[i];
    default: return NAN;
    }
}

/* ---- comparisons and the summary ---- */
#define MAX_ROWS 768
static struct row {
    char what[96], dtype[16];
    double err, tol;
    bool ok;
} rows[MAX_ROWS];
static int nrows, nfail;

static void record(const char *what, const char *dtype, double err, double tol)
{
    bool ok = err <= tol; /* NaN fails */
    if (!ok)
        nfail++;
    if (nrows < MAX_ROWS) {
        struct row *r = &rows[nrows++];
        snprintf(r->what, sizeof r->what, "%s", what);
        snprintf(r->dtype, sizeof r->dtype, "%s", dtype);
        r->err = err;
        r->tol = tol;
        r->ok = ok;
    }
    printf("%-4s %-44s %-10s rel err %.3e (tol %.0e)\n", ok ? "ok" : "FAIL", what, dtype, err, tol);
}

/* ||gpu - cpu|| / ||cpu|| over p's elements (||cpu|| 0: the absolute norm) */
static double rel_err(const struct pair *p)
{
    size_t b = am_tensor_bytes(&p->c);
    void *h = malloc(b ? b : 1);
    KG->download(&gpu, h, p->g.data, b);
    double num = 0, den = 0;
    int64_t n = am_tensor_numel(&p->c);
    for (int64_t i = 0; i < n; i++) {
        double c = elem(&p->c, p->c.data, i), g = elem(&p->c, h, i);
        num += (g - c) * (g - c);
        den += c * c;
    }
    free(h);
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void check(const char *what, const struct pair *p, bool bf16)
{
    char name[96];
    snprintf(name, sizeof name, "%s", what);
    record(name, bf16 ? "bf16" : "fp32", rel_err(p), bf16 ? TOL_BF16 : TOL_F32);
}

/* an attention gradient, from zero (or twice from zero): TOL_ATTN_BWD_BF16 in bf16 */
static void check_attn_grad(const char *what, const struct pair *p, bool bf16)
{
    record(what, bf16 ? "bf16" : "fp32", rel_err(p), bf16 ? TOL_ATTN_BWD_BF16 : TOL_F32);
}

static const char *dname(enum am_dtype dt) { return am_dtype_name(dt); }

/* ---- the cases ---- */

static void case_elementwise(enum am_dtype dt)
{
    bool bf = dt == AM_BF16;
    struct pair a = rnd(dt, 1000, 37, 0, 0), b = rnd(AM_F32, 1000, 37, 0, 0), c = rnd(dt, 1000, 37, 0, 0);
    KC->add(&cpu, &a.c, &b.c);
    KG->add(&gpu, &a.g, &b.g);
    check(bf ? "add (bf16 += f32)" : "add", &a, bf);
    KC->add(&cpu, &b.c, &c.c);
    KG->add(&gpu, &b.g, &c.g);
    check(bf ? "add (f32 += bf16)" : "add (again)", &b, false);
    KC->scale(&cpu, &c.c, 0.37f);
    KG->scale(&gpu, &c.g, 0.37f);
    check("scale", &c, bf);
    /* copy_cols (multi-head latent attention's heads): de-interleaved, then interleaved back and
     * added, then plain: the same bits */
    struct pair cs = rnd(dt, 200, 48, 0, 0), cd = rnd(dt, 200, 40, 0, 0);
    KC->copy_cols(&cpu, &cd.c, 4, &cs.c, 10, 16, 1, false);
    KG->copy_cols(&gpu, &cd.g, 4, &cs.g, 10, 16, 1, false);
    KC->copy_cols(&cpu, &cs.c, 30, &cd.c, 4, 16, -1, true);
    KG->copy_cols(&gpu, &cs.g, 30, &cd.g, 4, 16, -1, true);
    KC->copy_cols(&cpu, &cd.c, 21, &cs.c, 0, 19, 0, false);
    KG->copy_cols(&gpu, &cd.g, 21, &cs.g, 0, 19, 0, false);
    record("copy_cols", dname(dt), rel_err(&cs) + rel_err(&cd), 0);
    pair_free(&cs);
    pair_free(&cd);
    /* dropout's mask: the same counters, the same product: bit for bit (rows of 40 sequences
     * of 25 rows at shuffled positions of 50, columns 37 from 11 of 100) */
    struct pair pos = pair_new(AM_I32, 25, 0, 0, 0);
    for (int i = 0; i < 25; i++)
        ((int32_t *)pos.c.data)[i] = (i * 7) % 50;
    pair_upload(&pos);
    struct am_dropout dr = {.p = 0.3f, .seed = 5, .stream = 17, .seq0 = 3, .seq_step = 2, .seq_len = 50,
                            .rows_per_seq = 25, .col0 = 11, .cols = 100};
    struct am_dropout drg = dr;
    dr.pos = pos.c.data;
    drg.pos = pos.g.data;
    KC->dropout(&cpu, &c.c, &dr);
    KG->dropout(&gpu, &c.g, &drg);
    record("dropout", dname(dt), rel_err(&c), 0);
    pair_free(&pos);
    /* sum of squares into an f64 scalar, starting from a value */
    struct pair acc = pair_new(AM_F64, 1, 0, 0, 0);
    ((double *)acc.c.data)[0] = 2.5;
    pair_upload(&acc);
    KC->sum_squares(&cpu, &acc.c, &a.c, 3.0);
    KG->sum_squares(&gpu, &acc.g, &a.g, 3.0);
    KC->sum_squares(&cpu, &acc.c, &c.c, 1.0);
    KG->sum_squares(&gpu, &acc.g, &c.g, 1.0);
    record("sum_squares", dname(dt), rel_err(&acc), 1e-12);
    /* all_finite: 1 stays 1, then an Inf far in the tensor sets 0 */
    struct pair flag = pair_new(AM_I32, 1, 0, 0, 0);
    ((int32_t *)flag.c.data)[0] = 1;
    pair_upload(&flag);
    KC->all_finite(&cpu, &flag.c, &a.c);
    KG->all_finite(&gpu, &flag.g, &a.g);
    int32_t got = 0;
    KG->download(&gpu, &got, flag.g.data, 4);
    record("all_finite (finite: flag stays 1)", dname(dt), got == 1 && ((int32_t *)flag.c.data)[0] == 1 ? 0 : 1, 0);
    if (bf)
        ((uint16_t *)a.c.data)[29999] = 0x7f80; /* +Inf */
    else
        ((float *)a.c.data)[29999] = NAN;
    pair_upload(&a);
    KC->all_finite(&cpu, &flag.c, &a.c);
    KG->all_finite(&gpu, &flag.g, &a.g);
    KG->download(&gpu, &got, flag.g.data, 4);
    record(bf ? "all_finite (an Inf: flag 0)" : "all_finite (a NaN: flag 0)", dname(dt),
           got == 0 && ((int32_t *)flag.c.data)[0] == 0 ? 0 : 1, 0);
    pair_free(&a);
    pair_free(&b);
    pair_free(&c);
    pair_free(&acc);
    pair_free(&flag);
}

static void case_convert(void)
{
    struct pair f = rnd(AM_F32, 777, 0, 0, 0), h = pair_new(AM_BF16, 777, 0, 0, 0), f2 = pair_new(AM_F32, 777, 0, 0, 0);
    struct pair dd = pair_new(AM_F64, 777, 0, 0, 0);
    KC->convert(&cpu, &h.c, &f.c);
    KG->convert(&gpu, &h.g, &f.g);
    record("convert f32 -> bf16 (bitwise)", "bf16", rel_err(&h), 0);
    KC->convert(&cpu, &f2.c, &h.c);
    KG->convert(&gpu, &f2.g, &h.g);
    record("convert bf16 -> f32 (bitwise)", "bf16", rel_err(&f2), 0);
    KC->convert(&cpu, &dd.c, &f.c);
    KG->convert(&gpu, &dd.g, &f.g);
    record("convert f32 -> f64 (bitwise)", "fp32", rel_err(&dd), 0);
    pair_fill(&dd, -3, 3);
    KC->convert(&cpu, &f.c, &dd.c);
    KG->convert(&gpu, &f.g, &dd.g);
    record("convert f64 -> f32 (bitwise)", "fp32", rel_err(&f), 0);
    pair_free(&f);
    pair_free(&h);
    pair_free(&f2);
    pair_free(&dd);
}

static void case_matmul(enum am_dtype dt, enum am_dtype gdt)
{
    bool bf = dt == AM_BF16;
    int64_t M = 96, K = 160, N = 200;
    struct pair x = rnd(dt, M, K, 0, 0), w = rnd(dt, N, K, 0, 0), y = pair_new(dt, M, N, 0, 0);
    struct pair dy = rnd(dt, M, N, 0, 0), dx = rnd(dt, M, K, 0, 0), dw = rnd(gdt, N, K, 0, 0);
    char what[64];
    KC->matmul_forward(&cpu, &y.c, &x.c, &w.c);
    KG->matmul_forward(&gpu, &y.g, &x.g, &w.g);
    check("matmul_forward y", &y, bf);
    KC->matmul_backward(&cpu, &dx.c, &dw.c, &dy.c, &x.c, &w.c);
    KG->matmul_backward(&gpu, &dx.g, &dw.g, &dy.g, &x.g, &w.g);
    check("matmul_backward dx", &dx, bf);
    snprintf(what, sizeof what, "matmul_backward dw (%s)", dname(gdt));
    check(what, &dw, bf);
    pair_free(&x);
    pair_free(&w);
    pair_free(&y);
    pair_free(&dy);
    pair_free(&dx);
    pair_free(&dw);
}

static void case_embedding(enum am_dtype dt, enum am_dtype gdt)
{
    bool bf = dt == AM_BF16;
    int64_t N = 300, C = 96, V = 50, start = 40; /* ids 0..119: some in the shard [40, 90), repeated */
    struct pair ids = pair_new(AM_I32, N, 0, 0, 0), wte = rnd(dt, V, C, 0, 0), out = rnd(dt, N, C, 0, 0);
    struct pair dout = rnd(dt, N, C, 0, 0), dwte = rnd(gdt, V, C, 0, 0);
    pair_fill(&ids, 0, 120);
    char what[64];
    KC->embedding_forward(&cpu, &out.c, &ids.c, &wte.c, start);
    KG->embedding_forward(&gpu, &out.g, &ids.g, &wte.g, start);
    record("embedding_forward (bitwise)", dname(dt), rel_err(&out), 0);
    KC->embedding_backward(&cpu, &dwte.c, &dout.c, &ids.c, start);
    KG->embedding_backward(&gpu, &dwte.g, &dout.g, &ids.g, start);
    snprintf(what, sizeof what, "embedding_backward dwte (%s)", dname(gdt));
    check(what, &dwte, bf);
    pair_free(&ids);
    pair_free(&wte);
    pair_free(&out);
    pair_free(&dout);
    pair_free(&dwte);
}

static void case_rmsnorm(enum am_dtype dt, enum am_dtype gdt)
{
    bool bf = dt == AM_BF16;
    int64_t N = 130, C = 520;
    struct pair x = rnd(dt, N, C, 0, 0), w = rnd(dt, C, 0, 0, 0), out = pair_new(dt, N, C, 0, 0);
    struct pair rstd = pair_new(AM_F32, N, 0, 0, 0), dout = rnd(dt, N, C, 0, 0), dx = rnd(dt, N, C, 0, 0);
    struct pair dw = rnd(gdt, C, 0, 0, 0);
    char what[64];
    KC->rmsnorm_forward(&cpu, &out.c, &rstd.c, &x.c, &w.c, 1e-5f);
    KG->rmsnorm_forward(&gpu, &out.g, &rstd.g, &x.g, &w.g, 1e-5f);
    check("rmsnorm_forward out", &out, bf);
    record("rmsnorm_forward rstd", dname(dt), rel_err(&rstd), 1e-5);
    KC->rmsnorm_backward(&cpu, &dx.c, &dw.c, &dout.c, &x.c, &w.c, &rstd.c);
    KG->rmsnorm_backward(&gpu, &dx.g, &dw.g, &dout.g, &x.g, &w.g, &rstd.g);
    check("rmsnorm_backward dx", &dx, bf);
    snprintf(what, sizeof what, "rmsnorm_backward dw (%s)", dname(gdt));
    check(what, &dw, bf);
    pair_free(&x);
    pair_free(&w);
    pair_free(&out);
    pair_free(&rstd);
    pair_free(&dout);
    pair_free(&dx);
    pair_free(&dw);
}

static void case_rope(enum am_dtype dt, enum am_dtype tdt)
{
    bool bf = dt == AM_BF16;
    int64_t B = 2, T = 48, H = 3, D = 64;
    struct pair tc = pair_new(AM_F32, T, D / 2, 0, 0), ts = pair_new(AM_F32, T, D / 2, 0, 0);
    struct am_rope_scaling sc = {
        .type = "llama3", .factor = 8.0, .low_freq_factor = 1.0, .high_freq_factor = 4.0, .original_max_position_embeddings = 32};
    KC->rope_tables(&cpu, &tc.c, &ts.c, 500000.0, &sc);
    KG->rope_tables(&gpu, &tc.g, &ts.g, 500000.0, &sc);
    if (dt == AM_F32) {
        record("rope_tables cos (bitwise)", "fp32", rel_err(&tc), 0);
        record("rope_tables sin (bitwise)", "fp32", rel_err(&ts), 0);
    }
    struct pair c2 = tc, s2 = ts;
    if (tdt == AM_BF16) {
        c2 = pair_new(AM_BF16, T, D / 2, 0, 0);
        s2 = pair_new(AM_BF16, T, D / 2, 0, 0);
        KC->convert(&cpu, &c2.c, &tc.c);
        KG->convert(&gpu, &c2.g, &tc.g);
        KC->convert(&cpu, &s2.c, &ts.c);
        KG->convert(&gpu, &s2.g, &ts.g);
    }
    struct pair x = rnd(dt, B, T, H, D);
    char what[64];
    KC->rope_forward(&cpu, &x.c, &c2.c, &s2.c);
    KG->rope_forward(&gpu, &x.g, &c2.g, &s2.g);
    snprintf(what, sizeof what, "rope_forward (%s tables)", dname(tdt));
    check(what, &x, bf);
    KC->rope_backward(&cpu, &x.c, &c2.c, &s2.c);
    KG->rope_backward(&gpu, &x.g, &c2.g, &s2.g);
    snprintf(what, sizeof what, "rope_backward (%s tables)", dname(tdt));
    check(what, &x, bf);
    if (tdt == AM_BF16) {
        pair_free(&c2);
        pair_free(&s2);
    }
    pair_free(&tc);
    pair_free(&ts);
    pair_free(&x);
}

static void case_swiglu(enum am_dtype dt)
{
    bool bf = dt == AM_BF16;
    int64_t N = 200, I = 300;
    struct pair g = pair_new(dt, N, I, 0, 0), u = rnd(dt, N, I, 0, 0), out = pair_new(dt, N, I, 0, 0);
    struct pair dout = rnd(dt, N, I, 0, 0), dg = rnd(dt, N, I, 0, 0), du = rnd(dt, N, I, 0, 0);
    pair_fill(&g, -6, 6);
    KC->swiglu_forward(&cpu, &out.c, &g.c, &u.c);
    KG->swiglu_forward(&gpu, &out.g, &g.g, &u.g);
    check("swiglu_forward", &out, bf);
    KC->swiglu_backward(&cpu, &dg.c, &du.c, &dout.c, &g.c, &u.c);
    KG->swiglu_backward(&gpu, &dg.g, &du.g, &dout.g, &g.g, &u.g);
    check("swiglu_backward dgate", &dg, bf);
    check("swiglu_backward dup", &du, bf);
    KC->swiglu_backward(&cpu, NULL, &du.c, &dout.c, &g.c, &u.c);
    KG->swiglu_backward(&gpu, NULL, &du.g, &dout.g, &g.g, &u.g);
    check("swiglu_backward dup alone", &du, bf);
    pair_free(&g);
    pair_free(&u);
    pair_free(&out);
    pair_free(&dout);
    pair_free(&dg);
    pair_free(&du);
}

/* The bias of a linear layer: y += b, and db += Σ over rows of dy (a column summed in order on
 * both devices). */
static void case_bias(enum am_dtype dt)
{
    bool bf = dt == AM_BF16;
    int64_t M = 500, N = 300;
    struct pair y = rnd(dt, M, N, 0, 0), b = rnd(dt, N, 0, 0, 0), dy = rnd(dt, M, N, 0, 0), db = rnd(dt, N, 0, 0, 0);
    KC->bias_forward(&cpu, &y.c, &b.c);
    KG->bias_forward(&gpu, &y.g, &b.g);
    check("bias_forward", &y, bf);
    KC->bias_backward(&cpu, &db.c, &dy.c);
    KG->bias_backward(&gpu, &db.g, &dy.g);
    check("bias_backward", &db, bf);
    pair_free(&y);
    pair_free(&b);
    pair_free(&dy);
    pair_free(&db);
}

/* Gemma's kernels: RMSNorm with the weight 1 + w, GeGLU, the scaled and soft-capped attention
 * (with a window, AM_ATTN=cudnn: they run on the own kernels whatever the path) and the
 * cross-entropy on capped logits, over two vocabulary shards. */
static void fill_targets(struct pair *tg, int64_t lo, int64_t hi);

static void case_gemma(enum am_dtype dt, enum am_dtype gdt)
{
    bool bf = dt == AM_BF16;
    int64_t N = 130, C = 520;
    struct pair x = rnd(dt, N, C, 0, 0), w = rnd(dt, C, 0, 0, 0), out = pair_new(dt, N, C, 0, 0);
    struct pair rstd = pair_new(AM_F32, N, 0, 0, 0), dout = rnd(dt, N, C, 0, 0), dx = rnd(dt, N, C, 0, 0);
    struct pair dw = rnd(gdt, C, 0, 0, 0);
    KC->rmsnorm_offset_forward(&cpu, &out.c, &rstd.c, &x.c, &w.c, 1e-6f);
    KG->rmsnorm_offset_forward(&gpu, &out.g, &rstd.g, &x.g, &w.g, 1e-6f);
    check("rmsnorm_offset_forward out", &out, bf);
    KC->rmsnorm_offset_backward(&cpu, &dx.c, &dw.c, &dout.c, &x.c, &w.c, &rstd.c);
    KG->rmsnorm_offset_backward(&gpu, &dx.g, &dw.g, &dout.g, &x.g, &w.g, &rstd.g);
    check("rmsnorm_offset_backward dx", &dx, bf);
    check("rmsnorm_offset_backward dw", &dw, bf);
    struct pair g = pair_new(dt, N, C, 0, 0), dg = rnd(dt, N, C, 0, 0);
    pair_fill(&g, -6, 6);
    KC->geglu_forward(&cpu, &out.c, &g.c, &x.c);
    KG->geglu_forward(&gpu, &out.g, &g.g, &x.g);
    check("geglu_forward", &out, bf);
    KC->geglu_backward(&cpu, &dg.c, &dx.c, &dout.c, &g.c, &x.c);
    KG->geglu_backward(&gpu, &dg.g, &dx.g, &dout.g, &g.g, &x.g);
    check("geglu_backward dgate", &dg, bf);
    check("geglu_backward dup", &dx, bf);
    int64_t B = 2, T = 45, H = 4, KVH = 2, D = 32;
    setenv("AM_ATTN", "cudnn", 1);
    struct pair q = pair_new(dt, B, T, H, D), k = rnd(dt, B, T, KVH, D), v = rnd(dt, B, T, KVH, D);
    struct pair ao = pair_new(dt, B, T, H, D), lse = pair_new(AM_F32, B, H, T, 0), ado = rnd(dt, B, T, H, D);
    /* the gradients from zero (gpu_check's header says why), then accumulated once more */
    struct pair dq = pair_new(dt, B, T, H, D), dk = pair_new(dt, B, T, KVH, D), dv = pair_new(dt, B, T, KVH, D);
    pair_fill(&q, -2, 2);
    KC->attention_softcap_forward(&cpu, &ao.c, &lse.c, &q.c, &k.c, &v.c, 9, 0.25f, 1.5f);
    KG->attention_softcap_forward(&gpu, &ao.g, &lse.g, &q.g, &k.g, &v.g, 9, 0.25f, 1.5f);
    check("attention_softcap out", &ao, bf);
    record("attention_softcap lse", dname(dt), rel_err(&lse), 1e-5);
    pair_upload(&ao);
    pair_upload(&lse);
    for (int twice = 0; twice < 2; twice++) {
        KC->attention_softcap_backward(&cpu, &dq.c, &dk.c, &dv.c, &ado.c, &ao.c, &lse.c, &q.c, &k.c, &v.c, 9, 0.25f,
                                       1.5f);
        KG->attention_softcap_backward(&gpu, &dq.g, &dk.g, &dv.g, &ado.g, &ao.g, &lse.g, &q.g, &k.g, &v.g, 9, 0.25f,
                                       1.5f);
        check_attn_grad(twice ? "attention_softcap dq (accumulated twice)" : "attention_softcap dq", &dq, bf);
        check_attn_grad(twice ? "attention_softcap dk (accumulated twice)" : "attention_softcap dk", &dk, bf);
        check_attn_grad(twice ? "attention_softcap dv (accumulated twice)" : "attention_softcap dv", &dv, bf);
    }
    /* v's heads wider than q's and k's, then narrower (multi-head latent attention's v_head_dim;
     * cuDNN declines them: the own kernels run) */
    for (int wide = 0; wide < 2; wide++) {
        int64_t Dq = wide ? 24 : 48, Dv = wide ? 40 : 32;
        struct pair mq = rnd(dt, B, T, H, Dq), mk = rnd(dt, B, T, KVH, Dq), mv = rnd(dt, B, T, KVH, Dv);
        struct pair mo = pair_new(dt, B, T, H, Dv), ml = pair_new(AM_F32, B, H, T, 0), mdo = rnd(dt, B, T, H, Dv);
        struct pair mdq = pair_new(dt, B, T, H, Dq), mdk = pair_new(dt, B, T, KVH, Dq), mdv = pair_new(dt, B, T, KVH, Dv);
        KC->attention_softcap_forward(&cpu, &mo.c, &ml.c, &mq.c, &mk.c, &mv.c, 0, 0.2f, 0.0f);
        KG->attention_softcap_forward(&gpu, &mo.g, &ml.g, &mq.g, &mk.g, &mv.g, 0, 0.2f, 0.0f);
        check(wide ? "attention (v wider) out" : "attention (v narrower) out", &mo, bf);
        record(wide ? "attention (v wider) lse" : "attention (v narrower) lse", dname(dt), rel_err(&ml), 1e-5);
        pair_upload(&mo);
        pair_upload(&ml);
        KC->attention_softcap_backward(&cpu, &mdq.c, &mdk.c, &mdv.c, &mdo.c, &mo.c, &ml.c, &mq.c, &mk.c, &mv.c, 0, 0.2f,
                                       0.0f);
        KG->attention_softcap_backward(&gpu, &mdq.g, &mdk.g, &mdv.g, &mdo.g, &mo.g, &ml.g, &mq.g, &mk.g, &mv.g, 0, 0.2f,
                                       0.0f);
        check_attn_grad(wide ? "attention (v wider) dq" : "attention (v narrower) dq", &mdq, bf);
        check_attn_grad(wide ? "attention (v wider) dk" : "attention (v narrower) dk", &mdk, bf);
        check_attn_grad(wide ? "attention (v wider) dv" : "attention (v narrower) dv", &mdv, bf);
    }
    unsetenv("AM_ATTN");
    int64_t V = 300, Vh = V / 2, Nt = 70;
    struct pair hx = rnd(dt, Nt, C, 0, 0), hw = rnd(dt, V, C, 0, 0), tg = pair_new(AM_I32, Nt, 0, 0, 0);
    struct pair m = pair_new(AM_F32, Nt, 0, 0, 0), sm = pair_new(AM_F32, Nt, 0, 0, 0), t = pair_new(AM_F32, Nt, 0, 0, 0);
    struct pair hdx = rnd(dt, Nt, C, 0, 0), hdw = rnd(gdt, V, C, 0, 0);
    fill_targets(&tg, -1, V);
    for (int h = 0; h < 2; h++) {
        struct pair ws = hw, dws = hdw;
        size_t es = am_dtype_size(dt), gs = am_dtype_size(gdt);
        ws.c = am_tensor_view((char *)hw.c.data + (size_t)(h * Vh * C) * es, AM_DEV_CPU, dt, Vh, C, 0, 0);
        ws.g = am_tensor_view((char *)hw.g.data + (size_t)(h * Vh * C) * es, AM_DEV_CUDA, dt, Vh, C, 0, 0);
        dws.c = am_tensor_view((char *)hdw.c.data + (size_t)(h * Vh * C) * gs, AM_DEV_CPU, gdt, Vh, C, 0, 0);
        dws.g = am_tensor_view((char *)hdw.g.data + (size_t)(h * Vh * C) * gs, AM_DEV_CUDA, gdt, Vh, C, 0, 0);
        KC->ce_stats_softcap(&cpu, &m.c, &sm.c, &t.c, &hx.c, &ws.c, &tg.c, h * Vh, 2.0f);
        KG->ce_stats_softcap(&gpu, &m.g, &sm.g, &t.g, &hx.g, &ws.g, &tg.g, h * Vh, 2.0f);
        record(h ? "ce_stats_softcap m (shard 1)" : "ce_stats_softcap m (shard 0)", dname(dt), rel_err(&m), bf ? 1e-2 : 1e-5);
        record(h ? "ce_stats_softcap s (shard 1)" : "ce_stats_softcap s (shard 0)", dname(dt), rel_err(&sm), bf ? 1e-2 : 1e-5);
        record(h ? "ce_stats_softcap t (shard 1)" : "ce_stats_softcap t (shard 0)", dname(dt), rel_err(&t), bf ? 1e-2 : 1e-5);
        pair_upload(&m);
        pair_upload(&sm);
        KC->ce_backward_softcap(&cpu, &hdx.c, &dws.c, &hx.c, &ws.c, &tg.c, h * Vh, &m.c, &sm.c, 0.01f, 2.0f);
        KG->ce_backward_softcap(&gpu, &hdx.g, &dws.g, &hx.g, &ws.g, &tg.g, h * Vh, &m.g, &sm.g, 0.01f, 2.0f);
    }
    check("ce_backward_softcap dx", &hdx, bf);
    check("ce_backward_softcap dw", &hdw, bf);
    struct pair *all[] = {&x, &w, &out, &rstd, &dout, &dx, &dw, &g, &dg, &q, &k, &v, &ao, &lse, &ado, &dq, &dk, &dv,
                          &hx, &hw, &tg, &m, &sm, &t, &hdx, &hdw};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        pair_free(all[i]);
}

/* LoRA on lm_head (ce_stats_lora, ce_backward_lora): the logits x · wᵀ + u · bᵀ over two
 * vocabulary shards, without and with a soft cap; m, s, t of each shard, dx, du (summed over the
 * shards, as the model's tp sum would) and the fp32 db. */
static void case_ce_lora(enum am_dtype dt)
{
    bool bf = dt == AM_BF16;
    int64_t V = 300, Vh = V / 2, Nt = 70, C = 96, r = 8;
    struct pair hx = rnd(dt, Nt, C, 0, 0), hw = rnd(dt, V, C, 0, 0), tg = pair_new(AM_I32, Nt, 0, 0, 0);
    struct pair u = rnd(dt, Nt, r, 0, 0), b = rnd(dt, V, r, 0, 0);
    struct pair m = pair_new(AM_F32, Nt, 0, 0, 0), sm = pair_new(AM_F32, Nt, 0, 0, 0), t = pair_new(AM_F32, Nt, 0, 0, 0);
    struct pair hdx = rnd(dt, Nt, C, 0, 0), du = rnd(dt, Nt, r, 0, 0), db = rnd(AM_F32, V, r, 0, 0);
    fill_targets(&tg, -1, V);
    for (int capped = 0; capped < 2; capped++) {
        float cap = capped ? 2.0f : 0.0f;
        for (int h = 0; h < 2; h++) {
            struct pair ws = hw, bs = b, dbs = db;
            size_t es = am_dtype_size(dt);
            ws.c = am_tensor_view((char *)hw.c.data + (size_t)(h * Vh * C) * es, AM_DEV_CPU, dt, Vh, C, 0, 0);
            ws.g = am_tensor_view((char *)hw.g.data + (size_t)(h * Vh * C) * es, AM_DEV_CUDA, dt, Vh, C, 0, 0);
            bs.c = am_tensor_view((char *)b.c.data + (size_t)(h * Vh * r) * es, AM_DEV_CPU, dt, Vh, r, 0, 0);
            bs.g = am_tensor_view((char *)b.g.data + (size_t)(h * Vh * r) * es, AM_DEV_CUDA, dt, Vh, r, 0, 0);
            dbs.c = am_tensor_view((float *)db.c.data + h * Vh * r, AM_DEV_CPU, AM_F32, Vh, r, 0, 0);
            dbs.g = am_tensor_view((float *)db.g.data + h * Vh * r, AM_DEV_CUDA, AM_F32, Vh, r, 0, 0);
            KC->ce_stats_lora(&cpu, &m.c, &sm.c, &t.c, &hx.c, &ws.c, &u.c, &bs.c, &tg.c, h * Vh, cap);
            KG->ce_stats_lora(&gpu, &m.g, &sm.g, &t.g, &hx.g, &ws.g, &u.g, &bs.g, &tg.g, h * Vh, cap);
            char what[96];
            snprintf(what, sizeof what, "ce_stats_lora m (shard %d, cap %g)", h, cap);
            record(what, dname(dt), rel_err(&m), bf ? 1e-2 : 1e-5);
            snprintf(what, sizeof what, "ce_stats_lora s (shard %d, cap %g)", h, cap);
            record(what, dname(dt), rel_err(&sm), bf ? 1e-2 : 1e-5);
            snprintf(what, sizeof what, "ce_stats_lora t (shard %d, cap %g)", h, cap);
            record(what, dname(dt), rel_err(&t), bf ? 1e-2 : 1e-5);
            pair_upload(&m);
            pair_upload(&sm);
            KC->ce_backward_lora(&cpu, &hdx.c, NULL, &du.c, &dbs.c, &hx.c, &ws.c, &u.c, &bs.c, &tg.c, h * Vh, &m.c,
                                 &sm.c, 0.01f, cap);
            KG->ce_backward_lora(&gpu, &hdx.g, NULL, &du.g, &dbs.g, &hx.g, &ws.g, &u.g, &bs.g, &tg.g, h * Vh, &m.g,
                                 &sm.g, 0.01f, cap);
        }
        check(capped ? "ce_backward_lora dx (cap 2)" : "ce_backward_lora dx", &hdx, bf);
        check(capped ? "ce_backward_lora du (cap 2)" : "ce_backward_lora du", &du, bf);
        check(capped ? "ce_backward_lora db (cap 2)" : "ce_backward_lora db", &db, bf);
    }
    struct pair *all[] = {&hx, &hw, &tg, &u, &b, &m, &sm, &t, &hdx, &du, &db};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        pair_free(all[i]);
}

/* Partial rotary (glm4_moe's partial_rotary_factor 0.5): tables of a head of 32 rotate the first
 * 32 of 64 dims and leave the rest. */
static void case_rope_partial(enum am_dtype dt)
{
    bool bf = dt == AM_BF16;
    int64_t B = 2, T = 40, H = 3, D = 64, R = 32;
    struct pair tc = pair_new(AM_F32, T, R / 2, 0, 0), ts = pair_new(AM_F32, T, R / 2, 0, 0);
    KC->rope_tables(&cpu, &tc.c, &ts.c, 10000.0, NULL);
    KG->rope_tables(&gpu, &tc.g, &ts.g, 10000.0, NULL);
    struct pair x = rnd(dt, B, T, H, D);
    KC->rope_forward(&cpu, &x.c, &tc.c, &ts.c);
    KG->rope_forward(&gpu, &x.g, &tc.g, &ts.g);
    check("rope_forward (partial rotary)", &x, bf);
    KC->rope_backward(&cpu, &x.c, &tc.c, &ts.c);
    KG->rope_backward(&gpu, &x.g, &tc.g, &ts.g);
    check("rope_backward (partial rotary)", &x, bf);
    pair_free(&tc);
    pair_free(&ts);
    pair_free(&x);
}

/* gpt-oss: the attention sinks on an attention's out and lse (forward in place, the sinks'
 * gradient), the clamped SwiGLU with inputs beyond the clamps, and yarn's tables (the CPU's,
 * uploaded: bitwise). */
static void case_gpt_oss(enum am_dtype dt)
{
    bool bf = dt == AM_BF16;
    int64_t B = 2, T = 50, H = 6, D = 64, N = 200, I = 300;
    struct pair out = rnd(dt, B, T, H, D), lse = pair_new(AM_F32, B, H, T, 0), sinks = pair_new(dt, H, 0, 0, 0);
    struct pair dout = rnd(dt, B, T, H, D), ds = rnd(AM_F32, H, 0, 0, 0);
    pair_fill(&lse, -2, 4);
    pair_fill(&sinks, -3, 3);
    KC->attention_sink_forward(&cpu, &out.c, &lse.c, &sinks.c);
    KG->attention_sink_forward(&gpu, &out.g, &lse.g, &sinks.g);
    check("attention_sink_forward out", &out, bf);
    record("attention_sink_forward lse", dname(dt), rel_err(&lse), 1e-6);
    KC->attention_sink_backward(&cpu, &ds.c, &dout.c, &out.c, &lse.c, &sinks.c);
    KG->attention_sink_backward(&gpu, &ds.g, &dout.g, &out.g, &lse.g, &sinks.g);
    record("attention_sink_backward dsinks", dname(dt), rel_err(&ds), 1e-5);
    struct pair g = pair_new(dt, N, I, 0, 0), u = pair_new(dt, N, I, 0, 0), o = pair_new(dt, N, I, 0, 0);
    struct pair d = rnd(dt, N, I, 0, 0), dg = rnd(dt, N, I, 0, 0), du = rnd(dt, N, I, 0, 0);
    pair_fill(&g, -10, 10);
    pair_fill(&u, -10, 10);
    KC->swiglu_clamped_forward(&cpu, &o.c, &g.c, &u.c, 1.702f, 7.0f);
    KG->swiglu_clamped_forward(&gpu, &o.g, &g.g, &u.g, 1.702f, 7.0f);
    check("swiglu_clamped_forward", &o, bf);
    KC->swiglu_clamped_backward(&cpu, &dg.c, &du.c, &d.c, &g.c, &u.c, 1.702f, 7.0f);
    KG->swiglu_clamped_backward(&gpu, &dg.g, &du.g, &d.g, &g.g, &u.g, 1.702f, 7.0f);
    check("swiglu_clamped_backward dgate", &dg, bf);
    check("swiglu_clamped_backward dup", &du, bf);
    if (!bf) {
        struct am_rope_scaling y = {.type = "yarn", .factor = 32.0, .original_max_position_embeddings = 4096,
                                    .beta_fast = 32.0, .beta_slow = 1.0, .no_truncate = true};
        struct pair tc = pair_new(AM_F32, T, D / 2, 0, 0), ts = pair_new(AM_F32, T, D / 2, 0, 0);
        KC->rope_tables(&cpu, &tc.c, &ts.c, 150000.0, &y);
        KG->rope_tables(&gpu, &tc.g, &ts.g, 150000.0, &y);
        record("rope_tables yarn cos (bitwise)", "fp32", rel_err(&tc), 0);
        record("rope_tables yarn sin (bitwise)", "fp32", rel_err(&ts), 0);
        pair_free(&tc);
        pair_free(&ts);
    }
    struct pair *all[] = {&out, &lse, &sinks, &dout, &ds, &g, &u, &o, &d, &dg, &du};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        pair_free(all[i]);
}

/* DeepSeekMoE's router (glm4_moe) on both devices: 16 experts in 4 groups, 2 kept, top 3, a
 * selection bias; the choice exactly, the scores and weights, the backward with and without
 * the renormalisation. */
static void case_moe_sigmoid(enum am_dtype dt)
{
    bool bf = dt == AM_BF16;
    int64_t N = 150, E = 16, k = 3;
    struct pair lg = pair_new(dt, N, E, 0, 0), probs = pair_new(AM_F32, N, E, 0, 0), bias = pair_new(AM_F32, E, 0, 0, 0);
    struct pair idx = pair_new(AM_I32, N, k, 0, 0), wts = pair_new(AM_F32, N, k, 0, 0);
    pair_fill(&lg, -3, 3);
    pair_fill(&bias, -0.1, 0.1);
    KC->moe_route_sigmoid_forward(&cpu, &probs.c, &idx.c, &wts.c, &lg.c, &bias.c, 4, 2, true, 2.5f);
    KG->moe_route_sigmoid_forward(&gpu, &probs.g, &idx.g, &wts.g, &lg.g, &bias.g, 4, 2, true, 2.5f);
    check("moe_route_sigmoid_forward probs", &probs, false);
    record("moe_route_sigmoid_forward idx", bf ? "bf16" : "fp32", rel_err(&idx), 0);
    check("moe_route_sigmoid_forward wts", &wts, false);
    KG->upload(&gpu, idx.g.data, idx.c.data, am_tensor_bytes(&idx.c)); /* the same choice from here on */
    pair_upload(&probs);
    struct pair dl = rnd(dt, N, E, 0, 0), dwts = rnd(AM_F32, N, k, 0, 0);
    KC->moe_route_sigmoid_backward(&cpu, &dl.c, &dwts.c, &probs.c, &idx.c, NULL, 0.0f, true, 2.5f);
    KG->moe_route_sigmoid_backward(&gpu, &dl.g, &dwts.g, &probs.g, &idx.g, NULL, 0.0f, true, 2.5f);
    check("moe_route_sigmoid_backward dlogits", &dl, bf);
    KC->moe_route_sigmoid_backward(&cpu, &dl.c, &dwts.c, &probs.c, &idx.c, NULL, 0.0f, false, 1.0f);
    KG->moe_route_sigmoid_backward(&gpu, &dl.g, &dwts.g, &probs.g, &idx.g, NULL, 0.0f, false, 1.0f);
    check("moe_route_sigmoid_backward (no renorm)", &dl, bf);
    /* AutoModel's load-balancing loss: the normalised scores' sums, and their gradient */
    struct pair cnt = pair_new(AM_F32, E, 0, 0, 0), psum = pair_new(AM_F32, E, 0, 0, 0);
    KC->moe_aux_stats(&cpu, &cnt.c, &psum.c, &probs.c, &idx.c, true);
    KG->moe_aux_stats(&gpu, &cnt.g, &psum.g, &probs.g, &idx.g, true);
    record("moe_aux_stats cnt (normalised scores)", "fp32", rel_err(&cnt), 0);
    check("moe_aux_stats psum (normalised scores)", &psum, false);
    pair_upload(&cnt);
    KC->moe_route_sigmoid_backward(&cpu, &dl.c, &dwts.c, &probs.c, &idx.c, &cnt.c, 0.01f, true, 2.5f);
    KG->moe_route_sigmoid_backward(&gpu, &dl.g, &dwts.g, &probs.g, &idx.g, &cnt.g, 0.01f, true, 2.5f);
    check("moe_route_sigmoid_backward (AutoModel's aux)", &dl, bf);
    KC->moe_route_sigmoid_backward(&cpu, &dl.c, &dwts.c, &probs.c, &idx.c, &cnt.c, 0.01f, false, 1.0f);
    KG->moe_route_sigmoid_backward(&gpu, &dl.g, &dwts.g, &probs.g, &idx.g, &cnt.g, 0.01f, false, 1.0f);
    check("moe_route_sigmoid_backward (AutoModel's aux, no renorm)", &dl, bf);
    struct pair *all[] = {&lg, &probs, &bias, &idx, &wts, &dl, &dwts, &cnt, &psum};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        pair_free(all[i]);
}

/* The mixture of experts' kernels on both devices from the same inputs: the router (probs,
 * weights, the choice itself exactly), the plan (exactly: a stable sort), the permutation
 * (exactly), the grouped GEMMs, the combination and every backward, and the aux statistics.
 * Rows of the logits are drawn from [-3, 3) so that ties are unlikely; E = 8, k = 2, an
 * expert no token chooses (its rows are 0 in the grouped GEMMs). */
static void case_moe(enum am_dtype dt)
{
    bool bf = dt == AM_BF16;
    int64_t N = 150, E = 8, k = 2, S = N * k, C = 96, I = 72;
    struct pair lg = pair_new(dt, N, E, 0, 0), probs = pair_new(AM_F32, N, E, 0, 0);
    struct pair idx = pair_new(AM_I32, N, k, 0, 0), wts = pair_new(AM_F32, N, k, 0, 0);
    pair_fill(&lg, -3, 3);
    for (int64_t i = 0; i < N; i++) /* expert 5 is never chosen */
        for (int64_t e = 5; e < 6; e++) {
            if (dt == AM_F32)
                ((float *)lg.c.data)[i * E + e] = -50.0f;
            else
                ((uint16_t *)lg.c.data)[i * E + e] = am_f32_to_bf16(-50.0f);
        }
    pair_upload(&lg);
    KC->moe_route_forward(&cpu, &probs.c, &idx.c, &wts.c, &lg.c, true);
    KG->moe_route_forward(&gpu, &probs.g, &idx.g, &wts.g, &lg.g, true);
    check("moe_route_forward probs", &probs, false);
    record("moe_route_forward idx", bf ? "bf16" : "fp32", rel_err(&idx), 0);
    check("moe_route_forward wts", &wts, false);
    KG->upload(&gpu, idx.g.data, idx.c.data, am_tensor_bytes(&idx.c)); /* the same choice from here on */
    struct pair pos = pair_new(AM_I32, N, k, 0, 0), counts = pair_new(AM_I32, E, 0, 0, 0);
    KC->moe_plan(&cpu, &pos.c, &counts.c, &idx.c);
    KG->moe_plan(&gpu, &pos.g, &counts.g, &idx.g);
    record("moe_plan pos", "i32", rel_err(&pos), 0);
    record("moe_plan counts", "i32", rel_err(&counts), 0);
    int64_t hc[8];
    for (int64_t e = 0; e < E; e++)
        hc[e] = ((int32_t *)counts.c.data)[e];
    struct pair x = rnd(dt, N, C, 0, 0), xp = pair_new(dt, S, C, 0, 0), w1 = rnd(dt, E, I, C, 0);
    struct pair h = pair_new(dt, S, I, 0, 0), w2 = rnd(dt, E, C, I, 0), yp = pair_new(dt, S, C, 0, 0);
    struct pair y = pair_new(dt, N, C, 0, 0);
    KC->moe_permute_forward(&cpu, &xp.c, &x.c, &pos.c);
    KG->moe_permute_forward(&gpu, &xp.g, &x.g, &pos.g);
    record("moe_permute_forward", bf ? "bf16" : "fp32", rel_err(&xp), 0);
    KC->grouped_matmul_forward(&cpu, &h.c, &xp.c, &w1.c, hc);
    KG->grouped_matmul_forward(&gpu, &h.g, &xp.g, &w1.g, hc);
    check("grouped_matmul_forward (x w1)", &h, bf);
    pair_upload(&h);
    KC->grouped_matmul_forward(&cpu, &yp.c, &h.c, &w2.c, hc);
    KG->grouped_matmul_forward(&gpu, &yp.g, &h.g, &w2.g, hc);
    check("grouped_matmul_forward (h w2)", &yp, bf);
    pair_upload(&yp);
    KC->moe_combine_forward(&cpu, &y.c, &yp.c, &pos.c, &wts.c);
    KG->moe_combine_forward(&gpu, &y.g, &yp.g, &pos.g, &wts.g);
    check("moe_combine_forward", &y, bf);
    KG->upload(&gpu, wts.g.data, wts.c.data, am_tensor_bytes(&wts.c));
    struct pair dy = rnd(dt, N, C, 0, 0), dyp = rnd(dt, S, C, 0, 0), dwts = rnd(AM_F32, N, k, 0, 0);
    KC->moe_combine_backward(&cpu, &dyp.c, &dwts.c, &dy.c, &yp.c, &pos.c, &wts.c);
    KG->moe_combine_backward(&gpu, &dyp.g, &dwts.g, &dy.g, &yp.g, &pos.g, &wts.g);
    check("moe_combine_backward dyp", &dyp, bf);
    check("moe_combine_backward dwts", &dwts, bf);
    pair_upload(&dyp);
    struct pair dh = rnd(dt, S, I, 0, 0), dw2 = rnd(AM_F32, E, C, I, 0);
    KC->grouped_matmul_backward(&cpu, &dh.c, &dw2.c, &dyp.c, &h.c, &w2.c, hc);
    KG->grouped_matmul_backward(&gpu, &dh.g, &dw2.g, &dyp.g, &h.g, &w2.g, hc);
    check("grouped_matmul_backward dx", &dh, bf);
    check("grouped_matmul_backward dw (fp32)", &dw2, bf);
    struct pair dxp = rnd(dt, S, C, 0, 0), dx = rnd(dt, N, C, 0, 0);
    KC->moe_permute_backward(&cpu, &dx.c, &dxp.c, &pos.c);
    KG->moe_permute_backward(&gpu, &dx.g, &dxp.g, &pos.g);
    check("moe_permute_backward", &dx, bf);
    pair_upload(&probs);
    struct pair dl = rnd(dt, N, E, 0, 0), cnt = pair_new(AM_F32, E, 0, 0, 0), psum = pair_new(AM_F32, E, 0, 0, 0);
    KC->moe_aux_stats(&cpu, &cnt.c, &psum.c, &probs.c, &idx.c, false);
    KG->moe_aux_stats(&gpu, &cnt.g, &psum.g, &probs.g, &idx.g, false);
    record("moe_aux_stats cnt", "fp32", rel_err(&cnt), 0);
    check("moe_aux_stats psum", &psum, false);
    pair_upload(&cnt);
    pair_upload(&dwts);
    KC->moe_route_backward(&cpu, &dl.c, &dwts.c, &probs.c, &idx.c, &cnt.c, 0.01f, true);
    KG->moe_route_backward(&gpu, &dl.g, &dwts.g, &probs.g, &idx.g, &cnt.g, 0.01f, true);
    check("moe_route_backward dlogits", &dl, bf);
    KC->moe_route_backward(&cpu, &dl.c, &dwts.c, &probs.c, &idx.c, NULL, 0.0f, false);
    KG->moe_route_backward(&gpu, &dl.g, &dwts.g, &probs.g, &idx.g, NULL, 0.0f, false);
    check("moe_route_backward (no renorm, no aux)", &dl, bf);
    struct pair acc = pair_new(AM_F64, 1, 0, 0, 0);
    KC->moe_aux_loss(&cpu, &acc.c, &cnt.c, &psum.c, 0.5);
    pair_upload(&psum);
    KG->zero(&gpu, &acc.g);
    KG->moe_aux_loss(&gpu, &acc.g, &cnt.g, &psum.g, 0.5);
    check("moe_aux_loss", &acc, false);
    struct pair *all[] = {&lg, &probs, &idx, &wts, &pos, &counts, &x, &xp, &w1, &h, &w2, &yp, &y, &dy, &dyp,
                          &dwts, &dh, &dw2, &dxp, &dx, &dl, &cnt, &psum, &acc};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        pair_free(all[i]);
}

/* Attention by blocks (context parallelism's ring): one rank's queries (two chunks of 12 rows
 * of a 48-token sequence split over 2 ranks) against its own keys and then the other rank's,
 * merged, and the backward of both blocks, with and without a window, and packed (documents
 * of 7 rows for the first sequence, 11 for the second: qstart): each output as the CPU's.
 * dt: q, k, v, dout (and the backward's out) f32 or bf16; the running out stays f32 (ring.c's
 * accumulator), gdt: dq, dk, dv f32 (the ring's sums) or bf16 (packed sequences without cp:
 * rounded once per call); with bf16 also one block written into a bf16 out. scale, cap > 0:
 * Gemma's (attention_block_softcap_*), else the plain entries. */
static void blk_fwd(const struct am_kernels *K, const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                    const struct am_tensor *qp, const struct am_tensor *kp, const struct am_tensor *qs, int64_t W,
                    int acc, float scale, float cap)
{
    if (scale > 0 || cap > 0)
        K->attention_block_softcap_forward(d, out, lse, q, k, v, qp, kp, qs, W, acc, scale, cap);
    else
        K->attention_block_forward(d, out, lse, q, k, v, qp, kp, qs, W, acc);
}

static void blk_bwd(const struct am_kernels *K, const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                    struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                    const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                    const struct am_tensor *v, const struct am_tensor *qp, const struct am_tensor *kp,
                    const struct am_tensor *qs, int64_t W, float scale, float cap)
{
    if (scale > 0 || cap > 0)
        K->attention_block_softcap_backward(d, dq, dk, dv, dout, out, lse, q, k, v, qp, kp, qs, W, scale, cap);
    else
        K->attention_block_backward(d, dq, dk, dv, dout, out, lse, q, k, v, qp, kp, qs, W);
}

static void case_attention_block(enum am_dtype dt, enum am_dtype gdt, int64_t W, bool packed, float scale, float cap)
{
    int64_t B = 2, T = 24, H = 8, KVH = 2, D = 64, c = T / 2;
    bool bf = dt == AM_BF16;
    struct pair q = rnd(dt, B, T, H, D), out = pair_new(AM_F32, B, T, H, D), lse = pair_new(AM_F32, B, H, T, 0);
    struct pair kv[2][2], pos[2];
    for (int r = 0; r < 2; r++) {
        kv[r][0] = rnd(dt, B, T, KVH, D);
        kv[r][1] = rnd(dt, B, T, KVH, D);
        pos[r] = pair_new(AM_I32, T, 0, 0, 0);
        for (int64_t i = 0; i < c; i++) { /* a sequence of 48 in 4 chunks of 12: rank r holds r and 3 - r */
            ((int32_t *)pos[r].c.data)[i] = (int32_t)(r * c + i);
            ((int32_t *)pos[r].c.data)[c + i] = (int32_t)((3 - r) * c + i);
        }
        pair_upload(&pos[r]);
    }
    struct pair st0 = pair_new(AM_I32, B * T, 0, 0, 0); /* rank 0's rows' document starts */
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < T; i++) {
            int32_t p = ((int32_t *)pos[0].c.data)[i], len = b ? 11 : 7;
            ((int32_t *)st0.c.data)[b * T + i] = p / len * len;
        }
    pair_upload(&st0);
    const struct am_tensor *qs_c = packed ? &st0.c : NULL, *qs_g = packed ? &st0.g : NULL;
    pair_fill(&q, -2, 2);
    for (int st = 0; st < 2; st++) {
        blk_fwd(KC, &cpu, &out.c, &lse.c, &q.c, &kv[st][0].c, &kv[st][1].c, &pos[0].c, &pos[st].c, qs_c, W, st > 0,
                scale, cap);
        blk_fwd(KG, &gpu, &out.g, &lse.g, &q.g, &kv[st][0].g, &kv[st][1].g, &pos[0].g, &pos[st].g, qs_g, W, st > 0,
                scale, cap);
    }
    char what[96], tag[40];
    snprintf(tag, sizeof tag, "W%lld%s%s%s", (long long)W, packed ? " packed" : "",
             bf ? (gdt == AM_BF16 ? " (bf16 in, bf16 grads)" : " (bf16 in, f32 sums)") : "",
             scale > 0 || cap > 0 ? " gemma" : "");
    snprintf(what, sizeof what, "attention_block out (2 blocks, f32) %s", tag);
    check(what, &out, false); /* f32 from the same widened inputs: fp32's tolerance */
    snprintf(what, sizeof what, "attention_block lse (2 blocks) %s", tag);
    record(what, "fp32", rel_err(&lse), 1e-5);
    pair_upload(&out);
    pair_upload(&lse);
    struct pair o16 = pair_new(dt, B, T, H, D); /* the backward's out: the forward's, in q's dtype */
    KC->convert(&cpu, &o16.c, &out.c);
    pair_upload(&o16);
    if (bf) { /* one block into a bf16 out (no merge: rounded once); then the merged lse again */
        struct pair ob = pair_new(AM_BF16, B, T, H, D), lb = pair_new(AM_F32, B, H, T, 0);
        blk_fwd(KC, &cpu, &ob.c, &lb.c, &q.c, &kv[0][0].c, &kv[0][1].c, &pos[0].c, &pos[0].c, qs_c, W, 0, scale, cap);
        blk_fwd(KG, &gpu, &ob.g, &lb.g, &q.g, &kv[0][0].g, &kv[0][1].g, &pos[0].g, &pos[0].g, qs_g, W, 0, scale, cap);
        snprintf(what, sizeof what, "attention_block out (1 block, bf16) %s", tag);
        check(what, &ob, true);
        pair_free(&ob);
        pair_free(&lb);
    }
    struct pair dout = rnd(dt, B, T, H, D), dq = rnd(gdt, B, T, H, D), dk[2], dv[2];
    for (int st = 0; st < 2; st++) {
        dk[st] = rnd(gdt, B, T, KVH, D);
        dv[st] = rnd(gdt, B, T, KVH, D);
        blk_bwd(KC, &cpu, &dq.c, &dk[st].c, &dv[st].c, &dout.c, &o16.c, &lse.c, &q.c, &kv[st][0].c, &kv[st][1].c,
                &pos[0].c, &pos[st].c, qs_c, W, scale, cap);
        blk_bwd(KG, &gpu, &dq.g, &dk[st].g, &dv[st].g, &dout.g, &o16.g, &lse.g, &q.g, &kv[st][0].g, &kv[st][1].g,
                &pos[0].g, &pos[st].g, qs_g, W, scale, cap);
        snprintf(what, sizeof what, "attention_block dk (block %d) %s", st, tag);
        check(what, &dk[st], gdt == AM_BF16);
        snprintf(what, sizeof what, "attention_block dv (block %d) %s", st, tag);
        check(what, &dv[st], gdt == AM_BF16);
    }
    snprintf(what, sizeof what, "attention_block dq (2 blocks) %s", tag);
    check(what, &dq, gdt == AM_BF16);
    struct pair *all[] = {&q, &out, &lse, &kv[0][0], &kv[0][1], &kv[1][0], &kv[1][1], &pos[0], &pos[1], &dout, &dq,
                          &dk[0], &dk[1], &dv[0], &dv[1], &st0, &o16};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        pair_free(all[i]);
}

/* Attention, forward and backward, on one path: AM_ATTN=own (the backend's kernels) or
 * cudnn (cuDNN's fused attention, which must then have run the case, or with T = 1, which
 * cuDNN lacks, must have left it to the backend's kernels: a row says which ran). The
 * backward gets the CPU's out and lse (the same bytes on both devices), so that its rows
 * measure the backward alone. q is drawn from [-2, 2) for a softmax with some peaks. lse
 * is an fp32 statistic: 1e-5 on the backend's kernels, 1e-4 on cuDNN's (its exponentials
 * are the hardware's approximate exp2). The own path's backward runs twice from the same
 * gradients: the two results must be the same bits (no atomics). */
static void case_attention(const char *path, enum am_dtype dt, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                           int64_t W)
{
    bool bf = dt == AM_BF16, cudnn = strcmp(path, "cudnn") == 0, on_cuda = gpu.device == AM_DEV_CUDA;
    char what[96], shape[48];
    snprintf(shape, sizeof shape, "%s B%lld T%lld H%lld/%lld D%lld W%lld", path, (long long)B, (long long)T, (long long)H,
             (long long)KVH, (long long)D, (long long)W);
    begin("attention %s %s", shape, dname(dt));
    setenv("AM_ATTN", path, 1);
    struct pair q = pair_new(dt, B, T, H, D), k = rnd(dt, B, T, KVH, D), v = rnd(dt, B, T, KVH, D);
    struct pair out = pair_new(dt, B, T, H, D), lse = pair_new(AM_F32, B, H, T, 0), dout = rnd(dt, B, T, H, D);
    /* the gradients from zero: the rows compare what the backward computes (gpu_check's header) */
    struct pair dq = pair_new(dt, B, T, H, D), dk = pair_new(dt, B, T, KVH, D), dv = pair_new(dt, B, T, KVH, D);
    pair_fill(&q, -2, 2);
    unsigned long long own0 = 0, cudnn0 = 0, own1 = 0, cudnn1 = 0;
    if (on_cuda)
        am_cuda_attention_calls(&own0, &cudnn0);
    KC->attention_forward(&cpu, &out.c, &lse.c, &q.c, &k.c, &v.c, W);
    KG->attention_forward(&gpu, &out.g, &lse.g, &q.g, &k.g, &v.g, W);
    snprintf(what, sizeof what, "attn %s out", shape);
    check(what, &out, bf);
    snprintf(what, sizeof what, "attn %s lse", shape);
    record(what, dname(dt), rel_err(&lse), cudnn ? 1e-4 : 1e-5);
    pair_upload(&out);
    pair_upload(&lse);
    size_t gq = am_tensor_bytes(&dq.c), gk = am_tensor_bytes(&dk.c);
    void *h0 = malloc(gq + 2 * gk), *h1 = malloc(gq + 2 * gk);
    if (!h0 || !h1) {
        fprintf(stderr, "gpu_check: out of host memory\n");
        exit(1);
    }
    memcpy(h0, dq.c.data, gq);
    memcpy((char *)h0 + gq, dk.c.data, gk);
    memcpy((char *)h0 + gq + gk, dv.c.data, gk);
    KC->attention_backward(&cpu, &dq.c, &dk.c, &dv.c, &dout.c, &out.c, &lse.c, &q.c, &k.c, &v.c, W);
    KG->attention_backward(&gpu, &dq.g, &dk.g, &dv.g, &dout.g, &out.g, &lse.g, &q.g, &k.g, &v.g, W);
    snprintf(what, sizeof what, "attn %s dq", shape);
    check_attn_grad(what, &dq, bf);
    snprintf(what, sizeof what, "attn %s dk", shape);
    check_attn_grad(what, &dk, bf);
    snprintf(what, sizeof what, "attn %s dv", shape);
    check_attn_grad(what, &dv, bf);
    if (on_cuda)
        am_cuda_attention_calls(&own1, &cudnn1);
    if (!on_cuda) {
        /* --self-test: no path to check */
    } else if (cudnn && T >= 2) {
        const char *why = am_cuda_attention_cudnn_why(&gpu);
        if (cudnn1 - cudnn0 != 2)
            printf("     cuDNN did not run it: %s\n", why ? why : "(no reason recorded)");
        snprintf(what, sizeof what, "attn %s ran on cuDNN", shape);
        record(what, dname(dt), cudnn1 - cudnn0 == 2 ? 0 : 1, 0);
    } else if (cudnn) { /* cuDNN has no backward for T = 1: both directions fall back */
        snprintf(what, sizeof what, "attn %s fell back to own", shape);
        record(what, dname(dt), own1 - own0 == 2 && cudnn1 == cudnn0 ? 0 : 1, 0);
    } else {
        /* the same backward again from the same gradients: the same bits */
        KG->download(&gpu, h1, dq.g.data, gq);
        KG->download(&gpu, (char *)h1 + gq, dk.g.data, gk);
        KG->download(&gpu, (char *)h1 + gq + gk, dv.g.data, gk);
        KG->upload(&gpu, dq.g.data, h0, gq);
        KG->upload(&gpu, dk.g.data, (char *)h0 + gq, gk);
        KG->upload(&gpu, dv.g.data, (char *)h0 + gq + gk, gk);
        KG->attention_backward(&gpu, &dq.g, &dk.g, &dv.g, &dout.g, &out.g, &lse.g, &q.g, &k.g, &v.g, W);
        KG->download(&gpu, h0, dq.g.data, gq);
        KG->download(&gpu, (char *)h0 + gq, dk.g.data, gk);
        KG->download(&gpu, (char *)h0 + gq + gk, dv.g.data, gk);
        snprintf(what, sizeof what, "attn %s bwd twice: same bits", shape);
        record(what, dname(dt), memcmp(h0, h1, gq + 2 * gk) == 0 ? 0 : 1, 0);
        am_cuda_attention_calls(&own1, &cudnn1);
        snprintf(what, sizeof what, "attn %s ran on own kernels", shape);
        record(what, dname(dt), own1 - own0 == 3 && cudnn1 == cudnn0 ? 0 : 1, 0);
    }
    /* once more onto the first result, on both devices: the backward accumulates (a path that
     * wrote its result instead would be off by half) */
    KC->attention_backward(&cpu, &dq.c, &dk.c, &dv.c, &dout.c, &out.c, &lse.c, &q.c, &k.c, &v.c, W);
    KG->attention_backward(&gpu, &dq.g, &dk.g, &dv.g, &dout.g, &out.g, &lse.g, &q.g, &k.g, &v.g, W);
    snprintf(what, sizeof what, "attn %s dq accumulated", shape);
    check_attn_grad(what, &dq, bf);
    snprintf(what, sizeof what, "attn %s dk accumulated", shape);
    check_attn_grad(what, &dk, bf);
    snprintf(what, sizeof what, "attn %s dv accumulated", shape);
    check_attn_grad(what, &dv, bf);
    free(h0);
    free(h1);
    unsetenv("AM_ATTN");
    pair_free(&q);
    pair_free(&k);
    pair_free(&v);
    pair_free(&out);
    pair_free(&lse);
    pair_free(&dout);
    pair_free(&dq);
    pair_free(&dk);
    pair_free(&dv);
}

/* fp32 parameters, or bf16 ones (bf16 moments, fp32 gradients: the CUDA kernel computes the
 * CPU's ops in the CPU's order, so the bf16 rows want every bit; some gradients small enough
 * for eps to matter) */
static void case_adamw(float beta1, enum am_dtype pdt)
{
    int64_t n = 10007;
    bool bf16 = pdt == AM_BF16;
    struct pair p = rnd(pdt, n, 0, 0, 0), m = pair_new(pdt, n, 0, 0, 0), v = pair_new(pdt, n, 0, 0, 0);
    struct pair g = pair_new(AM_F32, n, 0, 0, 0);
    for (int64_t step = 1; step <= 3; step++) {
        pair_fill(&g, -1, 1);
        if (bf16) {
            for (int64_t i = 0; i < n; i += 7)
                ((float *)g.c.data)[i] *= 1e-6f;
            pair_upload(&g);
        }
        KC->adamw(&cpu, &p.c, &g.c, &m.c, &v.c, 1e-3f, beta1, 0.95f, 1e-8f, 0.1f, step);
        KG->adamw(&gpu, &p.g, &g.g, &m.g, &v.g, 1e-3f, beta1, 0.95f, 1e-8f, 0.1f, step);
    }
    char what[64];
    if (bf16) {
        snprintf(what, sizeof what, "adamw param, 3 steps (beta1 %.1f, bitwise)", beta1);
        record(what, "bf16", rel_err(&p), 0);
        record("adamw m (bitwise)", "bf16", rel_err(&m), 0);
        record("adamw v (bitwise)", "bf16", rel_err(&v), 0);
    } else {
        snprintf(what, sizeof what, "adamw param, 3 steps (beta1 %.1f)", beta1);
        check(what, &p, false);
        check("adamw m", &m, false);
        check("adamw v", &v, false);
    }
    pair_free(&p);
    pair_free(&m);
    pair_free(&v);
    pair_free(&g);
}

/* ---- the head's cross-entropy (ce_*) ----
 * x [N, C], the shard w [V, C] holding ids start .. start + V - 1, targets around the shard
 * (some below, some above it) and every 7th ignored (-100). Each kernel is compared on the
 * same inputs: the loss, the rescale and the backward take the CPU's statistics on both
 * devices. Gradients start small (|.| < 0.01) so that what the kernel adds dominates their
 * norm. Shapes: N = 4100 rows are a row chunk of 4096 and 4 more on the GPU; V = 5000 is a
 * tile of 4096 and one of 904 there (and too much vocabulary for one tile: ce_fused false);
 * V = 3000 fits one tile of the 4096 rows (ce_fused true over two row chunks). */
static void fill_targets(struct pair *tg, int64_t lo, int64_t hi)
{
    pair_fill(tg, (double)lo, (double)hi);
    int64_t n = am_tensor_numel(&tg->c);
    for (int64_t i = 0; i < n; i += 7)
        ((int32_t *)tg->c.data)[i] = -100;
    pair_upload(tg);
}

/* 0 when the GPU copy of p still holds `before` (bytes), 1 otherwise */
static double changed(const struct pair *p, const void *before)
{
    size_t b = am_tensor_bytes(&p->g);
    void *h = malloc(b ? b : 1);
    KG->download(&gpu, h, p->g.data, b);
    int diff = memcmp(h, before, b) != 0;
    free(h);
    return diff;
}

static void *gpu_bytes(const struct pair *p)
{
    size_t b = am_tensor_bytes(&p->g);
    void *h = malloc(b ? b : 1);
    KG->download(&gpu, h, p->g.data, b);
    return h;
}

static void case_ce(enum am_dtype dt, enum am_dtype gdt, int64_t N, int64_t C, int64_t V, int64_t start, bool fused_fits)
{
    bool bf = dt == AM_BF16;
    const char *dn = dname(dt);
    char what[128], shape[40];
    snprintf(shape, sizeof shape, "N%lld V%lld", (long long)N, (long long)V);
    struct pair x = rnd(dt, N, C, 0, 0), w = rnd(dt, V, C, 0, 0), tg = pair_new(AM_I32, N, 0, 0, 0);
    struct pair m = pair_new(AM_F32, N, 0, 0, 0), s = pair_new(AM_F32, N, 0, 0, 0), t = pair_new(AM_F32, N, 0, 0, 0);
    struct pair Mr = pair_new(AM_F32, N, 0, 0, 0), acc = pair_new(AM_F64, 1, 0, 0, 0);
    struct pair dx = pair_new(dt, N, C, 0, 0), dw = pair_new(gdt, V, C, 0, 0);
    fill_targets(&tg, start - V / 4, start + V + V / 4);

    /* ce_stats */
    KC->ce_stats(&cpu, &m.c, &s.c, &t.c, &x.c, &w.c, &tg.c, start);
    KG->ce_stats(&gpu, &m.g, &s.g, &t.g, &x.g, &w.g, &tg.g, start);
    snprintf(what, sizeof what, "ce_stats m (%s, start %lld)", shape, (long long)start);
    check(what, &m, bf);
    snprintf(what, sizeof what, "ce_stats s (%s)", shape);
    check(what, &s, bf);
    snprintf(what, sizeof what, "ce_stats t (%s)", shape);
    check(what, &t, bf);
    pair_upload(&m); /* the CPU's statistics on both devices from here on */
    pair_upload(&s);
    pair_upload(&t);

    /* ce_loss on the CPU's statistics, from a non-zero accumulator */
    ((double *)acc.c.data)[0] = 1.5;
    pair_upload(&acc);
    KC->ce_loss(&cpu, &acc.c, &m.c, &s.c, &t.c, &tg.c);
    KG->ce_loss(&gpu, &acc.g, &m.g, &s.g, &t.g, &tg.g);
    snprintf(what, sizeof what, "ce_loss (%s)", shape);
    record(what, "fp32", rel_err(&acc), 1e-5);

    /* ce_backward with M = m, S = s (one shard): dx and dw, then dx alone */
    pair_fill(&dx, -0.01, 0.01);
    pair_fill(&dw, -0.01, 0.01);
    float scale = 1.0f / 64.0f;
    KC->ce_backward(&cpu, &dx.c, &dw.c, &x.c, &w.c, &tg.c, start, &m.c, &s.c, scale);
    KG->ce_backward(&gpu, &dx.g, &dw.g, &x.g, &w.g, &tg.g, start, &m.g, &s.g, scale);
    snprintf(what, sizeof what, "ce_backward dx (%s)", shape);
    check(what, &dx, bf);
    snprintf(what, sizeof what, "ce_backward dw (%s, %s)", shape, dname(gdt));
    check(what, &dw, bf);
    pair_fill(&dx, -0.01, 0.01);
    KC->ce_backward(&cpu, &dx.c, NULL, &x.c, &w.c, &tg.c, start, &m.c, &s.c, scale);
    KG->ce_backward(&gpu, &dx.g, NULL, &x.g, &w.g, &tg.g, start, &m.g, &s.g, scale);
    snprintf(what, sizeof what, "ce_backward dx alone (%s)", shape);
    check(what, &dx, bf);

    /* ce_rescale: s exp(m - M) with M above m by up to 2 */
    for (int64_t i = 0; i < N; i++)
        ((float *)Mr.c.data)[i] = ((float *)m.c.data)[i] + (float)urand(0.0, 2.0);
    pair_upload(&Mr);
    KC->ce_rescale(&cpu, &s.c, &m.c, &Mr.c);
    KG->ce_rescale(&gpu, &s.g, &m.g, &Mr.g);
    snprintf(what, sizeof what, "ce_rescale (%s)", shape);
    record(what, "fp32", rel_err(&s), 1e-5);

    /* ce_fused: the whole vocabulary (targets 0 .. V - 1, some beyond, every 7th ignored) */
    fill_targets(&tg, 0, V + V / 8);
    pair_fill(&dx, -0.01, 0.01);
    pair_fill(&dw, -0.01, 0.01);
    pair_fill(&m, -1, 1);
    pair_fill(&s, -1, 1);
    pair_fill(&t, -1, 1);
    if (fused_fits) {
        bool c_ok = KC->ce_fused(&cpu, &m.c, &s.c, &t.c, &dx.c, &dw.c, &x.c, &w.c, &tg.c, scale);
        bool g_ok = KG->ce_fused(&gpu, &m.g, &s.g, &t.g, &dx.g, &dw.g, &x.g, &w.g, &tg.g, scale);
        snprintf(what, sizeof what, "ce_fused returns true (%s)", shape);
        record(what, dn, c_ok && g_ok ? 0 : 1, 0);
        if (c_ok && g_ok) {
            snprintf(what, sizeof what, "ce_fused m (%s)", shape);
            check(what, &m, bf);
            snprintf(what, sizeof what, "ce_fused s (%s)", shape);
            check(what, &s, bf);
            snprintf(what, sizeof what, "ce_fused t (%s)", shape);
            check(what, &t, bf);
            snprintf(what, sizeof what, "ce_fused dx (%s)", shape);
            check(what, &dx, bf);
            snprintf(what, sizeof what, "ce_fused dw (%s, %s)", shape, dname(gdt));
            check(what, &dw, bf);
        }
    } else { /* too much vocabulary for one tile of the GPU's row chunk: false, nothing written */
        void *bm = gpu_bytes(&m), *bs = gpu_bytes(&s), *bt = gpu_bytes(&t), *bdx = gpu_bytes(&dx), *bdw = gpu_bytes(&dw);
        bool g_ok = KG->ce_fused(&gpu, &m.g, &s.g, &t.g, &dx.g, &dw.g, &x.g, &w.g, &tg.g, scale);
        double touched = changed(&m, bm) + changed(&s, bs) + changed(&t, bt) + changed(&dx, bdx) + changed(&dw, bdw);
        snprintf(what, sizeof what, "ce_fused false, nothing written (%s)", shape);
        record(what, dn, !g_ok && touched == 0 ? 0 : 1, 0);
        free(bm);
        free(bs);
        free(bt);
        free(bdx);
        free(bdw);
    }
    struct pair *all[] = {&x, &w, &tg, &m, &s, &t, &Mr, &acc, &dx, &dw};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        pair_free(all[i]);
}

/* the elements whose bits differ between the CPU's and the GPU's copy */
static int64_t bits_apart(const struct pair *p)
{
    size_t b = am_tensor_bytes(&p->c), es = am_dtype_size(p->c.dtype);
    char *h = malloc(b ? b : 1);
    KG->download(&gpu, h, p->g.data, b);
    int64_t apart = 0, n = am_tensor_numel(&p->c);
    for (int64_t i = 0; i < n; i++)
        apart += memcmp(h + i * es, (const char *)p->c.data + i * es, es) != 0;
    free(h);
    return apart;
}

/* ---- adamw_multi with Transformer Engine's FusedAdam arithmetic (am_adamw_tensor.te): 16
 * tensors, every dtype combination of param, m and v twice, with the options in turn (L2
 * decay, no bias correction, the bf16 model gradient), the bf16 parameters of the second eight
 * with their masters' remainders (store_param_remainders), beside a torch-rule tensor;
 * clipped, then not: bitwise against the CPU. */
static void case_adamw_te(void)
{
    enum { NT = 17 };
    struct pair p[NT], g[NT], m[NT], v[NT], rem[NT];
    struct am_adamw_tensor lc[NT], lg[NT];
    unsigned opts[4] = {0, AM_TE_L2, AM_TE_NO_BIAS_CORR, AM_TE_GRAD_BF16 | AM_TE_L2};
    double ss = 0;
    for (int i = 0; i < NT; i++) {
        int64_t n = i == 3 ? 40000 : 1 + (int64_t)urand(0, 3000);
        int dt = i % 8;
        bool te = i < 16;
        p[i] = rnd(te && dt & 1 ? AM_BF16 : AM_F32, n, 0, 0, 0);
        g[i] = rnd(AM_F32, n, 0, 0, 0);
        m[i] = pair_new(te && dt & 2 ? AM_BF16 : AM_F32, n, 0, 0, 0);
        v[i] = pair_new(te && dt & 4 ? AM_BF16 : AM_F32, n, 0, 0, 0);
        pair_fill(&m[i], -0.1, 0.1);
        pair_fill(&v[i], 0, 0.01);
        bool split = te && (dt & 1) && i >= 8;
        if (split) /* 16 bits of both signs: bf16 values in [-1, 1) */
            rem[i] = rnd(AM_BF16, n, 0, 0, 0);
        for (int64_t e = 0; e < n; e++)
            ss += (double)((float *)g[i].c.data)[e] * ((float *)g[i].c.data)[e];
        unsigned t = te ? AM_TE_ADAM | opts[(i / 2) % 4] : 0;
        lc[i] = (struct am_adamw_tensor){.param = &p[i].c, .m = &m[i].c, .v = &v[i].c, .grad = &g[i].c,
                                         .rem = split ? &rem[i].c : NULL, .te = t};
        lg[i] = (struct am_adamw_tensor){.param = &p[i].g, .m = &m[i].g, .v = &v[i].g, .grad = &g[i].g,
                                         .rem = split ? &rem[i].g : NULL, .te = t};
    }
    struct pair sq = pair_new(AM_F64, 1, 0, 0, 0);
    ((double *)sq.c.data)[0] = ss;
    pair_upload(&sq);
    for (int64_t step = 1; step <= 2; step++) {
        double max_norm = step == 1 ? 1.0 : 1e9;
        KC->adamw_multi(&cpu, lc, NT, &sq.c, max_norm, NULL, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step);
        KG->adamw_multi(&gpu, lg, NT, &sq.g, max_norm, NULL, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step);
    }
    double e = 0;
    for (int i = 0; i < NT; i++)
        e = fmax(e, fmax(rel_err(&p[i]), fmax(rel_err(&m[i]), rel_err(&v[i]))));
    record("adamw_multi FusedAdam param, m, v (bitwise)", "mixed", e, 0);
    int64_t apart = 0;
    for (int i = 0; i < NT; i++)
        apart += lc[i].rem ? bits_apart(&rem[i]) : 0;
    record("adamw_multi FusedAdam remainders (bits apart)", "bf16", (double)apart, 0);
    for (int i = 0; i < NT; i++) {
        if (lc[i].rem)
            pair_free(&rem[i]);
        pair_free(&p[i]);
        pair_free(&g[i]);
        pair_free(&m[i]);
        pair_free(&v[i]);
    }
    pair_free(&sq);
}

/* ---- adamw_multi: 37 tensors (two launches of at most 32), one over a block of 16384
 * elements, the clipping decided on the device from an f64 or f32 squared norm; a step with
 * a zero flag or a NaN norm leaves every tensor as it was. The CPU's adamw_multi is
 * adamw's arithmetic to the bit (tests/kernels), and so is this kernel's. With bf16, every
 * odd tensor (the one over a block among them) is a bf16 parameter with bf16 moments, the
 * list mixing both paths; the bf16 rows want every bit. */
static void case_adamw_multi(enum am_dtype ss_dtype, float beta1, bool bf16)
{
    enum { NT = 37 };
    struct pair p[NT], g[NT], m[NT], v[NT];
    struct am_adamw_tensor lc[NT], lg[NT];
    double ss = 0;
    for (int i = 0; i < NT; i++) {
        int64_t n = i == 5 ? 50001 : 1 + (int64_t)urand(0, 3000);
        enum am_dtype pdt = bf16 && i % 2 ? AM_BF16 : AM_F32;
        p[i] = rnd(pdt, n, 0, 0, 0);
        g[i] = rnd(AM_F32, n, 0, 0, 0);
        m[i] = pair_new(pdt, n, 0, 0, 0);
        v[i] = pair_new(pdt, n, 0, 0, 0);
        pair_fill(&m[i], -0.1, 0.1);
        pair_fill(&v[i], 0, 0.01);
        for (int64_t e = 0; e < n; e++)
            ss += (double)((float *)g[i].c.data)[e] * ((float *)g[i].c.data)[e];
        lc[i] = (struct am_adamw_tensor){.param = &p[i].c, .m = &m[i].c, .v = &v[i].c, .grad = &g[i].c};
        lg[i] = (struct am_adamw_tensor){.param = &p[i].g, .m = &m[i].g, .v = &v[i].g, .grad = &g[i].g};
    }
    struct pair sq = pair_new(ss_dtype, 1, 0, 0, 0), fl = pair_new(AM_I32, 1, 0, 0, 0);
    if (ss_dtype == AM_F32)
        ((float *)sq.c.data)[0] = (float)ss;
    else
        ((double *)sq.c.data)[0] = ss;
    ((int32_t *)fl.c.data)[0] = 1;
    pair_upload(&sq);
    pair_upload(&fl);
    for (int64_t step = 1; step <= 2; step++) { /* clipped to 1 (the norm is ~100), then not clipped */
        double max_norm = step == 1 ? 1.0 : 1e9;
        KC->adamw_multi(&cpu, lc, NT, &sq.c, max_norm, &fl.c, 1e-3f, beta1, 0.95f, 1e-8f, 0.1f, step);
        KG->adamw_multi(&gpu, lg, NT, &sq.g, max_norm, &fl.g, 1e-3f, beta1, 0.95f, 1e-8f, 0.1f, step);
    }
    char what[64];
    double e[2][3] = {{0}}, eg = 0; /* [fp32, bf16 tensors][param, m, v] */
    for (int i = 0; i < NT; i++) {
        int b = p[i].c.dtype == AM_BF16;
        e[b][0] = fmax(e[b][0], rel_err(&p[i]));
        e[b][1] = fmax(e[b][1], rel_err(&m[i]));
        e[b][2] = fmax(e[b][2], rel_err(&v[i]));
        eg = fmax(eg, rel_err(&g[i]));
    }
    snprintf(what, sizeof what, "adamw_multi param (%s norm, beta1 %.1f)", dname(ss_dtype), beta1);
    record(what, "fp32", e[0][0], 1e-5);
    record("adamw_multi m", "fp32", e[0][1], 1e-5);
    record("adamw_multi v", "fp32", e[0][2], 1e-5);
    if (bf16) {
        snprintf(what, sizeof what, "adamw_multi param (%s norm, beta1 %.1f, bitwise)", dname(ss_dtype), beta1);
        record(what, "bf16", e[1][0], 0);
        record("adamw_multi m (bitwise)", "bf16", e[1][1], 0);
        record("adamw_multi v (bitwise)", "bf16", e[1][2], 0);
    }
    record("adamw_multi leaves the gradients (bitwise)", "fp32", eg, 0);
    /* skipped steps: the flag 0, then a NaN norm */
    for (int k = 0; k < 2; k++) {
        int32_t f = k == 0 ? 0 : 1;
        KG->upload(&gpu, fl.g.data, &f, sizeof f);
        if (k == 1) {
            double nan64 = NAN;
            float nan32 = NAN;
            KG->upload(&gpu, sq.g.data, ss_dtype == AM_F32 ? (void *)&nan32 : (void *)&nan64, am_dtype_size(ss_dtype));
        }
        void *before[3];
        before[0] = gpu_bytes(&p[5]);
        before[1] = gpu_bytes(&m[5]);
        before[2] = gpu_bytes(&v[5]);
        KG->adamw_multi(&gpu, lg, NT, &sq.g, 1.0, &fl.g, 1e-3f, beta1, 0.95f, 1e-8f, 0.1f, 3);
        double touched = changed(&p[5], before[0]) + changed(&m[5], before[1]) + changed(&v[5], before[2]);
        record(k == 0 ? "adamw_multi skips (flag 0)" : "adamw_multi skips (NaN norm)", "fp32", touched, 0);
        for (int j = 0; j < 3; j++)
            free(before[j]);
    }
    for (int i = 0; i < NT; i++) {
        pair_free(&p[i]);
        pair_free(&g[i]);
        pair_free(&m[i]);
        pair_free(&v[i]);
    }
    pair_free(&sq);
    pair_free(&fl);
}


/* ---- --self-test: the checks themselves, on the CPU ---- */

/* The CPU's attention backward with its result off by 1 %: each gradient gets 1.01 times what
 * the backward adds (then rounded to its dtype). */
static const struct am_kernels *real_cpu;

static void off_by_one_percent(struct am_tensor *g, const void *before)
{
    int64_t n = am_tensor_numel(g);
    for (int64_t i = 0; i < n; i++) {
        double b = elem(g, before, i), a = elem(g, g->data, i), v = b + 1.01 * (a - b);
        if (g->dtype == AM_F32)
            ((float *)g->data)[i] = (float)v;
        else
            ((uint16_t *)g->data)[i] = am_f32_to_bf16((float)v);
    }
}

static void attention_backward_off(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                   struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                   const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                   const struct am_tensor *v, int64_t window)
{
    struct am_tensor *g[3] = {dq, dk, dv};
    void *before[3];
    for (int i = 0; i < 3; i++) {
        size_t b = am_tensor_bytes(g[i]);
        before[i] = malloc(b ? b : 1);
        memcpy(before[i], g[i]->data, b);
    }
    real_cpu->attention_backward(d, dq, dk, dv, dout, out, lse, q, k, v, window);
    for (int i = 0; i < 3; i++) {
        off_by_one_percent(g[i], before[i]);
        free(before[i]);
    }
}

static int self_failures;

static void expect(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void expect(bool ok, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("%-4s ", ok ? "ok" : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    self_failures += !ok;
}

/* The attention cases of main on the CPU against kernels k (as the device): returns the rows
 * that passed and failed, the gradient rows (dq, dk, dv) and the others apart. */
static void attention_rows(const struct am_kernels *k, int *grad_ok, int *grad_fail, int *other_ok, int *other_fail)
{
    char err[256];
    if (am_dev_open(&gpu, AM_DEV_CPU, -1, err, sizeof err) < 0) {
        fprintf(stderr, "gpu_check: %s\n", err);
        exit(1);
    }
    gpu.k = KG = k;
    nrows = nfail = 0;
    static const int64_t shapes[][6] = {{2, 77, 8, 2, 64, 0}, {1, 40, 3, 3, 96, 5}, {2, 33, 2, 2, 20, 0}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int64_t *c = shapes[i];
        case_attention("own", AM_F32, c[0], c[1], c[2], c[3], c[4], c[5]);
        case_attention("own", AM_BF16, c[0], c[1], c[2], c[3], c[4], c[5]);
    }
    *grad_ok = *grad_fail = *other_ok = *other_fail = 0;
    for (int i = 0; i < nrows; i++) {
        const char *w = rows[i].what;
        bool grad = strstr(w, " dq") || strstr(w, " dk") || strstr(w, " dv");
        if (grad)
            rows[i].ok ? (*grad_ok)++ : (*grad_fail)++;
        else
            rows[i].ok ? (*other_ok)++ : (*other_fail)++;
    }
    am_dev_close(&gpu);
}

/* Runs fn in a child process (CUDA untouched: the backend's checks abort before any device
 * call) and returns what it printed on stdout and stderr; *sig: the signal that ended it, 0 if
 * none. */
static void in_child(void (*fn)(void), char *msg, size_t len, int *sig)
{
    int fd[2];
    if (pipe(fd) < 0) {
        perror("gpu_check: pipe");
        exit(1);
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        perror("gpu_check: fork");
        exit(1);
    }
    if (pid == 0) {
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        close(fd[0]);
        fn();
        fflush(stdout);
        _exit(0);
    }
    close(fd[1]);
    size_t got = 0;
    ssize_t rd;
    while (got + 1 < len && (rd = read(fd[0], msg + got, len - 1 - got)) > 0)
        got += (size_t)rd;
    msg[got] = 0;
    close(fd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    *sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
}

/* A context that passes the backend's check of an open context (never used for a device call). */
static struct am_dev fake_cuda(void)
{
    static char fake[64];
    struct am_dev d;
    memset(&d, 0, sizeof d);
    d.k = am_kernels_cuda();
    d.device = AM_DEV_CUDA;
    d.stream = fake;
    d.workspace = fake;
    return d;
}

static struct am_tensor fake_tensor(enum am_dtype dt, int64_t d0, int64_t d1, int64_t d2, int64_t d3, const char *name)
{
    static _Alignas(16) char data[16];
    struct am_tensor t = am_tensor_view(data, AM_DEV_CUDA, dt, d0, d1, d2, d3);
    t.name = name;
    return t;
}

static void notes_hook(void *arg, const struct am_dev_fault *f)
{
    (void)arg;
    printf("hook: %s %s: %s\n", f->kind == AM_DEV_FAULT_NOTE ? "note" : f->kind == AM_DEV_FAULT_BUG ? "bug" : "other",
           f->where, f->message);
    fflush(stdout);
}

static void grouped_forward_short_y(void)
{
    struct am_dev d = fake_cuda();
    int64_t counts[2] = {3, 2};
    struct am_tensor x = fake_tensor(AM_F32, 5, 8, 0, 0, "x"), w = fake_tensor(AM_F32, 2, 4, 8, 0, "w");
    struct am_tensor y = fake_tensor(AM_F32, 4, 4, 0, 0, "model.layers.0.mlp.experts.h");
    d.k->grouped_matmul_forward(&d, &y, &x, &w, counts);
}

static void grouped_backward_short_dx(void)
{
    struct am_dev d = fake_cuda();
    int64_t counts[2] = {3, 2};
    struct am_tensor x = fake_tensor(AM_F32, 5, 8, 0, 0, "x"), w = fake_tensor(AM_F32, 2, 4, 8, 0, "w");
    struct am_tensor dy = fake_tensor(AM_F32, 5, 4, 0, 0, "dy"), dx = fake_tensor(AM_F32, 3, 8, 0, 0, "model.experts.dx");
    d.k->grouped_matmul_backward(&d, &dx, NULL, &dy, &x, &w, counts);
}

/* B x H = 65536 query heads' rows: more than the own kernels' grid takes */
static void attention_wide(void)
{
    am_kernels_set_fault_hook(notes_hook, NULL);
    struct am_dev d = fake_cuda();
    int64_t B = 1, T = 2, H = 65536, D = 64;
    struct am_tensor q = fake_tensor(AM_BF16, B, T, H, D, "q"), k = fake_tensor(AM_BF16, B, T, 1, D, "k");
    struct am_tensor v = fake_tensor(AM_BF16, B, T, 1, D, "v"), o = fake_tensor(AM_BF16, B, T, H, D, "out");
    struct am_tensor lse = fake_tensor(AM_F32, B, H, T, 0, "lse");
    d.k->attention_forward(&d, &o, &lse, &q, &k, &v, 0);
}

static void attention_wide_own(void)
{
    setenv("AM_ATTN", "own", 1);
    attention_wide();
}

static int self_test(void)
{
    printf("gpu_check --self-test: the checks of tests/gpu, without a GPU\n");
    /* the probe's verdict: SKIP only without an NVIDIA device */
    static const struct {
        cudaError_t e;
        int ndev;
        bool nodes;
        enum gpu_verdict want;
        const char *says;
    } verdicts[] = {
        {cudaSuccess, 1, true, GPU_RUN, "1 CUDA device"},
        {cudaSuccess, 2, false, GPU_RUN, "2 CUDA devices"},
        {cudaSuccess, 0, true, GPU_SKIP, "0 devices"},
        {cudaErrorNoDevice, 0, true, GPU_SKIP, "cudaErrorNoDevice"},
        {cudaErrorInsufficientDriver, 0, false, GPU_SKIP, "no /dev/nvidia[0-9]* device node"},
        {cudaErrorInsufficientDriver, 0, true, GPU_FAIL,
         "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version (driver 12.2, runtime "
         "13.0: install a driver for CUDA 13.0 or later"},
        {cudaErrorInitializationError, 0, true, GPU_FAIL, "cudaGetDeviceCount: cudaErrorInitializationError"},
        {cudaErrorSystemDriverMismatch, 0, true, GPU_FAIL, "cudaErrorSystemDriverMismatch"},
        {cudaErrorDevicesUnavailable, 0, true, GPU_FAIL, "cudaErrorDevicesUnavailable"},
    };
    for (size_t i = 0; i < sizeof verdicts / sizeof verdicts[0]; i++) {
        char why[512];
        enum gpu_verdict v = gpu_verdict(verdicts[i].e, verdicts[i].ndev, verdicts[i].nodes, 12020, 13000, why, sizeof why);
        expect(v == verdicts[i].want && strstr(why, verdicts[i].says),
               "probe: %s, %d devices, %s device node: %s (%s)", cudaGetErrorName(verdicts[i].e), verdicts[i].ndev,
               verdicts[i].nodes ? "a" : "no", v == GPU_RUN ? "run" : v == GPU_SKIP ? "SKIP" : "FAIL", why);
    }

    /* the attention's rows: the CPU against itself passes; against its backward off by 1 %,
     * every gradient row fails and nothing else does */
    char err[256];
    if (am_dev_open(&cpu, AM_DEV_CPU, -1, err, sizeof err) < 0) {
        fprintf(stderr, "gpu_check: %s\n", err);
        return 1;
    }
    KC = real_cpu = cpu.k;
    rng_state = 0x9E3779B97F4A7C15ull;
    int go, gf, oo, of;
    attention_rows(real_cpu, &go, &gf, &oo, &of);
    expect(gf == 0 && of == 0 && go > 0, "attention, CPU against CPU: %d gradient rows and %d others pass, %d and %d fail",
           go, oo, gf, of);
    struct am_kernels off = *real_cpu;
    off.attention_backward = attention_backward_off;
    attention_rows(&off, &go, &gf, &oo, &of);
    expect(go == 0 && gf > 0 && of == 0,
           "attention, CPU against its backward off by 1 %%: %d gradient rows fail (%d pass), the %d others pass (%d fail)",
           gf, go, oo, of);
    am_dev_close(&cpu);

    /* the CUDA backend's checks that abort before the device is touched */
    static const struct {
        void (*fn)(void);
        const char *what;
        const char *says[3];
    } aborts[] = {
        {grouped_forward_short_y, "grouped_matmul_forward with a y of 4 rows for counts 3 + 2",
         {"am_cuda_grouped_matmul_forward", "y (model.layers.0.mlp.experts.h) has 4 rows; the experts' counts add up to 5",
          NULL}},
        {grouped_backward_short_dx, "grouped_matmul_backward with a dx of 3 rows for counts 3 + 2",
         {"am_cuda_grouped_matmul_backward", "dx (model.experts.dx) has 3 rows; the experts' counts add up to 5", NULL}},
        {attention_wide_own, "attention_forward, AM_ATTN=own, B x H = 65536",
         {"am_cuda_attention_forward", "B x H = 65536 (at most 65535)", "the backend's own attention kernels"}},
    };
    for (size_t i = 0; i < sizeof aborts / sizeof aborts[0]; i++) {
        char msg[4096];
        int sig = 0;
        in_child(aborts[i].fn, msg, sizeof msg, &sig);
        bool ok = sig == SIGABRT;
        for (int j = 0; j < 3 && aborts[i].says[j]; j++)
            ok &= strstr(msg, aborts[i].says[j]) != NULL;
        expect(ok, "%s: aborts naming it (signal %d): %s", aborts[i].what, sig, msg);
    }
    if (am_cuda_attention_has_cudnn() && !gpu_nodes()) {
        /* with cuDNN (AM_ATTN unset) the call goes to cuDNN first, and the limit is checked only
         * once cuDNN has declined it (here: no device for cuDNN's handle, a note; on a GPU
         * machine cuDNN would take the fake context: not run there) */
        char msg[4096];
        int sig = 0;
        unsetenv("AM_ATTN");
        in_child(attention_wide, msg, sizeof msg, &sig);
        char *note = strstr(msg, "hook: note"), *limit = strstr(msg, "B x H = 65536");
        expect(sig == SIGABRT && note && limit && note < limit,
               "attention_forward, B x H = 65536: cuDNN is tried before the own kernels' limit (signal %d): %s", sig, msg);
    }
    printf("gpu_check --self-test: %s\n", self_failures ? "FAILED" : "every check passed");
    return self_failures ? 1 : 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* through a pipe too: an abort loses no row */
    if (argc > 1 && strcmp(argv[1], "--self-test") == 0)
        return self_test();
    if (argc > 1 && strcmp(argv[1], "--probe") != 0) {
        fprintf(stderr, "usage: gpu_check [--probe | --self-test]\n");
        return 2;
    }
    enum gpu_verdict verdict = gpu_probe("gpu_check");
    if (verdict != GPU_RUN || argc > 1)
        return (int)verdict;
    char err[512];
    if (am_dev_open(&cpu, AM_DEV_CPU, -1, err, sizeof err) < 0) {
        fprintf(stderr, "gpu_check: %s\n", err);
        return 1;
    }
    KC = cpu.k;
    KG = am_kernels_cuda();
    memset(&gpu, 0, sizeof gpu);
    gpu.k = KG;
    gpu.device = AM_DEV_CUDA;
    gpu.ordinal = 0;
    if (KG->open(&gpu, err, sizeof err) < 0) {
        fprintf(stderr, "gpu_check: %s\n", err);
        return 1;
    }
    printf("gpu_check: device 0: %s, compute capability %d.%d\n", gpu.name, gpu.cc_major, gpu.cc_minor);
    char missing[512];
    if (am_kernels_missing(KG, missing, sizeof missing) > 0)
        printf("note: the CUDA backend lacks %s (not checked here; am_dev_open refuses the backend until it has them)\n",
               missing);
    const char *seed = getenv("AM_GPU_SEED");
    rng_state = seed && *seed ? strtoull(seed, NULL, 10) : (uint64_t)time(NULL);
    printf("seed %llu (AM_GPU_SEED=%llu repeats this run)\n", (unsigned long long)rng_state,
           (unsigned long long)rng_state);
    rng_state = rng_state * 0x9E3779B97F4A7C15ull + 1; /* never 0 */

    RUN(case_elementwise(AM_F32));
    RUN(case_elementwise(AM_BF16));
    RUN(case_convert());
    RUN(case_matmul(AM_F32, AM_F32));
    RUN(case_matmul(AM_BF16, AM_BF16));
    RUN(case_matmul(AM_BF16, AM_F32));
    RUN(case_embedding(AM_F32, AM_F32));
    RUN(case_embedding(AM_BF16, AM_BF16));
    RUN(case_embedding(AM_BF16, AM_F32));
    RUN(case_rmsnorm(AM_F32, AM_F32));
    RUN(case_rmsnorm(AM_BF16, AM_BF16));
    RUN(case_rmsnorm(AM_BF16, AM_F32));
    RUN(case_rope(AM_F32, AM_F32));
    RUN(case_rope(AM_BF16, AM_F32));
    RUN(case_rope(AM_BF16, AM_BF16));
    RUN(case_swiglu(AM_F32));
    RUN(case_swiglu(AM_BF16));
    RUN(case_bias(AM_F32));
    RUN(case_bias(AM_BF16));
    RUN(case_moe(AM_F32));
    RUN(case_moe(AM_BF16));
    RUN(case_moe_sigmoid(AM_F32));
    RUN(case_moe_sigmoid(AM_BF16));
    RUN(case_gpt_oss(AM_F32));
    RUN(case_gpt_oss(AM_BF16));
    RUN(case_rope_partial(AM_F32));
    RUN(case_rope_partial(AM_BF16));
    RUN(case_gemma(AM_F32, AM_F32));
    RUN(case_gemma(AM_BF16, AM_BF16));
    RUN(case_ce_lora(AM_F32));
    RUN(case_ce_lora(AM_BF16));
    /* attention: GQA and MHA, head sizes 64 and 128 (and, on the own kernels, 20, 96 and
     * 256), T not a multiple of the 32-row tiles, T = 1, a window shorter than T, B = 2 */
    static const int64_t shapes[][6] = {
        /* B, T, H, KVH, D, window */
        {2, 77, 8, 2, 64, 0}, {1, 77, 4, 4, 128, 0}, {2, 77, 8, 2, 128, 7},
        {2, 1, 8, 2, 64, 0},  {1, 64, 4, 4, 64, 7},  {2, 77, 8, 2, 64, 100},
    };
    static const int64_t own_shapes[][6] = {{1, 50, 2, 1, 256, 0}, {1, 40, 3, 3, 96, 5}, {2, 33, 2, 2, 20, 0}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int64_t *c = shapes[i];
        case_attention("own", AM_F32, c[0], c[1], c[2], c[3], c[4], c[5]);
        case_attention("own", AM_BF16, c[0], c[1], c[2], c[3], c[4], c[5]);
    }
    for (size_t i = 0; i < sizeof own_shapes / sizeof own_shapes[0]; i++) {
        const int64_t *c = own_shapes[i];
        case_attention("own", AM_F32, c[0], c[1], c[2], c[3], c[4], c[5]);
        case_attention("own", AM_BF16, c[0], c[1], c[2], c[3], c[4], c[5]);
    }
    RUN(case_attention_block(AM_F32, AM_F32, 0, false, 0.0f, 0.0f));
    RUN(case_attention_block(AM_F32, AM_F32, 7, false, 0.0f, 0.0f));
    RUN(case_attention_block(AM_F32, AM_F32, 0, true, 0.0f, 0.0f));
    RUN(case_attention_block(AM_F32, AM_F32, 5, true, 0.0f, 0.0f));
    RUN(case_attention_block(AM_BF16, AM_F32, 0, false, 0.0f, 0.0f)); /* the ring in bf16: f32 running out and sums */
    RUN(case_attention_block(AM_BF16, AM_F32, 7, true, 0.0f, 0.0f));
    RUN(case_attention_block(AM_BF16, AM_BF16, 0, true, 0.0f, 0.0f)); /* packed without cp: bf16 out and gradients */
    RUN(case_attention_block(AM_BF16, AM_BF16, 5, false, 0.0f, 0.0f));
    /* Gemma: 24 ** -0.5 capped at 1 (Gemma 2), 0.25 without a cap (Gemma 3) */
    RUN(case_attention_block(AM_F32, AM_F32, 7, false, 0.2041241f, 1.0f));
    RUN(case_attention_block(AM_F32, AM_F32, 5, true, 0.25f, 0.0f));
    RUN(case_attention_block(AM_BF16, AM_F32, 7, false, 0.2041241f, 1.0f));
    RUN(case_attention_block(AM_BF16, AM_BF16, 5, true, 0.2041241f, 1.0f));
    if (am_cuda_attention_has_cudnn())
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            const int64_t *c = shapes[i];
            case_attention("cudnn", AM_BF16, c[0], c[1], c[2], c[3], c[4], c[5]);
        }
    else
        printf("note: this build has no cuDNN: the attention's cuDNN path is not checked\n");
    RUN(case_adamw(0.9f, AM_F32));
    RUN(case_adamw(0.3f, AM_F32));
    RUN(case_adamw(0.9f, AM_BF16));
    RUN(case_adamw(0.3f, AM_BF16));
    RUN(case_ce(AM_F32, AM_F32, 300, 96, 1000, 500, true));
    RUN(case_ce(AM_BF16, AM_BF16, 300, 96, 1000, 500, true));
    RUN(case_ce(AM_BF16, AM_F32, 300, 96, 1000, 500, true));
    RUN(case_ce(AM_F32, AM_F32, 4100, 64, 5000, 123, false));
    RUN(case_ce(AM_BF16, AM_F32, 4100, 64, 5000, 123, false));
    RUN(case_ce(AM_F32, AM_F32, 4100, 64, 3000, 0, true));
    RUN(case_ce(AM_BF16, AM_BF16, 4100, 64, 3000, 0, true));
    RUN(case_adamw_multi(AM_F64, 0.9f, false));
    RUN(case_adamw_multi(AM_F32, 0.3f, false));
    RUN(case_adamw_multi(AM_F64, 0.9f, true));
    RUN(case_adamw_multi(AM_F32, 0.3f, true));
    RUN(case_adamw_te());
    KG->sync(&gpu);

    printf("\n%-44s %-6s %-11s %-7s %s\n", "kernel (CUDA vs CPU)", "dtype", "rel err", "tol", "");
    for (int i = 0; i < nrows; i++)
        printf("%-44s %-6s %-11.3e %-7.0e %s\n", rows[i].what, rows[i].dtype, rows[i].err, rows[i].tol,
               rows[i].ok ? "ok" : "FAIL");
    printf("%d comparisons, %d failed\n", nrows, nfail);
    KG->close(&gpu);
    am_dev_close(&cpu);
    return nfail ? 1 : 0;
}
