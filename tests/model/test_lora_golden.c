/* test_lora_golden.c - the model with LoRA adapters (model.h: lora_r, lora_targets) against the
 * peft library on transformers (tests/golden/models/llama_lora_qv, llama_lora_all,
 * llama_lora_head: q, v and lm_head, and gemma2_lora_head: the same on Gemma 2, whose head is
 * tied to the embedding and whose logits are soft-capped; glm4_moe_lora: GLM-4.5 MoE's q, k, v,
 * o, its dense layer's MLP, its shared experts' MLP (peft's mlp.shared_experts.gate_proj ...)
 * and lm_head; deepseek_v3_lora: DeepSeek-V3's multi-head latent attention (q_a_proj, q_b_proj,
 * kv_a_proj_with_mqa, kv_b_proj, o_proj), its dense and shared MLPs and lm_head; gpt_oss_lora:
 * gpt-oss's q, k, v and o (their biases and the attention sinks frozen); gpt_oss_lora_experts:
 * those and the experts, AutoModel's GroupedExpertsLoRA, whose gradients peft holds in its
 * ParamWrapper tensors of the fused experts (am_model_peft_place finds each element); README.md).
 *
 * For each case: the base model from base/, the adapters peft saved from adapter_init/
 * (am_model_load_peft), one forward and backward of the golden batch on the CPU in fp32: the
 * loss within 1e-5 and every adapter's gradient within 1e-5 of that tensor's largest (the full
 * models' tolerances, tests/golden/README.md); the frozen base has no gradient memory at all (no
 * base parameter's g points anywhere: no weight-gradient kernel of the base can run); the
 * adapters are the model's last parameter group, alone (with the experts', the last two).
 * Before the load: am_model_init_lora's two initialisations (check_init) and a full save
 * (am_model_save_hf) that holds the base tensors only.
 * The 5 AdamW steps of the golden (losses_adamw, final.*) are checked with the trainer's
 * adapter-only optimizer by tests/train/test-lora-golden.sh (golden_dist).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "model.h"
#include "model_io.h"
#include "recipe.h"
#include "safetensors.h"

static int fails;

/* am_model_init_lora: B zero; A within kaiming's bound 1 / sqrt(in) and filling it, or with
 * xavier's std sqrt(2 / (in + r)) (pooled over every A, within 10%: over 1024 or more samples
 * the estimate's own error is about 2%). */
static int check_init(struct am_model *m, const char *name)
{
    int bad = 0;
    for (int kaiming = 0; kaiming < 2; kaiming++) {
        if (am_model_init_lora(m, 7, kaiming) < 0) {
            printf("FAIL: am_model_init_lora: out of host memory\n");
            return -1;
        }
        double sum2 = 0, want2 = 0, worst = 0;
        int64_t n_a = 0;
        for (int i = 0; i < m->n_params; i++) {
            const struct am_param *p = &m->params[i];
            if (!am_model_is_lora(p))
                continue;
            const float *w = p->w.data;
            int64_t n = am_tensor_numel(&p->w);
            bool is_b = strstr(p->name, ".lora_B.") != NULL;
            double in = (double)p->full_cols, r = (double)p->full_rows;
            for (int64_t k = 0; k < n; k++) {
                if (is_b) {
                    bad += w[k] != 0;
                    continue;
                }
                sum2 += (double)w[k] * w[k];
                want2 += 2 / (in + r);
                worst = fmax(worst, fabs(w[k]) * sqrt(in));
                n_a++;
            }
        }
        double ratio = sqrt(sum2 / want2);
        bool ok = kaiming ? worst <= 1 && worst > 0.9 : fabs(ratio - 1) < 0.1;
        printf("%s: %s: %s init of %lld A elements: %s %.3f\n", ok && !bad ? "ok" : "FAIL", name,
               kaiming ? "kaiming" : "xavier", (long long)n_a, kaiming ? "max |a| sqrt(in)" : "std / xavier's",
               kaiming ? worst : ratio);
        bad += !ok;
    }
    /* a full save holds the base model only */
    char tmp[] = "/tmp/am-lora-save-XXXXXX", path[128];
    struct am_errors err;
    am_errors_init(&err);
    struct am_st_file *f = NULL;
    char out[64];
    if (!mkdtemp(tmp)) {
        printf("FAIL: %s: mkdtemp\n", name);
        return -1;
    }
    snprintf(out, sizeof(out), "%s/out", tmp);
    snprintf(path, sizeof(path), "%s/model.safetensors", out);
    int lora = 0;
    if (am_model_save_hf(m, out, NULL, &err) < 0 || am_st_open(path, &f, &err) < 0) {
        printf("FAIL: %s: save: %s\n", name, err.n ? err.msg[0] : "?");
        bad++;
    } else {
        int biases = 0; /* glm4_moe's selection biases: saved, not parameters */
        for (size_t i = 0; i < am_st_count(f); i++) {
            lora += strstr(am_st_at(f, i)->name, ".lora_") != NULL;
            biases += strstr(am_st_at(f, i)->name, ".e_score_correction_bias") != NULL;
        }
        int adapters = 0, fused = 0; /* gpt_oss: each layer's 6 E expert parameters saved as 4 fused tensors */
        for (int i = 0; i < m->n_params; i++)
            adapters += am_model_is_lora(&m->params[i]);
        for (int l = 0; m->cfg.gpt_oss && l < m->n_layers; l++)
            fused += m->layers[l].moe ? 6 * (int)m->cfg.num_experts - 4 : 0;
        bool ok = lora == 0 && (int)am_st_count(f) - biases == m->n_params - adapters - fused;
        printf("%s: %s: a full save holds the %zu base tensors, no adapter\n", ok ? "ok" : "FAIL", name,
               am_st_count(f));
        bad += !ok;
        am_st_close(f);
    }
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp);
    if (system(cmd) != 0)
        printf("note: could not remove %s\n", tmp);
    am_errors_free(&err);
    fails += bad;
    return bad ? -1 : 0;
}

static int run_case(const char *name, int r, float alpha, unsigned targets, bool experts)
{
    const char *src = getenv("AM_SRCDIR");
    char dir[1024], base[1100], path[1200], yaml[1300], msg[512];
    snprintf(dir, sizeof(dir), "%s/tests/golden/models/%s", src ? src : ".", name);
    snprintf(base, sizeof(base), "%s/base", dir);
    snprintf(yaml, sizeof(yaml), "model:\n  pretrained_model_name_or_path: %s\n", base);
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *rc = am_recipe_parse("lora.yaml", yaml, strlen(yaml), NULL, 0, &err);
    struct am_st_file *g = NULL;
    snprintf(path, sizeof(path), "%s/golden.safetensors", dir);
    if (!rc || err.n || am_st_open(path, &g, &err) < 0) {
        printf("FAIL: %s: %s\n", name, err.n ? err.msg[0] : "recipe");
        return 1;
    }
    const struct am_st_info *ids = am_st_find(g, "input_ids");
    int64_t B = ids->shape[0], T = ids->shape[1], N = B * T;
    int32_t *tokens = malloc((size_t)N * sizeof(int32_t)), *tgt = malloc((size_t)N * sizeof(int32_t));
    memcpy(tokens, ids->data, (size_t)N * sizeof(int32_t));
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            tgt[b * T + t] = t + 1 < T ? tokens[b * T + t + 1] : -1;
    int n_targets = (int)(B * (T - 1));
    struct am_dev dev;
    struct am_model m;
    if (am_dev_open(&dev, AM_DEV_CPU, 0, msg, sizeof(msg)) < 0) {
        printf("FAIL: %s\n", msg);
        return 1;
    }
    struct am_model_shard sh = am_model_shard_whole(1, 0, (int)rc->model.num_hidden_layers);
    sh.lora_r = r;
    sh.lora_alpha = alpha;
    sh.lora_targets = targets;
    sh.lora_experts = experts;
    if (am_model_init(&m, &rc->model, &sh, &dev, NULL, NULL, B, T, msg, sizeof(msg)) < 0) {
        printf("FAIL: %s: %s\n", name, msg);
        return 1;
    }
    /* the adapters: the last group, alone (with the experts', "lora.experts", the last two) */
    int ng = experts ? 2 : 1;
    const struct am_pgroup *lg = &m.groups[m.n_groups - ng], *end = &m.groups[m.n_groups - 1];
    int misplaced = 0;
    for (int i = 0; i < m.n_params; i++)
        misplaced += am_model_is_lora(&m.params[i]) != (i >= lg->first && i < end->first + end->n);
    if (lg->kind != AM_PG_LORA || end->kind != AM_PG_LORA || misplaced) {
        printf("FAIL: %s: the adapters are not the last group, alone\n", name);
        return 1;
    }
    if (!experts && check_init(&m, name) < 0) /* the experts' A are drawn as AutoModel's [E, in, dim] (test_lora_moe) */
        return 1;
    snprintf(path, sizeof(path), "%s/adapter_init", dir);
    if (am_model_load_hf(&m, base, &err) < 0 || am_model_load_peft(&m, path, &err) < 0) {
        for (size_t i = 0; i < err.n; i++)
            printf("FAIL: %s: %s\n", name, err.msg[i]);
        return 1;
    }
    double loss_sum;
    am_model_begin_step(&m);
    if (am_model_step(&m, tokens, tgt, NULL, B, 1.0f / (float)n_targets, &loss_sum, msg, sizeof(msg)) < 0) {
        printf("FAIL: %s: %s\n", name, msg);
        return 1;
    }
    double loss = loss_sum / n_targets, want = ((const double *)am_st_find(g, "loss")->data)[0];
    int bad = 0;
    printf("%s: loss %.7f, peft %.7f\n", name, loss, want);
    bad += !(fabs(loss - want) < 1e-5);
    int adapters = 0;
    double worst = 0;
    char last[160] = "";
    for (int i = 0; i < m.n_params; i++) {
        const struct am_param *p = &m.params[i];
        const float *mine = p->g.data;
        int64_t n = am_tensor_numel(&p->g);
        if (!am_model_is_lora(p)) {
            if (mine) {
                printf("FAIL: %s: frozen %s has gradient memory\n", name, p->name);
                bad++;
            }
            continue;
        }
        char key[200], name_in[160];
        int64_t shape[2], *at = malloc((size_t)n * sizeof(int64_t));
        /* gpt_oss's experts' adapters: elements of their layer's ParamWrapper tensors */
        int fused = am_model_peft_place(&m, p, name_in, sizeof(name_in), shape, at);
        snprintf(key, sizeof(key), "grad.%s", name_in);
        const struct am_st_info *t = am_st_find(g, key);
        if (!t || t->numel != shape[0] * (shape[1] > 0 ? shape[1] : 1)) {
            printf("FAIL: %s: golden has no %s of %lld x %lld\n", name, key, (long long)shape[0], (long long)shape[1]);
            bad++;
            free(at);
            continue;
        }
        float *w = malloc((size_t)t->numel * sizeof(float));
        am_st_read_f32(g, t, 0, t->numel, w, &err);
        double big = 0, diff = 0;
        for (int64_t k = 0; k < t->numel; k++) /* the largest of the whole tensor, as for the others */
            big = fmax(big, fabs(w[k]));
        for (int64_t k = 0; k < n; k++)
            diff = fmax(diff, fabs((double)mine[k] - w[at[k]]));
        free(at);
        if (!(diff <= 1e-5 * big) || big == 0) {
            printf("FAIL: %s: gradient of %s differs by %g (largest %g)\n", name, p->name, diff, big);
            bad++;
        }
        worst = fmax(worst, big > 0 ? diff / big : 1);
        adapters += !fused || strcmp(name_in, last) != 0; /* gpt_oss: each ParamWrapper tensor once (its
                                                             experts' runs are consecutive) */
        snprintf(last, sizeof(last), "%s", fused ? name_in : "");
        free(w);
    }
    int64_t want_adapters = 0;
    for (size_t i = 0; i < am_st_count(g); i++)
        want_adapters += strncmp(am_st_at(g, i)->name, "grad.", 5) == 0;
    if (adapters != want_adapters) {
        printf("FAIL: %s: %d adapter tensors, peft has %lld\n", name, adapters, (long long)want_adapters);
        bad++;
    }
    printf("%s: %s: %d adapter gradients, worst %.2e of the largest (tolerance 1e-5)\n", bad ? "FAIL" : "ok", name,
           adapters, worst);
    am_model_free(&m);
    am_dev_close(&dev);
    am_st_close(g);
    am_recipe_free(rc);
    am_errors_free(&err);
    free(tokens);
    free(tgt);
    return bad;
}

int main(void)
{
    fails += run_case("llama_lora_qv", 4, 8, 1u << AM_LORA_Q | 1u << AM_LORA_V, false);
    fails += run_case("llama_lora_all", 4, 8, (1u << (AM_LORA_DOWN + 1)) - 1, false);
    fails += run_case("llama_lora_head", 4, 8, 1u << AM_LORA_Q | 1u << AM_LORA_V | 1u << AM_LORA_HEAD, false);
    fails += run_case("gemma2_lora_head", 4, 8, 1u << AM_LORA_Q | 1u << AM_LORA_V | 1u << AM_LORA_HEAD, false);
    fails += run_case("glm4_moe_lora", 4, 8, ((1u << (AM_LORA_DOWN + 1)) - 1) | 1u << AM_LORA_HEAD, false);
    fails += run_case("deepseek_v3_lora", 4, 8,
                      1u << AM_LORA_Q_A | 1u << AM_LORA_Q | 1u << AM_LORA_KV_A | 1u << AM_LORA_KV_B | 1u << AM_LORA_O |
                          1u << AM_LORA_GATE | 1u << AM_LORA_UP | 1u << AM_LORA_DOWN | 1u << AM_LORA_HEAD, false);
    fails += run_case("gpt_oss_lora", 4, 8, 1u << AM_LORA_Q | 1u << AM_LORA_K | 1u << AM_LORA_V | 1u << AM_LORA_O,
                      false);
    fails += run_case("gpt_oss_lora_experts", 4, 8,
                      1u << AM_LORA_Q | 1u << AM_LORA_K | 1u << AM_LORA_V | 1u << AM_LORA_O, true);
    return fails ? 1 : 0;
}
