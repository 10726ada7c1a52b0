/* bf16.c - what the CPU backend's bf16 paths share (cpu.h says how they work): the
 * context's scratch, the dtype rules, exact widening and round-to-nearest-even narrowing,
 * and the mixed-precision matrix product on OpenBLAS.
 *
 * Matrix products. OpenBLAS exports cblas_sbgemm (bf16 x bf16 -> fp32) only where it was
 * built for it; Debian's 0.3.21 does not (its header declares it, the library has no such
 * symbol), and CPUs without AVX-512 BF16 have no bf16 instructions to run it on. configure
 * looks for the symbol (AC_CHECK_FUNC) and defines AM_HAVE_SBGEMM when it links; without
 * it, bf16 operands are widened to fp32 in blocks and multiplied by sgemm. A product of two
 * bf16 values is exact in fp32 (8 + 8 significant bits), so sgemm on the widened blocks
 * computes what sbgemm does, up to the order of the fp32 accumulation.
 */
#include <cblas.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu.h"
#include "half.h"

/* ---- the context's scratch ---- */

struct am_cpu_ws {
    float *p;
    size_t bytes;
    int64_t chunk; /* floats per operand per chunk */
    size_t in_use, peak; /* bytes handed out by alloc (memory.c), not freed */
};

void am_cpu_account(const struct am_dev *dev, size_t bytes, bool freed)
{
    struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    if (!ws)
        return;
    ws->in_use = freed ? (ws->in_use >= bytes ? ws->in_use - bytes : 0) : ws->in_use + bytes;
    if (ws->in_use > ws->peak)
        ws->peak = ws->in_use;
}

void am_cpu_mem_stats(const struct am_dev *dev, struct am_dev_mem *out)
{
    const struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    *out = (struct am_dev_mem){0};
    if (ws) {
        out->in_use = out->held = ws->in_use;
        out->peak = ws->peak;
    }
}

int64_t am_cpu_chunk(const struct am_dev *dev)
{
    const struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    return ws ? ws->chunk : AM_BF16_CHUNK;
}

void am_cpu_set_chunk(const struct am_dev *dev, int64_t n)
{
    struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    if (ws)
        ws->chunk = n > 0 ? n : AM_BF16_CHUNK;
}

int am_cpu_open(struct am_dev *dev, char *err, size_t err_len)
{
    struct am_cpu_ws *ws = calloc(1, sizeof(*ws));
    if (!ws) {
        snprintf(err, err_len, "kernels (cpu): out of memory for the device context");
        return -1;
    }
    ws->chunk = AM_BF16_CHUNK;
    dev->workspace = ws;
    dev->workspace_bytes = 0;
    return 0;
}

void am_cpu_close(struct am_dev *dev)
{
    struct am_cpu_ws *ws = dev->workspace;
    if (ws)
        free(ws->p);
    free(ws);
    dev->workspace = NULL;
}

float *am_cpu_scratch(const char *kernel, const struct am_dev *dev, int64_t nfloats)
{
    struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    if (!ws)
        am_cpu_fatal(kernel, "the device context has no scratch for bf16 tensors: open it with am_dev_open");
    size_t want = (size_t)(nfloats > 0 ? nfloats : 1) * sizeof(float);
    want = (want + 63) / 64 * 64;
    if (want > ws->bytes) {
        free(ws->p);
        ws->bytes = 0;
        ws->p = aligned_alloc(64, want);
        if (!ws->p)
            am_cpu_fatal(kernel, "out of memory for %zu bytes of scratch (bf16 operands widened to fp32)", want);
        ws->bytes = want;
    }
    return ws->p;
}

float *am_cpu_carve(float **p, int64_t n)
{
    float *r = *p;
    *p += (n + 15) / 16 * 16;
    return r;
}

/* ---- the dtype rules ---- */

enum am_dtype am_cpu_act(const char *kernel, const char *what, const struct am_tensor *t)
{
    am_cpu_check(kernel, what, t);
    if (t->dtype != AM_F32 && t->dtype != AM_BF16)
        am_cpu_fatal(kernel, "%s (%s) is %s; the CPU backend takes fp32 or bf16 here (bf16 storage, fp32 arithmetic)",
                     what, am_tname(t), am_dtype_name(t->dtype));
    return t->dtype;
}

void am_cpu_same(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                 const struct am_tensor *ref)
{
    am_cpu_check(kernel, what, t);
    if (t->dtype != ref->dtype)
        am_cpu_fatal(kernel, "%s (%s) is %s but %s (%s) is %s: a kernel's activations and weights share one dtype "
                     "(fp32, or bf16 for mixed precision)", what, am_tname(t), am_dtype_name(t->dtype), refname,
                     am_tname(ref), am_dtype_name(ref->dtype));
}

void am_cpu_grad(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                 const struct am_tensor *ref)
{
    am_cpu_check(kernel, what, t);
    if (t->dtype == AM_F32 || (t->dtype == AM_BF16 && ref->dtype == AM_BF16))
        return;
    am_cpu_fatal(kernel, "%s (%s) is %s with %s (%s) %s: a parameter gradient is fp32, or bf16 when the activations "
                 "are bf16", what, am_tname(t), am_dtype_name(t->dtype), refname, am_tname(ref),
                 am_dtype_name(ref->dtype));
}

void am_cpu_stat(const char *kernel, const char *what, const struct am_tensor *t)
{
    am_cpu_check(kernel, what, t);
    if (t->dtype != AM_F32)
        am_cpu_fatal(kernel, "%s (%s) is %s; statistics saved for backward stay fp32, also with bf16 activations", what,
                     am_tname(t), am_dtype_name(t->dtype));
}

/* ---- widening and narrowing ---- */

AM_HOT static void widen_row(float *restrict d, const uint16_t *restrict s, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        d[i] = am_bits_f32((uint32_t)s[i] << 16);
}

AM_HOT static void narrow_row(uint16_t *restrict d, const float *restrict s, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        d[i] = am_f32_to_bf16(s[i]);
}

void am_bf16_widen1(float *dst, const uint16_t *src, int64_t n) { widen_row(dst, src, n); }
void am_bf16_narrow1(uint16_t *dst, const float *src, int64_t n) { narrow_row(dst, src, n); }

void am_bf16_widen(float *dst, int64_t ldd, const uint16_t *src, int64_t lds, int64_t rows, int64_t cols)
{
    if (ldd == cols && lds == cols) { /* contiguous: one long row, cut evenly over the threads */
        int64_t n = rows * cols;
#pragma omp parallel if (n >= AM_PAR_MIN)
        {
            int64_t lo, hi;
            am_split(n, omp_get_thread_num(), omp_get_num_threads(), 16, &lo, &hi);
            widen_row(dst + lo, src + lo, hi - lo);
        }
        return;
    }
#pragma omp parallel for schedule(static) if (rows * cols >= AM_PAR_MIN)
    for (int64_t r = 0; r < rows; r++)
        widen_row(dst + r * ldd, src + r * lds, cols);
}

void am_bf16_narrow(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols)
{
    if (ldd == cols && lds == cols) {
        int64_t n = rows * cols;
#pragma omp parallel if (n >= AM_PAR_MIN)
        {
            int64_t lo, hi;
            am_split(n, omp_get_thread_num(), omp_get_num_threads(), 16, &lo, &hi);
            narrow_row(dst + lo, src + lo, hi - lo);
        }
        return;
    }
#pragma omp parallel for schedule(static) if (rows * cols >= AM_PAR_MIN)
    for (int64_t r = 0; r < rows; r++)
        narrow_row(dst + r * ldd, src + r * lds, cols);
}

float *am_cpu_load(const struct am_tensor *t, int64_t off, int64_t n, float *buf)
{
    if (t->dtype == AM_F32)
        return (float *)t->data + off;
    am_bf16_widen(buf, n, (const uint16_t *)t->data + off, n, 1, n);
    return buf;
}

void am_cpu_store(struct am_tensor *t, int64_t off, int64_t n, const float *buf)
{
    if (t->dtype == AM_BF16)
        am_bf16_narrow((uint16_t *)t->data + off, n, buf, n, 1, n);
}

/* ---- the mixed-precision matrix product ----
 * One parallel region per product: C is cut into tiles (up to TM x 512, TM halved down to 64
 * until there are two tiles per thread), each tile belongs to one thread, which widens the blocks of A
 * and B it needs into its own slice of the scratch, runs single-threaded sgemm over L in
 * blocks of 512 accumulating the tile in fp32, and rounds a bf16 tile once. No thread waits
 * for another inside the product (on a busy machine every barrier costs a time slice), and
 * the widening is spread over the threads with the multiplies. A block of B is widened once
 * per tile row that needs it: about 1/(2 TM) of the multiply-adds, a few percent. */

#define TILE 512

/* rows x cols of m from (r0, c0) as fp32: m's own memory when it is f32 (*ld its leading
 * dimension), else widened into buf (*ld = cols), on the calling thread. */
static const float *block(const struct am_mat *m, int64_t r0, int64_t c0, int64_t rows, int64_t cols, float *buf,
                          int64_t *ld)
{
    if (m->dt == AM_F32) {
        *ld = m->ld;
        return (const float *)m->p + r0 * m->ld + c0;
    }
    const uint16_t *src = (const uint16_t *)m->p + r0 * m->ld + c0;
    for (int64_t r = 0; r < rows; r++)
        widen_row(buf + r * cols, src + r * m->ld, cols);
    *ld = cols;
    return buf;
}

/* One tile of C, [mb, nb] at (m0, n0), on the calling thread; buf: 3 x TILE x TILE floats. */
static void gemm_tile(bool ta, bool tb, int64_t m0, int64_t n0, int64_t mb, int64_t nb, int64_t L,
                      const struct am_mat *A, const struct am_mat *B, float beta, const struct am_mat *C, float *buf)
{
    float *cbuf = buf, *abuf = buf + TILE * TILE, *bbuf = buf + 2 * TILE * TILE, *c;
    int64_t ldc;
    if (C->dt == AM_F32) {
        c = (float *)C->p + m0 * C->ld + n0;
        ldc = C->ld;
    } else {
        c = cbuf;
        ldc = nb;
        if (beta != 0.0f)
            block(C, m0, n0, mb, nb, cbuf, &ldc);
    }
    if (L <= 0)
        am_cpu_sgemm1(ta, tb, mb, nb, 0, 1.0f, NULL, 1, NULL, 1, beta, c, ldc);
    for (int64_t l0 = 0; l0 < L; l0 += TILE) {
        int64_t lb = L - l0 < TILE ? L - l0 : TILE, lda, ldb;
        float b_ = l0 == 0 ? beta : 1.0f;
#ifdef AM_HAVE_SBGEMM
        if (A->dt == AM_BF16 && B->dt == AM_BF16) {
            const uint16_t *a = (const uint16_t *)A->p + (ta ? l0 * A->ld + m0 : m0 * A->ld + l0);
            const uint16_t *b = (const uint16_t *)B->p + (tb ? n0 * B->ld + l0 : l0 * B->ld + n0);
            cblas_sbgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (blasint)mb,
                         (blasint)nb, (blasint)lb, 1.0f, a, (blasint)A->ld, b, (blasint)B->ld, b_, c, (blasint)ldc);
            continue;
        }
#endif
        /* op(A)'s rows m0.. and columns l0.. are A's rows l0.., columns m0.. when
         * transposed; likewise op(B)'s rows l0.., columns n0.. */
        const float *a = ta ? block(A, l0, m0, lb, mb, abuf, &lda) : block(A, m0, l0, mb, lb, abuf, &lda);
        const float *b = tb ? block(B, n0, l0, nb, lb, bbuf, &ldb) : block(B, l0, n0, lb, nb, bbuf, &ldb);
        am_cpu_sgemm1(ta, tb, mb, nb, lb, 1.0f, a, lda, b, ldb, b_, c, ldc);
    }
    if (C->dt != AM_F32) {
        uint16_t *dst = (uint16_t *)C->p + m0 * C->ld + n0;
        for (int64_t r = 0; r < mb; r++)
            narrow_row(dst + r * C->ld, c + r * nb, nb);
    }
}

void am_cpu_gemm_mixed(const char *kernel, const struct am_dev *dev, bool ta, bool tb, int64_t M, int64_t N, int64_t L,
                       struct am_mat A, struct am_mat B, float beta, struct am_mat C)
{
    if (M <= 0 || N <= 0)
        return;
    int nth = omp_get_max_threads();
    if (M * N * (L > 0 ? L : 1) < (1 << 18) || omp_in_parallel())
        nth = 1;
    int64_t tn = N < TILE ? N : TILE, tm = TILE, tiles_n = (N + tn - 1) / tn;
    while (tm > 64 && (M + tm - 1) / tm * tiles_n < 2 * nth) /* two tiles a thread: a third tile */
        tm /= 2;                                                   /* on one of two threads idles the other */
    int64_t tiles_m = (M + tm - 1) / tm, tiles = tiles_m * tiles_n;
    if (nth > tiles)
        nth = (int)tiles;
    float *ws = am_cpu_scratch(kernel, dev, (int64_t)nth * 3 * TILE * TILE);
#pragma omp parallel for num_threads(nth) schedule(static) if (nth > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t m0 = t / tiles_n * tm, n0 = t % tiles_n * tn;
        int64_t mb = M - m0 < tm ? M - m0 : tm, nb = N - n0 < tn ? N - n0 : tn;
        gemm_tile(ta, tb, m0, n0, mb, nb, L, &A, &B, beta, &C,
                  ws + (size_t)omp_get_thread_num() * 3 * TILE * TILE);
    }
}
