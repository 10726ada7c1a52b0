/* crossentropy.cu - cross-entropy fused with the output projection, vocabulary-parallel, in tiles of
 * rows x vocabulary so that the logits [N, V] never exist whole (kernels.h has the contract,
 * kernels/cpu/crossentropy.c the same computation on the CPU).
 *
 * For a chunk of R rows of x and a chunk of VC vocabulary entries of w:
 *   L = x_rows · w_vocabᵀ            cuBLASLt, into an fp32 tile [R, VC] of the scratch
 *   ce_stats:    each row's max m and s = Σ exp(l - m), over the vocabulary chunks in order
 *                with the online rescaling s <- s exp(m_old - m_new) + Σ_tile exp(l - m_new),
 *                and the target's logit t (0 when the target is not in the shard)
 *   ce_backward: the tile recomputed, dlogits = (exp(l - M - log S) - [v == target]) * scale
 *                (0 on ignored rows, target < 0), then dx_rows += dlogits · w_vocab and
 *                dw_vocab += dlogitsᵀ · x_rows (cuBLASLt, beta 1)
 *   ce_fused:    when the whole vocabulary fits one tile of the row chunk (VC = V), a row's
 *                statistics are final after its one tile: statistics, dlogits and both
 *                products from one GEMM of logits per row chunk. Otherwise it returns false
 *                having done nothing (the caller runs ce_stats and ce_backward).
 * Sizes: R = min(N, 4096, 2^24 / C) rows and VC = 2^24 / R vocabulary entries (a multiple
 * of 64, at most V): the logits tile is 64 MiB of fp32 at most, whatever N and V; so is the
 * fp32 dx tile of the bf16 path ([R, C]). ce_fused needs V <= 2^24 / R: a 128k vocabulary
 * (Llama 3's 128256) with more than 130 rows takes the two passes. (Smaller row chunks would
 * make it fit, but each row chunk reads and writes the whole of dw: computing the logits
 * twice costs less.)
 *
 * bf16 (x and w bf16): the GEMMs take bf16 operands with fp32 accumulation and write fp32
 * (the logits tile, the dx tile, an fp32 dw); dlogits are rounded to bf16 once to be the
 * products' operand (a second tile of the scratch), as torch's bf16 logits would be. The
 * contributions to a bf16 dx are summed over the vocabulary chunks in the fp32 dx tile and
 * added to dx once (one rounding per element: kernels.h's rule for a += into bf16); a bf16
 * dw (the model's head gradient is fp32; a bf16 one is the table's contract only) is widened
 * whole into fp32 scratch, accumulated there and rounded back once, as the CPU does: V x C x 4
 * bytes of scratch beside the tiles (2 GiB at 128k x 4096), which am-plan does not count (the
 * model never asks for it; cuda_impl.h has the scratch's sizes).
 *
 * LoRA on the head (ce_stats_lora, ce_backward_lora): one more GEMM per tile adds u_rows ·
 * b_vocabᵀ (K = r, beta 1) to the logits before the cap; the backward adds du_rows += D · b_vocab
 * (into an fp32 [R, r] tile added to a bf16 du once per row chunk, as dx's) and db_vocab += Dᵀ ·
 * u_rows (db fp32, the model's gradient).
 *
 * Determinism: one block per row reduces its part of a tile by a fixed tree, the tiles in
 * order; ce_loss is one block whose threads each sum a contiguous strip of tokens in order,
 * the strips added by a fixed tree; the GEMMs are cuBLASLt's with the algorithm cached per
 * shape. Run to run bitwise equal. Against the CPU: the same formulas, summed in another
 * order (and CUDA's expf and logf, within 2 ulp), hence the tolerances of tests/gpu/run.
 */
#include <math.h>

#include "common.cuh"

#define CE_TILE_FLOATS ((int64_t)1 << 24) /* logits per tile: 64 MiB of fp32 */
#define CE_MAX_ROWS 4096
#define CE_THREADS 256  /* one block per row of a tile; a power of 2 (the trees) */
#define LOSS_THREADS 1024

/* ---- the tiling ---- */

struct ce_plan {
    int64_t N, C, V;
    int64_t R;  /* rows per chunk */
    int64_t VC; /* vocabulary entries per tile */
    int64_t ld; /* the tiles' row length (VC rounded up to 8: 16-byte aligned bf16 rows) */
};

static struct ce_plan ce_plan_for(int64_t N, int64_t C, int64_t V)
{
    struct ce_plan p;
    p.N = N;
    p.C = C;
    p.V = V;
    int64_t r = CE_TILE_FLOATS / (C > 0 ? C : 1);
    r = r < 64 ? 64 : r > CE_MAX_ROWS ? CE_MAX_ROWS : r;
    p.R = N < r ? N : r;
    if (p.R < 1)
        p.R = 1;
    int64_t vc = CE_TILE_FLOATS / p.R / 64 * 64;
    vc = vc < 64 ? 64 : vc;
    p.VC = V < vc ? V : vc;
    if (p.VC < 1)
        p.VC = 1;
    p.ld = (p.VC + 7) / 8 * 8;
    return p;
}

static size_t rup(size_t bytes) { return (bytes + 255) / 256 * 256; }

/* The next region of the scratch (256-byte aligned). */
static void *carve(char **p, size_t bytes)
{
    void *r = *p;
    *p += rup(bytes);
    return r;
}

/* ---- device code ---- */

/* The threads' values reduced by a fixed tree (blockDim.x a power of 2); sh is reusable after. */
__device__ static float block_max(float *sh, float v)
{
    sh[threadIdx.x] = v;
    for (unsigned w = blockDim.x / 2; w > 0; w /= 2) {
        __syncthreads();
        if (threadIdx.x < w)
            sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + w]);
    }
    __syncthreads();
    float r = sh[0];
    __syncthreads();
    return r;
}

template <typename T> __device__ static T block_sum(T *sh, T v)
{
    sh[threadIdx.x] = v;
    for (unsigned w = blockDim.x / 2; w > 0; w /= 2) {
        __syncthreads();
        if (threadIdx.x < w)
            sh[threadIdx.x] += sh[threadIdx.x + w];
    }
    __syncthreads();
    T r = sh[0];
    __syncthreads();
    return r;
}

/* Folds row blockIdx.x of a tile of logits (vocabulary v0 .. v0 + vc - 1, rows ld apart) into
 * the row's running max m and sum s, and takes its target's logit into t; first: the row's
 * first tile, which starts m = -inf, s = 0, t = 0. kernels/cpu/crossentropy.c's tile_stats. */
__global__ void ce_stats_k(const float *L, int64_t ld, int64_t vc, int64_t v0, bool first, float *m, float *s, float *t,
                           const int32_t *tg, int64_t vocab_start)
{
    __shared__ float sh[CE_THREADS];
    int64_t r = blockIdx.x;
    const float *l = L + r * ld;
    float mx = -INFINITY;
    for (int64_t v = threadIdx.x; v < vc; v += blockDim.x)
        mx = fmaxf(mx, l[v]);
    mx = block_max(sh, mx);
    float mo = first ? -INFINITY : m[r], so = first ? 0.0f : s[r];
    if (mx > mo) { /* a new maximum: rescale what was summed so far */
        so = mo == -INFINITY ? 0.0f : so * expf(mo - mx);
        mo = mx;
    }
    float acc = 0.0f;
    for (int64_t v = threadIdx.x; v < vc; v += blockDim.x)
        acc += expf(l[v] - mo);
    acc = block_sum(sh, acc);
    if (threadIdx.x == 0) {
        m[r] = mo;
        s[r] = so + acc;
        int64_t tl = tg[r] < 0 ? -1 : (int64_t)tg[r] - vocab_start - v0; /* the target's column here */
        if (tl >= 0 && tl < vc)
            t[r] = l[tl];
        else if (first)
            t[r] = 0.0f;
    }
}

/* Gemma's final_logit_softcapping: rows [0, blockIdx.y) of a tile capped in place,
 * l <- cap * tanh(l / cap) (transformers' order: / cap, tanh, * cap). */
__global__ void ce_cap_k(float *L, int64_t ld, int64_t vc, float cap)
{
    float *l = L + (int64_t)blockIdx.y * ld;
    for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < vc; v += (int64_t)gridDim.x * blockDim.x)
        l[v] = tanhf(l[v] / cap) * cap;
}

/* m = -inf, s = 0, t = 0: the statistics of an empty shard */
__global__ void ce_stats_empty_k(float *m, float *s, float *t, int64_t n)
{
    AM_GRID_STRIDE(i, n)
    {
        m[i] = -INFINITY;
        s[i] = 0.0f;
        t[i] = 0.0f;
    }
}

/* dlogits of rows blockIdx.y of a tile (as ce_stats_k's) into out (rows ldo apart: the tile
 * itself for fp32, a bf16 tile for bf16): (exp(l - M - log S) - [v == target]) * scale, 0 on
 * rows whose target is < 0. kernels/cpu/crossentropy.c's dlogits_slice. */
template <typename D>
__global__ void ce_dlogits_k(const float *L, int64_t ld, int64_t vc, int64_t v0, D *out, int64_t ldo, const int32_t *tg,
                             int64_t vocab_start, const float *M, const float *S, float scale, float cap)
{
    int64_t r = blockIdx.y;
    const float *l = L + r * ld;
    D *o = out + r * ldo;
    int32_t g = tg[r];
    int64_t tl = g < 0 ? -1 : (int64_t)g - vocab_start - v0;
    float lse = g < 0 ? 0.0f : M[r] + logf(S[r]);
    for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < vc; v += (int64_t)gridDim.x * blockDim.x) {
        float dv = 0.0f;
        if (g >= 0) {
            float e = expf(l[v] - lse);
            dv = (v == tl ? e - 1.0f : e) * scale;
            if (cap > 0.0f) /* l holds the capped logit u: through the cap, 1 - (u / cap)² */
                dv *= 1.0f - (l[v] / cap) * (l[v] / cap);
        }
        am_st(o, v, dv);
    }
}

/* dst (bf16) += acc (fp32), rounded once */
__global__ void ce_add_bf16_k(am_bf16_t *dst, const float *acc, int64_t n)
{
    AM_GRID_STRIDE(i, n) dst[i] = am_to_bf16(am_ld(dst, i) + acc[i]);
}

__global__ void ce_widen_k(float *dst, const am_bf16_t *src, int64_t n)
{
    AM_GRID_STRIDE(i, n) dst[i] = am_ld(src, i);
}

__global__ void ce_narrow_k(am_bf16_t *dst, const float *src, int64_t n)
{
    AM_GRID_STRIDE(i, n) dst[i] = am_to_bf16(src[i]);
}

__global__ void ce_rescale_k(float *s, const float *m, const float *M, int64_t n)
{
    AM_GRID_STRIDE(i, n) s[i] = s[i] * expf(m[i] - M[i]);
}

/* One block: thread i sums tokens [i * per, (i + 1) * per) in order, in double, then the
 * strips by a fixed tree; acc += the total. */
__global__ void ce_loss_k(double *acc, const float *M, const float *S, const float *T, const int32_t *tg, int64_t n)
{
    __shared__ double sh[LOSS_THREADS];
    int64_t per = (n + blockDim.x - 1) / blockDim.x, lo = (int64_t)threadIdx.x * per;
    int64_t hi = lo + per < n ? lo + per : n;
    double sum = 0.0;
    for (int64_t i = lo; i < hi; i++)
        if (tg[i] >= 0)
            sum += (double)logf(S[i]) + (double)M[i] - (double)T[i];
    double total = block_sum(sh, sum);
    if (threadIdx.x == 0)
        *acc += total;
}

/* ---- checks ---- */

/* x and w (the activations' dtype, returned), targets, and the shapes they share */
static enum am_dtype check_ce(const char *k, const struct am_tensor *x, const struct am_tensor *w,
                              const struct am_tensor *targets)
{
    enum am_dtype dt = am_cuda_act(k, "x", x);
    am_cuda_same(k, "w", w, "x", x);
    am_cuda_data(k, "targets", targets, AM_I32);
    if (am_cols(x) != am_cols(w))
        am_cuda_fatal(k, "x (%s) has rows of %lld, w (%s) of %lld: both must be the hidden size", am_tname(x),
                      (long long)am_cols(x), am_tname(w), (long long)am_cols(w));
    if (am_tensor_numel(targets) != am_rows(x))
        am_cuda_fatal(k, "targets (%s) has %lld entries for %lld rows of x", am_tname(targets),
                      (long long)am_tensor_numel(targets), (long long)am_rows(x));
    return dt;
}

static float *stat_of(const char *k, const char *what, const struct am_tensor *t, int64_t N)
{
    am_cuda_stat(k, what, t);
    if (am_tensor_numel(t) != N)
        am_cuda_fatal(k, "%s (%s) has %lld entries: one per row of x (%lld)", what, am_tname(t),
                      (long long)am_tensor_numel(t), (long long)N);
    return (float *)t->data;
}

static void check_grads(const char *k, const struct am_tensor *dx, const struct am_tensor *dw, const struct am_tensor *x,
                        int64_t N, int64_t C, int64_t V)
{
    if (dx) {
        am_cuda_same(k, "dx", dx, "x", x);
        AM_CUDA_REQUIRE(k, am_rows(dx) == N && am_cols(dx) == C, "dx (%s) must have x's shape [%lld, %lld]", am_tname(dx),
                        (long long)N, (long long)C);
    }
    if (dw) {
        am_cuda_grad(k, "dw", dw, "x", x);
        AM_CUDA_REQUIRE(k, am_rows(dw) == V && am_cols(dw) == C, "dw (%s) must have w's shape [%lld, %lld]", am_tname(dw),
                        (long long)V, (long long)C);
    }
}

/* ---- the passes over the tiles ---- */

/* LoRA on the head: u [N, r], b [V, r] (x's dtype), du [N, r] (x's dtype), db [V, r] (fp32) */
struct ce_lora {
    const struct am_tensor *u, *b;
    struct am_tensor *du, *db;
    int64_t r;
};

/* L = x[r0 .. r0 + nr) · w[v0 .. v0 + vc)ᵀ (+ u_rows · b_vocabᵀ with lo) into the fp32 tile (rows
 * p->ld apart) */
static void logits(const char *k, const struct am_dev *d, const struct ce_plan *p, const struct am_tensor *x,
                   const struct am_tensor *w, int64_t r0, int64_t nr, int64_t v0, int64_t vc, float *L,
                   const struct ce_lora *lo)
{
    size_t es = am_dtype_size(x->dtype);
    const char *xc = (const char *)x->data + (size_t)(r0 * p->C) * es, *wc = (const char *)w->data + (size_t)(v0 * p->C) * es;
    am_cuda_gemm(k, d, true, false, vc, nr, p->C, wc, p->C, xc, p->C, x->dtype, L, p->ld, AM_F32, 0.0f);
    if (lo) {
        const char *uc = (const char *)lo->u->data + (size_t)(r0 * lo->r) * es;
        const char *bc = (const char *)lo->b->data + (size_t)(v0 * lo->r) * es;
        am_cuda_gemm(k, d, true, false, vc, nr, lo->r, bc, lo->r, uc, lo->r, x->dtype, L, p->ld, AM_F32, 1.0f);
    }
}

/* The tile's logits capped (cap > 0; nothing otherwise). */
static void cap_tile(const char *k, const struct am_dev *d, const struct ce_plan *p, float *L, int64_t nr, int64_t vc,
                     float cap)
{
    if (cap <= 0.0f)
        return;
    unsigned gx = (unsigned)((vc + CE_THREADS - 1) / CE_THREADS);
    gx = gx > 64 ? 64 : gx < 1 ? 1 : gx;
    ce_cap_k<<<dim3(gx, (unsigned)nr), CE_THREADS, 0, am_cuda_stream(d)>>>(L, p->ld, vc, cap);
    AM_LAUNCHED(k);
}

static void stats_tile(const char *k, const struct am_dev *d, const struct ce_plan *p, const float *L, int64_t nr,
                       int64_t v0, int64_t vc, float *m, float *s, float *t, const int32_t *tg, int64_t vocab_start)
{
    ce_stats_k<<<(unsigned)nr, CE_THREADS, 0, am_cuda_stream(d)>>>(L, p->ld, vc, v0, v0 == 0, m, s, t, tg, vocab_start);
    AM_LAUNCHED(k);
}

/* Where the gradients of one pass accumulate (the scratch of the bf16 path, or the tensors). */
struct ce_grads {
    float *L;          /* the fp32 logits tile */
    am_bf16_t *Lb;     /* bf16: the dlogits tile */
    float *dx_acc;     /* bf16 dx: the row chunk's fp32 contributions [R, C] */
    float *dw_acc;     /* bf16 dw: the whole of dw widened to fp32 [V, C] */
    float *du_acc;     /* LoRA with bf16 du: the row chunk's fp32 contributions [R, r] */
};

/* Scratch for one call: the logits tile, and what the bf16 path needs. */
static struct ce_grads ce_scratch(const char *k, const struct am_dev *d, const struct ce_plan *p, bool bf16, bool dx_acc,
                                  bool dw_acc, int64_t du_cols)
{
    size_t tile = (size_t)(p->R * p->ld);
    size_t bytes = rup(tile * sizeof(float)) + (bf16 ? rup(tile * sizeof(am_bf16_t)) : 0) +
                   (dx_acc ? rup((size_t)(p->R * p->C) * sizeof(float)) : 0) +
                   (dw_acc ? rup((size_t)(p->V * p->C) * sizeof(float)) : 0) +
                   (du_cols ? rup((size_t)(p->R * du_cols) * sizeof(float)) : 0);
    char *base = (char *)am_cuda_scratch(k, d, bytes);
    struct ce_grads g;
    g.L = (float *)carve(&base, tile * sizeof(float));
    g.Lb = bf16 ? (am_bf16_t *)carve(&base, tile * sizeof(am_bf16_t)) : NULL;
    g.dx_acc = dx_acc ? (float *)carve(&base, (size_t)(p->R * p->C) * sizeof(float)) : NULL;
    g.dw_acc = dw_acc ? (float *)carve(&base, (size_t)(p->V * p->C) * sizeof(float)) : NULL;
    g.du_acc = du_cols ? (float *)carve(&base, (size_t)(p->R * du_cols) * sizeof(float)) : NULL;
    return g;
}

/* From the logits tile of rows r0.., vocabulary v0..: dlogits, then dx += dlogits · w and
 * dw += dlogitsᵀ · x (each when given). M and S: the rows' combined statistics. */
static void backward_tile(const char *k, const struct am_dev *d, const struct ce_plan *p, const struct ce_grads *g,
                          struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x, const struct am_tensor *w,
                          const int32_t *tg, int64_t vocab_start, const float *M, const float *S, float scale,
                          int64_t r0, int64_t nr, int64_t v0, int64_t vc, float cap, const struct ce_lora *lo)
{
    cudaStream_t st = am_cuda_stream(d);
    enum am_dtype dt = x->dtype;
    size_t es = am_dtype_size(dt);
    unsigned gx = (unsigned)((vc + CE_THREADS - 1) / CE_THREADS);
    gx = gx > 64 ? 64 : gx < 1 ? 1 : gx;
    dim3 grid(gx, (unsigned)nr);
    const void *D;
    if (dt == AM_BF16) {
        ce_dlogits_k<<<grid, CE_THREADS, 0, st>>>(g->L, p->ld, vc, v0, g->Lb, p->ld, tg + r0, vocab_start, M + r0, S + r0,
                                                  scale, cap);
        D = g->Lb;
    } else {
        ce_dlogits_k<<<grid, CE_THREADS, 0, st>>>(g->L, p->ld, vc, v0, g->L, p->ld, tg + r0, vocab_start, M + r0, S + r0,
                                                  scale, cap);
        D = g->L;
    }
    AM_LAUNCHED(k);
    const char *wc = (const char *)w->data + (size_t)(v0 * p->C) * es, *xc = (const char *)x->data + (size_t)(r0 * p->C) * es;
    if (dx) { /* dx_rows[nr, C] += D[nr, vc] · w_vocab[vc, C] */
        void *out = g->dx_acc ? (void *)g->dx_acc : (void *)((char *)dx->data + (size_t)(r0 * p->C) * es);
        am_cuda_gemm(k, d, false, false, p->C, nr, vc, wc, p->C, D, p->ld, dt, out, p->C, AM_F32, 1.0f);
    }
    if (dw) { /* dw_vocab[vc, C] += D[nr, vc]ᵀ · x_rows[nr, C] */
        void *out = g->dw_acc ? (void *)(g->dw_acc + v0 * p->C)
                              : (void *)((char *)dw->data + (size_t)(v0 * p->C) * am_dtype_size(dw->dtype));
        am_cuda_gemm(k, d, false, true, p->C, vc, nr, xc, p->C, D, p->ld, dt, out, p->C, g->dw_acc ? AM_F32 : dw->dtype,
                     1.0f);
    }
    if (lo) { /* du_rows[nr, r] += D · b_vocab[vc, r]; db_vocab[vc, r] += Dᵀ · u_rows[nr, r] */
        int64_t r = lo->r;
        const char *bc = (const char *)lo->b->data + (size_t)(v0 * r) * es;
        const char *uc = (const char *)lo->u->data + (size_t)(r0 * r) * es;
        void *out = g->du_acc ? (void *)g->du_acc : (void *)((char *)lo->du->data + (size_t)(r0 * r) * es);
        am_cuda_gemm(k, d, false, false, r, nr, vc, bc, r, D, p->ld, dt, out, r, AM_F32, 1.0f);
        am_cuda_gemm(k, d, false, true, r, vc, nr, uc, r, D, p->ld, dt, (float *)lo->db->data + v0 * r, r, AM_F32, 1.0f);
    }
}

/* The bf16 path's accumulators: dw widened before the passes ... */
static void grads_begin(const char *k, const struct am_dev *d, const struct ce_plan *p, const struct ce_grads *g,
                        const struct am_tensor *dw)
{
    if (g->dw_acc) {
        int64_t n = p->V * p->C;
        ce_widen_k<<<am_blocks(n), AM_THREADS, 0, am_cuda_stream(d)>>>(g->dw_acc, (const am_bf16_t *)dw->data, n);
        AM_LAUNCHED(k);
    }
}

/* ... the dx tile zeroed before each row chunk and added to dx after it ... */
static void rows_begin(const char *k, const struct am_dev *d, const struct ce_plan *p, const struct ce_grads *g, int64_t nr,
                       const struct ce_lora *lo)
{
    if (g->dx_acc)
        am_cuda_check(k, cudaMemsetAsync(g->dx_acc, 0, (size_t)(nr * p->C) * sizeof(float), am_cuda_stream(d)),
                      "cudaMemsetAsync (dx tile)");
    if (g->du_acc)
        am_cuda_check(k, cudaMemsetAsync(g->du_acc, 0, (size_t)(nr * lo->r) * sizeof(float), am_cuda_stream(d)),
                      "cudaMemsetAsync (du tile)");
}

static void rows_end(const char *k, const struct am_dev *d, const struct ce_plan *p, const struct ce_grads *g,
                     struct am_tensor *dx, int64_t r0, int64_t nr, const struct ce_lora *lo)
{
    if (g->dx_acc) {
        int64_t n = nr * p->C;
        ce_add_bf16_k<<<am_blocks(n), AM_THREADS, 0, am_cuda_stream(d)>>>((am_bf16_t *)dx->data + r0 * p->C, g->dx_acc, n);
        AM_LAUNCHED(k);
    }
    if (g->du_acc) {
        int64_t n = nr * lo->r;
        ce_add_bf16_k<<<am_blocks(n), AM_THREADS, 0, am_cuda_stream(d)>>>((am_bf16_t *)lo->du->data + r0 * lo->r,
                                                                          g->du_acc, n);
        AM_LAUNCHED(k);
    }
}

/* ... and dw rounded back once after the passes */
static void grads_end(const char *k, const struct am_dev *d, const struct ce_plan *p, const struct ce_grads *g,
                      struct am_tensor *dw)
{
    if (g->dw_acc) {
        int64_t n = p->V * p->C;
        ce_narrow_k<<<am_blocks(n), AM_THREADS, 0, am_cuda_stream(d)>>>((am_bf16_t *)dw->data, g->dw_acc, n);
        AM_LAUNCHED(k);
    }
}

/* ---- the table's functions ---- */

static void ce_stats(const char *k, const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                     const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                     int64_t vocab_start, float cap, const struct ce_lora *lo)
{
    am_cuda_ctx(k, d);
    check_ce(k, x, w, targets);
    int64_t N = am_rows(x), C = am_cols(x), V = am_rows(w);
    float *md = stat_of(k, "m", m, N), *sd = stat_of(k, "s", s, N), *td = stat_of(k, "t", t, N);
    const int32_t *tg = (const int32_t *)targets->data;
    if (N == 0)
        return;
    if (V == 0) {
        ce_stats_empty_k<<<am_blocks(N), AM_THREADS, 0, am_cuda_stream(d)>>>(md, sd, td, N);
        AM_LAUNCHED(k);
        return;
    }
    struct ce_plan p = ce_plan_for(N, C, V);
    float *L = ce_scratch(k, d, &p, false, false, false, 0).L;
    for (int64_t r0 = 0; r0 < N; r0 += p.R) {
        int64_t nr = N - r0 < p.R ? N - r0 : p.R;
        for (int64_t v0 = 0; v0 < V; v0 += p.VC) {
            int64_t vc = V - v0 < p.VC ? V - v0 : p.VC;
            logits(k, d, &p, x, w, r0, nr, v0, vc, L, lo);
            cap_tile(k, d, &p, L, nr, vc, cap);
            stats_tile(k, d, &p, L, nr, v0, vc, md + r0, sd + r0, td + r0, tg + r0, vocab_start);
        }
    }
}

void am_cuda_ce_stats(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                      const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                      int64_t vocab_start)
{
    ce_stats("am_cuda_ce_stats", d, m, s, t, x, w, targets, vocab_start, 0.0f, NULL);
}

void am_cuda_ce_stats_softcap(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                              const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                              int64_t vocab_start, float softcap)
{
    ce_stats("am_cuda_ce_stats_softcap", d, m, s, t, x, w, targets, vocab_start, softcap, NULL);
}

/* LoRA's tensors checked against x and w (kernels.h: ce_stats_lora); NULL without u. */
static const struct ce_lora *lora_of(const char *k, struct ce_lora *lo, const struct am_tensor *x,
                                     const struct am_tensor *w, const struct am_tensor *u, const struct am_tensor *b,
                                     struct am_tensor *du, struct am_tensor *db)
{
    if (!u)
        return NULL;
    am_cuda_same(k, "u", u, "x", x);
    am_cuda_same(k, "b", b, "x", x);
    lo->u = u;
    lo->b = b;
    lo->du = du;
    lo->db = db;
    lo->r = am_cols(u);
    AM_CUDA_REQUIRE(k, am_rows(u) == am_rows(x) && am_rows(b) == am_rows(w) && am_cols(b) == lo->r,
                    "u (%s) must be [%lld, r] and b (%s) [%lld, r]", am_tname(u), (long long)am_rows(x), am_tname(b),
                    (long long)am_rows(w));
    if (du || db) {
        AM_CUDA_REQUIRE(k, du && db, "du and db come together");
        am_cuda_same(k, "du", du, "u", u);
        am_cuda_stat(k, "db", db);
        AM_CUDA_REQUIRE(k, am_rows(du) == am_rows(u) && am_cols(du) == lo->r && am_rows(db) == am_rows(b) &&
                               am_cols(db) == lo->r,
                        "du (%s) and db (%s) must have u's and b's shapes", am_tname(du), am_tname(db));
    }
    return lo;
}

void am_cuda_ce_stats_lora(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                           const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *u,
                           const struct am_tensor *b, const struct am_tensor *targets, int64_t vocab_start,
                           float softcap)
{
    const char *k = "am_cuda_ce_stats_lora";
    struct ce_lora lb;
    ce_stats(k, d, m, s, t, x, w, targets, vocab_start, softcap, lora_of(k, &lb, x, w, u, b, NULL, NULL));
}

static void ce_backward(const char *k, const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                        const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                        int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S, float dloss_scale,
                        float cap, const struct ce_lora *lo)
{
    am_cuda_ctx(k, d);
    enum am_dtype dt = check_ce(k, x, w, targets);
    int64_t N = am_rows(x), C = am_cols(x), V = am_rows(w);
    const float *Md = stat_of(k, "M", M, N), *Sd = stat_of(k, "S", S, N);
    check_grads(k, dx, dw, x, N, C, V);
    if ((!dx && !dw && !lo) || N == 0 || V == 0)
        return;
    const int32_t *tg = (const int32_t *)targets->data;
    struct ce_plan p = ce_plan_for(N, C, V);
    bool bf = dt == AM_BF16;
    struct ce_grads g = ce_scratch(k, d, &p, bf, bf && dx, dw && dw->dtype == AM_BF16, lo && bf ? lo->r : 0);
    grads_begin(k, d, &p, &g, dw);
    for (int64_t r0 = 0; r0 < N; r0 += p.R) {
        int64_t nr = N - r0 < p.R ? N - r0 : p.R;
        rows_begin(k, d, &p, &g, nr, lo);
        for (int64_t v0 = 0; v0 < V; v0 += p.VC) {
            int64_t vc = V - v0 < p.VC ? V - v0 : p.VC;
            logits(k, d, &p, x, w, r0, nr, v0, vc, g.L, lo);
            cap_tile(k, d, &p, g.L, nr, vc, cap);
            backward_tile(k, d, &p, &g, dx, dw, x, w, tg, vocab_start, Md, Sd, dloss_scale, r0, nr, v0, vc, cap, lo);
        }
        rows_end(k, d, &p, &g, dx, r0, nr, lo);
    }
    grads_end(k, d, &p, &g, dw);
}

void am_cuda_ce_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x,
                         const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start,
                         const struct am_tensor *M, const struct am_tensor *S, float dloss_scale)
{
    ce_backward("am_cuda_ce_backward", d, dx, dw, x, w, targets, vocab_start, M, S, dloss_scale, 0.0f, NULL);
}

void am_cuda_ce_backward_softcap(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                                 const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                                 int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S,
                                 float dloss_scale, float softcap)
{
    ce_backward("am_cuda_ce_backward_softcap", d, dx, dw, x, w, targets, vocab_start, M, S, dloss_scale, softcap, NULL);
}

void am_cuda_ce_backward_lora(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, struct am_tensor *du,
                              struct am_tensor *db, const struct am_tensor *x, const struct am_tensor *w,
                              const struct am_tensor *u, const struct am_tensor *b, const struct am_tensor *targets,
                              int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S, float dloss_scale,
                              float softcap)
{
    const char *k = "am_cuda_ce_backward_lora";
    struct ce_lora lb;
    const struct ce_lora *lo = lora_of(k, &lb, x, w, u, b, du, db);
    AM_CUDA_REQUIRE(k, !u || (du && db), "du and db are required with u");
    ce_backward(k, d, dx, dw, x, w, targets, vocab_start, M, S, dloss_scale, softcap, lo);
}

void am_cuda_ce_rescale(const struct am_dev *d, struct am_tensor *s, const struct am_tensor *m, const struct am_tensor *M)
{
    const char *k = "am_cuda_ce_rescale";
    am_cuda_ctx(k, d);
    am_cuda_stat(k, "s", s);
    int64_t n = am_tensor_numel(s);
    const float *md = stat_of(k, "m", m, n), *Md = stat_of(k, "M", M, n);
    if (!n)
        return;
    ce_rescale_k<<<am_blocks(n), AM_THREADS, 0, am_cuda_stream(d)>>>((float *)s->data, md, Md, n);
    AM_LAUNCHED(k);
}

void am_cuda_ce_loss(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *M, const struct am_tensor *S,
                     const struct am_tensor *T, const struct am_tensor *targets)
{
    const char *k = "am_cuda_ce_loss";
    am_cuda_ctx(k, d);
    double *out = (double *)am_cuda_scalar(k, "acc", acc, AM_F64);
    int64_t n = am_tensor_numel(M);
    const float *Md = stat_of(k, "M", M, n), *Sd = stat_of(k, "S", S, n), *Td = stat_of(k, "T", T, n);
    const int32_t *tg = (const int32_t *)am_cuda_data(k, "targets", targets, AM_I32);
    AM_CUDA_REQUIRE(k, am_tensor_numel(targets) == n, "targets (%s) has %lld entries; M, S and T have %lld",
                    am_tname(targets), (long long)am_tensor_numel(targets), (long long)n);
    if (!n)
        return;
    ce_loss_k<<<1, LOSS_THREADS, 0, am_cuda_stream(d)>>>(out, Md, Sd, Td, tg, n);
    AM_LAUNCHED(k);
}

bool am_cuda_ce_fused(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                      struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x, const struct am_tensor *w,
                      const struct am_tensor *targets, float dloss_scale)
{
    const char *k = "am_cuda_ce_fused";
    am_cuda_ctx(k, d);
    enum am_dtype dt = check_ce(k, x, w, targets);
    AM_CUDA_REQUIRE(k, dx && dw, "dx and dw are required (ce_backward takes either alone)");
    int64_t N = am_rows(x), C = am_cols(x), V = am_rows(w);
    struct ce_plan p = ce_plan_for(N, C, V);
    if (N == 0 || V == 0 || p.VC < V)
        return false; /* more than one tile of vocabulary per row chunk: ce_stats + ce_backward */
    float *md = stat_of(k, "m", m, N), *sd = stat_of(k, "s", s, N), *td = stat_of(k, "t", t, N);
    check_grads(k, dx, dw, x, N, C, V);
    const int32_t *tg = (const int32_t *)targets->data;
    bool bf = dt == AM_BF16;
    struct ce_grads g = ce_scratch(k, d, &p, bf, bf, dw->dtype == AM_BF16, 0);
    grads_begin(k, d, &p, &g, dw);
    for (int64_t r0 = 0; r0 < N; r0 += p.R) {
        int64_t nr = N - r0 < p.R ? N - r0 : p.R;
        rows_begin(k, d, &p, &g, nr, NULL);
        logits(k, d, &p, x, w, r0, nr, 0, V, g.L, NULL);
        stats_tile(k, d, &p, g.L, nr, 0, V, md + r0, sd + r0, td + r0, tg + r0, 0);
        /* the row chunk's statistics are final: M = m, S = s */
        backward_tile(k, d, &p, &g, dx, dw, x, w, tg, 0, md, sd, dloss_scale, r0, nr, 0, V, 0.0f, NULL);
        rows_end(k, d, &p, &g, dx, r0, nr, NULL);
    }
    grads_end(k, d, &p, &g, dw);
    return true;
}
