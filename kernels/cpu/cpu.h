/* cpu.h - private to the CPU backend (kernels/cpu/): every kernel's prototype, the checks
 * they share, and the few numerical helpers (a vectorisable exp) used by more than one file.
 *
 * Threads. The backend keeps one pool of threads, OpenMP's: element-wise kernels,
 * attention and the cross-entropy chunks run in OpenMP parallel regions, and OpenBLAS is
 * set to one thread (am_kernels_cpu() does it) and called from inside those regions on
 * disjoint slices. Two pools (OpenMP's and OpenBLAS's own) on the same cores spin against
 * each other between calls; one pool sized by OMP_NUM_THREADS does not.
 *
 * Errors. The table's functions return nothing; a tensor of the wrong device, dtype or
 * shape is a bug in the caller, so the kernel names itself, the tensor and the rule on
 * stderr and aborts (am_cpu_fatal), rather than computing garbage.
 */
#ifndef AM_KERNELS_CPU_H
#define AM_KERNELS_CPU_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "kernels.h"

/* The hot loops are compiled three times, for AVX-512 (x86-64-v4), AVX2 (x86-64-v3) and
 * the baseline, and the loader picks one for the machine (GCC's target_clones, an ifunc):
 * the build stays portable (no -march) and still uses the wide vectors where they exist.
 * Floating-point contraction stays off (-std=c11), so no clone fuses a*b+c. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && !defined(AM_NO_CLONES)
#define AM_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define AM_HOT
#endif

/* Helpers called from AM_HOT functions must be inlined into each clone (a helper left out
 * of line is compiled for the baseline only). */
#define AM_INLINE static inline __attribute__((always_inline))

/* Element-wise work below this many elements stays on the calling thread: opening a
 * parallel region costs a few microseconds, more than streaming 32k floats. */
#define AM_PAR_MIN 32768

/* ---- checks ---- */
_Noreturn void am_cpu_fatal(const char *kernel, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define AM_CHECK(cond, ...)                                                                                          \
    do {                                                                                                             \
        if (!(cond))                                                                                                 \
            am_cpu_fatal(__func__, __VA_ARGS__);                                                                     \
    } while (0)

/* The tensor's data as fp32 / int32, after checking that it lives on the CPU with that
 * dtype; `what` names the argument in the message ("x", "dw", ...). */
float *am_cpu_f32(const char *kernel, const char *what, const struct am_tensor *t);
const int32_t *am_cpu_i32(const char *kernel, const char *what, const struct am_tensor *t);
/* Any dtype, checked; and a one-element f64 (a device scalar). */
void *am_cpu_data(const char *kernel, const char *what, const struct am_tensor *t, enum am_dtype dtype);
double *am_cpu_scalar_f64(const char *kernel, const char *what, const struct am_tensor *t);
/* Device, dimensions and data of any dtype (a dtype's name: am_dtype_name, dtype.h). */
void am_cpu_check(const char *kernel, const char *what, const struct am_tensor *t);
#define F32(t) am_cpu_f32(__func__, #t, (t))
#define I32(t) am_cpu_i32(__func__, #t, (t))
#define F64_SCALAR(t) am_cpu_scalar_f64(__func__, #t, (t))

/* A tensor seen as a matrix: the last dimension is the row, the others are rows. */
static inline int64_t am_cols(const struct am_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }
static inline int64_t am_rows(const struct am_tensor *t)
{
    int64_t c = am_cols(t);
    return c ? am_tensor_numel(t) / c : 0;
}
static inline const char *am_tname(const struct am_tensor *t) { return t->name ? t->name : "(unnamed)"; }

/* The slice [*lo, *hi) of n items that thread `id` of `nth` owns, its edges rounded to a
 * multiple of `align` (contiguous, cache- and vector-friendly pieces). */
static inline void am_split(int64_t n, int id, int nth, int64_t align, int64_t *lo, int64_t *hi)
{
    int64_t blocks = (n + align - 1) / align;
    *lo = blocks * id / nth * align;
    *hi = blocks * (id + 1) / nth * align;
    if (*lo > n)
        *lo = n;
    if (*hi > n)
        *hi = n;
}

/* ---- a vectorisable expf ----
 * exp(x) = 2^n * exp(r) with n = round(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2]
 * (Cody-Waite: ln 2 = C1 + C2 with C1 short enough that n*C1 is exact), exp(r) by Cephes'
 * minimax polynomial (about 1 ulp, like glibc's expf), and 2^n applied as two factors
 * 2^(n/2) 2^(n - n/2), each a normal float built in the exponent bits, so that n = 128
 * (x up to ln FLT_MAX) needs no special case. n comes from "magic number" rounding (adding
 * 1.5 * 2^23 leaves round(x / ln 2) in the low mantissa bits): no float->int conversion,
 * so the loop vectorises without -ffast-math. Outside the normal range: x > ln FLT_MAX
 * gives +Inf (as expf), x < ln FLT_MIN gives 0 (expf would give a denormal below 1.2e-38;
 * 0 avoids denormal arithmetic and no sum we take can tell). NaN propagates. */
AM_INLINE float am_expf(float x)
{
    float xc = x < -87.33654f ? -87.33654f : x;
    xc = xc > 88.72283f ? 88.72283f : xc;
    float t = xc * 1.44269504088896341f + 12582912.0f;
    float n = t - 12582912.0f;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    uint32_t tb;
    memcpy(&tb, &t, sizeof tb);
    int32_t ni = (int32_t)(tb - 0x4B400000u); /* n, from t's low bits (two's complement) */
    int32_t na = ni >> 1, nb = ni - na;
    uint32_t ea = (uint32_t)(na + 127) << 23, eb = (uint32_t)(nb + 127) << 23;
    float sa, sb;
    memcpy(&sa, &ea, sizeof sa);
    memcpy(&sb, &eb, sizeof sb);
    float y = p * sa * sb;
    y = x < -87.33654f ? 0.0f : y;
    y = x > 88.72283f ? INFINITY : y;
    return y;
}

/* ---- bf16 storage, fp32 arithmetic (the context and the rules: cpu.c; widening and
 * narrowing: bf16.c; the mixed-precision matrix product: matmul.c) ----
 * Mixed precision as PyTorch's FSDP2 MixedPrecisionPolicy(param_dtype=bf16) runs it:
 * activations, their gradients and the weights' working copy may be bf16; master weights,
 * optimizer state and (optionally) parameter gradients stay fp32. Every kernel that takes
 * bf16 tensors widens them exactly to fp32, computes in fp32 as its fp32 path does, and
 * rounds each output once to bf16 (nearest even); a += into a bf16 gradient widens it,
 * adds in fp32 and rounds once. Each kernel's fp32 entry point checks first whether any
 * tensor is not f32 and only then hands over to its bf16 path (am_cpu_*_bf16 beside it in
 * the kernel's file), so the fp32 path is the code it always was.
 *
 * The dtype rules (a break is a caller's bug: the kernel names the tensor and the rule):
 *   - one "activation dtype" per call, f32 or bf16: the kernel's inputs, outputs and
 *     activation gradients, and a weight given as w / wte / the norm's w, all share it;
 *   - a parameter gradient (dw, dwte, the norm's dw) is f32, or bf16 when the activations
 *     are bf16 (f32 with bf16 activations: the products are accumulated into fp32 as they
 *     are, never rounded to bf16);
 *   - statistics (rstd, lse, m, s, t, M, S) are f32, token ids i32; rope's tables f32 or bf16.
 *
 * Scratch. The widened operands live in the context's scratch (dev->workspace: a buffer
 * grown on demand, kept until am_dev_close), taken once per call on the calling thread,
 * before any parallel region; the threads of the call use disjoint slices of it. Work is
 * cut into chunks of at most AM_BF16_CHUNK floats per operand, so the scratch stays bounded
 * by the chunk size (and, for a bf16 parameter gradient, by that parameter's size: it is
 * accumulated in fp32 over the whole call and rounded once). One context runs one kernel at
 * a time (as a CUDA stream does). */
#define AM_BF16_CHUNK ((int64_t)1 << 22)
/* The chunk size of dev (AM_BF16_CHUNK unless a test set a smaller one, n <= 0: the default,
 * to run the chunked paths on small tensors). */
int64_t am_cpu_chunk(const struct am_dev *dev);
void am_cpu_set_chunk(const struct am_dev *dev, int64_t n);
/* The context (cpu.c): its scratch and its count of allocated bytes. */
int am_cpu_open(struct am_dev *dev, char *err, size_t err_len);
/* The context's count of bytes handed out by am_cpu_alloc (memory.c): + bytes, or - when freed. */
void am_cpu_account(const struct am_dev *dev, size_t bytes, bool freed);
void am_cpu_mem_stats(const struct am_dev *dev, struct am_dev_mem *out);
void am_cpu_close(struct am_dev *dev);
/* nfloats of 64-byte aligned scratch (contents undefined), valid until the next call. */
float *am_cpu_scratch(const char *kernel, const struct am_dev *dev, int64_t nfloats);
/* The next n floats of a scratch area, 64-byte aligned (advances *p). */
float *am_cpu_carve(float **p, int64_t n);
/* Whether t is given and not f32: a kernel's cue to take its bf16 path. */
static inline bool am_not_f32(const struct am_tensor *t) { return t && t->dtype != AM_F32; }
/* The rules above: am_cpu_act checks t (any CPU tensor) and returns its dtype, which must be
 * f32 or bf16; am_cpu_same wants t to have ref's dtype; am_cpu_grad wants a parameter
 * gradient that is f32, or bf16 when the activations (ref) are bf16; am_cpu_stat wants f32. */
enum am_dtype am_cpu_act(const char *kernel, const char *what, const struct am_tensor *t);
void am_cpu_same(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                 const struct am_tensor *ref);
void am_cpu_grad(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                 const struct am_tensor *ref);
void am_cpu_stat(const char *kernel, const char *what, const struct am_tensor *t);
/* A gated unit's tensors (GeGLU, the clamped SwiGLU): gate an activation, up and a (the output,
 * or its gradient) of gate's dtype and element count. */
void am_cpu_glu_check(const char *kernel, const struct am_tensor *a, const struct am_tensor *gate,
                      const struct am_tensor *up);
/* Element i of an f32 or bf16 tensor as fp32, and stored back (rounded once when bf16). */
static inline float am_cpu_ld(const struct am_tensor *t, int64_t i)
{
    return t->dtype == AM_F32 ? ((const float *)t->data)[i] : am_bf16_to_f32(((const uint16_t *)t->data)[i]);
}
static inline void am_cpu_st(struct am_tensor *t, int64_t i, float v)
{
    if (t->dtype == AM_F32)
        ((float *)t->data)[i] = v;
    else
        ((uint16_t *)t->data)[i] = am_f32_to_bf16(v);
}
/* bf16.c: exact widening and round-to-nearest-even narrowing of rows x cols blocks (rows ld
 * apart), parallel over rows when large. */
void am_bf16_widen(float *dst, int64_t ldd, const uint16_t *src, int64_t lds, int64_t rows, int64_t cols);
void am_bf16_narrow(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols);
/* The same on the calling thread only (inside a parallel region): one row of n. */
void am_bf16_widen1(float *dst, const uint16_t *src, int64_t n);
void am_bf16_narrow1(uint16_t *dst, const float *src, int64_t n);
/* Elements [off, off + n) of t as fp32: t's own memory when t is f32, else widened into buf. */
float *am_cpu_load(const struct am_tensor *t, int64_t off, int64_t n, float *buf);
/* Writes back what am_cpu_load gave (a no-op when t is f32): buf rounded once into t. */
void am_cpu_store(struct am_tensor *t, int64_t off, int64_t n, const float *buf);
/* An f32 view of scratch memory. */
static inline struct am_tensor am_f32_view(float *p, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(p, AM_DEV_CPU, AM_F32, d0, d1, d2, d3);
}
/* matmul.c: C[M,N] = beta C + op(A) op(B) for A, B, C each f32 or bf16, row-major with leading
 * dimensions lda, ldb, ldc, op(A) [M,L], op(B) [L,N]: tiles of C (up to 512 x 512) are
 * accumulated in fp32 over blocks of L, the bf16 blocks widened into scratch, the sgemm
 * driver on the fp32 blocks (or OpenBLAS's sbgemm on the bf16 ones, where configure found
 * it), each tile of a bf16 C rounded once. */
struct am_mat {
    void *p;
    enum am_dtype dt;
    int64_t ld;
};
void am_cpu_gemm_mixed(const char *kernel, const struct am_dev *dev, bool ta, bool tb, int64_t M, int64_t N, int64_t L,
                       struct am_mat A, struct am_mat B, float beta, struct am_mat C);

/* ---- the kernels, one file per family (forward beside backward) ---- */
/* memory.c */
void *am_cpu_alloc(const struct am_dev *dev, size_t bytes);
void am_cpu_free(const struct am_dev *dev, void *p);
void am_cpu_upload(const struct am_dev *dev, void *dst, const void *host_src, size_t bytes);
void am_cpu_download(const struct am_dev *dev, void *host_dst, const void *src, size_t bytes);
void am_cpu_zero(const struct am_dev *dev, struct am_tensor *t);
void am_cpu_copy(const struct am_dev *dev, struct am_tensor *dst, const struct am_tensor *src);
/* elementwise.c */
void am_cpu_add(const struct am_dev *dev, struct am_tensor *dst, const struct am_tensor *src);
void am_cpu_scale(const struct am_dev *dev, struct am_tensor *t, float s);
void am_cpu_copy_cols(const struct am_dev *dev, struct am_tensor *dst, int64_t dst_col, const struct am_tensor *src,
                      int64_t src_col, int64_t width, int perm, bool accumulate);
void am_cpu_dropout(const struct am_dev *dev, struct am_tensor *t, const struct am_dropout *dr);
void am_cpu_convert(const struct am_dev *dev, struct am_tensor *dst, const struct am_tensor *src);
void am_cpu_sum_squares(const struct am_dev *dev, struct am_tensor *acc, const struct am_tensor *t, double div);
void am_cpu_all_finite(const struct am_dev *dev, struct am_tensor *flag, const struct am_tensor *t);
/* matmul.c */
void am_cpu_matmul_forward(const struct am_dev *dev, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w);
void am_cpu_matmul_backward(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                            const struct am_tensor *x, const struct am_tensor *w);
void am_cpu_bias_forward(const struct am_dev *dev, struct am_tensor *y, const struct am_tensor *b);
void am_cpu_bias_backward(const struct am_dev *dev, struct am_tensor *db, const struct am_tensor *dy);
/* The shared sgemm driver: C[M,N] = alpha * op(A) op(B) + beta * C, row-major, split over
 * the OpenMP threads on the larger of M and N when the product is big enough. Called from
 * outside any parallel region. */
void am_cpu_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                  int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
/* One single-threaded sgemm on the calling thread (for use inside a parallel region). */
void am_cpu_sgemm1(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                   int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
/* embedding.c */
void am_cpu_embedding_forward(const struct am_dev *dev, struct am_tensor *out, const struct am_tensor *ids, const struct am_tensor *wte,
                              int64_t vocab_start);
void am_cpu_embedding_backward(const struct am_dev *dev, struct am_tensor *dwte, const struct am_tensor *dout, const struct am_tensor *ids,
                               int64_t vocab_start);
/* rmsnorm.c */
void am_cpu_rmsnorm_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                            const struct am_tensor *w, float eps);
void am_cpu_rmsnorm_backward(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dout,
                             const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *rstd);
/* The fp32 backward on chunks of rows widened into scratch (read in place when f32) with the
 * weight w + w_offset (Gemma's 1 + w); a bf16 dw is accumulated in fp32 over every chunk and
 * rounded once. kernel: the caller's name in argument errors. */
void am_cpu_rmsnorm_backward_rows(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw,
                                  const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                  const struct am_tensor *rstd, float w_offset, const char *kernel);
/* rope.c */
void am_cpu_rope_tables(const struct am_dev *dev, struct am_tensor *tcos, struct am_tensor *tsin, double theta,
                        const struct am_rope_scaling *scaling);
void am_cpu_rope_forward(const struct am_dev *dev, struct am_tensor *x, const struct am_tensor *tcos, const struct am_tensor *tsin);
void am_cpu_rope_backward(const struct am_dev *dev, struct am_tensor *dx, const struct am_tensor *tcos, const struct am_tensor *tsin);
/* attention.c */
void am_cpu_attention_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *q,
                              const struct am_tensor *k, const struct am_tensor *v, int64_t window);
void am_cpu_attention_backward(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                               const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                               const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                               int64_t window);
void am_cpu_attention_softcap_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse,
                                      const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                      int64_t window, float scale, float cap);
void am_cpu_attention_softcap_backward(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk,
                                       struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                       const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                       const struct am_tensor *v, int64_t window, float scale, float cap);
/* gemma.c: Gemma's RMSNorm with weight 1 + w, GeGLU */
void am_cpu_rmsnorm_offset_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *rstd,
                                   const struct am_tensor *x, const struct am_tensor *w, float eps);
void am_cpu_rmsnorm_offset_backward(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw,
                                    const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                    const struct am_tensor *rstd);
void am_cpu_geglu_forward(const struct am_dev *dev, struct am_tensor *out, const struct am_tensor *gate,
                          const struct am_tensor *up);
void am_cpu_geglu_backward(const struct am_dev *dev, struct am_tensor *dgate, struct am_tensor *dup,
                           const struct am_tensor *dout, const struct am_tensor *gate, const struct am_tensor *up);
/* attention_block.c */
void am_cpu_attention_block_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse,
                                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                    const struct am_tensor *qpos, const struct am_tensor *kpos,
                                    const struct am_tensor *qstart, int64_t window, int accumulate);
void am_cpu_attention_block_backward(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk,
                                     struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                     const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                     const struct am_tensor *v, const struct am_tensor *qpos,
                                     const struct am_tensor *kpos, const struct am_tensor *qstart,
                                     int64_t window);
void am_cpu_attention_block_softcap_forward(const struct am_dev *dev, struct am_tensor *out, struct am_tensor *lse,
                                            const struct am_tensor *q, const struct am_tensor *k,
                                            const struct am_tensor *v, const struct am_tensor *qpos,
                                            const struct am_tensor *kpos, const struct am_tensor *qstart,
                                            int64_t window, int accumulate, float scale, float cap);
void am_cpu_attention_block_softcap_backward(const struct am_dev *dev, struct am_tensor *dq, struct am_tensor *dk,
                                             struct am_tensor *dv, const struct am_tensor *dout,
                                             const struct am_tensor *out, const struct am_tensor *lse,
                                             const struct am_tensor *q, const struct am_tensor *k,
                                             const struct am_tensor *v, const struct am_tensor *qpos,
                                             const struct am_tensor *kpos, const struct am_tensor *qstart,
                                             int64_t window, float scale, float cap);
/* gpt_oss.c: gpt-oss's attention sinks and clamped SwiGLU */
void am_cpu_attention_sink_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                 const struct am_tensor *sinks);
void am_cpu_attention_sink_backward(const struct am_dev *d, struct am_tensor *dsinks, const struct am_tensor *dout,
                                  const struct am_tensor *out, const struct am_tensor *lse, const struct am_tensor *sinks);
void am_cpu_swiglu_clamped_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate,
                                 const struct am_tensor *up, float alpha, float limit);
void am_cpu_swiglu_clamped_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup,
                                  const struct am_tensor *dout, const struct am_tensor *gate, const struct am_tensor *up,
                                  float alpha, float limit);
/* swiglu.c */
void am_cpu_swiglu_forward(const struct am_dev *dev, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up);
void am_cpu_swiglu_backward(const struct am_dev *dev, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                            const struct am_tensor *gate, const struct am_tensor *up);
/* moe.c: mixture of experts (routing, permutation, grouped GEMMs) */
void am_cpu_moe_route_forward(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx, struct am_tensor *wts,
                          const struct am_tensor *logits, bool renorm);
void am_cpu_moe_route_sigmoid_forward(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx,
                                      struct am_tensor *wts, const struct am_tensor *logits, const struct am_tensor *bias,
                                      int n_group, int topk_group, bool renorm, float scale);
void am_cpu_moe_route_sigmoid_backward(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                                       const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                                       float aux_scale, bool renorm, float scale);
void am_cpu_moe_route_backward(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                           const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                           float aux_scale, bool renorm);
void am_cpu_moe_aux_stats(const struct am_dev *d, struct am_tensor *cnt, struct am_tensor *psum, const struct am_tensor *probs,
                      const struct am_tensor *idx, bool renorm);
void am_cpu_moe_aux_loss(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *cnt, const struct am_tensor *psum,
                     double scale);
void am_cpu_moe_plan(const struct am_dev *d, struct am_tensor *pos, struct am_tensor *counts, const struct am_tensor *idx);
void am_cpu_moe_permute_forward(const struct am_dev *d, struct am_tensor *xp, const struct am_tensor *x, const struct am_tensor *pos);
void am_cpu_moe_permute_backward(const struct am_dev *d, struct am_tensor *dx, const struct am_tensor *dxp, const struct am_tensor *pos);
void am_cpu_moe_combine_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *yp, const struct am_tensor *pos,
                            const struct am_tensor *wts);
void am_cpu_moe_combine_backward(const struct am_dev *d, struct am_tensor *dyp, struct am_tensor *dwts, const struct am_tensor *dy,
                             const struct am_tensor *yp, const struct am_tensor *pos, const struct am_tensor *wts);
void am_cpu_grouped_matmul_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w,
                               const int64_t *counts);
void am_cpu_grouped_matmul_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                                const struct am_tensor *x, const struct am_tensor *w, const int64_t *counts);
/* crossentropy.c */
void am_cpu_ce_stats(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t, const struct am_tensor *x,
                     const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start);
void am_cpu_ce_backward(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x,
                        const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start,
                        const struct am_tensor *M, const struct am_tensor *S, float dloss_scale);
void am_cpu_ce_rescale(const struct am_dev *dev, struct am_tensor *s, const struct am_tensor *m, const struct am_tensor *M);
void am_cpu_ce_loss(const struct am_dev *dev, struct am_tensor *acc, const struct am_tensor *M, const struct am_tensor *S,
                    const struct am_tensor *T, const struct am_tensor *targets);
void am_cpu_ce_stats_softcap(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                             const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                             int64_t vocab_start, float cap);
void am_cpu_ce_backward_softcap(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw,
                                const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                                int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S,
                                float dloss_scale, float cap);
void am_cpu_ce_stats_lora(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                          const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *u,
                          const struct am_tensor *b, const struct am_tensor *targets, int64_t vocab_start, float cap);
void am_cpu_ce_backward_lora(const struct am_dev *dev, struct am_tensor *dx, struct am_tensor *dw, struct am_tensor *du,
                             struct am_tensor *db, const struct am_tensor *x, const struct am_tensor *w,
                             const struct am_tensor *u, const struct am_tensor *b, const struct am_tensor *targets,
                             int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S, float dloss_scale,
                             float cap);
bool am_cpu_ce_fused(const struct am_dev *dev, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t, struct am_tensor *dx,
                     struct am_tensor *dw, const struct am_tensor *x, const struct am_tensor *w,
                     const struct am_tensor *targets, float dloss_scale);
/* adamw.c */
void am_cpu_adamw(const struct am_dev *dev, struct am_tensor *param, const struct am_tensor *grad, struct am_tensor *m, struct am_tensor *v,
                  float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step);
void am_cpu_adamw_multi(const struct am_dev *dev, const struct am_adamw_tensor *list, int n, const struct am_tensor *sumsq,
                        double max_norm, const struct am_tensor *finite, float lr, float beta1, float beta2, float eps,
                        float weight_decay, int64_t step);

#endif
