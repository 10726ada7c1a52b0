/* am-ckpt - what a sharded training checkpoint holds, and its export to Hugging Face.
 *
 *   am-ckpt show DIR          the step, the layout it was saved at, the optimizer, data and
 *                             schedule state, its files and tensors (DIR: a step-N directory,
 *                             or a checkpoint_dir, whose `latest` is shown)
 *   am-ckpt export DIR OUT    the master weights as a Hugging Face directory (config.json +
 *                             safetensors), offline, from any layout: every shard checked
 *                             (size, crc32c) first; in the dtype of the run's own save (bf16 for
 *                             model.torch_dtype bfloat16, else fp32), or --dtype's: bfloat16
 *                             rounds them to bf16 (torch_dtype bfloat16), as AutoModel's
 *                             consolidated save of a bf16 model; never quantised (no quantization_config: a model trained
 *                             from an FP8 checkpoint is exported dequantised, and --dtype asking
 *                             for FP8 is refused with the reason); gpt_oss's experts, held
 *                             apart in the shards, written fused as transformers reads them
 *                             (gate_up_proj, down_proj and their biases: the consolidated save's)
 *   am-ckpt merge BASE PEFT OUT
 *                             LoRA adapters merged into their base model, as a Hugging Face
 *                             directory: W + (lora_alpha / r) * B @ A in the base's dtype, every
 *                             other tensor and file copied (peft_merge.h); OUT must not exist
 *
 * export and merge take --progress / --quiet (after the command): the progress line on stderr,
 * shown by default when stderr is a terminal (progress.h).
 * Exit status: 0, 1 when the checkpoint is refused (with the reason), 2 on a usage error. */
#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"
#include "checkpoint.h"
#include "model_config.h"
#include "peft_merge.h"
#include "progress.h"
#include "safetensors.h"
#include "shard_ckpt.h"
#include "version.h"

static int usage(FILE *out)
{
    fprintf(out, "usage: am-ckpt show DIR\n       am-ckpt export [--progress|--quiet] [--dtype float32|bfloat16] DIR OUT\n"
            "       am-ckpt merge [--progress|--quiet] BASE PEFT OUT\n"
            "DIR: a checkpoint (step-N, with manifest.json) or a checkpoint_dir (its `latest`)\n"
            "merge: LoRA adapters (PEFT: a step-N/peft directory, or one peft saved) merged into the base model\n"
            "(BASE: a Hugging Face model directory) as a new Hugging Face directory OUT (which must not exist)\n"
            "export and merge show their progress on a terminal (--progress: always; --quiet: never)\n");
    return out == stdout ? 0 : 2;
}

static int open_dir(const char *arg, struct am_sckpt **c)
{
    char dir[4096], err[2048];
    bool found;
    if (am_sckpt_resolve(arg, arg, dir, sizeof(dir), &found, err, sizeof(err)) < 0 || !found) {
        fprintf(stderr, "am-ckpt: %s\n", found ? err : "no checkpoint there (no manifest.json, no `latest`)");
        return -1;
    }
    if (am_sckpt_open(dir, c, err, sizeof(err)) < 0) {
        fprintf(stderr, "am-ckpt: %s\n", err);
        return -1;
    }
    return 0;
}

static json_int_t geti(json_t *o, const char *a, const char *b)
{
    return json_integer_value(json_object_get(json_object_get(o, a), b));
}

static int show(const char *arg)
{
    struct am_sckpt *c;
    if (open_dir(arg, &c) < 0)
        return 1;
    json_t *man = am_sckpt_json(c), *meta = am_sckpt_meta(c), *mc = json_object_get(meta, "model_config");
    printf("checkpoint    %s\n", am_sckpt_dir(c));
    printf("step          %ld (saved at unix time %.0f)\n", am_sckpt_step(c),
           json_number_value(json_object_get(man, "time")));
    printf("model         %s, hidden %lld, %lld layers, vocab %lld (hash %s)\n",
           json_string_value(json_object_get(mc, "model_type")) ? json_string_value(json_object_get(mc, "model_type"))
                                                                   : "?",
           (long long)json_integer_value(json_object_get(mc, "hidden_size")),
           (long long)json_integer_value(json_object_get(mc, "num_hidden_layers")),
           (long long)json_integer_value(json_object_get(mc, "vocab_size")), am_sckpt_model_hash(c));
    printf("layout        world %lld: tp %lld, pp %lld, dp %lld (replicate %lld x shard %lld), cp %lld, ep %lld; "
           "%s, ZeRO %lld\n", (long long)geti(meta, "layout", "world"), (long long)geti(meta, "layout", "tp"),
           (long long)geti(meta, "layout", "pp"), (long long)geti(meta, "layout", "dp"),
           (long long)geti(meta, "layout", "dp_replicate"), (long long)geti(meta, "layout", "dp_shard"),
           (long long)geti(meta, "layout", "cp"), (long long)geti(meta, "layout", "ep"),
           json_string_value(json_object_get(meta, "strategy")) ? json_string_value(json_object_get(meta, "strategy"))
                                                                 : "?",
           (long long)json_integer_value(json_object_get(meta, "zero_stage")));
    printf("optimizer     AdamW, %lld steps taken\n", (long long)geti(meta, "optimizer", "step"));
    printf("data          %lld samples consumed (global batch %lld of %lld tokens), dataset seed %lld\n",
           (long long)geti(meta, "data", "samples"), (long long)geti(meta, "data", "global_batch"),
           (long long)geti(meta, "data", "seq_length"), (long long)geti(meta, "data", "seed"));
    printf("lr schedule   %s, next lr %g\n",
           json_string_value(json_object_get(json_object_get(meta, "lr_scheduler"), "style")) ?: "?",
           json_number_value(json_object_get(json_object_get(meta, "lr_scheduler"), "next_lr")));
    printf("rng           seed %lld\n", (long long)geti(meta, "rng", "seed"));
    json_t *files = json_object_get(man, "files"), *f;
    size_t i;
    json_int_t bytes = 0;
    json_array_foreach(files, i, f)
        bytes += json_integer_value(json_object_get(f, "bytes"));
    printf("files         %zu shards, %lld bytes (masters, AdamW m and v in fp32)\n", json_array_size(files),
           (long long)bytes);
    json_int_t params = 0;
    for (i = 0; i < am_sckpt_n_tensors(c); i++) {
        struct am_sckpt_tensor_info t;
        am_sckpt_tensor(c, i, &t);
        params += t.rows * t.cols;
    }
    printf("tensors       %zu, %lld parameters\n", am_sckpt_n_tensors(c), (long long)params);
    for (i = 0; i < am_sckpt_n_tensors(c); i++) {
        struct am_sckpt_tensor_info t;
        am_sckpt_tensor(c, i, &t);
        if (t.ndim == 2)
            printf("  %-56s [%lld, %lld]  %zu pieces\n", t.name, (long long)t.rows, (long long)t.cols, t.n_pieces);
        else
            printf("  %-56s [%lld]  %zu pieces\n", t.name, (long long)t.rows, t.n_pieces);
    }
    am_sckpt_close(c);
    return 0;
}

/* The safetensors writer's fill: tensor `index`, read whole once, then handed out in chunks. */
struct exporter {
    struct am_sckpt *c;
    const struct am_model_config *cfg;
    size_t *which; /* safetensors index -> checkpoint tensor; from am_sckpt_n_tensors on: gpt_oss's fused
                      tensor 4 l + k of layer l (fuse_gpt_oss's k: gate_up_proj, its bias, down_proj, its bias) */
    size_t current;
    float *buf;
    bool bf16; /* --dtype bfloat16: buf's values rounded to bf16, in place */
    bool split; /* ... as FusedAdam's store_param_remainders splits its masters: ties away from zero */
    char err[2048];
    struct am_progress bar; /* the bytes of the tensors read */
    uint64_t done;
};

/* The number of floats of gpt_oss's fused tensor k of a layer (fill's which): [E, C, 2I], [E, 2I], [E, I, C], [E, C]. */
static int64_t fused_numel(const struct am_model_config *cfg, int k)
{
    int64_t C = cfg->hidden_size, I = cfg->moe_intermediate_size, E = cfg->num_experts;
    return k == 0 ? E * C * 2 * I : k == 1 ? E * 2 * I : k == 2 ? E * I * C : E * C;
}

/* gpt_oss: fused tensor k of layer l into buf, from the checkpoint's per-expert tensors (am's
 * mlp.experts.e.{gate,up,down}_proj.{weight,bias}), as the consolidated save fuses them
 * (model_io.c's fuse_gpt_oss): gate at the even columns of gate_up_proj, up at the odd; down_proj
 * [I, C] per expert (x @ W), am's [C, I] transposed. 0, or -1 with a message in x->err. */
static int read_fused(struct exporter *x, long l, int k, float *buf)
{
    int64_t C = x->cfg->hidden_size, I = x->cfg->moe_intermediate_size, E = x->cfg->num_experts;
    float *w = malloc((size_t)(I * C) * sizeof(float));
    int rc = w ? 0 : -1;
    if (!w)
        snprintf(x->err, sizeof(x->err), "out of memory");
    static const char *const kinds[3] = {"gate_proj", "up_proj", "down_proj"};
    bool down = k >= 2, bias = k & 1;
    for (int64_t e = 0; e < E && rc == 0; e++)
        for (int h = down ? 2 : 0; h < (down ? 3 : 2) && rc == 0; h++) { /* gate and up, or down */
            char name[160];
            snprintf(name, sizeof(name), "model.layers.%ld.mlp.experts.%lld.%s.%s", l, (long long)e, kinds[h],
                     bias ? "bias" : "weight");
            int i = am_sckpt_find(x->c, name);
            struct am_sckpt_tensor_info t = {0};
            if (i >= 0)
                am_sckpt_tensor(x->c, (size_t)i, &t);
            int64_t rows = down ? C : I, cols = bias ? 1 : down ? I : C; /* a vector has one column */
            if (i < 0 || t.rows != rows || t.cols != cols) {
                snprintf(x->err, sizeof(x->err), "%s: tensor %s %s (the checkpoint is damaged: export another)",
                         am_sckpt_dir(x->c), name, i < 0 ? "is missing" : "has another shape than the config's");
                rc = -1;
            } else if ((rc = am_sckpt_read(x->c, (size_t)i, 0, 0, rows, 0, cols, w, cols, NULL, x->err,
                                           sizeof(x->err))) == 0) {
                for (int64_t a = 0; k == 0 && a < I; a++) /* gate_up_proj [E, C, 2I] */
                    for (int64_t b = 0; b < C; b++)
                        buf[(e * C + b) * 2 * I + 2 * a + h] = w[a * C + b];
                for (int64_t a = 0; k == 1 && a < I; a++) /* gate_up_proj_bias [E, 2I] */
                    buf[e * 2 * I + 2 * a + h] = w[a];
                for (int64_t a = 0; k == 2 && a < I; a++) /* down_proj [E, I, C] */
                    for (int64_t b = 0; b < C; b++)
                        buf[(e * I + a) * C + b] = w[b * I + a];
                if (k == 3) /* down_proj_bias [E, C] */
                    memcpy(buf + e * C, w, (size_t)C * sizeof(float));
            }
        }
    free(w);
    return rc;
}

static int fill(void *ctx, size_t index, uint64_t offset, void *dst, size_t n, struct am_errors *err)
{
    struct exporter *x = ctx;
    struct am_sckpt_tensor_info t = {0};
    size_t nt = am_sckpt_n_tensors(x->c), fused = x->which[index] >= nt ? x->which[index] - nt : 0;
    if (x->which[index] < nt)
        am_sckpt_tensor(x->c, x->which[index], &t);
    else /* gpt_oss's fused tensor: its floats as one row */
        t = (struct am_sckpt_tensor_info){.rows = 1, .cols = fused_numel(x->cfg, (int)(fused % 4))};
    if (x->current != index || !x->buf) {
        am_progress_set(&x->bar, x->done, 0);
        x->done += (uint64_t)(t.rows * t.cols) * sizeof(float);
        free(x->buf);
        x->buf = malloc((size_t)(t.rows * t.cols) * sizeof(float) + 1);
        x->current = index;
        if (!x->buf ||
            (x->which[index] < nt ? am_sckpt_read(x->c, x->which[index], 0, 0, t.rows, 0, t.cols, x->buf, t.cols, NULL,
                                                  x->err, sizeof(x->err))
                                  : read_fused(x, (long)(fused / 4), (int)(fused % 4), x->buf)) < 0) {
            am_errors_fail(err, "%s", x->buf ? x->err : "out of memory");
            free(x->buf);
            x->buf = NULL;
            return -1;
        }
        uint16_t *h = (uint16_t *)x->buf; /* in place: element i's 2 bytes lie below float i's */
        for (int64_t i = 0; x->bf16 && i < t.rows * t.cols; i++) {
            uint16_t lo;
            if (x->split)
                am_te_master_split(am_f32_bits(x->buf[i]), &h[i], &lo);
            else
                h[i] = am_f32_to_bf16(x->buf[i]);
        }
    }
    memcpy(dst, (char *)x->buf + offset, n);
    return 0;
}

/* The experts' selection biases of a run that updated them (deepseek_v3's gate_bias_update_factor:
 * the trainer's selection_bias/, one file per pipeline stage): each MoE layer's, fp32, appended
 * to wt[*n] from the files kept open in files[] (closed by the caller). 0 when there is no such
 * directory (*n unchanged), 1 with them all, -1 with a message in e. */
#define AM_CKPT_BIAS_FILES 4096

static int add_biases(const char *dir, const struct am_model_config *cfg, struct am_st_wtensor **wt, size_t *n,
                      struct am_st_file **files, size_t *nf, struct am_arena *a, struct am_errors *e)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/selection_bias", dir);
    DIR *d = opendir(path);
    if (!d)
        return 0;
    for (struct dirent *de; (de = readdir(d)) && *nf < AM_CKPT_BIAS_FILES;) {
        size_t len = strlen(de->d_name);
        if (len < 12 || strcmp(de->d_name + len - 12, ".safetensors") != 0)
            continue;
        char f[4600];
        snprintf(f, sizeof(f), "%s/%s", path, de->d_name);
        if (am_st_open(f, &files[*nf], e) < 0)
            break;
        (*nf)++;
    }
    closedir(d);
    if (e->n)
        return -1;
    struct am_st_wtensor *v = realloc(*wt, (*n + (size_t)cfg->num_hidden_layers + 1) * sizeof(*v));
    if (!v) {
        am_errorf(e, NULL, "out of memory");
        return -1;
    }
    *wt = v;
    for (long l = 0; l < cfg->num_hidden_layers; l++) {
        if (!am_model_layer_is_moe(cfg, l))
            continue;
        char name[128];
        snprintf(name, sizeof(name), "model.layers.%ld.mlp.gate.e_score_correction_bias", l);
        const struct am_st_info *t = NULL;
        for (size_t i = 0; i < *nf && !t; i++)
            t = am_st_find(files[i], name);
        if (!t || t->dtype != AM_ST_F32 || t->ndim != 1 || t->shape[0] != cfg->num_experts) {
            am_errorf(e, NULL, "%s: %s %s (the checkpoint is damaged: export another)", path, name,
                      t ? "is not one fp32 per expert" : "is in none of its files");
            return -1;
        }
        v[(*n)++] = (struct am_st_wtensor){.name = am_arena_strdup(a, name), .dtype = AM_ST_F32, .ndim = 1,
                                           .shape = {t->shape[0]}, .data = t->data};
    }
    return 1;
}

/* dtype: "float32", "bfloat16", or NULL for the dtype of the run's own Hugging Face save (the
 * manifest's model_dtype: bfloat16 for bf16 parameters, float32 otherwise and for older
 * checkpoints) */
static int export(const char *arg, const char *out, bool show, const char *dtype)
{
    struct am_sckpt *c;
    char path[4200], err[2048], hash[17];
    struct am_errors e;
    struct am_arena a;
    struct am_list ignored = {0};
    struct am_model_config cfg;
    struct am_st_file *bias_files[AM_CKPT_BIAS_FILES]; /* selection_bias/ (add_biases) */
    size_t n_bias_files = 0, n_wt = 0;
    bool *fused = NULL;
    int rc = 1;
    if (open_dir(arg, &c) < 0)
        return 1;
    am_errors_init(&e);
    am_arena_init(&a, 64u << 20);
    if (!dtype) {
        const char *kept = json_string_value(json_object_get(am_sckpt_meta(c), "model_dtype"));
        dtype = kept && strcmp(kept, "bfloat16") == 0 ? "bfloat16" : "float32";
    }
    bool bf16 = strcmp(dtype, "bfloat16") == 0;
    /* a run whose parameters are its masters split as TE splits them (resume.c): those exactly */
    bool split = json_is_true(json_object_get(json_object_get(am_sckpt_meta(c), "optimizer"), "param_remainders"));
    struct exporter x = {.c = c, .current = (size_t)-1, .bf16 = bf16, .split = bf16 && split};
    struct am_st_wtensor *wt = calloc(am_sckpt_n_tensors(c) + 1, sizeof(*wt));
    x.which = calloc(am_sckpt_n_tensors(c) + 1, sizeof(size_t));
    if (!wt || !x.which) {
        fprintf(stderr, "am-ckpt: out of memory\n");
        goto out;
    }
    if (am_sckpt_verify(c, err, sizeof(err)) < 0) {
        fprintf(stderr, "am-ckpt: %s\n", err);
        goto out;
    }
    snprintf(path, sizeof(path), "%s/config.json", am_sckpt_dir(c));
    struct am_node *node = am_json_file_to_node(&a, path, &e);
    if (!node || am_model_config_read(&a, node, "config.json", &cfg, &ignored, &e) < 0 || e.n)
        goto errs;
    n_wt = am_sckpt_n_tensors(c);
    int biases = cfg.sigmoid_router ? add_biases(am_sckpt_dir(c), &cfg, &wt, &n_wt, bias_files, &n_bias_files, &a, &e)
                                    : 0;
    if (biases < 0)
        goto errs;
    if (cfg.sigmoid_router && biases == 0) { /* its selection biases are buffers of the model, not in the shards */
        fprintf(stderr, "am-ckpt: %s is a %s model, whose experts' selection biases (e_score_correction_bias, "
                "not trained: the recipe's model directory's) are not in a sharded checkpoint: an export without "
                "them would be another model; train with checkpoint.save_consolidated: its hf/ directory beside the "
                "shards holds them\n", am_sckpt_dir(c), cfg.model_type);
        goto out;
    }
    char *text = am_ckpt_config_json(&cfg, NULL, &e);
    if (!text)
        goto errs;
    am_sckpt_hash_text(text, hash);
    free(text);
    if (strcmp(hash, am_sckpt_model_hash(c)) != 0) {
        fprintf(stderr, "am-ckpt: %s describes a model of hash %s, the manifest says %s (the directory was changed: "
                "export another checkpoint)\n", path, hash, am_sckpt_model_hash(c));
        goto out;
    }
    size_t n = am_sckpt_n_tensors(c), k = 0; /* k: the tensors written */
    uint64_t total = 0;
    x.cfg = &cfg;
    fused = cfg.gpt_oss ? calloc((size_t)cfg.num_hidden_layers + 1, 1) : NULL; /* a layer's experts listed */
    if (cfg.gpt_oss && !fused) {
        fprintf(stderr, "am-ckpt: out of memory\n");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        struct am_sckpt_tensor_info t;
        am_sckpt_tensor(c, i, &t);
        long l;
        long long ex;
        if (cfg.gpt_oss && sscanf(t.name, "model.layers.%ld.mlp.experts.%lld.", &l, &ex) == 2 && l >= 0 &&
            l < cfg.num_hidden_layers) { /* an expert's tensor: transformers' GptOssExperts reads them fused */
            static const char *const names[4] = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"};
            int64_t C = cfg.hidden_size, I = cfg.moe_intermediate_size, E = cfg.num_experts;
            const int64_t shapes[4][3] = {{E, C, 2 * I}, {E, 2 * I}, {E, I, C}, {E, C}};
            for (int f = 0; !fused[l] && f < 4; f++) { /* in place of the layer's first expert tensor */
                char name[128];
                snprintf(name, sizeof(name), "model.layers.%ld.mlp.experts.%s", l, names[f]);
                x.which[k] = n + 4 * (size_t)l + (size_t)f;
                total += (uint64_t)fused_numel(&cfg, f) * sizeof(float);
                wt[k++] = (struct am_st_wtensor){.name = am_arena_strdup(&a, name), .dtype = bf16 ? AM_ST_BF16 : AM_ST_F32,
                                                 .ndim = f & 1 ? 2 : 3, .shape = {shapes[f][0], shapes[f][1], shapes[f][2]},
                                                 .fill = fill, .ctx = &x};
            }
            fused[l] = true;
            continue;
        }
        if (strstr(t.name, ".lora_A.") || strstr(t.name, ".lora_B.")) { /* a LoRA fine-tune's state: no model */
            fprintf(stderr, "am-ckpt: %s holds LoRA adapters, not a model (the frozen base is the recipe's model "
                    "directory): its peft/ directory holds them as the peft library saves them, for "
                    "PeftModel.from_pretrained(base, \"%s/peft\"), or for a merged model: am-ckpt merge BASE_DIR "
                    "%s/peft OUT_DIR\n", am_sckpt_dir(c), am_sckpt_dir(c), am_sckpt_dir(c));
            goto out;
        }
        x.which[k] = i;
        total += (uint64_t)(t.rows * t.cols) * sizeof(float);
        wt[k++] = (struct am_st_wtensor){.name = t.name, .dtype = bf16 ? AM_ST_BF16 : AM_ST_F32, .ndim = t.ndim,
                                         .shape = {t.rows, t.cols}, .fill = fill, .ctx = &x};
    }
    /* the biases (add_biases) after the tensors of the shards */
    memmove(wt + k, wt + n, (n_wt - n) * sizeof(*wt));
    k += n_wt - n;
    am_progress_start(&x.bar, "am-ckpt export", NULL, total, show);
    struct am_ckpt_save_opts opts = {.torch_dtype = bf16 ? "bfloat16" : NULL};
    if (am_ckpt_save(out, &cfg, wt, k, &opts, &e) < 0) {
        am_progress_end(&x.bar, false);
        goto errs;
    }
    am_progress_set(&x.bar, x.done, 0);
    am_progress_end(&x.bar, true);
    printf("am-ckpt: exported step %ld (%zu tensors) to %s\n", am_sckpt_step(c), k, out);
    rc = 0;
    goto out;
errs:
    for (size_t i = 0; i < e.n; i++)
        fprintf(stderr, "am-ckpt: %s\n", e.msg[i]);
out:
    for (size_t i = 0; i < n_bias_files; i++)
        am_st_close(bias_files[i]);
    free(fused);
    free(x.buf);
    free(x.which);
    free(wt);
    am_arena_free(&a);
    am_errors_free(&e);
    am_sckpt_close(c);
    return rc;
}

static int merge(const char *base, const char *peft, const char *out, bool show)
{
    struct am_errors e;
    struct am_progress bar = {.on = show};
    am_errors_init(&e);
    long n = am_peft_merge(base, peft, out, &bar, &e);
    for (size_t i = 0; i < e.n; i++)
        fprintf(stderr, "am-ckpt: %s\n", e.msg[i]);
    am_errors_free(&e);
    if (n < 0)
        return 1;
    printf("am-ckpt: merged %ld adapted weights of %s into %s, written to %s\n", n, peft, base, out);
    return 0;
}

int main(int argc, char **argv)
{
    if (am_version_option(argc, argv, "am-ckpt"))
        return 0;
    bool show_progress = isatty(2); /* --progress / --quiet: shown or not, after the command */
    const char *dtype = NULL;        /* export --dtype (NULL: the run's) */
    int n = 0;
    for (int i = 0; i < argc; i++) {
        int o = i >= 2 ? am_progress_option(argv[i]) : -1;
        if (o >= 0)
            show_progress = o;
        else if (i >= 2 && strncmp(argv[i], "--dtype=", 8) == 0)
            dtype = argv[i] + 8;
        else if (i >= 2 && strcmp(argv[i], "--dtype") == 0 && i + 1 < argc)
            dtype = argv[++i];
        else
            argv[n++] = argv[i];
    }
    if (dtype && (strcmp(dtype, "bf16") == 0 || strcmp(dtype, "fp32") == 0))
        dtype = strcmp(dtype, "bf16") == 0 ? "bfloat16" : "float32";
    if (dtype && strcmp(dtype, "bfloat16") != 0 && strcmp(dtype, "float32") != 0) {
        if (strstr(dtype, "fp8") || strstr(dtype, "float8") || strstr(dtype, "e4m3") || strstr(dtype, "fp4") ||
            strstr(dtype, "mxfp4") || strstr(dtype, "int8") || strstr(dtype, "int4")) {
            fprintf(stderr, "am-ckpt: --dtype %s: am does not re-quantise: the trained weights would be rounded to "
                    "a few bits per block scale (e4m3 keeps 3 mantissa bits), losing the fine-tuning's small updates, "
                    "and no such rounding is checked against the tools that serve the model; export float32 or "
                    "bfloat16 and quantise with the serving stack's own tool\n", dtype);
            return 1;
        }
        fprintf(stderr, "am-ckpt: --dtype %s: expected float32 or bfloat16\n", dtype);
        return 2;
    }
    argc = n;
    if (argc == 5 && strcmp(argv[1], "merge") == 0)
        return merge(argv[2], argv[3], argv[4], show_progress);
    if (argc == 3 && strcmp(argv[1], "show") == 0)
        return show(argv[2]);
    if (argc == 4 && strcmp(argv[1], "export") == 0)
        return export(argv[2], argv[3], show_progress, dtype);
    if (argc == 2 && strcmp(argv[1], "--help") == 0)
        return usage(stdout);
    return usage(stderr);
}
