/* peft_save.c - am's LoRA adapter files (runtime/ckpt/peft.h) from the golden's adapters.
 *
 *   peft_save SRC_ADAPTER_DIR OUT_DIR
 *
 * Reads SRC_ADAPTER_DIR/adapter_model.safetensors and adapter_config.json (what the peft
 * library wrote: tests/golden/models/llama_lora_qv/adapter_init and llama_lora_all's), writes OUT_DIR with
 * am_peft_save (the tensors under names built by am_peft_tensor_name from each tensor's module
 * path, r, lora_alpha and target_modules from the source config), then checks what it wrote:
 * the same tensor names, shapes and bits, and the config's r, lora_alpha, target_modules and
 * peft_type. tests/ckpt/test-peft-save.sh runs it and, where the peft library is installed,
 * loads OUT_DIR with peft. Exit status 0 when every check passes.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peft.h"
#include "safetensors.h"

static int fails;

static void check(int ok, const char *what)
{
    printf("%s: %s\n", ok ? "ok" : "FAIL", what);
    fails += !ok;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: peft_save SRC_ADAPTER_DIR OUT_DIR\n");
        return 2;
    }
    struct am_errors err;
    am_errors_init(&err);
    char path[4096];
    snprintf(path, sizeof(path), "%s/adapter_config.json", argv[1]);
    json_error_t je;
    json_t *src_cfg = json_load_file(path, 0, &je);
    struct am_st_file *src = NULL;
    snprintf(path, sizeof(path), "%s/adapter_model.safetensors", argv[1]);
    if (!src_cfg || am_st_open(path, &src, &err) < 0) {
        fprintf(stderr, "peft_save: %s\n", src_cfg ? err.msg[0] : je.text);
        return 1;
    }
    json_t *tj = json_object_get(src_cfg, "target_modules");
    size_t nt = json_array_size(tj);
    const char *targets[16];
    for (size_t i = 0; i < nt && i < 16; i++)
        targets[i] = json_string_value(json_array_get(tj, i));
    struct am_peft_config cfg = {.r = (long)json_integer_value(json_object_get(src_cfg, "r")),
                                 .alpha = json_number_value(json_object_get(src_cfg, "lora_alpha")),
                                 .targets = targets, .n_targets = nt < 16 ? nt : 16};
    size_t n = am_st_count(src);
    struct am_st_wtensor *w = calloc(n, sizeof(*w));
    char (*names)[256] = calloc(n, sizeof(*names));
    for (size_t i = 0; i < n; i++) {
        const struct am_st_info *t = am_st_at(src, i);
        /* the module path: between "base_model.model." and ".lora_X.weight" */
        char module[256];
        const char *start = t->name + strlen("base_model.model."), *end = strstr(t->name, ".lora_");
        snprintf(module, sizeof(module), "%.*s", (int)(end - start), start);
        am_peft_tensor_name(names[i], sizeof(names[i]), module, end[6] == 'B');
        w[i] = (struct am_st_wtensor){.name = names[i], .dtype = t->dtype, .ndim = t->ndim, .data = t->data};
        memcpy(w[i].shape, t->shape, sizeof(t->shape));
    }
    if (am_peft_save(argv[2], &cfg, w, n, &err) < 0) {
        fprintf(stderr, "peft_save: %s\n", err.msg[0]);
        return 1;
    }
    struct am_st_file *out = NULL;
    snprintf(path, sizeof(path), "%s/adapter_model.safetensors", argv[2]);
    if (am_st_open(path, &out, &err) < 0) {
        fprintf(stderr, "peft_save: %s\n", err.msg[0]);
        return 1;
    }
    check(am_st_count(out) == n, "as many tensors as the source");
    int same = 1;
    for (size_t i = 0; i < n; i++) {
        const struct am_st_info *a = am_st_at(src, i), *b = am_st_find(out, a->name);
        same &= b && b->dtype == a->dtype && b->ndim == a->ndim && !memcmp(b->shape, a->shape, sizeof(a->shape)) &&
                b->end - b->begin == a->end - a->begin && !memcmp(a->data, b->data, a->end - a->begin);
    }
    check(same, "every tensor under peft's name, shape and bits");
    snprintf(path, sizeof(path), "%s/adapter_config.json", argv[2]);
    json_t *oc = json_load_file(path, 0, &je);
    check(oc != NULL, "adapter_config.json is JSON");
    check(oc && json_equal(json_object_get(oc, "r"), json_object_get(src_cfg, "r")), "r");
    check(oc && json_equal(json_object_get(oc, "lora_alpha"), json_object_get(src_cfg, "lora_alpha")), "lora_alpha");
    check(oc && json_equal(json_object_get(oc, "target_modules"), tj), "target_modules");
    check(oc && !strcmp(json_string_value(json_object_get(oc, "peft_type")), "LORA"), "peft_type LORA");
    json_decref(oc);
    json_decref(src_cfg);
    am_st_close(out);
    am_st_close(src);
    free(w);
    free(names);
    am_errors_free(&err);
    return fails ? 1 : 0;
}
