/* model_io.c - Hugging Face checkpoints of a model shard (model_io.h). */
#include "model_io.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
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

int am_model_load_hf(struct am_model *m, const char *dir, struct am_errors *err)
{
    struct am_ckpt *c = NULL;
    if (am_ckpt_open(dir, &c, err) < 0)
        return -1;
    size_t before = err->n;
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        if (i > 0 && p == m->head && m->head == m->embed)
            continue;
        int64_t n = am_tensor_numel(&p->w);
        float *host = malloc((size_t)n * sizeof(float));
        if (!host) {
            am_errorf(err, NULL, "%s: out of memory reading %s", dir, p->name);
            break;
        }
        struct am_tensor dst = p->w;
        dst.data = host;
        dst.device = AM_DEV_CPU;
        struct am_ckpt_slice slice = p->split == AM_SPLIT_ROWS   ? am_ckpt_rows(p->row0, p->row0 + p->w.shape[0])
                                     : p->split == AM_SPLIT_COLS ? am_ckpt_cols(p->col0, p->col0 + p->w.shape[1])
                                                                 : (struct am_ckpt_slice){0, 0, 0};
        if (am_ckpt_read(c, p->name, p->split == AM_SPLIT_NONE ? NULL : &slice, &dst, err) == 0)
            m->K->upload(p->w.data, host, (size_t)n * sizeof(float));
        free(host);
    }
    am_ckpt_close(c);
    return err->n > before ? -1 : 0;
}

/* fill callback: downloads parameter `index` from the device as it is written */
struct save_ctx {
    const struct am_model *m;
    const int *which;
};

static int fill(void *ctx, size_t index, uint64_t offset, void *dst, size_t n, struct am_errors *err)
{
    (void)err;
    const struct save_ctx *s = ctx;
    const struct am_param *p = &s->m->params[s->which[index]];
    s->m->K->download(dst, (const char *)p->w.data + offset, n);
    return 0;
}

int am_model_save_hf(const struct am_model *m, const char *dir, const char *base_config, struct am_errors *err)
{
    if (m->sh.tp > 1 || !m->sh.first_stage || !m->sh.last_stage) {
        am_errorf(err, NULL, "%s: saving needs the whole model on one rank (tp 1, one pipeline stage)", dir);
        return -1;
    }
    struct am_st_wtensor *t = calloc((size_t)m->n_params, sizeof(*t));
    int *which = calloc((size_t)m->n_params, sizeof(int));
    int n = 0, rc = -1;
    if (!t || !which) {
        am_errorf(err, NULL, "%s: out of memory", dir);
        goto out;
    }
    struct save_ctx ctx = {m, which};
    for (int i = 0; i < m->n_params; i++) {
        const struct am_param *p = &m->params[i];
        if (i > 0 && p == m->head && m->head == m->embed)
            continue;
        t[n] = (struct am_st_wtensor){.name = p->name, .dtype = AM_ST_F32, .ndim = p->w.ndim, .fill = fill,
                                      .ctx = &ctx};
        for (int d = 0; d < p->w.ndim; d++)
            t[n].shape[d] = p->w.shape[d];
        which[n++] = i;
    }
    struct am_ckpt_save_opts opts = {.base_config = base_config};
    rc = am_ckpt_save(dir, &m->cfg, t, (size_t)n, &opts, err);
out:
    free(t);
    free(which);
    return rc;
}
