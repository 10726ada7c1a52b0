/* embedding.cu - the vocabulary-parallel embedding, forward and backward, computing what
 * kernels/cpu/embedding.c computes (kernels.h has the contract).
 *
 * Determinism: the backward's in-shard tokens are sorted by row (CUB's radix sort, stable:
 * each row's tokens stay in token order), then one block per row adds its tokens' gradients in
 * token order onto the row, in fp32, rounding once: the CPU's order, so the result is the
 * CPU's bit for bit. No atomics.
 */
#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"

template <typename T> __global__ void embed_fwd_k(T *out, const int32_t *ids, const T *wte, int64_t vocab_start, int64_t V,
                                                   int64_t N, int64_t C)
{
    AM_GRID_STRIDE(e, N * C)
    {
        int64_t i = e / C, c = e % C, r = (int64_t)ids[i] - vocab_start;
        out[e] = r >= 0 && r < V ? wte[r * C + c] : (T)0;
    }
}

void am_cuda_embedding_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *ids,
                               const struct am_tensor *wte, int64_t vocab_start)
{
    const char *k = "am_cuda_embedding_forward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "wte", wte);
    am_cuda_same(k, "out", out, "wte", wte);
    const int32_t *id = (const int32_t *)am_cuda_data(k, "ids", ids, AM_I32);
    AM_CUDA_REQUIRE(k, am_cols(out) == am_cols(wte), "out (%s) has rows of %lld, wte (%s) of %lld: both must be the hidden size",
                    am_tname(out), (long long)am_cols(out), am_tname(wte), (long long)am_cols(wte));
    AM_CUDA_REQUIRE(k, am_rows(out) == am_tensor_numel(ids), "out (%s) has %lld rows for %lld ids", am_tname(out),
                    (long long)am_rows(out), (long long)am_tensor_numel(ids));
    int64_t N = am_rows(out), C = am_cols(out), V = am_rows(wte);
    if (!N || !C)
        return;
    cudaStream_t s = am_cuda_stream(d);
    if (dt == AM_F32)
        embed_fwd_k<<<am_blocks(N * C), AM_THREADS, 0, s>>>((uint32_t *)out->data, id, (const uint32_t *)wte->data,
                                                           vocab_start, V, N, C);
    else
        embed_fwd_k<<<am_blocks(N * C), AM_THREADS, 0, s>>>((am_bf16_t *)out->data, id, (const am_bf16_t *)wte->data,
                                                           vocab_start, V, N, C);
    AM_LAUNCHED(k);
}

/* key = the token's row in the shard, or V (sorted last, skipped) when out of the shard */
__global__ void embed_keys_k(uint32_t *key, int32_t *tok, const int32_t *ids, int64_t vocab_start, int64_t V, int64_t N)
{
    AM_GRID_STRIDE(i, N)
    {
        int64_t r = (int64_t)ids[i] - vocab_start;
        key[i] = (uint32_t)(r >= 0 && r < V ? r : V);
        tok[i] = (int32_t)i;
    }
}

/* one block per sorted position that starts a row's run; threads over the columns */
template <typename G, typename S>
__global__ void embed_bwd_k(G *dwte, const S *dout, const uint32_t *key, const int32_t *tok, int64_t V, int64_t N, int64_t C)
{
    for (int64_t p = blockIdx.x; p < N; p += gridDim.x) {
        uint32_t row = key[p];
        if (row >= (uint32_t)V || (p > 0 && key[p - 1] == row))
            continue;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = am_ld(dwte, (int64_t)row * C + c);
            for (int64_t q = p; q < N && key[q] == row; q++)
                acc += am_ld(dout, (int64_t)tok[q] * C + c);
            am_st(dwte, (int64_t)row * C + c, acc);
        }
    }
}

void am_cuda_embedding_backward(const struct am_dev *d, struct am_tensor *dwte, const struct am_tensor *dout,
                                const struct am_tensor *ids, int64_t vocab_start)
{
    const char *k = "am_cuda_embedding_backward";
    am_cuda_ctx(k, d);
    enum am_dtype dt = am_cuda_act(k, "dout", dout);
    am_cuda_grad(k, "dwte", dwte, "dout", dout);
    const int32_t *id = (const int32_t *)am_cuda_data(k, "ids", ids, AM_I32);
    AM_CUDA_REQUIRE(k, am_cols(dout) == am_cols(dwte), "dout (%s) has rows of %lld, dwte (%s) of %lld: both must be the hidden size",
                    am_tname(dout), (long long)am_cols(dout), am_tname(dwte), (long long)am_cols(dwte));
    AM_CUDA_REQUIRE(k, am_rows(dout) == am_tensor_numel(ids), "dout (%s) has %lld rows for %lld ids", am_tname(dout),
                    (long long)am_rows(dout), (long long)am_tensor_numel(ids));
    int64_t N = am_rows(dout), C = am_cols(dout), V = am_rows(dwte);
    AM_CUDA_REQUIRE(k, N < INT32_MAX && V < UINT32_MAX, "%lld tokens and %lld rows: the sort takes 32-bit keys", (long long)N,
                    (long long)V);
    if (!N || !C)
        return;
    cudaStream_t s = am_cuda_stream(d);
    int bits = 1;
    while (bits < 32 && ((uint64_t)1 << bits) <= (uint64_t)V)
        bits++;
    size_t tmp = 0;
    am_cuda_check(k, cub::DeviceRadixSort::SortPairs(NULL, tmp, (const uint32_t *)NULL, (uint32_t *)NULL,
                                                     (const int32_t *)NULL, (int32_t *)NULL, (int)N, 0, bits, s),
                  "cub::DeviceRadixSort::SortPairs (size)");
    size_t arr = ((size_t)N * 4 + 255) / 256 * 256;
    char *ws = (char *)am_cuda_scratch(k, d, 4 * arr + tmp);
    uint32_t *key_in = (uint32_t *)ws, *key_out = (uint32_t *)(ws + arr);
    int32_t *tok_in = (int32_t *)(ws + 2 * arr), *tok_out = (int32_t *)(ws + 3 * arr);
    embed_keys_k<<<am_blocks(N), AM_THREADS, 0, s>>>(key_in, tok_in, id, vocab_start, V, N);
    AM_LAUNCHED(k);
    am_cuda_check(k, cub::DeviceRadixSort::SortPairs(ws + 4 * arr, tmp, key_in, key_out, tok_in, tok_out, (int)N, 0, bits, s),
                  "cub::DeviceRadixSort::SortPairs");
    unsigned blocks = (unsigned)(N < 65536 ? N : 65536);
    if (dwte->dtype == AM_F32 && dt == AM_F32)
        embed_bwd_k<<<blocks, AM_THREADS, 0, s>>>((float *)dwte->data, (const float *)dout->data, key_out, tok_out, V, N, C);
    else if (dwte->dtype == AM_F32)
        embed_bwd_k<<<blocks, AM_THREADS, 0, s>>>((float *)dwte->data, (const am_bf16_t *)dout->data, key_out, tok_out, V, N, C);
    else
        embed_bwd_k<<<blocks, AM_THREADS, 0, s>>>((am_bf16_t *)dwte->data, (const am_bf16_t *)dout->data, key_out, tok_out, V,
                                                  N, C);
    AM_LAUNCHED(k);
}
