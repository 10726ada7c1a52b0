/* test_checkpoint.c - Hugging Face model directories: loading single-file and sharded
 * checkpoints, sliced reads for tensor parallelism, config.json, and atomic saves (an
 * injected failure leaves the previous checkpoint intact). */
#include <jansson.h>

#include "../ckpt/testio.h"
#include "checkpoint.h"

static struct am_model_config tiny_llama(void)
{
    return (struct am_model_config){.model_type = "llama", .hidden_size = 8, .num_hidden_layers = 2,
                                    .num_attention_heads = 2, .num_key_value_heads = 1, .head_dim = 4,
                                    .intermediate_size = 16, .vocab_size = 32, .max_position_embeddings = 64,
                                    .rope_theta = 500000.0, .rms_norm_eps = 1e-5, .initializer_range = 0.02};
}

/* Model tensors: "w.N" of shape [rows, cols], value 1000 * N + 10 * row + col. */
struct weights {
    struct am_st_wtensor t[8];
    float *data[8];
    char names[8][32];
    size_t n;
};

static void make_weights(struct weights *w, size_t n, int64_t rows, int64_t cols)
{
    memset(w, 0, sizeof(*w));
    w->n = n;
    for (size_t k = 0; k < n; k++) {
        snprintf(w->names[k], sizeof(w->names[k]), "w.%zu", k);
        w->data[k] = malloc((size_t)(rows * cols) * sizeof(float));
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++)
                w->data[k][r * cols + c] = 1000.0f * (float)k + 10.0f * (float)r + (float)c;
        w->t[k] = (struct am_st_wtensor){w->names[k], AM_ST_F32, 2, {rows, cols}, w->data[k], NULL, NULL};
    }
}

static void free_weights(struct weights *w)
{
    for (size_t k = 0; k < w->n; k++)
        free(w->data[k]);
}

static void check_weights(const char *dir, const struct weights *w, int64_t rows, int64_t cols)
{
    struct am_errors err;
    am_errors_init(&err);
    struct am_ckpt *c;
    assert_int_equal(am_ckpt_open(dir, &c, &err), 0);
    expect_no_error(&err);
    assert_int_equal(am_ckpt_count(c), w->n);
    float *buf = malloc((size_t)(rows * cols) * sizeof(float));
    for (size_t k = 0; k < w->n; k++) {
        struct am_tensor dst = am_tensor_view(buf, AM_DEV_CPU, AM_F32, rows, cols, 0, 0);
        assert_int_equal(am_ckpt_read(c, w->names[k], NULL, &dst, &err), 0);
        assert_memory_equal(buf, w->data[k], (size_t)(rows * cols) * sizeof(float));
    }
    free(buf);
    am_ckpt_close(c);
}

/* ---- reading ----------------------------------------------------------------------------------------- */

static void test_read_reference_and_slices(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    size_t n;
    unsigned char *ref = slurp(srcpath("tests/ckpt/fixtures/reference.safetensors"), &n);
    spit(pathf("%s/model.safetensors", dir), ref, n);
    free(ref);
    struct am_errors err;
    am_errors_init(&err);
    struct am_ckpt *c;
    assert_int_equal(am_ckpt_open(dir, &c, &err), 0);
    assert_int_equal(am_ckpt_count(c), 6);
    assert_string_equal(am_ckpt_name(c, 0), "bf16");
    const char *name = "model.layers.0.mlp.up_proj.weight"; /* [4, 3], value 10 * row + col */
    const struct am_st_file *file;
    const struct am_st_info *info = am_ckpt_find(c, name, &file);
    assert_non_null(info);
    assert_string_equal(am_st_path(file), pathf("%s/model.safetensors", dir));

    float all[12], rows[6], cols[8], one[4];
    struct am_tensor t = am_tensor_view(all, AM_DEV_CPU, AM_F32, 4, 3, 0, 0);
    assert_int_equal(am_ckpt_read(c, name, NULL, &t, &err), 0);
    for (int i = 0; i < 12; i++)
        assert_true(all[i] == 10.0f * (float)(i / 3) + (float)(i % 3));
    /* rows [1, 3): a tensor-parallel shard of a column-parallel weight */
    struct am_ckpt_slice s = am_ckpt_rows(1, 3);
    t = am_tensor_view(rows, AM_DEV_CPU, AM_F32, 2, 3, 0, 0);
    assert_int_equal(am_ckpt_read(c, name, &s, &t, &err), 0);
    const float want_rows[6] = {10, 11, 12, 20, 21, 22};
    assert_memory_equal(rows, want_rows, sizeof(want_rows));
    /* columns [1, 3): a row-parallel weight */
    s = am_ckpt_cols(1, 3);
    t = am_tensor_view(cols, AM_DEV_CPU, AM_F32, 4, 2, 0, 0);
    assert_int_equal(am_ckpt_read(c, name, &s, &t, &err), 0);
    const float want_cols[8] = {1, 2, 11, 12, 21, 22, 31, 32};
    assert_memory_equal(cols, want_cols, sizeof(want_cols));
    /* a 1-d slice of a bf16 tensor into fp32, and an fp32 tensor into bf16 */
    s = am_ckpt_rows(0, 1);
    t = am_tensor_view(one, AM_DEV_CPU, AM_F32, 1, 3, 0, 0);
    assert_int_equal(am_ckpt_read(c, "bf16", &s, &t, &err), 0);
    assert_true(one[0] == 1.0f && one[1] == -3.140625f && one[2] == 0x1p-133f);
    uint16_t half[12];
    t = am_tensor_view(half, AM_DEV_CPU, AM_BF16, 4, 3, 0, 0);
    assert_int_equal(am_ckpt_read(c, name, NULL, &t, &err), 0);
    assert_int_equal(half[4], am_f32_to_bf16(11.0f));
    expect_no_error(&err);

    /* errors name the file, the tensor and both shapes */
    t = am_tensor_view(all, AM_DEV_CPU, AM_F32, 3, 4, 0, 0);
    assert_int_equal(am_ckpt_read(c, name, NULL, &t, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor '%s': the checkpoint holds [4, 3], but the model expects [3, 4] "
                 "(does config.json match the weights?)", dir, name);
    s = am_ckpt_rows(2, 4);
    t = am_tensor_view(all, AM_DEV_CPU, AM_F32, 2, 4, 0, 0);
    assert_int_equal(am_ckpt_read(c, name, &s, &t, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor '%s': the checkpoint holds [4, 3], rows [2, 4) of it are [2, 3], "
                 "but the model expects [2, 4] (does config.json match the weights?)", dir, name);
    s = am_ckpt_cols(2, 5);
    assert_int_equal(am_ckpt_read(c, name, &s, &t, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor '%s': cannot take [2, 5) of dimension 1 of a tensor of shape "
                 "[4, 3]", dir, name);
    assert_int_equal(am_ckpt_read(c, "lm_head.weight", NULL, &t, &err), -1);
    expect_error(&err, "%s: no tensor 'lm_head.weight' in the checkpoint (does config.json match the weights? "
                 "tie_word_embeddings and the model type decide which tensors exist)", dir);
    t = am_tensor_view(all, AM_DEV_CPU, AM_F32, 6, 0, 0, 0);
    assert_int_equal(am_ckpt_read(c, "f16", NULL, &t, &err), 0);
    assert_true(all[3] == 65504.0f);
    t = am_tensor_view(all, AM_DEV_CPU, AM_I32, 6, 0, 0, 0);
    assert_int_equal(am_ckpt_read(c, "f16", NULL, &t, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor 'f16': am reads checkpoints into host fp32, bf16 or fp16 tensors "
                 "(read into a host staging buffer, then copy to the device)", dir);
    am_ckpt_close(c);
    rm_tree(dir);
}

static void test_open_errors(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    struct am_errors err;
    am_errors_init(&err);
    struct am_ckpt *c = NULL;
    assert_int_equal(am_ckpt_open(pathf("%s/none", dir), &c, &err), -1);
    expect_error(&err, "%s/none: No such file or directory (expected a Hugging Face model directory)", dir);
    assert_int_equal(am_ckpt_open(dir, &c, &err), -1);
    expect_error(&err, "%s: neither model.safetensors nor model.safetensors.index.json is there (am reads Hugging "
                 "Face safetensors checkpoints; convert pytorch_model.bin with transformers' "
                 "save_pretrained(safe_serialization=True))", dir);
    /* an index naming a shard that lacks the tensor, and one that escapes the directory */
    size_t n;
    unsigned char *ref = slurp(srcpath("tests/ckpt/fixtures/reference.safetensors"), &n);
    spit(pathf("%s/a.safetensors", dir), ref, n);
    free(ref);
    const char *idx = pathf("%s/model.safetensors.index.json", dir);
    const char *bad1 = "{\"weight_map\": {\"f32\": \"a.safetensors\", \"lm_head.weight\": \"a.safetensors\"}}";
    spit(idx, bad1, strlen(bad1));
    assert_int_equal(am_ckpt_open(dir, &c, &err), -1);
    expect_error(&err, "%s: tensor 'lm_head.weight' is mapped to a.safetensors, which does not hold it (an incomplete "
                 "or mixed-up checkpoint)", idx);
    const char *bad2 = "{\"weight_map\": {\"f32\": \"../a.safetensors\"}}";
    spit(idx, bad2, strlen(bad2));
    assert_int_equal(am_ckpt_open(dir, &c, &err), -1);
    expect_error(&err, "%s: weight_map[\"f32\"]: expected the name of a file in %s (no '/')", idx, dir);
    const char *bad3 = "{\"metadata\": {}}";
    spit(idx, bad3, strlen(bad3));
    assert_int_equal(am_ckpt_open(dir, &c, &err), -1);
    expect_error(&err, "%s: no \"weight_map\" object (it maps each tensor name to its shard file)", idx);
    const char *good = "{\"weight_map\": {\"f32\": \"a.safetensors\", \"i32\": \"a.safetensors\"}}";
    spit(idx, good, strlen(good));
    assert_int_equal(am_ckpt_open(dir, &c, &err), 0);
    assert_int_equal(am_ckpt_count(c), 2); /* only what weight_map names, as transformers */
    assert_null(am_ckpt_find(c, "bf16", NULL));
    am_ckpt_close(c);
    /* a corrupt shard: the safetensors message comes through */
    spit(pathf("%s/a.safetensors", dir), "\x01\x02", 2);
    assert_int_equal(am_ckpt_open(dir, &c, &err), -1);
    expect_error(&err, "%s/a.safetensors: the file is 2 bytes, too short for the 8-byte header length (truncated, or "
                 "not a safetensors file)", dir);
    rm_tree(dir);
}

/* ---- saving ------------------------------------------------------------------------------------------ */

static json_t *load_json(const char *path)
{
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j)
        fail_msg("%s: %s", path, je.text);
    return j;
}

static void test_save_single_and_config(void **state)
{
    (void)state;
    char *parent = scratch_dir();
    const char *dir = pathf("%s/ckpt", parent);
    struct weights w;
    make_weights(&w, 3, 4, 5);
    struct am_model_config m = tiny_llama();
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_ckpt_save(dir, &m, w.t, w.n, NULL, &err), 0);
    expect_no_error(&err);
    check_weights(dir, &w, 4, 5);
    assert_int_equal(count_entries(dir, ""), 2); /* config.json, model.safetensors */
    assert_int_equal(count_entries(parent, ""), 1);
    json_t *cfg = load_json(pathf("%s/config.json", dir));
    assert_string_equal(json_string_value(json_array_get(json_object_get(cfg, "architectures"), 0)),
                        "LlamaForCausalLM");
    assert_string_equal(json_string_value(json_object_get(cfg, "model_type")), "llama");
    assert_string_equal(json_string_value(json_object_get(cfg, "torch_dtype")), "float32");
    assert_string_equal(json_string_value(json_object_get(cfg, "hidden_act")), "silu");
    assert_int_equal(json_integer_value(json_object_get(cfg, "num_key_value_heads")), 1);
    assert_int_equal(json_integer_value(json_object_get(cfg, "head_dim")), 4);
    assert_true(json_real_value(json_object_get(cfg, "rms_norm_eps")) == 1e-5);
    assert_true(json_real_value(json_object_get(cfg, "rope_theta")) == 500000.0);
    assert_true(json_is_false(json_object_get(cfg, "tie_word_embeddings")));
    assert_true(json_is_null(json_object_get(cfg, "rope_scaling")));
    json_decref(cfg);
    struct am_st_file *f;
    assert_int_equal(am_st_open(pathf("%s/model.safetensors", dir), &f, &err), 0);
    assert_string_equal(am_st_meta(f, "format"), "pt"); /* transformers checks it */
    am_st_close(f);

    /* Mixtral with llama3 rope scaling, on top of a base config whose other keys survive */
    const char *base = pathf("%s/base.json", parent);
    const char *base_text = "{\"bos_token_id\": 1, \"eos_token_id\": 2, \"model_type\": \"llama\", \"dtype\": \"bfloat16\"}";
    spit(base, base_text, strlen(base_text));
    m.model_type = "mixtral";
    m.num_experts = 4;
    m.num_experts_per_tok = 2;
    m.router_aux_loss_coef = 0.02;
    m.rope_scaling.type = "llama3";
    m.rope_scaling.factor = 8;
    m.rope_scaling.low_freq_factor = 1;
    m.rope_scaling.high_freq_factor = 4;
    m.rope_scaling.original_max_position_embeddings = 8192;
    char *text = am_ckpt_config_json(&m, base, &err);
    assert_non_null(text);
    assert_int_equal(text[strlen(text) - 1], '\n');
    json_error_t je;
    cfg = json_loads(text, 0, &je);
    free(text);
    assert_string_equal(json_string_value(json_array_get(json_object_get(cfg, "architectures"), 0)),
                        "MixtralForCausalLM");
    assert_string_equal(json_string_value(json_object_get(cfg, "model_type")), "mixtral");
    assert_string_equal(json_string_value(json_object_get(cfg, "dtype")), "float32");
    assert_int_equal(json_integer_value(json_object_get(cfg, "num_local_experts")), 4);
    assert_int_equal(json_integer_value(json_object_get(cfg, "num_experts_per_tok")), 2);
    assert_int_equal(json_integer_value(json_object_get(cfg, "eos_token_id")), 2);
    json_t *rs = json_object_get(cfg, "rope_scaling");
    assert_string_equal(json_string_value(json_object_get(rs, "rope_type")), "llama3");
    assert_int_equal(json_integer_value(json_object_get(rs, "original_max_position_embeddings")), 8192);
    assert_null(json_object_get(cfg, "pretraining_tp"));
    assert_true(json_is_null(json_object_get(cfg, "sliding_window")));
    json_decref(cfg);

    /* the sliding window trained with, as transformers reads it back: Mistral's on every layer;
     * Qwen3's with use_sliding_window and the layers' types */
    m.model_type = "mistral";
    m.num_experts = 0;
    m.rope_scaling.type = NULL;
    m.sliding_window = 7;
    for (long l = 0; l < m.num_hidden_layers; l++)
        m.window_layers[0] |= (uint64_t)1 << l;
    text = am_ckpt_config_json(&m, NULL, &err);
    assert_non_null(text);
    cfg = json_loads(text, 0, &je);
    free(text);
    assert_int_equal(json_integer_value(json_object_get(cfg, "sliding_window")), 7);
    json_decref(cfg);
    m.model_type = "qwen3";
    m.window_layers[0] = (uint64_t)1 << (m.num_hidden_layers - 1); /* the last layer only */
    text = am_ckpt_config_json(&m, NULL, &err);
    assert_non_null(text);
    cfg = json_loads(text, 0, &je);
    free(text);
    assert_int_equal(json_integer_value(json_object_get(cfg, "sliding_window")), 7);
    assert_true(json_is_true(json_object_get(cfg, "use_sliding_window")));
    assert_int_equal(json_integer_value(json_object_get(cfg, "max_window_layers")), m.num_hidden_layers - 1);
    json_t *lt = json_object_get(cfg, "layer_types");
    assert_int_equal(json_array_size(lt), (size_t)m.num_hidden_layers);
    assert_string_equal(json_string_value(json_array_get(lt, 0)), "full_attention");
    assert_string_equal(json_string_value(json_array_get(lt, (size_t)m.num_hidden_layers - 1)), "sliding_attention");
    json_decref(cfg);
    /* qwen2: the same window keys; no attention_bias (Qwen2Config has none: the biases are fixed) */
    m.model_type = "qwen2";
    text = am_ckpt_config_json(&m, NULL, &err);
    assert_non_null(text);
    cfg = json_loads(text, 0, &je);
    free(text);
    assert_string_equal(json_string_value(json_array_get(json_object_get(cfg, "architectures"), 0)),
                        "Qwen2ForCausalLM");
    assert_null(json_object_get(cfg, "attention_bias"));
    assert_true(json_is_true(json_object_get(cfg, "use_sliding_window")));
    assert_int_equal(json_integer_value(json_object_get(cfg, "max_window_layers")), m.num_hidden_layers - 1);
    lt = json_object_get(cfg, "layer_types");
    assert_int_equal(json_array_size(lt), (size_t)m.num_hidden_layers);
    assert_string_equal(json_string_value(json_array_get(lt, (size_t)m.num_hidden_layers - 1)), "sliding_attention");
    json_decref(cfg);
    m.sliding_window = 0;
    m.window_layers[0] = 0;
    m.model_type = "gpt2";
    assert_null(am_ckpt_config_json(&m, NULL, &err));
    expect_error(&err, "config.json: model_type 'gpt2' has no transformers class am knows (llama, mistral, mixtral, "
                 "qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, glm4_moe, deepseek_v3, gpt_oss)");
    free_weights(&w);
    rm_tree(parent);
}

static void test_save_sharded(void **state)
{
    (void)state;
    char *parent = scratch_dir();
    const char *dir = pathf("%s/sharded/", parent); /* a trailing slash is fine */
    struct weights w;
    make_weights(&w, 5, 6, 4); /* 96 bytes each */
    struct am_model_config m = tiny_llama();
    struct am_errors err;
    am_errors_init(&err);
    /* 200 bytes a shard: two tensors each, the last alone */
    struct am_ckpt_save_opts o = {.max_shard_bytes = 200};
    assert_int_equal(am_ckpt_save(dir, &m, w.t, w.n, &o, &err), 0);
    expect_no_error(&err);
    const char *d = pathf("%s/sharded", parent);
    assert_int_equal(count_entries(d, "-of-00003.safetensors"), 3);
    assert_int_equal(count_entries(d, "model.safetensors"), 1); /* the index only */
    json_t *idx = load_json(pathf("%s/model.safetensors.index.json", d));
    assert_int_equal(json_integer_value(json_object_get(json_object_get(idx, "metadata"), "total_size")), 5 * 96);
    json_t *map = json_object_get(idx, "weight_map");
    assert_int_equal(json_object_size(map), 5);
    assert_string_equal(json_string_value(json_object_get(map, "w.0")), "model-00001-of-00003.safetensors");
    assert_string_equal(json_string_value(json_object_get(map, "w.1")), "model-00001-of-00003.safetensors");
    assert_string_equal(json_string_value(json_object_get(map, "w.2")), "model-00002-of-00003.safetensors");
    assert_string_equal(json_string_value(json_object_get(map, "w.4")), "model-00003-of-00003.safetensors");
    json_decref(idx);
    check_weights(d, &w, 6, 4);
    /* sliced reads come from the right shard */
    struct am_ckpt *c;
    assert_int_equal(am_ckpt_open(d, &c, &err), 0);
    float part[4];
    struct am_ckpt_slice s = am_ckpt_rows(5, 6);
    struct am_tensor t = am_tensor_view(part, AM_DEV_CPU, AM_F32, 1, 4, 0, 0);
    assert_int_equal(am_ckpt_read(c, "w.3", &s, &t, &err), 0);
    assert_true(part[0] == 3050.0f && part[3] == 3053.0f);
    am_ckpt_close(c);
    /* a tensor larger than the limit gets a shard of its own */
    o.max_shard_bytes = 50;
    assert_int_equal(am_ckpt_save(d, &m, w.t, 2, &o, &err), 0);
    assert_int_equal(count_entries(d, "-of-00002.safetensors"), 2);
    assert_int_equal(count_entries(d, "-of-00003"), 0); /* the previous checkpoint is gone */
    /* no tensors at all: a valid, empty model.safetensors */
    assert_int_equal(am_ckpt_save(pathf("%s/none", parent), &m, NULL, 0, NULL, &err), 0);
    assert_int_equal(am_ckpt_open(pathf("%s/none", parent), &c, &err), 0);
    assert_int_equal(am_ckpt_count(c), 0);
    am_ckpt_close(c);
    free_weights(&w);
    rm_tree(parent);
}

struct failing {
    const float *data;
    size_t fail_at;
};

static int fill_from(void *ctx, size_t index, uint64_t offset, void *dst, size_t n, struct am_errors *err)
{
    struct failing *f = ctx;
    if (index == f->fail_at) {
        am_errorf(err, NULL, "injected failure writing tensor %zu", index);
        return -1;
    }
    memcpy(dst, (const char *)f->data + offset, n);
    return 0;
}

static void test_save_is_atomic(void **state)
{
    (void)state;
    char *parent = scratch_dir();
    const char *dir = pathf("%s/ckpt", parent);
    struct weights a, b;
    make_weights(&a, 3, 4, 5);
    make_weights(&b, 3, 4, 5);
    for (size_t k = 0; k < 3; k++)
        for (int i = 0; i < 20; i++)
            b.data[k][i] = -b.data[k][i] - 1;
    struct am_model_config m = tiny_llama();
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_ckpt_save(dir, &m, a.t, a.n, NULL, &err), 0);
    /* a tokenizer file beside the weights is carried over to later checkpoints */
    spit(pathf("%s/tokenizer.json", dir), "{}", 2);

    /* the second save fails while writing its last tensor: the first checkpoint stays whole */
    struct failing ctx[3];
    for (size_t k = 0; k < 3; k++) {
        ctx[k] = (struct failing){b.data[k], 2};
        b.t[k].data = NULL;
        b.t[k].fill = fill_from;
        b.t[k].ctx = &ctx[k];
    }
    for (int shards = 0; shards < 2; shards++) {
        struct am_ckpt_save_opts o = {.max_shard_bytes = shards ? 100 : 0};
        assert_int_equal(am_ckpt_save(dir, &m, b.t, b.n, &o, &err), -1);
        expect_error(&err, "injected failure writing tensor 2");
        check_weights(dir, &a, 4, 5);
        assert_int_equal(count_entries(parent, ""), 1); /* no ckpt.tmp-XXXXXX left behind */
        assert_int_equal(count_entries(dir, ""), 3);
    }

    /* the same save without the failure replaces it, keeping tokenizer.json */
    for (size_t k = 0; k < 3; k++)
        ctx[k].fail_at = 99;
    assert_int_equal(am_ckpt_save(dir, &m, b.t, b.n, NULL, &err), 0);
    expect_no_error(&err);
    check_weights(dir, &b, 4, 5);
    assert_int_equal(count_entries(dir, "tokenizer.json"), 1);
    assert_int_equal(count_entries(parent, ""), 1);

    /* am never replaces what is not a checkpoint */
    const char *other = pathf("%s/notes", parent);
    mkdir(other, 0755);
    spit(pathf("%s/notes/todo.txt", parent), "x", 1);
    assert_int_equal(am_ckpt_save(other, &m, a.t, a.n, NULL, &err), -1);
    expect_error(&err, "%s: exists and is not a checkpoint (no config.json in it); am replaces only a previous "
                 "checkpoint or an empty directory: choose another checkpoint.checkpoint_dir", other);
    assert_int_equal(count_entries(other, ""), 1);
    const char *file = pathf("%s/notes/todo.txt", parent);
    assert_int_equal(am_ckpt_save(file, &m, a.t, a.n, NULL, &err), -1);
    expect_error(&err, "%s: exists and is not a checkpoint (not a directory); am replaces only a previous checkpoint "
                 "or an empty directory: choose another checkpoint.checkpoint_dir", file);
    /* an empty directory is fine */
    const char *empty = pathf("%s/empty", parent);
    mkdir(empty, 0755);
    assert_int_equal(am_ckpt_save(empty, &m, a.t, a.n, NULL, &err), 0);
    check_weights(empty, &a, 4, 5);
    /* a parent that does not exist */
    const char *nowhere = pathf("%s/no/such/ckpt", parent);
    assert_int_equal(am_ckpt_save(nowhere, &m, a.t, a.n, NULL, &err), -1);
    expect_error(&err, "%s: cannot create the temporary directory %s.tmp-XXXXXX: No such file or directory (is the "
                 "parent directory writable?)", nowhere, nowhere);
    free_weights(&a);
    free_weights(&b);
    rm_tree(parent);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read_reference_and_slices),
        cmocka_unit_test(test_open_errors),
        cmocka_unit_test(test_save_single_and_config),
        cmocka_unit_test(test_save_sharded),
        cmocka_unit_test(test_save_is_atomic),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
