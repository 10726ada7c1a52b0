/* peft_merge.c - LoRA adapters merged into their base model (peft_merge.h). */
#include "peft_merge.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <regex.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "half.h"
#include "safetensors.h"
#include "util.h"

#define PFX "base_model.model."

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

struct module {
    char *name;                      /* the base layer's path, "model.layers.0.self_attn.q_proj" */
    long r;                          /* its adapters' rank: adapter_config.json's r, or rank_pattern's */
    const struct am_st_info *a, *b;  /* in the adapter file */
    const struct am_st_info *w;      /* the base weight */
    const struct am_st_file *wfile;
    void *merged;                    /* the merged weight, in w's dtype */
    /* peft's ParamWrapper on a 3-D parameter (target_parameters): w is [E, in, out], used as
     * x @ W (transformers' is_transposed experts: gpt_oss's), a [r E, in] with expert e's rank row
     * k at row e r + k, b [out, r E] with its column at k E + e */
    bool param;
    char *wname;                     /* the parameter's name, "model.layers.0.mlp.experts.gate_up_proj" */
};

/* adapter_config.json's target_parameters, sorted as peft wraps them (the first the outermost) */
struct params {
    char **name;
    size_t n;
};

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void params_free(struct params *p)
{
    for (size_t i = 0; i < p->n; i++)
        free(p->name[i]);
    free(p->name);
    *p = (struct params){0};
}

/* The parameter adapted by the ParamWrapper tensors of module path `mod` (its base_layer
 * segments count the wrappers inside the outermost): peft nests the target_parameters of one
 * module in sorted order, the first outermost. NULL: none. */
static char *param_of(const struct params *p, const char *mod)
{
    char base[4096];
    snprintf(base, sizeof(base), "%s", mod);
    int depth = 0;
    size_t bl = strlen(".base_layer");
    while (ends_with(base, ".base_layer")) {
        base[strlen(base) - bl] = '\0';
        depth++;
    }
    for (size_t i = 0; i < p->n; i++) {
        const char *dot = strrchr(p->name[i], '.');
        size_t ml = dot ? (size_t)(dot - p->name[i]) : 0, n = strlen(base);
        bool on = dot && n >= ml && strncmp(base + n - ml, p->name[i], ml) == 0 && (n == ml || base[n - ml - 1] == '.');
        if (on && depth-- == 0) {
            char *w = malloc(n + strlen(dot) + 1);
            if (w)
                sprintf(w, "%s%s", base, dot);
            return w;
        }
    }
    return NULL;
}

/* v rounded once to the dtype: through float by round-to-odd (float has more than two bits
 * beyond bf16's and f16's mantissas, so the second rounding is then exact as one would be). */
static float to_odd_f32(double v)
{
    float f = (float)v;
    if ((double)f == v || isnan(v) || isinf(f))
        return f;
    if (fabs((double)f) > fabs(v))
        f = nextafterf(f, 0.0f);
    return am_bits_f32(am_f32_bits(f) | 1u);
}

static void store(enum am_st_dtype d, void *dst, int64_t i, double v)
{
    if (d == AM_ST_F32)
        ((float *)dst)[i] = (float)v;
    else if (d == AM_ST_BF16)
        ((uint16_t *)dst)[i] = am_f32_to_bf16(to_odd_f32(v));
    else
        ((uint16_t *)dst)[i] = am_f32_to_f16(to_odd_f32(v));
}


static bool is_true(json_t *cfg, const char *key)
{
    return json_is_true(json_object_get(cfg, key));
}

static bool nonempty(json_t *cfg, const char *key)
{
    json_t *v = json_object_get(cfg, key);
    return v && !json_is_null(v) && !((json_is_object(v) && json_object_size(v) == 0) ||
                                      (json_is_array(v) && json_array_size(v) == 0));
}

/* adapter_config.json's rank_pattern: modules whose adapters have their own rank, in the
 * file's order (peft takes the first key that matches) */
struct ranks {
    regex_t *re; /* each key as peft matches it: the whole module name, or its end after a '.' */
    long *r;
    size_t n;
};

static void ranks_free(struct ranks *k)
{
    for (size_t i = 0; i < k->n; i++)
        regfree(&k->re[i]);
    free(k->re);
    free(k->r);
    *k = (struct ranks){0};
}

/* the rank of module `name`'s adapters: rank_pattern's first match, else r */
static long rank_of(const struct ranks *k, const char *name, long r)
{
    for (size_t i = 0; i < k->n; i++)
        if (regexec(&k->re[i], name, 0, NULL, 0) == 0)
            return k->r[i];
    return r;
}

static int read_ranks(const char *path, json_t *o, struct ranks *k, struct am_errors *err)
{
    size_t n = json_object_size(o);
    k->re = calloc(n + 1, sizeof(*k->re));
    k->r = calloc(n + 1, sizeof(*k->r));
    if (!k->re || !k->r) {
        am_errorf(err, NULL, "out of memory");
        return -1;
    }
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        char *pat = malloc(strlen(key) + 16);
        if (!pat) {
            am_errorf(err, NULL, "out of memory");
            return -1;
        }
        sprintf(pat, "^(.*\\.)?(%s)$", key); /* peft's re.match(rf"(.*\.)?({key})$", name) */
        int bad = regcomp(&k->re[k->n], pat, REG_EXTENDED | REG_NOSUB);
        free(pat);
        if (bad) {
            am_errorf(err, NULL, "%s: rank_pattern's key '%s' is not a regular expression am-ckpt merge reads "
                      "(POSIX extended): merge them with peft's merge_and_unload()", path, key);
            return -1;
        }
        k->r[k->n++] = json_is_integer(v) ? (long)json_integer_value(v) : 0;
        if (k->r[k->n - 1] < 1) {
            am_errorf(err, NULL, "%s: rank_pattern's '%s' must be a positive integer rank: restore the file peft "
                      "wrote", path, key);
            return -1;
        }
    }
    return 0;
}

/* The adapter_config.json checks: r, lora_alpha and rank_pattern's ranks; -1 with a message when
 * not plain LoRA. */
static int read_config(const char *path, long *r, double *alpha, struct ranks *ranks, struct params *params,
                       struct am_errors *err)
{
    json_error_t je;
    json_t *cfg = json_load_file(path, 0, &je);
    if (!cfg) {
        if (access(path, F_OK) != 0)
            am_errorf(err, NULL, "%s: missing: an adapter directory holds adapter_config.json and "
                      "adapter_model.safetensors, as peft saves them: name a step-N/peft directory or one "
                      "PeftModel.save_pretrained wrote", path);
        else
            am_errorf(err, NULL, "%s: not valid JSON (line %d: %s): restore the file peft wrote", path, je.line,
                      je.text);
        return -1;
    }
    const char *type = json_string_value(json_object_get(cfg, "peft_type"));
    json_t *jr = json_object_get(cfg, "r"), *ja = json_object_get(cfg, "lora_alpha");
    static const char *const refused[][2] = {
        {"use_dora", "DoRA's merge (a magnitude vector over the column norms) is not done here"},
        {"use_rslora", "rsLoRA scales by lora_alpha / sqrt(r), not the lora_alpha / r merged here"},
        {"fan_in_fan_out", "the adapters are for Conv1D layers (GPT-2's), whose weights are transposed"},
        {"lora_bias", "the adapters carry a bias for B, which plain LoRA has not"},
    };
    static const char *const patterns[][2] = {
        {"alpha_pattern", "modules have their own lora_alpha"},
        {"modules_to_save", "whole modules are trained and saved beside the adapters"},
    };
    int rc = -1;
    if (!type || strcmp(type, "LORA") != 0) {
        am_errorf(err, NULL, "%s: peft_type is %s, not LORA: am-ckpt merge merges LoRA adapters only: merge them "
                  "with peft's merge_and_unload()", path, type ? type : "missing");
        goto out;
    }
    if (!json_is_integer(jr) || json_integer_value(jr) < 1) {
        am_errorf(err, NULL, "%s: r must be a positive integer: restore the file peft wrote", path);
        goto out;
    }
    if (!json_is_number(ja)) {
        am_errorf(err, NULL, "%s: lora_alpha must be a number: restore the file peft wrote", path);
        goto out;
    }
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++)
        if (is_true(cfg, refused[i][0])) {
            am_errorf(err, NULL, "%s: %s is true: %s: merge them with peft's merge_and_unload()", path,
                      refused[i][0], refused[i][1]);
            goto out;
        }
    for (size_t i = 0; i < sizeof(patterns) / sizeof(patterns[0]); i++)
        if (nonempty(cfg, patterns[i][0])) {
            am_errorf(err, NULL, "%s: %s is set (%s): am-ckpt merge merges one lora_alpha for every "
                      "module: merge them with peft's merge_and_unload()", path, patterns[i][0], patterns[i][1]);
            goto out;
        }
    json_t *rp = json_object_get(cfg, "rank_pattern");
    if (rp && !json_is_null(rp) && !json_is_object(rp)) {
        am_errorf(err, NULL, "%s: rank_pattern must be an object of module patterns and ranks: restore the file "
                  "peft wrote", path);
        goto out;
    }
    if (rp && json_is_object(rp) && read_ranks(path, rp, ranks, err) < 0)
        goto out;
    json_t *tp = json_object_get(cfg, "target_parameters");
    if (tp && json_is_array(tp) && json_array_size(tp) > 0) {
        size_t i;
        json_t *v;
        if (!(params->name = calloc(json_array_size(tp), sizeof(char *)))) {
            am_errorf(err, NULL, "out of memory");
            goto out;
        }
        json_array_foreach(tp, i, v) {
            if (!json_is_string(v) || !(params->name[params->n++] = strdup(json_string_value(v)))) {
                am_errorf(err, NULL, "%s: target_parameters must be parameter names: restore the file peft wrote",
                          path);
                goto out;
            }
        }
        qsort(params->name, params->n, sizeof(char *), by_name);
    }
    *r = (long)json_integer_value(jr);
    *alpha = json_number_value(ja);
    rc = 0;
out:
    json_decref(cfg);
    return rc;
}

static const char *shape(const struct am_st_info *t, char *buf, size_t len)
{
    return am_st_shape_str(t->shape, t->ndim, buf, len);
}

/* Finds the adapters' modules and checks them against the base. */
static int collect(const struct am_st_file *af, const struct am_ckpt *base, long r0, const struct ranks *ranks,
                   const struct params *params, bool transposed, struct module **out, size_t *n_out,
                   struct am_errors *err)
{
    const char *apath = am_st_path(af);
    size_t n = am_st_count(af), nm = 0;
    struct module *m = calloc(n + 1, sizeof(*m));
    if (!m) {
        am_errorf(err, NULL, "out of memory");
        return -1;
    }
    *out = m;
    for (size_t i = 0; i < n; i++) {
        const struct am_st_info *t = am_st_at(af, i);
        bool is_a = ends_with(t->name, ".lora_A.weight"), is_b = ends_with(t->name, ".lora_B.weight");
        size_t plen = strlen(PFX);
        if ((!is_a && !is_b) || strncmp(t->name, PFX, plen) != 0 || strlen(t->name) <= plen + 14) {
            am_errorf(err, NULL, "%s: tensor %s is not a LoRA matrix (base_model.model.MODULE.lora_A.weight or "
                      ".lora_B.weight): am-ckpt merge merges plain LoRA adapters of linear layers only: merge "
                      "them with peft's merge_and_unload()", apath, t->name);
            return -1;
        }
        size_t len = strlen(t->name) - plen - 14;
        size_t j;
        for (j = 0; j < nm; j++)
            if (strlen(m[j].name) == len && strncmp(m[j].name, t->name + plen, len) == 0)
                break;
        if (j == nm) {
            if (!(m[nm].name = strndup(t->name + plen, len))) {
                am_errorf(err, NULL, "out of memory");
                return -1;
            }
            *n_out = ++nm;
        }
        *(is_a ? &m[j].a : &m[j].b) = t;
    }
    *n_out = nm;
    if (nm == 0) {
        am_errorf(err, NULL, "%s: holds no tensor: save the adapters again", apath);
        return -1;
    }
    for (size_t j = 0; j < nm; j++) {
        char wname[4200], s1[64], s2[64], s3[64];
        if (!m[j].a || !m[j].b) {
            am_errorf(err, NULL, "%s: module %s has lora_%s.weight but no lora_%s.weight: the file is incomplete: "
                      "save the adapters again", apath, m[j].name, m[j].a ? "A" : "B", m[j].a ? "B" : "A");
            return -1;
        }
        snprintf(wname, sizeof(wname), "%s.weight", m[j].name);
        const struct am_st_info *w = m[j].w = am_ckpt_find(base, wname, &m[j].wfile);
        const struct am_st_file *ef;
        if (!w && params->n && (m[j].wname = param_of(params, m[j].name)) && /* a ParamWrapper's */
            (w = m[j].w = am_ckpt_find(base, m[j].wname, &m[j].wfile))) {
            const struct am_st_info *a = m[j].a, *b = m[j].b;
            long r = m[j].r = rank_of(ranks, m[j].wname, r0);
            int64_t E = w->ndim == 3 ? w->shape[0] : 0;
            if (!transposed) {
                am_errorf(err, NULL, "%s: module %s adapts the parameter %s (target_parameters): am-ckpt merge merges "
                          "those of gpt_oss's experts (x @ W, [experts, in, out]) only: merge them with peft's "
                          "merge_and_unload()", apath, m[j].name, m[j].wname);
                return -1;
            }
            if (w->ndim != 3 || a->ndim != 2 || b->ndim != 2 || a->shape[0] != r * E || b->shape[1] != r * E ||
                a->shape[1] != w->shape[1] || b->shape[0] != w->shape[2]) {
                am_errorf(err, NULL, "%s: module %s: lora_A is %s and lora_B %s, but with r %ld the parameter %s %s "
                          "needs lora_A [%lld, %lld] and lora_B [%lld, %lld]: the adapters were trained on another "
                          "model: merge them into the base they were trained on", apath, m[j].name,
                          shape(a, s1, sizeof(s1)), shape(b, s2, sizeof(s2)), r, m[j].wname, shape(w, s3, sizeof(s3)),
                          (long long)(r * E), w->ndim == 3 ? (long long)w->shape[1] : -1LL,
                          w->ndim == 3 ? (long long)w->shape[2] : -1LL, (long long)(r * E));
                return -1;
            }
            m[j].param = true;
            snprintf(wname, sizeof(wname), "%s", m[j].wname);
            goto dtype;
        }
        if (!w && strcmp(m[j].name, "lm_head") == 0 && am_ckpt_find(base, "model.embed_tokens.weight", &ef)) {
            am_errorf(err, NULL, "%s: module lm_head is adapted, but the base model %s ties it to the embedding "
                      "(no tensor lm_head.weight, tie_word_embeddings): merged, the head's adapter would change "
                      "model.embed_tokens.weight, the input embedding, too: keep the adapters apart "
                      "(PeftModel.from_pretrained) or merge them with peft's merge_and_unload()", apath,
                      am_ckpt_dir(base));
            return -1;
        }
        if (!w) {
            am_errorf(err, NULL, "%s: module %s is adapted, but the base model %s has no tensor %s: the adapters "
                      "were trained on another model: merge them into the base they were trained on", apath,
                      m[j].name, am_ckpt_dir(base), wname);
            return -1;
        }
        const struct am_st_info *a = m[j].a, *b = m[j].b;
        long r = m[j].r = rank_of(ranks, m[j].name, r0);
        if (w->ndim != 2 || a->ndim != 2 || b->ndim != 2 || a->shape[0] != r || b->shape[1] != r ||
            a->shape[1] != w->shape[1] || b->shape[0] != w->shape[0]) {
            am_errorf(err, NULL, "%s: module %s: lora_A is %s and lora_B %s, but with r %ld the base weight %s %s "
                      "needs lora_A [%ld, %lld] and lora_B [%lld, %ld]: the adapters were trained on another model "
                      "(or adapter_config.json's r is not theirs): merge them into the base they were trained on",
                      apath, m[j].name, shape(a, s1, sizeof(s1)), shape(b, s2, sizeof(s2)), r, wname,
                      shape(w, s3, sizeof(s3)), r, w->ndim == 2 ? (long long)w->shape[1] : -1LL,
                      w->ndim == 2 ? (long long)w->shape[0] : -1LL, r);
            return -1;
        }
    dtype:
        if (w->dtype != AM_ST_F32 && w->dtype != AM_ST_BF16 && w->dtype != AM_ST_F16) {
            am_errorf(err, NULL, "%s: tensor %s is %s: am-ckpt merge merges into F32, BF16 or F16 weights only",
                      am_ckpt_dir(base), wname, am_st_dtype_name(w->dtype));
            return -1;
        }
    }
    return 0;
}

/* W + (alpha / r) * B @ A (r: the module's rank, peft's scale), in double, rounded once to W's
 * dtype. */
static int merge_param(const struct am_st_file *af, struct module *m, double alpha, struct am_errors *err);

static int merge_one(const struct am_st_file *af, struct module *m, double alpha, struct am_errors *err)
{
    if (m->param)
        return merge_param(af, m, alpha, err);
    long r = m->r;
    double scale = alpha / (double)r;
    int64_t out = m->w->shape[0], in = m->w->shape[1];
    float *a = malloc((size_t)(r * in) * sizeof(float) + 1), *b = malloc((size_t)(out * r) * sizeof(float) + 1);
    float *w = malloc((size_t)in * sizeof(float) + 1);
    m->merged = malloc((size_t)(out * in) * (m->w->dtype == AM_ST_F32 ? 4 : 2) + 1);
    double *row = malloc((size_t)in * sizeof(double) + 1);
    int rc = -1;
    if (!a || !b || !w || !m->merged || !row) {
        am_errorf(err, NULL, "out of memory");
        goto out;
    }
    if (am_st_read_f32(af, m->a, 0, r * in, a, err) < 0 || am_st_read_f32(af, m->b, 0, out * r, b, err) < 0)
        goto out;
    for (int64_t o = 0; o < out; o++) {
        if (am_st_read_f32(m->wfile, m->w, o * in, in, w, err) < 0)
            goto out;
        for (int64_t i = 0; i < in; i++)
            row[i] = 0.0;
        for (long k = 0; k < r; k++) {
            double bk = b[o * r + k];
            const float *ak = a + k * in;
            for (int64_t i = 0; i < in; i++)
                row[i] += bk * (double)ak[i];
        }
        for (int64_t i = 0; i < in; i++)
            store(m->w->dtype, m->merged, o * in + i, (double)w[i] + scale * row[i]);
    }
    rc = 0;
out:
    free(a);
    free(b);
    free(w);
    free(row);
    return rc;
}

/* A ParamWrapper's parameter [E, in, out]: W_e + (alpha / r) * A_eᵀ B_eᵀ (peft's delta for x @ W),
 * in double, rounded once to W's dtype. */
static int merge_param(const struct am_st_file *af, struct module *m, double alpha, struct am_errors *err)
{
    long r = m->r;
    double scale = alpha / (double)r;
    int64_t E = m->w->shape[0], in = m->w->shape[1], out = m->w->shape[2], rE = r * E;
    float *a = malloc((size_t)(rE * in) * sizeof(float) + 1), *b = malloc((size_t)(out * rE) * sizeof(float) + 1);
    float *w = malloc((size_t)out * sizeof(float) + 1);
    m->merged = malloc((size_t)(E * in * out) * (m->w->dtype == AM_ST_F32 ? 4 : 2) + 1);
    double *row = malloc((size_t)out * sizeof(double) + 1);
    int rc = -1;
    if (!a || !b || !w || !m->merged || !row) {
        am_errorf(err, NULL, "out of memory");
        goto out;
    }
    if (am_st_read_f32(af, m->a, 0, rE * in, a, err) < 0 || am_st_read_f32(af, m->b, 0, out * rE, b, err) < 0)
        goto out;
    for (int64_t e = 0; e < E; e++)
        for (int64_t i = 0; i < in; i++) {
            int64_t at = (e * in + i) * out;
            if (am_st_read_f32(m->wfile, m->w, at, out, w, err) < 0)
                goto out;
            for (int64_t o = 0; o < out; o++) {
                double d = 0.0;
                for (long k = 0; k < r; k++)
                    d += (double)a[(e * r + k) * in + i] * (double)b[o * rE + k * E + e];
                row[o] = d;
            }
            for (int64_t o = 0; o < out; o++)
                store(m->w->dtype, m->merged, at + o, (double)w[o] + scale * row[o]);
        }
    rc = 0;
out:
    free(a);
    free(b);
    free(w);
    free(row);
    return rc;
}

static uint64_t tensor_bytes(const struct am_st_info *t)
{
    uint64_t n = (uint64_t)am_st_dtype_bits(t->dtype);
    for (int d = 0; d < t->ndim; d++)
        n *= (uint64_t)t->shape[d];
    return n / 8;
}

static bool weight_file(const char *n)
{
    static const char *const sfx[] = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                                      ".bin.index.json", ".h5.index.json", ".msgpack.index.json"};
    for (size_t i = 0; i < sizeof(sfx) / sizeof(sfx[0]); i++)
        if (ends_with(n, sfx[i]))
            return true;
    return false;
}

/* Writes the base's files into tmp: copies, and the safetensors with the merged weights. */
static int write_out(const char *tmp, const struct am_ckpt *base, struct module *m, size_t nm, struct am_progress *bar,
                     struct am_errors *err)
{
    const char *bdir = am_ckpt_dir(base);
    DIR *d = opendir(bdir);
    struct dirent *de;
    char from[4400], to[4400];
    if (!d) {
        am_errorf(err, NULL, "%s: cannot list: %s", bdir, strerror(errno));
        return -1;
    }
    while ((de = readdir(d))) {
        struct stat st;
        if (de->d_name[0] == '.' || weight_file(de->d_name) || am_path_cat(from, sizeof(from), bdir, "/", de->d_name) < 0 ||
            stat(from, &st) < 0 || !S_ISREG(st.st_mode))
            continue;
        if (am_path_cat(to, sizeof(to), tmp, "/", de->d_name) < 0 || am_copy_file(from, to, 0644) < 0) {
            am_errorf(err, NULL, "%s: cannot copy to %s: %s", from, tmp, strerror(errno));
            closedir(d);
            return -1;
        }
    }
    closedir(d);
    /* every safetensors file of the base, once, with its tensors */
    size_t n = am_ckpt_count(base), nf = 0;
    const struct am_st_file **files = calloc(n + 1, sizeof(*files));
    int rc = -1;
    if (!files) {
        am_errorf(err, NULL, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        const struct am_st_file *f;
        am_ckpt_find(base, am_ckpt_name(base, i), &f);
        size_t j;
        for (j = 0; j < nf && files[j] != f; j++)
            ;
        if (j == nf)
            files[nf++] = f;
    }
    uint64_t total = 0, done = 0;
    for (size_t j = 0; j < nf; j++)
        for (size_t i = 0; i < am_st_count(files[j]); i++)
            total += tensor_bytes(am_st_at(files[j], i));
    if (bar)
        am_progress_start(bar, "am-ckpt merge", NULL, total, bar->on);
    for (size_t j = 0; j < nf; j++) {
        const struct am_st_file *f = files[j];
        size_t nt = am_st_count(f);
        struct am_st_wtensor *wt = calloc(nt + 1, sizeof(*wt));
        if (!wt) {
            am_errorf(err, NULL, "out of memory");
            goto out;
        }
        for (size_t i = 0; i < nt; i++) {
            const struct am_st_info *t = am_st_at(f, i);
            wt[i] = (struct am_st_wtensor){.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .data = t->data};
            memcpy(wt[i].shape, t->shape, sizeof(t->shape));
            for (size_t k = 0; k < nm; k++)
                if (m[k].w == t)
                    wt[i].data = m[k].merged;
        }
        const char *slash = strrchr(am_st_path(f), '/');
        int w = am_path_cat(to, sizeof(to), tmp, "/", slash ? slash + 1 : am_st_path(f));
        if (w == 0)
            w = am_st_write(to, wt, nt, NULL, 0, 0, err);
        free(wt);
        if (w < 0) {
            if (errno == ENAMETOOLONG)
                am_errorf(err, NULL, "%s: path too long", tmp);
            goto out;
        }
        for (size_t i = 0; i < nt; i++)
            done += tensor_bytes(am_st_at(f, i));
        if (bar)
            am_progress_set(bar, done, 0);
    }
    rc = 0;
out:
    if (bar)
        am_progress_end(bar, rc == 0);
    free(files);
    return rc;
}

long am_peft_merge(const char *base_dir, const char *peft_dir, const char *out_in, struct am_progress *bar,
                   struct am_errors *err)
{
    char out[4096], tmp[4200] = "", path[4400];
    struct am_ckpt *base = NULL;
    struct am_st_file *af = NULL;
    struct module *m = NULL;
    size_t nm = 0;
    long r = 0, rc = -1;
    double alpha = 0;
    struct ranks ranks = {0};
    struct params params = {0};
    size_t len = strlen(out_in);
    while (len > 1 && out_in[len - 1] == '/')
        len--;
    if (len == 0 || len >= sizeof(out) - 64) {
        am_errorf(err, NULL, "%s: not a usable directory name", out_in);
        return -1;
    }
    memcpy(out, out_in, len);
    out[len] = '\0';
    struct stat st;
    if (lstat(out, &st) == 0) {
        DIR *d = S_ISDIR(st.st_mode) ? opendir(out) : NULL;
        int entries = 0;
        for (struct dirent *de; d && (de = readdir(d));)
            entries += strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0;
        if (d)
            closedir(d);
        if (!S_ISDIR(st.st_mode) || entries > 0) {
            am_errorf(err, NULL, "%s: exists and is %s: am-ckpt merge writes a new directory and never overwrites "
                      "one: name a directory that does not exist (or is empty)", out,
                      S_ISDIR(st.st_mode) ? "not empty" : "not a directory");
            return -1;
        }
    } else if (errno != ENOENT) {
        am_errorf(err, NULL, "%s: %s", out, strerror(errno));
        return -1;
    }
    if (am_path_cat(path, sizeof(path), base_dir, "/", "config.json") < 0 || access(path, R_OK) != 0) {
        am_errorf(err, NULL, "%s: missing: the base is a Hugging Face model directory (config.json and "
                  "model.safetensors, or its index and shards): name the directory of the model the adapters "
                  "were trained on", path);
        return -1;
    }
    if (am_ckpt_open(base_dir, &base, err) < 0)
        return -1;
    if (am_path_cat(path, sizeof(path), peft_dir, "/", "adapter_config.json") < 0 ||
        read_config(path, &r, &alpha, &ranks, &params, err) < 0)
        goto done;
    /* the base's model_type: gpt_oss's experts are the parameters merged as x @ W */
    bool transposed = false;
    if (am_path_cat(path, sizeof(path), base_dir, "/", "config.json") == 0) {
        json_t *bc = json_load_file(path, 0, NULL);
        const char *mt = json_string_value(json_object_get(bc, "model_type"));
        transposed = mt && strcmp(mt, "gpt_oss") == 0;
        json_decref(bc);
    }
    if (am_path_cat(path, sizeof(path), peft_dir, "/", "adapter_model.safetensors") < 0)
        goto done;
    if (access(path, F_OK) != 0) {
        char bin[4400];
        am_path_cat(bin, sizeof(bin), peft_dir, "/", "adapter_model.bin");
        am_errorf(err, NULL, "%s: missing%s: an adapter directory holds adapter_config.json and "
                  "adapter_model.safetensors, as peft saves them: %s", path,
                  access(bin, F_OK) == 0 ? " (there is an adapter_model.bin, a pickle am does not read)" : "",
                  access(bin, F_OK) == 0 ? "save the adapters again with safe_serialization=True"
                                         : "name a step-N/peft directory or one PeftModel.save_pretrained wrote");
        goto done;
    }
    if (am_st_open(path, &af, err) < 0 || collect(af, base, r, &ranks, &params, transposed, &m, &nm, err) < 0)
        goto done;
    for (size_t j = 0; j < nm; j++)
        if (merge_one(af, &m[j], alpha, err) < 0)
            goto done;
    if (am_temp_dir(out, tmp, sizeof(tmp), err) < 0)
        goto done;
    if (write_out(tmp, base, m, nm, bar, err) < 0)
        goto done;
    if (am_fsync_dir_of(tmp, true) < 0 || rename(tmp, out) < 0) { /* over an empty directory, or none */
        am_errorf(err, NULL, "%s: cannot move %s into place: %s", out, tmp, strerror(errno));
        goto done;
    }
    tmp[0] = '\0';
    am_fsync_dir_of(out, false);
    rc = (long)nm;
done:
    if (tmp[0])
        am_remove_tree(tmp);
    for (size_t j = 0; m && j < nm; j++) {
        free(m[j].name);
        free(m[j].wname);
        free(m[j].merged);
    }
    free(m);
    ranks_free(&ranks);
    params_free(&params);
    if (af)
        am_st_close(af);
    am_ckpt_close(base);
    return rc;
}
