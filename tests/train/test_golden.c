/* test_golden.c - the model against Hugging Face transformers (tests/golden/).
 *
 * For each golden model directory: load it with am's own loader (recipe library + safetensors
 * checkpoint), run the golden batch, and compare with what transformers computed in fp32:
 *   logits        1e-5 absolute   (transformers' own fp32-vs-fp64 gap is 2.7e-7)
 *   loss          1e-5 absolute
 *   gradients     1e-5 of each tensor's largest |gradient| (fp32 vs fp64: 8.8e-7)
 *   5 AdamW steps 1e-5 absolute per loss, with and without clipping to norm 1
 *   final weights 5e-5 absolute after the clipped steps (Adam amplifies rounding: 5.2e-6 seen)
 * and, with bf16 mixed precision, against PyTorch running the same policy (check_bf16), and with
 * the parameters stored in bf16 (model.torch_dtype bfloat16, bf16 AdamW state) against PyTorch
 * trained as AutoModel trains that recipe (check_bf16store).
 * tests/golden/README.md gives the conventions: HF shifts labels inside the model, so token
 * t's target is input t+1 and the last position has none; the loss is the mean over targets.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels.h"
#include "model.h"
#include "half.h"
#include "model_io.h"
#include "moe.h"
#include "optim.h"
#include "packed.h"
#include "pipeline.h"
#include "plan.h"
#include "recipe.h"
#include "safetensors.h"

struct golden {
    struct am_recipe *recipe;
    struct am_st_file *g;
    struct am_model m;
    struct am_dev dev;
    const struct am_kernels *K; /* dev.k */
    int64_t B, T;
    int32_t *tokens, *targets;
    int32_t *starts; /* a packed case (llama_packed): each row's document start; else NULL */
    int32_t *fill;   /* a packed batch with pads (use_pack): each sequence's rows before them; else NULL */
    int n_targets;
    char dir[1024];
};

static float *read_all(struct golden *G, const char *name, int64_t *n)
{
    const struct am_st_info *t = am_st_find(G->g, name);
    if (!t) {
        print_error("golden %s has no tensor %s\n", G->dir, name);
        return NULL;
    }
    struct am_errors err;
    am_errors_init(&err);
    float *v = malloc((size_t)(t->numel ? t->numel : 1) * sizeof(float));
    if (am_st_read_f32(G->g, t, 0, t->numel, v, &err) < 0) {
        print_error("%s\n", err.msg[0]);
        free(v);
        v = NULL;
    }
    am_errors_free(&err);
    *n = t->numel;
    return v;
}

/* The golden's bf16 runs (make_bf16_golden.py's bf16.safetensors), made the file read_all reads;
 * the caller keeps G->g to put it back and closes the one returned. */
static struct am_st_file *open_bf16_ref(struct golden *G)
{
    char path[1100];
    struct am_errors err;
    struct am_st_file *ref = NULL;
    am_errors_init(&err);
    snprintf(path, sizeof(path), "%s/bf16.safetensors", G->dir);
    assert_int_equal(am_st_open(path, &ref, &err), 0);
    am_errors_free(&err);
    G->g = ref;
    return ref;
}

/* AM_GOLDEN_DEVICE=cuda runs the bf16 cases on the GPU (tests/gpu/run); the others need the
 * model in host memory and run on the CPU only. */
static enum am_device golden_device(void)
{
    const char *d = getenv("AM_GOLDEN_DEVICE");
    return d && strcmp(d, "cuda") == 0 ? AM_DEV_CUDA : AM_DEV_CPU;
}

/* The golden model `name` loaded into a whole-model shard computing in `compute` (fp32, or
 * bf16 mixed precision), with AutoModel's selection-bias update at `bias_factor` (0: none). */
/* bias_factor: the selection-bias update's; aux_coeff > 0: AutoModel's load-balancing loss in place of
 * transformers' (moe.h) */
/* store: the model as am-train builds it from a training recipe with model.torch_dtype bfloat16
 * and bf16 compute (`compute` is then the recipe's): its shard from the recipe's
 * one-rank plan (am_plan_build, am_pipe_init), so the parameters are stored as the recipe says. */
static void open_golden_impl(struct golden *G, const char *name, enum am_dtype compute, double bias_factor,
                             double aux_coeff, bool store)
{
    memset(G, 0, sizeof(*G));
    const char *src = getenv("AM_SRCDIR");
    snprintf(G->dir, sizeof(G->dir), "%s/tests/golden/models/%s", src ? src : ".", name);
    char yaml[2400], path[1100];
    struct am_errors err;
    am_errors_init(&err);
    snprintf(path, sizeof(path), "%s/golden.safetensors", G->dir);
    assert_int_equal(am_st_open(path, &G->g, &err), 0);
    const struct am_st_info *ids = am_st_find(G->g, "input_ids");
    assert_non_null(ids);
    assert_int_equal(ids->dtype, AM_ST_I32);
    G->B = ids->shape[0];
    G->T = ids->shape[1];
    if (store) /* the golden's bf16 AdamW (make_bf16_golden.py: lr 1e-3, clipping at 1.0) */
        snprintf(yaml, sizeof(yaml),
                 "model:\n  pretrained_model_name_or_path: %s\n  torch_dtype: bfloat16\n"
                 "distributed:\n  strategy: fsdp2\n  mp_policy:\n    param_dtype: bfloat16\n"
                 "step_scheduler:\n  global_batch_size: %lld\n  local_batch_size: %lld\n  max_steps: 5\n"
                 "dataset:\n  seq_length: %lld\n"
                 "optimizer:\n  _target_: torch.optim.AdamW\n  lr: 1.0e-3\n  betas: [0.9, 0.95]\n  eps: 1.0e-8\n"
                 "  weight_decay: 0.1\n"
                 "lr_scheduler:\n  lr_decay_style: constant\n  lr_warmup_steps: 0\n"
                 "clip_grad_norm:\n  max_norm: 1.0\n",
                 G->dir, (long long)G->B, (long long)G->B, (long long)G->T);
    else
        snprintf(yaml, sizeof(yaml), "model:\n  pretrained_model_name_or_path: %s\n", G->dir);
    G->recipe = am_recipe_parse("golden.yaml", yaml, strlen(yaml), NULL, 0, &err);
    for (size_t i = 0; i < err.n; i++)
        print_error("%s\n", err.msg[i]);
    assert_int_equal(err.n, 0);
    int64_t N = G->B * G->T;
    G->tokens = malloc((size_t)N * sizeof(int32_t));
    G->targets = malloc((size_t)N * sizeof(int32_t));
    memcpy(G->tokens, ids->data, (size_t)N * sizeof(int32_t));
    for (int64_t b = 0; b < G->B; b++)
        for (int64_t t = 0; t < G->T; t++)
            G->targets[b * G->T + t] = t + 1 < G->T ? G->tokens[b * G->T + t + 1] : -1;
    G->n_targets = (int)(G->B * (G->T - 1));
    const struct am_st_info *tg = am_st_find(G->g, "targets"), *st = am_st_find(G->g, "starts");
    if (st) { /* a pack (tests/golden/README.md): its own targets (-100: none) and documents */
        assert_non_null(tg);
        G->starts = malloc((size_t)N * sizeof(int32_t));
        memcpy(G->starts, st->data, (size_t)N * sizeof(int32_t));
        G->n_targets = 0;
        for (int64_t i = 0; i < N; i++) {
            int32_t v = ((const int32_t *)tg->data)[i];
            G->targets[i] = v < 0 ? -1 : v;
            G->n_targets += v >= 0;
        }
    }

    char msg[512];
    int rc_dev = am_dev_open(&G->dev, golden_device(), 0, msg, sizeof(msg));
    if (rc_dev < 0)
        print_error("%s\n", msg);
    assert_int_equal(rc_dev, 0);
    G->K = G->dev.k;
    G->recipe->model.gate_bias_update_factor = bias_factor;
    if (aux_coeff > 0) {
        G->recipe->model.aux_loss_coeff = aux_coeff;
        G->recipe->model.automodel_gate = true; /* AutoModel's own model: no transformers' loss */
    }
    struct am_model_shard sh = am_model_shard_whole(1, 0, (int)G->recipe->model.num_hidden_layers);
    sh.compute = compute;
    if (store) { /* am_train_build_model's shard: the recipe's, through its plan on one rank */
        struct am_world w = {.size = 1, .nodes = 1, .gpus_per_node = 1, .nvlink_domain = 1};
        struct am_plan plan;
        struct am_coords c;
        struct am_pipe pipe;
        int rc_plan = am_plan_build(G->recipe, &w, &plan, &err);
        for (size_t i = 0; i < err.n; i++)
            print_error("%s\n", err.msg[i]);
        assert_int_equal(rc_plan, 0);
        am_plan_coords(&plan, 0, &c);
        if (am_pipe_init(&pipe, &plan, G->recipe, &c, &sh, msg, sizeof(msg)) < 0)
            fail_msg("%s", msg);
        am_pipe_free(&pipe);
        am_plan_free(&plan);
        assert_int_equal(G->recipe->param_dtype, AM_BF16);
        assert_int_equal(sh.compute, AM_BF16);
    }
    assert_int_equal(am_model_init(&G->m, &G->recipe->model, &sh, &G->dev, NULL, NULL, G->B, G->T, msg, sizeof(msg)), 0);
    if (G->starts && am_packed_init(&G->m, G->T, msg, sizeof(msg)) < 0)
        fail_msg("%s", msg);
    int rc = am_model_load_hf(&G->m, G->dir, &err);
    for (size_t i = 0; i < err.n; i++)
        print_error("%s\n", err.msg[i]);
    assert_int_equal(rc, 0);
    am_errors_free(&err);
}

static void open_golden_with(struct golden *G, const char *name, enum am_dtype compute, double bias_factor,
                             double aux_coeff)
{
    open_golden_impl(G, name, compute, bias_factor, aux_coeff, false);
}

static void open_golden_as(struct golden *G, const char *name, enum am_dtype compute)
{
    open_golden_with(G, name, compute, 0.0, 0.0);
}

static void open_golden(struct golden *G, const char *name) { open_golden_as(G, name, AM_F32); }

static void close_golden(struct golden *G)
{
    am_model_free(&G->m);
    am_dev_close(&G->dev);
    am_st_close(G->g);
    am_recipe_free(G->recipe);
    free(G->tokens);
    free(G->targets);
    free(G->starts);
    free(G->fill);
}

/* AM_TEST_VERBOSE=1 prints each case's measured worst differences (what the tolerances above
 * are set against). */
static void report(const char *fmt, ...)
{
    if (!getenv("AM_TEST_VERBOSE"))
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
}

static double step(struct golden *G)
{
    double loss_sum;
    char msg[512];
    am_model_begin_step(&G->m);
    int rc = am_model_step(&G->m, G->tokens, G->targets, G->starts, G->B, 1.0f / (float)G->n_targets, &loss_sum, msg,
                           sizeof(msg));
    if (rc < 0)
        print_error("%s\n", msg);
    assert_int_equal(rc, 0);
    return loss_sum / G->n_targets;
}

static void check_forward_backward(const char *name)
{
    struct golden G;
    open_golden(&G, name);
    int64_t n;
    float *want_loss = read_all(&G, "loss", &n);
    double loss = step(&G);
    assert_true(fabs(loss - want_loss[0]) < 1e-5);
    double grad_worst = 0; /* relative to each tensor's largest */

    /* logits: the final hidden states (kept by the model) times the head */
    int64_t N = G.B * G.T, V = G.m.cfg.vocab_size;
    float *want = read_all(&G, "logits", &n);
    assert_int_equal(n, N * V);
    float *logits = G.K->alloc(&G.dev, (size_t)(N * V) * sizeof(float));
    struct am_tensor y = am_tensor_view(logits, AM_DEV_CPU, AM_F32, N, V, 0, 0);
    struct am_tensor hf = G.m.slots[0].hf;
    hf.shape[0] = N;
    G.K->matmul_forward(&G.dev, &y, &hf, &G.m.head->w);
    double cap = G.m.cfg.final_logit_softcapping; /* Gemma 2: cap * tanh(logit / cap) */
    for (int64_t i = 0; cap > 0 && i < N * V; i++)
        logits[i] = tanhf(logits[i] / (float)cap) * (float)cap;
    double worst = 0;
    for (int64_t i = 0; i < N * V; i++)
        worst = fmax(worst, fabs((double)logits[i] - want[i]));
    if (worst >= 1e-5)
        print_error("%s: logits differ by %g\n", name, worst);
    assert_true(worst < 1e-5);

    /* every parameter's gradient, relative to that tensor's largest */
    for (int i = 0; i < G.m.n_params; i++) {
        const struct am_param *p = &G.m.params[i];
        if (i > 0 && p == G.m.head && G.m.head == G.m.embed)
            continue;
        char key[160];
        snprintf(key, sizeof(key), "grad.%s", p->name);
        float *g = read_all(&G, key, &n);
        assert_non_null(g);
        assert_int_equal(n, am_tensor_numel(&p->g));
        const float *mine = p->g.data;
        double big = 0, diff = 0;
        for (int64_t k = 0; k < n; k++) {
            big = fmax(big, fabs(g[k]));
            diff = fmax(diff, fabs((double)mine[k] - g[k]));
        }
        if (diff > 1e-5 * big)
            print_error("%s: gradient of %s differs by %g (largest %g)\n", name, p->name, diff, big);
        assert_true(diff <= 1e-5 * big);
        grad_worst = fmax(grad_worst, diff / big);
        free(g);
    }
    if (am_st_find(G.g, "aux_loss")) { /* a mixture of experts: the load-balancing loss itself */
        float *want_aux = read_all(&G, "aux_loss", &n);
        struct am_moe_stats st;
        am_model_read_scalars(&G.m, &(struct am_model_values){0});
        am_moe_stats(&G.m, &st);
        if (fabs(st.aux - want_aux[0]) >= 1e-5)
            print_error("%s: aux loss %.7f, transformers %.7f\n", name, st.aux, want_aux[0]);
        assert_true(fabs(st.aux - want_aux[0]) < 1e-5);
        /* every token's k slots are counted once per MoE layer */
        assert_true(st.min >= 0 && st.max >= st.min && st.imbalance >= 1.0);
        report("%s: aux loss %.2e (tolerance 1e-5); tokens per expert min %lld max %lld imbalance %.2f\n", name,
               fabs(st.aux - want_aux[0]), (long long)st.min, (long long)st.max, st.imbalance);
        free(want_aux);
    }
    report("%s: loss %.2e, logits %.2e, gradients %.2e of the largest (tolerances 1e-5, 1e-5, 1e-5)\n", name,
           fabs(loss - want_loss[0]), worst, grad_worst);
    G.K->free(&G.dev, logits);
    free(want);
    free(want_loss);
    close_golden(&G);
}

/* The golden AdamW (betas (0.9, 0.95), eps 1e-8, weight decay 0.1) at learning rate lr, 5 steps
 * on the golden batch, clipping to norm 1 when `clip`: the loss before each step and the
 * gradient norm before clipping. With `loads` (the selection-bias update on): after each
 * optimizer step the trainer's update of the biases (one rank: nothing to sum), each step's
 * loads kept in loads[step * n ..] for n = the MoE layers x experts. */
static void adamw_steps(struct golden *G, float lr, bool clip, double *losses, double *norms, int64_t *loads)
{
    size_t E = G->m.n_elems;
    enum am_device dv = G->dev.device;
    float *mom = G->K->alloc(&G->dev, E * sizeof(float)), *var = G->K->alloc(&G->dev, E * sizeof(float));
    double *sumsq_dev = G->K->alloc(&G->dev, sizeof(double));
    struct am_tensor p = am_tensor_view(G->m.param_mem, dv, AM_F32, (int64_t)E, 0, 0, 0);
    struct am_tensor g = am_tensor_view(G->m.grad_mem, dv, AM_F32, (int64_t)E, 0, 0, 0);
    struct am_tensor m = am_tensor_view(mom, dv, AM_F32, (int64_t)E, 0, 0, 0);
    struct am_tensor v = am_tensor_view(var, dv, AM_F32, (int64_t)E, 0, 0, 0);
    struct am_tensor acc = am_tensor_view(sumsq_dev, dv, AM_F64, 1, 0, 0, 0);
    for (int s = 0; s < 5; s++) {
        losses[s] = step(G);
        double sumsq = 0;
        G->K->zero(&G->dev, &acc);
        G->K->sum_squares(&G->dev, &acc, &g, 1.0);
        G->K->download(&G->dev, &sumsq, sumsq_dev, sizeof(sumsq));
        norms[s] = sqrt(sumsq);
        /* the trainer's step (am_optim_step): clipping to norm 1 decided from the scalar */
        struct am_adamw_tensor slab = {.param = &p, .m = &m, .v = &v, .grad = &g};
        G->K->adamw_multi(&G->dev, &slab, 1, &acc, clip ? 1.0 : 0.0, NULL, lr, 0.9f, 0.95f, 1e-8f, 0.1f, s + 1);
        if (loads) {
            size_t n;
            void *at = am_moe_bias_loads(&G->m, &n);
            assert_non_null(at);
            G->K->download(&G->dev, loads + (size_t)s * n, at, n * sizeof(int64_t));
            am_moe_bias_update(&G->m);
        }
    }
    G->K->free(&G->dev, mom);
    G->K->free(&G->dev, var);
    G->K->free(&G->dev, sumsq_dev);
}

/* The golden AdamW: lr 1e-2, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, 5 steps on the
 * same batch; the losses are those before each step. */
static void check_adamw(const char *name, bool clip)
{
    struct golden G;
    open_golden(&G, name);
    int64_t n;
    float *want = read_all(&G, clip ? "losses_adamw_clip" : "losses_adamw", &n);
    float *norms = read_all(&G, clip ? "grad_norms_adamw_clip" : "grad_norms_adamw", &n);
    double loss_worst = 0, norm_worst = 0, final_worst = 0, loss[5], norm[5];
    adamw_steps(&G, 1e-2f, clip, loss, norm, NULL);
    for (int s = 0; s < 5; s++)
        report("%s: step %d loss %.7f (transformers %.7f), grad norm %.7f (transformers %.7f)\n", name, s + 1, loss[s],
               want[s], norm[s], norms[s]);
    for (int s = 0; s < 5; s++) {
        loss_worst = fmax(loss_worst, fabs(loss[s] - want[s]));
        if (fabs(loss[s] - want[s]) >= 1e-5)
            print_error("%s: step %d loss %.7f, transformers %.7f\n", name, s + 1, loss[s], want[s]);
        assert_true(fabs(loss[s] - want[s]) < 1e-5);
        assert_true(fabs(norm[s] - norms[s]) < 1e-5 * fmax(1.0, norms[s]));
        norm_worst = fmax(norm_worst, fabs(norm[s] - norms[s]) / fmax(1.0, norms[s]));
    }
    if (clip) { /* the weights themselves after the clipped steps */
        static const char *const finals[] = {"model.norm.weight", "lm_head.weight", "model.embed_tokens.weight",
                                             "model.layers.0.block_sparse_moe.gate.weight",
                                             "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight",
                                             "model.layers.0.mlp.router.weight"};
        for (size_t f = 0; f < sizeof(finals) / sizeof(finals[0]); f++) {
            char key[128];
            snprintf(key, sizeof(key), "final.%s", finals[f]);
            if (!am_st_find(G.g, key))
                continue;
            float *w = read_all(&G, key, &n);
            int i = am_model_find(&G.m, finals[f]);
            if (i < 0 && G.m.cfg.tie_word_embeddings) /* the tied head is the embedding */
                i = am_model_find(&G.m, "model.embed_tokens.weight");
            assert_true(i >= 0);
            const float *mine = G.m.params[i].w.data;
            double diff = 0;
            for (int64_t k = 0; k < n; k++)
                diff = fmax(diff, fabs((double)mine[k] - w[k]));
            if (diff >= 5e-5)
                print_error("%s: %s after 5 steps differs by %g\n", name, finals[f], diff);
            assert_true(diff < 5e-5);
            final_worst = fmax(final_worst, diff);
            free(w);
        }
    }
    report("%s: adamw%s: losses %.2e, grad norms %.2e relative (tolerances 1e-5, 1e-5)", name, clip ? " clipped" : "",
           loss_worst, norm_worst);
    report(clip ? "; final weights %.2e (tolerance 5e-5)\n" : "\n", final_worst);
    free(want);
    free(norms);
    close_golden(&G);
}

/* The rotary tables against transformers' own */
static void check_rope(const char *name)
{
    struct golden G;
    open_golden(&G, name);
    int64_t n;
    float *cos = read_all(&G, "rope_cos", &n), *sin = read_all(&G, "rope_sin", &n);
    const float *mc = G.m.cos.data, *ms = G.m.sin.data;
    double diff = 0;
    for (int64_t i = 0; i < n; i++)
        diff = fmax(diff, fmax(fabs((double)mc[i] - cos[i]), fabs((double)ms[i] - sin[i])));
    if (diff >= 2e-6)
        print_error("%s: rope tables differ by %g\n", name, diff);
    assert_true(diff < 2e-6);
    free(cos);
    free(sin);
    if (am_st_find(G.g, "rope_cos_local")) { /* Gemma 3's sliding layers: rope_local_base_freq */
        cos = read_all(&G, "rope_cos_local", &n);
        sin = read_all(&G, "rope_sin_local", &n);
        assert_non_null(G.m.cos_local.data);
        mc = G.m.cos_local.data;
        ms = G.m.sin_local.data;
        diff = 0;
        for (int64_t i = 0; i < n; i++)
            diff = fmax(diff, fmax(fabs((double)mc[i] - cos[i]), fabs((double)ms[i] - sin[i])));
        if (diff >= 2e-6)
            print_error("%s: local rope tables differ by %g\n", name, diff);
        assert_true(diff < 2e-6);
        free(cos);
        free(sin);
    }
    close_golden(&G);
}

/* A model saved by am reads back identically (and is what transformers loads: the golden
 * script's --check-am-export runs it there, see tests/golden/README.md). AM_KEEP_EXPORT=DIR
 * keeps the exported directory for that check. */
static void check_save(const char *name)
{
    struct golden G;
    open_golden(&G, name);
    char dir[512];
    const char *keep = getenv("AM_KEEP_EXPORT");
    snprintf(dir, sizeof(dir), "%s/%s", keep ? keep : "/tmp", name);
    if (!keep)
        snprintf(dir, sizeof(dir), "/tmp/am-test-export-%d-%s", (int)getpid(), name);
    struct am_errors err;
    am_errors_init(&err);
    char base[1100];
    snprintf(base, sizeof(base), "%s/config.json", G.dir);
    int rc = am_model_save_hf(&G.m, dir, base, &err);
    for (size_t i = 0; i < err.n; i++)
        print_error("%s\n", err.msg[i]);
    assert_int_equal(rc, 0);

    struct am_model back;
    char msg[512];
    struct am_model_shard sh = G.m.sh;
    assert_int_equal(am_model_init(&back, &G.recipe->model, &sh, &G.dev, NULL, NULL, G.B, G.T, msg, sizeof(msg)), 0);
    assert_int_equal(am_model_load_hf(&back, dir, &err), 0);
    assert_int_equal(back.n_elems, G.m.n_elems);
    assert_memory_equal(back.param_mem, G.m.param_mem, G.m.n_elems * sizeof(float));
    am_model_free(&back);
    if (!keep) {
        char cmd[600];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
        assert_int_equal(system(cmd), 0);
    }
    am_errors_free(&err);
    close_golden(&G);
}

/* The model refuses misuse with exact messages: chunks that are not runs of layers in model
 * order, a slot outside a chunk's slots, a backward with no forward before it. */
static void test_model_refuses(void **state)
{
    (void)state;
    struct golden G;
    open_golden(&G, "llama_tp"); /* 4 layers */
    char msg[512];
    struct am_model m;
    struct am_model_shard sh = {.tp = 1, .n_chunks = 2, .chunks = {{2, 2, 1}, {0, 1, 1}}};
    assert_int_equal(am_model_init(&m, &G.recipe->model, &sh, &G.dev, NULL, NULL, G.B, G.T, msg, sizeof(msg)), -1);
    assert_string_equal(msg, "model: chunk 1 (layers 0..0) is not a run of layers after the previous chunk within the "
                             "model's 4");
    assert_int_equal(am_model_forward(&G.m, 0, 1, G.B, G.tokens, G.targets, NULL, NULL, NULL, 1.0f, msg, sizeof(msg)), -1);
    assert_string_equal(msg, "model: slot 1 of chunk 0 out of range (1 slots)");
    assert_int_equal(am_model_forward(&G.m, 0, 0, G.B + 1, G.tokens, G.targets, NULL, NULL, NULL, 1.0f, msg, sizeof(msg)),
                     -1);
    assert_string_equal(msg, "model: a micro-batch of 48 tokens; this model was built for up to 32");
    assert_int_equal(am_model_backward(&G.m, 0, 0, NULL, NULL, 1.0f, msg, sizeof(msg)), -1);
    assert_string_equal(msg, "model: backward of slot 0 of chunk 0, which holds no forward");
    close_golden(&G);
}

/* bf16 mixed precision (tests/golden/make_bf16_golden.py): the clipped steps (at lr 1e-3, where
 * the tiny models' trajectories are not chaotic: make_bf16_golden.py says why) with a bf16 copy of
 * the weights and bf16 activations (fp32 masters, gradients and AdamW state), against PyTorch
 * running the same policy. Two implementations of one bf16 policy round in different places (a
 * fused kernel rounds once where PyTorch's separate operations round each time), so they may
 * differ by about as much as bf16 differs from fp32 (two independent roundings of one
 * computation are about sqrt 2 times further apart than either is from the exact value). The
 * first step is one forward and backward from the same weights: its loss must be within twice
 * PyTorch's |bf16 - fp32| plus 1e-4 of PyTorch's bf16 loss, its grad norm likewise
 * (relative). AdamW's first update moves every weight by about the learning rate in the
 * direction of its gradient's sign, so a gradient element near zero whose sign differs between
 * two bf16 implementations (or between bf16 and fp32) moves by twice that: from the second
 * step on the runs drift apart as bf16 and fp32 do, and each step's tolerance is three times
 * the largest |bf16 - fp32| of PyTorch's trajectory plus 1e-4 (loss; grad norm relative). The
 * final weights' L2 distance to PyTorch's bf16 ones is at most twice PyTorch's bf16-to-fp32
 * distance. And am's bf16 run must differ from its fp32 run (bf16 is really used).
 * Where the golden holds PyTorch's second bf16 run (the DeepSeekMoE cases: sdpa attention and
 * grouped_mm experts, make_bf16_golden.py), each |bf16 - fp32| above is the larger of it and that
 * run's distance to the eager bf16 run: two implementations of the policy measured directly
 * (a token near a routing tie may change its expert in one of them, which one run's distance
 * to fp32 does not show). */
static void check_bf16(const char *name)
{
    double l32[5], n32[5], l16[5], n16[5];
    struct golden G;
    open_golden_as(&G, name, AM_F32);
    adamw_steps(&G, 1e-3f, true, l32, n32, NULL);
    close_golden(&G);
    open_golden_as(&G, name, AM_BF16);
    adamw_steps(&G, 1e-3f, true, l16, n16, NULL);

    struct am_st_file *keep = G.g, *ref = open_bf16_ref(&G); /* read_all reads from G.g: ref's */
    int64_t n;
    float *tl16 = read_all(&G, "losses_bf16", &n), *tl32 = read_all(&G, "losses_fp32", &n);
    float *tn16 = read_all(&G, "grad_norms_bf16", &n), *tn32 = read_all(&G, "grad_norms_fp32", &n);
    bool second = am_st_find(ref, "losses_bf16_sdpa") != NULL; /* PyTorch's second bf16 run */
    float *tls = second ? read_all(&G, "losses_bf16_sdpa", &n) : NULL;
    float *tns = second ? read_all(&G, "grad_norms_bf16_sdpa", &n) : NULL;
    float *tws = second ? read_all(&G, "final_bf16_sdpa_distance", &n) : NULL;
    double own = 0, loss_worst = 0, norm_worst = 0, drift = 0, ndrift = 0, l_apart[5], n_apart[5];
    for (int s = 0; s < 5; s++) {
        l_apart[s] = fabs(tl16[s] - tl32[s]);
        n_apart[s] = fabs(tn16[s] - tn32[s]) / tn32[s];
        if (second) {
            l_apart[s] = fmax(l_apart[s], fabs(tls[s] - tl16[s]));
            n_apart[s] = fmax(n_apart[s], fabs(tns[s] - tn16[s]) / tn16[s]);
        }
        drift = fmax(drift, l_apart[s]);
        ndrift = fmax(ndrift, n_apart[s]);
    }
    for (int s = 0; s < 5; s++) {
        double tol = (s == 0 ? 2 * l_apart[0] : 3 * drift) + 1e-4, d = fabs(l16[s] - tl16[s]);
        double ntol = (s == 0 ? 2 * n_apart[0] : 3 * ndrift) + 1e-4;
        double nd = fabs(n16[s] - tn16[s]) / tn16[s];
        report("%s bf16 step %d: loss %.6f, torch bf16 %.6f (fp32 %.6f): diff %.2e, tolerance %.2e; grad norm "
               "diff %.2e relative, tolerance %.2e\n", name, s + 1, l16[s], tl16[s], tl32[s], d, tol, nd, ntol);
        if (d > tol || nd > ntol)
            print_error("%s bf16 step %d: loss %.6f vs torch %.6f (tolerance %.2e); grad norm %.6f vs %.6f "
                        "(tolerance %.2e relative)\n", name, s + 1, l16[s], tl16[s], tol, n16[s], tn16[s], ntol);
        assert_true(d <= tol);
        assert_true(nd <= ntol);
        loss_worst = fmax(loss_worst, d / tol);
        norm_worst = fmax(norm_worst, nd / ntol);
        own = fmax(own, fabs(l16[s] - l32[s]));
    }
    double d_am = 0, d_torch = 0;
    for (int i = 0; i < G.m.n_params; i++) {
        const struct am_param *p = &G.m.params[i];
        char key[160];
        snprintf(key, sizeof(key), "final_bf16.%s", p->name);
        float *w16 = read_all(&G, key, &n);
        snprintf(key, sizeof(key), "final_fp32.%s", p->name);
        float *w32 = read_all(&G, key, &n);
        assert_non_null(w16);
        assert_non_null(w32);
        assert_int_equal(n, am_tensor_numel(&p->w));
        float *mine = malloc((size_t)n * sizeof(float)); /* the fp32 master, wherever it lives */
        assert_non_null(mine);
        G.K->download(&G.dev, mine, p->w.data, (size_t)n * sizeof(float));
        for (int64_t k = 0; k < n; k++) {
            d_am += ((double)mine[k] - w16[k]) * ((double)mine[k] - w16[k]);
            d_torch += ((double)w32[k] - w16[k]) * ((double)w32[k] - w16[k]);
        }
        free(mine);
        free(w16);
        free(w32);
    }
    double w_apart = second ? fmax(sqrt(d_torch), tws[0]) : sqrt(d_torch);
    report("%s bf16: worst loss and norm at %.2f and %.2f of their tolerances; final weights %.3e from torch's "
           "bf16 (tolerance %.3e); am bf16 vs am fp32 losses differ by up to %.2e\n", name, loss_worst, norm_worst,
           sqrt(d_am), 2 * w_apart, own);
    if (sqrt(d_am) > 2 * w_apart)
        print_error("%s bf16: final weights %.3e from torch's bf16 run, tolerance %.3e\n", name, sqrt(d_am),
                    2 * w_apart);
    assert_true(sqrt(d_am) <= 2 * w_apart);
    assert_true(own > 1e-5); /* bf16 changed the computation */
    free(tls);
    free(tns);
    free(tws);
    free(tl16);
    free(tl32);
    free(tn16);
    free(tn32);
    am_st_close(ref);
    G.g = keep;
    close_golden(&G);
}

/* bf16 storage (model.torch_dtype bfloat16 with torch.optim.AdamW, as NeMo AutoModel trains it
 * under FSDP2: make_bf16_golden.py's bf16store run): the parameters stored in bf16, forward and
 * backward in bf16, the gradients rounded to bf16 before the optimizer, AdamW's moments in bf16.
 * am runs it as am-train does from a recipe saying so (open_golden_impl with store: the
 * shard from its plan, am_optim_init and am_optim_step with the recipe's AdamW at am_lr_at,
 * am_model_grad_sumsq's norm, clipping at 1.0), 5 steps on the golden batch, against PyTorch's
 * losses_bf16store, grad_norms_bf16store and final_bf16store.*. The tolerances follow
 * check_bf16's rule, derived from PyTorch's own distances to its fp32 run (losses_fp32,
 * grad_norms_fp32, final_fp32.*): d(s) is the largest of |bf16store(s) - fp32(s)|,
 * |bf16(s) - fp32(s)| (the fp32-master bf16 run: its step 1 is bf16store's forward and backward
 * from the same bf16 weights, a second draw of the same distance) and, where the golden holds
 * PyTorch's second bf16 run (sdpa, the DeepSeekMoE cases), that run's distance to the eager one
 * (grad norms relative); step 1's loss within 2 d(1) + 1e-4 of PyTorch's bf16store loss, each
 * later step's within 3 max_s d(s) + 1e-4 (grad norm likewise, relative); the final weights' L2
 * distance to PyTorch's bf16store ones at most twice the largest of the bf16store and bf16 runs'
 * distances to fp32's and the sdpa run's to the eager one. These tolerances (about 1e-2 from
 * step 2 on) are wider than the bf16store run's distance to PyTorch's fp32-master bf16 run
 * (2e-3 to 6e-3), so two more checks tell the storage apart: am's losses of steps 2 to 5 must be
 * nearer (L2 over the 4 steps) PyTorch's bf16store run than its bf16 run with fp32 masters
 * (bf16 storage freezes every norm weight, whose AdamW update of about lr 1e-3 is below half a
 * bf16 ulp of 1.0, and drops weight decay's 1e-4: the same in any implementation that stores
 * bf16), but in gpt_oss_tiny (`nearer` false: its trajectories pass routing ties from step 2
 * on, tests/golden/README.md, and a second implementation of bf16 storage lands only half as
 * far from the bf16store run as from the bf16 run, too close to call); and every parameter must
 * be stored in bf16 (p->w of dtype bf16, read widened). */
static void check_bf16store(const char *name, bool nearer)
{
    struct golden G;
    open_golden_impl(&G, name, AM_BF16, 0.0, 0.0, true);
    const struct am_recipe *r = G.recipe;
    struct am_optim optim;
    assert_int_equal(am_optim_init(&optim, &G.dev, G.m.grad_elems, G.m.store_dt, r), 0);
    double l16[5], n16[5];
    char msg[512];
    for (int s = 0; s < 5; s++) { /* train.c's run(), one rank: nothing to reduce over dp */
        l16[s] = step(&G);
        if (am_model_grad_sumsq(&G.m, msg, sizeof(msg)) < 0)
            fail_msg("%s", msg);
        am_optim_step(&optim, G.m.param_mem, G.m.grad_mem, AM_F32, am_model_sumsq(&G.m), r->optim.max_grad_norm,
                      (float)am_lr_at(r, s));
        struct am_model_values v;
        am_model_read_scalars(&G.m, &v);
        n16[s] = sqrt(v.sumsq);
    }

    struct am_st_file *keep = G.g, *ref = open_bf16_ref(&G); /* read_all reads from G.g: ref's */
    int64_t n;
    float *tst = read_all(&G, "losses_bf16store", &n), *tl32 = read_all(&G, "losses_fp32", &n);
    float *tnst = read_all(&G, "grad_norms_bf16store", &n), *tn32 = read_all(&G, "grad_norms_fp32", &n);
    float *tl16 = read_all(&G, "losses_bf16", &n), *tn16 = read_all(&G, "grad_norms_bf16", &n);
    assert_non_null(tst);
    assert_non_null(tnst);
    bool second = am_st_find(ref, "losses_bf16_sdpa") != NULL; /* PyTorch's second bf16 run */
    float *tls = second ? read_all(&G, "losses_bf16_sdpa", &n) : NULL;
    float *tns = second ? read_all(&G, "grad_norms_bf16_sdpa", &n) : NULL;
    float *tws = second ? read_all(&G, "final_bf16_sdpa_distance", &n) : NULL;
    double loss_worst = 0, norm_worst = 0, drift = 0, ndrift = 0, l_apart[5], n_apart[5];
    for (int s = 0; s < 5; s++) {
        l_apart[s] = fmax(fabs(tst[s] - tl32[s]), fabs(tl16[s] - tl32[s]));
        n_apart[s] = fmax(fabs(tnst[s] - tn32[s]) / tn32[s], fabs(tn16[s] - tn32[s]) / tn32[s]);
        if (second) {
            l_apart[s] = fmax(l_apart[s], fabs(tls[s] - tl16[s]));
            n_apart[s] = fmax(n_apart[s], fabs(tns[s] - tn16[s]) / tn16[s]);
        }
        drift = fmax(drift, l_apart[s]);
        ndrift = fmax(ndrift, n_apart[s]);
    }
    int failed = 0;
    for (int s = 0; s < 5; s++) {
        double tol = (s == 0 ? 2 * l_apart[0] : 3 * drift) + 1e-4, d = fabs(l16[s] - tst[s]);
        double ntol = (s == 0 ? 2 * n_apart[0] : 3 * ndrift) + 1e-4;
        double nd = fabs(n16[s] - tnst[s]) / tnst[s];
        report("%s bf16store step %d: loss %.6f, torch bf16store %.6f (fp32 %.6f, bf16 %.6f): diff %.2e, tolerance "
               "%.2e; grad norm %.6f, torch %.6f: diff %.2e relative, tolerance %.2e\n", name, s + 1, l16[s], tst[s],
               tl32[s], tl16[s], d, tol, n16[s], tnst[s], nd, ntol);
        if (!(d <= tol) || !(nd <= ntol)) {
            print_error("%s bf16store step %d: loss %.6f vs torch %.6f (tolerance %.2e); grad norm %.6f vs %.6f "
                        "(tolerance %.2e relative)\n", name, s + 1, l16[s], tst[s], tol, n16[s], tnst[s], ntol);
            failed++;
        }
        loss_worst = fmax(loss_worst, d / tol);
        norm_worst = fmax(norm_worst, nd / ntol);
    }
    /* nearer PyTorch's bf16store run than its fp32-master bf16 run, over steps 2 to 5 */
    double to_store = 0, to_masters = 0;
    for (int s = 1; s < 5; s++) {
        to_store += (l16[s] - tst[s]) * (l16[s] - tst[s]);
        to_masters += (l16[s] - tl16[s]) * (l16[s] - tl16[s]);
    }
    report("%s bf16store: losses of steps 2-5 %.2e from torch's bf16store run, %.2e from its bf16 run with fp32 "
           "masters (L2)\n", name, sqrt(to_store), sqrt(to_masters));
    if (nearer && !(to_store < to_masters))
        print_error("%s bf16store: losses of steps 2-5 %.2e from torch's bf16store run, nearer its fp32-master bf16 "
                    "run (%.2e): am trained fp32 masters?\n", name, sqrt(to_store), sqrt(to_masters));
    double d_am = 0, d_torch = 0, d_masters = 0;
    int not_bf16 = 0;
    for (int i = 0; i < G.m.n_params; i++) {
        const struct am_param *p = &G.m.params[i];
        char key[160];
        snprintf(key, sizeof(key), "final_bf16store.%s", p->name);
        float *wst = read_all(&G, key, &n);
        snprintf(key, sizeof(key), "final_bf16.%s", p->name);
        float *w16 = read_all(&G, key, &n);
        snprintf(key, sizeof(key), "final_fp32.%s", p->name);
        float *w32 = read_all(&G, key, &n);
        assert_non_null(wst);
        assert_non_null(w16);
        assert_non_null(w32);
        assert_int_equal(n, am_tensor_numel(&p->w));
        float *mine = malloc((size_t)n * sizeof(float)); /* the stored value, widened */
        assert_non_null(mine);
        am_param_read(&G.m, p, mine, 0, (size_t)n);
        not_bf16 += p->w.dtype != AM_BF16;
        for (int64_t k = 0; k < n; k++) {
            d_am += ((double)mine[k] - wst[k]) * ((double)mine[k] - wst[k]);
            d_torch += ((double)w32[k] - wst[k]) * ((double)w32[k] - wst[k]);
            d_masters += ((double)w32[k] - w16[k]) * ((double)w32[k] - w16[k]);
        }
        free(mine);
        free(wst);
        free(w16);
        free(w32);
    }
    double w_apart = fmax(sqrt(d_torch), sqrt(d_masters));
    if (second)
        w_apart = fmax(w_apart, tws[0]);
    report("%s bf16store: worst loss and norm at %.2f and %.2f of their tolerances; final weights %.3e from torch's "
           "bf16store (tolerance %.3e); %d of %d parameters not stored in bf16\n", name, loss_worst, norm_worst,
           sqrt(d_am), 2 * w_apart, not_bf16, G.m.n_params);
    if (sqrt(d_am) > 2 * w_apart)
        print_error("%s bf16store: final weights %.3e from torch's bf16store run, tolerance %.3e\n", name, sqrt(d_am),
                    2 * w_apart);
    if (not_bf16)
        print_error("%s bf16store: %d of %d parameters stored in fp32 with model.torch_dtype bfloat16\n", name,
                    not_bf16, G.m.n_params);
    assert_int_equal(failed, 0);
    assert_true(sqrt(d_am) <= 2 * w_apart);
    assert_true(!nearer || to_store < to_masters);
    assert_int_equal(not_bf16, 0);
    free(tls);
    free(tns);
    free(tws);
    free(tst);
    free(tl32);
    free(tnst);
    free(tn32);
    free(tl16);
    free(tn16);
    am_st_close(ref);
    G.g = keep;
    am_optim_free(&optim);
    close_golden(&G);
}

/* Packed sequences (llama_packed): the documents matter, and what does not fit is refused.
 * With every row's start at 0 (the rows as one sequence: plain causal attention, positions
 * 0 .. T - 1) the loss moves away from transformers' packed loss by far more than the golden
 * tolerance (the generator requires 1e-3: summary.json, loss_change_without_document_mask), and
 * with the pack's starts it is back within 1e-5. Exact messages for: no starts to a packed model,
 * a start after its row, starts to a model without packing. Gemma 2 and 3 and llama_yarn packed
 * one document per sequence give transformers' loss; packing in bf16 is test_llama_packed_bf16's, against
 * PyTorch. */
static void test_packed(void **state)
{
    (void)state;
    struct golden G;
    open_golden(&G, "llama_packed");
    int64_t n, N = G.B * G.T;
    float *want = read_all(&G, "loss", &n);
    int32_t *zero = calloc((size_t)N, sizeof(int32_t));
    assert_non_null(zero);
    double sum;
    char msg[512];
    assert_int_equal(am_model_loss(&G.m, G.tokens, G.targets, zero, G.B, &sum, msg, sizeof(msg)), 0);
    double off = fabs(sum / G.n_targets - want[0]);
    assert_int_equal(am_model_loss(&G.m, G.tokens, G.targets, G.starts, G.B, &sum, msg, sizeof(msg)), 0);
    double on = fabs(sum / G.n_targets - want[0]);
    report("llama_packed: loss without the documents %.2e from transformers' (must exceed 1e-3), with them %.2e "
           "(tolerance 1e-5)\n", off, on);
    assert_true(off > 1e-3);
    assert_true(on < 1e-5);
    assert_int_equal(am_model_loss(&G.m, G.tokens, G.targets, NULL, G.B, &sum, msg, sizeof(msg)), -1);
    assert_string_equal(msg, "model: packed sequences need each row's document start (starts is NULL)");
    zero[5] = 6;
    assert_int_equal(am_model_loss(&G.m, G.tokens, G.targets, zero, G.B, &sum, msg, sizeof(msg)), -1);
    assert_string_equal(msg, "packed sequences: row 5 of sequence 0 (position 5) has its document start at 6, outside "
                             "0 .. 5");
    close_golden(&G);
    open_golden(&G, "llama_gqa");
    assert_int_equal(am_model_loss(&G.m, G.tokens, G.targets, zero, G.B, &sum, msg, sizeof(msg)), -1);
    assert_string_equal(msg, "model: document starts given to a model without packed sequences");
    close_golden(&G);
    open_golden_as(&G, "llama_gqa", AM_BF16);
    assert_int_equal(am_packed_init(&G.m, G.T, msg, sizeof(msg)), 0); /* bf16: the block kernels' bf16 path */
    close_golden(&G);
    free(want);
    /* Gemma 2 and 3 packed, one document per sequence (every start 0): the block kernels with
     * Gemma's scale, soft cap and sliding window, and Gemma 3's second rotary table gathered
     * per row, give transformers' unpacked loss; so does yarn's table (the packed rows' own,
     * packed.c) */
    const char *one_doc[] = {"gemma2_tiny", "gemma3_tiny", "llama_yarn"};
    zero[5] = 0;
    for (int i = 0; i < 3; i++) {
        open_golden(&G, one_doc[i]);
        want = read_all(&G, "loss", &n);
        assert_true(G.B * G.T <= N);
        assert_int_equal(am_packed_init(&G.m, G.T, msg, sizeof(msg)), 0);
        assert_int_equal(am_model_loss(&G.m, G.tokens, G.targets, zero, G.B, &sum, msg, sizeof(msg)), 0);
        double d = fabs(sum / G.n_targets - want[0]);
        report("%s packed as one document per sequence: loss %.2e from transformers' (tolerance 1e-5)\n", one_doc[i],
               d);
        assert_true(d < 1e-5);
        free(want);
        close_golden(&G);
    }
    free(zero);
}

/* A packed batch of ref (input_ids, targets -100: none, starts, fill: each sequence's rows before its
 * pads) in place of G's golden batch, the model given packed sequences of G's length. */
static void use_pack(struct golden *G, const struct am_st_file *ref)
{
    const struct am_st_info *ids = am_st_find(ref, "input_ids"), *tg = am_st_find(ref, "targets");
    const struct am_st_info *st = am_st_find(ref, "starts"), *fi = am_st_find(ref, "fill");
    assert_true(ids && tg && st && fi && ids->numel == G->B * G->T && fi->numel == G->B);
    int64_t N = G->B * G->T;
    G->starts = realloc(G->starts, (size_t)N * sizeof(int32_t));
    G->fill = malloc((size_t)G->B * sizeof(int32_t));
    memcpy(G->tokens, ids->data, (size_t)N * sizeof(int32_t));
    memcpy(G->starts, st->data, (size_t)N * sizeof(int32_t));
    memcpy(G->fill, fi->data, (size_t)G->B * sizeof(int32_t));
    G->n_targets = 0;
    for (int64_t i = 0; i < N; i++) {
        int32_t v = ((const int32_t *)tg->data)[i];
        G->targets[i] = v < 0 ? -1 : v;
        G->n_targets += v >= 0;
    }
    char msg[512];
    if (!G->m.pk && am_packed_init(&G->m, G->T, msg, sizeof(msg)) < 0)
        fail_msg("%s", msg);
    am_model_set_pack_fill(&G->m, G->fill);
}

/* AutoModel's selection-bias update (tests/golden/make_bias_golden.py: transformers' model with
 * AutoModel's Gate.update_bias after each optimizer step, at a factor that changes some routing
 * choices within the 5 clipped AdamW steps): every step's tokens per expert and layer exactly,
 * the losses and grad norms as check_adamw's, each bias after the steps bit for bit (the same
 * fp32 sums of +-factor). file: bias_update, or bias_update_packed (a packed batch whose pads
 * are no load: AutoModel's token_mask). */
static void check_bias_update(const char *file)
{
    const char *src = getenv("AM_SRCDIR");
    char path[1200];
    struct am_errors err;
    am_errors_init(&err);
    struct am_st_file *ref = NULL;
    snprintf(path, sizeof(path), "%s/tests/golden/models/deepseek_v3_tiny/%s.safetensors", src ? src : ".", file);
    assert_int_equal(am_st_open(path, &ref, &err), 0);
    const struct am_st_info *fi = am_st_find(ref, "factor"), *li = am_st_find(ref, "loads");
    const struct am_st_info *wl = am_st_find(ref, "losses"), *wn = am_st_find(ref, "grad_norms");
    assert_true(fi && li && wl && wn && li->dtype == AM_ST_I32 && li->ndim == 3 && li->shape[0] == 5);
    float factor, want_loss[5], want_norm[5];
    assert_int_equal(am_st_read_f32(ref, fi, 0, 1, &factor, &err), 0);
    assert_int_equal(am_st_read_f32(ref, wl, 0, 5, want_loss, &err), 0);
    assert_int_equal(am_st_read_f32(ref, wn, 0, 5, want_norm, &err), 0);
    struct golden G;
    open_golden_with(&G, "deepseek_v3_tiny", AM_F32, factor, 0.0);
    if (am_st_find(ref, "fill"))
        use_pack(&G, ref);
    int64_t per = li->shape[1] * li->shape[2], *loads = calloc(5 * (size_t)per, sizeof(int64_t));
    double loss[5], norm[5], loss_worst = 0;
    adamw_steps(&G, 1e-2f, true, loss, norm, loads);
    const int32_t *want_loads = (const int32_t *)li->data;
    for (int64_t i = 0; i < 5 * per; i++) {
        if (loads[i] != want_loads[i])
            print_error("deepseek_v3_tiny: step %lld, MoE layer %lld: expert %lld has %lld tokens, transformers' %d\n",
                        (long long)(i / per + 1), (long long)(i % per / li->shape[2]), (long long)(i % li->shape[2]),
                        (long long)loads[i], want_loads[i]);
        assert_int_equal(loads[i], want_loads[i]);
    }
    for (int s = 0; s < 5; s++) {
        loss_worst = fmax(loss_worst, fabs(loss[s] - want_loss[s]));
        if (fabs(loss[s] - want_loss[s]) >= 1e-5)
            print_error("deepseek_v3_tiny: bias update: step %d loss %.7f, transformers %.7f\n", s + 1, loss[s],
                        want_loss[s]);
        assert_true(fabs(loss[s] - want_loss[s]) < 1e-5);
        assert_true(fabs(norm[s] - want_norm[s]) < 1e-5 * fmax(1.0, want_norm[s]));
    }
    int biases = 0;
    for (int l = 0; l < G.m.n_layers; l++) {
        const struct am_moe_layer *X = G.m.layers[l].moe;
        if (!X)
            continue;
        char key[128];
        snprintf(key, sizeof(key), "final.%s", X->bias_name);
        const struct am_st_info *t = am_st_find(ref, key);
        assert_non_null(t);
        assert_int_equal(t->numel, am_tensor_numel(&X->bias));
        assert_memory_equal(X->bias.data, t->data, (size_t)t->numel * sizeof(float));
        biases++;
    }
    assert_int_equal(biases, li->shape[1]);
    report("deepseek_v3_tiny: %s (factor %g): loads and biases exact, losses %.2e (tolerance 1e-5)\n", file,
           factor, loss_worst);
    free(loads);
    close_golden(&G);
    am_st_close(ref);
    am_errors_free(&err);
}

static void test_deepseek_v3_tiny_bias_update(void **state)
{
    (void)state;
    check_bias_update("bias_update");
}

static void test_deepseek_v3_tiny_bias_update_packed(void **state)
{
    (void)state;
    check_bias_update("bias_update_packed");
}

/* AutoModel's own load-balancing loss (tests/golden/make_aux_golden.py: transformers' model with
 * AutoModel's Gate._compute_aux_loss and MoEAuxLossAutoScaler applied to each router's output, the
 * cross entropy alone trained and reported): 5 clipped AdamW steps' losses, grad norms and aux
 * values, and the routers after them; micro 2: each step's batch as two micro-batches of one
 * sequence (the aux loss's gradient over 2, as am_moe_set_aux_div says; keys mb2.*); micro 0: the
 * packed batch of aux_loss_packed.safetensors in one micro-batch (its pads out of load, score sums
 * and T, and without the loss's gradient: AutoModel's token_mask). */
static void check_aux_loss(const char *name, int micro)
{
    bool packed = micro == 0;
    micro = packed ? 1 : micro;
    const char *pre = micro > 1 ? "mb2." : "";
    char kc[64], ka[64], kl[64], kn[64];
    snprintf(kc, sizeof(kc), "coeff");
    snprintf(ka, sizeof(ka), "%saux", pre);
    snprintf(kl, sizeof(kl), "%slosses", pre);
    snprintf(kn, sizeof(kn), "%sgrad_norms", pre);
    const char *src = getenv("AM_SRCDIR");
    char path[1200];
    struct am_errors err;
    am_errors_init(&err);
    struct am_st_file *ref = NULL;
    snprintf(path, sizeof(path), "%s/tests/golden/models/%s/aux_loss%s.safetensors", src ? src : ".", name,
             packed ? "_packed" : "");
    assert_int_equal(am_st_open(path, &ref, &err), 0);
    const struct am_st_info *ci = am_st_find(ref, kc), *ai = am_st_find(ref, ka);
    const struct am_st_info *wl = am_st_find(ref, kl), *wn = am_st_find(ref, kn);
    assert_true(ci && ai && wl && wn);
    float coeff, want_loss[5], want_norm[5], want_aux[5];
    assert_int_equal(am_st_read_f32(ref, ci, 0, 1, &coeff, &err), 0);
    assert_int_equal(am_st_read_f32(ref, wl, 0, 5, want_loss, &err), 0);
    assert_int_equal(am_st_read_f32(ref, wn, 0, 5, want_norm, &err), 0);
    assert_int_equal(am_st_read_f32(ref, ai, 0, 5, want_aux, &err), 0);
    struct golden G;
    open_golden_with(&G, name, AM_F32, 0.0, coeff);
    assert_true(G.B % micro == 0 && !G.starts);
    if (packed)
        use_pack(&G, ref);
    am_moe_set_aux_div(&G.m, micro); /* one rank: the step's micro-batches */
    size_t E = G.m.n_elems;
    enum am_device dv = G.dev.device;
    float *mom = G.K->alloc(&G.dev, E * sizeof(float)), *var = G.K->alloc(&G.dev, E * sizeof(float));
    double *sumsq_dev = G.K->alloc(&G.dev, sizeof(double)), worst[3] = {0, 0, 0};
    struct am_tensor p = am_tensor_view(G.m.param_mem, dv, AM_F32, (int64_t)E, 0, 0, 0);
    struct am_tensor g = am_tensor_view(G.m.grad_mem, dv, AM_F32, (int64_t)E, 0, 0, 0);
    struct am_tensor m = am_tensor_view(mom, dv, AM_F32, (int64_t)E, 0, 0, 0);
    struct am_tensor v = am_tensor_view(var, dv, AM_F32, (int64_t)E, 0, 0, 0);
    struct am_tensor acc = am_tensor_view(sumsq_dev, dv, AM_F64, 1, 0, 0, 0);
    for (int s = 0; s < 5; s++) {
        double loss = 0, sumsq = 0;
        if (micro == 1) {
            loss = step(&G);
        } else { /* gradient accumulation: each micro-batch's targets over the step's */
            char msg[512];
            int64_t rows = G.B / micro, n = rows * G.T;
            am_model_begin_step(&G.m);
            for (int mb = 0; mb < micro; mb++) {
                double sum = 0;
                int rc = am_model_step(&G.m, G.tokens + mb * n, G.targets + mb * n, NULL, rows,
                                       1.0f / (float)G.n_targets, &sum, msg, sizeof(msg));
                if (rc < 0)
                    print_error("%s\n", msg);
                assert_int_equal(rc, 0);
                loss += sum;
            }
            loss /= G.n_targets;
        }
        struct am_moe_stats st;
        am_moe_stats(&G.m, &st);
        G.K->zero(&G.dev, &acc);
        G.K->sum_squares(&G.dev, &acc, &g, 1.0);
        G.K->download(&G.dev, &sumsq, sumsq_dev, sizeof(sumsq));
        double d[3] = {fabs(loss - want_loss[s]), fabs(sqrt(sumsq) - want_norm[s]) / fmax(1.0, want_norm[s]),
                       fabs(st.aux - want_aux[s])};
        report("%s: aux loss: step %d loss %.7f (%.7f), grad norm %.7f (%.7f), aux %.7f (%.7f)\n", name, s + 1, loss,
               want_loss[s], sqrt(sumsq), want_norm[s], st.aux, want_aux[s]);
        for (int i = 0; i < 3; i++) {
            if (d[i] >= 1e-5)
                print_error("%s: aux loss: step %d: %s differs by %g\n", name, s + 1,
                            i == 0 ? "loss" : i == 1 ? "grad norm" : "aux", d[i]);
            assert_true(d[i] < 1e-5);
            worst[i] = fmax(worst[i], d[i]);
        }
        struct am_adamw_tensor slab = {.param = &p, .m = &m, .v = &v, .grad = &g};
        G.K->adamw_multi(&G.dev, &slab, 1, &acc, 1.0, NULL, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, s + 1);
    }
    int finals = 0;
    for (size_t i = 0; i < am_st_count(ref); i++) {
        const struct am_st_info *t = am_st_at(ref, i);
        const char *key = t->name;
        size_t lp = strlen(pre);
        if (strncmp(key, pre, lp) != 0 || strncmp(key + lp, "final.", 6) != 0)
            continue;
        key += lp;
        int k = am_model_find(&G.m, key + 6);
        assert_true(k >= 0);
        const float *mine = G.m.params[k].w.data, *want = (const float *)t->data;
        double diff = 0;
        for (int64_t j = 0; j < t->numel; j++)
            diff = fmax(diff, fabs((double)mine[j] - want[j]));
        if (diff >= 5e-5)
            print_error("%s: aux loss: %s after 5 steps differs by %g\n", name, key + 6, diff);
        assert_true(diff < 5e-5);
        finals++;
    }
    assert_true(finals > 0);
    report("%s: aux loss (coeff %g, %d micro-batch(es)%s): losses %.2e, grad norms %.2e relative, aux %.2e (tolerances "
           "1e-5), %d routers after the steps\n", name, coeff, micro, packed ? ", packed" : "", worst[0], worst[1],
           worst[2], finals);
    G.K->free(&G.dev, mom);
    G.K->free(&G.dev, var);
    G.K->free(&G.dev, sumsq_dev);
    close_golden(&G);
    am_st_close(ref);
    am_errors_free(&err);
}

static void test_deepseek_v3_tiny_aux_loss(void **s)
{
    (void)s;
    check_aux_loss("deepseek_v3_tiny", 1);
    check_aux_loss("deepseek_v3_tiny", 2);
    check_aux_loss("deepseek_v3_tiny", 0);
}

static void test_gpt_oss_tiny_aux_loss(void **s)
{
    (void)s;
    check_aux_loss("gpt_oss_tiny", 1);
    check_aux_loss("gpt_oss_tiny", 2);
    check_aux_loss("gpt_oss_tiny", 0);
}

#define CASE_FP32(name)                                                                                            \
    static void test_##name##_forward_backward(void **s) { (void)s; check_forward_backward(#name); }            \
    static void test_##name##_adamw(void **s) { (void)s; check_adamw(#name, false); }                            \
    static void test_##name##_adamw_clip(void **s) { (void)s; check_adamw(#name, true); }                        \
    static void test_##name##_rope(void **s) { (void)s; check_rope(#name); }                                     \
    static void test_##name##_save(void **s) { (void)s; check_save(#name); }
#define CASE(name)                                                                                                 \
    CASE_FP32(name)                                                                                                \
    static void test_##name##_bf16(void **s) { (void)s; check_bf16(#name); }
CASE(llama_gqa)
CASE(llama_tied)
CASE(llama3_scaling)
CASE(llama_yarn) /* yarn */
CASE(llama_tp)
CASE(qwen2_tiny)
CASE(qwen2_window)
CASE(qwen3_tiny)
CASE(mistral_window)
CASE_FP32(mixtral_tiny) /* no bf16 golden: make_bf16_golden.py says why */
CASE(qwen3_moe_tiny)
CASE_FP32(gemma2_tiny) /* Gemma: fp32 goldens */
CASE_FP32(gemma3_tiny)
CASE(llama_packed) /* packed sequences (packed.h); bf16: the block kernels' bf16 path */
CASE(glm4_moe_tiny) /* GLM-4.5: partial rotary, q/k norms, DeepSeekMoE */
CASE(deepseek_v3_tiny) /* DeepSeek-V3: multi-head latent attention (q_lora_rank, rope_interleave) */
CASE_FP32(deepseek_v3_qproj) /* q_proj (q_lora_rank null), v wider than q and k; no bf16: make_bf16_golden.py */
CASE(deepseek_v3_yarn) /* yarn rope scaling: the tables' ramp and attention factor, the softmax's mscale² */
CASE(gpt_oss_tiny) /* gpt-oss: sinks, q/k/v/o biases, alternating windows, yarn, the biased router and experts */
/* bf16 storage (model.torch_dtype bfloat16, bf16 AdamW state): the cases whose golden has the bf16store run */
#define STORE(name, nearer) static void test_##name##_bf16store(void **s) { (void)s; check_bf16store(#name, nearer); }
STORE(llama_gqa, true)
STORE(qwen3_moe_tiny, true)
STORE(deepseek_v3_tiny, true)
STORE(gpt_oss_tiny, false) /* routing ties from step 2 on: no "nearer" check (check_bf16store) */
#define TESTS_FP32(name)                                                                                           \
    cmocka_unit_test(test_##name##_rope), cmocka_unit_test(test_##name##_forward_backward),                       \
        cmocka_unit_test(test_##name##_adamw), cmocka_unit_test(test_##name##_adamw_clip),                         \
        cmocka_unit_test(test_##name##_save)
#define TESTS(name) TESTS_FP32(name), cmocka_unit_test(test_##name##_bf16)

int main(void)
{
    const struct CMUnitTest tests[] = {TESTS(llama_gqa), TESTS(llama_tied), TESTS(llama3_scaling), TESTS(llama_tp),
                                       TESTS(llama_yarn), /* yarn's rope */
                                       TESTS(qwen2_tiny),     TESTS(qwen2_window),
                                       TESTS(qwen3_tiny),     TESTS(mistral_window),
                                       /* mixtures of experts (mixtral_tiny without bf16) */
                                       TESTS_FP32(mixtral_tiny), TESTS(qwen3_moe_tiny),
                                       /* Gemma 2 (soft-capping, post norms, GeGLU), Gemma 3 (q/k norms, two ropes) */
                                       TESTS_FP32(gemma2_tiny), TESTS_FP32(gemma3_tiny),
                                       /* GLM-4.5 (glm4_moe): partial rotary, DeepSeekMoE's router, shared experts */
                                       TESTS(glm4_moe_tiny),
                                       /* DeepSeek-V3 (deepseek_v3): multi-head latent attention, DeepSeekMoE */
                                       TESTS(deepseek_v3_tiny), TESTS_FP32(deepseek_v3_qproj),
                                       TESTS(deepseek_v3_yarn), cmocka_unit_test(test_deepseek_v3_tiny_bias_update),
                                       cmocka_unit_test(test_deepseek_v3_tiny_bias_update_packed),
                                       cmocka_unit_test(test_deepseek_v3_tiny_aux_loss),
                                       /* gpt-oss (gpt_oss): attention sinks, biases, clamped SwiGLU experts */
                                       TESTS(gpt_oss_tiny), cmocka_unit_test(test_gpt_oss_tiny_aux_loss),
                                       /* packed sequences: documents in a sequence, none seeing another */
                                       TESTS(llama_packed), cmocka_unit_test(test_packed),
                                       cmocka_unit_test(test_model_refuses),
                                       /* bf16 storage: model.torch_dtype bfloat16 with torch.optim.AdamW */
                                       cmocka_unit_test(test_llama_gqa_bf16store),
                                       cmocka_unit_test(test_qwen3_moe_tiny_bf16store),
                                       cmocka_unit_test(test_deepseek_v3_tiny_bf16store),
                                       cmocka_unit_test(test_gpt_oss_tiny_bf16store)};
    /* on a GPU (AM_GOLDEN_DEVICE=cuda): the bf16 cases and bf16 storage, the models in device memory */
    const struct CMUnitTest gpu[] = {
        cmocka_unit_test(test_llama_gqa_bf16),        cmocka_unit_test(test_llama_tied_bf16),
        cmocka_unit_test(test_llama3_scaling_bf16),   cmocka_unit_test(test_llama_tp_bf16),
        cmocka_unit_test(test_llama_yarn_bf16),       cmocka_unit_test(test_qwen2_tiny_bf16),
        cmocka_unit_test(test_qwen2_window_bf16),     cmocka_unit_test(test_qwen3_tiny_bf16),
        cmocka_unit_test(test_mistral_window_bf16),   cmocka_unit_test(test_qwen3_moe_tiny_bf16),
        cmocka_unit_test(test_glm4_moe_tiny_bf16),    cmocka_unit_test(test_deepseek_v3_tiny_bf16),
        cmocka_unit_test(test_deepseek_v3_yarn_bf16), cmocka_unit_test(test_gpt_oss_tiny_bf16),
        cmocka_unit_test(test_llama_packed_bf16),     cmocka_unit_test(test_llama_gqa_bf16store),
        cmocka_unit_test(test_qwen3_moe_tiny_bf16store), cmocka_unit_test(test_deepseek_v3_tiny_bf16store),
        cmocka_unit_test(test_gpt_oss_tiny_bf16store)};
    if (golden_device() == AM_DEV_CUDA)
        return cmocka_run_group_tests_name("golden bf16 (cuda)", gpu, NULL, NULL);
    return cmocka_run_group_tests_name("golden", tests, NULL, NULL);
}
