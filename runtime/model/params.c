/* params.c - the parameter registry, the slabs and the groups (model_impl.h, model.h), and
 * the weights' initial values.
 *
 * Registration (am_model_begin_group, am_model_add_param: model.c for the embedding and the
 * head, layer.c for a layer, moe.c for its router and experts) fills params[] and groups[] in
 * model order with shapes only; am_model_place_params then lays every parameter out in the
 * slabs, consecutive, each group's span padded to group_align, and points w, g and wc there.
 */
#include "model_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "rng.h"
#include "util.h"

/* ---- the registry -------------------------------------------------------------------- */

/* Registers a parameter of local shape rows x cols (cols 0: a vector) in the current group. */
struct am_param *am_model_add_param(struct am_model *m, const char *name, int64_t rows, int64_t cols,
                                    enum am_split split, int64_t full_rows, int64_t full_cols, int64_t row0,
                                    int64_t col0)
{
    struct am_param *p = &m->params[m->n_params++];
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "%s", name);
    p->w = am_tensor_view(NULL, m->K->device, m->store_dt, rows, cols, 0, 0);
    p->g = am_tensor_view(NULL, m->K->device, AM_F32, rows, cols, 0, 0);
    p->wc = am_tensor_view(NULL, m->K->device, m->act_dt, rows, cols, 0, 0);
    p->split = split;
    p->full_rows = full_rows;
    p->full_cols = full_cols;
    p->row0 = row0;
    p->col0 = col0;
    p->copies_in_tp = split == AM_SPLIT_NONE ? m->sh.tp : 1;
    p->partial_in_tp = split == AM_SPLIT_NONE && m->sh.sequence_parallel; /* the norms of the stream's rows */
    m->n_elems += (size_t)am_tensor_numel(&p->w);
    return p;
}

/* Starts parameter group `kind` with the next parameter registered (model.h). */
void am_model_begin_group(struct am_model *m, enum am_pgroup_kind kind, int layer, const char *name)
{
    struct am_pgroup *g = &m->groups[m->n_groups++];
    *g = (struct am_pgroup){.kind = kind, .layer = layer, .first = m->n_params, .shard = AM_SHARD_REPLICATED};
    snprintf(g->name, sizeof(g->name), "%s", name);
}

int am_model_find(const struct am_model *m, const char *name)
{
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0)
            return i;
    return -1;
}

/* ---- the slabs and the groups -------------------------------------------------------- */

bool am_model_tied_across_stages(const struct am_model *m)
{
    return m->pp_comm && m->cfg.tie_word_embeddings && m->sh.first_stage != m->sh.last_stage;
}

static size_t align_up(size_t n, int align) { return align > 1 ? (n + (size_t)align - 1) / (size_t)align * (size_t)align : n; }

/* The multiple a group's span is padded to: group_align, the experts' expert_align if set;
 * LoRA's adapters, kept whole on every rank, none. */
static int align_of(const struct am_model *m, const struct am_pgroup *g)
{
    if (g->kind == AM_PG_LORA)
        return 1;
    return g->kind == AM_PG_EXPERTS && m->sh.expert_align > 0 ? m->sh.expert_align : m->sh.group_align;
}

/* The slab offset of each parameter: consecutive, each group's span padded to its align_of. */
static size_t param_offsets(struct am_model *m, size_t *offs)
{
    size_t off = 0;
    for (int g = 0, i = 0; g < m->n_groups; g++) {
        size_t start = off;
        int end = g + 1 < m->n_groups ? m->groups[g + 1].first : m->n_params;
        for (; i < end; i++) {
            offs[i] = off;
            off += (size_t)am_tensor_numel(&m->params[i].w);
        }
        off = start + align_up(off - start, align_of(m, &m->groups[g]));
    }
    return off;
}

/* Each group's span of the slabs, and whether it holds a tied copy split over stages. */
static void end_groups(struct am_model *m)
{
    for (int i = 0; i < m->n_groups; i++) {
        struct am_pgroup *g = &m->groups[i];
        g->n = (i + 1 < m->n_groups ? m->groups[i + 1].first : m->n_params) - g->first;
        g->offset = m->params[g->first].slab_off;
        g->n_elems = 0;
        for (int k = g->first; k < g->first + g->n; k++) {
            g->n_elems += (size_t)am_tensor_numel(&m->params[k].g);
            g->tied |= am_model_tied_across_stages(m) && (&m->params[k] == m->embed || &m->params[k] == m->head);
        }
        g->span = align_up(g->n_elems, align_of(m, g));
    }
}

int am_model_place_params(struct am_model *m)
{
    const struct am_kernels *K = m->K;
    /* one slab for the values, one for the gradients (each group padded to group_align: the
     * padding stays zero) */
    size_t *offs = malloc(((size_t)m->n_params + 1) * sizeof(*offs));
    if (!offs)
        return -1;
    m->slab_elems = param_offsets(m, offs);
    size_t ws = am_dtype_size(m->store_dt), cs = am_dtype_size(m->act_dt);
    m->param_mem = K->alloc(m->dev, m->slab_elems * ws);
    m->param_off = 0;
    /* LoRA freezes the base: the gradient slab is the adapters' group alone, the last */
    m->grad_off = 0;
    m->grad_elems = m->slab_elems;
    if (m->sh.lora_r > 0) {
        int first = m->n_groups; /* the adapters' groups, the last ones */
        while (first > 0 && m->groups[first - 1].kind == AM_PG_LORA)
            first--;
        const struct am_pgroup *L = first < m->n_groups ? &m->groups[first] : NULL;
        m->grad_off = L && L->first < m->n_params ? offs[L->first] : m->slab_elems;
        m->grad_elems = m->slab_elems - m->grad_off;
        for (int g = 0; g < m->n_groups; g++)
            m->groups[g].frozen = m->groups[g].kind != AM_PG_LORA;
    }
    m->grad_mem = K->alloc(m->dev, (m->grad_elems ? m->grad_elems : 1) * sizeof(float));
    if (m->act_dt != m->store_dt && m->param_mem && !(m->param_lp_mem = K->alloc(m->dev, m->slab_elems * cs))) {
        free(offs);
        return -1;
    }
    if (!m->param_mem || !m->grad_mem) {
        free(offs);
        return -1;
    }
    if (m->slab_elems != m->n_elems) {
        struct am_tensor all = am_tensor_view(m->param_mem, m->dev->device, m->store_dt, (int64_t)m->slab_elems, 0, 0, 0);
        K->zero(m->dev, &all);
    }
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        size_t off = offs[i];
        p->slab_off = off;
        p->w.data = (char *)m->param_mem + off * ws;
        p->g.data = off >= m->grad_off ? (float *)m->grad_mem + (off - m->grad_off) : NULL;
        p->wc.data = m->param_lp_mem ? (char *)m->param_lp_mem + off * cs : p->w.data;
    }
    free(offs);
    end_groups(m);
    return 0;
}

void am_model_cast_weights(struct am_model *m)
{
    if (!m->param_lp_mem || !m->param_mem)
        return;
    int64_t n = (int64_t)(m->slab_elems - m->param_off);
    struct am_tensor w = am_tensor_view(m->param_mem, m->K->device, m->store_dt, n, 0, 0, 0);
    struct am_tensor c = am_tensor_view(m->param_lp_mem, m->K->device, m->act_dt, n, 0, 0, 0);
    m->K->convert(m->dev, &c, &w);
}

/* LoRA: the adapters' group (the slabs' last span, from grad_off) copied into slabs of its own,
 * which param_mem and param_lp_mem then are (param_off = grad_off), their w and wc pointed there.
 * Returns 0, or -1 when out of memory (nothing changed). */
static int keep_adapters(struct am_model *m)
{
    const struct am_kernels *K = m->K;
    size_t n = m->grad_elems, ws = am_dtype_size(m->store_dt), cs = am_dtype_size(m->act_dt);
    void *w = K->alloc(m->dev, (n ? n : 1) * ws), *c = NULL;
    if (w && m->param_lp_mem && !(c = K->alloc(m->dev, (n ? n : 1) * cs))) {
        K->free(m->dev, w);
        return -1;
    }
    if (!w)
        return -1;
    if (n) {
        struct am_tensor dst = am_tensor_view(w, m->dev->device, m->store_dt, (int64_t)n, 0, 0, 0);
        struct am_tensor src = am_tensor_view((char *)m->param_mem + (m->grad_off - m->param_off) * ws,
                                              m->dev->device, m->store_dt, (int64_t)n, 0, 0, 0);
        K->copy(m->dev, &dst, &src);
    }
    K->free(m->dev, m->param_mem);
    if (m->param_lp_mem)
        K->free(m->dev, m->param_lp_mem);
    m->param_mem = w;
    m->param_lp_mem = c;
    m->param_off = m->grad_off;
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        if (p->slab_off < m->grad_off) {
            p->w.data = p->wc.data = NULL;
            continue;
        }
        p->w.data = (char *)w + (p->slab_off - m->grad_off) * ws;
        p->wc.data = c ? (char *)c + (p->slab_off - m->grad_off) * cs : p->w.data;
    }
    am_model_cast_weights(m);
    return 0;
}

int am_model_drop_weights(struct am_model *m)
{
    if (m->sh.lora_r > 0 && m->param_mem)
        return keep_adapters(m);
    if (m->param_mem)
        m->K->free(m->dev, m->param_mem);
    if (m->param_lp_mem)
        m->K->free(m->dev, m->param_lp_mem);
    m->param_mem = m->param_lp_mem = NULL;
    for (int i = 0; i < m->n_params; i++)
        m->params[i].w.data = m->params[i].wc.data = NULL;
    return 0;
}

void am_model_drop_grads(struct am_model *m)
{
    if (m->grad_mem)
        m->K->free(m->dev, m->grad_mem);
    m->grad_mem = NULL;
    for (int i = 0; i < m->n_params; i++)
        m->params[i].g.data = NULL;
}

int am_model_group_also(const struct am_model *m, int group)
{
    if (group < 0 || group >= m->n_groups)
        return -1;
    if (m->embed && m->head == m->embed && m->groups[group].kind == AM_PG_HEAD)
        return 0;
    return group + 1 < m->n_groups && m->groups[group].kind == AM_PG_LAYER &&
                   m->groups[group + 1].kind == AM_PG_EXPERTS
               ? group + 1
               : -1;
}

/* ---- initial values ------------------------------------------------------------------ */

static bool is_bias(const struct am_param *p)
{
    size_t n = strlen(p->name);
    return n > 5 && strcmp(p->name + n - 5, ".bias") == 0;
}

/* The vectors transformers initialises from N(0, initializer_range): gpt_oss's attention sinks
 * and router bias (GptOssPreTrainedModel._init_weights). */
static bool normal_vector(const struct am_param *p)
{
    static const char *const ends[] = {".self_attn.sinks", ".router.bias"};
    size_t n = strlen(p->name);
    for (int i = 0; i < 2; i++)
        if (n > strlen(ends[i]) && strcmp(p->name + n - strlen(ends[i]), ends[i]) == 0)
            return true;
    return false;
}

int am_model_round_to_bf16(struct am_model *m)
{
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        size_t n = (size_t)am_tensor_numel(&p->w);
        float *host = malloc(n * sizeof(float) + 1);
        if (!host)
            return -1;
        am_param_read(m, p, host, 0, n);
        for (size_t k = 0; k < n; k++)
            host[k] = am_bf16_to_f32(am_f32_to_bf16(host[k]));
        am_param_write(m, p, host, 0, n);
        free(host);
    }
    return 0;
}

/* Elements of a matrix below which its draw stays on one thread (about 30 ns an element: log,
 * cos and two hashes). */
#define INIT_PAR_MIN 65536

int am_model_init_weights(struct am_model *m, uint64_t seed)
{
    double std = m->cfg.initializer_range;
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        if (am_model_is_lora(p)) /* am_model_init_lora */
            continue;
        int64_t rows = p->w.shape[0], cols = p->w.ndim > 1 ? p->w.shape[1] : 1;
        float *host = malloc((size_t)(rows * cols) * sizeof(float));
        if (!host)
            return -1;
        uint64_t stream = am_hash_str(p->name);
        if (p->w.ndim == 1) {
            /* RMSNorm weights 1 (Gemma's, 1 + w: 0), biases 0 (transformers' _init_weights);
             * gpt_oss's sinks and router bias N(0, std) */
            bool normal = normal_vector(p);
            float fill = is_bias(p) || m->cfg.gemma ? 0.0f : 1.0f;
            for (int64_t r = 0; r < rows; r++)
                host[r] = normal ? (float)(std * am_rng_normal(seed, stream, (uint64_t)(p->row0 + r))) : fill;
        } else {
            /* each element its own draw, so the rows split over threads give the same values */
#pragma omp parallel for schedule(static) if (rows * cols >= INIT_PAR_MIN)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++) {
                    uint64_t idx = (uint64_t)((p->row0 + r) * p->full_cols + p->col0 + c);
                    host[r * cols + c] = (float)(std * am_rng_normal(seed, stream, idx));
                }
        }
        am_param_write(m, p, host, 0, (size_t)(rows * cols));
        free(host);
    }
    am_model_cast_weights(m);
    return 0;
}

bool am_model_is_lora(const struct am_param *p) { return strstr(p->name, ".lora_A.") || strstr(p->name, ".lora_B."); }

int am_model_init_lora(struct am_model *m, uint64_t seed, bool kaiming)
{
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        if (!am_model_is_lora(p))
            continue;
        int64_t rows = p->w.shape[0], cols = p->w.shape[1];
        float *host = calloc((size_t)(rows * cols), sizeof(float));
        if (!host)
            return -1;
        uint64_t stream = am_hash_str(p->name);
        double in = (double)p->full_cols, r = (double)p->full_rows;
        /* an expert's A (moe.h): as torch's init of AutoModel's [E, in, r] tensor, whose fans are
         * in·r and E·r */
        double fan_in = in, fan_sum = in + r;
        if (strstr(p->name, ".experts."))
            fan_in = in * r, fan_sum = r * (in + (double)m->cfg.num_experts);
        for (int64_t y = 0; strstr(p->name, ".lora_A.") && y < rows; y++) /* B stays zero */
            for (int64_t c = 0; c < cols; c++) {
                uint64_t idx = (uint64_t)((p->row0 + y) * p->full_cols + p->col0 + c);
                host[y * cols + c] = kaiming ? (float)((2 * am_rng_uniform(seed, stream, idx) - 1) / sqrt(fan_in))
                                             : (float)(sqrt(2.0 / fan_sum) * am_rng_normal(seed, stream, idx));
            }
        am_param_write(m, p, host, 0, (size_t)(rows * cols));
        free(host);
    }
    am_model_cast_weights(m);
    return 0;
}

/* ---- reading and writing the masters ------------------------------------------------- */

void am_param_write(const struct am_model *m, const struct am_param *p, const float *host, size_t at, size_t n)
{
    am_dev_upload_f32(m->dev, m->store_dt, (char *)p->w.data + at * am_dtype_size(m->store_dt), host, n);
}

void am_param_read(const struct am_model *m, const struct am_param *p, float *host, size_t at, size_t n)
{
    am_dev_download_f32(m->dev, m->store_dt, host, (const char *)p->w.data + at * am_dtype_size(m->store_dt), n);
}
