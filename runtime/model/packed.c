/* packed.c - packed sequences in the model: the rows' documents and rotary positions (packed.h). */
#include "packed.h"

#include <stdlib.h>
#include <string.h>

#include "model_impl.h"
#include "ring.h"
#include "util.h"

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

int am_packed_init(struct am_model *m, int64_t seq_len, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    const struct am_model_config *cfg = &m->cfg;
    int64_t T = seq_len, Tl = m->seq_len, N = m->max_tokens, half = am_model_rotary_dim(&m->cfg) / 2;
    int P = m->cp ? m->cp->size : 1;
    if (Tl * P != T)
        return am_fail(err, err_len, "packed sequences: the model holds %lld rows of a sequence of %lld tokens over "
                       "cp = %d", (long long)Tl, (long long)T, P);
    struct am_packed *pk = calloc(1, sizeof(*pk));
    if (!pk)
        return am_fail(err, err_len, "packed sequences: out of memory");
    m->pk = pk;
    pk->seq_len = T;
    pk->starts = calloc((size_t)m->n_slots, sizeof(*pk->starts));
    pk->rope_pos = calloc((size_t)m->n_slots, sizeof(*pk->rope_pos));
    pk->host_rows = malloc((size_t)Tl * sizeof(int32_t));
    pk->host_pos = malloc((size_t)N * sizeof(int32_t));
    int64_t Bmax = N / Tl + 1;
    pk->fill = malloc((size_t)(m->n_slots * Bmax) * sizeof(int32_t));
    pk->runs = malloc((size_t)(4 * Bmax) * sizeof(int64_t));
    size_t tab = align64((size_t)(T * half) * sizeof(float)), rows = align64((size_t)(N * half) * sizeof(float));
    size_t ints = align64((size_t)N * sizeof(int32_t)), own = align64((size_t)Tl * sizeof(int32_t));
    int pairs = cfg->rope_local_base_freq > 0 ? 2 : 1; /* Gemma 3: its sliding layers' tables too */
    pk->bytes = (size_t)pairs * (2 * tab + 2 * rows) + own + 2 * ints * (size_t)m->n_slots;
    if (!pk->starts || !pk->rope_pos || !pk->host_rows || !pk->host_pos || !pk->fill || !pk->runs || !(pk->mem = K->alloc(m->dev, pk->bytes))) {
        size_t bytes = pk->bytes;
        am_packed_free(m);
        return am_fail(err, err_len, "packed sequences: out of memory for %zu bytes of document starts and rotary "
                       "tables", bytes);
    }
    enum am_device dv = m->dev->device;
    char *p = pk->mem;
    pk->cos_all = am_tensor_view(p, dv, AM_F32, T, half, 0, 0);
    pk->sin_all = am_tensor_view(p + tab, dv, AM_F32, T, half, 0, 0);
    p += 2 * tab;
    pk->cos = am_tensor_view(p, dv, AM_F32, N, half, 0, 0);
    pk->sin = am_tensor_view(p + rows, dv, AM_F32, N, half, 0, 0);
    p += 2 * rows;
    if (pairs == 2) {
        pk->cos_local_all = am_tensor_view(p, dv, AM_F32, T, half, 0, 0);
        pk->sin_local_all = am_tensor_view(p + tab, dv, AM_F32, T, half, 0, 0);
        p += 2 * tab;
        pk->cos_local = am_tensor_view(p, dv, AM_F32, N, half, 0, 0);
        pk->sin_local = am_tensor_view(p + rows, dv, AM_F32, N, half, 0, 0);
        p += 2 * rows;
    }
    pk->rows = am_tensor_view(p, dv, AM_I32, Tl, 0, 0, 0);
    p += own;
    for (int s = 0; s < m->n_slots; s++) {
        pk->starts[s] = am_tensor_view(p, dv, AM_I32, N, 0, 0, 0);
        pk->rope_pos[s] = am_tensor_view(p + ints, dv, AM_I32, N, 0, 0, 0);
        p += 2 * ints;
    }
    struct am_rope_scaling rs = am_model_rope_scaling(cfg);
    K->rope_tables(m->dev, &pk->cos_all, &pk->sin_all, cfg->rope_theta, &rs);
    if (pairs == 2) /* as model.c's: their own theta, unscaled */
        K->rope_tables(m->dev, &pk->cos_local_all, &pk->sin_local_all, cfg->rope_local_base_freq, NULL);
    if (m->cp)
        am_cp_positions(T, P, m->cp->rank, pk->host_rows);
    else
        for (int64_t i = 0; i < Tl; i++)
            pk->host_rows[i] = (int32_t)i;
    K->upload(m->dev, pk->rows.data, pk->host_rows, (size_t)Tl * sizeof(int32_t));
    m->act_bytes += pk->bytes;
    return 0;
}

void am_packed_free(struct am_model *m)
{
    struct am_packed *pk = m->pk;
    if (!pk)
        return;
    if (pk->mem && m->K)
        m->K->free(m->dev, pk->mem);
    free(pk->starts);
    free(pk->rope_pos);
    free(pk->host_rows);
    free(pk->host_pos);
    free(pk->fill);
    free(pk->runs);
    free(pk);
    m->pk = NULL;
}

int am_packed_load(struct am_model *m, int slot, int64_t B, const int32_t *starts, const int32_t *fill, char *err,
                   size_t err_len)
{
    struct am_packed *pk = m->pk;
    int64_t Tl = m->seq_len, N = B * Tl, Bmax = m->max_tokens / Tl + 1;
    for (int64_t b = 0; b < B; b++) {
        int32_t f = fill ? fill[b] : (int32_t)pk->seq_len;
        if (f < 0 || f > pk->seq_len)
            return am_fail(err, err_len, "packed sequences: sequence %lld is filled to row %d, outside 0 .. %lld",
                           (long long)b, f, (long long)pk->seq_len);
        pk->fill[slot * Bmax + b] = f;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < Tl; i++) {
            int32_t s = starts[b * Tl + i], p = pk->host_rows[i];
            if (s < 0 || s > p)
                return am_fail(err, err_len, "packed sequences: row %lld of sequence %lld (position %d) has its "
                               "document start at %d, outside 0 .. %d", (long long)i, (long long)b, p, s, p);
            pk->host_pos[b * Tl + i] = p - s;
        }
    m->K->upload(m->dev, pk->starts[slot].data, starts, (size_t)N * sizeof(int32_t));
    m->K->upload(m->dev, pk->rope_pos[slot].data, pk->host_pos, (size_t)N * sizeof(int32_t));
    return 0;
}

void am_packed_enter(struct am_model *m, int slot, int64_t B)
{
    struct am_packed *pk = m->pk;
    int64_t N = B * m->seq_len;
    struct am_tensor ids = am_tensor_view(pk->rope_pos[slot].data, m->dev->device, AM_I32, N, 0, 0, 0);
    struct am_tensor c = pk->cos, s = pk->sin;
    c.shape[0] = s.shape[0] = N;
    m->K->embedding_forward(m->dev, &c, &ids, &pk->cos_all, 0);
    m->K->embedding_forward(m->dev, &s, &ids, &pk->sin_all, 0);
    if (pk->cos_local_all.data) {
        c = pk->cos_local;
        s = pk->sin_local;
        c.shape[0] = s.shape[0] = N;
        m->K->embedding_forward(m->dev, &c, &ids, &pk->cos_local_all, 0);
        m->K->embedding_forward(m->dev, &s, &ids, &pk->sin_local_all, 0);
    }
    pk->cur = am_tensor_view(pk->starts[slot].data, m->dev->device, AM_I32, N, 0, 0, 0);
}

int64_t am_packed_runs(const struct am_model *m, int slot, int64_t B, const int64_t **runs)
{
    const struct am_packed *pk = m->pk;
    int64_t Tl = m->seq_len, Bmax = m->max_tokens / Tl + 1, n = 0;
    const int32_t *fill = pk->fill + slot * Bmax;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < Tl; i++) {
            if (pk->host_rows[i] >= fill[b])
                continue;
            int64_t r = b * Tl + i;
            if (n > 0 && pk->runs[2 * n - 1] == r) /* the run goes on */
                pk->runs[2 * n - 1] = r + 1;
            else {
                pk->runs[2 * n] = r;
                pk->runs[2 * n + 1] = r + 1;
                n++;
            }
        }
    *runs = pk->runs;
    return n;
}

int64_t am_packed_filled(const struct am_model *m, int slot, int64_t B)
{
    const struct am_packed *pk = m->pk;
    int64_t Bmax = m->max_tokens / m->seq_len + 1, n = 0;
    for (int64_t b = 0; b < B; b++)
        n += pk->fill[slot * Bmax + b];
    return n;
}
