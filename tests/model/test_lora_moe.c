/* test_lora_moe.c - LoRA on the experts of a mixture of experts (moe.h: AutoModel's
 * GroupedExpertsLoRA) in a small Mixtral on one CPU rank, every adapter (attention and
 * experts) started at random values (B too, so that every gradient is alive):
 *
 * 1. forward: the model with the experts' adapters computes the loss of the base model whose
 *    experts' weights are merged, W1 + s Bg A, W3 + s Bu A, W2 + s B_d A_d (the shared A of gate
 *    and up; what AutoModel's forward computes and what am-ckpt merge writes), its adapters' B
 *    then zero: the same summed loss within fp32's rounding;
 * 2. backward: the gradient of each kind of expert adapter (A, B of gate, B of up, A and B of
 *    down) along a ±1 direction of all its values, against central differences of the summed
 *    loss (am_model_loss; a step small enough that no token changes experts);
 * 3. the adapters' names, shapes and group: peft's per-expert names, "lora.experts" of kind
 *    AM_PG_LORA after "lora", the gradient slab holding both.
 * Each twice: the experts' adapters of rank r as the attention's, and of rank r / top-k
 * (AutoModel's moe_rank_scaling, sh.lora_experts_r), their scale alpha / (r / top-k).
 * Prints ok/FAIL lines; exits 1 on a failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "model.h"
#include "recipe.h"

static int fails;

static const char yaml[] = "model:\n"
                           "  model_type: mixtral\n"
                           "  vocab_size: 48\n"
                           "  hidden_size: 16\n"
                           "  intermediate_size: 12\n"
                           "  num_hidden_layers: 2\n"
                           "  num_attention_heads: 2\n"
                           "  num_key_value_heads: 1\n"
                           "  num_local_experts: 4\n"
                           "  num_experts_per_tok: 2\n"
                           "  max_position_embeddings: 64\n"
                           "  rope_theta: 10000.0\n"
                           "  rms_norm_eps: 1.0e-5\n"
                           "  torch_dtype: float32\n";

enum { B = 2, T = 8, R = 4, L = 2, E = 4, C = 16, I = 12 };
static const float ALPHA = 8.0f;

static unsigned seed = 12345;
static double urand(void)
{
    seed = seed * 1103515245u + 12345u;
    return (double)((seed >> 8) & 0xffffff) / (double)0x1000000;
}

static void expect(bool ok, const char *fmt, double a, double b)
{
    printf("%s: ", ok ? "ok" : "FAIL");
    printf(fmt, a, b);
    printf("\n");
    fails += !ok;
}

static struct am_param *param(struct am_model *m, const char *fmt, int l, int e)
{
    char n[160];
    snprintf(n, sizeof(n), fmt, l, e);
    int i = am_model_find(m, n);
    if (i < 0) {
        printf("FAIL: no parameter %s\n", n);
        exit(1);
    }
    return &m->params[i];
}

static double loss_of(struct am_model *m, const int32_t *tok, const int32_t *tgt)
{
    char err[512];
    double loss = 0;
    am_model_cast_weights(m);
    if (am_model_loss(m, tok, tgt, NULL, B, &loss, err, sizeof(err)) < 0) {
        printf("FAIL: am_model_loss: %s\n", err);
        exit(1);
    }
    return loss;
}

/* the gradient along a random ±1 direction of every parameter whose name has `kind`, against
 * central differences */
static void directional(struct am_model *m, const int32_t *tok, const int32_t *tgt, const char *kind)
{
    double gd = 0, h = 1e-3;
    int n = 0;
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        if (!strstr(p->name, kind))
            continue;
        n++;
        for (int64_t k = 0; k < am_tensor_numel(&p->w); k++)
            gd += ((float *)p->g.data)[k] * (((unsigned)k * 2654435761u + (unsigned)i) >> 7 & 1 ? 1.0 : -1.0);
    }
    double lv[2];
    for (int side = 0; side < 2; side++) {
        for (int i = 0; i < m->n_params; i++) {
            struct am_param *p = &m->params[i];
            for (int64_t k = 0; strstr(p->name, kind) && k < am_tensor_numel(&p->w); k++)
                ((float *)p->w.data)[k] += (float)((side ? -2 : 1) * h *
                                                   (((unsigned)k * 2654435761u + (unsigned)i) >> 7 & 1 ? 1.0 : -1.0));
        }
        lv[side] = loss_of(m, tok, tgt);
    }
    for (int i = 0; i < m->n_params; i++) { /* back to the start */
        struct am_param *p = &m->params[i];
        for (int64_t k = 0; strstr(p->name, kind) && k < am_tensor_numel(&p->w); k++)
            ((float *)p->w.data)[k] += (float)(h * (((unsigned)k * 2654435761u + (unsigned)i) >> 7 & 1 ? 1.0 : -1.0));
    }
    double fd = (lv[0] - lv[1]) / (2 * h), rel = fabs(fd - gd) / fmax(fabs(fd), 1e-3);
    char what[200];
    snprintf(what, sizeof(what), "gradient of the %d %s along a direction: %%.6g, central differences %%.6g", n,
             kind);
    expect(n > 0 && rel < 5e-3 && fabs(gd) > 1e-2, what, gd, fd);
}

/* one case: the experts' adapters of rank RE (sh.lora_experts_r; R: the same as the attention's) */
static int run(int RE)
{
    char err[512];
    seed = 12345;
    struct am_errors e;
    am_errors_init(&e);
    struct am_recipe *rc = am_recipe_parse("lora_moe.yaml", yaml, strlen(yaml), NULL, 0, &e);
    struct am_dev dev;
    if (!rc || e.n || am_dev_open(&dev, AM_DEV_CPU, -1, err, sizeof(err)) < 0) {
        printf("FAIL: setup: %s\n", e.n ? e.msg[0] : err);
        return 1;
    }
    struct am_model_shard sh = am_model_shard_whole(1, 0, L);
    sh.lora_r = R;
    sh.lora_alpha = ALPHA;
    sh.lora_targets = 1u << AM_LORA_Q | 1u << AM_LORA_V;
    sh.lora_experts = true;
    sh.lora_experts_r = RE == R ? 0 : RE;
    printf("the experts' adapters of rank %d, the attention's %d:\n", RE, R);
    struct am_model m;
    if (am_model_init(&m, &rc->model, &sh, &dev, NULL, NULL, B, T, err, sizeof(err)) < 0) {
        printf("FAIL: am_model_init: %s\n", err);
        return 1;
    }
    if (am_model_init_weights(&m, 7) < 0) {
        printf("FAIL: am_model_init_weights: out of host memory\n");
        return 1;
    }
    for (int i = 0; i < m.n_params; i++) /* every adapter random, B too */
        if (am_model_is_lora(&m.params[i]))
            for (int64_t k = 0; k < am_tensor_numel(&m.params[i].w); k++)
                ((float *)m.params[i].w.data)[k] = (float)(0.6 * urand() - 0.3);
    am_model_cast_weights(&m);
    int32_t tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++)
        tok[i] = (int32_t)(urand() * 48) % 48;
    for (int i = 0; i < B * T; i++)
        tgt[i] = i % T + 1 < T ? tok[i + 1] : -1;

    /* 3. names, shapes, groups */
    const struct am_pgroup *last = &m.groups[m.n_groups - 1], *prev = &m.groups[m.n_groups - 2];
    struct am_param *a = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w1.lora_A.weight", 1, 3);
    struct am_param *bd = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w2.lora_B.weight", 0, 2);
    struct am_param *bu = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w3.lora_B.weight", 0, 0);
    bool shapes = a->w.shape[0] == RE && a->w.shape[1] == C && bd->w.shape[0] == C && bd->w.shape[1] == RE &&
                  bu->w.shape[0] == I && bu->w.shape[1] == RE &&
                  am_model_find(&m, "model.layers.0.block_sparse_moe.experts.0.w3.lora_A.weight") < 0; /* gate's */
    bool groups = last->kind == AM_PG_LORA && strcmp(last->name, "lora.experts") == 0 &&
                  last->shard == AM_SHARD_EXPERT && last->n == L * 5 * E && prev->kind == AM_PG_LORA &&
                  strcmp(prev->name, "lora") == 0 && m.grad_off == prev->offset &&
                  m.grad_elems == m.slab_elems - prev->offset;
    expect(shapes && groups, "the experts' adapters: A [%g, 16] (gate's, shared with up), B of up [12, r], B of down "
           "[16, %g], in the group lora.experts after lora, in the gradient slab", RE, RE);

    /* 2. backward against central differences */
    double loss;
    am_model_begin_step(&m);
    if (am_model_step(&m, tok, tgt, NULL, B, 1.0f, &loss, err, sizeof(err)) < 0 ||
        am_model_finish_grads(&m, err, sizeof(err)) < 0) {
        printf("FAIL: am_model_step: %s\n", err);
        return 1;
    }
    const char *kinds[] = {".w1.lora_A.", ".w1.lora_B.", ".w3.lora_B.", ".w2.lora_A.", ".w2.lora_B."};
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++)
        directional(&m, tok, tgt, kinds[k]);

    /* 1. forward against the merged base */
    double with = loss_of(&m, tok, tgt);
    float s = ALPHA / RE; /* AutoModel's scale of the experts' adapters: alpha / their rank */
    for (int l = 0; l < L; l++)
        for (int x = 0; x < E; x++) {
            struct am_param *w1 = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l, x);
            struct am_param *w3 = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", l, x);
            struct am_param *w2 = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", l, x);
            struct am_param *la = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w1.lora_A.weight", l, x);
            struct am_param *lg = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w1.lora_B.weight", l, x);
            struct am_param *lu = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w3.lora_B.weight", l, x);
            struct am_param *lda = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w2.lora_A.weight", l, x);
            struct am_param *ldb = param(&m, "model.layers.%d.block_sparse_moe.experts.%d.w2.lora_B.weight", l, x);
            struct {
                struct am_param *w, *b, *a;
                int out, in;
            } mg[3] = {{w1, lg, la, I, C}, {w3, lu, la, I, C}, {w2, ldb, lda, C, I}};
            for (int q = 0; q < 3; q++) {
                float *W = mg[q].w->w.data, *Bm = mg[q].b->w.data, *Am = mg[q].a->w.data;
                for (int o = 0; o < mg[q].out; o++)
                    for (int c = 0; c < mg[q].in; c++) {
                        double acc = 0;
                        for (int r = 0; r < RE; r++)
                            acc += (double)Bm[o * RE + r] * Am[r * mg[q].in + c];
                        W[o * mg[q].in + c] += (float)(s * acc);
                    }
            }
            memset(lg->w.data, 0, sizeof(float) * I * RE);
            memset(lu->w.data, 0, sizeof(float) * I * RE);
            memset(ldb->w.data, 0, sizeof(float) * C * RE);
        }
    double merged = loss_of(&m, tok, tgt);
    expect(fabs(with - merged) <= 1e-5 * fabs(with) && fabs(with - loss) <= 1e-6 * fabs(with),
           "the summed loss with the experts' adapters %.7g, of the merged experts %.7g", with, merged);
    am_model_free(&m);
    am_dev_close(&dev);
    am_recipe_free(rc);
    am_errors_free(&e);
    return 0;
}

int main(void)
{
    if (run(R) || run(R / 2)) /* r / top-k: moe_rank_scaling's rank (top 2) */
        return 1;
    return fails ? 1 : 0;
}
