/* model_config.c - the model architecture: resolving, reading and counting (model_config.h). */
#include "model_config.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <ctype.h>
#include <sys/stat.h>

#include "util.h"

#ifndef AM_PKGDATADIR
#define AM_PKGDATADIR "/usr/local/share/am"
#endif

/* ---- finding config.json ------------------------------------------------------------- */

static bool is_file(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static bool is_dir(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The hub cache directory, as huggingface_hub computes it. */
static void hub_cache_dir(char *out, size_t len)
{
    const char *v;
    if ((v = getenv("HF_HUB_CACHE")) && *v)
        snprintf(out, len, "%s", v);
    else if ((v = getenv("HF_HOME")) && *v)
        snprintf(out, len, "%s/hub", v);
    else if ((v = getenv("XDG_CACHE_HOME")) && *v)
        snprintf(out, len, "%s/huggingface/hub", v);
    else
        snprintf(out, len, "%s/.cache/huggingface/hub", (v = getenv("HOME")) && *v ? v : "");
}

static int from_hub_cache(const char *id, char *out, size_t out_len, char *looked, size_t looked_len)
{
    char cache[1024], repo[2048], ref[64] = "", refpath[2200];
    hub_cache_dir(cache, sizeof(cache));
    snprintf(repo, sizeof(repo), "%s/models--", cache);
    size_t l = strlen(repo);
    for (const char *c = id; *c && l + 3 < sizeof(repo); c++) { /* ORG/NAME -> ORG--NAME */
        if (*c == '/') {
            repo[l++] = '-';
            repo[l++] = '-';
        } else {
            repo[l++] = *c;
        }
    }
    repo[l] = '\0';
    snprintf(refpath, sizeof(refpath), "%s/refs/main", repo);
    FILE *f = fopen(refpath, "r");
    if (f) {
        if (!fgets(ref, sizeof(ref), f))
            ref[0] = '\0';
        fclose(f);
        ref[strcspn(ref, "\r\n")] = '\0';
    }
    size_t ll = strlen(looked);
    snprintf(looked + ll, looked_len - ll, "%sthe Hugging Face cache (%s)", ll ? ", " : "", repo);
    if (!ref[0] || strchr(ref, '/'))
        return -1;
    snprintf(out, out_len, "%s/snapshots/%s/config.json", repo, ref);
    return is_file(out) ? 0 : -1;
}

static int from_shipped(const char *id, char *out, size_t out_len, char *looked, size_t looked_len)
{
    const char *dir = getenv("AM_MODELS_DIR");
    char def[1024];
    if (!dir || !*dir) {
        snprintf(def, sizeof(def), "%s/models", AM_PKGDATADIR);
        dir = def;
    }
    char name[512];
    size_t l = 0;
    for (const char *c = id; *c && l + 3 < sizeof(name); c++) {
        if (*c == '/') {
            name[l++] = '-';
            name[l++] = '-';
        } else {
            name[l++] = *c;
        }
    }
    name[l] = '\0';
    snprintf(out, out_len, "%s/%s.json", dir, name);
    size_t ll = strlen(looked);
    snprintf(looked + ll, looked_len - ll, "%sthe configs shipped with am (%s)", ll ? ", " : "", dir);
    return is_file(out) ? 0 : -1;
}

int am_model_resolve(const char *name_or_path, char *out, size_t out_len, char *looked, size_t looked_len)
{
    looked[0] = '\0';
    if (is_dir(name_or_path)) {
        snprintf(out, out_len, "%s/config.json", name_or_path);
        snprintf(looked, looked_len, "the directory %s (it has no config.json)", name_or_path);
        return is_file(out) ? 0 : -1;
    }
    /* A path that is not a directory: only a hub id (ORG/NAME or NAME) is looked up. */
    int slashes = 0;
    for (const char *c = name_or_path; *c; c++)
        slashes += *c == '/';
    if (name_or_path[0] == '/' || name_or_path[0] == '.' || name_or_path[0] == '~' || slashes > 1 ||
        !name_or_path[0]) {
        snprintf(looked, looked_len, "a local directory (none exists at that path)");
        return -1;
    }
    if (from_hub_cache(name_or_path, out, out_len, looked, looked_len) == 0)
        return 0;
    return from_shipped(name_or_path, out, out_len, looked, looked_len);
}

/* ---- close matches of a hub id -------------------------------------------------------- */

struct match {
    char id[256];
    int dist;
};

static void lower(const char *s, char *out, size_t len)
{
    size_t i = 0;
    for (; s[i] && i + 1 < len; i++)
        out[i] = (char)tolower((unsigned char)s[i]);
    out[i] = '\0';
}

/* How close candidate ORG/NAME is to the id asked for: by NAME, ignoring case; -1 when not
 * close (neither name contains the other, and more than 2 letters differ). */
static int closeness(const char *want, const char *cand)
{
    const char *w = strrchr(want, '/'), *c = strrchr(cand, '/');
    char a[256], b[256];
    lower(w ? w + 1 : want, a, sizeof(a));
    lower(c ? c + 1 : cand, b, sizeof(b));
    if (!a[0] || !b[0] || strcmp(want, cand) == 0)
        return -1;
    int cap = (int)(strlen(a) > strlen(b) ? strlen(a) : strlen(b));
    int d = am_edit_distance(a, b, cap);
    if (strstr(a, b) || strstr(b, a) || d <= 2)
        return d;
    return -1;
}

/* ORG--NAME (after prefix, before suffix) -> ORG/NAME */
static bool id_of(const char *entry, const char *prefix, const char *suffix, char *out, size_t len)
{
    size_t el = strlen(entry), pl = strlen(prefix), sl = strlen(suffix);
    if (el <= pl + sl || strncmp(entry, prefix, pl) || strcmp(entry + el - sl, suffix))
        return false;
    const char *sep = strstr(entry + pl, "--");
    size_t n = el - pl - sl;
    if (n + 1 > len)
        return false;
    if (!sep || sep >= entry + el - sl) {
        memcpy(out, entry + pl, n);
        out[n] = '\0';
        return true;
    }
    size_t org = (size_t)(sep - (entry + pl));
    snprintf(out, len, "%.*s/%.*s", (int)org, entry + pl, (int)(n - org - 2), sep + 2);
    return true;
}

static void scan(const char *dir, const char *prefix, const char *suffix, const char *want, struct match *m, int *n,
                 int max)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        char id[256];
        if (!id_of(e->d_name, prefix, suffix, id, sizeof(id)))
            continue;
        int dist = closeness(want, id);
        if (dist < 0)
            continue;
        bool dup = false;
        for (int i = 0; i < *n; i++)
            dup = dup || strcmp(m[i].id, id) == 0;
        if (dup)
            continue;
        if (*n == max)
            break;
        snprintf(m[*n].id, sizeof(m[*n].id), "%s", id);
        m[(*n)++].dist = dist;
    }
    closedir(d);
}

int am_model_similar(const char *id, char *out, size_t len)
{
    static const int max = 64;
    struct match m[64];
    int n = 0;
    char cache[1024], def[1024];
    hub_cache_dir(cache, sizeof(cache));
    scan(cache, "models--", "", id, m, &n, max);
    const char *dir = getenv("AM_MODELS_DIR");
    if (!dir || !*dir) {
        snprintf(def, sizeof(def), "%s/models", AM_PKGDATADIR);
        dir = def;
    }
    scan(dir, "", ".json", id, m, &n, max);
    for (int i = 1; i < n; i++) /* closest first; ties by name */
        for (int j = i; j > 0 && (m[j].dist < m[j - 1].dist ||
                                  (m[j].dist == m[j - 1].dist && strcmp(m[j].id, m[j - 1].id) < 0)); j--) {
            struct match t = m[j];
            m[j] = m[j - 1];
            m[j - 1] = t;
        }
    out[0] = '\0';
    for (int i = 0; i < n && i < 3; i++) {
        size_t l = strlen(out);
        snprintf(out + l, len - l, "%s%s", i ? ", " : "", m[i].id);
    }
    return n < 3 ? n : 3;
}

/* ---- JSON -> node tree --------------------------------------------------------------- */

static struct am_node *json_to_node(struct am_arena *a, json_t *j, const struct am_pos *pos, int depth)
{
    if (depth > AM_YAML_MAX_DEPTH)
        return NULL;
    struct am_node *n = am_arena_alloc(a, sizeof(*n));
    if (!n)
        return NULL;
    n->pos = *pos;
    n->kind = AM_NODE_SCALAR;
    n->plain = true;
    char num[64];
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        n->kind = AM_NODE_MAP;
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v) {
            struct am_node *c = json_to_node(a, v, pos, depth + 1);
            if (!c || am_node_append(a, n, am_arena_strdup(a, k), *pos, c) < 0)
                return NULL;
        }
        return n;
    }
    case JSON_ARRAY: {
        n->kind = AM_NODE_SEQ;
        size_t i;
        json_t *v;
        json_array_foreach(j, i, v) {
            struct am_node *c = json_to_node(a, v, pos, depth + 1);
            if (!c || am_node_append(a, n, NULL, *pos, c) < 0)
                return NULL;
        }
        return n;
    }
    case JSON_STRING:
        n->plain = false;
        n->str = am_arena_strndup(a, json_string_value(j), json_string_length(j));
        break;
    case JSON_INTEGER:
        snprintf(num, sizeof(num), "%" JSON_INTEGER_FORMAT, json_integer_value(j));
        n->str = am_arena_strdup(a, num);
        break;
    case JSON_REAL:
        snprintf(num, sizeof(num), "%.17g", json_real_value(j));
        n->str = am_arena_strdup(a, num);
        break;
    case JSON_TRUE:
        n->str = "true";
        break;
    case JSON_FALSE:
        n->str = "false";
        break;
    case JSON_NULL:
        n->str = "null";
        break;
    }
    return n->str ? n : NULL;
}

struct am_node *am_json_file_to_node(struct am_arena *a, const char *path, struct am_errors *err)
{
    size_t len;
    char *buf = NULL;
    const char *why = am_read_file(path, AM_JSON_MAX_BYTES, &buf, &len);
    if (why) {
        am_errorf(err, NULL, "%s: %s", path, why);
        return NULL;
    }
    json_error_t je;
    json_t *j = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &je);
    free(buf);
    if (!j) {
        am_errorf(err, NULL, "%s:%d:%d: invalid JSON: %s", path, je.line, je.column, je.text);
        return NULL;
    }
    struct am_pos pos = {.file = am_arena_strdup(a, path)};
    struct am_node *n = NULL;
    if (!json_is_object(j))
        am_errorf(err, NULL, "%s: expected a JSON object at the top", path);
    else if (!pos.file || !(n = json_to_node(a, j, &pos, 0)))
        am_errorf(err, NULL, "%s: too deeply nested or out of memory", path);
    json_decref(j);
    return n;
}

/* ---- reading the architecture -------------------------------------------------------- */

enum kind {
    K_LONG, K_DOUBLE, K_BOOL, K_STR, K_ACT, K_ROPE_SCALING, K_ROPE_PARAMETERS, K_CHECK_FALSE, K_CHECK_ZERO, K_MLP_ONLY,
    K_WINDOW, K_USE_WINDOW, K_MAX_WINDOW_LAYERS, K_LAYER_TYPES, K_QUANT, K_IGNORE, K_DOUBLE_NULL, K_HIDDEN_ACTIVATION,
    K_BIDIRECTIONAL, K_WINDOW_PATTERN, K_ATTENTION_BIAS, K_MTP, K_MOE_OVERRIDES, K_DSV3_ONLY, K_GPT_OSS_ONLY
};

/* The sliding-window keys as written, resolved per model type once all keys are read. */
struct window_keys {
    long sliding_window; /* 0 for null */
    bool sliding_window_given, use_sliding_window;
    long max_window_layers; /* -1: not given */
    struct am_node *sliding_window_node, *layer_types;
    struct am_node *mlp_only_layers;
    bool qwen2; /* the model is a qwen2 (known before the keys are read): Qwen2Config reads neither
                   attention_bias nor mlp_bias (its q, k, v always have biases, o and the MLP never) */
    bool gemma;                                      /* the model type, known before the keys: gemma2 or gemma3_text */
    long window_pattern;                             /* gemma3_text's sliding_window_pattern; 0: not given */
    bool glm;                                        /* the model type, known before the keys: glm4_moe */
    bool attention_bias;                             /* glm4_moe: q, k and v with biases (o never) */
    bool use_qk_norm;                                /* glm4_moe: q/k norms */
    bool dsv3;                                       /* the model type, known before the keys: deepseek_v3 */
    bool gpt_oss;                                    /* the model type, known before the keys: gpt_oss */
    bool qwen3_moe;                                  /* the model type, known before the keys: qwen3_moe */
    bool rope_given;                                 /* rope_scaling or rope_parameters written (not null) */
    long moe_layer_freq;                             /* deepseek_v3: as written (1 when absent) */
    struct am_node *moe_layer_freq_node, *topk_method, *scoring_func;
};

struct hf_key {
    const char *name;
    enum kind kind;
    size_t off;
};

#define F(field) offsetof(struct am_model_config, field)
static const struct hf_key hf_keys[] = {
    {"model_type", K_STR, F(model_type)},
    {"hidden_size", K_LONG, F(hidden_size)},
    {"num_hidden_layers", K_LONG, F(num_hidden_layers)},
    {"num_attention_heads", K_LONG, F(num_attention_heads)},
    {"num_key_value_heads", K_LONG, F(num_key_value_heads)},
    {"head_dim", K_LONG, F(head_dim)},
    {"intermediate_size", K_LONG, F(intermediate_size)},
    {"vocab_size", K_LONG, F(vocab_size)},
    {"max_position_embeddings", K_LONG, F(max_position_embeddings)},
    {"rope_theta", K_DOUBLE, F(rope_theta)},
    {"rms_norm_eps", K_DOUBLE, F(rms_norm_eps)},
    {"initializer_range", K_DOUBLE, F(initializer_range)},
    {"tie_word_embeddings", K_BOOL, F(tie_word_embeddings)},
    {"num_local_experts", K_LONG, F(num_experts)}, /* mixtral */
    {"num_experts", K_LONG, F(num_experts)},       /* qwen3_moe */
    {"num_experts_per_tok", K_LONG, F(num_experts_per_tok)},
    {"moe_intermediate_size", K_LONG, F(moe_intermediate_size)},
    {"norm_topk_prob", K_BOOL, F(norm_topk_prob)},
    {"router_aux_loss_coef", K_DOUBLE, F(router_aux_loss_coef)},
    {"output_router_logits", K_BOOL, F(output_router_logits)},
    {"decoder_sparse_step", K_LONG, F(decoder_sparse_step)},
    {"mlp_only_layers", K_MLP_ONLY, 0},
    {"rope_scaling", K_ROPE_SCALING, 0},
    {"rope_parameters", K_ROPE_PARAMETERS, 0}, /* transformers 5: rope_theta and the scaling together */
    {"torch_dtype", K_STR, F(torch_dtype)},
    {"dtype", K_STR, F(torch_dtype)}, /* transformers 5's name for torch_dtype */
    {"hidden_act", K_ACT, 0},
    {"hidden_activation", K_HIDDEN_ACTIVATION, 0}, /* gemma2, gemma3_text: the MLP's activation */
    {"query_pre_attn_scalar", K_DOUBLE, F(query_pre_attn_scalar)},
    {"attn_logit_softcapping", K_DOUBLE_NULL, F(attn_logit_softcapping)},
    {"final_logit_softcapping", K_DOUBLE_NULL, F(final_logit_softcapping)},
    {"rope_local_base_freq", K_DOUBLE, F(rope_local_base_freq)},
    {"use_bidirectional_attention", K_BIDIRECTIONAL, 0},
    {"sliding_window_pattern", K_WINDOW_PATTERN, 0},
    {"attention_bias", K_ATTENTION_BIAS, 0},
    /* glm4_moe */
    {"partial_rotary_factor", K_DOUBLE, F(partial_rotary_factor)},
    {"use_qk_norm", K_BOOL, 0},
    {"n_routed_experts", K_LONG, F(num_experts)},
    {"n_shared_experts", K_LONG, F(n_shared_experts)},
    {"n_group", K_LONG, F(n_group)},
    {"topk_group", K_LONG, F(topk_group)},
    {"routed_scaling_factor", K_DOUBLE, F(routed_scaling_factor)},
    {"first_k_dense_replace", K_LONG, F(first_k_dense_replace)},
    {"num_nextn_predict_layers", K_MTP, 0},
    /* deepseek_v3: multi-head latent attention, and DeepSeekMoE's keys that transformers does not read */
    {"q_lora_rank", K_LONG, F(q_lora_rank)},
    {"kv_lora_rank", K_LONG, F(kv_lora_rank)},
    {"qk_nope_head_dim", K_LONG, F(qk_nope_head_dim)},
    {"qk_rope_head_dim", K_LONG, F(qk_rope_head_dim)},
    {"v_head_dim", K_LONG, F(v_head_dim)},
    {"rope_interleave", K_BOOL, F(rope_interleave)},
    {"moe_layer_freq", K_DSV3_ONLY, 0},
    {"topk_method", K_DSV3_ONLY, 0},
    {"scoring_func", K_DSV3_ONLY, 0},
    {"ep_size", K_IGNORE, 0},      /* DeepSeek's own modelling code's expert-parallel size: a layout, not the model */
    {"aux_loss_alpha", K_IGNORE, 0}, /* read by DeepSeek's code only in training with seq_aux; transformers and
                                        AutoModel's deepseek_v3 compute no such loss */
    {"seq_aux", K_IGNORE, 0},
    {"num_mtp_layers", K_MTP, 0},
    /* gpt_oss */
    {"swiglu_limit", K_GPT_OSS_ONLY, F(swiglu_limit)},
    {"swiglu_alpha", K_GPT_OSS_ONLY, F(swiglu_alpha)},
    {"experts_per_token", K_IGNORE, 0},      /* gpt-oss's own code's name: GptOssConfig reads num_experts_per_tok */
    {"initial_context_length", K_IGNORE, 0}, /* gpt-oss's own code's: transformers reads rope_scaling's
                                                original_max_position_embeddings */
    {"moe_overrides", K_MOE_OVERRIDES, 0}, /* AutoModel's MoEConfig fields for its own MoE models */
    {"moe_config", K_MOE_OVERRIDES, 0},
    {"mlp_bias", K_CHECK_FALSE, 0},
    {"attention_dropout", K_CHECK_ZERO, 0},
    {"sliding_window", K_WINDOW, 0},
    {"use_sliding_window", K_USE_WINDOW, 0},
    {"max_window_layers", K_MAX_WINDOW_LAYERS, 0},
    {"layer_types", K_LAYER_TYPES, 0},
    {"quantization_config", K_QUANT, 0},
    /* config.json keys that do not change the architecture am builds */
    {"architectures", K_IGNORE, 0},
    {"bos_token_id", K_IGNORE, 0},
    {"eos_token_id", K_IGNORE, 0},
    {"pad_token_id", K_IGNORE, 0},
    {"transformers_version", K_IGNORE, 0},
    {"use_cache", K_IGNORE, 0},
    {"pretraining_tp", K_IGNORE, 0},
    {"router_jitter_noise", K_IGNORE, 0},
    {"_name_or_path", K_IGNORE, 0},
    {"cache_implementation", K_IGNORE, 0},
};
#undef F

#define AM_SUPPORTED_TYPES                                                                                             \
    "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, glm4_moe, deepseek_v3, gpt_oss"
static const char *const supported_types[] = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text",
                                              "glm4_moe", "deepseek_v3", "gpt_oss", NULL};

bool am_model_type_supported(const char *t)
{
    for (int i = 0; supported_types[i]; i++)
        if (strcmp(t, supported_types[i]) == 0)
            return true;
    return false;
}

static const struct hf_key *find_key(const char *name)
{
    for (size_t i = 0; i < sizeof(hf_keys) / sizeof(hf_keys[0]); i++)
        if (strcmp(hf_keys[i].name, name) == 0)
            return &hf_keys[i];
    return NULL;
}

static int read_rope_scaling(struct am_node *n, const char *section, struct am_model_config *m,
                             struct am_errors *err)
{
    char key[128];
    if (am_node_is_null(n)) {
        m->rope_scaling.type = NULL;
        return 0;
    }
    if (n->kind != AM_NODE_MAP) {
        am_errorf(err, &n->pos, "%s.rope_scaling: expected a section (rope_type, factor, ...) or null", section);
        return -1;
    }
    struct am_node *t = am_node_child(n, "rope_type");
    if (!t)
        t = am_node_child(n, "type");
    const char *type = NULL;
    snprintf(key, sizeof(key), "%s.rope_scaling.rope_type", section);
    if (!t || am_node_str(t, key, &type, err) < 0) {
        if (!t)
            am_errorf(err, &n->pos, "%s: missing (llama3, linear or yarn)", key);
        return -1;
    }
    if (strcmp(type, "default") == 0) {
        m->rope_scaling.type = NULL;
        return 0;
    }
    bool yarn = strcmp(type, "yarn") == 0;
    if (strcmp(type, "llama3") != 0 && strcmp(type, "linear") != 0 && !yarn) {
        am_errorf(err, &t->pos, "%s: '%s' is not supported by am (use llama3, linear or yarn)", key, type);
        return -1;
    }
    m->rope_scaling.type = type;
    m->rope_scaling.beta_fast = m->rope_scaling.beta_slow = m->rope_scaling.attention_factor = 0; /* absent */
    m->rope_scaling.mscale = m->rope_scaling.mscale_all_dim = 0;
    m->rope_scaling.no_truncate = false;
    struct {
        const char *name;
        double *d;
        long *l;
        bool yarn; /* yarn's alone (optional: absent or null, transformers' default) */
    } fields[] = {
        {"factor", &m->rope_scaling.factor, NULL, false},
        {"low_freq_factor", &m->rope_scaling.low_freq_factor, NULL, false},
        {"high_freq_factor", &m->rope_scaling.high_freq_factor, NULL, false},
        {"original_max_position_embeddings", NULL, &m->rope_scaling.original_max_position_embeddings, false},
        {"beta_fast", &m->rope_scaling.beta_fast, NULL, true},
        {"beta_slow", &m->rope_scaling.beta_slow, NULL, true},
        {"attention_factor", &m->rope_scaling.attention_factor, NULL, true},
        {"mscale", &m->rope_scaling.mscale, NULL, true},
        {"mscale_all_dim", &m->rope_scaling.mscale_all_dim, NULL, true},
    };
    int rc = 0;
    if (yarn) { /* truncate: true unless false (transformers' rope_parameters.get("truncate", True)) */
        struct am_node *tr = am_node_child(n, "truncate");
        bool b = true;
        snprintf(key, sizeof(key), "%s.rope_scaling.truncate", section);
        if (tr && !am_node_is_null(tr) && am_node_bool(tr, key, &b, err) < 0)
            rc = -1;
        m->rope_scaling.no_truncate = !b;
    }
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        struct am_node *v = am_node_child(n, fields[i].name);
        snprintf(key, sizeof(key), "%s.rope_scaling.%s", section, fields[i].name);
        bool needed = fields[i].d == &m->rope_scaling.factor || strcmp(type, "llama3") == 0 ||
                      (yarn && fields[i].l == &m->rope_scaling.original_max_position_embeddings);
        if (fields[i].yarn && (!yarn || (v && am_node_is_null(v))))
            continue;
        if (!v) {
            if (needed) {
                am_errorf(err, &n->pos, "%s: missing (required for rope_type %s)", key, type);
                rc = -1;
            }
            continue;
        }
        if (fields[i].d ? am_node_double(v, key, fields[i].d, err) : am_node_long(v, key, 1, LONG_MAX, fields[i].l, err))
            rc = -1;
    }
    if (rc == 0 && yarn && !(m->rope_scaling.factor > 0)) {
        am_errorf(err, &n->pos, "%s.rope_scaling.factor: %g; yarn needs a factor > 0", section, m->rope_scaling.factor);
        rc = -1;
    }
    return rc;
}

/* quantization_config: an FP8 checkpoint as DeepSeek-V3 and Kimi ship it (quant_method fp8,
 * fmt e4m3, weight_block_size [b0, b1]: runtime/ckpt/quant.h) is dequantised at load; any other
 * quantisation is refused. modules_to_not_convert is read but not needed: a tensor stored in
 * F8_E4M3 is dequantised, any other loads as it is. activation_scheme concerns FP8 inference
 * (the activations' scales), not the weights am trains. */
static int read_quant(struct am_node *v, const char *key, struct am_model_config *m, bool gpt_oss,
                      struct am_errors *err)
{
    m->fp8 = m->mxfp4 = false;
    if (am_node_is_null(v))
        return 0;
    struct am_node *method = v->kind == AM_NODE_MAP ? am_node_child(v, "quant_method") : NULL;
    bool fp8 = method && method->kind == AM_NODE_SCALAR && strcmp(method->str, "fp8") == 0;
    if (method && method->kind == AM_NODE_SCALAR && strcmp(method->str, "mxfp4") == 0) {
        /* gpt-oss's: its experts' `*_blocks` and `*_scales` dequantised at load; the other tensors
         * (modules_to_not_convert) load as they are stored */
        if (!gpt_oss) {
            am_errorf(err, &method->pos, "%s.quant_method: mxfp4 is dequantized by am for gpt_oss's experts only "
                      "(their *_blocks and *_scales): use the unquantized model", key);
            return -1;
        }
        m->mxfp4 = true;
        return 0;
    }
    if (!fp8) {
        am_errorf(err, &v->pos, "%s: a quantized checkpoint%s%.40s%s is not supported: am trains bf16 or fp32 "
                  "weights and dequantizes only FP8 checkpoints (quant_method fp8, fmt e4m3, as DeepSeek-V3's); "
                  "use the unquantized model", key,
                  method && method->kind == AM_NODE_SCALAR ? " (quant_method " : "",
                  method && method->kind == AM_NODE_SCALAR ? method->str : "",
                  method && method->kind == AM_NODE_SCALAR ? ")" : "");
        return -1;
    }
    char sub[160];
    struct am_node *fmt = am_node_child(v, "fmt");
    const char *f = "e4m3";
    snprintf(sub, sizeof(sub), "%s.fmt", key);
    if (fmt && !am_node_is_null(fmt) && am_node_str(fmt, sub, &f, err) < 0)
        return -1;
    if (strcmp(f, "e4m3") != 0) {
        am_errorf(err, &fmt->pos, "%s: '%s' is not supported: am dequantizes FP8 checkpoints in e4m3 (F8_E4M3 "
                  "weights with one fp32 weight_scale_inv per block, as DeepSeek-V3 and Kimi ship them); "
                  "use such a checkpoint or the unquantized model", sub, f);
        return -1;
    }
    struct am_node *bs = am_node_child(v, "weight_block_size");
    snprintf(sub, sizeof(sub), "%s.weight_block_size", key);
    m->fp8_block[0] = m->fp8_block[1] = 128; /* transformers' FineGrainedFP8Config default */
    if (bs && am_node_is_null(bs)) {
        am_errorf(err, &bs->pos, "%s: null (one scale per tensor) is not supported: am dequantizes FP8 weights "
                  "with one scale per block, [rows, columns] (DeepSeek-V3's [128, 128])", sub);
        return -1;
    }
    if (bs && (bs->kind != AM_NODE_SEQ || bs->n != 2)) {
        am_errorf(err, &bs->pos, "%s: expected [rows, columns], the block of one scale (DeepSeek-V3's [128, 128])",
                  sub);
        return -1;
    }
    for (size_t i = 0; bs && i < 2; i++)
        if (am_node_long(bs->entries[i].value, sub, 1, 1L << 30, &m->fp8_block[i], err) < 0)
            return -1;
    struct am_node *skip = am_node_child(v, "modules_to_not_convert");
    snprintf(sub, sizeof(sub), "%s.modules_to_not_convert", key);
    if (skip && !am_node_is_null(skip)) {
        const char *name;
        if (skip->kind != AM_NODE_SEQ) {
            am_errorf(err, &skip->pos, "%s: expected a list of module names", sub);
            return -1;
        }
        for (size_t i = 0; i < skip->n; i++)
            if (am_node_str(skip->entries[i].value, sub, &name, err) < 0)
                return -1;
    }
    m->fp8 = true;
    return 0;
}

static int read_key(const struct hf_key *k, struct am_node *v, const char *section,
                    struct am_model_config *m, struct window_keys *w, struct am_errors *err)
{
    char key[128];
    snprintf(key, sizeof(key), "%s.%s", section, k->name);
    char *base = (char *)m;
    bool b;
    if (v->failed)
        return -1;
    switch (k->kind) {
    case K_LONG:
        if (am_node_is_null(v))
            return *(long *)(base + k->off) = 0, 0;
        return am_node_long(v, key, 0, 1L << 40, (long *)(base + k->off), err);
    case K_DOUBLE:
        return am_node_double(v, key, (double *)(base + k->off), err);
    case K_BOOL:
        if (strcmp(k->name, "use_qk_norm") == 0) /* glm4_moe's; resolved with the model type */
            return am_node_is_null(v) ? 0 : am_node_bool(v, key, &w->use_qk_norm, err);
        return am_node_bool(v, key, (bool *)(base + k->off), err);
    case K_ATTENTION_BIAS: /* glm4_moe: q, k, v biases; qwen2 reads none (always biased); others have none */
        if (w->qwen2)
            return 0;
        if (w->glm || w->gpt_oss) /* glm4_moe: q, k, v; gpt_oss: q, k, v and o */
            return am_node_is_null(v) ? 0 : am_node_bool(v, key, &w->attention_bias, err);
        if (am_node_bool(v, key, &b, err) < 0)
            return -1;
        if (b) {
            am_errorf(err, &v->pos, "%s: true is not supported by am (its layers have no bias terms: train a model "
                      "without them, %s false)", key, k->name);
            return -1;
        }
        return 0;
    case K_MOE_OVERRIDES: { /* AutoModel's MoEConfig: what am computes is transformers' MoE, so of its
                               training rules it takes deepseek_v3's selection-bias update and the
                               load-balancing loss of the MoEs AutoModel builds its own gate for, and
                               leaves the others at 0 */
        if (am_node_is_null(v))
            return 0;
        if (v->kind != AM_NODE_MAP) {
            am_errorf(err, &v->pos, "%s: expected a section (AutoModel's MoEConfig fields)", key);
            return -1;
        }
        int rc = 0;
        for (size_t i = 0; i < v->n; i++) {
            struct am_entry *f = &v->entries[i];
            char sub[192];
            double d;
            snprintf(sub, sizeof(sub), "%s.%s", key, f->key);
            bool bias = strcmp(f->key, "gate_bias_update_factor") == 0, aux = strcmp(f->key, "aux_loss_coeff") == 0;
            if (w->dsv3 && strcmp(f->key, "force_e_score_correction_bias") == 0) { /* the bias without an update */
                if (am_node_bool(f->value, sub, &m->bias_forced, err) < 0)
                    rc = -1;
                continue;
            }
            if (!bias && !aux) {
                am_errorf(err, &f->key_pos, "%s: not read by am (it trains the MoE transformers' class computes; of "
                          "AutoModel's MoEConfig it takes gate_bias_update_factor (deepseek_v3) and aux_loss_coeff): "
                          "remove it", sub);
                rc = -1;
            } else if (am_node_double(f->value, sub, &d, err) < 0) {
                rc = -1;
            } else if (bias && w->dsv3 && d >= 0.0) { /* AutoModel's deepseek_v3: its Gate.update_bias */
                m->gate_bias_update_factor = d;
                m->bias_update_set = true;
            } else if (aux && (w->dsv3 || w->glm || w->gpt_oss || w->qwen3_moe)) { /* its Gate: on above 0 */
                m->aux_loss_coeff = d > 0.0 ? d : 0.0;
                m->aux_loss_set = true;
            } else if (bias && w->dsv3) {
                am_errorf(err, &f->value->pos, "%s: %g is not supported by am: AutoModel updates the selection bias "
                          "when the factor is above 0 and never otherwise (set it to 0 or above)", sub, d);
                rc = -1;
            } else if (d != 0.0) {
                am_errorf(err, &f->value->pos, "%s: %g is not supported by am: %s (set it to 0)", sub, d,
                          bias ? "it does not update the experts' selection bias (e_score_correction_bias) in "
                                 "training; AutoModel's glm4_moe does not either (its model has no "
                                 "update_moe_gate_bias, which the train loop calls)"
                : "AutoModel's load-balancing loss is not computed by am for this model (AutoModel builds no gate "
                  "of its own for it; am computes transformers' own: output_router_logits and router_aux_loss_coef)");
                rc = -1;
            }
        }
        return rc;
    }
    case K_MTP: /* multi-token prediction modules: not part of the causal LM transformers and AutoModel train */
        if (am_node_is_null(v))
            return 0;
        {
            long n;
            return am_node_long(v, key, 0, 1L << 20, &n, err);
        }
    case K_ACT: /* the MLP's activation as transformers reads it: hidden_act (silu) for the Llama family; */
    case K_HIDDEN_ACTIVATION: { /* hidden_activation (gelu_pytorch_tanh) for Gemma, which never reads hidden_act */
        const char *s;
        if ((k->kind == K_ACT) == w->gemma) /* the key the model does not read */
            return am_node_is_null(v) || v->kind == AM_NODE_SCALAR ? 0 : am_node_str(v, key, &s, err);
        if (am_node_str(v, key, &s, err) < 0)
            return -1;
        if (w->gemma && strcmp(s, "gelu_pytorch_tanh") != 0) {
            am_errorf(err, &v->pos, "%s: '%s' is not supported by am (Gemma's MLP is GeGLU with gelu_pytorch_tanh, "
                      "the tanh approximation: set it to gelu_pytorch_tanh)", key, s);
            return -1;
        }
        if (!w->gemma && strcmp(s, "silu") != 0) {
            am_errorf(err, &v->pos, "%s: '%s' is not supported by am (Llama-style models use silu)", key, s);
            return -1;
        }
        return 0;
    }
    case K_DOUBLE_NULL:
        if (am_node_is_null(v))
            return *(double *)(base + k->off) = 0.0, 0;
        return am_node_double(v, key, (double *)(base + k->off), err);
    case K_BIDIRECTIONAL:
        if (am_node_is_null(v))
            return 0;
        if (am_node_bool(v, key, &b, err) < 0)
            return -1;
        if (b) {
            am_errorf(err, &v->pos, "%s: true is not supported by am (it trains causal language models; bidirectional "
                      "attention is Gemma's embedding variant): set it to false, or leave it out", key);
            return -1;
        }
        return 0;
    case K_WINDOW_PATTERN:
        if (am_node_is_null(v))
            return 0;
        return am_node_long(v, key, 1, 1L << 40, &w->window_pattern, err);
    case K_STR:
        if (am_node_is_null(v))
            return 0;
        return am_node_str(v, key, (const char **)(base + k->off), err);
    case K_ROPE_SCALING:
        w->rope_given |= !am_node_is_null(v);
        return read_rope_scaling(v, section, m, err);
    case K_ROPE_PARAMETERS: {
        w->rope_given |= !am_node_is_null(v);
        struct am_node *full = am_node_child(v, "full_attention"), *sliding = am_node_child(v, "sliding_attention");
        if (full || sliding) { /* Gemma 3: one set per attention type */
            if (sliding) {
                struct am_node *st = am_node_child(sliding, "rope_type"), *sth = am_node_child(sliding, "rope_theta");
                snprintf(key, sizeof(key), "%s.rope_parameters.sliding_attention.rope_type", section);
                if (st && st->kind == AM_NODE_SCALAR && strcmp(st->str, "default") != 0) {
                    am_errorf(err, &st->pos, "%s: '%s' is not supported by am (the sliding layers' rope is unscaled in "
                              "Gemma 3: use default)", key, st->str);
                    return -1;
                }
                snprintf(key, sizeof(key), "%s.rope_parameters.sliding_attention.rope_theta", section);
                if (sth && am_node_double(sth, key, &m->rope_local_base_freq, err) < 0)
                    return -1;
            }
            if (!full)
                return 0;
            struct am_node *ft = am_node_child(full, "rope_theta");
            snprintf(key, sizeof(key), "%s.rope_parameters.full_attention.rope_theta", section);
            if (ft && am_node_double(ft, key, &m->rope_theta, err) < 0)
                return -1;
            return read_rope_scaling(full, section, m, err);
        }
        struct am_node *theta = am_node_child(v, "rope_theta"), *prf = am_node_child(v, "partial_rotary_factor");
        snprintf(key, sizeof(key), "%s.rope_parameters.rope_theta", section);
        if (theta && am_node_double(theta, key, &m->rope_theta, err) < 0)
            return -1;
        snprintf(key, sizeof(key), "%s.rope_parameters.partial_rotary_factor", section);
        if (prf && !am_node_is_null(prf) && am_node_double(prf, key, &m->partial_rotary_factor, err) < 0)
            return -1;
        return read_rope_scaling(v, section, m, err);
    }
    case K_CHECK_FALSE:
        if (w->qwen2 && (strcmp(k->name, "attention_bias") == 0 || strcmp(k->name, "mlp_bias") == 0))
            return 0; /* not read by transformers for qwen2 */
        if (am_node_bool(v, key, &b, err) < 0)
            return -1;
        if (b) {
            am_errorf(err, &v->pos, "%s: true is not supported by am (its layers have no bias terms: train a model "
                      "without them, %s false)", key, k->name);
            return -1;
        }
        return 0;
    case K_CHECK_ZERO: {
        double d;
        if (am_node_double(v, key, &d, err) < 0)
            return -1;
        if (d != 0.0) {
            am_errorf(err, &v->pos, "%s: %g is not supported by am (it trains without dropout: set it to 0.0)", key,
                      d);
            return -1;
        }
        return 0;
    }
    case K_WINDOW:
        w->sliding_window_given = true;
        w->sliding_window_node = v;
        if (am_node_is_null(v))
            return w->sliding_window = 0, 0;
        return am_node_long(v, key, 1, 1L << 40, &w->sliding_window, err);
    case K_USE_WINDOW:
        return am_node_bool(v, key, &w->use_sliding_window, err);
    case K_MAX_WINDOW_LAYERS:
        return am_node_long(v, key, 0, 1L << 40, &w->max_window_layers, err);
    case K_LAYER_TYPES:
        if (!am_node_is_null(v))
            w->layer_types = v;
        return 0;
    case K_MLP_ONLY:
        if (!am_node_is_null(v))
            w->mlp_only_layers = v;
        return 0;
    case K_QUANT:
        return read_quant(v, key, m, w->gpt_oss, err);
    case K_DSV3_ONLY: /* resolved with the model type (dsv3_checks) */
        if (strcmp(k->name, "moe_layer_freq") == 0) {
            w->moe_layer_freq_node = v;
            return am_node_is_null(v) ? 0 : am_node_long(v, key, 1, 1L << 20, &w->moe_layer_freq, err);
        }
        if (!am_node_is_null(v))
            *(strcmp(k->name, "topk_method") == 0 ? &w->topk_method : &w->scoring_func) = v;
        return 0;
    case K_GPT_OSS_ONLY: /* the experts' clamped SwiGLU: gpt_oss's alone */
        if (!w->gpt_oss) {
            am_errorf(err, &v->pos, "%s: gpt_oss's (its experts' clamped SwiGLU); a model of another type has none: "
                      "remove it", key);
            return -1;
        }
        if (am_node_double(v, key, (double *)(base + k->off), err) < 0)
            return -1;
        if (!(*(double *)(base + k->off) > 0)) {
            am_errorf(err, &v->pos, "%s: %g; it must be > 0", key, *(double *)(base + k->off));
            return -1;
        }
        return 0;
    case K_IGNORE:
        return 0;
    }
    return 0;
}

/* qwen3_moe's dense layers (Qwen3MoeDecoderLayer): layer l has experts when it is not in
 * mlp_only_layers and (l + 1) % decoder_sparse_step == 0 (default 1: every layer); mixtral's
 * layers all have experts (MixtralConfig has neither key). */
static void resolve_dense_layers(const struct window_keys *w, const struct am_pos *where, const char *section,
                                 struct am_model_config *m, struct am_errors *err)
{
    memset(m->dense_layers, 0, sizeof(m->dense_layers));
    if (m->sigmoid_router) { /* glm4_moe, deepseek_v3: the first first_k_dense_replace layers are dense */
        m->decoder_sparse_step = 1;
        for (long l = 0; l < m->first_k_dense_replace && l < m->num_hidden_layers && l < AM_MAX_WINDOW_LAYERS; l++)
            m->dense_layers[l / 64] |= (uint64_t)1 << (l % 64);
        return;
    }
    if (strcmp(m->model_type, "qwen3_moe") != 0) {
        m->decoder_sparse_step = 1;
        return;
    }
    if (m->decoder_sparse_step <= 0)
        m->decoder_sparse_step = 1;
    if (m->num_hidden_layers > AM_MAX_WINDOW_LAYERS) {
        am_errorf(err, where, "%s.num_hidden_layers: %ld; am builds mixture-of-experts models of up to %d layers",
                  section, m->num_hidden_layers, AM_MAX_WINDOW_LAYERS);
        return;
    }
    for (long l = 0; l < m->num_hidden_layers; l++)
        if ((l + 1) % m->decoder_sparse_step)
            m->dense_layers[l / 64] |= (uint64_t)1 << (l % 64);
    struct am_node *ml = w->mlp_only_layers;
    if (!ml)
        return;
    if (ml->kind != AM_NODE_SEQ) {
        am_errorf(err, &ml->pos, "%s.mlp_only_layers: expected a list of layer indices", section);
        return;
    }
    for (size_t i = 0; i < ml->n; i++) {
        char key[128];
        long l;
        snprintf(key, sizeof(key), "%s.mlp_only_layers[%zu]", section, i);
        if (am_node_long(ml->entries[i].value, key, 0, m->num_hidden_layers - 1, &l, err) < 0)
            continue;
        m->dense_layers[l / 64] |= (uint64_t)1 << (l % 64);
    }
}

bool am_model_layer_is_moe(const struct am_model_config *m, long l)
{
    if (m->num_experts <= 0 || l < 0 || l >= m->num_hidden_layers)
        return false;
    return l >= AM_MAX_WINDOW_LAYERS || !((m->dense_layers[l / 64] >> (l % 64)) & 1);
}

long am_model_layer_mlp_width(const struct am_model_config *m, long l)
{
    if (!am_model_layer_is_moe(m, l))
        return m->intermediate_size;
    return m->n_shared_experts > 0 ? m->n_shared_experts * m->moe_intermediate_size : 0;
}

long am_model_moe_layers(const struct am_model_config *m)
{
    long n = 0;
    for (long l = 0; l < m->num_hidden_layers; l++)
        n += am_model_layer_is_moe(m, l);
    return n;
}

static void set_window_layer(struct am_model_config *m, long l) { m->window_layers[l / 64] |= (uint64_t)1 << (l % 64); }

/* The sliding window as transformers 5 builds each model type's attention:
 *   mistral, mixtral: sliding_window on every layer (MistralConfig's default 4096 when the key
 *     is absent, MixtralConfig's null); layer_types is not read (MistralModel ignores it);
 *   qwen2, qwen3: sliding_window (default 4096) only when use_sliding_window, on the layers that
 *     layer_types marks "sliding_attention", by default layers max_window_layers (default 28)
 *     and up (Qwen3Config); a layer marked sliding without a window fails in transformers;
 *   qwen3_moe: sliding_window on every layer when use_sliding_window;
 *   gpt_oss: sliding_window (default 128) on the layers layer_types marks sliding_attention, by
 *     default every other layer from layer 0 (GptOssConfig's), as Gemma 2's;
 *   llama: no sliding window in LlamaAttention: a window given is refused, not ignored.
 * The mask is kv_idx > q_idx - sliding_window with the causal kv_idx <= q_idx. */
static void resolve_windows(const struct window_keys *w, const struct am_pos *where, const char *section,
                            struct am_model_config *m, struct am_errors *err)
{
    const char *t = m->model_type;
    const struct am_pos *wpos = w->sliding_window_node ? &w->sliding_window_node->pos : where;
    /* qwen2 resolves its windows as qwen3 does (Qwen2Config's keys and defaults are Qwen3Config's) */
    bool qwen3 = strcmp(t, "qwen3") == 0 || strcmp(t, "qwen2") == 0, qwen3_moe = strcmp(t, "qwen3_moe") == 0;
    long window = 0;
    memset(m->window_layers, 0, sizeof(m->window_layers));
    bool gemma = m->gemma, gemma3 = strcmp(t, "gemma3_text") == 0, gpt_oss = m->gpt_oss;
    if (gpt_oss) /* GptOssConfig: 128 */
        window = w->sliding_window_given ? w->sliding_window : 128;
    else if (strcmp(t, "mistral") == 0 || strcmp(t, "mixtral") == 0)
        window = w->sliding_window_given ? w->sliding_window : strcmp(t, "mistral") == 0 ? 4096 : 0;
    else if (gemma) /* Gemma2Config, Gemma3TextConfig: 4096 */
        window = w->sliding_window_given ? w->sliding_window : 4096;
    else if (qwen3 || qwen3_moe)
        window = !w->use_sliding_window ? 0 : w->sliding_window_given ? w->sliding_window : 4096;
    else if (w->sliding_window_given && w->sliding_window > 0) {
        am_errorf(err, wpos, "%s.sliding_window: %ld, but a %s model has no sliding window (transformers would "
                  "attend to every earlier token): remove it, or use model_type mistral for sliding-window attention",
                  section, w->sliding_window, t);
        return;
    }
    m->sliding_window = 0;
    struct am_node *lt = qwen3 || gemma || gpt_oss ? w->layer_types : NULL;
    if (lt) {
        if (lt->kind != AM_NODE_SEQ || (long)lt->n != m->num_hidden_layers) {
            am_errorf(err, &lt->pos, "%s.layer_types: expected a list of %ld entries (one per layer: "
                      "full_attention or sliding_attention)", section, m->num_hidden_layers);
            return;
        }
        for (size_t l = 0; l < lt->n; l++) {
            struct am_node *e = lt->entries[l].value;
            const char *s = e->kind == AM_NODE_SCALAR ? e->str : "";
            if (strcmp(s, "full_attention") == 0 || strcmp(s, "attention") == 0)
                continue;
            if (strcmp(s, "sliding_attention") != 0) {
                am_errorf(err, &e->pos, "%s.layer_types[%zu]: '%s' is not an attention am runs (use full_attention "
                          "or sliding_attention)", section, l, s);
                return;
            }
            if (window <= 0) {
                am_errorf(err, &e->pos, "%s.layer_types[%zu]: sliding_attention, but no sliding window is set "
                          "(transformers refuses it too): set use_sliding_window true and sliding_window, or make the "
                          "layer full_attention", section, l);
                return;
            }
            if (l >= AM_MAX_WINDOW_LAYERS) {
                am_errorf(err, &e->pos, "%s.layer_types[%zu]: am supports sliding windows on the first %d layers",
                          section, l, AM_MAX_WINDOW_LAYERS);
                return;
            }
            set_window_layer(m, (long)l);
        }
    } else if (gemma || gpt_oss) { /* the default layer_types: every 2nd layer full (Gemma 2, gpt-oss), every
                                      pattern-th (Gemma 3) */
        long pattern = gemma3 ? (w->window_pattern > 0 ? w->window_pattern : 6) : 2;
        for (long l = 0; l < m->num_hidden_layers; l++) {
            if (!((l + 1) % pattern))
                continue;
            if (window <= 0) {
                am_errorf(err, wpos, "%s.sliding_window: null, but layer %ld is a sliding_attention layer (%s's "
                          "default layer_types): set sliding_window, or give layer_types", section, l,
                          gpt_oss ? "gpt-oss" : "Gemma");
                return;
            }
            if (l >= AM_MAX_WINDOW_LAYERS) {
                am_errorf(err, wpos, "%s.sliding_window: am supports sliding windows on the first %d layers (the model "
                          "has %ld)", section, AM_MAX_WINDOW_LAYERS, m->num_hidden_layers);
                return;
            }
            set_window_layer(m, l);
        }
    } else if (window > 0) {
        long from = qwen3 ? (w->max_window_layers >= 0 ? w->max_window_layers : 28) : 0;
        for (long l = from; l < m->num_hidden_layers; l++) {
            if (l >= AM_MAX_WINDOW_LAYERS) {
                am_errorf(err, wpos, "%s.sliding_window: am supports sliding windows on the first %d layers (the model "
                          "has %ld)", section, AM_MAX_WINDOW_LAYERS, m->num_hidden_layers);
                return;
            }
            set_window_layer(m, l);
        }
    }
    for (long l = 0; l < m->num_hidden_layers && l < AM_MAX_WINDOW_LAYERS; l++)
        if ((m->window_layers[l / 64] >> (l % 64)) & 1)
            m->sliding_window = window;
}

/* The model-level keys AutoModel passes to from_pretrained that do not describe the
 * architecture: accepted in a recipe, listed as ignored. */
static const char *const automodel_model_keys[] = {
    "_target_", "trust_remote_code", "attn_implementation", "use_liger_kernel", "use_sdpa_patching",
    "sdpa_method", "output_hidden_states", "is_meta_device", "force_hf", "backend", "name_or_path",
    "_attn_implementation", "cache_dir", "revision", "local_files_only", "low_cpu_mem_usage", "text_config", NULL};

/* model.backend: AutoModel's kernel choices for its own models (attention, linear, experts,
 * dispatcher: how, not what; ignored), but for the three that change what is computed. */
static void check_backend(struct am_node *backend, const char *section, struct am_errors *err)
{
    for (size_t i = 0; backend && backend->kind == AM_NODE_MAP && i < backend->n; i++) {
        const struct am_entry *e = &backend->entries[i];
        bool on = false;
        if (strcmp(e->key, "te_fp8") == 0 && !am_node_is_null(e->value))
            am_errorf(err, &e->key_pos, "%s.backend.te_fp8: Transformer Engine's FP8 matrix multiplications are not "
                      "supported by am: it computes in bf16 or fp32 (remove te_fp8)", section);
        else if (strcmp(e->key, "experts") == 0 && e->value->kind == AM_NODE_SCALAR &&
                 strcmp(e->value->str, "torch_mm_mxfp8") == 0)
            am_errorf(err, &e->value->pos, "%s.backend.experts: torch_mm_mxfp8 computes the experts' GEMMs in MXFP8, "
                      "which am does not: it computes in bf16 or fp32 (use experts: torch_mm)", section);
        else if (strcmp(e->key, "fake_balanced_gate") == 0 &&
                 am_node_bool(e->value, "backend.fake_balanced_gate", &on, err) == 0 && on)
            am_errorf(err, &e->value->pos, "%s.backend.fake_balanced_gate: true routes tokens without the learned "
                      "router, a different model than the config's: am trains the router (remove it)", section);
    }
}

/* Without a model_type, the class that names the architecture: config.json's architectures
 * (LlamaForCausalLM) or AutoModel's config class (model.config._target_: ...DeepseekV4Config).
 * Sets *type for a class am builds; reports one it does not know as unsupported and returns
 * true. */
static bool unsupported_class(struct am_node *cfg, const char *section, const char **type, struct am_errors *err)
{
    static const char *const known[] = {"Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Qwen3Moe", "Gemma2", "Gemma3Text",
                                        "Glm4Moe", "DeepseekV3", "GptOss", NULL};
    static const char *const types[] = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text",
                                        "glm4_moe", "deepseek_v3", "gpt_oss"};
    struct am_node *arch = am_node_path(cfg, "architectures"), *target = am_node_path(cfg, "_target_"), *v = NULL;
    const char *cls = NULL, *key = NULL;
    char name[128];
    size_t stem;
    if (arch && arch->kind == AM_NODE_SEQ && arch->n > 0 && arch->entries[0].value->kind == AM_NODE_SCALAR) {
        v = arch->entries[0].value;
        cls = v->str;
        key = "architectures";
        const char *end = strstr(cls, "For");
        stem = end ? (size_t)(end - cls) : strlen(cls);
    } else if (target && target->kind == AM_NODE_SCALAR && !strstr(target->str, "AutoConfig")) {
        /* ...DeepseekV4Config, or ...DeepseekV4Config.from_pretrained */
        const char *t = target->str, *end = t + strlen(t), *dot = strrchr(t, '.');
        if (dot && strncmp(dot + 1, "from_", 5) == 0) {
            end = dot;
            dot = NULL;
            for (const char *c = t; c < end; c++)
                if (*c == '.')
                    dot = c;
        }
        const char *start = dot ? dot + 1 : t;
        snprintf(name, sizeof(name), "%.*s", (int)(end - start), start);
        v = target;
        cls = name;
        key = "_target_";
        size_t l = strlen(cls);
        if (l <= 6 || strcmp(cls + l - 6, "Config") != 0)
            return false;
        stem = l - 6;
    } else {
        return false;
    }
    if (strcmp(cls, "Gemma3ForCausalLM") == 0) { /* Gemma 3's text model (Gemma3ForConditionalGeneration is not) */
        *type = "gemma3_text";
        return false;
    }
    for (int i = 0; known[i]; i++)
        if (strlen(known[i]) == stem && strncmp(cls, known[i], stem) == 0) {
            *type = types[i];
            return false;
        }
    am_errorf(err, &v->pos, "%s.%s: '%.60s' is not an architecture am builds (supported: %s)", section, key, cls,
              AM_SUPPORTED_TYPES);
    return true;
}

/* DeepSeekMoE's router and shared experts (glm4_moe, deepseek_v3): what transformers computes,
 * or what am does not (yet). */
static void router_checks(const struct am_model_config *m, const struct am_pos *where, const char *section,
                          struct am_errors *err)
{
    long E = m->num_experts;
    if (m->n_group < 1 || E % m->n_group || E / m->n_group < 2)
        am_errorf(err, where, "%s.n_group: %ld must divide n_routed_experts (%ld) into groups of at least 2 experts "
                  "(a group's score is the sum of its two best)", section, m->n_group, E);
    else if (m->topk_group < 1 || m->topk_group > m->n_group)
        am_errorf(err, where, "%s.topk_group: %ld must be 1 to n_group (%ld)", section, m->topk_group, m->n_group);
    else if (m->num_experts_per_tok > m->topk_group * (E / m->n_group))
        am_errorf(err, where, "%s.num_experts_per_tok: %ld exceeds the %ld experts of the topk_group (%ld) groups "
                  "kept", section, m->num_experts_per_tok, m->topk_group * (E / m->n_group), m->topk_group);
    if (m->n_shared_experts < 0)
        am_errorf(err, where, "%s.n_shared_experts: %ld must be 0 or more", section, m->n_shared_experts);
    if (m->n_shared_experts > 0 && m->n_shared_experts * m->moe_intermediate_size > m->intermediate_size)
        am_errorf(err, where, "%s.n_shared_experts: the shared experts' width %ld x moe_intermediate_size %ld is "
                  "wider than intermediate_size %ld; am keeps them in the dense MLP's buffers and does not train "
                  "a wider one yet", section, m->n_shared_experts, m->moe_intermediate_size, m->intermediate_size);
    if (m->first_k_dense_replace < 0)
        am_errorf(err, where, "%s.first_k_dense_replace: %ld must be 0 or more", section, m->first_k_dense_replace);
    if (m->routed_scaling_factor <= 0)
        am_errorf(err, where, "%s.routed_scaling_factor: %g must be > 0", section, m->routed_scaling_factor);
}

/* glm4_moe's own rules: its partial rotary, then the router's. */
static void glm_checks(const struct am_model_config *m, const struct am_pos *where, const char *section,
                       struct am_errors *err)
{
    long rd = (long)((double)m->head_dim * m->partial_rotary_factor);
    if (!(m->partial_rotary_factor > 0 && m->partial_rotary_factor <= 1) || rd < 2 || rd % 2)
        am_errorf(err, where, "%s.partial_rotary_factor: %g gives a rotary part of %ld of head_dim %ld; it must be "
                  "even and at least 2 (a factor in (0, 1])", section, m->partial_rotary_factor, rd, m->head_dim);
    if (m->rope_scaling.type && m->partial_rotary_factor < 1)
        am_errorf(err, where, "%s.rope_scaling: %s with partial_rotary_factor %g is not supported by am (its partial "
                  "rotary tables are checked against transformers without scaling only): use rope_scaling null",
                  section, m->rope_scaling.type, m->partial_rotary_factor);
    router_checks(m, where, section, err);
}

/* deepseek_v3's own rules (multi-head latent attention, DeepSeekMoE's keys transformers does not
 * read), then the router's; sets the attention's head width and rotary part (model_config.h). */
static void dsv3_checks(struct am_model_config *m, const struct window_keys *w, const struct am_pos *where,
                        const char *section, struct am_errors *err)
{
    if (m->kv_lora_rank < 1 || m->qk_rope_head_dim < 2 || m->qk_rope_head_dim % 2 || m->qk_nope_head_dim < 0 ||
        m->v_head_dim < 1)
        am_errorf(err, where, "%s: kv_lora_rank %ld, qk_rope_head_dim %ld, qk_nope_head_dim %ld, v_head_dim %ld: "
                  "multi-head latent attention needs kv_lora_rank and v_head_dim >= 1 and an even qk_rope_head_dim >= 2",
                  section, m->kv_lora_rank, m->qk_rope_head_dim, m->qk_nope_head_dim, m->v_head_dim);
    if (m->num_key_value_heads != m->num_attention_heads)
        am_errorf(err, where, "%s.num_key_value_heads: %ld, but deepseek_v3's kv_b_proj gives every one of the %ld "
                  "attention heads its own key and value (transformers would repeat them into more heads than it "
                  "has queries): set it to num_attention_heads", section, m->num_key_value_heads,
                  m->num_attention_heads);
    if (m->rope_scaling.type && strcmp(m->rope_scaling.type, "yarn") != 0)
        am_errorf(err, where, "%s.rope_scaling: %s with deepseek_v3 is not supported by am (its rope tables under "
                  "that scaling are not checked against transformers' DeepseekV3Attention): use yarn, or rope_scaling "
                  "null", section, m->rope_scaling.type);
    if (w->moe_layer_freq != 1)
        am_errorf(err, w->moe_layer_freq_node ? &w->moe_layer_freq_node->pos : where,
                  "%s.moe_layer_freq: %ld is not supported by am: transformers' DeepseekV3 ignores it (every layer from "
                  "first_k_dense_replace on has experts) while DeepSeek's own code puts experts on every %ld-th layer "
                  "only; set it to 1", section, w->moe_layer_freq, w->moe_layer_freq);
    static const char *const fixed[][3] = {{"topk_method", "noaux_tc", "the grouped top-k on sigmoid scores plus "
                                                                       "e_score_correction_bias"},
                                           {"scoring_func", "sigmoid", "sigmoid scores"}};
    const struct am_node *given[] = {w->topk_method, w->scoring_func};
    for (int i = 0; i < 2; i++)
        if (given[i] && (given[i]->kind != AM_NODE_SCALAR || strcmp(given[i]->str, fixed[i][1]) != 0))
            am_errorf(err, &given[i]->pos, "%s.%s: '%.40s' is not supported by am: transformers' DeepseekV3 computes "
                      "%s (%s) whatever it says; set it to %s", section, fixed[i][0],
                      given[i]->kind == AM_NODE_SCALAR ? given[i]->str : "?", fixed[i][1], fixed[i][2], fixed[i][1]);
    router_checks(m, where, section, err);
    long qk = m->qk_nope_head_dim + m->qk_rope_head_dim;
    m->head_dim = qk > m->v_head_dim ? qk : m->v_head_dim;
    m->rotary_dim = m->qk_rope_head_dim;
}

int am_model_config_read(struct am_arena *a, struct am_node *cfg, const char *section,
                         struct am_model_config *m, struct am_list *ignored, struct am_errors *err)
{
    size_t before = err->n;
    *m = (struct am_model_config){.rope_theta = 10000.0, .rms_norm_eps = 1e-6, .initializer_range = 0.02,
                                  .max_position_embeddings = 2048, .router_aux_loss_coef = 0.001,
                                  .partial_rotary_factor = 1.0};
    struct window_keys wk = {.max_window_layers = -1};
    /* an architecture am does not build is reported first and alone: its other keys would
     * only hide it behind errors about them */
    struct am_entry *type = am_node_entry(cfg, "model_type");
    if (type && !type->used && type->value->kind == AM_NODE_SCALAR && !am_node_is_null(type->value) &&
        !am_model_type_supported(type->value->str)) {
        struct am_pos where = type->value->pos;
        if (strcmp(type->value->str, "gemma3") == 0)
            am_errorf(err, &where, "%s.model_type: 'gemma3' is Gemma 3's image-text model (AutoModelForCausalLM builds "
                      "Gemma3ForConditionalGeneration: a vision tower and a projector beside the language model, whose "
                      "weights are model.language_model.*); am trains text decoders only and would train another model: "
                      "use a text-only Gemma 3 (model_type gemma3_text, e.g. google/gemma-3-1b-pt or "
                      "google/gemma-3-270m)", section);
        else
            am_errorf(err, &where, "%s.model_type: '%.40s' is not supported (supported: %s)", section,
                      type->value->str, AM_SUPPORTED_TYPES);
        return -1;
    }
    const char *class_type = NULL;
    if (!type && unsupported_class(cfg, section, &class_type, err))
        return -1;
    const char *pre_type = type && type->value->kind == AM_NODE_SCALAR ? type->value->str : class_type;
    wk.qwen2 = pre_type && strcmp(pre_type, "qwen2") == 0;
    wk.glm = pre_type && strcmp(pre_type, "glm4_moe") == 0;
    wk.dsv3 = pre_type && strcmp(pre_type, "deepseek_v3") == 0;
    wk.qwen3_moe = pre_type && strcmp(pre_type, "qwen3_moe") == 0;
    wk.gpt_oss = pre_type && strcmp(pre_type, "gpt_oss") == 0;
    wk.moe_layer_freq = 1;
    if (wk.dsv3) { /* DeepseekV3Config's defaults, where they differ from Llama's */
        m->max_position_embeddings = 4096;
        m->intermediate_size = 18432;
        m->n_shared_experts = 1;
        m->num_experts = 256;
        m->num_experts_per_tok = 8;
        m->moe_intermediate_size = 2048;
        m->n_group = 8;
        m->topk_group = 4;
        m->first_k_dense_replace = 3;
        m->norm_topk_prob = true;
        m->routed_scaling_factor = 2.5;
        m->q_lora_rank = 1536;
        m->kv_lora_rank = 512;
        m->qk_rope_head_dim = 64;
        m->qk_nope_head_dim = 128;
        m->v_head_dim = 128;
        m->rope_interleave = true;
    }
    if (wk.gpt_oss) { /* GptOssConfig's defaults, where they differ from Llama's (its rope_parameters' below) */
        m->head_dim = 64;
        m->intermediate_size = 2880;
        m->num_experts = 128;
        m->num_experts_per_tok = 4;
        m->rms_norm_eps = 1e-5;
        m->max_position_embeddings = 131072;
        m->rope_theta = 150000.0;
        m->swiglu_alpha = 1.702;
        m->swiglu_limit = 7.0;
        wk.attention_bias = true;
    }
    if (wk.glm) { /* Glm4MoeConfig's defaults, where they differ from Llama's */
        m->partial_rotary_factor = 0.5;
        m->rms_norm_eps = 1e-5;
        m->max_position_embeddings = 131072;
        m->n_shared_experts = 1;
        m->n_group = m->topk_group = 1;
        m->first_k_dense_replace = 1;
        m->norm_topk_prob = true;
        m->routed_scaling_factor = 1.0;
        m->num_experts = 128;
        m->num_experts_per_tok = 8;
        m->moe_intermediate_size = 1408;
    }
    if (pre_type && (strcmp(pre_type, "gemma2") == 0 || strcmp(pre_type, "gemma3_text") == 0)) {
        /* Gemma2Config's and Gemma3TextConfig's defaults, where they differ from Llama's */
        bool g3 = strcmp(pre_type, "gemma3_text") == 0;
        m->tie_word_embeddings = true;
        m->head_dim = 256;
        m->query_pre_attn_scalar = 256;
        m->rope_theta = g3 ? 1000000.0 : 10000.0;
        m->rope_local_base_freq = g3 ? 10000.0 : 0.0;
        m->max_position_embeddings = g3 ? 131072 : 8192;
        m->attn_logit_softcapping = g3 ? 0.0 : 50.0;
        m->final_logit_softcapping = g3 ? 0.0 : 30.0;
        wk.gemma = true;
    }
    for (size_t i = 0; i < cfg->n; i++) {
        struct am_entry *e = &cfg->entries[i];
        if (e->used) /* read by the caller (pretrained_model_name_or_path, config, ...) */
            continue;
        const struct hf_key *k = find_key(e->key);
        bool from_recipe = e->key_pos.line > 0 || e->key_pos.origin;
        if (!k) {
            if (!from_recipe)
                continue; /* config.json may carry anything */
            char *name = am_arena_strdup(a, e->key);
            if (name && am_key_in(e->key, automodel_model_keys)) {
                if (strcmp(e->key, "backend") == 0)
                    check_backend(e->value, section, err);
                char full[256];
                snprintf(full, sizeof(full), "%s.%s", section, e->key);
                am_list_add(a, ignored, am_arena_strdup(a, full));
                continue;
            }
            const char *names[sizeof(hf_keys) / sizeof(hf_keys[0]) + 1];
            for (size_t j = 0; j < sizeof(hf_keys) / sizeof(hf_keys[0]); j++)
                names[j] = hf_keys[j].name;
            names[sizeof(hf_keys) / sizeof(hf_keys[0])] = NULL;
            am_error_unknown_key(err, &e->key_pos, section, e->key, names, automodel_model_keys);
            continue;
        }
        bool unread = wk.qwen2 && (strcmp(e->key, "attention_bias") == 0 || strcmp(e->key, "mlp_bias") == 0);
        if ((k->kind == K_IGNORE || unread) && from_recipe) {
            char full[256];
            snprintf(full, sizeof(full), "%s.%s", section, e->key);
            am_list_add(a, ignored, am_arena_strdup(a, full));
        }
        read_key(k, e->value, section, m, &wk, err);
    }
    if (err->n > before)
        return -1;

    /* defaults and consistency of the architecture itself */
    struct am_pos where = cfg->pos;
    where.line = 0;
    if (!m->model_type)
        m->model_type = class_type ? class_type : m->num_experts ? "mixtral" : "llama";
    if (!am_model_type_supported(m->model_type)) {
        am_errorf(err, &where, "%s.model_type: '%s' is not supported (supported: %s)", section, m->model_type,
                  AM_SUPPORTED_TYPES);
        return -1;
    }
    m->gemma = strcmp(m->model_type, "gemma2") == 0 || strcmp(m->model_type, "gemma3_text") == 0;
    static const char *const required[] = {"hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "vocab_size", NULL};
    long *req_val[] = {&m->hidden_size, &m->num_hidden_layers, &m->num_attention_heads, &m->vocab_size};
    for (int i = 0; required[i]; i++)
        if (*req_val[i] <= 0)
            am_errorf(err, &where, "%s.%s: missing (write it under %s:, or set pretrained_model_name_or_path "
                      "to a model directory or hub id)", section, required[i], section);
    if (err->n > before)
        return -1;
    if (!m->num_key_value_heads)
        m->num_key_value_heads = m->num_attention_heads;
    if (!m->head_dim && !wk.dsv3) { /* deepseek_v3: its head widths are its own (dsv3_checks) */
        if (m->hidden_size % m->num_attention_heads) {
            am_errorf(err, &where, "%s.num_attention_heads: %ld does not divide hidden_size %ld (set head_dim, "
                      "or use a divisor of %ld)", section, m->num_attention_heads, m->hidden_size, m->hidden_size);
            return -1;
        }
        m->head_dim = m->hidden_size / m->num_attention_heads;
    }
    if (m->num_attention_heads % m->num_key_value_heads)
        am_errorf(err, &where, "%s.num_key_value_heads: %ld does not divide num_attention_heads %ld "
                  "(grouped-query attention shares each kv head among whole groups of query heads)",
                  section, m->num_key_value_heads, m->num_attention_heads);
    m->qk_norm = strncmp(m->model_type, "qwen3", 5) == 0 || strcmp(m->model_type, "gemma3_text") == 0;
    if (m->gemma && m->query_pre_attn_scalar <= 0)
        am_errorf(err, &where, "%s.query_pre_attn_scalar: %g; the attention scale is its inverse square root: it must "
                  "be > 0 (Gemma's is 256, or head_dim)", section, m->query_pre_attn_scalar);
    if (m->gemma && (m->attn_logit_softcapping < 0 || m->final_logit_softcapping < 0))
        am_errorf(err, &where, "%s.attn_logit_softcapping / final_logit_softcapping: %g / %g; a cap must be > 0, or "
                  "null for none", section, m->attn_logit_softcapping, m->final_logit_softcapping);
    if (!m->gemma && (m->attn_logit_softcapping > 0 || m->final_logit_softcapping > 0 || m->rope_local_base_freq > 0))
        am_errorf(err, &where, "%s: attn_logit_softcapping, final_logit_softcapping and rope_local_base_freq are "
                  "Gemma's (model_type gemma2 or gemma3_text); a %s model has none: remove them", section,
                  m->model_type);
    m->qkv_bias = strcmp(m->model_type, "qwen2") == 0;
    bool glm = strcmp(m->model_type, "glm4_moe") == 0, dsv3 = strcmp(m->model_type, "deepseek_v3") == 0;
    bool gpt_oss = strcmp(m->model_type, "gpt_oss") == 0;
    m->rotary_dim = m->head_dim;
    m->gpt_oss = gpt_oss;
    if (!gpt_oss) {
        m->o_bias = m->mxfp4 = false;
        m->swiglu_alpha = m->swiglu_limit = 0;
    }
    if (gpt_oss) {
        m->qkv_bias = m->o_bias = wk.attention_bias;
        m->norm_topk_prob = true; /* the softmax over the k chosen logits: the renormalised top-k */
        m->partial_rotary_factor = 1.0;
        m->n_shared_experts = 0;
        if (!wk.rope_given) { /* GptOssConfig's default rope_parameters */
            m->rope_scaling.type = "yarn";
            m->rope_scaling.factor = 32.0;
            m->rope_scaling.beta_fast = 32.0;
            m->rope_scaling.beta_slow = 1.0;
            m->rope_scaling.no_truncate = true;
            m->rope_scaling.original_max_position_embeddings = 4096;
        }
        if (m->mxfp4 && m->hidden_size % 32)
            am_errorf(err, &where, "%s.hidden_size: %ld; MXFP4 experts are stored in blocks of 32 values along "
                      "hidden_size and intermediate_size, which must be multiples of 32", section, m->hidden_size);
    } else if (glm) {
        m->qkv_bias = wk.attention_bias;
        m->qk_norm = wk.use_qk_norm;
        m->sigmoid_router = true;
        m->output_router_logits = false; /* Glm4MoeForCausalLM adds no load-balancing loss */
        glm_checks(m, &where, section, err);
        m->rotary_dim = (long)((double)m->head_dim * m->partial_rotary_factor);
    } else if (dsv3) {
        m->mla = true;
        m->partial_rotary_factor = 1.0;
        m->sigmoid_router = true;
        m->output_router_logits = false; /* DeepseekV3ForCausalLM adds no load-balancing loss */
        dsv3_checks(m, &wk, &where, section, err);
    } else {
        m->partial_rotary_factor = 1.0; /* read by glm4_moe only */
        m->n_shared_experts = 0;
    }
    if (!dsv3) {
        m->q_lora_rank = m->kv_lora_rank = m->qk_nope_head_dim = m->qk_rope_head_dim = m->v_head_dim = 0;
        m->rope_interleave = false;
    }
    bool moe = strcmp(m->model_type, "mixtral") == 0 || strcmp(m->model_type, "qwen3_moe") == 0 || glm || dsv3 ||
               gpt_oss;
    if (moe && m->num_experts <= 0)
        am_errorf(err, &where, "%s.%s: missing (a %s model has experts)", section,
                  strcmp(m->model_type, "mixtral") == 0 || gpt_oss ? "num_local_experts"
                  : glm || dsv3                          ? "n_routed_experts"
                                                         : "num_experts",
                  m->model_type);
    if (!moe)
        m->num_experts = 0;
    if (moe && m->num_experts > 0) {
        if (m->num_experts_per_tok < 1 || m->num_experts_per_tok > m->num_experts)
            am_errorf(err, &where, "%s.num_experts_per_tok: %ld must be 1 to num_experts (%ld)", section,
                      m->num_experts_per_tok, m->num_experts);
        if (strcmp(m->model_type, "mixtral") == 0 || gpt_oss) /* each expert of intermediate_size */
            m->moe_intermediate_size = m->intermediate_size;
        if (m->moe_intermediate_size <= 0)
            am_errorf(err, &where, "%s.moe_intermediate_size: missing (the width of each expert's MLP)", section);
    } else if (m->intermediate_size <= 0) {
        am_errorf(err, &where, "%s.intermediate_size: missing (the MLP width)", section);
    }
    if (moe && err->n == before)
        resolve_dense_layers(&wk, &where, section, m, err);
    if (err->n == before)
        resolve_windows(&wk, &where, section, m, err);
    return err->n > before ? -1 : 0;
}

long am_model_layer_window(const struct am_model_config *m, long l)
{
    if (m->sliding_window <= 0 || l < 0 || l >= AM_MAX_WINDOW_LAYERS)
        return 0;
    return (m->window_layers[l / 64] >> (l % 64)) & 1 ? m->sliding_window : 0;
}

void am_model_params(const struct am_model_config *m, struct am_param_count *p)
{
    double h = (double)m->hidden_size, hd = (double)m->head_dim, L = (double)m->num_hidden_layers;
    double q = (double)m->num_attention_heads * hd, kv = (double)m->num_key_value_heads * hd;
    memset(p, 0, sizeof(*p));
    p->embedding = (double)m->vocab_size * h;
    p->lm_head = m->tie_word_embeddings ? 0 : p->embedding;
    p->attn_per_layer =
        h * q + 2 * h * kv + q * h + (m->qk_norm ? 2 * hd : 0) + (m->qkv_bias ? q + 2 * kv : 0) /* qwen2's biases */
        + (m->o_bias ? h : 0) + (m->gpt_oss ? (double)m->num_attention_heads : 0); /* gpt_oss: o's bias, the sinks */
    double attn_matmul = h * q + 2 * h * kv + q * h; /* the attention's weights a token multiplies by */
    if (m->mla) { /* multi-head latent attention: its projections and its two norms (model_config.h) */
        double nh = (double)m->num_attention_heads, qr = (double)m->q_lora_rank, kvr = (double)m->kv_lora_rank;
        double qk = (double)(m->qk_nope_head_dim + m->qk_rope_head_dim), vd = (double)m->v_head_dim;
        double qw = qr > 0 ? h * qr + qr * nh * qk : h * nh * qk;
        attn_matmul = qw + h * (kvr + (double)m->qk_rope_head_dim) + kvr * nh * ((double)m->qk_nope_head_dim + vd) +
                      nh * vd * h;
        p->attn_per_layer = attn_matmul + qr + kvr;
    }
    p->norms_per_layer = (m->gemma ? 4 : 2) * h; /* Gemma: post-attention, pre- and post-MLP norms */
    if (m->num_experts > 0) {
        p->router_per_layer = h * (double)m->num_experts + (m->gpt_oss ? (double)m->num_experts : 0);
        p->experts_per_layer = (double)m->num_experts * 3 * h * (double)m->moe_intermediate_size;
        if (m->gpt_oss) /* the experts' biases: gate and up [2I], down [C] */
            p->experts_per_layer += (double)m->num_experts * (2 * (double)m->moe_intermediate_size + h);
        p->shared_per_layer = 3 * h * (double)(m->n_shared_experts * m->moe_intermediate_size);
    } else {
        p->mlp_per_layer = 3 * h * (double)m->intermediate_size;
    }
    /* a MoE model's dense layers (qwen3_moe's mlp_only_layers): counted into the averages
     * per layer, mlp_per_layer, router_per_layer and experts_per_layer */
    double n_moe = m->num_experts > 0 ? (double)am_model_moe_layers(m) : L, dense_share = L > 0 ? (L - n_moe) / L : 0;
    double dense_active = 0;
    if (m->num_experts > 0 && n_moe < L) {
        p->router_per_layer *= n_moe / L;
        p->experts_per_layer *= n_moe / L;
        p->shared_per_layer *= n_moe / L;
        p->mlp_per_layer = dense_share * 3 * h * (double)m->intermediate_size;
        dense_active = p->mlp_per_layer;
    }
    p->per_layer = p->attn_per_layer + p->norms_per_layer + p->mlp_per_layer + p->router_per_layer +
                   p->experts_per_layer + p->shared_per_layer;
    p->final_norm = h;
    p->total = p->embedding + p->lm_head + L * p->per_layer + p->final_norm;
    double mlp_active = m->num_experts > 0
                            ? p->router_per_layer + p->shared_per_layer +
                                  (n_moe / L) * (double)m->num_experts_per_tok * 3 * h * (double)m->moe_intermediate_size +
                                  dense_active
                            : p->mlp_per_layer;
    p->active_per_token = L * (attn_matmul + mlp_active) + (double)m->vocab_size * h;
}

double am_model_layer_rope_theta(const struct am_model_config *m, long l, bool *scaled)
{
    bool local = m->rope_local_base_freq > 0 && am_model_layer_window(m, l) > 0;
    *scaled = !local && m->rope_scaling.type;
    return local ? m->rope_local_base_freq : m->rope_theta;
}

static const char *const lora_target_paths[AM_LORA_NTARGETS] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj",    "self_attn.q_a_proj",
    "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "lm_head"};

const char *am_lora_target_path(enum am_lora_target t) { return lora_target_paths[t]; }

static const char *leaf(const char *path)
{
    const char *dot = strrchr(path, '.');
    return dot ? dot + 1 : path;
}

const char *am_lora_target_name(enum am_lora_target t) { return leaf(lora_target_paths[t]); }

const char *am_lora_target_path_of(const struct am_model_config *m, enum am_lora_target t)
{
    bool mla_own = t == AM_LORA_Q_A || t == AM_LORA_KV_A || t == AM_LORA_KV_B;
    if (!m->mla)
        return mla_own ? NULL : lora_target_paths[t];
    if (t == AM_LORA_K || t == AM_LORA_V || (t == AM_LORA_Q_A && m->q_lora_rank <= 0))
        return NULL;
    if (t == AM_LORA_Q && m->q_lora_rank > 0)
        return "self_attn.q_b_proj";
    return lora_target_paths[t];
}

const char *am_lora_target_name_of(const struct am_model_config *m, enum am_lora_target t)
{
    const char *p = am_lora_target_path_of(m, t);
    return p ? leaf(p) : NULL;
}
