/* glu.cuh - the gated linear units' kernels, shared by SwiGLU (swiglu.cu) and GeGLU
 * (gemma.cu): out = act(gate) * up; dup += dout * act(gate), dgate += dout * up * act'(gate),
 * element-wise in fp32, each output rounded once (bf16). Op is the activation: a struct with
 * __device__ static float f(float g) (act) and df(float g) (its derivative), given by the
 * including file. */
#ifndef AM_KERNELS_CUDA_GLU_CUH
#define AM_KERNELS_CUDA_GLU_CUH

#include "common.cuh"

template <class Op, typename T> __global__ void glu_fwd_k(T *out, const T *gate, const T *up, int64_t n)
{
    AM_GRID_STRIDE(i, n)
    am_st(out, i, Op::f(am_ld(gate, i)) * am_ld(up, i));
}

template <class Op, typename T>
__global__ void glu_bwd_k(T *dgate, T *dup, const T *dout, const T *gate, const T *up, int64_t n)
{
    AM_GRID_STRIDE(i, n)
    {
        float g = am_ld(gate, i), d = am_ld(dout, i);
        if (dup)
            am_st(dup, i, am_ld(dup, i) + d * Op::f(g));
        if (dgate)
            am_st(dgate, i, am_ld(dgate, i) + d * am_ld(up, i) * Op::df(g));
    }
}

/* The units' arguments: gate an activation tensor, up and a (out or dout, named `name`) of its
 * dtype and element count; returns the dtype. */
static inline enum am_dtype glu_check(const char *k, const char *name, const struct am_tensor *a,
                                      const struct am_tensor *gate, const struct am_tensor *up)
{
    enum am_dtype dt = am_cuda_act(k, "gate", gate);
    am_cuda_same(k, "up", up, "gate", gate);
    am_cuda_same(k, name, a, "gate", gate);
    if (am_tensor_numel(a) != am_tensor_numel(gate) || am_tensor_numel(up) != am_tensor_numel(gate))
        am_cuda_fatal(k, "gate (%s), up (%s) and %s must have the same shape (%lld, %lld, %lld elements)", am_tname(gate),
                      am_tname(up), am_tname(a), (long long)am_tensor_numel(gate), (long long)am_tensor_numel(up),
                      (long long)am_tensor_numel(a));
    return dt;
}

/* The backward's gradients, each optional: gate's dtype, and gate's and up's element counts. */
static inline void glu_grads_check(const char *k, const struct am_tensor *dgate, const struct am_tensor *dup,
                                   const struct am_tensor *gate, const struct am_tensor *up)
{
    if (dgate)
        am_cuda_same(k, "dgate", dgate, "gate", gate);
    if (dup)
        am_cuda_same(k, "dup", dup, "gate", gate);
    AM_CUDA_REQUIRE(k, !dgate || am_tensor_numel(dgate) == am_tensor_numel(gate), "dgate (%s) must have gate's shape",
                    am_tname(dgate));
    AM_CUDA_REQUIRE(k, !dup || am_tensor_numel(dup) == am_tensor_numel(up), "dup (%s) must have up's shape", am_tname(dup));
}

template <class Op>
static void glu_forward(const char *k, const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate,
                        const struct am_tensor *up)
{
    am_cuda_ctx(k, d);
    enum am_dtype dt = glu_check(k, "out", out, gate, up);
    int64_t n = am_tensor_numel(out);
    if (!n)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        glu_fwd_k<Op><<<am_blocks(n), AM_THREADS, 0, s>>>((float *)out->data, (const float *)gate->data,
                                                         (const float *)up->data, n);
    else
        glu_fwd_k<Op><<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)out->data, (const am_bf16_t *)gate->data,
                                                         (const am_bf16_t *)up->data, n);
    AM_LAUNCHED(k);
}

template <class Op>
static void glu_backward(const char *k, const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup,
                         const struct am_tensor *dout, const struct am_tensor *gate, const struct am_tensor *up)
{
    am_cuda_ctx(k, d);
    enum am_dtype dt = glu_check(k, "dout", dout, gate, up);
    glu_grads_check(k, dgate, dup, gate, up);
    int64_t n = am_tensor_numel(dout);
    if (!n || (!dgate && !dup))
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        glu_bwd_k<Op><<<am_blocks(n), AM_THREADS, 0, s>>>(dgate ? (float *)dgate->data : NULL,
                                                         dup ? (float *)dup->data : NULL, (const float *)dout->data,
                                                         (const float *)gate->data, (const float *)up->data, n);
    else
        glu_bwd_k<Op><<<am_blocks(n), AM_THREADS, 0, s>>>(dgate ? (am_bf16_t *)dgate->data : NULL,
                                                         dup ? (am_bf16_t *)dup->data : NULL,
                                                         (const am_bf16_t *)dout->data, (const am_bf16_t *)gate->data,
                                                         (const am_bf16_t *)up->data, n);
    AM_LAUNCHED(k);
}

#endif
