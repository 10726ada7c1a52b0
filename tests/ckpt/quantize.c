/* quantize.c - the test quantisers' driver (quantize.h): reads the model, writes the quantised
 * checkpoint and the dequantised one, with their config.json. */
#include "quantize.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct quantize_out {
    struct am_st_wtensor *t; /* the quantised checkpoint's tensors */
    size_t n;
    void **bufs; /* what quantize_run frees */
    size_t nb;
};

static void *grow(void *p, size_t n, size_t size)
{
    p = realloc(p, n * size);
    if (!p)
        abort();
    return p;
}

void *quantize_alloc(struct quantize_out *o, size_t bytes)
{
    o->bufs = grow(o->bufs, o->nb + 1, sizeof(*o->bufs));
    return o->bufs[o->nb++] = grow(NULL, bytes ? bytes : 1, 1);
}

void quantize_add(struct quantize_out *o, struct am_st_wtensor w)
{
    o->t = grow(o->t, o->n + 1, sizeof(*o->t));
    o->t[o->n++] = w;
}

/* DIR/config.json: SRC's, with q's quantization_config where quant */
static int write_config(const struct quantiser *q, const char *src, const char *dir, int quant)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/config.json", src);
    json_error_t je;
    json_t *cfg = json_load_file(path, JSON_PRESERVE_ORDER, &je);
    if (!cfg) {
        fprintf(stderr, "%s: %s: %s\n", q->name, path, je.text);
        return -1;
    }
    if (quant)
        json_object_set_new(cfg, "quantization_config", q->config());
    snprintf(path, sizeof(path), "%s/config.json", dir);
    int rc = json_dump_file(cfg, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(cfg);
    return rc;
}

int quantize_run(const struct quantiser *q, const char *src, const char *out)
{
    struct am_errors err;
    am_errors_init(&err);
    char path[4200], q_dir[4096], deq_dir[4096]; /* path: a dir plus a file name */
    snprintf(q_dir, sizeof(q_dir), "%s/%s", out, q->dir);
    snprintf(deq_dir, sizeof(deq_dir), "%s/deq", out);
    mkdir(out, 0755);
    mkdir(q_dir, 0755);
    mkdir(deq_dir, 0755);
    snprintf(path, sizeof(path), "%s/model.safetensors", src);
    struct am_st_file *f;
    if (am_st_open(path, &f, &err) != 0) {
        fprintf(stderr, "%s: %s\n", q->name, err.msg[0]);
        am_errors_free(&err);
        return 1;
    }
    size_t n = am_st_count(f);
    struct am_st_wtensor *d = calloc(n, sizeof(*d));
    struct quantize_out o = {0};
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        const struct am_st_info *t = am_st_at(f, i);
        float *x = quantize_alloc(&o, (size_t)t->numel * sizeof(float));
        if (am_st_read_f32(f, t, 0, t->numel, x, &err) != 0) {
            fprintf(stderr, "%s: %s\n", q->name, err.msg[0]);
            rc = 1;
            break;
        }
        struct am_st_wtensor w = {.name = t->name, .dtype = AM_ST_F32, .ndim = t->ndim, .data = x};
        memcpy(w.shape, t->shape, sizeof(w.shape));
        d[i] = w;
        if (!q->quantised(t)) {
            quantize_add(&o, w);
            continue;
        }
        float *deq = quantize_alloc(&o, (size_t)t->numel * sizeof(float));
        q->quantise(&o, t, x, deq);
        d[i].data = deq;
    }
    if (rc == 0) {
        snprintf(path, sizeof(path), "%s/model.safetensors", q_dir);
        if (am_st_write(path, o.t, o.n, NULL, 0, 0, &err) != 0)
            rc = 1;
        snprintf(path, sizeof(path), "%s/model.safetensors", deq_dir);
        if (rc == 0 && am_st_write(path, d, n, NULL, 0, 0, &err) != 0)
            rc = 1;
        if (rc)
            fprintf(stderr, "%s: %s\n", q->name, err.msg[0]);
    }
    if (rc == 0 && (write_config(q, src, q_dir, 1) != 0 || write_config(q, src, deq_dir, 0) != 0))
        rc = 1;
    for (size_t i = 0; i < o.nb; i++)
        free(o.bufs[i]);
    free(o.bufs);
    free(o.t);
    free(d);
    am_st_close(f);
    am_errors_free(&err);
    return rc;
}
