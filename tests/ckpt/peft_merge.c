/* peft_merge.c - inputs for `am-ckpt merge` (runtime/ckpt/peft_merge.h) and an independent check
 * of what it wrote. tests/ckpt/test-peft-merge.sh drives it.
 *
 *   peft_merge trained GOLDEN ADAPTER_INIT OUT   OUT: an adapter directory holding the golden's
 *                                                trained adapters ("final." tensors of
 *                                                GOLDEN/golden.safetensors: B is not zero) and
 *                                                ADAPTER_INIT/adapter_config.json
 *   peft_merge edit ADAPTER OUT KIND             OUT: ADAPTER with one fault: KIND "no-B" (the
 *                                                first lora_B dropped), "foreign" (layer 0's
 *                                                modules renamed to layer 9's), "shape" (the
 *                                                first lora_A one row short), "extra" (a
 *                                                tensor that is not a LoRA matrix added)
 *   peft_merge bf16 BASE OUT                     OUT: BASE with every tensor in BF16
 *   peft_merge shard BASE OUT                    OUT: BASE in two shards,
 *                                                model-0000{1,2}-of-00002.safetensors, and
 *                                                model.safetensors.index.json
 *   peft_merge check BASE ADAPTER OUT            every tensor of OUT against BASE: the dtype,
 *                                                shape and file kept; a weight the adapters
 *                                                adapt equal to W + (lora_alpha / r) * B @ A
 *                                                computed here in double precision within one
 *                                                unit in the last place of its dtype (am rounds
 *                                                once, so the error is at most half of one) and
 *                                                different from W where B @ A is not zero; every
 *                                                other tensor bit-identical
 * Exit status 0 when it did its work and every check passed.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "safetensors.h"

#define PFX "base_model.model."

static int fails;

static void check(int ok, const char *fmt, const char *what)
{
    if (!ok) {
        printf("FAIL: ");
        printf(fmt, what);
        printf("\n");
    }
    fails += !ok;
}

static int die(struct am_errors *e)
{
    for (size_t i = 0; i < e->n; i++)
        fprintf(stderr, "peft_merge: %s\n", e->msg[i]);
    return 1;
}

static int copy_config(const char *from_dir, const char *to_dir)
{
    char a[4096], b[4096];
    snprintf(a, sizeof(a), "%s/%s", from_dir, "adapter_config.json");
    snprintf(b, sizeof(b), "%s/%s", to_dir, "adapter_config.json");
    json_t *j = json_load_file(a, 0, NULL);
    int rc = j && json_dump_file(j, b, JSON_INDENT(2) | JSON_PRESERVE_ORDER) == 0 ? 0 : -1;
    json_decref(j);
    return rc;
}

static struct am_st_wtensor wt_of(const struct am_st_info *t, const char *name)
{
    struct am_st_wtensor w = {.name = name, .dtype = t->dtype, .ndim = t->ndim, .data = t->data};
    memcpy(w.shape, t->shape, sizeof(t->shape));
    return w;
}

static int trained(const char *golden, const char *init, const char *out)
{
    struct am_errors e;
    struct am_st_file *g;
    char path[4096];
    am_errors_init(&e);
    snprintf(path, sizeof(path), "%s/golden.safetensors", golden);
    if (am_st_open(path, &g, &e) < 0)
        return die(&e);
    struct am_st_wtensor wt[256];
    size_t n = 0;
    for (size_t i = 0; i < am_st_count(g) && n < 256; i++) {
        const struct am_st_info *t = am_st_at(g, i);
        if (strncmp(t->name, "final.", 6) == 0)
            wt[n++] = wt_of(t, t->name + 6);
    }
    snprintf(path, sizeof(path), "%s/adapter_model.safetensors", out);
    if (n == 0 || copy_config(init, out) < 0 || am_st_write(path, wt, n, NULL, 0, 0, &e) < 0)
        return die(&e) | 1;
    am_st_close(g);
    return 0;
}

static int edit(const char *src, const char *out, const char *kind)
{
    struct am_errors e;
    struct am_st_file *f;
    char path[4096];
    static char names[256][512];
    static float extra[4] = {1, 2, 3, 4};
    am_errors_init(&e);
    snprintf(path, sizeof(path), "%s/adapter_model.safetensors", src);
    if (am_st_open(path, &f, &e) < 0)
        return die(&e);
    struct am_st_wtensor wt[257];
    size_t n = 0;
    int done = 0;
    for (size_t i = 0; i < am_st_count(f) && n < 256; i++) {
        const struct am_st_info *t = am_st_at(f, i);
        snprintf(names[n], sizeof(names[n]), "%s", t->name);
        wt[n] = wt_of(t, names[n]);
        if (!done && strcmp(kind, "no-B") == 0 && strstr(t->name, ".lora_B.")) {
            done = 1;
            continue;
        }
        char *l0 = strstr(names[n], ".layers.0.");
        if (strcmp(kind, "foreign") == 0 && l0) {
            l0[8] = '9';
            done = 1;
        }
        if (!done && strcmp(kind, "shape") == 0 && strstr(t->name, ".lora_A.")) {
            wt[n].shape[0]--;
            done = 1;
        }
        n++;
    }
    if (strcmp(kind, "extra") == 0) {
        wt[n++] = (struct am_st_wtensor){.name = PFX "model.norm.weight", .dtype = AM_ST_F32, .ndim = 1,
                                         .shape = {4}, .data = extra};
        done = 1;
    }
    snprintf(path, sizeof(path), "%s/adapter_model.safetensors", out);
    if (!done || copy_config(src, out) < 0 || am_st_write(path, wt, n, NULL, 0, 0, &e) < 0)
        return die(&e) | 1;
    am_st_close(f);
    return 0;
}

static int bf16(const char *base, const char *out)
{
    struct am_errors e;
    struct am_st_file *f;
    char path[4096];
    am_errors_init(&e);
    snprintf(path, sizeof(path), "%s/model.safetensors", base);
    if (am_st_open(path, &f, &e) < 0)
        return die(&e);
    size_t n = am_st_count(f);
    struct am_st_wtensor *wt = calloc(n, sizeof(*wt));
    for (size_t i = 0; i < n; i++) {
        const struct am_st_info *t = am_st_at(f, i);
        float *x = malloc((size_t)t->numel * 4 + 4);
        uint16_t *h = malloc((size_t)t->numel * 2 + 2);
        if (am_st_read_f32(f, t, 0, t->numel, x, &e) < 0)
            return die(&e);
        for (int64_t k = 0; k < t->numel; k++)
            h[k] = am_f32_to_bf16(x[k]);
        free(x);
        wt[i] = wt_of(t, t->name);
        wt[i].dtype = AM_ST_BF16;
        wt[i].data = h;
    }
    snprintf(path, sizeof(path), "%s/model.safetensors", out);
    if (am_st_write(path, wt, n, NULL, 0, 0, &e) < 0)
        return die(&e);
    char a[4096], b[4096];
    snprintf(a, sizeof(a), "%s/config.json", base);
    snprintf(b, sizeof(b), "%s/config.json", out);
    json_t *j = json_load_file(a, 0, NULL);
    json_object_set_new(j, "dtype", json_string("bfloat16"));
    return json_dump_file(j, b, JSON_INDENT(2)) == 0 ? 0 : 1;
}

/* base with lm_head.weight left out and tie_word_embeddings true: a tied base */
static int tie(const char *base, const char *out)
{
    struct am_errors e;
    struct am_st_file *f;
    char path[4096];
    am_errors_init(&e);
    snprintf(path, sizeof(path), "%s/model.safetensors", base);
    if (am_st_open(path, &f, &e) < 0)
        return die(&e);
    size_t n = am_st_count(f), k = 0;
    struct am_st_wtensor *wt = calloc(n, sizeof(*wt));
    for (size_t i = 0; i < n; i++)
        if (strcmp(am_st_at(f, i)->name, "lm_head.weight") != 0)
            wt[k] = wt_of(am_st_at(f, i), am_st_at(f, i)->name), k++;
    snprintf(path, sizeof(path), "%s/model.safetensors", out);
    if (am_st_write(path, wt, k, NULL, 0, 0, &e) < 0)
        return die(&e);
    char a[4096], b[4096];
    snprintf(a, sizeof(a), "%s/config.json", base);
    snprintf(b, sizeof(b), "%s/config.json", out);
    json_t *j = json_load_file(a, 0, NULL);
    json_object_set_new(j, "tie_word_embeddings", json_true());
    return json_dump_file(j, b, JSON_INDENT(2)) == 0 ? 0 : 1;
}

static int shard(const char *base, const char *out)
{
    struct am_errors e;
    struct am_st_file *f;
    char path[4096];
    am_errors_init(&e);
    snprintf(path, sizeof(path), "%s/model.safetensors", base);
    if (am_st_open(path, &f, &e) < 0)
        return die(&e);
    size_t n = am_st_count(f), half = n / 2;
    struct am_st_wtensor *wt = calloc(n, sizeof(*wt));
    json_t *map = json_object();
    for (size_t i = 0; i < n; i++) {
        wt[i] = wt_of(am_st_at(f, i), am_st_at(f, i)->name);
        json_object_set_new(map, wt[i].name, json_string(i < half ? "model-00001-of-00002.safetensors"
                                                                  : "model-00002-of-00002.safetensors"));
    }
    snprintf(path, sizeof(path), "%s/model-00001-of-00002.safetensors", out);
    if (am_st_write(path, wt, half, NULL, 0, 0, &e) < 0)
        return die(&e);
    snprintf(path, sizeof(path), "%s/model-00002-of-00002.safetensors", out);
    if (am_st_write(path, wt + half, n - half, NULL, 0, 0, &e) < 0)
        return die(&e);
    json_t *index = json_pack("{s:{s:I}s:o}", "metadata", "total_size", (json_int_t)0, "weight_map", map);
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", out);
    if (json_dump_file(index, path, JSON_INDENT(2)) < 0)
        return 1;
    char a[4096], b[4096];
    snprintf(a, sizeof(a), "%s/config.json", base);
    snprintf(b, sizeof(b), "%s/config.json", out);
    json_t *j = json_load_file(a, 0, NULL);
    return json_dump_file(j, b, JSON_INDENT(2)) == 0 ? 0 : 1;
}

static int check_merge(const char *base_dir, const char *adapter, const char *out_dir)
{
    struct am_errors e;
    struct am_ckpt *base, *out;
    struct am_st_file *af;
    char path[4096];
    am_errors_init(&e);
    snprintf(path, sizeof(path), "%s/adapter_config.json", adapter);
    json_t *cfg = json_load_file(path, 0, NULL);
    if (!cfg)
        return 1;
    double r = (double)json_integer_value(json_object_get(cfg, "r"));
    double scale = json_number_value(json_object_get(cfg, "lora_alpha")) / r;
    snprintf(path, sizeof(path), "%s/adapter_model.safetensors", adapter);
    if (am_ckpt_open(base_dir, &base, &e) < 0 || am_ckpt_open(out_dir, &out, &e) < 0 || am_st_open(path, &af, &e) < 0)
        return die(&e);
    check(am_ckpt_count(base) == am_ckpt_count(out), "%s: the tensor count differs", out_dir);
    int merged = 0, copied = 0;
    double worst = 0; /* in units in the last place */
    for (size_t i = 0; i < am_ckpt_count(base); i++) {
        const char *name = am_ckpt_name(base, i);
        const struct am_st_file *bf, *of;
        const struct am_st_info *w = am_ckpt_find(base, name, &bf), *o = am_ckpt_find(out, name, &of);
        if (!o) {
            check(0, "%s: missing in the merged model", name);
            continue;
        }
        check(o->dtype == w->dtype && o->ndim == w->ndim && memcmp(o->shape, w->shape, sizeof(o->shape)) == 0,
              "%s: dtype or shape changed", name);
        check(strcmp(strrchr(am_st_path(bf), '/'), strrchr(am_st_path(of), '/')) == 0, "%s: moved to another file",
              name);
        char an[600], bn[600];
        size_t len = strlen(name);
        snprintf(an, sizeof(an), PFX "%.*s.lora_A.weight", (int)(len - 7), name);
        snprintf(bn, sizeof(bn), PFX "%.*s.lora_B.weight", (int)(len - 7), name);
        const struct am_st_info *a = len > 7 ? am_st_find(af, an) : NULL, *b = a ? am_st_find(af, bn) : NULL;
        if (!a || !b) {
            check(w->end - w->begin == o->end - o->begin && memcmp(w->data, o->data, w->end - w->begin) == 0,
                  "%s: not bit-identical to the base's", name);
            copied++;
            continue;
        }
        merged++;
        int64_t rows = w->shape[0], cols = w->shape[1], k = a->shape[0];
        float *W = malloc((size_t)(rows * cols) * 4), *O = malloc((size_t)(rows * cols) * 4);
        float *A = malloc((size_t)(k * cols) * 4), *B = malloc((size_t)(rows * k) * 4);
        if (am_st_read_f32(bf, w, 0, rows * cols, W, &e) < 0 || am_st_read_f32(of, o, 0, rows * cols, O, &e) < 0 ||
            am_st_read_f32(af, a, 0, k * cols, A, &e) < 0 || am_st_read_f32(af, b, 0, rows * k, B, &e) < 0)
            return die(&e);
        int mantissa = w->dtype == AM_ST_F32 ? 23 : w->dtype == AM_ST_BF16 ? 7 : 10;
        int bad = 0, moved = 0, delta = 0;
        for (int64_t x = 0; x < rows; x++)
            for (int64_t y = 0; y < cols; y++) {
                double ba = 0;
                for (int64_t q = k - 1; q >= 0; q--) /* another order than am's */
                    ba += (double)B[x * k + q] * (double)A[q * cols + y];
                double want = (double)W[x * cols + y] + scale * ba, got = O[x * cols + y];
                int ex;
                frexp(want, &ex);
                double ulp = ldexp(1.0, ex - 1 - mantissa);
                if (fabs(got - want) / ulp > worst)
                    worst = fabs(got - want) / ulp;
                bad += !(fabs(got - want) <= ulp);
                delta += ba != 0;
                moved += got != W[x * cols + y];
            }
        check(bad == 0, "%s: merged weights differ from W + (alpha / r) B A by more than one ulp", name);
        check(delta == 0 || moved > 0, "%s: B A is not zero but the weight did not change", name);
        free(W);
        free(O);
        free(A);
        free(B);
    }
    check(merged * 2 == (int)am_st_count(af), "%s: not every adapted module was merged", adapter);
    printf("%s: %d weights merged (worst %.3f ulp), %d copied bit for bit%s\n", out_dir, merged, worst, copied,
           fails ? ": FAILED" : "");
    am_ckpt_close(base);
    am_ckpt_close(out);
    am_st_close(af);
    json_decref(cfg);
    return fails != 0;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "trained") == 0)
        return trained(argv[2], argv[3], argv[4]);
    if (argc == 5 && strcmp(argv[1], "edit") == 0)
        return edit(argv[2], argv[3], argv[4]);
    if (argc == 4 && strcmp(argv[1], "bf16") == 0)
        return bf16(argv[2], argv[3]);
    if (argc == 4 && strcmp(argv[1], "tie") == 0)
        return tie(argv[2], argv[3]);
    if (argc == 4 && strcmp(argv[1], "shard") == 0)
        return shard(argv[2], argv[3]);
    if (argc == 5 && strcmp(argv[1], "check") == 0)
        return check_merge(argv[2], argv[3], argv[4]);
    fprintf(stderr, "usage: peft_merge trained|edit|bf16|check ...\n");
    return 2;
}
