/* lora_tp_check - a rank program (start it with am-launch --nproc TP): the model with LoRA
 * adapters split over TP tensor-parallel ranks (lora.h) against the peft library's golden
 * (tests/golden/models/CASE, as tests/model/test_lora_golden.c checks it on one rank).
 *
 *   am-launch --nproc 2 RECIPE -- tests/model/lora_tp_check CASE TARGETS [sp]
 *
 * TARGETS: "qv" or "all"; sp: with sequence parallelism. Every rank loads the base model and peft's adapters (its tp slice),
 * runs one forward and backward of the golden batch over the tp group, completes the gradients
 * (am_model_finish_grads: the partial ones summed over tp), and checks the loss (1e-5) and its
 * slice of every adapter's gradient (1e-5 of the whole tensor's largest). LORA_TP_PERTURB=1
 * skips the completion: the partial gradients then differ and the check must fail.
 * Prints "lora_tp_check: rank R: N checks passed" or exits 1.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "kernels.h"
#include "model.h"
#include "model_io.h"
#include "recipe.h"
#include "safetensors.h"

static long checks, failures;
static int my_rank;

static void check(bool ok, const char *what, double got, double lim)
{
    checks++;
    if (!ok) {
        failures++;
        fprintf(stderr, "lora_tp_check: rank %d: %s: %g (limit %g)\n", my_rank, what, got, lim);
    }
}

int main(int argc, char **argv)
{
    char err[1024];
    if (argc != 3 && !(argc == 4 && strcmp(argv[3], "sp") == 0)) {
        fprintf(stderr, "usage: lora_tp_check CASE qv|all|head [sp]\n");
        return 2;
    }
    struct am_boot_info info;
    struct am_boot *boot = am_boot_init(&info, err, sizeof(err));
    if (!boot) {
        fprintf(stderr, "lora_tp_check: %s\n", err);
        return 3;
    }
    my_rank = info.rank;
    int tp = info.size;
    const char *to = getenv("AM_COMM_TIMEOUT");
    struct am_comm_ctx *ctx = am_comm_ctx_init(AM_COMM_UCX, boot, &info, -1, to ? atof(to) : 30, err, sizeof(err));
    struct am_comm *tpc = NULL;
    int *members = malloc((size_t)tp * sizeof(int));
    for (int q = 0; q < tp; q++)
        members[q] = q;
    const char *names[1] = {"tp"};
    const int *const mem[1] = {members};
    if (!ctx || am_comm_create_groups(ctx, 1, mem, &tp, names, &tpc, err, sizeof(err)) < 0) {
        fprintf(stderr, "lora_tp_check: rank %d: %s\n", my_rank, err);
        return 3;
    }
    const char *src = getenv("AM_SRCDIR");
    char dir[1024], base[1100], path[1200], yaml[1300];
    snprintf(dir, sizeof(dir), "%s/tests/golden/models/%s", src ? src : ".", argv[1]);
    snprintf(base, sizeof(base), "%s/base", dir);
    snprintf(yaml, sizeof(yaml), "model:\n  pretrained_model_name_or_path: %s\n", base);
    struct am_errors e;
    am_errors_init(&e);
    struct am_recipe *rc = am_recipe_parse("lora.yaml", yaml, strlen(yaml), NULL, 0, &e);
    struct am_st_file *g = NULL;
    snprintf(path, sizeof(path), "%s/golden.safetensors", dir);
    struct am_dev dev;
    if (!rc || e.n || am_st_open(path, &g, &e) < 0 || am_dev_open(&dev, AM_DEV_CPU, -1, err, sizeof(err)) < 0) {
        fprintf(stderr, "lora_tp_check: rank %d: %s\n", my_rank, e.n ? e.msg[0] : err);
        return 3;
    }
    const struct am_st_info *ids = am_st_find(g, "input_ids");
    int64_t B = ids->shape[0], T = ids->shape[1], N = B * T;
    int32_t *tokens = malloc((size_t)N * sizeof(int32_t)), *tgt = malloc((size_t)N * sizeof(int32_t));
    memcpy(tokens, ids->data, (size_t)N * sizeof(int32_t));
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            tgt[b * T + t] = t + 1 < T ? tokens[b * T + t + 1] : -1;
    int n_targets = (int)(B * (T - 1));
    struct am_model_shard sh = am_model_shard_whole(tp, my_rank, (int)rc->model.num_hidden_layers);
    sh.lora_r = 4;
    sh.sequence_parallel = argc == 4;
    sh.lora_alpha = 8;
    sh.lora_targets = strcmp(argv[2], "qv") == 0 ? (1u << AM_LORA_Q | 1u << AM_LORA_V)
                      : strcmp(argv[2], "head") == 0 ? (1u << AM_LORA_Q | 1u << AM_LORA_V | 1u << AM_LORA_HEAD)
                                                     : (1u << (AM_LORA_DOWN + 1)) - 1;
    struct am_model m;
    if (am_model_init(&m, &rc->model, &sh, &dev, tpc, NULL, B, T, err, sizeof(err)) < 0) {
        fprintf(stderr, "lora_tp_check: rank %d: %s\n", my_rank, err);
        return 3;
    }
    snprintf(path, sizeof(path), "%s/adapter_init", dir);
    if (am_model_load_hf(&m, base, &e) < 0 || am_model_load_peft(&m, path, &e) < 0) {
        fprintf(stderr, "lora_tp_check: rank %d: %s\n", my_rank, e.msg[0]);
        return 3;
    }
    double loss_sum;
    am_model_begin_step(&m);
    if (am_model_step(&m, tokens, tgt, NULL, B, 1.0f / (float)n_targets, &loss_sum, err, sizeof(err)) < 0 ||
        (!(getenv("LORA_TP_PERTURB") && getenv("LORA_TP_PERTURB")[0] == '1') &&
         am_model_finish_grads(&m, err, sizeof(err)) < 0)) {
        fprintf(stderr, "lora_tp_check: rank %d: %s\n", my_rank, err);
        return 3;
    }
    double want = ((const double *)am_st_find(g, "loss")->data)[0];
    check(fabs(loss_sum / n_targets - want) < 1e-5, "loss differs from peft's by", fabs(loss_sum / n_targets - want),
          1e-5);
    for (int i = 0; i < m.n_params; i++) {
        const struct am_param *p = &m.params[i];
        if (!am_model_is_lora(p))
            continue;
        char key[200];
        snprintf(key, sizeof(key), "grad.base_model.model.%s", p->name);
        const struct am_st_info *t = am_st_find(g, key);
        int64_t rows = p->full_rows, cols = p->full_cols;
        if (!t || t->numel != rows * cols) {
            check(false, key, 0, 0);
            continue;
        }
        float *w = malloc((size_t)(rows * cols) * sizeof(float));
        am_st_read_f32(g, t, 0, rows * cols, w, &e);
        double big = 0, diff = 0;
        for (int64_t k = 0; k < rows * cols; k++)
            big = fmax(big, fabs(w[k]));
        const float *mine = p->g.data;
        int64_t lr = p->w.shape[0], lc = p->w.shape[1];
        for (int64_t y = 0; y < lr; y++)
            for (int64_t c = 0; c < lc; c++)
                diff = fmax(diff, fabs((double)mine[y * lc + c] - w[(p->row0 + y) * cols + p->col0 + c]));
        char what[240];
        snprintf(what, sizeof(what), "gradient of %s differs by (relative)", p->name);
        check(diff <= 1e-5 * big && big > 0, what, big > 0 ? diff / big : 1, 1e-5);
        free(w);
    }
    am_model_free(&m);
    am_dev_close(&dev);
    am_st_close(g);
    am_recipe_free(rc);
    am_comm_destroy(tpc);
    am_comm_ctx_fini(ctx);
    am_boot_fini(boot);
    if (failures) {
        fprintf(stderr, "lora_tp_check: rank %d: %ld of %ld checks FAILED\n", my_rank, failures, checks);
        return 1;
    }
    printf("lora_tp_check: rank %d: %ld checks passed\n", my_rank, checks);
    return 0;
}
