/* matmul.c - linear layers, y = x · wᵀ (torch.nn.Linear without bias), on OpenBLAS sgemm,
 * and the bias added apart (bias_forward, bias_backward, at the end).
 *
 *   forward:  y[M,N]   = x[M,K] · w[N,K]ᵀ
 *   backward: dx[M,K] += dy[M,N] · w[N,K]
 *             dw[N,K] += dy[M,N]ᵀ · x[M,K]
 * Backward accumulates (beta = 1), so residual branches and tied weights add up for free.
 *
 * bf16 (cpu.h's rules: x, w, y, dy, dx share one dtype; dw f32 or bf16): the same three
 * products through am_cpu_gemm_mixed (below), which widens blocks of the bf16 operands,
 * accumulates in fp32 and rounds each output element once; dx and a bf16 dw are widened,
 * accumulated into and rounded once, an f32 dw is accumulated into directly. As
 * torch.matmul in bf16 on CPU and cuBLAS (fp32 accumulation, one rounding of the output).
 *
 * OpenBLAS exports cblas_sbgemm (bf16 x bf16 -> fp32) only where it was built for it;
 * Debian's 0.3.21 does not (its header declares it, the library has no such symbol), and CPUs
 * without AVX-512 BF16 have no bf16 instructions to run it on. configure looks for the symbol
 * (AC_CHECK_FUNC) and defines AM_HAVE_SBGEMM when it links; without it, bf16 operands are
 * widened to fp32 in blocks and multiplied by sgemm. A product of two bf16 values is exact in
 * fp32 (8 + 8 significant bits), so sgemm on the widened blocks computes what sbgemm does, up
 * to the order of the fp32 accumulation.
 */
#include <cblas.h>
#include <omp.h>

#include "cpu.h"
#include "half.h"

/* Below this many multiply-adds a product runs on the calling thread. */
#define SGEMM_PAR_MIN (1 << 18)

void am_cpu_sgemm1(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                   int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc)
{
    if (M <= 0 || N <= 0)
        return;
    if (K <= 0) { /* nothing to add: C = beta * C, which OpenBLAS may not do for K = 0 */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++)
                C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
        return;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, (blasint)M,
                (blasint)N, (blasint)K, alpha, A, (blasint)lda, B, (blasint)ldb, beta, C, (blasint)ldc);
}

/* C = alpha op(A) op(B) + beta C, split over the threads on the larger of M and N: each
 * thread owns a block of C's rows (and op(A)'s) or of C's columns (and op(B)'s), so no two
 * threads write the same element and each element's sum over K is the one sgemm does. */
void am_cpu_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                  int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc)
{
    int nth = omp_get_max_threads();
    if (nth <= 1 || M * N * K < SGEMM_PAR_MIN || omp_in_parallel()) {
        am_cpu_sgemm1(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    bool by_rows = M >= N;
#pragma omp parallel
    {
        int id = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t lo, hi;
        if (by_rows) { /* rows lo..hi of C and of op(A) */
            am_split(M, id, n, 16, &lo, &hi);
            const float *a = trans_a ? A + lo : A + lo * lda;
            am_cpu_sgemm1(trans_a, trans_b, hi - lo, N, K, alpha, a, lda, B, ldb, beta, C + lo * ldc, ldc);
        } else { /* columns lo..hi of C and of op(B) */
            am_split(N, id, n, 16, &lo, &hi);
            const float *b = trans_b ? B + lo * ldb : B + lo;
            am_cpu_sgemm1(trans_a, trans_b, M, hi - lo, K, alpha, A, lda, b, ldb, beta, C + lo, ldc);
        }
    }
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
        am_bf16_widen1(buf + r * cols, src + r * m->ld, cols);
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
            am_bf16_narrow1(dst + r * C->ld, c + r * nb, nb);
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

static void check_shapes(const char *kernel, const struct am_tensor *x, const struct am_tensor *w, int64_t M,
                         int64_t N, int64_t yrows, int64_t ycols, const char *yname)
{
    if (am_cols(x) != am_cols(w))
        am_cpu_fatal(kernel, "x (%s) has rows of %lld, w (%s) of %lld: x [M,K] · w[N,K]ᵀ needs the same K",
                     am_tname(x), (long long)am_cols(x), am_tname(w), (long long)am_cols(w));
    if (yrows != M || ycols != N)
        am_cpu_fatal(kernel, "%s is [%lld, %lld]; x [M,K] · w[N,K]ᵀ is [%lld, %lld]", yname, (long long)yrows,
                     (long long)ycols, (long long)M, (long long)N);
}

static struct am_mat mat(const struct am_tensor *t) { return (struct am_mat){t->data, t->dtype, am_cols(t)}; }

static void matmul_forward_bf16(const struct am_dev *dev, struct am_tensor *y, const struct am_tensor *x,
                                const struct am_tensor *w)
{
    const char *kernel = "am_cpu_matmul_forward";
    am_cpu_act(kernel, "x", x);
    am_cpu_same(kernel, "w", w, "x", x);
    am_cpu_same(kernel, "y", y, "x", x);
    int64_t M = am_rows(x), K = am_cols(x), N = am_rows(w);
    check_shapes(kernel, x, w, M, N, am_rows(y), am_cols(y), "y");
    am_cpu_gemm_mixed(kernel, dev, false, true, M, N, K, mat(x), mat(w), 0.0f, mat(y));
}

static void matmul_backward_bf16(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw,
                                 const struct am_tensor *dy, const struct am_tensor *x, const struct am_tensor *w)
{
    const char *kernel = "am_cpu_matmul_backward";
    am_cpu_act(kernel, "x", x);
    am_cpu_same(kernel, "w", w, "x", x);
    am_cpu_same(kernel, "dy", dy, "x", x);
    int64_t M = am_rows(x), K = am_cols(x), N = am_rows(w);
    check_shapes(kernel, x, w, M, N, am_rows(dy), am_cols(dy), "dy");
    if (dx) {
        am_cpu_same(kernel, "dx", dx, "x", x);
        AM_CHECK(am_rows(dx) == M && am_cols(dx) == K, "dx (%s) must have x's shape [%lld, %lld]", am_tname(dx),
                 (long long)M, (long long)K);
        am_cpu_gemm_mixed(kernel, dev, false, false, M, K, N, mat(dy), mat(w), 1.0f, mat(dx)); /* dx += dy · w */
    }
    if (dw) {
        am_cpu_grad(kernel, "dw", dw, "x", x);
        AM_CHECK(am_rows(dw) == N && am_cols(dw) == K, "dw (%s) must have w's shape [%lld, %lld]", am_tname(dw),
                 (long long)N, (long long)K);
        am_cpu_gemm_mixed(kernel, dev, true, false, N, K, M, mat(dy), mat(x), 1.0f, mat(dw)); /* dw += dyᵀ · x */
    }
}

void am_cpu_matmul_forward(const struct am_dev *dev, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w)
{
    if (am_not_f32(y) || am_not_f32(x) || am_not_f32(w)) {
        matmul_forward_bf16(dev, y, x, w);
        return;
    }
    float *yd = F32(y);
    const float *xd = F32(x), *wd = F32(w);
    int64_t M = am_rows(x), K = am_cols(x), N = am_rows(w);
    check_shapes(__func__, x, w, M, N, am_rows(y), am_cols(y), "y");
    am_cpu_sgemm(false, true, M, N, K, 1.0f, xd, K, wd, K, 0.0f, yd, N);
}

void am_cpu_matmul_backward(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                            const struct am_tensor *x, const struct am_tensor *w)
{
    if (am_not_f32(dx) || am_not_f32(dw) || am_not_f32(dy) || am_not_f32(x) || am_not_f32(w)) {
        matmul_backward_bf16(dev, dx, dw, dy, x, w);
        return;
    }
    const float *dyd = F32(dy), *xd = F32(x), *wd = F32(w);
    int64_t M = am_rows(x), K = am_cols(x), N = am_rows(w);
    check_shapes(__func__, x, w, M, N, am_rows(dy), am_cols(dy), "dy");
    if (dx) {
        float *dxd = F32(dx);
        AM_CHECK(am_rows(dx) == M && am_cols(dx) == K, "dx (%s) must have x's shape [%lld, %lld]", am_tname(dx),
                 (long long)M, (long long)K);
        am_cpu_sgemm(false, false, M, K, N, 1.0f, dyd, N, wd, K, 1.0f, dxd, K); /* dx += dy · w */
    }
    if (dw) {
        float *dwd = F32(dw);
        AM_CHECK(am_rows(dw) == N && am_cols(dw) == K, "dw (%s) must have w's shape [%lld, %lld]", am_tname(dw),
                 (long long)N, (long long)K);
        am_cpu_sgemm(true, false, N, K, M, 1.0f, dyd, N, xd, K, 1.0f, dwd, K); /* dw += dyᵀ · x */
    }
}

/* ---- the bias: y[i, :] += b; db += Σ_i dy[i, :] ----
 * Forward over rows (threads take whole rows); backward over columns (each thread sums its
 * columns over every row in order, in fp32, then adds the sums to db once), so the result
 * does not depend on the number of threads. bf16 (y, b, dy bf16; db f32 or bf16): widened
 * exactly, added in fp32, each output rounded once. */
static float ld(const void *p, enum am_dtype dt, int64_t i)
{
    return dt == AM_BF16 ? am_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void st(void *p, enum am_dtype dt, int64_t i, float v)
{
    if (dt == AM_BF16)
        ((uint16_t *)p)[i] = am_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

void am_cpu_bias_forward(const struct am_dev *dev, struct am_tensor *y, const struct am_tensor *b)
{
    enum am_dtype dt = am_cpu_act(__func__, "y", y);
    am_cpu_same(__func__, "b", b, "y", y);
    int64_t M = am_rows(y), N = am_cols(y);
    AM_CHECK(am_tensor_numel(b) == N, "b (%s) has %lld elements; y (%s) has rows of %lld", am_tname(b),
             (long long)am_tensor_numel(b), am_tname(y), (long long)N);
    void *yd = y->data;
    const void *bd = b->data;
#pragma omp parallel for schedule(static) if (M * N >= AM_PAR_MIN)
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++)
            st(yd, dt, i * N + j, ld(yd, dt, i * N + j) + ld(bd, dt, j));
}

void am_cpu_bias_backward(const struct am_dev *dev, struct am_tensor *db, const struct am_tensor *dy)
{
    enum am_dtype dt = am_cpu_act(__func__, "dy", dy);
    am_cpu_grad(__func__, "db", db, "dy", dy);
    int64_t M = am_rows(dy), N = am_cols(dy);
    AM_CHECK(am_tensor_numel(db) == N, "db (%s) has %lld elements; dy (%s) has rows of %lld", am_tname(db),
             (long long)am_tensor_numel(db), am_tname(dy), (long long)N);
    float *acc = am_cpu_scratch(__func__, dev, N);
    const void *dyd = dy->data;
    void *dbd = db->data;
    enum am_dtype gt = db->dtype;
#pragma omp parallel if (M * N >= AM_PAR_MIN)
    {
        int64_t lo, hi;
        am_split(N, omp_get_thread_num(), omp_get_num_threads(), 16, &lo, &hi);
        for (int64_t j = lo; j < hi; j++)
            acc[j] = 0.0f;
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = lo; j < hi; j++)
                acc[j] += ld(dyd, dt, i * N + j);
        for (int64_t j = lo; j < hi; j++)
            st(dbd, gt, j, ld(dbd, gt, j) + acc[j]);
    }
}
