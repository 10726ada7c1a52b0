/* model_io.c - Hugging Face checkpoints of a model shard (model_io.h). */
#include "model_io.h"

#include <dirent.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "moe.h"
#include "peft.h"
#include "safetensors.h"

int am_model_dir_has_weights(const char *dir)
{
    char p[4096];
    struct stat st;
    snprintf(p, sizeof(p), "%s/model.safetensors", dir);
    if (stat(p, &st) == 0)
        return 1;
    snprintf(p, sizeof(p), "%s/model.safetensors.index.json", dir);
    return stat(p, &st) == 0;
}

/* ---- gpt_oss's experts: transformers' fused tensors, am's per-expert parameters ---------------- */

/* The prefix "model.layers.L.mlp.experts" of an expert parameter's name. */
static void experts_prefix(char *buf, size_t len, const struct am_param *first)
{
    const char *dot = strstr(first->name, ".experts.");
    snprintf(buf, len, "%.*s.experts", dot ? (int)(dot - first->name) : 0, first->name);
}

/* One of GptOssExperts' tensors, experts [e0, e0 + El) of it, into host (F32 [El, d1, d2] or
 * [El, d1] for d2 0): the MXFP4 `_blocks` and `_scales` dequantised when the checkpoint has
 * quant_method mxfp4 (the matrices only: their biases are stored as they are). */
static int read_experts(struct am_ckpt *c, const struct am_model *m, const char *name, int64_t e0, int64_t El,
                        int64_t d1, int64_t d2, float *host, struct am_errors *err)
{
    struct am_tensor dst = am_tensor_view(host, AM_DEV_CPU, AM_F32, El, d1, d2, 0);
    if (!d2)
        dst = am_tensor_view(host, AM_DEV_CPU, AM_F32, El, d1, 0, 0);
    if (m->cfg.mxfp4 && d2)
        return am_ckpt_read_mxfp4(c, name, e0, e0 + El, &dst, err);
    struct am_ckpt_slice slice = am_ckpt_rows(e0, e0 + El);
    return am_ckpt_read(c, name, &slice, &dst, err);
}

/* gpt_oss: each MoE layer's experts held here, from transformers' gate_up_proj [E, C, 2I] (x @ W;
 * gate at the even columns, up at the odd), gate_up_proj_bias [E, 2I], down_proj [E, I, C] and
 * down_proj_bias [E, C], into am's per-expert gate and up [I, C], down [C, I] and their biases
 * (moe.h). Only this rank's experts are read. */
static int load_gpt_oss_experts(struct am_model *m, struct am_ckpt *c, const char *dir, struct am_errors *err)
{
    int64_t C = m->cfg.hidden_size, I = m->cfg.moe_intermediate_size, E = m->cfg.num_experts;
    int ep = m->sh.ep > 1 ? m->sh.ep : 1;
    int64_t El = E / ep, e0 = (int64_t)(ep > 1 ? m->sh.ep_rank : 0) * El;
    size_t big = (size_t)(El * C * 2 * I), n = big + (size_t)(El * 2 * I) + (size_t)(El * C);
    float *buf = malloc(n * sizeof(float)), *w = malloc((size_t)(C * I) * sizeof(float));
    int rc = 0;
    if (!buf || !w) {
        free(buf);
        free(w);
        am_errorf(err, NULL, "%s: out of memory reading gpt_oss's experts (%zu floats)", dir, n);
        return -1;
    }
    float *gu = buf, *gub = buf + big, *db = gub + El * 2 * I;
    for (int l = 0; l < m->n_layers && rc == 0; l++) {
        const struct am_moe_layer *X = m->layers[l].moe;
        if (!X || !X->b1)
            continue;
        char pre[96], name[160];
        experts_prefix(pre, sizeof(pre), X->w1);
        snprintf(name, sizeof(name), "%s.gate_up_proj", pre);
        if (read_experts(c, m, name, e0, El, C, 2 * I, gu, err) < 0) {
            rc = -1;
            break;
        }
        snprintf(name, sizeof(name), "%s.gate_up_proj_bias", pre);
        if (read_experts(c, m, name, e0, El, 2 * I, 0, gub, err) < 0) {
            rc = -1;
            break;
        }
        for (int64_t e = 0; e < El; e++) {
            const float *g = gu + (size_t)(e * C * 2 * I);
            for (int half = 0; half < 2; half++) { /* gate (even columns), up (odd) */
                for (int64_t i = 0; i < I; i++)
                    for (int64_t k = 0; k < C; k++)
                        w[i * C + k] = g[k * 2 * I + 2 * i + half];
                const struct am_param *pw = (half ? X->w3 : X->w1) + e, *pb = (half ? X->b3 : X->b1) + e;
                am_param_write(m, pw, w, 0, (size_t)(I * C));
                for (int64_t i = 0; i < I; i++)
                    w[i] = gub[e * 2 * I + 2 * i + half];
                am_param_write(m, pb, w, 0, (size_t)I);
            }
        }
        snprintf(name, sizeof(name), "%s.down_proj", pre);
        if (read_experts(c, m, name, e0, El, I, C, gu, err) < 0) {
            rc = -1;
            break;
        }
        snprintf(name, sizeof(name), "%s.down_proj_bias", pre);
        if (read_experts(c, m, name, e0, El, C, 0, db, err) < 0) {
            rc = -1;
            break;
        }
        for (int64_t e = 0; e < El; e++) { /* down_proj [I, C] (x @ W) is am's [C, I] transposed */
            const float *d = gu + (size_t)(e * I * C);
            for (int64_t k = 0; k < C; k++)
                for (int64_t i = 0; i < I; i++)
                    w[k * I + i] = d[i * C + k];
            am_param_write(m, (X->w2 + e), w, 0, (size_t)(I * C));
            am_param_write(m, (X->b2 + e), db + e * C, 0, (size_t)C);
        }
    }
    free(buf);
    free(w);
    return rc;
}

int am_model_load_hf(struct am_model *m, const char *dir, struct am_errors *err)
{
    struct am_ckpt *c = NULL;
    if (am_ckpt_open(dir, &c, err) < 0)
        return -1;
    if (m->cfg.fp8) /* an FP8 checkpoint: its F8_E4M3 weights dequantised as they are read */
        am_ckpt_set_fp8(c, (const int64_t[2]){m->cfg.fp8_block[0], m->cfg.fp8_block[1]});
    size_t before = err->n;
    uint64_t total = 0, done = 0; /* the bytes of this rank's weights, for the progress line */
    for (int i = 0; i < m->n_params; i++)
        total += am_model_is_lora(&m->params[i]) ? 0 : (uint64_t)am_tensor_numel(&m->params[i].w) * sizeof(float);
    if (m->load_bar)
        am_progress_start(m->load_bar, "am-train: loading the weights", NULL, total, m->load_bar->on);
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        if (am_model_is_lora(p)) /* LoRA's adapters are not the base model's (am_model_load_peft) */
            continue;
        if (m->cfg.gpt_oss && am_moe_is_expert_param(m, p)) /* read fused, per layer (load_gpt_oss_experts) */
            continue;
        int64_t n = am_tensor_numel(&p->w);
        float *host = malloc((size_t)n * sizeof(float));
        if (!host) {
            am_errorf(err, NULL, "%s: out of memory reading %s", dir, p->name);
            break;
        }
        struct am_tensor dst = p->w; /* read as fp32 on the host, then written in the storage dtype */
        dst.data = host;
        dst.device = AM_DEV_CPU;
        dst.dtype = AM_F32;
        struct am_ckpt_slice slice = p->split == AM_SPLIT_ROWS   ? am_ckpt_rows(p->row0, p->row0 + p->w.shape[0])
                                     : p->split == AM_SPLIT_COLS ? am_ckpt_cols(p->col0, p->col0 + p->w.shape[1])
                                                                 : (struct am_ckpt_slice){0, 0, 0};
        if (am_ckpt_read(c, p->name, p->split == AM_SPLIT_NONE ? NULL : &slice, &dst, err) == 0)
            am_param_write(m, p, host, 0, (size_t)n);
        free(host);
        done += (uint64_t)n * sizeof(float);
        if (m->load_bar)
            am_progress_set(m->load_bar, done, 0);
    }
    if (m->cfg.gpt_oss && err->n == before)
        load_gpt_oss_experts(m, c, dir, err);
    if (m->load_bar)
        am_progress_end(m->load_bar, err->n == before);
    for (int l = 0; l < m->n_layers; l++) { /* glm4_moe's selection biases: buffers, whole on every rank */
        const struct am_moe_layer *X = m->layers[l].moe;
        if (!X || !X->bias_name[0])
            continue;
        int64_t n = am_tensor_numel(&X->bias);
        float *host = malloc((size_t)n * sizeof(float));
        if (!host) {
            am_errorf(err, NULL, "%s: out of memory reading %s", dir, X->bias_name);
            break;
        }
        struct am_tensor dst = X->bias;
        dst.data = host;
        dst.device = AM_DEV_CPU;
        if (am_ckpt_read(c, X->bias_name, NULL, &dst, err) == 0)
            m->K->upload(m->dev, X->bias.data, host, (size_t)n * sizeof(float));
        free(host);
    }
    am_ckpt_close(c);
    am_model_cast_weights(m);
    return err->n > before ? -1 : 0;
}

/* gpt_oss's ParamWrapper tensors of a layer's experts' adapters (fuse_gpt_oss_lora) */
static const char *const pw_names[4] = {"base_layer.lora_A.weight", "base_layer.lora_B.weight", "lora_A.weight",
                                        "lora_B.weight"};

/* Where element (y, c) of run w's expert e (w: A, B of gate, B of up, A and B of down; moe.h) lies
 * in the ParamWrapper tensors: their index (pw_names) in *k, the flat index returned. */
static int64_t pw_index(int w, int64_t e, int64_t E, int64_t r, int64_t I, int64_t C, int64_t y, int64_t c, int *k)
{
    switch (w) {
    case 0: /* A [r, C]: base_layer.lora_A [r E, C] */
        return *k = 0, (e * r + y) * C + c;
    case 1: /* B of gate [I, r]: base_layer.lora_B [2I, r E], the even rows */
    case 2: /* B of up, the odd rows */
        return *k = 1, (2 * y + (w == 2)) * r * E + c * E + e;
    case 3: /* down's A [r, I]: lora_A [r E, I] */
        return *k = 2, (e * r + y) * I + c;
    default: /* down's B [C, r]: lora_B [C, r E] */
        return *k = 3, y * r * E + c * E + e;
    }
}

/* gpt_oss: the run and the global expert of an expert adapter p (false: p is none) */
static bool pw_run(const struct am_model *m, const struct am_param *p, int *w, int64_t *e)
{
    int ep = m->sh.ep > 1 ? m->sh.ep : 1;
    int64_t El = m->cfg.num_experts / ep, e0 = (int64_t)(ep > 1 ? m->sh.ep_rank : 0) * El;
    for (int l = 0; m->cfg.gpt_oss && l < m->n_layers; l++) {
        const struct am_moe_layer *X = m->layers[l].moe;
        const struct am_param *first[5] = {X ? X->la : NULL, X ? X->lbg : NULL, X ? X->lbu : NULL,
                                           X ? X->lda : NULL, X ? X->ldb : NULL};
        for (int k = 0; k < 5 && first[0]; k++)
            if (p >= first[k] && p < first[k] + El)
                return *w = k, *e = e0 + (p - first[k]), true;
    }
    return false;
}

int am_model_peft_place(const struct am_model *m, const struct am_param *p, char *name, size_t len, int64_t shape[2],
                        int64_t *at)
{
    int w;
    int64_t e, C = m->cfg.hidden_size, I = m->cfg.moe_intermediate_size, E = m->cfg.num_experts;
    int64_t rows = p->full_rows, cols = p->full_cols > 0 ? p->full_cols : 1;
    if (!pw_run(m, p, &w, &e)) {
        snprintf(name, len, "base_model.model.%s", p->name);
        shape[0] = p->full_rows, shape[1] = p->full_cols;
        for (int64_t i = 0; at && i < rows * cols; i++)
            at[i] = i;
        return 0;
    }
    int64_t r = m->sh.lora_experts_r > 0 ? m->sh.lora_experts_r : m->sh.lora_r;
    const int64_t shapes[4][2] = {{r * E, C}, {2 * I, r * E}, {r * E, I}, {C, r * E}};
    int k = 0;
    for (int64_t y = 0; y < rows; y++)
        for (int64_t c = 0; c < cols; c++) {
            int64_t i = pw_index(w, e, E, r, I, C, y, c, &k);
            if (at)
                at[y * cols + c] = i;
        }
    char pre[96];
    experts_prefix(pre, sizeof(pre), p);
    snprintf(name, len, "base_model.model.%s.%s", pre, pw_names[k]);
    shape[0] = shapes[k][0], shape[1] = shapes[k][1];
    return 1;
}

/* gpt_oss: the experts' adapters held here from peft's ParamWrapper tensors of each MoE layer
 * (fuse_gpt_oss_lora's layout), each tensor read once. */
static void load_gpt_oss_lora(struct am_model *m, struct am_st_file *f, const char *path, struct am_errors *err)
{
    int64_t C = m->cfg.hidden_size, I = m->cfg.moe_intermediate_size, E = m->cfg.num_experts;
    int ep = m->sh.ep > 1 ? m->sh.ep : 1;
    int64_t El = E / ep, e0 = (int64_t)(ep > 1 ? m->sh.ep_rank : 0) * El;
    int64_t r = m->sh.lora_experts_r > 0 ? m->sh.lora_experts_r : m->sh.lora_r;
    const int64_t shape[4][2] = {{r * E, C}, {2 * I, r * E}, {r * E, I}, {C, r * E}};
    float *full[4] = {0}, *one = malloc((size_t)(r * (C > I ? C : I)) * sizeof(float));
    for (int k = 0; k < 4; k++)
        full[k] = malloc((size_t)(shape[k][0] * shape[k][1]) * sizeof(float));
    for (int l = 0; l < m->n_layers && one && full[0] && full[1] && full[2] && full[3]; l++) {
        const struct am_moe_layer *X = m->layers[l].moe;
        if (!X || !X->la)
            continue;
        char pre[96], name[160];
        experts_prefix(pre, sizeof(pre), X->la);
        bool ok = true;
        for (int k = 0; k < 4 && ok; k++) {
            snprintf(name, sizeof(name), "base_model.model.%s.%s", pre, pw_names[k]);
            const struct am_st_info *t = am_st_find(f, name);
            if (!t || t->ndim != 2 || t->shape[0] != shape[k][0] || t->shape[1] != shape[k][1]) {
                am_errorf(err, NULL, "%s: %s: %s (want [%lld, %lld])", path, name, t ? "another shape" : "missing",
                          (long long)shape[k][0], (long long)shape[k][1]);
                ok = false;
            } else if (am_st_read_f32(f, t, 0, shape[k][0] * shape[k][1], full[k], err) < 0) {
                ok = false;
            }
        }
        const struct am_param *first[5] = {X->la, X->lbg, X->lbu, X->lda, X->ldb};
        for (int64_t j = 0; ok && j < El; j++)
            for (int w = 0; w < 5; w++) {
                const struct am_param *p = first[w] + j;
                int64_t rows = p->w.shape[0], cols = p->w.shape[1];
                int k = 0;
                for (int64_t y = 0; y < rows; y++)
                    for (int64_t c = 0; c < cols; c++) {
                        int64_t i = pw_index(w, e0 + j, E, r, I, C, y, c, &k);
                        one[y * cols + c] = full[k][i];
                    }
                am_param_write(m, p, one, 0, (size_t)(rows * cols));
            }
    }
    if (!one || !full[0] || !full[1] || !full[2] || !full[3])
        am_errorf(err, NULL, "%s: out of memory reading gpt_oss's experts' adapters", path);
    for (int k = 0; k < 4; k++)
        free(full[k]);
    free(one);
}

int am_model_load_peft(struct am_model *m, const char *dir, struct am_errors *err)
{
    char path[4096];
    struct am_st_file *f = NULL;
    snprintf(path, sizeof(path), "%s/adapter_model.safetensors", dir);
    if (am_st_open(path, &f, err) < 0)
        return -1;
    size_t before = err->n;
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        if (!am_model_is_lora(p) || (m->cfg.gpt_oss && am_moe_is_expert_param(m, p))) /* load_gpt_oss_lora */
            continue;
        char name[160];
        snprintf(name, sizeof(name), "base_model.model.%s", p->name);
        const struct am_st_info *t = am_st_find(f, name);
        int64_t rows = p->full_rows, cols = p->full_cols;
        if (!t || t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
            am_errorf(err, NULL, "%s: %s: %s (want [%lld, %lld])", path, name, t ? "another shape" : "missing",
                      (long long)rows, (long long)cols);
            continue;
        }
        float *full = malloc((size_t)(rows * cols) * sizeof(float));
        float *mine = malloc((size_t)am_tensor_numel(&p->w) * sizeof(float));
        if (full && mine && am_st_read_f32(f, t, 0, rows * cols, full, err) == 0) {
            int64_t r0 = p->split == AM_SPLIT_ROWS ? p->row0 : 0, c0 = p->split == AM_SPLIT_COLS ? p->col0 : 0;
            int64_t lr = p->w.shape[0], lc = p->w.shape[1];
            for (int64_t r = 0; r < lr; r++)
                memcpy(mine + r * lc, full + (r0 + r) * cols + c0, (size_t)lc * sizeof(float));
            am_param_write(m, p, mine, 0, (size_t)(lr * lc));
        } else if (!full || !mine) {
            am_errorf(err, NULL, "%s: out of memory reading %s", path, name);
        }
        free(full);
        free(mine);
    }
    if (m->cfg.gpt_oss && m->sh.lora_experts && m->moe)
        load_gpt_oss_lora(m, f, path, err);
    am_st_close(f);
    am_model_cast_weights(m);
    return err->n > before ? -1 : 0;
}

/* ---- saving: every pp rank's tensors, gathered over tp, streamed to one writer ---------------- */

/* One tensor of a pp rank's list as it travels to the writer (sent as int64 elements). */
struct wire_tensor {
    char name[96];
    int64_t ndim, rows, cols; /* the full shape; cols 0 for a vector */
    int64_t depth;            /* a third dimension (gpt_oss's fused experts, ndim 3); else 0 */
};
_Static_assert(sizeof(struct wire_tensor) % sizeof(int64_t) == 0, "a wire_tensor is sent as int64 elements");
#define WIRE_I64 (sizeof(struct wire_tensor) / sizeof(int64_t))

/* Expert parallelism: every expert of the model, gathered over ep into the host before the
 * save (each ep rank holds E / ep of them); list entries -1 - j are these. */
struct ep_tensor {
    struct wire_tensor t;
    const float *data;
};

/* A tensor of the whole model, on the writer: which pp rank holds it, at which index of its list. */
struct save_tensor {
    struct wire_tensor t;
    int owner;
    int64_t index;
};

/* One rank's part of a save. */
struct saver {
    const struct am_model *m;
    struct am_comm *tp, *pp; /* NULL for size 1 */
    char comm_err[AM_COMM_ERR_LEN]; /* the message of the communicator call that failed */
    const char *dir;
    int tp_size, tp_rank, pp_size, pp_rank;
    int *which;      /* the parameters written, in model order: the rank's list (-1 - j: ep[j]) */
    struct ep_tensor *ep; /* ep > 1: every expert's matrices, gathered */
    int64_t n_ep;
    float *ep_mem;
    float *bias_mem; /* glm4_moe's selection biases, listed in ep after the experts (add_biases) */
    int64_t n_bias;
    int64_t n;       /* entries in it */
    int64_t *origin; /* (row0, col0) of list entry i on tp rank r at [2 * (r * n + i)] */
    int64_t *count;  /* writer: each pp rank's list length, -1 for a rank that could not take part */
    float *slices;   /* tp > 1: every tp rank's slice of one tensor (the all-gather's output) */
    float *full;     /* tp rank 0: one whole tensor */
    struct save_tensor *all; /* writer: every tensor of the model, in the order written */
    void *stage;             /* on a GPU: device memory every message passes through (msg_*) */
    size_t stage_bytes;
    int64_t n_all, current;  /* writer: the tensor now in full (-1: none) */
    const struct am_peft_config *peft; /* LoRA's adapters alone, written as peft does (else NULL: the base) */
};

static int comm_failed(const struct saver *s, struct am_errors *err)
{
    am_errorf(err, NULL, "%s: saving: %s", s->dir, s->comm_err);
    return -1;
}

/* ---- messages ----
 * The buffers of a save live in host memory. The CPU's communicators (UCX) take them as they
 * are; NCCL's move device memory only, so on a GPU every message passes through s->stage
 * (device memory as large as the largest message so far): uploaded, exchanged, downloaded.
 * Each returns 0, or -1 with the message in s->comm_err. */

static void *stage(struct saver *s, size_t bytes)
{
    const struct am_model *m = s->m;
    if (bytes <= s->stage_bytes)
        return s->stage;
    if (s->stage)
        m->K->free(m->dev, s->stage);
    s->stage = m->K->alloc(m->dev, bytes);
    s->stage_bytes = s->stage ? bytes : 0;
    if (!s->stage)
        snprintf(s->comm_err, sizeof(s->comm_err), "out of device memory for a message of %zu bytes", bytes);
    return s->stage;
}

static bool staged(const struct saver *s) { return s->m->dev->device != AM_DEV_CPU; }

static int msg_send(struct saver *s, struct am_comm *c, const void *buf, size_t count, enum am_dtype t, int peer)
{
    size_t bytes = count * am_dtype_size(t);
    if (!staged(s))
        return am_send(c, buf, count, t, peer, s->comm_err, sizeof(s->comm_err));
    if (!stage(s, bytes))
        return -1;
    s->m->K->upload(s->m->dev, s->stage, buf, bytes);
    return am_send(c, s->stage, count, t, peer, s->comm_err, sizeof(s->comm_err));
}

static int msg_recv(struct saver *s, struct am_comm *c, void *buf, size_t count, enum am_dtype t, int peer)
{
    size_t bytes = count * am_dtype_size(t);
    if (!staged(s))
        return am_recv(c, buf, count, t, peer, s->comm_err, sizeof(s->comm_err));
    if (!stage(s, bytes) || am_recv(c, s->stage, count, t, peer, s->comm_err, sizeof(s->comm_err)) < 0)
        return -1;
    s->m->K->download(s->m->dev, buf, s->stage, bytes);
    return 0;
}

static int msg_broadcast(struct saver *s, struct am_comm *c, void *buf, size_t count, enum am_dtype t)
{
    size_t bytes = count * am_dtype_size(t);
    if (!staged(s))
        return am_broadcast(c, buf, count, t, 0, s->comm_err, sizeof(s->comm_err));
    if (!stage(s, bytes))
        return -1;
    s->m->K->upload(s->m->dev, s->stage, buf, bytes);
    if (am_broadcast(c, s->stage, count, t, 0, s->comm_err, sizeof(s->comm_err)) < 0)
        return -1;
    s->m->K->download(s->m->dev, buf, s->stage, bytes);
    return 0;
}

static int msg_allreduce_max(struct saver *s, struct am_comm *c, int32_t *v)
{
    if (!staged(s))
        return am_allreduce(c, v, v, 1, AM_I32, AM_MAX, s->comm_err, sizeof(s->comm_err));
    if (!stage(s, sizeof(*v)))
        return -1;
    s->m->K->upload(s->m->dev, s->stage, v, sizeof(*v));
    if (am_allreduce(c, s->stage, s->stage, 1, AM_I32, AM_MAX, s->comm_err, sizeof(s->comm_err)) < 0)
        return -1;
    s->m->K->download(s->m->dev, v, s->stage, sizeof(*v));
    return 0;
}

/* recv: every rank's count elements in rank order; send: this rank's */
static int msg_allgather(struct saver *s, struct am_comm *c, const void *send, void *recv, size_t count,
                         enum am_dtype t)
{
    size_t es = am_dtype_size(t), n = (size_t)am_comm_size(c);
    if (!staged(s))
        return am_allgather(c, send, recv, count, t, s->comm_err, sizeof(s->comm_err));
    if (!stage(s, n * count * es))
        return -1;
    char *mine = (char *)s->stage + (size_t)am_comm_rank(c) * count * es; /* in place (comm.h) */
    s->m->K->upload(s->m->dev, mine, send, count * es);
    if (am_allgather(c, mine, s->stage, count, t, s->comm_err, sizeof(s->comm_err)) < 0)
        return -1;
    s->m->K->download(s->m->dev, recv, s->stage, n * count * es);
    return 0;
}

static int64_t full_numel(const struct wire_tensor *t)
{
    return t->rows * (t->cols > 0 ? t->cols : 1) * (t->depth > 0 ? t->depth : 1);
}

static struct wire_tensor wire_of(const struct am_param *p)
{
    struct wire_tensor t = {.ndim = p->w.ndim, .rows = p->full_rows, .cols = p->full_cols};
    snprintf(t.name, sizeof(t.name), "%s", p->name);
    return t;
}

/* list entry i's tensor */
static struct wire_tensor entry_wire(const struct saver *s, int64_t i)
{
    return s->which[i] >= 0 ? wire_of(&s->m->params[s->which[i]]) : s->ep[-1 - s->which[i]].t;
}

/* The runs of El consecutive parameters of layer X that are saved gathered: the experts'
 * matrices (w1, w3, w2), or with peft their adapters (moe.h: A, B of gate, B of up, A and B of
 * down). Returns how many (0: none). */
static int expert_runs(const struct am_moe_layer *X, bool peft, const struct am_param *run[5])
{
    if (!X || (peft && !X->la))
        return 0;
    const struct am_param *base[6] = {X->w1, X->w3, X->w2, X->b1, X->b3, X->b2};
    const struct am_param *lora[5] = {X->la, X->lbg, X->lbu, X->lda, X->ldb};
    int nb = X->b1 ? 6 : 3; /* gpt_oss: the experts' biases after their matrices */
    for (int k = 0; k < (peft ? 5 : nb); k++)
        run[k] = peft ? lora[k] : base[k];
    return peft ? 5 : nb;
}

/* The name of expert e's tensor of the run whose first parameter is `first`, with the segment
 * after the expert's index replaced by `kind` when not NULL (".w3.lora_A.weight"). */
static void expert_name(char *buf, size_t len, const struct am_param *first, int64_t e, const char *kind)
{
    const char *dot = strstr(first->name, ".experts.");
    const char *rest = dot ? strchr(dot + strlen(".experts."), '.') : NULL;
    snprintf(buf, len, "%.*s.experts.%lld%s", dot ? (int)(dot - first->name) : 0, first->name, (long long)e,
             kind ? kind : rest ? rest : "");
}

/* The experts of every MoE layer gathered over ep (collective over ep: all its ranks; ep NULL:
 * this rank's, which are all of them): for each layer and run (expert_runs), the ep ranks' El
 * consecutive matrices, back to back in rank order, are the E experts in global order. With
 * peft each expert's A of gate and up is listed twice, as gate's and as up's (peft's names
 * for AutoModel's shared A). */
static int gather_experts(struct saver *s, struct am_comm *ep, struct am_errors *err)
{
    const struct am_model *m = s->m;
    bool peft = s->peft != NULL;
    int n = ep ? am_comm_size(ep) : 1, nr;
    int64_t E = m->cfg.num_experts, El = E / n, total = 0, per = 0;
    const struct am_param *run[6];
    for (int l = 0; l < m->n_layers; l++)
        if ((nr = expert_runs(m->layers[l].moe, peft, run)) > 0) {
            per = 0;
            for (int k = 0; k < nr; k++)
                per += am_tensor_numel(&run[k]->w);
            total += per * E;
            s->n_ep += (nr + (peft ? 1 : 0)) * E;
        }
    s->ep_mem = malloc((size_t)(total + 1) * sizeof(float));
    s->ep = calloc((size_t)s->n_ep + 1, sizeof(*s->ep));
    float *mine = malloc((size_t)(per * El + 1) * sizeof(float));
    if (!s->ep_mem || !s->ep || !mine) {
        free(mine);
        am_errorf(err, NULL, "%s: saving: out of memory for the %lld experts' weights", s->dir, (long long)total);
        return -1;
    }
    float *at = s->ep_mem;
    int64_t j = 0;
    for (int l = 0; l < m->n_layers; l++) {
        nr = expert_runs(m->layers[l].moe, peft, run);
        const float *shared = at; /* peft: the A of gate and up, the first run */
        for (int w = 0; w < nr; w++) {
            size_t one = (size_t)am_tensor_numel(&run[w]->w);
            if (ep) {
                am_param_read(m, run[w], mine, 0, one * (size_t)El);
                if (msg_allgather(s, ep, mine, at, one * (size_t)El, AM_F32) < 0) {
                    free(mine);
                    return comm_failed(s, err);
                }
            } else {
                am_param_read(m, run[w], at, 0, one * (size_t)E);
            }
            for (int64_t e = 0; e < E; e++) { /* the names: this rank's first expert's, renumbered */
                struct ep_tensor *t = &s->ep[j++];
                t->t = wire_of(run[w]);
                expert_name(t->t.name, sizeof(t->t.name), run[w], e, NULL);
                t->data = at + (size_t)e * one;
            }
            at += one * (size_t)E;
        }
        if (nr && peft) { /* up's lora_A: the shared A again, named after up's lora_B */
            const char *dot = strstr(run[2]->name, ".experts.");
            const char *rest = dot ? strchr(dot + strlen(".experts."), '.') : NULL;
            char kind[64];
            snprintf(kind, sizeof(kind), "%.*s.lora_A.weight", rest ? (int)(strstr(rest, ".lora_B.") - rest) : 0,
                     rest ? rest : "");
            size_t one = (size_t)am_tensor_numel(&run[0]->w);
            for (int64_t e = 0; e < E; e++) {
                struct ep_tensor *t = &s->ep[j++];
                t->t = wire_of(run[0]);
                expert_name(t->t.name, sizeof(t->t.name), run[0], e, kind);
                t->data = shared + (size_t)e * one;
            }
        }
    }
    free(mine);
    return 0;
}

/* The gathered experts' list replaced by N tensors over FLOATS values (fuse_gpt_oss and
 * fuse_gpt_oss_lora): the new list and its memory, or -1 naming WHAT when out of memory. */
static int fused_new(const struct saver *s, int64_t n, int64_t floats, const char *what, struct ep_tensor **ep,
                     float **mem, struct am_errors *err)
{
    *ep = calloc((size_t)(n + 1), sizeof(**ep));
    *mem = malloc((size_t)(floats + 1) * sizeof(float));
    if (*ep && *mem)
        return 0;
    free(*ep);
    free(*mem);
    am_errorf(err, NULL, "%s: saving: out of memory for %s", s->dir, what);
    return -1;
}

static void fused_install(struct saver *s, struct ep_tensor *ep, float *mem, int64_t n)
{
    free(s->ep);
    free(s->ep_mem);
    s->ep = ep;
    s->ep_mem = mem;
    s->n_ep = n;
}

/* gpt_oss: the gathered experts (every layer's six runs of E entries: gate, up, down, their
 * biases, in global order) replaced by transformers' four fused tensors per layer (the inverse of
 * load_gpt_oss_experts): gate_up_proj [E, C, 2I], gate_up_proj_bias [E, 2I], down_proj
 * [E, I, C], down_proj_bias [E, C]. */
static int fuse_gpt_oss(struct saver *s, struct am_errors *err)
{
    const struct am_model *m = s->m;
    int64_t C = m->cfg.hidden_size, I = m->cfg.moe_intermediate_size, E = m->cfg.num_experts;
    int64_t layers = s->n_ep / (6 * E), per = E * (C * 2 * I + 2 * I + I * C + C);
    struct ep_tensor *ep;
    float *mem;
    if (fused_new(s, 4 * layers, layers * per, "gpt_oss's fused experts", &ep, &mem, err) < 0)
        return -1;
    for (int64_t l = 0; l < layers; l++) {
        const struct ep_tensor *r = s->ep + l * 6 * E; /* run k's expert e: r[k * E + e] */
        float *gu = mem + l * per, *gub = gu + E * C * 2 * I, *dn = gub + E * 2 * I, *db = dn + E * I * C;
        for (int64_t e = 0; e < E; e++) {
            const float *g = r[e].data, *u = r[E + e].data, *d = r[2 * E + e].data;
            const float *bg = r[3 * E + e].data, *bu = r[4 * E + e].data, *bd = r[5 * E + e].data;
            for (int64_t i = 0; i < I; i++) {
                for (int64_t k = 0; k < C; k++) {
                    gu[(e * C + k) * 2 * I + 2 * i] = g[i * C + k];
                    gu[(e * C + k) * 2 * I + 2 * i + 1] = u[i * C + k];
                    dn[(e * I + i) * C + k] = d[k * I + i];
                }
                gub[e * 2 * I + 2 * i] = bg[i];
                gub[e * 2 * I + 2 * i + 1] = bu[i];
            }
            memcpy(db + e * C, bd, (size_t)C * sizeof(float));
        }
        char pre[96];
        const char *first = r[0].t.name, *dot = strstr(first, ".experts.");
        snprintf(pre, sizeof(pre), "%.*s.experts", dot ? (int)(dot - first) : 0, first);
        struct ep_tensor *t = ep + 4 * l;
        t[0] = (struct ep_tensor){.t = {.ndim = 3, .rows = E, .cols = C, .depth = 2 * I}, .data = gu};
        t[1] = (struct ep_tensor){.t = {.ndim = 2, .rows = E, .cols = 2 * I}, .data = gub};
        t[2] = (struct ep_tensor){.t = {.ndim = 3, .rows = E, .cols = I, .depth = C}, .data = dn};
        t[3] = (struct ep_tensor){.t = {.ndim = 2, .rows = E, .cols = C}, .data = db};
        static const char *const names[4] = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"};
        for (int k = 0; k < 4; k++)
            snprintf(t[k].t.name, sizeof(t[k].t.name), "%.70s.%s", pre, names[k]);
    }
    fused_install(s, ep, mem, 4 * layers);
    return 0;
}

/* gpt_oss with LoRA on the experts: the gathered adapters (every layer's six runs of E entries:
 * A, B of gate, B of up, A and B of down, A again for up; moe.h) replaced by the four tensors of
 * peft's ParamWrapper on transformers' fused experts (target_parameters mlp.experts.down_proj,
 * the outer wrapper, and mlp.experts.gate_up_proj, the inner one: peft wraps them in sorted
 * order). GptOssExperts' parameters are [E, in, out] (used as x @ W, is_transposed), so peft keeps
 * in and out, and folds the experts into the rank: expert e's rank row k of lora_A is row e r + k,
 * its column of lora_B column k E + e, and its delta is s (A_e)ᵀ (B_e)ᵀ, am's s B A transposed:
 *   experts.base_layer.lora_A.weight [r E, C]: the A of gate and up (GroupedExpertsLoRA's shared A);
 *   experts.base_layer.lora_B.weight [2I, r E]: gate's B at the even rows, up's at the odd (as
 *     gate_up_proj's columns are);
 *   experts.lora_A.weight [r E, I]: down's A;  experts.lora_B.weight [C, r E]: down's B. */
static int fuse_gpt_oss_lora(struct saver *s, struct am_errors *err)
{
    const struct am_model *m = s->m;
    int64_t C = m->cfg.hidden_size, I = m->cfg.moe_intermediate_size, E = m->cfg.num_experts;
    int64_t layers = s->n_ep / (6 * E), r = m->sh.lora_experts_r > 0 ? m->sh.lora_experts_r : m->sh.lora_r;
    int64_t per = r * E * (2 * I + C + C + I);
    struct ep_tensor *ep;
    float *mem;
    if (fused_new(s, 4 * layers, layers * per, "gpt_oss's experts' adapters", &ep, &mem, err) < 0)
        return -1;
    for (int64_t l = 0; l < layers; l++) {
        const struct ep_tensor *x = s->ep + l * 6 * E; /* run k's expert e: x[k * E + e] */
        float *gua = mem + l * per, *gub = gua + r * E * C, *dna = gub + 2 * I * r * E, *dnb = dna + r * E * I;
        for (int64_t e = 0; e < E; e++) {
            const float *a = x[e].data, *bg = x[E + e].data, *bu = x[2 * E + e].data; /* [r, C], [I, r] twice */
            const float *da = x[3 * E + e].data, *db = x[4 * E + e].data;             /* [r, I], [C, r] */
            memcpy(gua + e * r * C, a, (size_t)(r * C) * sizeof(float));
            memcpy(dna + e * r * I, da, (size_t)(r * I) * sizeof(float));
            for (int64_t k = 0; k < r; k++) {
                for (int64_t i = 0; i < I; i++) {
                    gub[2 * i * r * E + k * E + e] = bg[i * r + k];
                    gub[(2 * i + 1) * r * E + k * E + e] = bu[i * r + k];
                }
                for (int64_t c = 0; c < C; c++)
                    dnb[c * r * E + k * E + e] = db[c * r + k];
            }
        }
        char pre[96];
        const char *first = x[0].t.name, *dot = strstr(first, ".experts.");
        snprintf(pre, sizeof(pre), "%.*s.experts", dot ? (int)(dot - first) : 0, first);
        struct ep_tensor *t = ep + 4 * l;
        t[0] = (struct ep_tensor){.t = {.ndim = 2, .rows = r * E, .cols = C}, .data = gua};
        t[1] = (struct ep_tensor){.t = {.ndim = 2, .rows = 2 * I, .cols = r * E}, .data = gub};
        t[2] = (struct ep_tensor){.t = {.ndim = 2, .rows = r * E, .cols = I}, .data = dna};
        t[3] = (struct ep_tensor){.t = {.ndim = 2, .rows = C, .cols = r * E}, .data = dnb};
        for (int k = 0; k < 4; k++)
            snprintf(t[k].t.name, sizeof(t[k].t.name), "%.60s.%s", pre, pw_names[k]);
    }
    fused_install(s, ep, mem, 4 * layers);
    return 0;
}

/* glm4_moe's selection biases (moe.h), buffers whole on every rank of the layer's stage: copied
 * to the host and listed after the gathered experts, as those are (whole on every tp rank). */
static int add_biases(struct saver *s, struct am_errors *err)
{
    const struct am_model *m = s->m;
    int64_t nb = 0, E = m->cfg.num_experts;
    for (int l = 0; l < m->n_layers; l++)
        nb += m->layers[l].moe && m->layers[l].moe->bias_name[0];
    if (!nb)
        return 0;
    struct ep_tensor *ep = realloc(s->ep, (size_t)(s->n_ep + nb + 1) * sizeof(*ep));
    if (ep)
        s->ep = ep;
    if (!ep || !(s->bias_mem = malloc((size_t)(nb * E) * sizeof(float)))) {
        am_errorf(err, NULL, "%s: saving: out of memory for the experts' selection biases", s->dir);
        return -1;
    }
    float *at = s->bias_mem;
    for (int l = 0; l < m->n_layers; l++) {
        const struct am_moe_layer *X = m->layers[l].moe;
        if (!X || !X->bias_name[0])
            continue;
        m->K->download(m->dev, at, X->bias.data, (size_t)E * sizeof(float));
        struct ep_tensor *t = &s->ep[s->n_ep + s->n_bias++];
        *t = (struct ep_tensor){.t = {.ndim = 1, .rows = E, .cols = 0}, .data = at};
        snprintf(t->t.name, sizeof(t->t.name), "%s", X->bias_name);
        at += E;
    }
    return 0;
}

/* Checks the arguments and builds the rank's list and the small tables (no communication).
 * -1 with a message on the ranks where the arguments are wrong or memory runs out. */
static int saver_init(struct saver *s, const struct am_model *m, struct am_comm *tp, struct am_comm *pp,
                      struct am_comm *ep, bool saves, const char *dir, const struct am_peft_config *peft,
                      struct am_errors *err)
{
    *s = (struct saver){.m = m, .tp = tp, .pp = pp, .dir = dir, .tp_size = 1, .pp_size = 1, .current = -1,
                        .peft = peft};
    /* the experts gathered over ep; with peft their adapters always (up's A written as gate's) */
    bool gather = (ep && am_comm_size(ep) > 1) || (peft && m->sh.lora_experts) || (!peft && m->cfg.gpt_oss);
    if (gather && gather_experts(s, ep && am_comm_size(ep) > 1 ? ep : NULL, err) < 0)
        return -1;
    if (!peft && m->cfg.gpt_oss && fuse_gpt_oss(s, err) < 0) /* transformers' fused experts */
        return -1;
    if (peft && m->cfg.gpt_oss && s->n_ep && fuse_gpt_oss_lora(s, err) < 0) /* peft's ParamWrapper */
        return -1;
    if (!saves)
        return 0;
    if (!peft && add_biases(s, err) < 0)
        return -1;
    if (tp) {
        s->tp_size = am_comm_size(tp);
        s->tp_rank = am_comm_rank(tp);
    }
    if (pp) {
        s->pp_size = am_comm_size(pp);
        s->pp_rank = am_comm_rank(pp);
    }
    if (s->tp_size != m->sh.tp || s->tp_rank != m->sh.tp_rank) {
        am_errorf(err, NULL, "%s: saving: the model is tp rank %d of %d, the tp communicator says %d of %d", dir,
                  m->sh.tp_rank, m->sh.tp, s->tp_rank, s->tp_size);
        return -1;
    }
    if (m->sh.first_stage != (s->pp_rank == 0)) {
        am_errorf(err, NULL, "%s: saving: pp rank %d of %d %s the first pipeline stage (pp rank 0 must hold it)",
                  dir, s->pp_rank, s->pp_size, m->sh.first_stage ? "holds" : "lacks");
        return -1;
    }
    if (!pp && !m->sh.last_stage) {
        am_errorf(err, NULL, "%s: saving: without a pp group the rank must hold every pipeline stage", dir);
        return -1;
    }
    s->which = malloc((size_t)m->n_params * sizeof(int));
    s->count = calloc((size_t)s->pp_size, sizeof(int64_t));
    if (!s->which || !s->count)
        goto oom;
    for (int i = 0; i < m->n_params; i++)
        if (!am_model_is_tied_copy(m, &m->params[i]) && !(s->n_ep && am_moe_is_expert_param(m, &m->params[i])) &&
            am_model_is_lora(&m->params[i]) == (peft != NULL)) /* LoRA's adapters are saved apart (ckpt/peft.h) */
            s->which[s->n++] = i;
    /* the gathered experts after their layer's other tensors (the writer sorts by layer) */
    if ((s->n_ep || s->n_bias) &&
        !(s->which = realloc(s->which, ((size_t)m->n_params + (size_t)(s->n_ep + s->n_bias)) * sizeof(int))))
        goto oom;
    for (int64_t j = 0; j < s->n_ep + s->n_bias; j++)
        s->which[s->n++] = (int)(-1 - j);
    if (!(s->origin = malloc((size_t)s->tp_size * (size_t)(2 * s->n + 1) * sizeof(int64_t))))
        goto oom;
    return 0;
oom:
    am_errorf(err, NULL, "%s: saving: out of memory", dir);
    return -1;
}

static void saver_free(struct saver *s)
{
    free(s->which);
    free(s->ep);
    free(s->ep_mem);
    free(s->bias_mem);
    free(s->origin);
    free(s->count);
    free(s->slices);
    free(s->full);
    free(s->all);
    if (s->stage)
        s->m->K->free(s->m->dev, s->stage);
}

/* Allocates the all-gather's buffer and, for max_full > 0, full for tensors of up to max_full
 * elements (tp rank 0, when anything is gathered or received). */
static int alloc_buffers(struct saver *s, int64_t max_full, struct am_errors *err)
{
    int64_t max_local = 0;
    for (int64_t i = 0; i < s->n; i++) {
        struct wire_tensor t = entry_wire(s, i); /* the gathered experts are whole */
        int64_t k = s->which[i] >= 0 ? am_tensor_numel(&s->m->params[s->which[i]].w) : full_numel(&t);
        max_local = k > max_local ? k : max_local;
    }
    if (s->tp_size > 1 && !(s->slices = malloc((size_t)(s->tp_size * max_local) * sizeof(float))))
        goto oom;
    if (max_full > 0 && s->tp_rank == 0 && (s->tp_size > 1 || s->pp_size > 1) &&
        !(s->full = malloc((size_t)max_full * sizeof(float))))
        goto oom;
    return 0;
oom:
    am_errorf(err, NULL, "%s: saving: out of memory for the buffers of one tensor", s->dir);
    return -1;
}

/* Whether the tp ranks' slices of list entry i lie inside the tensor and together make it up
 * once (a kv head held by several ranks counted once). */
static bool slices_fit(const struct saver *s, int64_t i)
{
    if (s->which[i] < 0)
        return true; /* a gathered expert: whole on every tp rank */
    const struct am_param *p = &s->m->params[s->which[i]];
    int64_t rows = p->w.shape[0], cols = p->w.ndim > 1 ? p->w.shape[1] : 1, covered = 0;
    int64_t frows = p->full_rows, fcols = p->full_cols > 0 ? p->full_cols : 1;
    for (int r = 0; r < s->tp_size; r++) {
        const int64_t *o = &s->origin[2 * (r * s->n + i)];
        if (o[0] < 0 || o[1] < 0 || o[0] + rows > frows || o[1] + cols > fcols)
            return false;
        covered += rows * cols;
    }
    return covered == frows * fcols * p->copies_in_tp;
}

/* Every list entry's slices fit (slices_fit); -1 with a message naming the first that does not. */
static int check_slices(const struct saver *s, struct am_errors *err)
{
    for (int64_t i = 0; i < s->n; i++)
        if (!slices_fit(s, i)) {
            const struct am_param *p = &s->m->params[s->which[i]];
            am_errorf(err, NULL, "%s: saving: the tp ranks' slices of %s do not make up its %lld x %lld elements",
                      s->dir, p->name, (long long)p->full_rows, (long long)(p->full_cols > 0 ? p->full_cols : 1));
            return -1;
        }
    return 0;
}

/* Collective over tp: allocates the buffers, agrees that every tp rank could, shares where
 * each rank's slices start and checks them. The result is the same on every tp rank. */
static int prepare(struct saver *s, int64_t max_full, struct am_errors *err)
{
    int32_t bad = alloc_buffers(s, max_full, err) < 0;
    if (s->tp_size > 1) {
        int32_t any = bad;
        if (msg_allreduce_max(s, s->tp, &any) < 0)
            return comm_failed(s, err);
        if (any && !bad)
            am_errorf(err, NULL, "%s: saving: another tp rank could not take part (its errors say why)", s->dir);
        bad = any;
    }
    if (bad)
        return -1;
    int64_t *mine = s->origin + 2 * s->tp_rank * s->n;
    for (int64_t i = 0; i < s->n; i++) {
        mine[2 * i] = s->which[i] >= 0 ? s->m->params[s->which[i]].row0 : 0;
        mine[2 * i + 1] = s->which[i] >= 0 ? s->m->params[s->which[i]].col0 : 0;
    }
    if (s->tp_size > 1 &&
        msg_allgather(s, s->tp, mine, s->origin, (size_t)(2 * s->n), AM_I64) < 0)
        return comm_failed(s, err);
    return check_slices(s, err);
}

/* Collective over tp: every rank contributes its slice of list entry i; tp rank 0 puts
 * each slice in its place in full (tp 1: its own tensor, whole). */
static int gather(struct saver *s, int64_t i, struct am_errors *err)
{
    if (s->which[i] < 0) { /* a gathered expert, the same on every tp rank */
        const struct ep_tensor *t = &s->ep[-1 - s->which[i]];
        if (s->tp_rank == 0)
            memcpy(s->full, t->data, (size_t)full_numel(&t->t) * sizeof(float));
        return 0;
    }
    const struct am_param *p = &s->m->params[s->which[i]];
    size_t n = (size_t)am_tensor_numel(&p->w);
    float *mine = s->tp_size > 1 ? s->slices + (size_t)s->tp_rank * n : s->full;
    am_param_read(s->m, p, mine, 0, n);
    if (s->tp_size == 1)
        return 0;
    if (msg_allgather(s, s->tp, mine, s->slices, n, AM_F32) < 0)
        return comm_failed(s, err);
    if (s->tp_rank != 0)
        return 0;
    int64_t rows = p->w.shape[0], cols = p->w.ndim > 1 ? p->w.shape[1] : 1;
    int64_t fcols = p->full_cols > 0 ? p->full_cols : 1;
    for (int r = 0; r < s->tp_size; r++) {
        const int64_t *o = &s->origin[2 * (r * s->n + i)];
        for (int64_t k = 0; k < rows; k++)
            memcpy(s->full + (o[0] + k) * fcols + o[1], s->slices + (size_t)r * n + (size_t)(k * cols),
                   (size_t)cols * sizeof(float));
    }
    return 0;
}

/* Every rank but the writer: serves the writer's requests (list indices) until it sends -1.
 * tp rank 0 of a pp rank > 0 receives each over pp; every tp rank learns it over tp, takes
 * part in the gather, and tp rank 0 sends the whole tensor back. */
static int serve(struct saver *s, struct am_errors *err)
{
    for (;;) {
        int64_t req = -1;
        if (s->tp_rank == 0 && msg_recv(s, s->pp, &req, 1, AM_I64, 0) < 0)
            return comm_failed(s, err);
        if (s->tp_size > 1 && msg_broadcast(s, s->tp, &req, 1, AM_I64) < 0)
            return comm_failed(s, err);
        if (req < 0)
            return 0;
        if (req >= s->n) {
            am_errorf(err, NULL, "%s: saving: the writer asked for tensor %lld of %lld", s->dir, (long long)req,
                      (long long)s->n);
            return -1;
        }
        if (gather(s, req, err) < 0)
            return -1;
        struct wire_tensor t = entry_wire(s, req);
        if (s->tp_rank == 0 &&
            msg_send(s, s->pp, s->full, (size_t)full_numel(&t), AM_F32, 0) < 0)
            return comm_failed(s, err);
    }
}

/* tp rank 0 of a pp rank > 0: its list length (-1: it cannot take part), then each entry. */
static int send_list(struct saver *s, bool ok, struct am_errors *err)
{
    int64_t n = ok ? s->n : -1;
    if (msg_send(s, s->pp, &n, 1, AM_I64, 0) < 0)
        return comm_failed(s, err);
    for (int64_t i = 0; i < n; i++) {
        struct wire_tensor t = entry_wire(s, i);
        if (msg_send(s, s->pp, &t, WIRE_I64, AM_I64, 0) < 0)
            return comm_failed(s, err);
    }
    return 0;
}

/* Where a tensor comes in model order: the embedding, the layers, then the final norm and
 * the head. */
static long model_place(const char *name)
{
    int layer;
    if (strcmp(name, "model.embed_tokens.weight") == 0)
        return -1;
    if (sscanf(name, "model.layers.%d.", &layer) == 1)
        return layer;
    return LONG_MAX;
}

/* Model order; within a layer (or the end) the owner's list order. */
static int cmp_save_tensor(const void *a, const void *b)
{
    const struct save_tensor *x = a, *y = b;
    long px = model_place(x->t.name), py = model_place(y->t.name);
    if (px != py)
        return px < py ? -1 : 1;
    if (x->owner != y->owner)
        return x->owner < y->owner ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

/* The writer: every pp rank's list (its own, then each other's over pp), in model order.
 * Receives every list even after a failure, so that no rank stays blocked sending it;
 * count[p] says which ranks are serving. */
static int collect_lists(struct saver *s, bool ok, struct am_errors *err)
{
    s->count[0] = ok ? s->n : -1;
    int64_t total = s->count[0] > 0 ? s->count[0] : 0;
    for (int p = 1; p < s->pp_size; p++) {
        if (msg_recv(s, s->pp, &s->count[p], 1, AM_I64, p) < 0)
            return comm_failed(s, err);
        if (s->count[p] < 0) {
            am_errorf(err, NULL, "%s: saving: pp rank %d could not take part (its errors say why)", s->dir, p);
            ok = false;
        }
        total += s->count[p] > 0 ? s->count[p] : 0;
    }
    if (!(s->all = calloc((size_t)total + 1, sizeof(*s->all)))) {
        am_errorf(err, NULL, "%s: saving: out of memory for the list of %lld tensors", s->dir, (long long)total);
        ok = false;
    }
    for (int64_t i = 0; i < s->n && s->all; i++)
        s->all[s->n_all++] = (struct save_tensor){entry_wire(s, i), 0, i};
    for (int p = 1; p < s->pp_size; p++)
        for (int64_t i = 0; i < s->count[p]; i++) {
            struct save_tensor t = {.owner = p, .index = i};
            if (msg_recv(s, s->pp, &t.t, WIRE_I64, AM_I64, p) < 0)
                return comm_failed(s, err);
            t.t.name[sizeof(t.t.name) - 1] = '\0';
            if (t.t.ndim < 1 || t.t.ndim > 3 || t.t.rows < 1 || t.t.cols < 0 || (t.t.ndim >= 2) != (t.t.cols > 0) ||
                (t.t.ndim == 3) != (t.t.depth > 0)) {
                am_errorf(err, NULL, "%s: saving: pp rank %d sent tensor '%s' with a bad shape", s->dir, p, t.t.name);
                ok = false;
            }
            if (s->all)
                s->all[s->n_all++] = t;
        }
    if (s->all)
        qsort(s->all, (size_t)s->n_all, sizeof(*s->all), cmp_save_tensor);
    return ok ? 0 : -1;
}

/* The writer: makes tensor i of all the one in full, gathered over tp or received from its pp rank. */
static int fetch(struct saver *s, int64_t i, struct am_errors *err)
{
    const struct save_tensor *t = &s->all[i];
    int64_t req = t->index;
    s->current = -1;
    if (t->owner == 0) {
        if (s->tp_size > 1 && msg_broadcast(s, s->tp, &req, 1, AM_I64) < 0)
            return comm_failed(s, err);
        if (gather(s, req, err) < 0)
            return -1;
    } else if (msg_send(s, s->pp, &req, 1, AM_I64, t->owner) < 0 ||
               msg_recv(s, s->pp, s->full, (size_t)full_numel(&t->t), AM_F32, t->owner) < 0) {
        return comm_failed(s, err);
    }
    s->current = i;
    return 0;
}

/* The dtype tensor t is saved in: the parameters' (bf16 storage writes bf16, as torch saves a bf16
 * model; so do bf16 parameters beside fp32 masters, as FusedAdam's users save them: m->save_dt),
 * but the selection biases, fp32 as the checkpoints that hold them keep them. */
static bool saved_bf16(const struct saver *s, const struct save_tensor *t)
{
    return s->m->save_dt == AM_BF16 && !strstr(t->t.name, "e_score_correction_bias");
}

/* fill callback of the writer: bytes of tensor `index` of all (am_st_write asks for each tensor's
 * bytes in order, in pieces of whole elements). The writer's own tensors with tp 1 and fp32
 * masters come straight from the device; the others through full (fetched at their first bytes)
 * or the gathered experts, rounded to bf16 for a bf16 file. */
static int fill(void *ctx, size_t index, uint64_t offset, void *dst, size_t n, struct am_errors *err)
{
    struct saver *s = ctx;
    const struct save_tensor *t = &s->all[index];
    const float *src;
    if (t->owner == 0 && s->tp_size == 1 && s->which[t->index] < 0) {
        src = s->ep[-1 - s->which[t->index]].data;
    } else if (t->owner == 0 && s->tp_size == 1 && s->m->save_dt == AM_F32) { /* fp32 masters saved fp32 */
        const struct am_param *p = &s->m->params[s->which[t->index]];
        s->m->K->download(s->m->dev, dst, (const char *)p->w.data + offset, n);
        return 0;
    } else {
        if ((int64_t)index != s->current && fetch(s, (int64_t)index, err) < 0)
            return -1;
        src = s->full;
    }
    if (!saved_bf16(s, t)) {
        memcpy(dst, (const char *)src + offset, n);
        return 0;
    }
    uint16_t *h = dst;
    for (size_t k = 0; k < n / 2; k++)
        h[k] = am_f32_to_bf16(src[offset / 2 + k]);
    return 0;
}

/* The writer: saves all (their bytes fetched as am_ckpt_save asks for them). */
static int write_all(struct saver *s, const char *base_config, struct am_errors *err)
{
    int64_t max_full = 0;
    for (int64_t i = 0; i < s->n_all; i++)
        max_full = full_numel(&s->all[i].t) > max_full ? full_numel(&s->all[i].t) : max_full;
    struct am_st_wtensor *t = calloc((size_t)s->n_all + 1, sizeof(*t));
    bool full = s->tp_size > 1 || s->pp_size > 1 || s->m->save_dt != AM_F32; /* else from the device */
    if (!t || (full && !(s->full = malloc((size_t)max_full * sizeof(float))))) {
        free(t);
        am_errorf(err, NULL, "%s: saving: out of memory for the buffer of one tensor", s->dir);
        return -1;
    }
    for (int64_t i = 0; i < s->n_all; i++) {
        const struct wire_tensor *w = &s->all[i].t;
        t[i] = (struct am_st_wtensor){.name = w->name, .dtype = saved_bf16(s, &s->all[i]) ? AM_ST_BF16 : AM_ST_F32,
                                      .ndim = (int)w->ndim,
                                      .shape = {w->rows, w->cols, w->depth}, .fill = fill, .ctx = s};
    }
    int rc;
    if (s->peft) { /* peft's names: "base_model.model." + the parameter's */
        char(*names)[128] = calloc((size_t)s->n_all + 1, sizeof(*names));
        if (!names) {
            free(t);
            am_errorf(err, NULL, "%s: saving: out of memory", s->dir);
            return -1;
        }
        for (int64_t i = 0; i < s->n_all; i++) {
            snprintf(names[i], sizeof(names[i]), "base_model.model.%s", s->all[i].t.name);
            t[i].name = names[i];
        }
        rc = am_peft_save(s->dir, s->peft, t, (size_t)s->n_all, err);
        free(names);
    } else {
        struct am_ckpt_save_opts opts = {.base_config = base_config,
                                         .torch_dtype = s->m->save_dt == AM_BF16 ? "bfloat16" : NULL};
        rc = am_ckpt_save(s->dir, &s->m->cfg, t, (size_t)s->n_all, &opts, err);
    }
    free(t);
    return rc;
}

/* The writer: tells every rank still serving to stop (its own tp group when it prepared).
 * -1 with a message when one could not be told. */
static int stop_all(struct saver *s, bool tp_serving, struct am_errors *err)
{
    int64_t stop = -1;
    int rc = 0;
    if (tp_serving && s->tp_size > 1 && msg_broadcast(s, s->tp, &stop, 1, AM_I64) < 0)
        rc = comm_failed(s, err);
    for (int p = 1; p < s->pp_size; p++)
        if (s->count[p] >= 0 && msg_send(s, s->pp, &stop, 1, AM_I64, p) < 0)
            return comm_failed(s, err);
    return rc;
}

int am_model_save_hf_dist(const struct am_model *m, struct am_comm *tp, struct am_comm *pp, const char *dir,
                          const char *base_config, struct am_errors *err)
{
    return am_model_save_hf_ep(m, tp, pp, NULL, true, dir, base_config, err);
}

static int save_dist(const struct am_model *m, struct am_comm *tp, struct am_comm *pp, struct am_comm *ep, bool saves,
                     const char *dir, const char *base_config, const struct am_peft_config *peft,
                     struct am_errors *err)
{
    struct saver s;
    int rc0 = saver_init(&s, m, tp, pp, ep, saves, dir, peft, err);
    if (rc0 < 0 || !saves) {
        saver_free(&s);
        return rc0;
    }
    int64_t max_full = 0; /* the writer sizes full once it has every rank's list */
    bool writer = s.tp_rank == 0 && s.pp_rank == 0;
    for (int64_t i = 0; i < s.n && !writer; i++) {
        struct wire_tensor t = entry_wire(&s, i);
        max_full = full_numel(&t) > max_full ? full_numel(&t) : max_full;
    }
    int rc = prepare(&s, max_full, err);
    if (writer) {
        bool prepared = rc == 0;
        rc = collect_lists(&s, prepared, err);
        if (rc == 0)
            rc = write_all(&s, base_config, err);
        if (stop_all(&s, prepared, err) < 0)
            rc = -1;
    } else {
        if (s.tp_rank == 0 && s.pp_rank > 0 && send_list(&s, rc == 0, err) < 0)
            rc = -1;
        if (rc == 0)
            rc = serve(&s, err);
    }
    saver_free(&s);
    return rc;
}

int am_model_save_hf_ep(const struct am_model *m, struct am_comm *tp, struct am_comm *pp, struct am_comm *ep,
                        bool saves, const char *dir, const char *base_config, struct am_errors *err)
{
    return save_dist(m, tp, pp, ep, saves, dir, base_config, NULL, err);
}

int am_model_save_peft_dist(const struct am_model *m, struct am_comm *tp, struct am_comm *pp, struct am_comm *ep,
                            bool saves, const char *dir, const char *base_model, struct am_errors *err)
{
    const struct am_model_config *c = &m->cfg;
    bool experts = m->sh.lora_experts && c->num_experts > 0;
    int64_t moe_layers = 0;
    for (int64_t l = 0; experts && l < c->num_hidden_layers; l++)
        moe_layers += am_model_layer_is_moe(c, l);
    /* the projections' names, and with the experts each expert's gate, up and down by its path
     * (AutoModel's per-expert target_modules), or gpt_oss's fused experts as target_parameters */
    size_t cap = AM_LORA_NTARGETS + (size_t)(3 * moe_layers * c->num_experts), n = 0;
    const char **targets = calloc(cap, sizeof(*targets));
    char *paths = calloc(cap, 96);
    if (!targets || !paths) {
        free(targets);
        free(paths);
        am_errorf(err, NULL, "%s: saving LoRA adapters: out of memory", dir);
        return -1;
    }
    for (int t = 0; t < AM_LORA_NTARGETS; t++)
        if (m->sh.lora_targets >> t & 1u)
            targets[n++] = am_lora_target_name_of(c, t);
    bool mixtral = strcmp(c->model_type, "mixtral") == 0;
    const char *kind[3] = {mixtral ? "w1" : "gate_proj", mixtral ? "w3" : "up_proj", mixtral ? "w2" : "down_proj"};
    /* gpt_oss: transformers' fused experts, adapted as parameters (fuse_gpt_oss_lora) */
    static const char *const fused[2] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
    bool pw = experts && c->gpt_oss;
    for (int64_t l = 0; experts && !pw && l < c->num_hidden_layers; l++)
        for (int64_t e = 0; am_model_layer_is_moe(c, l) && e < c->num_experts; e++)
            for (int k = 0; k < 3; k++, n++) {
                snprintf(paths + n * 96, 96, "model.layers.%lld.%s.experts.%lld.%s", (long long)l,
                         mixtral ? "block_sparse_moe" : "mlp", (long long)e, kind[k]);
                targets[n] = paths + n * 96;
            }
    int rc = -1;
    if (m->sh.lora_r < 1 || (n == 0 && !pw)) {
        am_errorf(err, NULL, "%s: saving LoRA adapters: the model has none", dir);
    } else {
        struct am_peft_config cfg = {.r = m->sh.lora_r, .alpha = m->sh.lora_alpha, .targets = targets,
                                     .n_targets = n, .params = fused, .n_params = pw ? 2 : 0,
                                     .base_model = base_model, .dropout = m->lora_drop.p};
        /* the experts' adapters of their own rank (moe_rank_scaling): peft's rank_pattern, matching
         * each expert's projections ("model.layers.0.mlp.experts.3.gate_proj") */
        if (experts && m->sh.lora_experts_r > 0 && m->sh.lora_experts_r != m->sh.lora_r) {
            cfg.rank_key = pw        ? "experts\\.(gate_up_proj|down_proj)"
                           : mixtral ? "experts\\.[0-9]+\\.(w1|w3|w2)"
                                     : "experts\\.[0-9]+\\.(gate_proj|up_proj|down_proj)";
            cfg.rank_r = m->sh.lora_experts_r;
        }
        rc = save_dist(m, tp, pp, experts ? ep : NULL, saves, dir, NULL, &cfg, err);
    }
    free(targets);
    free(paths);
    return rc;
}

int am_model_save_hf(const struct am_model *m, const char *dir, const char *base_config, struct am_errors *err)
{
    if (m->sh.tp > 1 || !m->sh.first_stage || !m->sh.last_stage) {
        am_errorf(err, NULL, "%s: saving needs the whole model on one rank (tp 1, one pipeline stage); "
                  "am_model_save_hf_dist saves from a sharded one", dir);
        return -1;
    }
    return am_model_save_hf_dist(m, NULL, NULL, dir, base_config, err);
}

/* ---- the selection biases in a sharded checkpoint (model_io.h) ----------------------------- */

int am_model_save_biases(const struct am_model *m, const char *path, struct am_errors *err)
{
    int64_t E = m->cfg.num_experts;
    int n = 0;
    for (int l = 0; l < m->n_layers; l++)
        n += m->layers[l].moe && m->layers[l].moe->bias_name[0];
    if (n == 0)
        return 0;
    float *mem = malloc((size_t)(n * E) * sizeof(float));
    struct am_st_wtensor *t = calloc((size_t)n, sizeof(*t));
    int rc = -1, i = 0;
    if (!mem || !t) {
        am_errorf(err, NULL, "%s: out of memory for the experts' selection biases", path);
        goto out;
    }
    for (int l = 0; l < m->n_layers; l++) {
        const struct am_moe_layer *X = m->layers[l].moe;
        if (!X || !X->bias_name[0])
            continue;
        m->K->download(m->dev, mem + i * E, X->bias.data, (size_t)E * sizeof(float));
        t[i] = (struct am_st_wtensor){.name = X->bias_name, .dtype = AM_ST_F32, .ndim = 1, .shape = {E},
                                      .data = mem + i * E};
        i++;
    }
    rc = am_st_write(path, t, (size_t)n, NULL, 0, 0, err);
out:
    free(mem);
    free(t);
    return rc;
}

int am_model_load_biases(struct am_model *m, const char *dir, struct am_errors *err)
{
    size_t before = err->n;
    int64_t E = m->cfg.num_experts;
    struct am_st_file *files[AM_MODEL_BIAS_FILES] = {0};
    size_t nf = 0;
    char path[4200];
    DIR *d = opendir(dir);
    if (!d)
        return 0; /* saved without the update: the model directory's biases stay */
    for (struct dirent *de; (de = readdir(d)) && nf < AM_MODEL_BIAS_FILES;) {
        size_t len = strlen(de->d_name);
        if (len < 12 || strcmp(de->d_name + len - 12, ".safetensors") != 0)
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        if (am_st_open(path, &files[nf], err) < 0)
            break;
        nf++;
    }
    closedir(d);
    float *host = malloc((size_t)E * sizeof(float));
    if (!host)
        am_errorf(err, NULL, "%s: out of memory for the experts' selection biases", dir);
    for (int l = 0; err->n == before && l < m->n_layers; l++) {
        const struct am_moe_layer *X = m->layers[l].moe;
        if (!X || !X->bias_name[0])
            continue;
        const struct am_st_info *ti = NULL;
        size_t f = 0;
        for (; f < nf && !ti; f++)
            ti = am_st_find(files[f], X->bias_name);
        if (!ti)
            am_errorf(err, NULL, "%s: no file holds %s (the checkpoint is damaged or of another model: restore from "
                      "another checkpoint)", dir, X->bias_name);
        else if (ti->ndim != 1 || ti->shape[0] != E)
            am_errorf(err, NULL, "%s: %s has %lld elements, the model's %lld experts want one each", dir,
                      X->bias_name, (long long)ti->numel, (long long)E);
        else if (am_st_read_f32(files[f - 1], ti, 0, E, host, err) == 0)
            m->K->upload(m->dev, X->bias.data, host, (size_t)E * sizeof(float));
    }
    free(host);
    for (size_t f = 0; f < nf; f++)
        am_st_close(files[f]);
    return err->n > before ? -1 : 0;
}
