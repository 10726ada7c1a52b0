/* resume.c - the trainer's sharded checkpoints: what they hold, saved and restored
 * (resume.h), and when the trainer saves and restores them (trainer.h). */
#include "resume.h"

#include <errno.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "crash.h"
#include "errors.h"
#include "groups.h"
#include "half.h"
#include "log.h"
#include "model_io.h"
#include "moe.h"
#include "preempt.h"
#include "trainer.h"
#include "util.h"

/* ---- the layout: runs of a parameter's elements in the state arrays --------------------------- */

/* A run of `len` elements of parameter p from its local element a, at `off` in the arrays. */
typedef int (*run_fn)(void *arg, const struct am_param *p, int64_t a, int64_t len, size_t off, char *err,
                      size_t err_len);

static int64_t local_cols(const struct am_param *p) { return p->w.ndim > 1 ? p->w.shape[1] : 1; }
static int64_t full_cols(const struct am_param *p) { return p->full_cols > 0 ? p->full_cols : 1; }

/* Every run of the layout; skip_tied (the save) leaves out a tied embedding's copy on the last
 * stage and, on HSDP's replicas but the first, the groups they hold copies of (all but the
 * experts' with expert parallelism). */
static int for_runs(const struct am_train_state *s, bool skip_tied, run_fn fn, void *arg, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    if (!s->fsdp) {
        for (int i = 0; i < m->n_params; i++) {
            const struct am_param *p = &m->params[i];
            if ((skip_tied && am_model_is_tied_copy(m, p)) || p->slab_off < s->base)
                continue; /* a tied copy; LoRA's frozen base (not state) */
            if (skip_tied && s->experts_only && !am_moe_is_expert_param(m, p))
                continue; /* LoRA under ep: a copy of a lower data-parallel rank's adapter */
            if (fn(arg, p, 0, am_tensor_numel(&p->w), p->slab_off - s->base, err, err_len) < 0)
                return -1;
        }
        return 0;
    }
    for (int gi = 0; gi < m->n_groups; gi++) {
        const struct am_pgroup *G = &m->groups[gi];
        if (skip_tied && G->replicate && am_comm_rank(G->replicate) != 0)
            continue;
        size_t lo = G->offset + (size_t)am_comm_rank(G->comm) * G->shard_elems, hi = lo + G->shard_elems;
        for (int j = G->first; j < G->first + G->n; j++) {
            const struct am_param *p = &m->params[j];
            if (skip_tied && am_model_is_tied_copy(m, p))
                continue;
            size_t po = p->slab_off, pe = po + (size_t)am_tensor_numel(&p->w);
            size_t a = po > lo ? po : lo, b = pe < hi ? pe : hi;
            if (a < b && fn(arg, p, (int64_t)(a - po), (int64_t)(b - a), G->shard_offset + (a - lo), err, err_len) < 0)
                return -1;
        }
    }
    return 0;
}

/* A run as rectangles of the full tensor, each stored row-major from `off`. */
typedef int (*box_fn)(void *arg, const struct am_param *p, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                      size_t off, char *err, size_t err_len);

static int for_boxes(const struct am_param *p, int64_t a, int64_t len, size_t off, box_fn fn, void *arg, char *err,
                     size_t err_len)
{
    int64_t lc = local_cols(p);
    while (len > 0) {
        int64_t r = a / lc, c = a % lc, n;
        int rc;
        if (c != 0 || len < lc) {
            n = lc - c < len ? lc - c : len;
            rc = fn(arg, p, p->row0 + r, 1, p->col0 + c, n, off, err, err_len);
        } else {
            int64_t k = len / lc;
            n = k * lc;
            rc = fn(arg, p, p->row0 + r, k, p->col0, lc, off, err, err_len);
        }
        if (rc < 0)
            return -1;
        a += n;
        off += (size_t)n;
        len -= n;
    }
    return 0;
}

struct box_visit {
    box_fn fn;
    void *arg;
};

static int run_to_boxes(void *arg, const struct am_param *p, int64_t a, int64_t len, size_t off, char *err,
                        size_t err_len)
{
    struct box_visit *v = arg;
    return for_boxes(p, a, len, off, v->fn, v->arg, err, err_len);
}

/* ---- job-wide agreement --------------------------------------------------------------------------- */

/* v[0..n) replaced by its maximum over every rank of the job (device buffers for NCCL). */
int am_train_job_max(const struct am_train_state *s, int32_t *v, size_t n, char *err, size_t err_len)
{
    const struct am_dev *d = s->m->dev;
    size_t bytes = n * sizeof(int32_t);
    void *a = d->k->alloc(d, bytes), *b = d->k->alloc(d, bytes);
    int rc = 0;
    if (!a || !b) {
        rc = am_fail(err, err_len, "checkpoint: out of device memory for %zu flags", n);
        goto out;
    }
    d->k->upload(d, a, v, bytes);
    void *max;
    if (am_groups_job_max(s->job, a, b, n, AM_I32, &max, err, err_len) < 0) {
        rc = -1;
        goto out;
    }
    d->k->download(d, v, max, bytes);
out:
    if (a)
        d->k->free(d, a);
    if (b)
        d->k->free(d, b);
    return rc;
}

int am_train_model_hash(const struct am_model *m, char out[17], char *err, size_t err_len)
{
    struct am_errors e;
    am_errors_init(&e);
    char *text = am_ckpt_config_json(&m->cfg, NULL, &e);
    if (!text) {
        am_fail(err, err_len, "checkpoint: the model's config: %s", e.n ? e.msg[0] : "out of memory");
        am_errors_free(&e);
        return -1;
    }
    am_errors_free(&e);
    am_sckpt_hash_text(text, out);
    free(text);
    return 0;
}

/* ---- save ----------------------------------------------------------------------------------------- */

struct pieces {
    struct am_sckpt_piece *v;
    size_t n, cap;
};

static int add_piece(void *arg, const struct am_param *p, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                     size_t off, char *err, size_t err_len)
{
    struct pieces *ps = arg;
    if (ps->n == ps->cap) {
        size_t cap = ps->cap ? 2 * ps->cap : 256;
        struct am_sckpt_piece *v = realloc(ps->v, cap * sizeof(*v));
        if (!v)
            return am_fail(err, err_len, "checkpoint: out of memory for the list of pieces");
        ps->v = v;
        ps->cap = cap;
    }
    ps->v[ps->n++] = (struct am_sckpt_piece){p->name, p->full_rows, p->full_cols, (int64_t)off, row0, rows, col0, cols};
    return 0;
}

static json_t *meta_of(const struct am_train_state *s, long step)
{
    const struct am_recipe *r = s->r;
    const struct am_plan *p = s->p;
    static const char *const lr_styles[] = {"constant", "linear", "cosine"};
    json_t *o = json_object();
    json_object_set_new(o, "layout", json_pack("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "world", p->world, "tp", p->tp,
                                               "pp", p->pp, "dp", p->dp, "dp_replicate", p->dp_replicate, "dp_shard",
                                               p->dp_shard, "cp", p->cp, "ep", p->ep));
    json_object_set_new(o, "strategy", json_string(am_strategy_name(r->dist.strategy)));
    json_object_set_new(o, "zero_stage", json_integer(p->zero_stage));
    /* the dtype of the model's Hugging Face save (am-ckpt export's default) */
    json_object_set_new(o, "model_dtype", json_string(am_dtype_torch_name(s->m->save_dt)));
    json_object_set_new(o, "optimizer", json_pack("{s:I,s:f,s:f,s:f,s:f,s:f,s:s}", "step", (json_int_t)s->optim->step,
                                                  "lr", r->optim.lr, "beta1", r->optim.beta1, "beta2", r->optim.beta2,
                                                  "eps", r->optim.eps, "weight_decay", r->optim.weight_decay,
                                                  "dtype", am_dtype_torch_name(s->optim->dt)));
    /* FusedAdam's store_param_remainders: the shards hold the fp32 masters the parameters and
     * remainders make, and the parameters are those masters split as TE splits them (am-ckpt
     * export rounds them so: half.h, am_te_master_split) */
    if (s->optim->rem_mem)
        json_object_set_new(json_object_get(o, "optimizer"), "param_remainders", json_true());
    json_object_set_new(o, "data", json_pack("{s:I,s:I,s:I,s:I,s:I,s:b}", "step", (json_int_t)step, "global_batch",
                                             (json_int_t)p->global_batch, "seq_length", (json_int_t)p->seq_length,
                                             "samples", (json_int_t)(step * p->global_batch), "seed",
                                             (json_int_t)r->data.seed, "shuffle", r->data.shuffle));
    json_object_set_new(o, "rng", json_pack("{s:I,s:s}", "seed", (json_int_t)r->seed, "draws",
                                            "at initialisation only, from (seed, tensor, index)"));
    json_object_set_new(o, "lr_scheduler", json_pack("{s:s,s:I,s:I,s:f,s:f}", "style",
                                                     (unsigned)r->lr.style < 3 ? lr_styles[r->lr.style] : "?",
                                                     "warmup_steps", (json_int_t)r->lr.warmup_steps, "decay_steps",
                                                     (json_int_t)r->lr.decay_steps, "min_lr", r->lr.min_lr,
                                                     "next_lr", am_lr_at(r, step)));
    struct am_errors e;
    am_errors_init(&e);
    char *text = am_ckpt_config_json(&s->m->cfg, NULL, &e);
    am_errors_free(&e);
    if (text) {
        json_t *cfg = json_loads(text, 0, NULL);
        if (cfg)
            json_object_set_new(o, "model_config", cfg);
        free(text);
    }
    return o;
}

/* The model's config.json beside the manifest (am-ckpt export reads it). */
static int write_config(const struct am_train_state *s, const char *tmp, char *err, size_t err_len)
{
    struct am_errors e;
    am_errors_init(&e);
    char *text = am_ckpt_config_json(&s->m->cfg, NULL, &e);
    if (!text)
        am_fail(err, err_len, "checkpoint: the model's config: %s", e.n ? e.msg[0] : "out of memory");
    am_errors_free(&e);
    if (!text)
        return -1;
    int rc = am_sckpt_write_text(tmp, "config.json", text, err, err_len);
    free(text);
    return rc;
}

/* The masters into host fp32: widened from their dtype, or (FusedAdam's remainders) rebuilt
 * from the bf16 parameters and their remainders (half.h). 0, or -1 out of host memory. */
static int masters_to_host(const struct am_train_state *s, float *out)
{
    const struct am_dev *d = s->m->dev;
    if (!s->optim->rem_mem) {
        am_dev_download_f32(d, s->optim->dt, out, s->master, s->n);
        return 0;
    }
    uint16_t *hi = malloc(s->n * sizeof(uint16_t) + 1), *lo = malloc(s->n * sizeof(uint16_t) + 1);
    if (hi && lo) {
        d->k->download(d, hi, s->master, s->n * sizeof(uint16_t));
        d->k->download(d, lo, s->optim->rem_mem, s->n * sizeof(uint16_t));
        for (size_t i = 0; i < s->n; i++)
            out[i] = am_bits_f32(am_te_master_join(hi[i], lo[i]));
    }
    int rc = hi && lo ? 0 : -1;
    free(hi);
    free(lo);
    return rc;
}

/* The masters from host fp32: rounded to their dtype (exact: saved from it), or split into
 * the bf16 parameters and their remainders (from any fp32 master: a checkpoint of a run
 * without remainders too). 0, or -1 out of host memory. */
static int masters_from_host(const struct am_train_state *s, const float *in)
{
    const struct am_dev *d = s->m->dev;
    if (!s->optim->rem_mem) {
        am_dev_upload_f32(d, s->optim->dt, s->master, in, s->n);
        return 0;
    }
    uint16_t *hi = malloc(s->n * sizeof(uint16_t) + 1), *lo = malloc(s->n * sizeof(uint16_t) + 1);
    if (hi && lo) {
        for (size_t i = 0; i < s->n; i++)
            am_te_master_split(am_f32_bits(in[i]), &hi[i], &lo[i]);
        d->k->upload(d, s->master, hi, s->n * sizeof(uint16_t));
        d->k->upload(d, s->optim->rem_mem, lo, s->n * sizeof(uint16_t));
    }
    int rc = hi && lo ? 0 : -1;
    free(hi);
    free(lo);
    return rc;
}

/* This rank's three arrays and pieces into tmp. */
static int write_rank(const struct am_train_state *s, const char *tmp, char *err, size_t err_len)
{
    const struct am_dev *d = s->m->dev;
    size_t bytes = s->n * sizeof(float);
    float *sec[AM_SCKPT_SECTIONS] = {malloc(bytes ? bytes : 1), malloc(bytes ? bytes : 1), malloc(bytes ? bytes : 1)};
    struct pieces ps = {0};
    int rc = -1;
    if (!sec[0] || !sec[1] || !sec[2]) {
        am_fail(err, err_len, "checkpoint: out of host memory for %zu bytes of state", 3 * bytes);
        goto out;
    }
    /* fp32 on disk: bf16 masters and moments widened (exact) */
    if (masters_to_host(s, sec[0]) < 0) {
        am_fail(err, err_len, "checkpoint: out of host memory for %zu bytes of parameters", s->n * 4);
        goto out;
    }
    am_dev_download_f32(d, s->optim->mdt[0], sec[1], s->optim->m_mem, s->n);
    am_dev_download_f32(d, s->optim->mdt[1], sec[2], s->optim->v_mem, s->n);
    struct box_visit v = {add_piece, &ps};
    if (for_runs(s, true, run_to_boxes, &v, err, err_len) < 0)
        goto out;
    rc = am_sckpt_write_rank(tmp, s->rank, (const float *const *)sec, (int64_t)s->n, ps.v, ps.n, s->hook, s->hook_arg,
                             err, err_len);
out:
    for (int i = 0; i < AM_SCKPT_SECTIONS; i++)
        free(sec[i]);
    free(ps.v);
    return rc;
}

/* The experts' selection biases when training updates them (model_io.h): one file per
 * pipeline stage (its first data-parallel, tp and cp rank writes), selection_bias/rank-R. */
static bool biases_updated(const struct am_model *m)
{
    return m->cfg.sigmoid_router && m->cfg.gate_bias_update_factor > 0;
}

static int write_biases(const struct am_train_state *s, const char *tmp, char *err, size_t err_len)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/selection_bias", tmp);
    if (mkdir(path, 0755) < 0 && errno != EEXIST)
        return am_fail(err, err_len, "checkpoint: %s: %s", path, strerror(errno));
    snprintf(path, sizeof(path), "%s/selection_bias/rank-%05d.safetensors", tmp, s->rank);
    struct am_errors e;
    am_errors_init(&e);
    int rc = am_model_save_biases(s->m, path, &e);
    if (rc < 0)
        am_fail(err, err_len, "checkpoint: %s", e.n ? e.msg[0] : "the selection biases");
    am_errors_free(&e);
    return rc;
}

int am_train_save(const struct am_train_state *s, long step, char *dir, size_t dir_len, double *seconds, char *err,
                  size_t err_len)
{
    const char *root = s->r->ckpt.dir ? s->r->ckpt.dir : "checkpoints";
    double t0 = am_mono_time();
    char tmp[4096], msg[1024] = "";
    char hash[17];
    int32_t *flags = calloc((size_t)s->world + 1, sizeof(int32_t)); /* [rank]: writes; [world]: a failure */
    if (!flags)
        return am_fail(err, err_len, "checkpoint at step %ld: out of memory", step);
    am_sckpt_tmp_dir(root, step, s->tag, tmp, sizeof(tmp));
    am_sckpt_step_dir(root, step, dir, dir_len);
    int bad = am_train_model_hash(s->m, hash, msg, sizeof(msg)) < 0;
    if (!bad && s->rank == 0)
        bad = am_sckpt_begin(root, step, s->tag, msg, sizeof(msg)) < 0 || write_config(s, tmp, msg, sizeof(msg)) < 0;
    flags[s->world] = bad;
    if (am_train_job_max(s, &flags[s->world], 1, err, err_len) < 0)
        goto fail;
    if (flags[s->world]) {
        if (bad)
            am_fail(err, err_len, "checkpoint at step %ld: %s", step, msg);
        else
            am_fail(err, err_len, "checkpoint at step %ld: rank 0 could not begin it (its log says why)", step);
        goto fail;
    }
    bad = s->writes && write_rank(s, tmp, msg, sizeof(msg)) < 0;
    if (!bad && s->bias_writes && biases_updated(s->m))
        bad = write_biases(s, tmp, msg, sizeof(msg)) < 0;
    if (!bad && s->extra)
        bad = s->extra(s->extra_arg, tmp, msg, sizeof(msg)) < 0;
    flags[s->rank] = s->writes;
    flags[s->world] = bad;
    if (am_train_job_max(s, flags, (size_t)s->world + 1, err, err_len) < 0)
        goto fail;
    if (flags[s->world]) {
        if (bad)
            am_fail(err, err_len, "checkpoint at step %ld: %s", step, msg);
        else
            am_fail(err, err_len, "checkpoint at step %ld: another rank could not write its shard (its log says why)",
                    step);
        goto fail;
    }
    int32_t done = 0;
    if (s->rank == 0) {
        int *ranks = malloc((size_t)s->world * sizeof(int));
        int n = 0;
        bool already = false;
        for (int i = 0; ranks && i < s->world; i++)
            if (flags[i])
                ranks[n++] = i;
        done = !ranks || am_sckpt_commit(root, step, s->tag, ranks, n, meta_of(s, step), hash, s->r->ckpt.keep_last,
                                         s->hook, s->hook_arg, &already, msg, sizeof(msg)) < 0;
        if (!ranks)
            snprintf(msg, sizeof(msg), "out of memory");
        free(ranks);
    }
    bad = done;
    if (am_train_job_max(s, &done, 1, err, err_len) < 0)
        goto fail;
    if (done) {
        if (bad)
            am_fail(err, err_len, "checkpoint at step %ld: %s", step, msg);
        else
            am_fail(err, err_len, "checkpoint at step %ld: rank 0 could not commit it (its log says why)", step);
        goto fail;
    }
    free(flags);
    *seconds = am_mono_time() - t0;
    return 0;
fail:
    free(flags);
    return -1;
}

/* ---- restore -------------------------------------------------------------------------------------- */

struct loader {
    struct am_sckpt *c;
    float *sec[AM_SCKPT_SECTIONS];
    unsigned char *mask;
};

static int load_box(void *arg, const struct am_param *p, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                    size_t off, char *err, size_t err_len)
{
    struct loader *L = arg;
    int t = am_sckpt_find(L->c, p->name);
    struct am_sckpt_tensor_info ti;
    if (t < 0)
        return am_fail(err, err_len, "checkpoint %s has no tensor %s (saved from another model: restore from a "
                       "checkpoint of this model)", am_sckpt_dir(L->c), p->name);
    am_sckpt_tensor(L->c, (size_t)t, &ti);
    if (ti.rows != p->full_rows || ti.cols != full_cols(p) || (ti.ndim == 2) != (p->full_cols > 0))
        return am_fail(err, err_len, "checkpoint %s holds %s as %lld x %lld, this model as %lld x %lld (another "
                       "model: restore from a checkpoint of this model)", am_sckpt_dir(L->c), p->name,
                       (long long)ti.rows, (long long)ti.cols, (long long)p->full_rows, (long long)full_cols(p));
    for (int s = 0; s < AM_SCKPT_SECTIONS; s++)
        if (am_sckpt_read(L->c, (size_t)t, s, row0, rows, col0, cols, L->sec[s] + off, cols, s == 0 ? L->mask + off : NULL,
                          err, err_len) < 0)
            return -1;
    for (int64_t i = 0; i < rows * cols; i++)
        if (!L->mask[off + (size_t)i])
            return am_fail(err, err_len, "checkpoint %s does not hold element (%lld, %lld) of %s (its shards are "
                           "incomplete: restore from another checkpoint)", am_sckpt_dir(L->c),
                           (long long)(row0 + i / cols), (long long)(col0 + i % cols), p->name);
    return 0;
}

static long meta_long(json_t *meta, const char *obj, const char *key)
{
    json_t *v = json_object_get(json_object_get(meta, obj), key);
    return json_is_integer(v) ? (long)json_integer_value(v) : -1;
}

static int restore_local(const struct am_train_state *s, const char *dir, long *step, char *err, size_t err_len)
{
    struct loader L = {0};
    char hash[17];
    int rc = -1;
    if (am_train_model_hash(s->m, hash, err, err_len) < 0 || am_sckpt_open(dir, &L.c, err, err_len) < 0)
        return -1;
    json_t *meta = am_sckpt_meta(L.c);
    if (strcmp(am_sckpt_model_hash(L.c), hash) != 0) {
        json_t *mc = json_object_get(meta, "model_config");
        am_fail(err, err_len, "checkpoint %s was saved from another model (model hash %s; this recipe's is %s: "
                "model_type %s, hidden_size %ld, num_hidden_layers %ld, vocab_size %ld; the checkpoint's: model_type "
                "%s, hidden_size %lld, num_hidden_layers %lld, vocab_size %lld): restore from a checkpoint of this "
                "model", dir, am_sckpt_model_hash(L.c), hash, s->m->cfg.model_type, s->m->cfg.hidden_size,
                s->m->cfg.num_hidden_layers, s->m->cfg.vocab_size,
                json_string_value(json_object_get(mc, "model_type")) ? json_string_value(json_object_get(mc, "model_type")) : "?",
                (long long)json_integer_value(json_object_get(mc, "hidden_size")),
                (long long)json_integer_value(json_object_get(mc, "num_hidden_layers")),
                (long long)json_integer_value(json_object_get(mc, "vocab_size")));
        goto out;
    }
    long gb = meta_long(meta, "data", "global_batch"), sl = meta_long(meta, "data", "seq_length");
    if (gb != s->p->global_batch || sl != s->p->seq_length) {
        am_fail(err, err_len, "checkpoint %s was saved with a global batch of %ld sequences of %ld tokens, this job "
                "runs %ld of %ld: the data position (a number of steps of that batch) cannot be taken; keep "
                "step_scheduler.global_batch_size and the sequence length of the saved run", dir, gb, sl,
                (long)s->p->global_batch, (long)s->p->seq_length);
        goto out;
    }
    long opt_step = meta_long(meta, "optimizer", "step");
    if (opt_step < 0) {
        am_fail(err, err_len, "checkpoint %s: manifest.json has no optimizer step (damaged: restore from another "
                "checkpoint)", dir);
        goto out;
    }
    size_t bytes = s->n * sizeof(float);
    for (int i = 0; i < AM_SCKPT_SECTIONS; i++)
        L.sec[i] = calloc(s->n ? s->n : 1, sizeof(float));
    L.mask = calloc(s->n ? s->n : 1, 1);
    if (!L.sec[0] || !L.sec[1] || !L.sec[2] || !L.mask) {
        am_fail(err, err_len, "checkpoint %s: out of host memory for %zu bytes of state", dir, 3 * bytes);
        goto out;
    }
    struct box_visit v = {load_box, &L};
    if (for_runs(s, false, run_to_boxes, &v, err, err_len) < 0)
        goto out;
    const struct am_dev *d = s->m->dev;
    if (masters_from_host(s, L.sec[0]) < 0) {
        am_fail(err, err_len, "checkpoint %s: out of host memory for %zu bytes of parameters", dir, s->n * 4);
        goto out;
    }
    am_dev_upload_f32(d, s->optim->mdt[0], s->optim->m_mem, L.sec[1], s->n);
    am_dev_upload_f32(d, s->optim->mdt[1], s->optim->v_mem, L.sec[2], s->n);
    s->optim->step = opt_step;
    *step = am_sckpt_step(L.c);
    if (s->m->cfg.sigmoid_router) { /* the biases as trained, when the run that saved updated them */
        char bdir[4200];
        struct am_errors e;
        am_errors_init(&e);
        snprintf(bdir, sizeof(bdir), "%s/selection_bias", dir);
        if (am_model_load_biases(s->m, bdir, &e) < 0) {
            am_fail(err, err_len, "checkpoint %s", e.n ? e.msg[0] : "the selection biases");
            am_errors_free(&e);
            goto out;
        }
        am_errors_free(&e);
    }
    rc = 0;
out:
    for (int i = 0; i < AM_SCKPT_SECTIONS; i++)
        free(L.sec[i]);
    free(L.mask);
    am_sckpt_close(L.c);
    return rc;
}

int am_train_restore(const struct am_train_state *s, const char *dir, long *step, char *err, size_t err_len)
{
    char msg[1024];
    int32_t v[2];
    long got = -1;
    int bad = restore_local(s, dir, &got, msg, sizeof(msg)) < 0;
    v[0] = bad;
    v[1] = bad ? -1 : (int32_t)got;
    int32_t neg[2] = {bad, bad ? 1 : -(int32_t)got};
    if (am_train_job_max(s, v, 2, err, err_len) < 0 || am_train_job_max(s, neg, 2, err, err_len) < 0)
        return -1;
    if (bad)
        return am_fail(err, err_len, "%s", msg);
    if (v[0])
        return am_fail(err, err_len, "checkpoint %s: another rank could not restore its part (its log says why)", dir);
    if (v[1] != -neg[1])
        return am_fail(err, err_len, "checkpoint %s: the ranks read different steps (%d and %d): the directory "
                       "changed while they read it", dir, -neg[1], v[1]);
    *step = got;
    return 0;
}

/* ---- the trainer's checkpoints: when it saves and restores (trainer.h) ---------------------------- */

/* The Hugging Face export of the weights (checkpoint.save_consolidated) into dir: one replica
 * saves (cp rank 0 of it), its tp and pp ranks together (pp 0 / tp 0 writes); fully sharded,
 * the shard groups first gather the masters; with ep > 1 every rank first gathers its ep
 * group's experts. */
static int save_hf(struct trainer *t, const char *dir, struct am_errors *err)
{
    void *slab = NULL;
    if (t->model.sh.lora_r > 0) { /* LoRA: the adapters, as peft saves them; the base is the model directory */
        bool saves = t->dp_rank == 0 && !(t->g.cp && am_comm_rank(t->g.cp) != 0);
        char base[4096];
        const char *model_dir = NULL; /* the adapters' base_model_name_or_path: the base's directory */
        if (t->base_config[0]) {
            snprintf(base, sizeof(base), "%s", t->base_config);
            model_dir = dirname(base);
        }
        return am_model_save_peft_dist(&t->model, t->p->tp > 1 ? t->g.tp : NULL, t->p->pp > 1 ? t->g.pp : NULL,
                                       t->p->ep > 1 ? t->g.ep : NULL, saves, dir, model_dir, err);
    }
    char msg[1024];
    if (am_dp_gather_weights(&t->dp, &slab, msg, sizeof(msg)) < 0) {
        am_dp_release_weights(&t->dp, slab);
        return am_errors_fail(err, "%s", msg);
    }
    bool saves = t->dp_rank == 0 && !(t->g.cp && am_comm_rank(t->g.cp) != 0);
    int rc = !saves && t->p->ep == 1
                 ? 0
                 : am_model_save_hf_ep(&t->model, t->p->tp > 1 ? t->g.tp : NULL, t->p->pp > 1 ? t->g.pp : NULL,
                                       t->p->ep > 1 ? t->g.ep : NULL, saves, dir,
                                       t->base_config[0] ? t->base_config : NULL, err);
    am_dp_release_weights(&t->dp, slab);
    return rc;
}

static int save_hf_extra(void *arg, const char *tmp_dir, char *err, size_t err_len)
{
    struct trainer *t = arg;
    char dir[4200];
    struct am_errors e;
    am_errors_init(&e);
    bool lora = t->model.sh.lora_r > 0;
    snprintf(dir, sizeof(dir), "%s/%s", tmp_dir, lora ? "peft" : "hf");
    int rc = save_hf(t, dir, &e);
    if (rc < 0)
        snprintf(err, err_len, "%s: %s", lora ? "the LoRA adapters (peft)" : "the Hugging Face export",
                 e.n ? e.msg[0] : "failed");
    am_errors_free(&e);
    return rc;
}

/* What resume.h saves and restores of this rank. */
static struct am_train_state train_state(struct trainer *t)
{
    const char *job = getenv("AM_JOB_ID");
    struct am_train_state st = {
        .job = {t->g.tp, t->g.pp, t->g.dp, t->g.cp}, .rank = t->s->info.rank, .world = t->s->info.size,
        .r = t->r, .p = t->p, .tag = job && *job ? job : "0", .hook = am_train_fault_in_save, .hook_arg = t,
        .extra = t->r->ckpt.save_consolidated || t->model.sh.lora_r > 0 ? save_hf_extra : NULL, .extra_arg = t,
        .bias_writes = t->dp_rank == 0 && am_comm_rank(t->g.tp) == 0 && !(t->g.cp && am_comm_rank(t->g.cp) != 0)};
    am_dp_state(&t->dp, &st); /* the arrays' layout, and whether this rank writes them */
    return st;
}

/* A sharded checkpoint (resume.h) of the state after `step` steps, with the Hugging Face
 * export inside it when checkpoint.save_consolidated (every checkpoint, or with `final` the
 * one at the end of training). */
int am_train_save_checkpoint(struct trainer *t, long step, struct am_errors *err)
{
    if (!t->r->ckpt.enabled)
        return 0;
    struct am_train_state st = train_state(t);
    if (t->r->ckpt.consolidated_final && t->model.sh.lora_r == 0 && step != t->r->steps.max_steps)
        st.extra = NULL; /* save_consolidated: final: the Hugging Face directory with the last checkpoint only */
    char dir[4096], msg[2048];
    double secs = 0;
    /* its end is the "checkpoint" record: am-diag reports a save that began and did not end */
    am_log_record(t->log, "checkpoint_start", json_pack("{s:i,s:f}", "step", (int)step, "time", am_wall_time()));
    if (am_train_save(&st, step, dir, sizeof(dir), &secs, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    am_log_record(t->log, "checkpoint", json_pack("{s:i,s:s,s:f,s:s,s:b,s:f}", "step", (int)step, "dir", dir,
                                                  "seconds", secs, "format", "sharded", "writes", st.writes, "time",
                                                  am_wall_time()));
    return 0;
}

/* Slurm's warning before the time limit (preempt.h), agreed by every rank at the end of each
 * step: 1 when the ranks stop after `step` (saved; `saved` when ckpt_every_steps did it). */
int am_train_preempt_check(struct trainer *t, long step, bool saved, struct am_errors *err)
{
    struct am_train_state st = train_state(t);
    int32_t warned = am_preempt_noted();
    char msg[1024];
    if (am_train_job_max(&st, &warned, 1, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "step %ld: agreeing on Slurm's warning (SIGUSR1): %s", step, msg);
    if (!warned)
        return 0;
    if (!saved && am_train_save_checkpoint(t, step, err) < 0)
        return -1;
    am_crash_leaving(); /* the ranks end one by one from here: status 85 each, whoever ends first */
    am_log_record(t->log, "preempted", json_pack("{s:i,s:f,s:i}", "step", (int)step, "time", am_wall_time(),
                                                 "exit", AM_EXIT_REQUEUE));
    if (t->s->info.rank == 0)
        printf("am-train: warned (SIGUSR1): saved the state after step %ld, stopping for a requeue (status %d)\n",
               step, AM_EXIT_REQUEUE);
    return 1;
}

/* checkpoint.restore_from: the state of a sharded checkpoint (resume.h), saved at any layout;
 * `latest` before any checkpoint exists starts from the beginning. */
int am_train_restore_checkpoint(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    const char *root = r->ckpt.dir ? r->ckpt.dir : "checkpoints";
    char dir[4096], msg[2048];
    bool found = false;
    long step = 0;
    double t0 = am_mono_time();
    if (!r->ckpt.restore_from || !*r->ckpt.restore_from)
        return 0;
    if (am_sckpt_resolve(root, r->ckpt.restore_from, dir, sizeof(dir), &found, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    if (!found) {
        am_log_record(t->log, "restore", json_pack("{s:s,s:b}", "from", r->ckpt.restore_from, "found", 0));
        return 0;
    }
    struct am_train_state st = train_state(t);
    if (am_train_restore(&st, dir, &step, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "checkpoint.restore_from: %s", msg);
    if (step > r->steps.max_steps)
        return am_errors_fail(err, "checkpoint.restore_from: %s was saved after step %ld, past max_steps %ld: raise "
                              "step_scheduler.max_steps", dir, step, r->steps.max_steps);
    if (am_dp_restored(&t->dp, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "checkpoint.restore_from: %s", msg);
    t->start_step = step;
    am_log_record(t->log, "restore", json_pack("{s:s,s:b,s:s,s:i,s:f}", "from", r->ckpt.restore_from, "found", 1,
                                               "dir", dir, "step", (int)step, "seconds", am_mono_time() - t0));
    if (t->s->info.rank == 0)
        printf("am-train: resumed from %s after step %ld\n", dir, step);
    return 0;
}
