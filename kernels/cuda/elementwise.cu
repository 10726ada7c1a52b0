/* elementwise.cu - dst += src, t *= s, dropout's mask, dtype conversion, the sum of squares (gradient norm)
 * and the finiteness check, as kernels/cpu/elementwise.c computes them.
 *
 * sum_squares is deterministic: SS_BLOCKS blocks (a constant, whatever the GPU) each sum a
 * fixed grid-stride share of the squares in double and reduce their threads by a fixed
 * tree into one partial; one final block adds the partials by a fixed tree and adds
 * total / div into the accumulator. all_finite writes 0 into the flag from any thread that
 * sees an Inf or a NaN (all write the same value) and never syncs with the host. */
#include "common.cuh"
#include "rng.h"

template <typename D, typename S> __global__ void add_k(D *dst, const S *src, int64_t n)
{
    AM_GRID_STRIDE(i, n) am_st(dst, i, am_ld(dst, i) + am_ld(src, i));
}

template <typename T> __global__ void scale_k(T *t, float s, int64_t n)
{
    AM_GRID_STRIDE(i, n) am_st(t, i, am_ld(t, i) * s);
}

/* dropout's mask (kernels.h): one thread per element, its counter that of the CPU's */
template <typename T> __global__ void dropout_k(T *t, struct am_dropout dr, float keep, int64_t F, int64_t n)
{
    AM_GRID_STRIDE(e, n)
    {
        int64_t r = e / F, f = e % F, b = r / dr.rows_per_seq, i = r % dr.rows_per_seq;
        int64_t key = (dr.seq0 + b * dr.seq_step) * dr.seq_len + (dr.pos ? dr.pos[i] : i);
        uint64_t idx = (uint64_t)key * (uint64_t)dr.cols + (uint64_t)dr.col0 + (uint64_t)f;
        am_st(t, e, am_ld(t, e) * (am_rng_keep(dr.seed, dr.stream, idx, dr.p) ? keep : 0.0f));
    }
}

template <typename D, typename S> __global__ void convert_k(D *dst, const S *src, int64_t n)
{
    AM_GRID_STRIDE(i, n) dst[i] = (D)src[i];
}

template <typename D> __global__ void from_bf16_k(D *dst, const am_bf16_t *src, int64_t n)
{
    AM_GRID_STRIDE(i, n) dst[i] = am_ld(src, i);
}

__global__ void to_bf16_k(am_bf16_t *dst, const float *src, int64_t n)
{
    AM_GRID_STRIDE(i, n) dst[i] = am_to_bf16(src[i]);
}

static void same_size(const char *k, const struct am_tensor *a, const struct am_tensor *b)
{
    if (am_tensor_numel(a) != am_tensor_numel(b))
        am_cuda_fatal(k, "dst (%s) has %lld elements, src (%s) %lld: they must match", am_tname(a),
                      (long long)am_tensor_numel(a), am_tname(b), (long long)am_tensor_numel(b));
}

void am_cuda_add(const struct am_dev *d, struct am_tensor *dst, const struct am_tensor *src)
{
    const char *k = "am_cuda_add";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "dst", dst), st = am_cuda_act(k, "src", src);
    same_size(k, dst, src);
    int64_t n = am_tensor_numel(dst);
    if (!n)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32 && st == AM_F32)
        add_k<<<am_blocks(n), AM_THREADS, 0, s>>>((float *)dst->data, (const float *)src->data, n);
    else if (dt == AM_F32)
        add_k<<<am_blocks(n), AM_THREADS, 0, s>>>((float *)dst->data, (const am_bf16_t *)src->data, n);
    else if (st == AM_F32)
        add_k<<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)dst->data, (const float *)src->data, n);
    else
        add_k<<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)dst->data, (const am_bf16_t *)src->data, n);
    AM_LAUNCHED(k);
}

void am_cuda_scale(const struct am_dev *d, struct am_tensor *t, float sc)
{
    const char *k = "am_cuda_scale";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "t", t);
    int64_t n = am_tensor_numel(t);
    if (!n)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        scale_k<<<am_blocks(n), AM_THREADS, 0, s>>>((float *)t->data, sc, n);
    else
        scale_k<<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)t->data, sc, n);
    AM_LAUNCHED(k);
}

void am_cuda_dropout(const struct am_dev *d, struct am_tensor *t, const struct am_dropout *dr)
{
    const char *k = "am_cuda_dropout";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "t", t);
    int64_t n = am_tensor_numel(t), F = t->shape[1] ? t->shape[1] : 1;
    if (!n)
        return;
    float keep = 1.0f / (1.0f - dr->p);
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        dropout_k<<<am_blocks(n), AM_THREADS, 0, s>>>((float *)t->data, *dr, keep, F, n);
    else
        dropout_k<<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)t->data, *dr, keep, F, n);
    AM_LAUNCHED(k);
}

void am_cuda_convert(const struct am_dev *d, struct am_tensor *dst, const struct am_tensor *src)
{
    const char *k = "am_cuda_convert";
    am_cuda_ctx(k, d);
    am_cuda_tensor(k, "dst", dst);
    am_cuda_tensor(k, "src", src);
    same_size(k, dst, src);
    enum am_dtype to = dst->dtype, from = src->dtype;
    if (to == from) {
        am_cuda_copy(d, dst, src);
        return;
    }
    int64_t n = am_tensor_numel(dst);
    if (!n)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (from == AM_F32 && to == AM_BF16)
        to_bf16_k<<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)dst->data, (const float *)src->data, n);
    else if (from == AM_BF16 && to == AM_F32)
        from_bf16_k<<<am_blocks(n), AM_THREADS, 0, s>>>((float *)dst->data, (const am_bf16_t *)src->data, n);
    else if (from == AM_F64 && to == AM_F32)
        convert_k<<<am_blocks(n), AM_THREADS, 0, s>>>((float *)dst->data, (const double *)src->data, n);
    else if (from == AM_F32 && to == AM_F64)
        convert_k<<<am_blocks(n), AM_THREADS, 0, s>>>((double *)dst->data, (const float *)src->data, n);
    else
        am_cuda_fatal(k, "no conversion from %s's dtype (%s) to %s's (%s): fp32 <-> bf16, fp32 <-> fp64", am_tname(src),
                      am_dtype_name(from), am_tname(dst), am_dtype_name(to));
    AM_LAUNCHED(k);
}

/* ---- sum of squares ---- */
#define SS_BLOCKS 1024
#define SS_THREADS 256

/* threads' values of one block summed by a fixed tree into v[0] (blockDim.x a power of 2) */
__device__ static double block_sum(double *v)
{
    for (unsigned w = blockDim.x / 2; w > 0; w /= 2) {
        __syncthreads();
        if (threadIdx.x < w)
            v[threadIdx.x] += v[threadIdx.x + w];
    }
    __syncthreads();
    return v[0];
}

template <typename T> __global__ void ss_partial_k(double *part, const T *x, int64_t n)
{
    __shared__ double v[SS_THREADS];
    double acc = 0.0;
    AM_GRID_STRIDE(i, n)
    {
        double a = am_ld(x, i);
        acc += a * a;
    }
    v[threadIdx.x] = acc;
    double total = block_sum(v);
    if (threadIdx.x == 0)
        part[blockIdx.x] = total;
}

__global__ void ss_final_k(double *acc, const double *part, double div)
{
    __shared__ double v[SS_BLOCKS];
    v[threadIdx.x] = part[threadIdx.x];
    double total = block_sum(v);
    if (threadIdx.x == 0)
        *acc += total / div;
}

void am_cuda_sum_squares(const struct am_dev *d, struct am_tensor *acc, const struct am_tensor *t, double div)
{
    const char *k = "am_cuda_sum_squares";
    am_cuda_ctx(k, d);
    double *out = (double *)am_cuda_scalar(k, "acc", acc, AM_F64);
    enum am_dtype dt = am_cuda_act(k, "t", t);
    int64_t n = am_tensor_numel(t);
    double *part = (double *)am_cuda_scratch(k, d, SS_BLOCKS * sizeof(double));
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        ss_partial_k<<<SS_BLOCKS, SS_THREADS, 0, s>>>(part, (const float *)t->data, n);
    else
        ss_partial_k<<<SS_BLOCKS, SS_THREADS, 0, s>>>(part, (const am_bf16_t *)t->data, n);
    AM_LAUNCHED(k);
    ss_final_k<<<1, SS_BLOCKS, 0, s>>>(out, part, div);
    AM_LAUNCHED(k);
}

/* ---- finiteness ---- */

__global__ void finite_f32_k(int32_t *flag, const uint32_t *x, int64_t n)
{
    bool bad = false;
    AM_GRID_STRIDE(i, n) bad |= (x[i] & 0x7F800000u) == 0x7F800000u;
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        *flag = 0;
}

__global__ void finite_bf16_k(int32_t *flag, const am_bf16_t *x, int64_t n)
{
    bool bad = false;
    AM_GRID_STRIDE(i, n) bad |= (x[i] & 0x7F80u) == 0x7F80u;
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        *flag = 0;
}

void am_cuda_all_finite(const struct am_dev *d, struct am_tensor *flag, const struct am_tensor *t)
{
    const char *k = "am_cuda_all_finite";
    am_cuda_ctx(k, d);
    int32_t *ok = (int32_t *)am_cuda_scalar(k, "flag", flag, AM_I32);
    enum am_dtype dt = am_cuda_act(k, "t", t);
    int64_t n = am_tensor_numel(t);
    if (!n)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        finite_f32_k<<<am_blocks(n), AM_THREADS, 0, s>>>(ok, (const uint32_t *)t->data, n);
    else
        finite_bf16_k<<<am_blocks(n), AM_THREADS, 0, s>>>(ok, (const am_bf16_t *)t->data, n);
    AM_LAUNCHED(k);
}

/* copy_cols (kernels.h): one thread per element of the block, the CPU's index arithmetic */
template <typename T>
__global__ void copy_cols_k(T *dst, int64_t Nd, int64_t dst_col, const T *src, int64_t Ns, int64_t src_col,
                            int64_t width, int perm, bool accumulate, int64_t n)
{
    AM_GRID_STRIDE(e, n)
    {
        int64_t i = e / width, j = e % width, half = width / 2;
        int64_t pj = perm == 0 ? j : j < half ? 2 * j : 2 * (j - half) + 1;
        int64_t di = i * Nd + dst_col + (perm < 0 ? pj : j), si = i * Ns + src_col + (perm > 0 ? pj : j);
        if (accumulate)
            am_st(dst, di, am_ld(dst, di) + am_ld(src, si));
        else
            dst[di] = src[si];
    }
}

void am_cuda_copy_cols(const struct am_dev *d, struct am_tensor *dst, int64_t dst_col, const struct am_tensor *src,
                       int64_t src_col, int64_t width, int perm, bool accumulate)
{
    const char *k = "am_cuda_copy_cols";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "dst", dst), st = am_cuda_act(k, "src", src);
    int64_t Nd = dst->ndim ? dst->shape[dst->ndim - 1] : 1, Ns = src->ndim ? src->shape[src->ndim - 1] : 1;
    int64_t M = Nd ? am_tensor_numel(dst) / Nd : 0, Ms = Ns ? am_tensor_numel(src) / Ns : 0;
    if (dt != st || M != Ms || width < 0 || dst_col < 0 || src_col < 0 || dst_col + width > Nd ||
        src_col + width > Ns || (perm != 0 && width % 2))
        am_cuda_fatal(k, "columns [%lld, +%lld) of dst (%s, %lld x %lld) from [%lld, +%lld) of src (%s, %lld x %lld), "
                      "perm %d: dtypes, rows or range do not fit", (long long)dst_col, (long long)width, am_tname(dst),
                      (long long)M, (long long)Nd, (long long)src_col, (long long)width, am_tname(src), (long long)Ms,
                      (long long)Ns, perm);
    int64_t n = M * width;
    if (!n)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        copy_cols_k<<<am_blocks(n), AM_THREADS, 0, s>>>((float *)dst->data, Nd, dst_col, (const float *)src->data, Ns,
                                                       src_col, width, perm, accumulate, n);
    else
        copy_cols_k<<<am_blocks(n), AM_THREADS, 0, s>>>((am_bf16_t *)dst->data, Nd, dst_col,
                                                       (const am_bf16_t *)src->data, Ns, src_col, width, perm,
                                                       accumulate, n);
    AM_LAUNCHED(k);
}
