/* matmul.cu - linear layers, y = x · wᵀ, on cuBLASLt (kernels/cpu/matmul.c's conventions), and their bias.
 *
 *   forward:  y[M,N]   = x[M,K] · w[N,K]ᵀ
 *   backward: dx[M,K] += dy[M,N] · w[N,K]        (beta = 1)
 *             dw[N,K] += dy[M,N]ᵀ · x[M,K]       (beta = 1)
 * cuBLASLt is column-major; a row-major [r, c] matrix is a column-major [c, r] one, so each
 * product is computed transposed: yᵀ = w · xᵀ, i.e. C = op(A) op(B) with A = w (opT),
 * B = x; dxᵀ = wᵀ dyᵀ (A = w, B = dy, both opN); dwᵀ = xᵀ dy (A = x opN, B = dy opT).
 *
 * Precision: compute CUBLAS_COMPUTE_32F (true fp32, never TF32) with fp32 scale; A and B
 * share the activations' dtype (f32 or bf16), C (= D, in place) is the output's: y and dx
 * have the activations' dtype, dw f32 or bf16 (an f32 dw with bf16 activations accumulates
 * the products into fp32 as they are). Each bf16 output is rounded once by cuBLASLt.
 *
 * The algorithm for a shape comes from cublasLtMatmulAlgoGetHeuristic once and is cached in
 * the context (AM_CUDA_GEMM_CACHE entries, round robin), keyed by the transposes, sizes,
 * leading dimensions, dtypes, beta and the operands' alignment. */
#include <string.h>

#include "common.cuh"

/* a cuBLASLt failure is the device's (AM_DEV_FAULT_ERROR: a `cuda` cause), not the caller's:
 * the shapes were checked before */
static void lt_check(const char *k, cublasStatus_t st, const char *what)
{
    if (st != CUBLAS_STATUS_SUCCESS)
        am_cuda_device_error(k, cublasLtGetStatusString(st), "cuBLASLt error in %s: %s", what,
                             cublasLtGetStatusString(st));
}

static int align_of(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    int al = 16;
    while (al > 1 && a % (uintptr_t)al)
        al /= 2;
    return al;
}

static cudaDataType_t cuda_type(enum am_dtype dt) { return dt == AM_BF16 ? CUDA_R_16BF : CUDA_R_32F; }

/* C[m,n] = op(A) op(B) + beta C, column-major, A/B of atype, C of ctype (common.cuh) */
void am_cuda_gemm(const char *k, const struct am_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t kk,
                 const void *A, int64_t lda, const void *B, int64_t ldb, enum am_dtype atype, void *C, int64_t ldc,
                 enum am_dtype ctype, float beta)
{
    struct am_cuda_ctx *c = am_cuda_ctx(k, d);
    if (m <= 0 || n <= 0)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (kk <= 0) { /* nothing to add; C = beta C, with beta 0 or 1 */
        if (beta == 0.0f)
            am_cuda_check(k, cudaMemsetAsync(C, 0, (size_t)ldc * (size_t)n * am_dtype_size(ctype), s), "cudaMemsetAsync");
        return;
    }
    struct am_cuda_gemm_key key;
    memset(&key, 0, sizeof key);
    key.ta = ta;
    key.tb = tb;
    key.m = m;
    key.n = n;
    key.k = kk;
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    key.atype = cuda_type(atype);
    key.ctype = cuda_type(ctype);
    key.beta_one = beta != 0.0f;
    int al = align_of(A);
    al = align_of(B) < al ? align_of(B) : al;
    al = align_of(C) < al ? align_of(C) : al;
    key.align = al;

    cublasLtHandle_t h = (cublasLtHandle_t)d->blas;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    lt_check(k, cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    lt_check(k, cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa), "TRANSA");
    lt_check(k, cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb), "TRANSB");
    /* A is stored [rows, cols] column-major: op(A) is m x k */
    lt_check(k, cublasLtMatrixLayoutCreate(&la, cuda_type(atype), ta ? kk : m, ta ? m : kk, lda), "layout A");
    lt_check(k, cublasLtMatrixLayoutCreate(&lb, cuda_type(atype), tb ? n : kk, tb ? kk : n, ldb), "layout B");
    lt_check(k, cublasLtMatrixLayoutCreate(&lc, cuda_type(ctype), m, n, ldc), "layout C");

    struct am_cuda_gemm_entry *e = NULL;
    for (int i = 0; i < AM_CUDA_GEMM_CACHE; i++)
        if (c->gemm[i].used && memcmp(&c->gemm[i].key, &key, sizeof key) == 0) {
            e = &c->gemm[i];
            break;
        }
    if (!e) {
        cublasLtMatmulPreference_t pref = NULL;
        lt_check(k, cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
        size_t wsb = d->workspace_bytes;
        uint32_t a32 = (uint32_t)al;
        lt_check(k, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb),
                 "preference workspace");
        lt_check(k, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a32, sizeof a32),
                 "preference alignment A");
        lt_check(k, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &a32, sizeof a32),
                 "preference alignment B");
        lt_check(k, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &a32, sizeof a32),
                 "preference alignment C");
        lt_check(k, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &a32, sizeof a32),
                 "preference alignment D");
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        lt_check(k, cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 1, &res, &found),
                 "cublasLtMatmulAlgoGetHeuristic");
        cublasLtMatmulPreferenceDestroy(pref);
        if (found < 1)
            am_cuda_device_error(k, "no algorithm",
                                 "cuBLASLt has no algorithm for %s%s m=%lld n=%lld k=%lld (%s x %s -> %s)",
                                 ta ? "T" : "N", tb ? "T" : "N", (long long)m, (long long)n, (long long)kk,
                                 am_dtype_name(atype), am_dtype_name(atype), am_dtype_name(ctype));
        e = &c->gemm[c->gemm_next];
        c->gemm_next = (c->gemm_next + 1) % AM_CUDA_GEMM_CACHE;
        e->key = key;
        e->algo = res.algo;
        e->used = true;
    }
    float alpha = 1.0f;
    lt_check(k, cublasLtMatmul(h, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &e->algo, c->gemm_ws,
                               d->workspace_bytes, s),
             "cublasLtMatmul");
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
}

static void check_shapes(const char *k, const struct am_tensor *x, const struct am_tensor *w, int64_t yrows,
                         int64_t ycols, const char *yname)
{
    int64_t M = am_rows(x), N = am_rows(w);
    if (am_cols(x) != am_cols(w))
        am_cuda_fatal(k, "x (%s) has rows of %lld, w (%s) of %lld: x [M,K] · w[N,K]ᵀ needs the same K", am_tname(x),
                      (long long)am_cols(x), am_tname(w), (long long)am_cols(w));
    if (yrows != M || ycols != N)
        am_cuda_fatal(k, "%s is [%lld, %lld]; x [M,K] · w[N,K]ᵀ is [%lld, %lld]", yname, (long long)yrows,
                      (long long)ycols, (long long)M, (long long)N);
}

void am_cuda_matmul_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w)
{
    const char *k = "am_cuda_matmul_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "x", x);
    am_cuda_same(k, "w", w, "x", x);
    am_cuda_same(k, "y", y, "x", x);
    int64_t M = am_rows(x), K = am_cols(x), N = am_rows(w);
    check_shapes(k, x, w, am_rows(y), am_cols(y), "y");
    am_cuda_gemm(k, d, true, false, N, M, K, w->data, K, x->data, K, dt, y->data, N, dt, 0.0f);
}

void am_cuda_matmul_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                             const struct am_tensor *x, const struct am_tensor *w)
{
    const char *k = "am_cuda_matmul_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "x", x);
    am_cuda_same(k, "w", w, "x", x);
    am_cuda_same(k, "dy", dy, "x", x);
    int64_t M = am_rows(x), K = am_cols(x), N = am_rows(w);
    check_shapes(k, x, w, am_rows(dy), am_cols(dy), "dy");
    if (dx) {
        am_cuda_same(k, "dx", dx, "x", x);
        AM_CUDA_REQUIRE(k, am_rows(dx) == M && am_cols(dx) == K, "dx (%s) must have x's shape [%lld, %lld]", am_tname(dx),
                        (long long)M, (long long)K);
        am_cuda_gemm(k, d, false, false, K, M, N, w->data, K, dy->data, N, dt, dx->data, K, dt, 1.0f); /* dx += dy · w */
    }
    if (dw) {
        am_cuda_grad(k, "dw", dw, "x", x);
        AM_CUDA_REQUIRE(k, am_rows(dw) == N && am_cols(dw) == K, "dw (%s) must have w's shape [%lld, %lld]", am_tname(dw),
                        (long long)N, (long long)K);
        am_cuda_gemm(k, d, false, true, K, N, M, x->data, K, dy->data, N, dt, dw->data, K, dw->dtype, 1.0f); /* dw += dyᵀ · x */
    }
}

/* ---- the bias (kernels/cpu/matmul.c computes the same): y[i, :] += b; db += Σ_i dy[i, :],
 * one thread per column summing its rows in order in fp32 (deterministic), added to db once ---- */
template <typename T> __global__ void bias_fwd_k(T *y, const T *b, int64_t M, int64_t N)
{
    AM_GRID_STRIDE(i, M * N) am_st(y, i, am_ld(y, i) + am_ld(b, i % N));
}

template <typename T, typename G> __global__ void bias_bwd_k(G *db, const T *dy, int64_t M, int64_t N)
{
    AM_GRID_STRIDE(j, N)
    {
        float acc = 0.0f;
        for (int64_t i = 0; i < M; i++)
            acc += am_ld(dy, i * N + j);
        am_st(db, j, am_ld(db, j) + acc);
    }
}

void am_cuda_bias_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *b)
{
    const char *k = "am_cuda_bias_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "y", y);
    am_cuda_same(k, "b", b, "y", y);
    int64_t M = am_rows(y), N = am_cols(y);
    AM_CUDA_REQUIRE(k, am_tensor_numel(b) == N, "b (%s) has %lld elements; y (%s) has rows of %lld", am_tname(b),
                    (long long)am_tensor_numel(b), am_tname(y), (long long)N);
    if (!M || !N)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        bias_fwd_k<<<am_blocks(M * N), AM_THREADS, 0, s>>>((float *)y->data, (const float *)b->data, M, N);
    else
        bias_fwd_k<<<am_blocks(M * N), AM_THREADS, 0, s>>>((am_bf16_t *)y->data, (const am_bf16_t *)b->data, M, N);
    AM_LAUNCHED(k);
}

void am_cuda_bias_backward(const struct am_dev *d, struct am_tensor *db, const struct am_tensor *dy)
{
    const char *k = "am_cuda_bias_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "dy", dy);
    am_cuda_grad(k, "db", db, "dy", dy);
    int64_t M = am_rows(dy), N = am_cols(dy);
    AM_CUDA_REQUIRE(k, am_tensor_numel(db) == N, "db (%s) has %lld elements; dy (%s) has rows of %lld", am_tname(db),
                    (long long)am_tensor_numel(db), am_tname(dy), (long long)N);
    if (!N)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        bias_bwd_k<<<am_blocks(N), AM_THREADS, 0, s>>>((float *)db->data, (const float *)dy->data, M, N);
    else if (db->dtype == AM_F32)
        bias_bwd_k<<<am_blocks(N), AM_THREADS, 0, s>>>((float *)db->data, (const am_bf16_t *)dy->data, M, N);
    else
        bias_bwd_k<<<am_blocks(N), AM_THREADS, 0, s>>>((am_bf16_t *)db->data, (const am_bf16_t *)dy->data, M, N);
    AM_LAUNCHED(k);
}
