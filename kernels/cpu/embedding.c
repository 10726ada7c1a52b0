/* embedding.c - token embedding, vocabulary-parallel.
 *
 * wte [V_shard, C] holds the rows of ids vocab_start .. vocab_start + V_shard - 1.
 *   forward:  out[i] = wte[ids[i] - vocab_start] when the id is in the shard, else 0
 *             (the caller sums out over the tensor-parallel group).
 *   backward: dwte[ids[i] - vocab_start] += dout[i] for the ids in the shard.
 * The backward is a scatter-add in which several tokens may hit one row. Each thread owns a
 * slice of the columns and walks every token in order, so no two threads touch one element
 * and each element's sum is taken in token order: deterministic, whatever the thread count.
 *
 * bf16: wte and out share a dtype (a bf16 row is copied as it is: exact). The backward
 * takes a bf16 dout into an f32 dwte (each value widened and added, as above) or a bf16
 * dwte: then the tokens are grouped by row (a stable sort of (row, token)), each row's
 * tokens summed in fp32 in token order onto the widened row, and the row rounded once, one
 * row per task (torch's embedding_dense_backward also sums a row's tokens before the add).
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu.h"
#include "half.h"

static void check(const char *kernel, const struct am_tensor *act, const char *actname, const struct am_tensor *ids,
                  const struct am_tensor *wte, const char *wname)
{
    if (am_cols(act) != am_cols(wte))
        am_cpu_fatal(kernel, "%s (%s) has rows of %lld, %s (%s) of %lld: both must be the hidden size", actname,
                     am_tname(act), (long long)am_cols(act), wname, am_tname(wte), (long long)am_cols(wte));
    if (am_rows(act) != am_tensor_numel(ids))
        am_cpu_fatal(kernel, "%s (%s) has %lld rows for %lld ids", actname, am_tname(act), (long long)am_rows(act),
                     (long long)am_tensor_numel(ids));
}

static void embedding_forward_bf16(struct am_tensor *out, const struct am_tensor *ids, const struct am_tensor *wte,
                                   int64_t vocab_start)
{
    const char *kernel = "am_cpu_embedding_forward";
    am_cpu_act(kernel, "wte", wte);
    am_cpu_same(kernel, "out", out, "wte", wte);
    const int32_t *id = am_cpu_i32(kernel, "ids", ids);
    check(kernel, out, "out", ids, wte, "wte");
    int64_t N = am_rows(out), C = am_cols(out), V = am_rows(wte);
    size_t row = (size_t)C * am_dtype_size(wte->dtype);
    char *o = out->data;
    const char *w = wte->data;
#pragma omp parallel for schedule(static) if (N * C >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++) {
        int64_t r = (int64_t)id[i] - vocab_start;
        if (r >= 0 && r < V)
            memcpy(o + (size_t)i * row, w + (size_t)r * row, row);
        else
            memset(o + (size_t)i * row, 0, row);
    }
}

static int cmp_key(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static void embedding_backward_bf16(const struct am_dev *dev, struct am_tensor *dwte, const struct am_tensor *dout,
                                    const struct am_tensor *ids, int64_t vocab_start)
{
    const char *kernel = "am_cpu_embedding_backward";
    am_cpu_act(kernel, "dout", dout);
    am_cpu_grad(kernel, "dwte", dwte, "dout", dout);
    const int32_t *id = am_cpu_i32(kernel, "ids", ids);
    check(kernel, dout, "dout", ids, dwte, "dwte");
    int64_t N = am_rows(dout), C = am_cols(dout), V = am_rows(dwte);
    const uint16_t *d = dout->data;
    if (dwte->dtype == AM_F32) { /* the fp32 loop, each value widened */
        float *dw = dwte->data;
#pragma omp parallel if (N * C >= AM_PAR_MIN)
        {
            int64_t c0, c1;
            am_split(C, omp_get_thread_num(), omp_get_num_threads(), 16, &c0, &c1);
            for (int64_t i = 0; i < N; i++) {
                int64_t row = (int64_t)id[i] - vocab_start;
                if (row < 0 || row >= V)
                    continue;
                float *restrict dst = dw + row * C;
                const uint16_t *restrict src = d + i * C;
#pragma omp simd
                for (int64_t c = c0; c < c1; c++)
                    dst[c] += am_bf16_to_f32(src[c]);
            }
        }
        return;
    }
    /* keys (row << 32 | token), sorted: each row's tokens together, in token order */
    int nth = omp_get_max_threads();
    float *ws = am_cpu_scratch(kernel, dev, 2 * N + (int64_t)nth * (C + 16) + 16);
    int64_t *key = (int64_t *)(void *)am_cpu_carve(&ws, 2 * N), n = 0;
    float *acc_all = ws;
    for (int64_t i = 0; i < N; i++) {
        int64_t row = (int64_t)id[i] - vocab_start;
        if (row >= 0 && row < V)
            key[n++] = row << 32 | i;
    }
    qsort(key, (size_t)n, sizeof(*key), cmp_key);
    uint16_t *dw = dwte->data;
#pragma omp parallel if (n * C >= AM_PAR_MIN)
    {
        float *restrict acc = acc_all + (size_t)omp_get_thread_num() * (size_t)(C + 16);
#pragma omp for schedule(dynamic, 16)
        for (int64_t k = 0; k < n; k++) {
            if (k > 0 && key[k - 1] >> 32 == key[k] >> 32)
                continue; /* not the first token of its row */
            int64_t row = key[k] >> 32;
            uint16_t *restrict dst = dw + row * C;
            for (int64_t c = 0; c < C; c++)
                acc[c] = am_bf16_to_f32(dst[c]);
            for (int64_t j = k; j < n && key[j] >> 32 == row; j++) {
                const uint16_t *restrict src = d + (key[j] & 0xffffffff) * C;
#pragma omp simd
                for (int64_t c = 0; c < C; c++)
                    acc[c] += am_bf16_to_f32(src[c]);
            }
            for (int64_t c = 0; c < C; c++)
                dst[c] = am_f32_to_bf16(acc[c]);
        }
    }
}

void am_cpu_embedding_forward(const struct am_dev *dev, struct am_tensor *out, const struct am_tensor *ids, const struct am_tensor *wte,
                              int64_t vocab_start)
{
    if (am_not_f32(out) || am_not_f32(wte)) {
        embedding_forward_bf16(out, ids, wte, vocab_start);
        return;
    }
    float *o = F32(out);
    const int32_t *id = I32(ids);
    const float *w = F32(wte);
    check(__func__, out, "out", ids, wte, "wte");
    int64_t N = am_rows(out), C = am_cols(out), V = am_rows(wte);
#pragma omp parallel for schedule(static) if (N * C >= AM_PAR_MIN)
    for (int64_t i = 0; i < N; i++) {
        int64_t row = (int64_t)id[i] - vocab_start;
        if (row >= 0 && row < V)
            memcpy(o + i * C, w + row * C, (size_t)C * sizeof(float));
        else
            memset(o + i * C, 0, (size_t)C * sizeof(float));
    }
}

void am_cpu_embedding_backward(const struct am_dev *dev, struct am_tensor *dwte, const struct am_tensor *dout, const struct am_tensor *ids,
                               int64_t vocab_start)
{
    if (am_not_f32(dwte) || am_not_f32(dout)) {
        embedding_backward_bf16(dev, dwte, dout, ids, vocab_start);
        return;
    }
    float *dw = F32(dwte);
    const float *d = F32(dout);
    const int32_t *id = I32(ids);
    check(__func__, dout, "dout", ids, dwte, "dwte");
    int64_t N = am_rows(dout), C = am_cols(dout), V = am_rows(dwte);
#pragma omp parallel if (N * C >= AM_PAR_MIN)
    {
        int64_t c0, c1;
        am_split(C, omp_get_thread_num(), omp_get_num_threads(), 16, &c0, &c1);
        for (int64_t i = 0; i < N; i++) {
            int64_t row = (int64_t)id[i] - vocab_start;
            if (row < 0 || row >= V)
                continue;
            float *restrict dst = dw + row * C;
            const float *restrict src = d + i * C;
#pragma omp simd
            for (int64_t c = c0; c < c1; c++)
                dst[c] += src[c];
        }
    }
}
