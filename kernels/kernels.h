/* kernels.h - the math of a Llama-style transformer, forward beside backward, behind one
 * table of functions per device. The model never calls a backend directly: it holds a device
 * context (struct am_dev, opened with am_dev_open) and calls through the context's table,
 * passing the context to every kernel.
 *
 * Device contexts. A context is where kernels run and what they may use there: the device,
 * a stream (CUDA: every kernel is enqueued on it, in call order), a BLAS handle and a
 * workspace. The CPU backend needs none of them and runs each kernel to completion in the
 * call. Kernels do not synchronise with the host: results that the host needs (the loss, the
 * gradient norm, the finiteness of the gradients) are reductions into device scalars that the
 * caller reads once per step (download, which waits for the stream).
 *
 * Conventions (the same for every backend):
 *   - Shapes are given by the tensors; 2-d [rows, cols] row-major unless said otherwise.
 *     Activations are [N, C] with N = B * T tokens (batch-major), heads laid out as
 *     [B, T, H, D] (Hugging Face's layout before its transpose).
 *   - Backward functions ACCUMULATE (+=) into every gradient they write, activations'
 *     and parameters' alike: the caller zeroes gradient buffers once per step (llm.c's
 *     convention), which also makes residual connections and tied weights free.
 *   - Tensor parallelism is expressed by the caller (the sharded shapes and the collectives
 *     around the calls); the vocabulary-parallel pieces take the shard's first vocabulary id.
 *   - Parameters, gradients and activations are AM_F32, or for mixed precision (PyTorch
 *     FSDP2's MixedPrecisionPolicy(param_dtype=bf16)) AM_BF16: a kernel's activations,
 *     activation gradients and weight (the bf16 working copy) share one dtype; a parameter
 *     gradient (dw, dwte, the norm's dw) is F32, or BF16 with BF16 activations; statistics
 *     saved for backward (rstd, lse, m, s, t, M, S) stay F32; adamw's parameters and
 *     moments are F32, or all three BF16 (see adamw), its gradient F32 (or BF16 for
 *     BF16 parameters). bf16
 *     tensors are computed on in fp32 and each output is rounded once to bf16 (nearest
 *     even); a += into a bf16 gradient adds in fp32 and rounds once (kernels/cpu/cpu.h has
 *     the rules, each kernel's file where it rounds differently from PyTorch's bf16 ops).
 *     Token ids and targets are AM_I32. A target < 0 is ignored (no loss, no gradient).
 *     Device scalars are one-element tensors: AM_F64 accumulators, AM_I32 flags.
 * A tensor of the wrong device, dtype or shape is a bug in the caller: the backend names the
 * kernel, the tensor and the rule on stderr and aborts (the functions return no status).
 */
#ifndef AM_KERNELS_H
#define AM_KERNELS_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor.h"

#ifdef __cplusplus
extern "C" { /* the CUDA backend's .cu files are C++ */
#endif

struct am_rope_scaling {
    const char *type; /* NULL or "default" (none), "llama3", "linear", "yarn" */
    double factor, low_freq_factor, high_freq_factor;
    long original_max_position_embeddings;
    /* yarn (transformers' _compute_yarn_parameters; kernels/cpu/rope.c): 0 stands for a key
     * absent from rope_parameters (beta_fast 32, beta_slow 1; attention_factor computed from
     * factor, with mscale and mscale_all_dim when both are set); no_truncate: truncate false */
    double beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim;
    bool no_truncate;
};

/* yarn's get_mscale (transformers' get_mscale / yarn_get_mscale): 1 for scale <= 1, else
 * 0.1 mscale ln(scale) + 1, in double. The tables' attention factor (kernels/cpu/rope.c) and
 * deepseek_v3's softmax scale (runtime/model/layer.c) are made of it. */
static inline double am_yarn_mscale(double scale, double mscale)
{
    return scale <= 1 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

struct am_kernels;

/* The update rule of one tensor of adamw_multi (am_adamw_tensor.te): 0 is torch.optim.AdamW's
 * arithmetic (adamw); AM_TE_ADAM is Transformer Engine's FusedAdam's functor (adamw_multi),
 * with its options as further bits. */
enum {
    AM_TE_ADAM = 1,        /* Transformer Engine's arithmetic */
    AM_TE_L2 = 2,          /* adam_w_mode false: decay * p added to the gradient (else AdamW's) */
    AM_TE_NO_BIAS_CORR = 4, /* bias_correction false */
    AM_TE_GRAD_BF16 = 8,   /* the model's parameters are bf16 (with fp32 masters or without): the
                              gradient TE reads is bf16, the fp32 one rounded (FSDP2's cast; or a
                              bf16 gradient as it is), the clipping's product rounded again */
};

/* One tensor of adamw_multi's list: a parameter, its gradient and Adam's two moments (the
 * same number of elements). te 0 (torch's AdamW): param, m and v all fp32 or all bf16, grad
 * fp32, or bf16 with bf16 ones (see adamw). te with AM_TE_ADAM: param (the master), m and v
 * each fp32 or bf16 on its own, grad fp32, or bf16 with AM_TE_GRAD_BF16.
 *
 * rem (AM_TE_ADAM only; NULL: none): FusedAdam's store_param_remainders, an fp32 master kept
 * as the bf16 parameter (param, bf16) and the master's low 16 bits (rem: 16-bit words, its
 * dtype AM_BF16 only as their container). TE's split: the parameter is the master's high half
 * plus one when the low half's top bit is set (the master rounded to nearest, ties away from
 * zero), the remainder the low half; the master is rebuilt from the two exactly (the high
 * half less one when the remainder's top bit is set), stepped as an fp32 master, and split
 * again: am_te_master_split and am_te_master_join (half.h). */
struct am_adamw_tensor {
    struct am_tensor *param, *m, *v;
    const struct am_tensor *grad;
    struct am_tensor *rem;
    unsigned te; /* 0, or AM_TE_ADAM | its options */
};

/* A device context (see above). One per rank for now; a later stream for communication
 * gets a context of its own on the same device. */
struct am_dev {
    const struct am_kernels *k; /* the backend's table */
    enum am_device device;
    int ordinal;                /* the CUDA device; -1 on the CPU */
    void *stream;               /* cudaStream_t; NULL on the CPU */
    void *blas;                 /* cublasLtHandle_t; NULL on the CPU */
    void *workspace;            /* the backend's own struct: the CPU's owns a buffer grown on demand
                                 * (widened bf16 operands); CUDA's the GEMM workspace, a device
                                 * scratch and the GEMM algorithm cache (kernels/cuda/cuda_impl.h) */
    size_t workspace_bytes;
    char name[96];              /* the device's name ("NVIDIA H200"; "cpu") */
    int cc_major, cc_minor;     /* CUDA compute capability; 0 on the CPU */
};

/* Opens a context on a device (ordinal: the CUDA device, ignored on the CPU). Returns 0, or
 * -1 with a message naming the device and why (no such backend in this build, no device). */
int am_dev_open(struct am_dev *d, enum am_device device, int ordinal, char *err, size_t err_len);
void am_dev_close(struct am_dev *d);

/* n elements of device memory src in dtype dt (AM_F32 or AM_BF16) read into host fp32 (exact),
 * and host fp32 written to device memory dst in dt (rounded to nearest even, as torch's
 * .to(bfloat16)): the host side of weights and optimizer state kept in bf16. */
void am_dev_download_f32(const struct am_dev *d, enum am_dtype dt, float *host, const void *src, size_t n);
void am_dev_upload_f32(const struct am_dev *d, enum am_dtype dt, void *dst, const float *host, size_t n);
const char *am_device_name(enum am_device device);

/* ---- failures of the device, told to whoever runs it ----
 * The kernels print no log of their own. A program that wants to record why its device failed
 * (the trainer writes a cause record, runtime/train/crash.h) installs a hook; the backends call
 * it when an allocation fails (AM_DEV_FAULT_OOM, before alloc returns NULL or a kernel's
 * scratch aborts) and before they abort on a device error (AM_DEV_FAULT_ERROR: a CUDA call or
 * launch, cuBLASLt or cuDNN that failed, with the library's text for it) or on a caller's bug
 * (AM_DEV_FAULT_BUG: a tensor of the wrong device, dtype or shape), and to tell of a path
 * taken instead of the usual one, nothing having failed (AM_DEV_FAULT_NOTE: cuDNN declined an
 * attention case, the backend's own kernels run it; told once per process). The hook runs on
 * the calling thread, may write a file, and returns; after an ERROR or a BUG the backend then
 * prints its message on stderr and aborts (SIGABRT). One hook per process (the device's
 * checks have no context to carry one: am_cuda_check is called from deep inside kernels), set
 * before the device is opened and left alone while it runs; NULL removes it. */
enum am_dev_fault_kind { AM_DEV_FAULT_OOM, AM_DEV_FAULT_ERROR, AM_DEV_FAULT_BUG, AM_DEV_FAULT_NOTE };

struct am_dev_fault {
    enum am_dev_fault_kind kind;
    const char *backend;        /* "cpu", "cuda" */
    int ordinal;                /* the device (-1: the CPU, or not known) */
    const char *where;          /* the kernel or call that failed ("am_cuda_alloc", "cudaMallocAsync") */
    const char *error;          /* the device's text for the error (cudaGetErrorString), or "" */
    const char *message;        /* the whole message, as stderr gets it */
    /* OOM: what was asked for, what the allocator holds from the device (reserved) and how much
     * of that is handed out (in use), and the device's total memory (0: not known) */
    size_t bytes_asked, bytes_held, bytes_in_use, bytes_total;
};
typedef void (*am_dev_fault_fn)(void *arg, const struct am_dev_fault *f);
void am_kernels_set_fault_hook(am_dev_fault_fn fn, void *arg);
/* The backends' call: runs the hook, if any (at most once per process for ERROR and BUG: an
 * abort in the hook's wake does not report twice). */
void am_kernels_fault(const struct am_dev_fault *f);

/* A device's memory, as its allocator sees it. */
struct am_dev_mem {
    size_t held;     /* reserved from the device (CUDA: the caching allocator's pool; CPU: = in_use) */
    size_t in_use;   /* handed out by alloc and not freed */
    size_t peak;     /* the most in_use so far */
    size_t total;    /* the device's memory (0: not known, the CPU) */
};

/* dropout's mask (am_kernels.dropout) */
struct am_dropout {
    float p;                   /* the probability of a zero, 0 < p < 1 */
    uint64_t seed, stream;
    int64_t seq0, seq_step;    /* the global index of the rows' first sequence, and the step to the next */
    int64_t seq_len;           /* the whole sequence's tokens */
    int64_t rows_per_seq;      /* the rows of each sequence in t (seq_len, or its share under cp) */
    const int32_t *pos;        /* their positions in the sequence (device memory), or NULL: 0, 1, ... */
    int64_t col0, cols;        /* t's first column in the whole tensor, and the whole tensor's columns */
};

struct am_kernels {
    const char *name;
    enum am_device device;
    /* the backend's part of am_dev_open / am_dev_close (NULL: nothing to do) */
    int (*open)(struct am_dev *d, char *err, size_t err_len);
    void (*close)(struct am_dev *d);
    /* waits until every kernel enqueued on d has finished (the CPU: returns at once) */
    void (*sync)(const struct am_dev *d);

    /* ---- memory ---- */
    void *(*alloc)(const struct am_dev *d, size_t bytes); /* zeroed; NULL when out of memory */
    void (*free)(const struct am_dev *d, void *p);
    /* host -> device and device -> host copies, in stream order; download returns when the
     * bytes are on the host (it waits for the kernels before it) */
    void (*upload)(const struct am_dev *d, void *dst, const void *host_src, size_t bytes);
    void (*download)(const struct am_dev *d, void *host_dst, const void *src, size_t bytes);
    void (*zero)(const struct am_dev *d, struct am_tensor *t);
    void (*copy)(const struct am_dev *d, struct am_tensor *dst, const struct am_tensor *src);
    /* the allocator's counts (may be NULL: unknown) */
    void (*mem_stats)(const struct am_dev *d, struct am_dev_mem *out);
    /* reserves bytes up front (CUDA: the caching allocator's pool, from the plan's estimate)
     * so that later allocations take no device call; 0, or -1 when the device has not that
     * much (nothing reserved then). May be NULL (nothing to do). */
    int (*reserve)(const struct am_dev *d, size_t bytes);

    /* ---- element-wise and reductions ---- */
    /* dst += src (f32 or bf16 each; rounded once into a bf16 dst) */
    void (*add)(const struct am_dev *d, struct am_tensor *dst, const struct am_tensor *src);
    void (*scale)(const struct am_dev *d, struct am_tensor *t, float s); /* t *= s */
    /* A block of columns (multi-head latent attention's pieces of q, k and v): dst [M, Nd] and
     * src [M, Ns] seen as matrices of one dtype (f32 or bf16); for every row i and j < width,
     *   perm 0:  dst[i, dst_col + j] = src[i, src_col + j]
     *   perm 1:  dst[i, dst_col + j] = src[i, src_col + p(j)], p(j) = 2j for j < width / 2 and
     *            2 (j - width / 2) + 1 after (DeepSeek's rope_interleave: x0, x2, ..., x1, x3, ...)
     *   perm -1: dst[i, dst_col + p(j)] = src[i, src_col + j] (the inverse: perm 1's gradient);
     * accumulate: += instead of =, added in fp32 and rounded once. The other columns stay. */
    void (*copy_cols)(const struct am_dev *d, struct am_tensor *dst, int64_t dst_col, const struct am_tensor *src,
                      int64_t src_col, int64_t width, int perm, bool accumulate);
    /* dropout's mask (LoRA's adapter dropout, as torch.nn.functional.dropout): t [N, F] (f32
     * or bf16) *= keep / (1 - p), keep of row n, column f = am_rng_keep(seed, stream,
     * key(n) * cols + col0 + f, p) (rng.h), the product computed in fp32 and rounded once into a
     * bf16 t. Row n = b * rows_per_seq + i is row i of sequence b: key(n) = (seq0 + b *
     * seq_step) * seq_len + pos[i] (pos: rows_per_seq int32 positions in device memory, or
     * NULL: i). A mask of (sequence, position, feature) of the whole tensor: each rank draws
     * the elements it holds, the same in every layout. Applied twice, the same mask. */
    void (*dropout)(const struct am_dev *d, struct am_tensor *t, const struct am_dropout *dr);
    /* dst = src converted to dst's dtype (same number of elements): f64 <-> f32, f32 <-> bf16
     * (round to nearest even), or a plain copy when the dtypes match */
    void (*convert)(const struct am_dev *d, struct am_tensor *dst, const struct am_tensor *src);
    /* acc (one f64) += (Σ t², squares and sum in double, in an order that does not depend on
     * the threads) / div; t f32 or bf16 */
    void (*sum_squares)(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *t, double div);
    /* flag (one i32) = 0 when t holds an Inf or a NaN; left as it is otherwise */
    void (*all_finite)(const struct am_dev *d, struct am_tensor *flag, const struct am_tensor *t);

    /* ---- linear layers: y = x · wᵀ (torch.nn.Linear without bias) ----
     * x [M, K], w [N, K], y [M, N].  backward: dx += dy · w,  dw += dyᵀ · x (either NULL). */
    void (*matmul_forward)(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w);
    void (*matmul_backward)(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                            const struct am_tensor *x, const struct am_tensor *w);
    /* ---- the bias of a linear layer (torch.nn.Linear's + b; Qwen2's q, k, v projections) ----
     * y [M, N], b [N] (the activation dtype): bias_forward y[i, :] += b (bf16: rounded once,
     * after the product's own rounding: PyTorch's addmm rounds the two together).
     * bias_backward: db [N] += Σ over rows of dy, each column summed in fp32 over the rows in
     * order (the same bits whatever the threads) and added to db once (db f32, or bf16 with a
     * bf16 dy). */
    void (*bias_forward)(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *b);
    void (*bias_backward)(const struct am_dev *d, struct am_tensor *db, const struct am_tensor *dy);

    /* ---- embedding (vocabulary-parallel) ----
     * ids [N] int32; wte [V_shard, C] holds ids vocab_start .. vocab_start + V_shard - 1;
     * out [N, C]: the row for ids in the shard, zero for the others (the caller sums over tp). */
    void (*embedding_forward)(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *ids, const struct am_tensor *wte,
                              int64_t vocab_start);
    void (*embedding_backward)(const struct am_dev *d, struct am_tensor *dwte, const struct am_tensor *dout, const struct am_tensor *ids,
                               int64_t vocab_start);

    /* ---- RMSNorm: out = x / sqrt(mean(x²) + eps) * w ----
     * x, out [N, C], w [C], rstd [N] (saved for backward, fp32). */
    void (*rmsnorm_forward)(const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                            const struct am_tensor *w, float eps);
    void (*rmsnorm_backward)(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dout,
                             const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *rstd);

    /* ---- rotary position embedding, Hugging Face's rotate-half layout ----
     * rope_tables fills cos, sin [T, D/2] (on the backend's device) for positions 0..T-1 of a
     * head of size D, with
     * rope_theta and optional Llama 3 / linear scaling, exactly as transformers computes them.
     * x [B, T, H, D] is rotated in place; backward rotates the gradient by the opposite angle.
     * Partial rotary: tables [T, R/2] with R < D (made by rope_tables as for a head of size R)
     * rotate the first R dims of each head and leave the rest (glm4_moe's partial_rotary_factor). */
    void (*rope_tables)(const struct am_dev *d, struct am_tensor *cos, struct am_tensor *sin, double theta,
                        const struct am_rope_scaling *scaling);
    void (*rope_forward)(const struct am_dev *d, struct am_tensor *x, const struct am_tensor *cos, const struct am_tensor *sin);
    void (*rope_backward)(const struct am_dev *d, struct am_tensor *dx, const struct am_tensor *cos, const struct am_tensor *sin);

    /* ---- causal grouped-query attention, softmax(q kᵀ / sqrt(D)) v ----
     * q [B, T, H, D], k [B, T, KVH, D]; v [B, T, KVH, Dv], out [B, T, H, Dv] with H a multiple
     * of KVH (query head h reads kv head h / (H / KVH)); Dv, v's head width, is D or another
     * (multi-head latent attention's v_head_dim): the scale stays 1 / sqrt(D), and the backward's
     * dout is out's shape, dq q's, dk k's, dv v's; lse [B, H, T] fp32 (log-sum-exp of each row, saved for
     * backward). Never materialises more than a few rows of scores per thread (never T x T).
     * window > 0: a sliding window (Mistral's sliding_window): the query at position t sees
     * the keys t - window < j <= t, itself and the window - 1 before it (transformers masks
     * kv_idx <= q_idx - window); window <= 0, or >= T: plain causal, j <= t. */
    void (*attention_forward)(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *q,
                              const struct am_tensor *k, const struct am_tensor *v, int64_t window);
    void (*attention_backward)(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                               const struct am_tensor *dout, const struct am_tensor *out,
                               const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                               const struct am_tensor *v, int64_t window);

    /* ---- attention of one block of queries against one block of keys (context parallelism's
     * ring attention, runtime/model/ring.h) ----
     * q [B, Tq, H, D], k [B, Tk, KVH, D]; v [B, Tk, KVH, Dv], out [B, Tq, H, Dv] (Dv as
     * attention_forward's; query head h reads kv head h / (H / KVH));
     * lse [B, H, Tq] fp32; qpos [Tq] and kpos [Tk] int32: each row's position in its sequence
     * (the same for every b). Query t sees key j when kpos[j] <= qpos[t], and with window > 0
     * also kpos[j] > qpos[t] - window (attention_forward's mask, by position). qstart: NULL, or
     * (packed sequences: several documents in one sequence, none attending to another) int32
     * [B, Tq], the position where the document of query row (b, t) starts: the row then sees
     * only keys with kpos[j] >= qstart[b, t] too (block-diagonal causal attention).
     * attention_block_forward computes the block's softmax(q kᵀ / sqrt(D)) v over the keys
     * each row sees and its log-sum-exp lse_b; accumulate 0 writes them into out and lse (a
     * row that sees no key: out 0, lse -inf), accumulate 1 merges them into what out and lse
     * hold, by log-sum-exp: lse' = log(exp(lse) + exp(lse_b)),
     * out' = out exp(lse - lse') + out_b exp(lse_b - lse'). Over every block of keys that gives
     * attention_forward's out and lse.
     * attention_block_backward, given the rows' final out and lse (over all blocks), adds the
     * block's terms to dq, dk and dv (attention_backward's formulas, p_j = exp(s_j - lse_t) over
     * the keys of this block the row sees). Sums in a fixed order (run to run the same bits on
     * the CPU).
     * dtypes: q, k, v (and backward's dout and out) f32 or bf16, one dtype; lse f32. The
     * forward's out is f32 (any accumulate: a running merge across blocks is kept in fp32 by
     * its owner, ring.c, and rounded once at the end), or q's dtype with accumulate 0 (the
     * block's result rounded once). The backward's dq, dk, dv (one dtype) are f32 (sums across
     * blocks in fp32, rounded once by their owner) or q's dtype: each element gets the block's
     * terms added in fp32 and is rounded once per call. Scores, softmax statistics and sums are
     * fp32 whatever the dtypes (FlashAttention's semantics; the CPU widens bf16 operands into
     * scratch and runs the fp32 kernel). */
    void (*attention_block_forward)(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                    const struct am_tensor *qpos, const struct am_tensor *kpos,
                                    const struct am_tensor *qstart, int64_t window, int accumulate);
    void (*attention_block_backward)(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                     struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                     const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                     const struct am_tensor *v, const struct am_tensor *qpos,
                                     const struct am_tensor *kpos, const struct am_tensor *qstart, int64_t window);

    /* ---- SwiGLU: out = silu(gate) * up, all [N, I] ---- */
    void (*swiglu_forward)(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up);
    void (*swiglu_backward)(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                            const struct am_tensor *gate, const struct am_tensor *up);

    /* ---- Gemma 2 / Gemma 3 (transformers' Gemma2ForCausalLM, Gemma3ForCausalLM) ----
     * rmsnorm_offset: Gemma's RMSNorm, out = x * rstd * (1 + w), computed in fp32 with (1 + w)
     *   in fp32 and the output rounded once (Gemma2RMSNorm: (x.float() * rsqrt(...)) *
     *   (1.0 + w.float()), then type_as(x)); shapes and rstd as rmsnorm; backward: rmsnorm's
     *   with the weight 1 + w (dw += Σ_i dout_ij * x̂_ij, as rmsnorm's).
     * geglu: out = gelu_tanh(gate) * up (gelu_pytorch_tanh: 0.5 g (1 + tanh(sqrt(2/pi) (g +
     *   0.044715 g³)))), all [N, I]; backward as swiglu's (dgate or dup may be NULL).
     * attention_softcap: attention_forward / attention_backward with the scores
     *   s_j = scale * q_t · k_j (scale > 0: Gemma's query_pre_attn_scalar ** -0.5; scale <= 0:
     *   1 / sqrt(D)) and, with softcap > 0, capped before the softmax: s_j <- softcap *
     *   tanh(s_j / softcap) (attn_logit_softcapping); softcap <= 0: no cap. With scale <= 0
     *   and softcap <= 0 it is attention_forward / attention_backward, bit for bit.
     * attention_block_softcap: attention_block_forward / attention_block_backward (ring
     *   attention, packed sequences) with attention_softcap's scale and cap on each score; the
     *   window and the documents as attention_block's (by position: across the ring's blocks a
     *   window counts positions of the whole sequence, and a document bounds it from below).
     *   With scale <= 0 and softcap <= 0 it is attention_block_forward / _backward, bit for bit.
     * ce_stats_softcap, ce_backward_softcap: ce_stats and ce_backward on the capped logits
     *   softcap * tanh(logit / softcap) (final_logit_softcapping), the backward through the
     *   cap (d/dlogit = 1 - (capped / softcap)²); softcap <= 0: ce_stats / ce_backward. */
    void (*rmsnorm_offset_forward)(const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd,
                                   const struct am_tensor *x, const struct am_tensor *w, float eps);
    void (*rmsnorm_offset_backward)(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                                    const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                    const struct am_tensor *rstd);
    void (*geglu_forward)(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up);
    void (*geglu_backward)(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                           const struct am_tensor *gate, const struct am_tensor *up);
    void (*attention_softcap_forward)(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                      const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                      int64_t window, float scale, float softcap);
    void (*attention_softcap_backward)(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                       struct am_tensor *dv, const struct am_tensor *dout, const struct am_tensor *out,
                                       const struct am_tensor *lse, const struct am_tensor *q, const struct am_tensor *k,
                                       const struct am_tensor *v, int64_t window, float scale, float softcap);
    void (*attention_block_softcap_forward)(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                            const struct am_tensor *q, const struct am_tensor *k,
                                            const struct am_tensor *v, const struct am_tensor *qpos,
                                            const struct am_tensor *kpos, const struct am_tensor *qstart,
                                            int64_t window, int accumulate, float scale, float softcap);
    void (*attention_block_softcap_backward)(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk,
                                             struct am_tensor *dv, const struct am_tensor *dout,
                                             const struct am_tensor *out, const struct am_tensor *lse,
                                             const struct am_tensor *q, const struct am_tensor *k,
                                             const struct am_tensor *v, const struct am_tensor *qpos,
                                             const struct am_tensor *kpos, const struct am_tensor *qstart,
                                             int64_t window, float scale, float softcap);
    void (*ce_stats_softcap)(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                             const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *targets,
                             int64_t vocab_start, float softcap);
    void (*ce_backward_softcap)(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x,
                                const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start,
                                const struct am_tensor *M, const struct am_tensor *S, float dloss_scale, float softcap);
    /* LoRA on the head (runtime/model/lora.h): ce_stats_softcap and ce_backward_softcap on the
     * logits x · wᵀ + u · bᵀ, u [N, r] the adapter's scaled x · Aᵀ (compute dtype), b [V_shard, r]
     * this shard of lora_B; the backward also accumulates du [N, r] += dlogits · b (compute dtype;
     * the caller sums it over tp) and db [V_shard, r] += dlogitsᵀ · u (the gradient, fp32). The
     * logits are never stored whole, as without the adapter. With u NULL (b, du, db NULL): the
     * _softcap kernels, bit for bit. */
    void (*ce_stats_lora)(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t,
                          const struct am_tensor *x, const struct am_tensor *w, const struct am_tensor *u,
                          const struct am_tensor *b, const struct am_tensor *targets, int64_t vocab_start, float softcap);
    void (*ce_backward_lora)(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, struct am_tensor *du,
                             struct am_tensor *db, const struct am_tensor *x, const struct am_tensor *w,
                             const struct am_tensor *u, const struct am_tensor *b, const struct am_tensor *targets,
                             int64_t vocab_start, const struct am_tensor *M, const struct am_tensor *S, float dloss_scale,
                             float softcap);

    /* ---- mixture of experts on one rank's experts (transformers' Mixtral, Qwen3-MoE) ----
     * N tokens, E experts, k experts per token (idx's columns), S = N * k routed rows; the
     * router's logits [N, E] are a matmul by the caller (x · Wgᵀ). Activations (logits, x, xp,
     * y, yp and their gradients) have the activation dtype; probs, wts, cnt, psum are f32,
     * idx, pos, counts i32.
     *   moe_route_forward: probs = softmax(logits) in fp32; idx the k experts of largest
     *     probability in descending order (ties to the lower expert); wts their probabilities,
     *     divided by their sum when renorm (Mixtral always; Qwen3-MoE's norm_topk_prob):
     *     transformers' order, softmax over all experts, then top-k, then the renormalisation.
     *   moe_route_backward: dlogits += the softmax's backward of dprobs, where dprobs is dwts
     *     taken back through the renormalisation onto the top-k entries (the choice itself has
     *     no gradient), plus aux_scale * cnt[e] on every entry e of every row (the gradient of
     *     the load-balancing loss; cnt NULL: none).
     *   moe_aux_stats: cnt[e] += how many of the rows' top-k slots chose e, psum[e] += Σ over
     *     rows of probs[:, e] (rows in order), each row divided by its Σ_e probs + 1e-20 when
     *     renorm (AutoModel's normalised sigmoid scores).
     *   moe_aux_loss: acc (one f64) += scale * Σ_e cnt[e] * psum[e] (in double): with
     *     scale = E / R² over R rows of all the MoE layers it is transformers'
     *     load_balancing_loss_func (Switch Transformer's E Σ f_e P_e).
     *   moe_plan: a stable counting sort of the slots by expert: counts[e] = slots routed to e,
     *     pos[i, j] = the row of slot (i, j) in the permuted order (expert by expert, tokens in
     *     order within an expert).
     *   moe_permute_forward: xp[pos[i, j]] = x[i]; backward: dx[i] += Σ_j dxp[pos[i, j]].
     *   moe_combine_forward: y[i] = Σ_j wts[i, j] * yp[pos[i, j]] (j in order, from 0);
     *     backward: dyp[pos[i, j]] += wts[i, j] * dy[i], dwts[i, j] += dy[i] · yp[pos[i, j]].
     *   grouped_matmul: the experts' linear layers in one call: w [E, Nout, K] (the experts'
     *     weights back to back), x [S, K] and y [S, Nout] in expert order, counts a HOST array
     *     of E row counts (moe_plan's, downloaded by the caller: the backends size their
     *     products on the host); rows of expert e: y_e = x_e · w_eᵀ, as matmul. backward:
     *     dx += dy_e · w_e, dw_e += dy_eᵀ · x_e (either NULL). */
    void (*moe_route_forward)(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx, struct am_tensor *wts,
                              const struct am_tensor *logits, bool renorm);
    void (*moe_route_backward)(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                               const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                               float aux_scale, bool renorm);
    /* DeepSeekMoE's router (glm4_moe; transformers' Glm4MoeTopkRouter), on logits [N, E]:
     *   moe_route_sigmoid_forward: probs = sigmoid(logits) in fp32; the choice on
     *     probs + bias (bias [E] f32, e_score_correction_bias: it chooses, never weights): the
     *     n_group groups of E / n_group consecutive experts scored by the sum of their two
     *     largest biased scores, the topk_group best groups kept (ties to the lower group), then
     *     idx the k experts of largest biased score among the kept groups, in descending order
     *     (ties to the lower expert); wts their unbiased probs, divided by their sum + 1e-20 when
     *     renorm, times scale (routed_scaling_factor).
     *   moe_route_sigmoid_backward: dlogits += the sigmoid's backward p (1 - p) of dprobs, where
     *     dprobs is dwts taken back through the scale and the renormalisation onto the chosen
     *     entries (the choice itself has no gradient), plus the gradient of AutoModel's
     *     load-balancing loss (cnt NULL: none): aux_scale * cnt[e] on every score q_e of the row,
     *     q = p / (Σ_e p_e + 1e-20) when renorm (AutoModel's normalised scores), else q = p,
     *     taken back through that normalisation. */
    void (*moe_route_sigmoid_forward)(const struct am_dev *d, struct am_tensor *probs, struct am_tensor *idx,
                                      struct am_tensor *wts, const struct am_tensor *logits, const struct am_tensor *bias,
                                      int n_group, int topk_group, bool renorm, float scale);
    void (*moe_route_sigmoid_backward)(const struct am_dev *d, struct am_tensor *dlogits, const struct am_tensor *dwts,
                                       const struct am_tensor *probs, const struct am_tensor *idx, const struct am_tensor *cnt,
                                       float aux_scale, bool renorm, float scale);
    /* ---- gpt-oss (transformers' GptOssForCausalLM) ----
     * attention_sink: a learned logit per head (sinks [H], f32 or the activations' dtype) in
     *   each softmax's denominator, given attention's out [B, T, H, D] and lse [B, H, T] over
     *   the keys (any attention kernel's, ring's and packed included): forward, in place,
     *   lse' = logaddexp(lse, sink_h), out *= exp(lse - lse'), lse = lse' (GptOssAttention's
     *   softmax over [scores | sink] with the sink's column dropped). The attention backward
     *   given these out and lse is then the sinks' attention's for q, k and v (its
     *   D_t = dout_t · out_t is Σ p_j dp_j with the sink's p counted, whose dp is 0);
     *   backward: dsinks [H] f32 += -Σ_{b,t} exp(sink_h - lse'_{b,h,t}) (dout · out)_{b,t,h},
     *   summed per head in a fixed order (deterministic).
     * swiglu_clamped: GptOssExperts._apply_gate on gate and up [N, I] (gate_up_proj's even
     *   and odd columns, split by the caller): g = min(gate, limit), u = clamp(up, -limit,
     *   limit), out = (u + 1) * g * sigmoid(alpha g); backward (dgate or dup may be NULL;
     *   both +=): the clamps pass the gradient where the input is within them, ends included
     *   (torch's clamp), dg = dout (u + 1) (s + alpha g s (1 - s)), du = dout g s. */
    void (*attention_sink_forward)(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                   const struct am_tensor *sinks);
    void (*attention_sink_backward)(const struct am_dev *d, struct am_tensor *dsinks, const struct am_tensor *dout,
                                    const struct am_tensor *out, const struct am_tensor *lse,
                                    const struct am_tensor *sinks);
    void (*swiglu_clamped_forward)(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate,
                                   const struct am_tensor *up, float alpha, float limit);
    void (*swiglu_clamped_backward)(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup,
                                    const struct am_tensor *dout, const struct am_tensor *gate,
                                    const struct am_tensor *up, float alpha, float limit);
    void (*moe_aux_stats)(const struct am_dev *d, struct am_tensor *cnt, struct am_tensor *psum, const struct am_tensor *probs,
                          const struct am_tensor *idx, bool renorm);
    void (*moe_aux_loss)(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *cnt,
                         const struct am_tensor *psum, double scale);
    void (*moe_plan)(const struct am_dev *d, struct am_tensor *pos, struct am_tensor *counts, const struct am_tensor *idx);
    void (*moe_permute_forward)(const struct am_dev *d, struct am_tensor *xp, const struct am_tensor *x, const struct am_tensor *pos);
    void (*moe_permute_backward)(const struct am_dev *d, struct am_tensor *dx, const struct am_tensor *dxp,
                                 const struct am_tensor *pos);
    void (*moe_combine_forward)(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *yp, const struct am_tensor *pos,
                                const struct am_tensor *wts);
    void (*moe_combine_backward)(const struct am_dev *d, struct am_tensor *dyp, struct am_tensor *dwts, const struct am_tensor *dy,
                                 const struct am_tensor *yp, const struct am_tensor *pos, const struct am_tensor *wts);
    void (*grouped_matmul_forward)(const struct am_dev *d, struct am_tensor *y, const struct am_tensor *x, const struct am_tensor *w,
                                   const int64_t *counts);
    void (*grouped_matmul_backward)(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *dy,
                                    const struct am_tensor *x, const struct am_tensor *w, const int64_t *counts);

    /* ---- cross-entropy fused with the output projection, vocabulary-parallel, in chunks ----
     * x [N, C] final hidden states, w [V_shard, C] the head's shard (ids vocab_start..),
     * targets [N] int32. Logits are computed chunk by chunk and never stored whole.
     *   ce_stats: for each token, over this shard: max logit m [N], sum of exp(logit - m)
     *     s [N], and the target's logit t [N] (0 when the target is not in the shard).
     *   The caller combines shards: M = max over tp of m; S = sum over tp of s * exp(m - M)
     *     (ce_rescale before the sum); T = sum over tp of t; loss_i = log S + M - T (ce_loss).
     *   ce_backward: with the combined M and S, dlogits = (softmax - onehot) * dloss_scale for
     *     tokens whose target >= 0; dx += dlogits · w (the caller sums dx over tp),
     *     dw += dlogitsᵀ · x. */
    void (*ce_stats)(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t, const struct am_tensor *x,
                     const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start);
    void (*ce_backward)(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw, const struct am_tensor *x,
                        const struct am_tensor *w, const struct am_tensor *targets, int64_t vocab_start,
                        const struct am_tensor *M, const struct am_tensor *S, float dloss_scale);
    /* s *= exp(m - M), element-wise over [N] (the shard's share of the combined S) */
    void (*ce_rescale)(const struct am_dev *d, struct am_tensor *s, const struct am_tensor *m, const struct am_tensor *M);
    /* acc (one f64) += Σ over tokens with targets >= 0 of log S + M - T, each term and the sum
     * in double, tokens in order */
    void (*ce_loss)(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *M, const struct am_tensor *S,
                    const struct am_tensor *T, const struct am_tensor *targets);
    /* ce_stats and ce_backward in one pass over the logits, for a head holding the whole
     * vocabulary (no tensor parallelism: M = m, S = s): each tile of logits is computed once
     * instead of twice. Writes m, s, t as ce_stats and accumulates dx, dw as ce_backward.
     * Returns false, having done nothing, when the vocabulary is too large for one tile of
     * the kernel's row chunk: then call ce_stats and ce_backward. */
    bool (*ce_fused)(const struct am_dev *d, struct am_tensor *m, struct am_tensor *s, struct am_tensor *t, struct am_tensor *dx,
                     struct am_tensor *dw, const struct am_tensor *x, const struct am_tensor *w,
                     const struct am_tensor *targets, float dloss_scale);

    /* ---- AdamW, PyTorch's torch.optim.AdamW semantics (decoupled weight decay, bias
     * correction with step >= 1); weight_decay 0 gives Adam. param, m and v are all F32, or
     * all BF16 (bf16 storage: torch.optim.AdamW keeps the moments in the parameter's dtype);
     * grad is F32, or with BF16 parameters also BF16 (FSDP2's sharded gradient in the
     * parameter's dtype). A BF16 parameter is stepped as PyTorch steps it under FSDP2:
     * the gradient rounded to bf16 (a BF16 grad is that already: the step is bit for bit the
     * one its fp32 value would give; then multiplied by the clipping factor, rounded again),
     * and each of AdamW's tensor ops computed in fp32 and rounded to bf16, as torch's CPU
     * kernels do (kernels/cpu/adamw.c lists the ops). Any other combination is refused. ---- */
    void (*adamw)(const struct am_dev *d, struct am_tensor *param, const struct am_tensor *grad, struct am_tensor *m, struct am_tensor *v,
                  float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step);
    /* The optimizer step of a whole model in one call, with nothing read by the host: adamw on
     * each of the n tensors of list, after the global-norm clipping and the finiteness check,
     * both decided on the device from device scalars:
     *   sumsq: NULL, or a device scalar (AM_F64, or AM_F32) holding the squared norm of all
     *     the gradients, Σ g²;
     *   max_norm > 0 (sumsq required): clipping, in double as the host would compute it:
     *     coef = max_norm / (sqrt(sumsq) + 1e-6), and when coef < 1 each gradient element is
     *     used multiplied by (float)coef, rounded to fp32 (scale's result); the gradients
     *     themselves are left as they are. max_norm <= 0: no clipping;
     *   finite: NULL, or an AM_I32 device scalar (all_finite's flag).
     * When finite holds 0, or sumsq is an Inf or a NaN (which any Inf or NaN among the
     * gradients makes it), the step is skipped: no tensor is written. Otherwise each tensor
     * ends bit for bit as adamw leaves it (after scale, when clipped; a bf16 tensor's gradient
     * is rounded to bf16 before the factor multiplies it, and the product rounded again). The
     * list may mix fp32 and bf16 tensors.
     * A tensor with te & AM_TE_ADAM is stepped with Transformer Engine's FusedAdam arithmetic
     * instead (kernels/cpu/adamw.c writes it out, from TE's multi_tensor/adam.cu): every value
     * widened to fp32, the update in fp32 in TE's order, each stored value (param, m, v)
     * rounded once to its dtype (nearest even); the gradient g (fp32; with AM_TE_GRAD_BF16
     * rounded to bf16, or bf16 already, times the clipping factor rounded to bf16 again; else
     * times the factor in fp32), the scalars lr, beta1, beta2, eps, weight_decay as the fp32 floats TE's kernel
     * takes, and bias corrections 1 - beta^step in double rounded to fp32 (1 without them);
     * with rem the master rebuilt from param and rem and split back into them
     * (am_adamw_tensor.rem). */
    void (*adamw_multi)(const struct am_dev *d, const struct am_adamw_tensor *list, int n, const struct am_tensor *sumsq,
                        double max_norm, const struct am_tensor *finite, float lr, float beta1, float beta2, float eps,
                        float weight_decay, int64_t step);
};

/* The table for a device, or NULL when this build has no such backend (am_dev_open says so). */
const struct am_kernels *am_kernels_for(enum am_device device);

/* The CPU backend's table (kernels/cpu/). */
const struct am_kernels *am_kernels_cpu(void);

/* The CUDA backend's table (kernels/cuda/), defined only in a build with CUDA (configure
 * defines AM_HAVE_CUDA). Its open fails with "no CUDA device" where cudaGetDeviceCount finds
 * none. */
const struct am_kernels *am_kernels_cuda(void);

/* The kernels a table lacks (NULL entries; open and close may be NULL): their names, comma
 * separated, into buf (empty when none; buf may be NULL when len is 0), and how many.
 * am_dev_open refuses a context on an incomplete table with "the <name> backend lacks: ..." */
int am_kernels_missing(const struct am_kernels *k, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif
