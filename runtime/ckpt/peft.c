/* peft.c - LoRA adapters in the peft library's files (peft.h). */
#include "peft.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

int am_peft_tensor_name(char *buf, size_t len, const char *module, int b)
{
    int n = snprintf(buf, len, "base_model.model.%s.%s.weight", module, b ? "lora_B" : "lora_A");
    return n < 0 || (size_t)n >= len ? -1 : 0;
}

static json_t *config_json(const struct am_peft_config *cfg)
{
    json_t *targets = json_array();
    for (size_t i = 0; i < cfg->n_targets; i++)
        json_array_append_new(targets, json_string(cfg->targets[i]));
    json_t *o = json_object();
    json_object_set_new(o, "peft_type", json_string("LORA"));
    json_object_set_new(o, "task_type", json_string("CAUSAL_LM"));
    json_object_set_new(o, "base_model_name_or_path", cfg->base_model ? json_string(cfg->base_model) : json_null());
    json_object_set_new(o, "r", json_integer(cfg->r));
    /* peft reads lora_alpha as a number; an integral alpha is written as an integer, as
     * AutoModel's and peft's configs have it */
    json_object_set_new(o, "lora_alpha", cfg->alpha == (double)(long long)cfg->alpha
                                             ? json_integer((json_int_t)cfg->alpha) : json_real(cfg->alpha));
    json_object_set_new(o, "target_modules", cfg->n_targets ? targets : json_null());
    if (!cfg->n_targets)
        json_decref(targets);
    if (cfg->n_params) {
        json_t *params = json_array();
        for (size_t i = 0; i < cfg->n_params; i++)
            json_array_append_new(params, json_string(cfg->params[i]));
        json_object_set_new(o, "target_parameters", params);
    }
    if (cfg->rank_key) {
        json_t *ranks = json_object();
        json_object_set_new(ranks, cfg->rank_key, json_integer(cfg->rank_r));
        json_object_set_new(o, "rank_pattern", ranks);
    }
    json_object_set_new(o, "lora_dropout", json_real(cfg->dropout));
    json_object_set_new(o, "bias", json_string("none"));
    json_object_set_new(o, "fan_in_fan_out", json_false());
    json_object_set_new(o, "use_dora", json_false());
    json_object_set_new(o, "use_rslora", json_false());
    json_object_set_new(o, "init_lora_weights", json_true());
    json_object_set_new(o, "modules_to_save", json_null());
    json_object_set_new(o, "inference_mode", json_true());
    return o;
}

int am_peft_save(const char *dir, const struct am_peft_config *cfg, const struct am_st_wtensor *t, size_t n,
                 struct am_errors *err)
{
    char path[4096], tmp[4200];
    if (mkdir(dir, 0777) < 0 && errno != EEXIST) {
        am_errorf(err, NULL, "%s: cannot create the adapter directory: %s", dir, strerror(errno));
        return -1;
    }
    if (am_path_cat(path, sizeof(path), dir, "/", "adapter_model.safetensors") < 0 ||
        am_st_write(path, t, n, NULL, 0, 0, err) < 0) {
        if (errno == ENAMETOOLONG)
            am_errorf(err, NULL, "%s: path too long", dir);
        return -1;
    }
    if (am_path_cat(path, sizeof(path), dir, "/", "adapter_config.json") < 0) {
        am_errorf(err, NULL, "%s: path too long", dir);
        return -1;
    }
    json_t *o = config_json(cfg);
    int fd = am_open_temp(path, tmp, sizeof(tmp));
    if (!o || fd < 0) {
        am_errorf(err, NULL, "%s: cannot write: %s", path, o ? strerror(errno) : "out of memory");
        json_decref(o);
        if (fd >= 0)
            close(fd);
        return -1;
    }
    int rc = json_dumpfd(o, fd, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (rc == 0 && write(fd, "\n", 1) != 1)
        rc = -1;
    if (rc == 0 && fsync(fd) < 0)
        rc = -1;
    if (close(fd) < 0)
        rc = -1;
    if (rc == 0 && rename(tmp, path) < 0)
        rc = -1;
    if (rc < 0) {
        am_errorf(err, NULL, "%s: cannot write: %s", path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    am_fsync_dir_of(path, false);
    return 0;
}
