/* embedding.c - token embedding, vocabulary-parallel.
 *
 * wte [V_shard, C] holds the rows of ids vocab_start .. vocab_start + V_shard - 1.
 *   forward:  out[i] = wte[ids[i] - vocab_start] when the id is in the shard, else 0
 *             (the caller sums out over the tensor-parallel group).
 *   backward: dwte[ids[i] - vocab_start] += dout[i] for the ids in the shard.
 * The backward is a scatter-add in which several tokens may hit one row. Each thread owns a
 * slice of the columns and walks every token in order, so no two threads touch one element
 * and each element's sum is taken in token order: deterministic, whatever the thread count.
 */
#include <omp.h>

#include "cpu.h"

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

void am_cpu_embedding_forward(const struct am_dev *dev, struct am_tensor *out, const struct am_tensor *ids, const struct am_tensor *wte,
                              int64_t vocab_start)
{
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
