/* save_dist_check - a rank program (start it with am-launch --nproc TP*PP) that saves a tiny
 * Llama sharded over tp x pp with am_model_save_hf_dist and checks what it wrote.
 *
 *   save_dist_check TP PP VIRTUAL DIR
 *
 * Rank r is tp rank r % TP of pp rank r / TP (tp innermost, as the planner's mesh). The model
 * (4 layers, 4 heads, 2 kv heads: with TP 4 each kv head is held by two ranks; a vocabulary
 * large enough that the embedding is written in several pieces) is split as the planner
 * splits it: PP * VIRTUAL stages of equal runs of layers, stage s on pp rank s % PP, the
 * embedding on the first stage and the head on the last. Once a Llama with tie_word_embeddings
 * false, once a Qwen2 with it true (the tied embedding's copy on the last stage must not be
 * written twice; the q, k, v biases split with their rows, at TP 4 a kv head's held by two
 * ranks, and filled with values of their place in the whole tensor after the init, which
 * leaves them 0), every
 * rank initialises its shard with one seed (am_model_init_weights: the same model in every
 * layout) and all save to DIR/tieN/dist. Then
 *   - rank 0 saves the same model whole (am_model_shard_whole, same seed) to DIR/tieN/ref with
 *     am_model_save_hf and checks that both directories hold the same tensors, bit for bit,
 *     each equal to the whole model's parameter; config.json and model.safetensors byte for
 *     byte;
 *   - every rank loads DIR/tieN/dist into a second shard like its own (am_model_load_hf) and
 *     checks every parameter against the first, bit for bit.
 * Each rank prints "save_dist_check: rank R: N checks passed" or the failures (exit 1).
 *
 * Environment: AM_COMM_TIMEOUT (seconds, default 30); SAVE_DIST_PERTURB=1: the last rank
 * changes one element of its shard before saving, which the checks must catch (the test of
 * the test).
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "comm.h"
#include "kernels.h"
#include "model.h"
#include "model_io.h"
#include "util.h"

#define SEED 1234
#define LAYERS 4

struct run {
    int rank, size, tp, pp, virt, tp_rank, pp_rank;
    const char *dir;
    struct am_comm *world, *tpc, *ppc; /* tpc, ppc NULL for size 1 */
    struct am_dev dev;
    long checks, failures;
};

/* Counts a check; reports it when it fails. */
static bool check(struct run *r, bool ok, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool check(struct run *r, bool ok, const char *fmt, ...)
{
    r->checks++;
    if (ok)
        return true;
    r->failures++;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "save_dist_check: rank %d (tp %d, pp %d, v %d): ", r->rank, r->tp, r->pp, r->virt);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return false;
}

/* Reports and clears the errors of a call; true when there were none. */
static bool no_errors(struct run *r, struct am_errors *err, const char *what)
{
    for (size_t i = 0; i < err->n; i++)
        check(r, false, "%s: %s", what, err->msg[i]);
    bool ok = err->n == 0;
    am_errors_free(err);
    am_errors_init(err);
    return check(r, ok, "%s failed", what);
}

static struct am_model_config tiny_llama(bool tie)
{
    return (struct am_model_config){.model_type = tie ? "qwen2" : "llama", .qkv_bias = tie,
                                    .hidden_size = 32, .num_hidden_layers = LAYERS,
                                    .num_attention_heads = 4, .num_key_value_heads = 2, .head_dim = 8,
                                    .intermediate_size = 48, .vocab_size = 8448, /* 270,336 floats: 2 pieces */
                                    .max_position_embeddings = 64, .rope_theta = 10000.0, .rms_norm_eps = 1e-5,
                                    .initializer_range = 0.02, .tie_word_embeddings = tie};
}

/* This rank's shard: the stages s with s % pp == pp_rank, LAYERS / (pp * virt) layers each. */
static struct am_model_shard my_shard(const struct run *r)
{
    int stages = r->pp * r->virt, per = LAYERS / stages;
    struct am_model_shard sh = {.tp = r->tp, .tp_rank = r->tp_rank};
    for (int s = r->pp_rank; s < stages; s += r->pp)
        sh.chunks[sh.n_chunks++] = (struct am_chunk){s * per, per, 1};
    sh.first_stage = r->pp_rank == 0;
    sh.last_stage = (stages - 1) % r->pp == r->pp_rank;
    return sh;
}

/* Qwen2's biases (0 after am_model_init_weights): element i of the whole tensor becomes
 * (i + 1) / 1024 plus a step per tensor (its layer digit and projection letter), the same in every
 * layout. */
static void fill_biases(struct am_model *m)
{
    for (int k = 0; k < m->n_params; k++) {
        struct am_param *p = &m->params[k];
        size_t len = strlen(p->name);
        if (len < 5 || strcmp(p->name + len - 5, ".bias") != 0)
            continue;
        int64_t n = am_tensor_numel(&p->w);
        float *h = malloc((size_t)n * sizeof(float));
        if (!h)
            continue;
        for (int64_t i = 0; i < n; i++)
            h[i] = (float)(p->row0 + i + 1) / 1024.0f + (float)(p->name[13] + p->name[len - 11]) / 64.0f;
        m->K->upload(m->dev, p->w.data, h, (size_t)n * sizeof(float));
        free(h);
    }
}

static float *download(const struct am_model *m, const struct am_param *p)
{
    size_t n = (size_t)am_tensor_numel(&p->w);
    float *h = malloc(n * sizeof(float));
    if (h)
        m->K->download(m->dev, h, p->w.data, n * sizeof(float));
    return h;
}

/* A whole tensor of a checkpoint as host fp32 (NULL when it is not there). */
static float *read_whole(struct run *r, const struct am_ckpt *c, const char *name, int64_t *numel)
{
    const struct am_st_info *info = am_ckpt_find(c, name, NULL);
    if (!check(r, info != NULL, "%s: no tensor %s", am_ckpt_dir(c), name))
        return NULL;
    struct am_tensor t = {.device = AM_DEV_CPU, .dtype = AM_F32, .ndim = info->ndim};
    memcpy(t.shape, info->shape, (size_t)info->ndim * sizeof(int64_t));
    *numel = info->numel;
    t.data = malloc((size_t)info->numel * sizeof(float) + 1);
    struct am_errors err;
    am_errors_init(&err);
    if (!t.data || am_ckpt_read(c, name, NULL, &t, &err) < 0) {
        no_errors(r, &err, name);
        free(t.data);
        return NULL;
    }
    am_errors_free(&err);
    return t.data;
}

static bool same_file(struct run *r, const char *a, const char *b)
{
    char *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    const char *why = am_read_file(a, (size_t)1 << 30, &x, &nx);
    if (!why)
        why = am_read_file(b, (size_t)1 << 30, &y, &ny);
    bool ok = check(r, !why, "%s", why ? why : "") && check(r, nx == ny && memcmp(x, y, nx) == 0,
                                                          "%s and %s differ (%zu and %zu bytes)", a, b, nx, ny);
    free(x);
    free(y);
    return ok;
}

/* Rank 0: the whole model saved by am_model_save_hf, against the distributed save. */
static void check_against_whole(struct run *r, bool tie, const char *dist, const char *ref, const char *base)
{
    struct am_model_config cfg = tiny_llama(tie);
    struct am_model_shard sh = am_model_shard_whole(1, 0, LAYERS);
    struct am_model m;
    struct am_errors err;
    char msg[512];
    am_errors_init(&err);
    if (!check(r, am_model_init(&m, &cfg, &sh, &r->dev, NULL, NULL, 1, 4, msg, sizeof(msg)) == 0, "%s", msg))
        return;
    if (!check(r, am_model_init_weights(&m, SEED) == 0, "am_model_init_weights: out of host memory"))
        return;
    fill_biases(&m);
    am_model_save_hf(&m, ref, base, &err);
    struct am_ckpt *d = NULL, *w = NULL;
    if (no_errors(r, &err, "am_model_save_hf") && am_ckpt_open(dist, &d, &err) == 0 &&
        am_ckpt_open(ref, &w, &err) == 0) {
        size_t want = (tie ? 12 : 9) * LAYERS + 2 + !tie; /* Qwen2: 3 biases per layer */
        check(r, am_ckpt_count(d) == want && am_ckpt_count(w) == want, "%zu tensors saved, %zu by one rank, want %zu",
              am_ckpt_count(d), am_ckpt_count(w), want);
        for (size_t i = 0; i < am_ckpt_count(w); i++) { /* the same names, shapes and bits */
            const char *name = am_ckpt_name(w, i);
            int64_t nd = -1, nw = -2;
            float *a = read_whole(r, d, name, &nd), *b = read_whole(r, w, name, &nw);
            if (a && b)
                check(r, nd == nw && memcmp(a, b, (size_t)nd * sizeof(float)) == 0, "%s differs from one rank's save",
                      name);
            free(a);
            free(b);
        }
        for (int i = 0; i < m.n_params; i++) { /* and each is the model's parameter */
            int64_t n = -1;
            float *a = read_whole(r, d, m.params[i].name, &n), *b = download(&m, &m.params[i]);
            if (a && b)
                check(r, n == am_tensor_numel(&m.params[i].w) && memcmp(a, b, (size_t)n * sizeof(float)) == 0,
                      "%s differs from the whole model's parameter", m.params[i].name);
            free(a);
            free(b);
        }
        char pa[4400], pb[4400];
        static const char *const files[] = {"config.json", AM_CKPT_SINGLE};
        for (int f = 0; f < 2; f++) {
            snprintf(pa, sizeof(pa), "%s/%s", dist, files[f]);
            snprintf(pb, sizeof(pb), "%s/%s", ref, files[f]);
            same_file(r, pa, pb);
        }
    }
    no_errors(r, &err, "opening the checkpoints");
    am_ckpt_close(d);
    am_ckpt_close(w);
    am_model_free(&m);
}

/* Every rank: the saved directory loaded into a fresh shard equals the shard saved. */
static void check_load_back(struct run *r, const struct am_model *m, const char *dist)
{
    struct am_model m2;
    struct am_errors err;
    char msg[512];
    am_errors_init(&err);
    if (!check(r, am_model_init(&m2, &m->cfg, &m->sh, &r->dev, r->tpc, r->ppc, 1, 4, msg, sizeof(msg)) == 0, "%s", msg))
        return;
    am_model_load_hf(&m2, dist, &err);
    if (no_errors(r, &err, "am_model_load_hf") && check(r, m2.n_params == m->n_params, "parameter counts differ"))
        for (int i = 0; i < m->n_params; i++) {
            float *a = download(m, &m->params[i]), *b = download(&m2, &m2.params[i]);
            size_t n = (size_t)am_tensor_numel(&m->params[i].w);
            if (a && b)
                check(r, memcmp(a, b, n * sizeof(float)) == 0, "%s: this rank's slice loads back different",
                      m->params[i].name);
            free(a);
            free(b);
        }
    am_model_free(&m2);
}

/* One model (tied or not): save from the layout, then the checks. */
static void run_case(struct run *r, bool tie, bool perturb)
{
    char sub[4200], dist[4300], ref[4300], base[4300];
    snprintf(sub, sizeof(sub), "%s/tie%d", r->dir, tie);
    snprintf(dist, sizeof(dist), "%s/dist", sub);
    snprintf(ref, sizeof(ref), "%s/ref", sub);
    snprintf(base, sizeof(base), "%s/base.json", r->dir);
    struct am_model_config cfg = tiny_llama(tie);
    struct am_model_shard sh = my_shard(r);
    struct am_model m;
    struct am_errors err;
    char msg[AM_COMM_ERR_LEN];
    am_errors_init(&err);
    if (!check(r, am_model_init(&m, &cfg, &sh, &r->dev, r->tpc, r->ppc, 1, 4, msg, sizeof(msg)) == 0, "%s", msg))
        return;
    if (!check(r, am_model_init_weights(&m, SEED) == 0, "am_model_init_weights: out of host memory"))
        return;
    fill_biases(&m);
    if (perturb && r->rank == r->size - 1) { /* the test of the test */
        float *h = download(&m, &m.params[1]);
        h[0] += 1.0f;
        m.K->upload(m.dev, m.params[1].w.data, h, sizeof(float));
        free(h);
    }
    if (r->rank == 0) {
        mkdir(sub, 0755);
        FILE *f = fopen(base, "w");
        check(r, f && fputs("{\"bos_token_id\": 1, \"eos_token_id\": 2}\n", f) >= 0 && fclose(f) == 0,
              "cannot write %s", base);
    }
    am_model_save_hf_dist(&m, r->tpc, r->ppc, dist, base, &err);
    bool saved = no_errors(r, &err, "am_model_save_hf_dist");
    if (saved && r->rank == 0)
        check_against_whole(r, tie, dist, ref, base);
    if (saved)
        check_load_back(r, &m, dist);
    am_model_free(&m);
    check(r, am_barrier(r->world, msg, sizeof(msg)) == 0, "barrier: %s", msg);
}

/* The world, one tp group per pp rank and one pp group per tp rank (those of size > 1). */
static int make_groups(struct run *r, struct am_comm_ctx *ctx, char *err, size_t err_len)
{
    int n = 0, sizes[16], *members[16];
    const char *names[16];
    struct am_comm *out[16];
    for (int g = 0; g < 1 + (r->tp > 1) * r->pp + (r->pp > 1) * r->tp; g++) {
        members[n] = malloc((size_t)r->size * sizeof(int));
        sizes[n] = 0;
        bool tpg = g >= 1 && r->tp > 1 && g <= r->pp;
        int k = tpg ? g - 1 : g - 1 - (r->tp > 1) * r->pp; /* which pp rank, or which tp rank */
        for (int q = 0; q < r->size; q++)
            if (g == 0 || (tpg ? q / r->tp == k : q % r->tp == k))
                members[n][sizes[n]++] = q;
        names[n++] = g == 0 ? "world" : tpg ? "tp" : "pp";
    }
    int rc = am_comm_create_groups(ctx, n, (const int *const *)members, sizes, names, out, err, err_len);
    for (int g = 0; g < n; g++) {
        free(members[g]);
        if (rc < 0 || !out[g])
            continue;
        if (g == 0)
            r->world = out[g];
        else if (strcmp(names[g], "tp") == 0)
            r->tpc = out[g];
        else
            r->ppc = out[g];
    }
    return rc;
}

int main(int argc, char **argv)
{
    struct run r = {0};
    struct am_boot_info info;
    char err[1024];
    if (argc != 5) {
        fprintf(stderr, "usage: save_dist_check TP PP VIRTUAL DIR\n");
        return 2;
    }
    r.tp = atoi(argv[1]);
    r.pp = atoi(argv[2]);
    r.virt = atoi(argv[3]);
    r.dir = argv[4];
    struct am_boot *boot = am_boot_init(&info, err, sizeof(err));
    if (!boot) {
        fprintf(stderr, "save_dist_check: %s\n", err);
        return 3;
    }
    r.rank = info.rank;
    r.size = info.size;
    r.tp_rank = r.rank % (r.tp > 0 ? r.tp : 1);
    r.pp_rank = r.rank / (r.tp > 0 ? r.tp : 1);
    if (r.tp < 1 || r.pp < 1 || r.virt < 1 || r.tp * r.pp != r.size || r.tp + r.pp > 15 ||
        LAYERS % (r.pp * r.virt) != 0) {
        fprintf(stderr, "save_dist_check: tp %d x pp %d must be the %d ranks, pp x virtual divide %d layers\n", r.tp,
                r.pp, r.size, LAYERS);
        return 2;
    }
    const char *to = getenv("AM_COMM_TIMEOUT"), *perturb = getenv("SAVE_DIST_PERTURB");
    struct am_comm_ctx *ctx = am_comm_ctx_init(AM_COMM_UCX, boot, &info, -1, to ? atof(to) : 30, err, sizeof(err));
    if (!ctx) {
        fprintf(stderr, "save_dist_check: rank %d: %s\n", r.rank, err);
        return 3;
    }
    if (make_groups(&r, ctx, err, sizeof(err)) < 0) {
        fprintf(stderr, "save_dist_check: rank %d: %s\n", r.rank, err);
        return 3;
    }
    if (am_dev_open(&r.dev, AM_DEV_CPU, -1, err, sizeof(err)) < 0) {
        fprintf(stderr, "save_dist_check: rank %d: %s\n", r.rank, err);
        return 3;
    }
    for (int tie = 0; tie < 2; tie++)
        run_case(&r, tie, perturb && *perturb == '1');
    am_comm_destroy(r.tpc);
    am_comm_destroy(r.ppc);
    am_comm_destroy(r.world);
    am_comm_ctx_fini(ctx);
    am_boot_fini(boot);
    if (r.failures) {
        fprintf(stderr, "save_dist_check: rank %d: %ld of %ld checks FAILED\n", r.rank, r.failures, r.checks);
        return 1;
    }
    printf("save_dist_check: rank %d: %ld checks passed\n", r.rank, r.checks);
    return 0;
}
