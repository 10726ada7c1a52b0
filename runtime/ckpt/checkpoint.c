/* checkpoint.c - Hugging Face model directories behind checkpoint.h. */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "quant.h"
#include "util.h"

/* ---- reading ------------------------------------------------------------------------------------ */

struct entry {
    const char *name;
    const struct am_st_file *file;
    const struct am_st_info *info;
};

struct am_ckpt {
    char *dir;
    struct am_st_file **files;
    size_t n_files;
    struct entry *e;
    size_t n;
    json_t *index; /* keeps weight_map names alive */
    int64_t fp8_block[2]; /* am_ckpt_set_fp8's blocks; 0: not an FP8 checkpoint */
};

static int cmp_entry(const void *a, const void *b)
{
    return strcmp(((const struct entry *)a)->name, ((const struct entry *)b)->name);
}

static int open_file(struct am_ckpt *c, const char *name, struct am_errors *err)
{
    char path[4200];
    if (am_path_cat(path, sizeof(path), c->dir, "/", name) < 0) {
        am_errorf(err, NULL, "%s/%s: path too long", c->dir, name);
        return -1;
    }
    struct am_st_file **files = realloc(c->files, (c->n_files + 1) * sizeof(*files));
    if (!files) {
        am_errorf(err, NULL, "%s: out of memory", path);
        return -1;
    }
    c->files = files;
    if (am_st_open(path, &c->files[c->n_files], err) < 0)
        return -1;
    c->n_files++;
    return 0;
}

/* model.safetensors.index.json: {"metadata": {...}, "weight_map": {NAME: FILE}}. */
static int open_sharded(struct am_ckpt *c, const char *index_path, struct am_errors *err)
{
    char *text = NULL;
    size_t len;
    int rc = -1;
    const char *why = am_read_file(index_path, AM_JSON_MAX_BYTES, &text, &len);
    if (why) {
        am_errorf(err, NULL, "%s: %s", index_path, why);
        goto done;
    }
    json_error_t je;
    c->index = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!c->index) {
        am_errorf(err, NULL, "%s:%d:%d: not valid JSON: %s", index_path, je.line, je.column, je.text);
        goto done;
    }
    json_t *map = json_object_get(c->index, "weight_map");
    if (!json_is_object(map)) {
        am_errorf(err, NULL, "%s: no \"weight_map\" object (it maps each tensor name to its shard file)", index_path);
        goto done;
    }
    size_t n = json_object_size(map);
    if (!(c->e = calloc(n ? n : 1, sizeof(*c->e)))) {
        am_errorf(err, NULL, "%s: out of memory", index_path);
        goto done;
    }
    const char *name;
    json_t *v;
    json_object_foreach(map, name, v)
    {
        const char *file = json_string_value(v);
        if (!file || !*file || strchr(file, '/') || strcmp(file, ".") == 0 || strcmp(file, "..") == 0) {
            am_errorf(err, NULL, "%s: weight_map[\"%.200s\"]: expected the name of a file in %s (no '/')", index_path,
                      name, c->dir);
            goto done;
        }
        const struct am_st_file *f = NULL;
        char full[4200];
        am_path_cat(full, sizeof(full), c->dir, "/", file); /* too long: matches nothing, open_file says why */
        for (size_t i = 0; i < c->n_files && !f; i++)
            if (strcmp(am_st_path(c->files[i]), full) == 0)
                f = c->files[i];
        if (!f) {
            if (open_file(c, file, err) < 0)
                goto done;
            f = c->files[c->n_files - 1];
        }
        const struct am_st_info *info = am_st_find(f, name);
        if (!info) {
            am_errorf(err, NULL, "%s: tensor '%.200s' is mapped to %s, which does not hold it (an incomplete or "
                      "mixed-up checkpoint)", index_path, name, file);
            goto done;
        }
        c->e[c->n++] = (struct entry){name, f, info};
    }
    rc = 0;
done:
    free(text);
    return rc;
}

int am_ckpt_open(const char *dir, struct am_ckpt **out, struct am_errors *err)
{
    int rc = -1;
    char single[4200], index[4200];
    *out = NULL;
    struct am_ckpt *c = calloc(1, sizeof(*c));
    if (!c || !(c->dir = strdup(dir))) {
        am_errorf(err, NULL, "%s: out of memory", dir);
        goto done;
    }
    if (am_path_cat(single, sizeof(single), dir, "/", AM_CKPT_SINGLE) < 0 ||
        am_path_cat(index, sizeof(index), dir, "/", AM_CKPT_INDEX) < 0) {
        am_errorf(err, NULL, "%s: path too long", dir);
        goto done;
    }
    struct stat st;
    if (stat(dir, &st) < 0) {
        am_errorf(err, NULL, "%s: %s (expected a Hugging Face model directory)", dir, strerror(errno));
        goto done;
    }
    if (!S_ISDIR(st.st_mode)) {
        am_errorf(err, NULL, "%s: not a directory (expected a Hugging Face model directory)", dir);
        goto done;
    }
    if (stat(single, &st) == 0) {
        if (open_file(c, AM_CKPT_SINGLE, err) < 0)
            goto done;
        size_t n = am_st_count(c->files[0]);
        if (!(c->e = calloc(n ? n : 1, sizeof(*c->e)))) {
            am_errorf(err, NULL, "%s: out of memory", single);
            goto done;
        }
        for (size_t i = 0; i < n; i++) {
            const struct am_st_info *t = am_st_at(c->files[0], i);
            c->e[c->n++] = (struct entry){t->name, c->files[0], t};
        }
    } else if (stat(index, &st) == 0) {
        if (open_sharded(c, index, err) < 0)
            goto done;
    } else {
        am_errorf(err, NULL, "%s: neither %s nor %s is there (am reads Hugging Face safetensors checkpoints; "
                  "convert pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))",
                  dir, AM_CKPT_SINGLE, AM_CKPT_INDEX);
        goto done;
    }
    qsort(c->e, c->n, sizeof(*c->e), cmp_entry);
    *out = c;
    c = NULL;
    rc = 0;
done:
    am_ckpt_close(c);
    return rc;
}

void am_ckpt_close(struct am_ckpt *c)
{
    if (!c)
        return;
    for (size_t i = 0; i < c->n_files; i++)
        am_st_close(c->files[i]);
    free(c->files);
    free(c->e);
    if (c->index)
        json_decref(c->index);
    free(c->dir);
    free(c);
}

const char *am_ckpt_dir(const struct am_ckpt *c) { return c->dir; }
size_t am_ckpt_count(const struct am_ckpt *c) { return c->n; }
const char *am_ckpt_name(const struct am_ckpt *c, size_t i) { return i < c->n ? c->e[i].name : NULL; }

void am_ckpt_set_fp8(struct am_ckpt *c, const int64_t *block)
{
    c->fp8_block[0] = block ? block[0] : 0;
    c->fp8_block[1] = block ? block[1] : 0;
}

const struct am_st_info *am_ckpt_find(const struct am_ckpt *c, const char *name, const struct am_st_file **file)
{
    struct entry key = {.name = name};
    const struct entry *e = bsearch(&key, c->e, c->n, sizeof(*c->e), cmp_entry);
    if (file)
        *file = e ? e->file : NULL;
    return e ? e->info : NULL;
}

/* Converts `count` elements starting at element `first` of t into dst (dtype dt) at element
 * dst_first, in chunks through a small fp32 buffer when dt is not fp32. */
static int copy_run(const struct am_st_file *f, const struct am_st_info *t, int64_t first, int64_t count,
                    enum am_dtype dt, void *dst, int64_t dst_first, struct am_errors *err)
{
    if (dt == AM_F32)
        return am_st_read_f32(f, t, first, count, (float *)dst + dst_first, err);
    float buf[2048];
    uint16_t *d = (uint16_t *)dst + dst_first;
    for (int64_t done = 0; done < count;) {
        int64_t k = count - done < 2048 ? count - done : 2048;
        if (am_st_read_f32(f, t, first + done, k, buf, err) < 0)
            return -1;
        for (int64_t i = 0; i < k; i++)
            d[done + i] = dt == AM_BF16 ? am_f32_to_bf16(buf[i]) : am_f32_to_f16(buf[i]);
        done += k;
    }
    return 0;
}

/* An FP8 weight (quant.h), or rows or columns of it, dequantised into dst (its shape checked):
 * each row's bytes of the slice and the scales of their blocks are all that is read. */
static int read_fp8(const struct am_ckpt *c, const struct am_st_file *f, const struct am_st_info *t, const char *name,
                    const struct am_ckpt_slice *slice, const struct am_tensor *dst, struct am_errors *err)
{
    if (!c->fp8_block[0]) {
        am_errorf(err, NULL, "%s: tensor '%s' is F8_E4M3, but config.json has no quantization_config with "
                  "quant_method fp8 (the block of one scale, weight_block_size, is unknown): use the model's own "
                  "config.json", am_st_path(f), name);
        return -1;
    }
    char sname[300];
    snprintf(sname, sizeof(sname), "%s" AM_FP8_SCALE_SUFFIX, name);
    const struct am_st_file *sf;
    const struct am_st_info *s = am_ckpt_find(c, sname, &sf);
    if (am_fp8_check(am_st_path(f), name, t, s, c->fp8_block, err) < 0)
        return -1;
    int64_t r0 = 0, r1 = t->shape[0], c0 = 0, c1 = t->shape[1];
    if (slice && slice->dim == 0)
        r0 = slice->begin, r1 = slice->end;
    else if (slice)
        c0 = slice->begin, c1 = slice->end;
    if (dst->dtype == AM_F32) {
        am_fp8_dequant(t, s, c->fp8_block, r0, r1, c0, c1, dst->data);
        return 0;
    }
    float *row = malloc((size_t)(c1 - c0 + 1) * sizeof(float)); /* one row at a time, rounded once */
    if (!row) {
        am_errorf(err, NULL, "%s: tensor '%s': out of memory", am_st_path(f), name);
        return -1;
    }
    uint16_t *d = dst->data;
    for (int64_t r = r0; r < r1; r++) {
        am_fp8_dequant(t, s, c->fp8_block, r, r + 1, c0, c1, row);
        for (int64_t j = 0; j < c1 - c0; j++)
            d[(r - r0) * (c1 - c0) + j] = dst->dtype == AM_BF16 ? am_f32_to_bf16(row[j]) : am_f32_to_f16(row[j]);
    }
    free(row);
    return 0;
}

int am_ckpt_read_mxfp4(const struct am_ckpt *c, const char *name, int64_t e0, int64_t e1, const struct am_tensor *dst,
                       struct am_errors *err)
{
    char bn[300], sn[300], have[200], want[200];
    snprintf(bn, sizeof(bn), "%s_blocks", name);
    snprintf(sn, sizeof(sn), "%s_scales", name);
    const struct am_st_file *f, *sf;
    const struct am_st_info *b = am_ckpt_find(c, bn, &f), *s = am_ckpt_find(c, sn, &sf);
    const char *path = f ? am_st_path(f) : sf ? am_st_path(sf) : c->dir;
    if (am_mxfp4_check(path, name, b, s, err) < 0)
        return -1;
    int64_t E = b->shape[0], R = b->shape[1], G = b->shape[2];
    int64_t shape[3] = {e1 - e0, G * 32, R};
    if (e0 < 0 || e0 >= e1 || e1 > E) {
        am_errorf(err, NULL, "%s: tensor '%s': cannot take experts [%" PRId64 ", %" PRId64 ") of %" PRId64, path, bn,
                  e0, e1, E);
        return -1;
    }
    if (dst->device != AM_DEV_CPU || dst->dtype != AM_F32 || dst->ndim != 3 || dst->shape[0] != shape[0] ||
        dst->shape[1] != shape[1] || dst->shape[2] != shape[2]) {
        am_errorf(err, NULL, "%s: tensor '%s': experts [%" PRId64 ", %" PRId64 ") dequantise to %s, but the model "
                  "expects %s (read into a host fp32 tensor; does config.json match the weights?)", path, name, e0,
                  e1, am_st_shape_str(shape, 3, want, sizeof(want)),
                  am_st_shape_str(dst->shape, dst->ndim, have, sizeof(have)));
        return -1;
    }
    am_mxfp4_dequant(b->data + e0 * R * G * 16, s->data + e0 * R * G, e1 - e0, R, G, dst->data);
    return 0;
}

int am_ckpt_read(const struct am_ckpt *c, const char *name, const struct am_ckpt_slice *slice,
                 const struct am_tensor *dst, struct am_errors *err)
{
    const struct am_st_file *f;
    const struct am_st_info *t = am_ckpt_find(c, name, &f);
    char have[200], part[200], want[200];
    if (!t) {
        am_errorf(err, NULL, "%s: no tensor '%s' in the checkpoint (does config.json match the weights? "
                  "tie_word_embeddings and the model type decide which tensors exist)", c->dir, name);
        return -1;
    }
    if (dst->device != AM_DEV_CPU || (dst->dtype != AM_F32 && dst->dtype != AM_BF16 && dst->dtype != AM_F16)) {
        am_errorf(err, NULL, "%s: tensor '%s': am reads checkpoints into host fp32, bf16 or fp16 tensors (read into "
                  "a host staging buffer, then copy to the device)", am_st_path(f), name);
        return -1;
    }
    int64_t shape[AM_ST_MAX_DIMS];
    memcpy(shape, t->shape, sizeof(shape));
    am_st_shape_str(t->shape, t->ndim, have, sizeof(have));
    part[0] = '\0';
    int dim = slice && slice->dim >= 0 ? slice->dim : -1;
    if (dim >= 0) {
        static const char *const what[] = {"rows", "columns"};
        if (dim >= t->ndim || slice->begin < 0 || slice->begin > slice->end || slice->end > t->shape[dim]) {
            am_errorf(err, NULL, "%s: tensor '%s': cannot take [%" PRId64 ", %" PRId64 ") of dimension %d of a "
                      "tensor of shape %s", am_st_path(f), name, slice->begin, slice->end, dim, have);
            return -1;
        }
        shape[dim] = slice->end - slice->begin;
        char s[200];
        snprintf(part, sizeof(part), ", %s [%" PRId64 ", %" PRId64 ") of it are %s",
                 dim < 2 ? what[dim] : "indices", slice->begin, slice->end, am_st_shape_str(shape, t->ndim, s, sizeof(s)));
    }
    bool same = dst->ndim == t->ndim;
    for (int i = 0; same && i < t->ndim; i++)
        same = dst->shape[i] == shape[i];
    if (!same) {
        am_errorf(err, NULL, "%s: tensor '%s': the checkpoint holds %s%s, but the model expects %s (does config.json "
                  "match the weights?)", am_st_path(f), name, have, part,
                  am_st_shape_str(dst->shape, dst->ndim, want, sizeof(want)));
        return -1;
    }
    if (t->dtype == AM_ST_F8_E4M3)
        return read_fp8(c, f, t, name, dim < 0 ? NULL : slice, dst, err);
    if (dim < 0)
        return copy_run(f, t, 0, t->numel, dst->dtype, dst->data, 0, err);
    int64_t outer = 1, inner = 1;
    for (int i = 0; i < dim; i++)
        outer *= t->shape[i];
    for (int i = dim + 1; i < t->ndim; i++)
        inner *= t->shape[i];
    int64_t run = (slice->end - slice->begin) * inner;
    for (int64_t o = 0; o < outer; o++)
        if (copy_run(f, t, (o * t->shape[dim] + slice->begin) * inner, run, dst->dtype, dst->data, o * run, err) < 0)
            return -1;
    return 0;
}

/* ---- config.json -------------------------------------------------------------------------------- */

static const char *architecture(const char *model_type)
{
    static const char *const map[][2] = {{"llama", "LlamaForCausalLM"},     {"mistral", "MistralForCausalLM"},
                                         {"mixtral", "MixtralForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"},
                                         {"qwen3", "Qwen3ForCausalLM"},     {"qwen3_moe", "Qwen3MoeForCausalLM"},
                                         {"gemma2", "Gemma2ForCausalLM"},   {"gemma3_text", "Gemma3ForCausalLM"},
                                         {"glm4_moe", "Glm4MoeForCausalLM"}, {"deepseek_v3", "DeepseekV3ForCausalLM"},
                                         {"gpt_oss", "GptOssForCausalLM"}};
    for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
        if (strcmp(model_type, map[i][0]) == 0)
            return map[i][1];
    return NULL;
}

static void set(json_t *o, const char *k, json_t *v) { json_object_set_new(o, k, v); }

/* DeepSeekMoE's keys, as deepseek_v3's and glm4_moe's configs name them. */
static void set_deepseek_moe(json_t *cfg, const struct am_model_config *m)
{
    set(cfg, "n_routed_experts", json_integer(m->num_experts));
    set(cfg, "num_experts_per_tok", json_integer(m->num_experts_per_tok));
    set(cfg, "moe_intermediate_size", json_integer(m->moe_intermediate_size));
    set(cfg, "norm_topk_prob", json_boolean(m->norm_topk_prob));
    set(cfg, "n_group", json_integer(m->n_group));
    set(cfg, "topk_group", json_integer(m->topk_group));
    set(cfg, "n_shared_experts", json_integer(m->n_shared_experts));
    set(cfg, "routed_scaling_factor", json_real(m->routed_scaling_factor));
    set(cfg, "first_k_dense_replace", json_integer(m->first_k_dense_replace));
    set(cfg, "num_nextn_predict_layers", json_integer(0)); /* am builds and saves no MTP layers */
}

char *am_ckpt_config_json(const struct am_model_config *m, const char *base_config, struct am_errors *err)
{
    char *text = NULL, *out = NULL;
    size_t len;
    json_t *cfg = NULL;
    const char *type = m->model_type ? m->model_type : "llama", *arch = architecture(type);
    if (!arch) {
        am_errorf(err, NULL, "config.json: model_type '%s' has no transformers class am knows (llama, mistral, "
                  "mixtral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, glm4_moe, deepseek_v3, gpt_oss)", type);
        goto done;
    }
    if (base_config) {
        const char *why = am_read_file(base_config, AM_JSON_MAX_BYTES, &text, &len);
        json_error_t je;
        if (why || !(cfg = json_loadb(text, len, 0, &je)) || !json_is_object(cfg)) {
            am_errorf(err, NULL, "%s: %s", base_config, why ? why : cfg ? "not a JSON object" : je.text);
            goto done;
        }
    } else if (!(cfg = json_object())) {
        goto oom;
    }
    json_t *archs = json_array();
    json_array_append_new(archs, json_string(arch));
    set(cfg, "architectures", archs);
    set(cfg, "model_type", json_string(type));
    set(cfg, "hidden_size", json_integer(m->hidden_size));
    set(cfg, "num_hidden_layers", json_integer(m->num_hidden_layers));
    set(cfg, "num_attention_heads", json_integer(m->num_attention_heads));
    set(cfg, "num_key_value_heads", json_integer(m->num_key_value_heads ? m->num_key_value_heads
                                                                         : m->num_attention_heads));
    if (m->mla) /* DeepseekV3Config's head_dim is its rope part (the attention's width is am's own) */
        set(cfg, "head_dim", json_integer(m->qk_rope_head_dim));
    else if (m->head_dim)
        set(cfg, "head_dim", json_integer(m->head_dim));
    set(cfg, "intermediate_size", json_integer(m->intermediate_size));
    set(cfg, "vocab_size", json_integer(m->vocab_size));
    set(cfg, "max_position_embeddings", json_integer(m->max_position_embeddings));
    set(cfg, "rope_theta", json_real(m->rope_theta));
    set(cfg, "rms_norm_eps", json_real(m->rms_norm_eps));
    set(cfg, "initializer_range", json_real(m->initializer_range));
    set(cfg, "tie_word_embeddings", json_boolean(m->tie_word_embeddings));
    set(cfg, "hidden_act", json_string(m->gemma ? "gelu_pytorch_tanh" : "silu"));
    set(cfg, "attention_dropout", json_real(0.0));
    set(cfg, "use_cache", json_true());
    set(cfg, "torch_dtype", json_string("float32"));
    if (json_object_get(cfg, "dtype")) /* transformers >= 4.56 writes "dtype" */
        set(cfg, "dtype", json_string("float32"));
    json_object_del(cfg, "quantization_config");
    if (m->rope_scaling.type) {
        json_t *rs = json_object();
        set(rs, "rope_type", json_string(m->rope_scaling.type));
        set(rs, "factor", json_real(m->rope_scaling.factor));
        if (strcmp(m->rope_scaling.type, "llama3") == 0) {
            set(rs, "low_freq_factor", json_real(m->rope_scaling.low_freq_factor));
            set(rs, "high_freq_factor", json_real(m->rope_scaling.high_freq_factor));
            set(rs, "original_max_position_embeddings", json_integer(m->rope_scaling.original_max_position_embeddings));
        }
        if (strcmp(m->rope_scaling.type, "yarn") == 0) { /* a key am read as absent (0) is written absent */
            set(rs, "original_max_position_embeddings", json_integer(m->rope_scaling.original_max_position_embeddings));
            const char *names[] = {"beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"};
            double vals[] = {m->rope_scaling.beta_fast, m->rope_scaling.beta_slow, m->rope_scaling.attention_factor,
                             m->rope_scaling.mscale, m->rope_scaling.mscale_all_dim};
            for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); i++)
                if (vals[i] != 0)
                    set(rs, names[i], json_real(vals[i]));
            set(rs, "truncate", json_boolean(!m->rope_scaling.no_truncate));
            json_t *rp = json_object_get(cfg, "rope_parameters"); /* transformers 5 reads it there */
            if (json_is_object(rp)) {
                json_t *copy = json_deep_copy(rs);
                set(copy, "rope_theta", json_real(m->rope_theta));
                set(cfg, "rope_parameters", copy);
            }
        }
        set(cfg, "rope_scaling", rs);
    } else {
        set(cfg, "rope_scaling", json_null());
    }
    bool moe = strcmp(type, "mixtral") == 0 || strcmp(type, "qwen3_moe") == 0 || m->gpt_oss;
    if (m->gemma || m->gpt_oss) { /* Gemma2Config / Gemma3TextConfig: what am trained, as transformers reads it back */
        bool g3 = strcmp(type, "gemma3_text") == 0;
        if (m->gpt_oss)
            goto layer_types;
        set(cfg, "hidden_activation", json_string("gelu_pytorch_tanh"));
        double qs = m->query_pre_attn_scalar; /* Gemma2Config types it int: written as one when whole */
        set(cfg, "query_pre_attn_scalar", qs == (double)(json_int_t)qs ? json_integer((json_int_t)qs) : json_real(qs));
        set(cfg, "attn_logit_softcapping", m->attn_logit_softcapping > 0 ? json_real(m->attn_logit_softcapping) : json_null());
        set(cfg, "final_logit_softcapping",
            m->final_logit_softcapping > 0 ? json_real(m->final_logit_softcapping) : json_null());
        set(cfg, "attention_bias", json_false());
        set(cfg, "use_bidirectional_attention", json_false());
    layer_types:;
        json_t *lt = json_array();
        long window = 0;
        for (long l = 0; l < m->num_hidden_layers; l++) {
            long w = am_model_layer_window(m, l);
            window = w > 0 ? w : window;
            json_array_append_new(lt, json_string(w > 0 ? "sliding_attention" : "full_attention"));
        }
        set(cfg, "layer_types", lt);
        set(cfg, "sliding_window", window > 0 ? json_integer(window) : json_null());
        json_object_del(cfg, "sliding_window_pattern");
        if (m->gpt_oss) { /* GptOssConfig: what am trained, as transformers reads it back */
            set(cfg, "attention_bias", json_boolean(m->o_bias));
            set(cfg, "swiglu_limit", json_real(m->swiglu_limit));
            set(cfg, "swiglu_alpha", json_real(m->swiglu_alpha));
            json_object_del(cfg, "experts_per_token"); /* gpt-oss's own code's copy of num_experts_per_tok */
            if (!m->rope_scaling.type) /* GptOssConfig's rope without parameters is yarn: say default */
                set(cfg, "rope_parameters", json_pack("{s:s, s:f}", "rope_type", "default", "rope_theta", m->rope_theta));
        } else {
            json_object_del(cfg, "rope_parameters"); /* rope_theta, rope_scaling (and rope_local_base_freq) above */
        }
        if (g3)
            set(cfg, "rope_local_base_freq", json_real(m->rope_local_base_freq));
    }
    if (strcmp(type, "llama") == 0) {
        set(cfg, "attention_bias", json_false());
        set(cfg, "mlp_bias", json_false());
        set(cfg, "pretraining_tp", json_integer(1));
    } else if (!m->gemma) { /* the window am trained with (model_config.h), as transformers reads it back */
        set(cfg, "sliding_window", m->sliding_window > 0 ? json_integer(m->sliding_window) : json_null());
    }
    bool qwen2 = strcmp(type, "qwen2") == 0; /* Qwen2Config: no attention_bias (the biases are fixed) */
    if (strncmp(type, "qwen3", 5) == 0 || qwen2) {
        long first = m->num_hidden_layers; /* the first layer with the window */
        for (long l = m->num_hidden_layers - 1; l >= 0; l--)
            if (am_model_layer_window(m, l) > 0)
                first = l;
        if (!qwen2)
            set(cfg, "attention_bias", json_false());
        set(cfg, "use_sliding_window", json_boolean(m->sliding_window > 0));
        set(cfg, "max_window_layers", json_integer(first));
    }
    if (strcmp(type, "qwen3") == 0 || qwen2) {
        json_t *lt = json_array();
        for (long l = 0; l < m->num_hidden_layers; l++)
            json_array_append_new(lt, json_string(am_model_layer_window(m, l) > 0 ? "sliding_attention"
                                                                                  : "full_attention"));
        set(cfg, "layer_types", lt);
    }
    if (moe) {
        set(cfg, strcmp(type, "mixtral") == 0 || m->gpt_oss ? "num_local_experts" : "num_experts",
            json_integer(m->num_experts));
        set(cfg, "num_experts_per_tok", json_integer(m->num_experts_per_tok));
        set(cfg, "router_aux_loss_coef", json_real(m->router_aux_loss_coef));
        set(cfg, "output_router_logits", json_boolean(m->output_router_logits));
    }
    if (strcmp(type, "qwen3_moe") == 0) {
        set(cfg, "moe_intermediate_size", json_integer(m->moe_intermediate_size));
        set(cfg, "norm_topk_prob", json_boolean(m->norm_topk_prob));
        /* the dense layers am built, listed one by one (the same layers as any sparse step) */
        json_t *dense = json_array();
        for (long l = 0; l < m->num_hidden_layers; l++)
            if (!am_model_layer_is_moe(m, l))
                json_array_append_new(dense, json_integer(l));
        set(cfg, "decoder_sparse_step", json_integer(1));
        set(cfg, "mlp_only_layers", dense);
    }
    if (m->mla) { /* DeepseekV3Config: what am trained, as transformers reads it back */
        if (m->q_lora_rank > 0)
            set(cfg, "q_lora_rank", json_integer(m->q_lora_rank));
        else
            set(cfg, "q_lora_rank", json_null());
        set(cfg, "kv_lora_rank", json_integer(m->kv_lora_rank));
        set(cfg, "qk_nope_head_dim", json_integer(m->qk_nope_head_dim));
        set(cfg, "qk_rope_head_dim", json_integer(m->qk_rope_head_dim));
        set(cfg, "v_head_dim", json_integer(m->v_head_dim));
        set(cfg, "rope_interleave", json_boolean(m->rope_interleave));
        set(cfg, "attention_bias", json_false());
        json_t *rp = json_object_get(cfg, "rope_parameters");
        if (json_is_object(rp))
            set(rp, "rope_theta", json_real(m->rope_theta));
        set_deepseek_moe(cfg, m);
    }
    if (strcmp(type, "glm4_moe") == 0) { /* Glm4MoeConfig: what am trained, as transformers reads it back */
        set(cfg, "attention_bias", json_boolean(m->qkv_bias));
        set(cfg, "use_qk_norm", json_boolean(m->qk_norm));
        set(cfg, "partial_rotary_factor", json_real(m->partial_rotary_factor));
        json_t *rp = json_object_get(cfg, "rope_parameters"); /* transformers 5 keeps it there */
        if (json_is_object(rp)) {
            set(rp, "partial_rotary_factor", json_real(m->partial_rotary_factor));
            set(rp, "rope_theta", json_real(m->rope_theta));
        }
        set_deepseek_moe(cfg, m);
    }
    char *dumped = json_dumps(cfg, JSON_INDENT(2) | JSON_SORT_KEYS);
    if (!dumped)
        goto oom;
    len = strlen(dumped);
    if ((out = malloc(len + 2))) {
        memcpy(out, dumped, len);
        memcpy(out + len, "\n", 2);
    }
    free(dumped);
    if (out)
        goto done;
oom:
    am_errorf(err, NULL, "config.json: out of memory");
done:
    free(text);
    if (cfg)
        json_decref(cfg);
    return out;
}

/* ---- saving ------------------------------------------------------------------------------------ */

/* Writes a small file (not atomically: it lives in the temporary directory) and fsyncs it. */
static int write_small(const char *path, const char *text, struct am_errors *err)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    size_t len = strlen(text), off = 0;
    while (fd >= 0 && off < len) {
        ssize_t w = write(fd, text + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    int ok = fd >= 0 && off == len && fsync(fd) == 0;
    int saved = errno;
    if (fd >= 0 && close(fd) < 0)
        ok = 0;
    if (!ok) {
        am_errorf(err, NULL, "%s: cannot write: %s (is the disk full?)", path, strerror(saved ? saved : EIO));
        return -1;
    }
    return 0;
}

/* The names am_ckpt_save writes: they are never carried over from a previous checkpoint. */
static bool managed_name(const char *n)
{
    unsigned a, b;
    int end = 0;
    return strcmp(n, "config.json") == 0 || strcmp(n, AM_CKPT_SINGLE) == 0 || strcmp(n, AM_CKPT_INDEX) == 0 ||
           (sscanf(n, "model-%5u-of-%5u.safetensors%n", &a, &b, &end) == 2 && n[end] == '\0');
}

/* Hard-links (or copies) the previous checkpoint's other top-level files into tmp. */
static int carry_over(const char *old, const char *tmp, struct am_errors *err)
{
    DIR *d = opendir(old);
    if (!d) {
        am_errorf(err, NULL, "%s: cannot list the previous checkpoint: %s", old, strerror(errno));
        return -1;
    }
    int rc = 0;
    struct dirent *de;
    while (rc == 0 && (de = readdir(d))) {
        char from[4200], to[4200];
        struct stat st;
        if (de->d_name[0] == '.' || managed_name(de->d_name))
            continue;
        if (am_path_cat(from, sizeof(from), old, "/", de->d_name) < 0 ||
            am_path_cat(to, sizeof(to), tmp, "/", de->d_name) < 0 ||
            lstat(from, &st) < 0 || !S_ISREG(st.st_mode))
            continue;
        if (link(from, to) < 0 && am_copy_file(from, to, 0666) < 0) {
            am_errorf(err, NULL, "%s: cannot carry it over into the new checkpoint: %s", from, strerror(errno));
            rc = -1;
        }
    }
    closedir(d);
    return rc;
}

/* Replaces dir (which may not exist) by tmp; on return tmp names the previous checkpoint
 * (or nothing). */
static int swap_in(const char *tmp, const char *dir, bool exists, struct am_errors *err)
{
    if (!exists) {
        if (rename(tmp, dir) == 0)
            return 0;
        am_errorf(err, NULL, "%s: cannot rename the finished checkpoint into place: %s", dir, strerror(errno));
        return -1;
    }
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, dir, RENAME_EXCHANGE) == 0)
        return 0;
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
        am_errorf(err, NULL, "%s: cannot swap the new checkpoint in: %s", dir, strerror(errno));
        return -1;
    }
    /* No RENAME_EXCHANGE here: move the old one aside, then the new one in. Between the two
     * renames DIR does not exist, but the previous checkpoint is intact at DIR.tmp-XXXXXX.old. */
    char aside[4300];
    am_path_cat(aside, sizeof(aside), tmp, ".old", ""); /* tmp is shorter than aside by more than 4 */
    if (rename(dir, aside) < 0) {
        am_errorf(err, NULL, "%s: cannot move the previous checkpoint aside: %s", dir, strerror(errno));
        return -1;
    }
    if (rename(tmp, dir) < 0) {
        int saved = errno;
        rename(aside, dir);
        am_errorf(err, NULL, "%s: cannot rename the finished checkpoint into place: %s", dir, strerror(saved));
        return -1;
    }
    rename(aside, tmp);
    return 0;
}

/* Writes the weights into tmp: one file, or shards of at most max bytes plus the index. */
static int write_weights(const char *tmp, const struct am_st_wtensor *t, size_t n, uint64_t max,
                         struct am_errors *err)
{
    int rc = -1;
    size_t *first = calloc(n + 2, sizeof(*first)), n_shards = 0;
    json_t *index = NULL;
    char path[4200], *text = NULL;
    if (!first) {
        am_errorf(err, NULL, "%s: out of memory", tmp);
        goto done;
    }
    /* shards are consecutive runs of t: a new one starts when the next tensor would take the
     * current one past max (so a tensor larger than max gets a shard of its own) */
    uint64_t total = 0, cur = 0;
    for (size_t i = 0; i < n; i++) {
        bool ok;
        uint64_t b = am_st_wtensor_bytes(&t[i], &ok);
        if (!ok) {
            am_errorf(err, NULL, "%s: tensor '%.200s': invalid dtype or shape", tmp, t[i].name ? t[i].name : "(null)");
            goto done;
        }
        if (n_shards == 0 || (cur > 0 && cur + b > max)) {
            first[n_shards++] = i;
            cur = 0;
        }
        cur += b;
        total += b;
    }
    if (n_shards == 0)
        first[n_shards++] = 0;
    first[n_shards] = n;
    if (n_shards == 1) {
        if (am_path_cat(path, sizeof(path), tmp, "/", AM_CKPT_SINGLE) < 0)
            goto too_long;
        rc = am_st_write(path, t, n, NULL, 0, 0, err);
        goto done;
    }
    json_t *map = json_object(), *meta = json_object();
    index = json_object();
    if (!map || !meta || !index) {
        json_decref(map);
        json_decref(meta);
        am_errorf(err, NULL, "%s: out of memory", tmp);
        goto done;
    }
    json_object_set_new(meta, "total_size", json_integer((json_int_t)total));
    json_object_set_new(index, "metadata", meta);
    json_object_set_new(index, "weight_map", map);
    for (size_t s = 0; s < n_shards; s++) {
        char name[64];
        snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, n_shards);
        if (am_path_cat(path, sizeof(path), tmp, "/", name) < 0)
            goto too_long;
        if (am_st_write(path, t + first[s], first[s + 1] - first[s], NULL, 0, first[s], err) < 0)
            goto done;
        for (size_t i = first[s]; i < first[s + 1]; i++)
            json_object_set_new(map, t[i].name, json_string(name));
    }
    char *dumped = json_dumps(index, JSON_INDENT(2) | JSON_SORT_KEYS);
    if (!dumped || !(text = malloc(strlen(dumped) + 2))) {
        free(dumped);
        am_errorf(err, NULL, "%s: out of memory", tmp);
        goto done;
    }
    sprintf(text, "%s\n", dumped);
    free(dumped);
    if (am_path_cat(path, sizeof(path), tmp, "/", AM_CKPT_INDEX) < 0)
        goto too_long;
    rc = write_small(path, text, err);
    goto done;
too_long:
    am_errorf(err, NULL, "%s: path too long", tmp);
done:
    free(text);
    if (index)
        json_decref(index);
    free(first);
    return rc;
}

/* config (am_ckpt_config_json's text, freed) with torch_dtype (and dtype when there) set to
 * `dtype`, written the same way; NULL on failure. */
static char *set_torch_dtype(char *config, const char *dtype, struct am_errors *err)
{
    json_t *cfg = json_loads(config, 0, NULL);
    free(config);
    char *dumped = NULL, *out = NULL;
    if (cfg) {
        json_object_set_new(cfg, "torch_dtype", json_string(dtype));
        if (json_object_get(cfg, "dtype"))
            json_object_set_new(cfg, "dtype", json_string(dtype));
        dumped = json_dumps(cfg, JSON_INDENT(2) | JSON_SORT_KEYS);
        json_decref(cfg);
    }
    if (dumped && (out = malloc(strlen(dumped) + 2)))
        sprintf(out, "%s\n", dumped);
    free(dumped);
    if (!out)
        am_errorf(err, NULL, "config.json: out of memory");
    return out;
}

int am_ckpt_save(const char *dir_in, const struct am_model_config *m, const struct am_st_wtensor *t, size_t n,
                 const struct am_ckpt_save_opts *opts, struct am_errors *err)
{
    int rc = -1;
    char dir[4096], tmp[4200] = "", path[4300];
    char *config = NULL;
    size_t len = strlen(dir_in);
    while (len > 1 && dir_in[len - 1] == '/')
        len--;
    if (len == 0 || len >= sizeof(dir) - 64) {
        am_errorf(err, NULL, "%s: not a usable checkpoint directory name", dir_in);
        goto done;
    }
    memcpy(dir, dir_in, len);
    dir[len] = '\0';
    struct stat st;
    bool exists = lstat(dir, &st) == 0;
    if (exists) {
        am_path_cat(path, sizeof(path), dir, "/config.json", ""); /* dir is short: checked above */
        DIR *d = S_ISDIR(st.st_mode) ? opendir(dir) : NULL;
        int entries = 0;
        for (struct dirent *de; d && (de = readdir(d));)
            entries += strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0;
        if (d)
            closedir(d);
        if (!S_ISDIR(st.st_mode) || (entries > 0 && access(path, F_OK) != 0)) {
            am_errorf(err, NULL, "%s: exists and is not a checkpoint (%s); am replaces only a previous checkpoint "
                      "or an empty directory: choose another checkpoint.checkpoint_dir", dir,
                      S_ISDIR(st.st_mode) ? "no config.json in it" : "not a directory");
            goto done;
        }
    } else if (errno != ENOENT) {
        am_errorf(err, NULL, "%s: %s", dir, strerror(errno));
        goto done;
    }
    if (!(config = am_ckpt_config_json(m, opts ? opts->base_config : NULL, err)))
        goto done;
    if (opts && opts->torch_dtype && !(config = set_torch_dtype(config, opts->torch_dtype, err)))
        goto done;
    if (am_temp_dir(dir, tmp, sizeof(tmp), err) < 0)
        goto done;
    am_path_cat(path, sizeof(path), tmp, "/config.json", "");
    uint64_t max = opts && opts->max_shard_bytes ? opts->max_shard_bytes : AM_CKPT_DEFAULT_SHARD_BYTES;
    if (write_small(path, config, err) < 0 || write_weights(tmp, t, n, max, err) < 0)
        goto done;
    if (exists && carry_over(dir, tmp, err) < 0)
        goto done;
    if (am_fsync_dir_of(tmp, true) < 0) {
        am_errorf(err, NULL, "%s: cannot sync the new checkpoint: %s", tmp, strerror(errno));
        goto done;
    }
    if (swap_in(tmp, dir, exists, err) < 0)
        goto done;
    if (am_fsync_dir_of(dir, false) < 0) {
        am_errorf(err, NULL, "%s: saved, but syncing its parent directory failed: %s (the rename may not survive "
                  "a crash)", dir, strerror(errno));
        goto done;
    }
    rc = 0;
done:
    if (tmp[0])
        am_remove_tree(tmp); /* the unfinished checkpoint, or after a swap the previous one */
    free(config);
    return rc;
}
