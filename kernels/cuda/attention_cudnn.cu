/* attention_cudnn.cu - attention on cuDNN's fused (flash) scaled-dot-product attention,
 * through cuDNN 9's backend graph API, for the cases it has; attention.cu runs the others
 * (and every case with AM_ATTN=own). Built only where configure found cuDNN (AM_HAVE_CUDNN).
 *
 * Cases: bf16 q, k, v (and out, dout, dq, dk, dv), head size 64 or 128, T >= 2 (cuDNN's
 * backward is not offered for one query and one key), 16-byte aligned tensors, causal, with
 * or without a sliding window (cuDNN's left bound, top-left aligned: keys j > t - W).
 * Anything else returns -1 at once and the caller runs the backend's own kernels. A graph
 * cuDNN cannot build or finalise a plan for also returns -1, remembered per shape (never
 * retried), and the reason is printed once per process on stderr
 * (am_cuda_attention_cudnn_why returns it): no silent wrong results, no silent slow path.
 * The plans' engines are compiled at run time by cuDNN (NVRTC and the driver must be there,
 * as they are wherever the toolkit and a GPU are).
 *
 * The graphs are cuDNN's documented fused-attention patterns (what cudnn-frontend's sdpa
 * and sdpa_backward nodes lower to), on am's layout: q [B, T, H, D] is cuDNN's
 * [B, H, T, D] with strides (T H D, D, H D, 1) (BSHD), k and v likewise with KVH heads; GQA
 * is cuDNN's, k and v having fewer heads than q.
 *   forward:  S = Q Kᵀ; S *= scale; causal (row >= col), window (col + W > row): masked
 *             entries -inf; M = max_row S; E = exp(S - M); L = Σ_row E;
 *             Stats = M + log L; P = E / L (bf16); O = P V.
 *   backward: Dsum = Σ_d dO O (fp32 in the workspace); S = Q Kᵀ scale - Stats, masked as
 *             above; E = exp S (= p); dV = Eᵀ dO (summed over a kv head's query heads with
 *             GQA); dS = (dO Vᵀ - Dsum) E scale; dK = dSᵀ Q (summed likewise); dQ = dS K,
 *             summed in an fp32 accumulator in the workspace (dQacc) and written as bf16:
 *             cuDNN's memory-lean backward (no T x T workspace), the graph cudnn-frontend
 *             builds by default. Its dQ sums arrive in an order that may vary run to run
 *             (fp32 atomics): the cuDNN backward is not bitwise reproducible; AM_ATTN=own is.
 * Stats is the natural-log log-sum-exp of the scaled scores, the graph says so: M + log Σ
 * exp(S - M) with LOG and EXP the natural ones, S = q·k/sqrt(D): am's lse exactly, so a
 * forward on one path and a backward on the other agree.
 * cuDNN writes its outputs; kernels.h's backward accumulates: dq, dk, dv are written to
 * bf16 temporaries in the context's scratch and added (rounded once more) onto the
 * gradients. Plans are built once per shape (B, T, H, KVH, D, window) per context and
 * kept in a small cache (ATT_PLANS entries, round robin; an evicted plan is destroyed after
 * the context's stream has run what used it); the cuDNN handle is created on first use and
 * bound to the context's stream. A failure of cuDNN at run time (cudnnBackendExecute) is the
 * device's (am_cuda_device_error: a `cuda` cause), not a caller's bug.
 */
#include <cudnn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

#define ATT_PLANS 32
#define ATT_MAX_DESC 160

struct att_key {
    int bwd;
    int64_t B, T, H, KVH, D, W; /* W: the window, 0 for none (window <= 0 or >= T) */
};

struct att_plan {
    struct att_key key;
    bool used, ok;
    cudnnBackendDescriptor_t plan;
    int64_t workspace;
    cudnnBackendDescriptor_t keep[ATT_MAX_DESC]; /* every descriptor the plan was built from */
    int nkeep;
};

struct att_state {
    cudnnHandle_t handle;
    struct att_plan plans[ATT_PLANS];
    int next;
    char why[512]; /* the last reason cuDNN could not run a case */
};

/* uids of the tensors the caller binds (the rest are virtual, or scalars by value) */
enum { U_Q = 1, U_K, U_V, U_O, U_STATS, U_DO, U_DQ, U_DK, U_DV, U_DSUM, U_DQACC, U_SCALE, U_NEGINF, U_ONE, U_WINDOW };

static bool att_told;

/* The first case cuDNN declines is told to the device's fault hook as a note (kernels.h:
 * the trainer logs it and prints it once); the rest only update s->why. */
static void note_once(const char *kernel, const char *fmt, const char *why)
{
    if (__atomic_exchange_n(&att_told, true, __ATOMIC_RELAXED))
        return;
    char msg[768];
    snprintf(msg, sizeof msg, fmt, why);
    struct am_dev_fault f = {AM_DEV_FAULT_NOTE, "cuda", -1, kernel, "", msg, 0, 0, 0, 0};
    am_kernels_fault(&f);
}

/* ---- building a graph: descriptors are kept in the plan's list, errors end the build ---- */
struct builder {
    struct att_plan *p;
    cudnnStatus_t st;
    const char *what;
    int64_t next_uid; /* virtual tensors */
};

static cudnnBackendDescriptor_t mk(struct builder *b, cudnnBackendDescriptorType_t type, const char *what)
{
    cudnnBackendDescriptor_t d = NULL;
    if (b->st != CUDNN_STATUS_SUCCESS)
        return NULL;
    if (b->p->nkeep >= ATT_MAX_DESC) {
        b->st = CUDNN_STATUS_INTERNAL_ERROR;
        b->what = "too many descriptors";
        return NULL;
    }
    b->st = cudnnBackendCreateDescriptor(type, &d);
    if (b->st != CUDNN_STATUS_SUCCESS) {
        b->what = what;
        return NULL;
    }
    b->p->keep[b->p->nkeep++] = d;
    return d;
}

static void set(struct builder *b, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                cudnnBackendAttributeType_t type, int64_t n, const void *v, const char *what)
{
    if (b->st != CUDNN_STATUS_SUCCESS)
        return;
    b->st = cudnnBackendSetAttribute(d, name, type, n, v);
    if (b->st != CUDNN_STATUS_SUCCESS)
        b->what = what;
}

static void fin(struct builder *b, cudnnBackendDescriptor_t d, const char *what)
{
    if (b->st != CUDNN_STATUS_SUCCESS)
        return;
    b->st = cudnnBackendFinalize(d);
    if (b->st != CUDNN_STATUS_SUCCESS)
        b->what = what;
}

/* a tensor: 4-d dims and strides; uid 0: a new virtual one */
static cudnnBackendDescriptor_t tensor(struct builder *b, cudnnDataType_t dt, const int64_t dim[4], const int64_t str[4],
                                       int64_t uid, bool by_value)
{
    cudnnBackendDescriptor_t t = mk(b, CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor descriptor");
    bool virt = uid == 0;
    if (virt)
        uid = b->next_uid++;
    int64_t align = 16;
    set(b, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor data type");
    set(b, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim, "tensor dimensions");
    set(b, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str, "tensor strides");
    set(b, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    set(b, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
    set(b, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, "tensor virtual");
    if (by_value)
        set(b, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by value");
    fin(b, t, "tensor finalize");
    return t;
}

static cudnnBackendDescriptor_t scalar(struct builder *b, cudnnDataType_t dt, int64_t uid)
{
    const int64_t one[4] = {1, 1, 1, 1};
    return tensor(b, dt, one, one, uid, true);
}

/* y = op(x [, x2 [, t]]): the pointwise mode with math precision prec (axis for GEN_INDEX) */
static void pointwise(struct builder *b, cudnnPointwiseMode_t mode, cudnnDataType_t prec, cudnnBackendDescriptor_t x,
                      cudnnBackendDescriptor_t x2, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, int64_t axis,
                      cudnnBackendDescriptor_t *ops, int *nops)
{
    cudnnBackendDescriptor_t pw = mk(b, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise descriptor");
    set(b, pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    set(b, pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise precision");
    if (mode == CUDNN_POINTWISE_GEN_INDEX)
        set(b, pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    fin(b, pw, "pointwise finalize");
    cudnnBackendDescriptor_t op = mk(b, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation");
    set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, "pointwise op desc");
    set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "pointwise x");
    if (x2)
        set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x2, "pointwise b");
    if (t)
        set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, "pointwise t");
    set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "pointwise y");
    fin(b, op, "pointwise operation finalize");
    ops[(*nops)++] = op;
}

static void matmul(struct builder *b, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t bb, cudnnBackendDescriptor_t c,
                   cudnnBackendDescriptor_t *ops, int *nops)
{
    cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t md = mk(b, CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul descriptor");
    set(b, md, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "matmul compute type");
    fin(b, md, "matmul finalize");
    cudnnBackendDescriptor_t op = mk(b, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    set(b, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, "matmul a");
    set(b, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &bb, "matmul b");
    set(b, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, "matmul c");
    set(b, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &md, "matmul desc");
    fin(b, op, "matmul operation finalize");
    ops[(*nops)++] = op;
}

static void reduction(struct builder *b, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                      cudnnBackendDescriptor_t *ops, int *nops)
{
    cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t rd = mk(b, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction descriptor");
    set(b, rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction operator");
    set(b, rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "reduction compute type");
    fin(b, rd, "reduction finalize");
    cudnnBackendDescriptor_t op = mk(b, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    set(b, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reduction x");
    set(b, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reduction y");
    set(b, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd, "reduction desc");
    fin(b, op, "reduction operation finalize");
    ops[(*nops)++] = op;
}

static void reshape(struct builder *b, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y, cudnnBackendDescriptor_t *ops,
                    int *nops)
{
    cudnnBackendDescriptor_t op = mk(b, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    set(b, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reshape x");
    set(b, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reshape y");
    fin(b, op, "reshape operation finalize");
    ops[(*nops)++] = op;
}

/* s masked: causal (row >= col) and, with a window, col + W > row; -inf elsewhere */
static cudnnBackendDescriptor_t mask(struct builder *b, cudnnBackendDescriptor_t s, const int64_t sdim[4],
                                     const int64_t sstr[4], int64_t W, cudnnBackendDescriptor_t neginf,
                                     cudnnBackendDescriptor_t window, cudnnBackendDescriptor_t *ops, int *nops)
{
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT, i32 = CUDNN_DATA_INT32, bo = CUDNN_DATA_BOOLEAN;
    cudnnBackendDescriptor_t row = tensor(b, i32, sdim, sstr, 0, false), col = tensor(b, i32, sdim, sstr, 0, false);
    pointwise(b, CUDNN_POINTWISE_GEN_INDEX, f32, s, NULL, NULL, row, 2, ops, nops);
    pointwise(b, CUDNN_POINTWISE_GEN_INDEX, f32, s, NULL, NULL, col, 3, ops, nops);
    cudnnBackendDescriptor_t keep = tensor(b, bo, sdim, sstr, 0, false), out = tensor(b, f32, sdim, sstr, 0, false);
    pointwise(b, CUDNN_POINTWISE_CMP_GE, bo, row, col, NULL, keep, 0, ops, nops);
    pointwise(b, CUDNN_POINTWISE_BINARY_SELECT, f32, s, neginf, keep, out, 0, ops, nops);
    if (W <= 0)
        return out;
    cudnnBackendDescriptor_t row2 = tensor(b, i32, sdim, sstr, 0, false), col2 = tensor(b, i32, sdim, sstr, 0, false);
    pointwise(b, CUDNN_POINTWISE_GEN_INDEX, f32, out, NULL, NULL, row2, 2, ops, nops);
    pointwise(b, CUDNN_POINTWISE_GEN_INDEX, f32, out, NULL, NULL, col2, 3, ops, nops);
    cudnnBackendDescriptor_t colw = tensor(b, f32, sdim, sstr, 0, false), keep2 = tensor(b, bo, sdim, sstr, 0, false);
    pointwise(b, CUDNN_POINTWISE_ADD, f32, col2, window, NULL, colw, 0, ops, nops);
    pointwise(b, CUDNN_POINTWISE_CMP_GT, bo, colw, row2, NULL, keep2, 0, ops, nops);
    cudnnBackendDescriptor_t out2 = tensor(b, f32, sdim, sstr, 0, false);
    pointwise(b, CUDNN_POINTWISE_BINARY_SELECT, f32, out, neginf, keep2, out2, 0, ops, nops);
    return out2;
}

/* The forward or backward graph of a key, its plan (the first of the heuristics' engine
 * configurations that finalises), its workspace size. false with b->what on failure. */
static bool build(struct att_state *s, struct att_plan *p, struct builder *b)
{
    const struct att_key *k = &p->key;
    const int64_t B = k->B, T = k->T, H = k->H, KV = k->KVH, D = k->D;
    const cudnnDataType_t bf = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
    /* am's [B, T, heads, D] as cuDNN's [B, heads, T, D] */
    const int64_t qdim[4] = {B, H, T, D}, qstr[4] = {T * H * D, D, H * D, 1};
    const int64_t kdim[4] = {B, KV, T, D}, kstr[4] = {T * KV * D, D, KV * D, 1};
    const int64_t ktdim[4] = {B, KV, D, T}, ktstr[4] = {T * KV * D, D, 1, KV * D}; /* kᵀ, vᵀ: the same bytes */
    const int64_t sdim[4] = {B, H, T, T}, sstr[4] = {H * T * T, T * T, T, 1};
    const int64_t stdim[4] = {B, H, T, T}, ststr[4] = {H * T * T, T * T, 1, T}; /* a score matrix transposed */
    const int64_t rdim[4] = {B, H, T, 1}, rstr[4] = {H * T, T, 1, 1};
    cudnnBackendDescriptor_t ops[64];
    int n = 0;
    cudnnBackendDescriptor_t scale = scalar(b, f32, U_SCALE), neginf = scalar(b, f32, U_NEGINF);
    cudnnBackendDescriptor_t window = k->W > 0 ? scalar(b, f32, U_WINDOW) : NULL;
    cudnnBackendDescriptor_t Q = tensor(b, bf, qdim, qstr, U_Q, false), Stats = tensor(b, f32, rdim, rstr, U_STATS, false);
    cudnnBackendDescriptor_t Kt = tensor(b, bf, ktdim, ktstr, U_K, false);
    if (!k->bwd) {
        cudnnBackendDescriptor_t V = tensor(b, bf, kdim, kstr, U_V, false), O = tensor(b, bf, qdim, qstr, U_O, false);
        cudnnBackendDescriptor_t S = tensor(b, f32, sdim, sstr, 0, false), S1 = tensor(b, f32, sdim, sstr, 0, false);
        matmul(b, Q, Kt, S, ops, &n);
        pointwise(b, CUDNN_POINTWISE_MUL, f32, S, scale, NULL, S1, 0, ops, &n);
        cudnnBackendDescriptor_t Sm = mask(b, S1, sdim, sstr, k->W, neginf, window, ops, &n);
        cudnnBackendDescriptor_t M = tensor(b, f32, rdim, rstr, 0, false), Z = tensor(b, f32, sdim, sstr, 0, false);
        cudnnBackendDescriptor_t E = tensor(b, f32, sdim, sstr, 0, false), L = tensor(b, f32, rdim, rstr, 0, false);
        cudnnBackendDescriptor_t logL = tensor(b, f32, rdim, rstr, 0, false), P = tensor(b, bf, sdim, sstr, 0, false);
        reduction(b, CUDNN_REDUCE_TENSOR_MAX, Sm, M, ops, &n);
        pointwise(b, CUDNN_POINTWISE_SUB, f32, Sm, M, NULL, Z, 0, ops, &n);
        pointwise(b, CUDNN_POINTWISE_EXP, f32, Z, NULL, NULL, E, 0, ops, &n);
        reduction(b, CUDNN_REDUCE_TENSOR_ADD, E, L, ops, &n);
        pointwise(b, CUDNN_POINTWISE_LOG, f32, L, NULL, NULL, logL, 0, ops, &n);
        pointwise(b, CUDNN_POINTWISE_ADD, f32, M, logL, NULL, Stats, 0, ops, &n);
        pointwise(b, CUDNN_POINTWISE_DIV, f32, E, L, NULL, P, 0, ops, &n);
        matmul(b, P, V, O, ops, &n);
    } else {
        const int64_t dodim[4] = {B, H, T, D}, dostr[4] = {H * T * D, T * D, H * D, 1}; /* as cudnn-frontend's */
        const int64_t fdim[4] = {B, H, T, D}, fstr[4] = {H * T * D, T * D, D, 1};       /* per query head, dense */
        cudnnBackendDescriptor_t Vt = tensor(b, bf, ktdim, ktstr, U_V, false), O = tensor(b, bf, qdim, qstr, U_O, false);
        cudnnBackendDescriptor_t dO = tensor(b, bf, qdim, qstr, U_DO, false), dQ = tensor(b, bf, qdim, qstr, U_DQ, false);
        cudnnBackendDescriptor_t dK = tensor(b, bf, kdim, kstr, U_DK, false), dV = tensor(b, bf, kdim, kstr, U_DV, false);
        cudnnBackendDescriptor_t one = scalar(b, f32, U_ONE);
        /* Dsum = Σ_d dO O (a workspace the caller binds) */
        cudnnBackendDescriptor_t dOO = tensor(b, f32, dodim, dostr, 0, false), r = tensor(b, f32, rdim, rstr, 0, false);
        cudnnBackendDescriptor_t Dsum = tensor(b, f32, rdim, rstr, U_DSUM, false);
        pointwise(b, CUDNN_POINTWISE_MUL, f32, dO, O, NULL, dOO, 0, ops, &n);
        reduction(b, CUDNN_REDUCE_TENSOR_ADD, dOO, r, ops, &n);
        pointwise(b, CUDNN_POINTWISE_MUL, f32, r, one, NULL, Dsum, 0, ops, &n);
        /* E = exp(Q Kᵀ scale - Stats), masked */
        cudnnBackendDescriptor_t S = tensor(b, f32, sdim, sstr, 0, false), S1 = tensor(b, f32, sdim, sstr, 0, false);
        cudnnBackendDescriptor_t S2 = tensor(b, f32, sdim, sstr, 0, false);
        matmul(b, Q, Kt, S, ops, &n);
        pointwise(b, CUDNN_POINTWISE_MUL, f32, S, scale, NULL, S1, 0, ops, &n);
        pointwise(b, CUDNN_POINTWISE_SUB, f32, S1, Stats, NULL, S2, 0, ops, &n);
        cudnnBackendDescriptor_t Sm = mask(b, S2, sdim, sstr, k->W, neginf, window, ops, &n);
        cudnnBackendDescriptor_t E = tensor(b, f32, sdim, sstr, 0, false), Et = tensor(b, bf, stdim, ststr, 0, false);
        pointwise(b, CUDNN_POINTWISE_EXP, f32, Sm, NULL, NULL, E, 0, ops, &n);
        /* dV = Eᵀ dO (per query head, then summed over the group with GQA) */
        reshape(b, E, Et, ops, &n);
        if (H == KV)
            matmul(b, Et, dO, dV, ops, &n);
        else {
            cudnnBackendDescriptor_t dVf = tensor(b, bf, fdim, fstr, 0, false);
            matmul(b, Et, dO, dVf, ops, &n);
            reduction(b, CUDNN_REDUCE_TENSOR_ADD, dVf, dV, ops, &n);
        }
        /* dS = (dO Vᵀ - Dsum) E scale */
        cudnnBackendDescriptor_t dP = tensor(b, f32, sdim, sstr, 0, false), t1 = tensor(b, f32, sdim, sstr, 0, false);
        cudnnBackendDescriptor_t t2 = tensor(b, f32, sdim, sstr, 0, false), dS = tensor(b, f32, sdim, sstr, 0, false);
        matmul(b, dO, Vt, dP, ops, &n);
        pointwise(b, CUDNN_POINTWISE_SUB, f32, dP, Dsum, NULL, t1, 0, ops, &n);
        pointwise(b, CUDNN_POINTWISE_MUL, f32, t1, E, NULL, t2, 0, ops, &n);
        pointwise(b, CUDNN_POINTWISE_MUL, f32, t2, scale, NULL, dS, 0, ops, &n);
        /* dK = dSᵀ Q (summed over the group with GQA) */
        cudnnBackendDescriptor_t dSt = tensor(b, bf, stdim, ststr, 0, false);
        reshape(b, dS, dSt, ops, &n);
        if (H == KV)
            matmul(b, dSt, Q, dK, ops, &n);
        else {
            cudnnBackendDescriptor_t dKf = tensor(b, bf, fdim, fstr, 0, false);
            matmul(b, dSt, Q, dKf, ops, &n);
            reduction(b, CUDNN_REDUCE_TENSOR_ADD, dKf, dK, ops, &n);
        }
        /* dQ = dS K, summed in fp32 in the workspace (dQacc), then written as bf16 */
        cudnnBackendDescriptor_t Kr = tensor(b, bf, kdim, kstr, 0, false);
        cudnnBackendDescriptor_t dQacc = tensor(b, f32, fdim, fstr, U_DQACC, false);
        reshape(b, Kt, Kr, ops, &n);
        matmul(b, dS, Kr, dQacc, ops, &n);
        pointwise(b, CUDNN_POINTWISE_IDENTITY, f32, dQacc, NULL, NULL, dQ, 0, ops, &n);
    }
    if (b->st != CUDNN_STATUS_SUCCESS)
        return false;
    cudnnBackendDescriptor_t g = mk(b, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    set(b, g, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &s->handle, "graph handle");
    set(b, g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n, ops, "graph operations");
    fin(b, g, "operation graph finalize (cuDNN has no fused attention for this graph)");
    cudnnBackendDescriptor_t h = mk(b, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
    cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    set(b, h, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g, "heuristics graph");
    set(b, h, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
    fin(b, h, "heuristics finalize");
    if (b->st != CUDNN_STATUS_SUCCESS)
        return false;
    int64_t count = 0;
    b->st = cudnnBackendGetAttribute(h, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL);
    if (b->st != CUDNN_STATUS_SUCCESS) {
        b->what = "heuristics results (count)";
        return false;
    }
    if (count <= 0) {
        b->what = "the heuristics found no engine for this graph";
        b->st = CUDNN_STATUS_NOT_SUPPORTED;
        return false;
    }
    if (count > 8)
        count = 8;
    cudnnBackendDescriptor_t cfg[8];
    for (int64_t i = 0; i < count; i++)
        cfg[i] = mk(b, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration");
    if (b->st != CUDNN_STATUS_SUCCESS)
        return false;
    int64_t got = 0;
    b->st = cudnnBackendGetAttribute(h, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, cfg);
    if (b->st != CUDNN_STATUS_SUCCESS) {
        b->what = "heuristics results";
        return false;
    }
    cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
    for (int64_t i = 0; i < got; i++) {
        cudnnBackendDescriptor_t plan = NULL;
        if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan) != CUDNN_STATUS_SUCCESS)
            continue;
        if ((last = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &s->handle)) ==
                CUDNN_STATUS_SUCCESS &&
            (last = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                             &cfg[i])) == CUDNN_STATUS_SUCCESS &&
            (last = cudnnBackendFinalize(plan)) == CUDNN_STATUS_SUCCESS) {
            int64_t ws = 0, nws = 0;
            if ((last = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &nws,
                                                 &ws)) == CUDNN_STATUS_SUCCESS) {
                p->plan = plan;
                p->workspace = ws;
                return true;
            }
        }
        cudnnBackendDestroyDescriptor(plan);
    }
    b->st = last;
    b->what = "no engine configuration finalises an execution plan";
    return false;
}

static struct att_state *state(const char *kn, const struct am_dev *d)
{
    struct am_cuda_ctx *c = am_cuda_ctx(kn, d);
    if (c->attn)
        return (struct att_state *)c->attn;
    struct att_state *s = (struct att_state *)calloc(1, sizeof *s);
    if (!s)
        am_cuda_fatal(kn, "out of host memory for cuDNN's state");
    c->attn = s;
    cudnnStatus_t st = cudnnCreate(&s->handle);
    if (st == CUDNN_STATUS_SUCCESS && (st = cudnnSetStream(s->handle, am_cuda_stream(d))) != CUDNN_STATUS_SUCCESS) {
        cudnnDestroy(s->handle);
        s->handle = NULL;
    }
    if (st != CUDNN_STATUS_SUCCESS) { /* no cuDNN on this context: every call runs the backend's kernels */
        s->handle = NULL;
        snprintf(s->why, sizeof s->why, "cudnnCreate or cudnnSetStream: %s", cudnnGetErrorString(st));
        note_once(kn, "cuDNN cannot run attention (%s); the CUDA backend's own attention kernels run it", s->why);
    }
    return s;
}

/* the plan for a key, built on first use; NULL when cuDNN cannot run it (why in s->why) */
static struct att_plan *plan_for(const char *kn, const struct am_dev *d, struct att_state *s, const struct att_key *key)
{
    for (int i = 0; i < ATT_PLANS; i++)
        if (s->plans[i].used && memcmp(&s->plans[i].key, key, sizeof *key) == 0)
            return s->plans[i].ok ? &s->plans[i] : NULL;
    struct att_plan *p = &s->plans[s->next];
    s->next = (s->next + 1) % ATT_PLANS;
    if (p->used) { /* evicted */
        /* the stream may still run the plan: wait for it (the context's stream, not the device:
         * a collective on another stream may wait for a peer) before the plan goes. Only here,
         * where more than ATT_PLANS shapes came by, does a kernel wait for its stream. */
        if (p->plan) {
            am_cuda_check(kn, cudaStreamSynchronize(am_cuda_stream(d)), "cudaStreamSynchronize (a cuDNN plan evicted)");
            cudnnBackendDestroyDescriptor(p->plan);
        }
        for (int i = 0; i < p->nkeep; i++)
            cudnnBackendDestroyDescriptor(p->keep[i]);
    }
    memset(p, 0, sizeof *p);
    p->key = *key;
    p->used = true;
    struct builder b = {p, CUDNN_STATUS_SUCCESS, NULL, 1000};
    p->ok = build(s, p, &b);
    if (!p->ok) {
        char msg[256] = "";
        cudnnGetLastErrorString(msg, sizeof msg);
        snprintf(s->why, sizeof s->why, "%s B=%lld T=%lld H=%lld KVH=%lld D=%lld window=%lld: %s: %s%s%s", key->bwd ? "backward" : "forward",
                 (long long)key->B, (long long)key->T, (long long)key->H, (long long)key->KVH, (long long)key->D,
                 (long long)key->W, b.what ? b.what : "?", cudnnGetErrorString(b.st), msg[0] ? ": " : "", msg);
        note_once(kn, "cuDNN cannot run the attention %s; the CUDA backend's own attention kernels run it", s->why);
        for (int i = 0; i < p->nkeep; i++)
            cudnnBackendDestroyDescriptor(p->keep[i]);
        p->nkeep = 0;
        return NULL;
    }
    return p;
}

static bool aligned16(const struct am_tensor *t) { return ((uintptr_t)t->data & 15u) == 0; }

/* the key of a call that cuDNN may run (bf16, D 64 or 128 for every head, v's too, aligned), or false */
static bool key_for(struct att_key *key, int bwd, const struct am_tensor *q, const struct am_tensor *k, int64_t window,
                    const struct am_tensor *const *all, int nall)
{
    if (q->dtype != AM_BF16)
        return false;
    int64_t D = q->shape[3];
    if (D != 64 && D != 128)
        return false;
    if (q->shape[1] < 2) /* no cuDNN backward for T = 1; the forward stays with it on one path */
        return false;
    for (int i = 0; i < nall; i++)
        if (!aligned16(all[i]) || (all[i]->ndim == 4 && all[i]->shape[3] != D)) /* v's heads as wide as q's */
            return false;
    memset(key, 0, sizeof *key);
    key->bwd = bwd;
    key->B = q->shape[0];
    key->T = q->shape[1];
    key->H = q->shape[2];
    key->KVH = k->shape[2];
    key->D = D;
    key->W = window > 0 && window < key->T ? window : 0;
    return true;
}

static int execute(const char *kn, const struct am_dev *d, struct att_state *s, struct att_plan *p, const int64_t *uids,
                   void **ptrs, int n, void *ws)
{
    cudnnBackendDescriptor_t vp = NULL;
    cudnnStatus_t st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendFinalize(vp);
    if (st == CUDNN_STATUS_SUCCESS) {
        cudnnSetStream(s->handle, am_cuda_stream(d));
        st = cudnnBackendExecute(s->handle, p->plan, vp);
    }
    if (vp)
        cudnnBackendDestroyDescriptor(vp);
    if (st != CUDNN_STATUS_SUCCESS) {
        char msg[256] = "";
        cudnnGetLastErrorString(msg, sizeof msg);
        am_cuda_device_error(kn, cudnnGetErrorString(st),
                             "cudnnBackendExecute: %s%s%s (AM_ATTN=own runs attention without cuDNN)",
                             cudnnGetErrorString(st), msg[0] ? ": " : "", msg);
    }
    AM_LAUNCHED(kn);
    return 0;
}

static size_t up256(size_t n) { return (n + 255) / 256 * 256; }

int am_cuda_attention_cudnn_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *lse,
                                    const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                    int64_t window)
{
    const char *kn = "am_cuda_attention_forward";
    struct att_key key;
    const struct am_tensor *all[] = {out, lse, q, k, v};
    if (!key_for(&key, 0, q, k, window, all, 5))
        return -1;
    struct att_state *s = state(kn, d);
    if (!s->handle)
        return -1;
    struct att_plan *p = plan_for(kn, d, s, &key);
    if (!p)
        return -1;
    float scale = (float)(1.0 / sqrt((double)key.D)), neginf = -INFINITY, w = (float)key.W;
    void *ws = am_cuda_scratch(kn, d, up256((size_t)p->workspace));
    int64_t uids[] = {U_Q, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEGINF, U_WINDOW};
    void *ptrs[] = {q->data, k->data, v->data, out->data, lse->data, &scale, &neginf, &w};
    return execute(kn, d, s, p, uids, ptrs, key.W > 0 ? 8 : 7, ws);
}

int am_cuda_attention_cudnn_backward(const struct am_dev *d, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                                     const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                                     const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                                     int64_t window)
{
    const char *kn = "am_cuda_attention_backward";
    struct att_key key;
    const struct am_tensor *all[] = {dq, dk, dv, dout, out, lse, q, k, v};
    if (!key_for(&key, 1, q, k, window, all, 9))
        return -1;
    struct att_state *s = state(kn, d);
    if (!s->handle)
        return -1;
    struct att_plan *p = plan_for(kn, d, s, &key);
    if (!p)
        return -1;
    /* scratch: cuDNN's workspace, Dsum [B, H, T] and dQacc [B, H, T, D] fp32, then dq, dk,
     * dv as cuDNN writes them */
    size_t wsb = up256((size_t)p->workspace), dsb = up256((size_t)(key.B * key.H * key.T) * sizeof(float));
    size_t ab = up256((size_t)am_tensor_numel(dq) * sizeof(float));
    size_t qb = up256((size_t)am_tensor_numel(dq) * 2), kb = up256((size_t)am_tensor_numel(dk) * 2);
    char *ws = (char *)am_cuda_scratch(kn, d, wsb + dsb + ab + qb + 2 * kb);
    char *dsum = ws + wsb, *acc = dsum + dsb, *tq = acc + ab, *tk = tq + qb, *tv = tk + kb;
    /* cuDNN >= 9.6 initialises the accumulator itself; zeroing it costs little and does not
     * depend on that */
    am_cuda_check(kn, cudaMemsetAsync(acc, 0, ab, am_cuda_stream(d)), "cudaMemsetAsync (dQ accumulator)");
    float scale = (float)(1.0 / sqrt((double)key.D)), neginf = -INFINITY, one = 1.0f, w = (float)key.W;
    int64_t uids[] = {U_Q, U_K, U_V, U_O, U_STATS, U_DO, U_DQ, U_DK, U_DV, U_DSUM, U_DQACC, U_SCALE, U_NEGINF, U_ONE, U_WINDOW};
    void *ptrs[] = {q->data, k->data, v->data, out->data, lse->data, dout->data, tq, tk,
                    tv,      dsum,    acc,     &scale,    &neginf,   &one,       &w};
    execute(kn, d, s, p, uids, ptrs, key.W > 0 ? 15 : 14, ws);
    /* kernels.h's backward accumulates: dq += cuDNN's dq, and so on */
    struct am_tensor g[3] = {*dq, *dk, *dv};
    g[0].data = tq;
    g[1].data = tk;
    g[2].data = tv;
    g[0].name = "cuDNN's dq";
    g[1].name = "cuDNN's dk";
    g[2].name = "cuDNN's dv";
    am_cuda_add(d, dq, &g[0]);
    am_cuda_add(d, dk, &g[1]);
    am_cuda_add(d, dv, &g[2]);
    return 0;
}

const char *am_cuda_attention_cudnn_why(const struct am_dev *d)
{
    struct am_cuda_ctx *c = am_cuda_ctx("am_cuda_attention_cudnn_why", d);
    struct att_state *s = (struct att_state *)c->attn;
    return s && s->why[0] ? s->why : NULL;
}

void am_cuda_attention_cudnn_close(struct am_dev *d)
{
    struct am_cuda_ctx *c = (struct am_cuda_ctx *)d->workspace;
    if (!c || !c->attn)
        return;
    struct att_state *s = (struct att_state *)c->attn;
    for (int i = 0; i < ATT_PLANS; i++) {
        struct att_plan *p = &s->plans[i];
        if (p->plan)
            cudnnBackendDestroyDescriptor(p->plan);
        for (int j = 0; j < p->nkeep; j++)
            cudnnBackendDestroyDescriptor(p->keep[j]);
    }
    if (s->handle)
        cudnnDestroy(s->handle);
    free(s);
    c->attn = NULL;
}
