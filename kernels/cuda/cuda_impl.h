/* cuda_impl.h - private to the CUDA backend (kernels/cuda/): every kernel's prototype (C
 * linkage: the table is built in C, table.c; the kernels are CUDA C++ in the .cu files),
 * the context's state and the checks the kernels share.
 *
 * The context. am_dev_open (cuda.cu) makes the ordinal the calling thread's current device,
 * creates a non-blocking stream (d->stream), a cuBLASLt handle (d->blas) and a GEMM
 * workspace; d->workspace is the backend's own host struct (struct am_cuda_ctx), which owns
 * that workspace (also d->workspace_bytes), a device scratch grown on demand in stream order
 * and kept (the partial sums of the reductions, the sort of the embedding backward, the
 * attention's row sums, cuDNN's workspace with its fp32 dQ accumulator and bf16 dq, dk, dv,
 * the cross-entropy's tiles), the GEMM algorithm cache and, once attention runs on cuDNN, a
 * cuDNN handle on the context's stream and its attention plans per shape
 * (attention_cudnn.cu). The scratch is as large as the largest call asks: the cross-entropy's
 * tiles are at most 160 MiB (crossentropy.cu: 64 MiB of fp32 logits, with bf16 activations 32 MiB of
 * bf16 dlogits and up to 64 MiB of fp32 dx) and, with a bf16 dw only, the whole of dw widened
 * to fp32 besides (V x C x 4 bytes: 2 GiB at 128k x 4096; the model's head gradient is fp32,
 * so only the table's contract asks for it); cuDNN's attention backward takes 6 bytes per
 * element of q (the fp32 dQ accumulator, bf16 dq) and 4 per element of k (bf16 dk, dv) beside
 * its own workspace (225 MiB for 8192 tokens of Llama 3.1 8B's 32 heads of 128). am-plan
 * counts the scratch the model's shapes ask for (its "kernels' scratch", runtime/recipe/plan.c).
 * Kernels are enqueued on d->stream in call order and never wait for it (but where a cuDNN
 * plan is evicted from its cache: attention_cudnn.cu);
 * the thread that calls them must have the context's device current (the opening thread
 * does).
 *
 * Numerics. bf16 storage, fp32 arithmetic, each output rounded once to bf16 (nearest even;
 * the same rounding as the CPU's am_f32_to_bf16, NaN payloads included), as kernels/cpu/
 * does (cpu.h has the dtype rules; this backend checks the same ones). The .cu files are
 * compiled with --fmad=false: a*b+c is not contracted, each operation rounds as in the CPU
 * backend (and torch's separate tensor operations); explicit fmaf stays fused (AdamW).
 * Reductions (sum_squares, the RMSNorm weight gradient, the embedding backward, the own
 * attention's backward, the cross-entropy's statistics and loss) take a fixed order that does
 * not depend on the GPU or the launch: run to run bitwise equal. cuDNN's attention backward
 * is not (attention_cudnn.cu says why; AM_ATTN=own is).
 *
 * Memory. A caching allocator (common.cuh: struct am_cuda_pool) serves alloc, free and the
 * scratch: one arena reserved up front (reserve), blocks reused by size class in stream order;
 * nothing goes back to the device before close (no cudaFree while the context runs).
 *
 * Errors. A tensor of the wrong device, dtype or shape aborts with the kernel's name, the
 * tensor and the rule (am_cuda_fatal); every CUDA call and launch is checked, and a failure
 * aborts naming the kernel and cudaGetErrorString's message (am_cuda_check), as does a
 * failure of cuBLASLt or cuDNN (am_cuda_device_error, with the library's status). Both tell the
 * fault hook first (kernels.h: AM_DEV_FAULT_BUG; AM_DEV_FAULT_ERROR, which the trainer records
 * as a `cuda` cause), and so does an allocation that fails (AM_DEV_FAULT_OOM), so that the
 * program running the kernels can record why before the process ends.
 */
#ifndef AM_KERNELS_CUDA_IMPL_H
#define AM_KERNELS_CUDA_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- context (cuda.cu) ---- */
int am_cuda_open(struct am_dev *d, char *err, size_t err_len);
void am_cuda_close(struct am_dev *d);
void am_cuda_sync(const struct am_dev *d);

/* ---- memory (memory.cu) ---- */
void *am_cuda_alloc(const struct am_dev *d, size_t bytes);
void am_cuda_free(const struct am_dev *d, void *p);
void am_cuda_mem_stats(const struct am_dev *d, struct am_dev_mem *out);
int am_cuda_reserve(const struct am_dev *d, size_t bytes);
void am_cuda_upload(const struct am_dev *d, void *dst, const void *host_src, size_t bytes);
void am_cuda_download(const struct am_dev *d, void *host_dst, const void *src, size_t bytes);
void am_cuda_zero(const struct am_dev *d, struct am_tensor *t);
void am_cuda_copy(const struct am_dev *d, struct am_tensor *dst, const struct am_tensor *src);

/* ---- element-wise and reductions (elementwise.cu) ---- */
void am_cuda_add(const struct am_dev *d, struct am_tensor *dst, const struct am_tensor *src);
void am_cuda_scale(const struct am_dev *d, struct am_tensor *t, float s);
void am_cuda_copy_cols(const struct am_dev *d, struct am_tensor *dst, int64_t dst_col, const struct am_tensor *src,
                       int64_t src_col, int64_t width, int perm, bool accumulate);
void am_cuda_dropout(const struct am_dev *d, struct am_tensor *t, const struct am_dropout *dr);
void am_cuda_convert(const struct am_dev *d, struct am_tensor *dst, const struct am_tensor *src);
void am_cuda_sum_squares(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *t, double div);
void am_cuda_all_finite(const struct am_dev *d, struct am_tensor *flag, const struct am_tensor *t);

/* ---- matmul.cu (cuBLASLt) ---- */
void am_cuda_matmul_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w);
void am_cuda_matmul_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                             const struct am_tensor *x, const struct am_tensor *w);
void am_cuda_bias_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *b);
void am_cuda_bias_backward(const struct am_dev *d, struct am_tensor *db, const struct am_tensor *dy);

/* ---- embedding.cu ---- */
void am_cuda_embedding_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *ids,
                               const struct am_tensor *wte, int64_t vocab_start);
void am_cuda_embedding_backward(const struct am_dev *d, struct am_tensor *dwte, const struct am_tensor *dout,
                                const struct am_tensor *ids, int64_t vocab_start);
/* ---- rmsnorm.cu ---- */
void am_cuda_rmsnorm_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                             const struct am_tensor *w, float eps);
void am_cuda_rmsnorm_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dout,
                              const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *rstd);
/* ---- rope.cu ---- */
void am_cuda_rope_tables(const struct am_dev *d, struct am_tensor *tcos, struct am_tensor *tsin, double theta,
                         const struct am_rope_scaling *scaling);
void am_cuda_rope_forward(const struct am_dev *d, struct am_tensor *x, const struct am_tensor *tcos, const struct am_tensor *tsin);
void am_cuda_rope_backward(const struct am_dev *d, struct am_tensor *dx, const struct am_tensor *tcos, const struct am_tensor *tsin);
/* ---- gpt_oss.cu ---- */
void am_cuda_attention_sink_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                 const struct am_tensor *sinks);
void am_cuda_attention_sink_backward(const struct am_dev *d, struct am_tensor *dsinks, const struct am_tensor *dout,
                                  const struct am_tensor *out, const struct am_tensor *lse, const struct am_tensor *sinks);
void am_cuda_swiglu_clamped_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate,
                                 const struct am_tensor *up, float alpha, float limit);
void am_cuda_swiglu_clamped_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup,
                                  const struct am_tensor *dout, const struct am_tensor *gate, const struct am_tensor *up,
                                  float alpha, float limit);
/* ---- swiglu.cu ---- */
void am_cuda_swiglu_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up);
void am_cuda_swiglu_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                             const struct am_tensor *gate, const struct am_tensor *up);

/* ---- attention.cu: causal grouped-query attention; cuDNN's fused attention where the
 * build has cuDNN and it has the case (AM_ATTN=cudnn, the default), the backend's own
 * kernels otherwise and with AM_ATTN=own ---- */
void am_cuda_attention_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *q,
                               const struct am_tensor *k, const struct am_tensor *v, int64_t window);
void am_cuda_attention_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                                const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                                const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v, int64_t window);
void am_cuda_attention_softcap_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                       const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                       int64_t window, float scale, float softcap);
void am_cuda_attention_softcap_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                        struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                        const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                        const struct am_tensor *v, int64_t window, float scale, float softcap);
void am_cuda_attention_block_softcap_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                             const struct am_tensor *q, const struct am_tensor *k,
                                             const struct am_tensor *v, const struct am_tensor *qpos,
                                             const struct am_tensor *kpos, const struct am_tensor *qstart,
                                             int64_t window, int accumulate, float scale, float softcap);
void am_cuda_attention_block_softcap_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                              struct am_tensor *dv, const struct am_tensor *dout,
                                              const struct am_tensor *out, const struct am_tensor *lse,
                                              const struct am_tensor *q, const struct am_tensor *k,
                                              const struct am_tensor *v, const struct am_tensor *qpos,
                                              const struct am_tensor *kpos, const struct am_tensor *qstart,
                                              int64_t window, float scale, float softcap);
/* ---- gemma.cu: Gemma's RMSNorm with weight 1 + w, GeGLU ---- */
void am_cuda_rmsnorm_offset_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd,
                                    const struct am_tensor *x, const struct am_tensor *w, float eps);
void am_cuda_rmsnorm_offset_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                                     const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                     const struct am_tensor *rstd);
void am_cuda_geglu_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up);
void am_cuda_geglu_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                            const struct am_tensor *gate, const struct am_tensor *up);
/* how many attention calls (forward and backward, this process) each path ran: tests and
 * benchmarks read it to know which path they measured */
void am_cuda_attention_calls(unsigned long long *own, unsigned long long *cudnn);
/* true in a build with cuDNN (attention_cudnn.cu) */
bool am_cuda_attention_has_cudnn(void);
/* attention_cudnn.cu (a build with cuDNN, AM_HAVE_CUDNN): runs the call on cuDNN and returns
 * 0, or returns -1 having enqueued nothing when cuDNN lacks the case (the caller runs the
 * backend's kernels); the context's cuDNN state is freed by am_cuda_attention_cudnn_close. */
int am_cuda_attention_cudnn_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                    int64_t window);
int am_cuda_attention_cudnn_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                                     const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                                     const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                     int64_t window);
/* the last reason cuDNN could not run a case on this context, or NULL */
const char *am_cuda_attention_cudnn_why(const struct am_dev *d);
void am_cuda_attention_cudnn_close(struct am_dev *d);

/* ---- attention_block.cu: one block of queries against one block of keys, masked by
 * position, merged by log-sum-exp (context parallelism's ring attention, packed sequences;
 * f32 or bf16 inputs, fp32 arithmetic: kernels.h says which dtype each argument takes) ---- */
void am_cuda_attention_block_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                     const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                     const struct am_tensor *qpos, const struct am_tensor *kpos,
                                     const struct am_tensor *qstart, int64_t window, int accumulate);
void am_cuda_attention_block_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                      struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                      const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                      const struct am_tensor *v, const struct am_tensor *qpos,
                                      const struct am_tensor *kpos, const struct am_tensor *qstart,
                                     int64_t window);

/* ---- crossentropy.cu: the head's cross-entropy, vocabulary-parallel, in tiles (cuBLASLt + own) ---- */
void am_cuda_ce_stats(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                      const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                      int64_t vocab_start);
void am_cuda_ce_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x,
                         const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start,
                         const struct am_tensor *M, const struct am_tensor *S, float dloss_scale);
void am_cuda_ce_rescale(const struct am_dev *d, struct am_tensor *s, const struct am_tensor *m, const struct am_tensor *M);
void am_cuda_ce_loss(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *M, const struct am_tensor *S,
                     const struct am_tensor *T, const struct am_tensor *targets);
void am_cuda_ce_stats_softcap(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                              const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                              int64_t vocab_start, float softcap);
void am_cuda_ce_backward_softcap(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                                 const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                                 int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S,
                                 float dloss_scale, float softcap);
void am_cuda_ce_stats_lora(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                           const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *u,
                           const struct am_tensor *b, const struct am_tensor *targets, int64_t vocab_start,
                           float softcap);
void am_cuda_ce_backward_lora(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, struct am_tensor *du,
                              struct am_tensor *db, const struct am_tensor *x, const struct am_tensor *w,
                              const struct am_tensor *u, const struct am_tensor *b, const struct am_tensor *targets,
                              int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S, float dloss_scale,
                              float softcap);
bool am_cuda_ce_fused(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                      struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x, const struct am_tensor *w,
                      const struct am_tensor *targets, float dloss_scale);

/* ---- moe.cu: mixture of experts (routing, permutation; grouped GEMMs on cuBLASLt, one per expert) ---- */
void am_cuda_moe_route_forward(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx, struct am_tensor *wts,
                          const struct am_tensor *logits, bool renorm);
void am_cuda_moe_route_sigmoid_forward(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx,
                                       struct am_tensor *wts, const struct am_tensor *logits, const struct am_tensor *bias,
                                       int n_group, int topk_group, bool renorm, float scale);
void am_cuda_moe_route_sigmoid_backward(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                                        const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                                        float aux_scale, bool renorm, float scale);
void am_cuda_moe_route_backward(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                           const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                           float aux_scale, bool renorm);
void am_cuda_moe_aux_stats(const struct am_dev *d, struct am_tensor *cnt, struct am_tensor *psum, const struct am_tensor *probs,
                      const struct am_tensor *idx, bool renorm);
void am_cuda_moe_aux_loss(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *cnt, const struct am_tensor *psum,
                     double scale);
void am_cuda_moe_plan(const struct am_dev *d, struct am_tensor *pos, struct am_tensor *counts, const struct am_tensor *idx);
void am_cuda_moe_permute_forward(const struct am_dev *d, struct am_tensor *xp, const struct am_tensor *x, const struct am_tensor *pos);
void am_cuda_moe_permute_backward(const struct am_dev *d, struct am_tensor *dx, const struct am_tensor *dxp, const struct am_tensor *pos);
void am_cuda_moe_combine_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *yp, const struct am_tensor *pos,
                            const struct am_tensor *wts);
void am_cuda_moe_combine_backward(const struct am_dev *d, struct am_tensor *dyp, struct am_tensor *dwts, const struct am_tensor *dy,
                             const struct am_tensor *yp, const struct am_tensor *pos, const struct am_tensor *wts);
void am_cuda_grouped_matmul_forward(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w,
                               const int64_t *counts);
void am_cuda_grouped_matmul_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                                const struct am_tensor *x, const struct am_tensor *w, const int64_t *counts);

/* ---- adamw.cu ---- */
void am_cuda_adamw(const struct am_dev *d, struct am_tensor *param, const struct am_tensor *grad, struct am_tensor *m,
                   struct am_tensor *v, float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step);
void am_cuda_adamw_multi(const struct am_dev *d, const struct am_adamw_tensor *list, int n, const struct am_tensor *sumsq,
                         double max_norm, const struct am_tensor *finite, float lr, float beta1, float beta2, float eps,
                         float weight_decay, int64_t step);

#ifdef __cplusplus
}
#endif

#endif
