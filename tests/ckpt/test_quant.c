/* test_quant.c - quantised checkpoint tensors dequantised (runtime/ckpt/quant.h), against
 * what torch and transformers compute (tests/ckpt/fixtures/quant.safetensors, written by
 * make_quant_fixture.py): every e4m3fn byte; an FP8 weight in 2 x 3 blocks (edge blocks
 * partial) read whole, by rows and by columns through am_ckpt_read, into fp32 and bf16; the
 * errors of a missing or misshapen scale; MXFP4 blocks and scales as
 * convert_moe_packed_tensors converts them, whole and an ep rank's experts through
 * am_ckpt_read_mxfp4, with its errors. */
#include <math.h>

#include "../ckpt/testio.h"
#include "checkpoint.h"
#include "quant.h"

static struct am_st_file *fixture_file(void)
{
    struct am_errors err;
    am_errors_init(&err);
    struct am_st_file *f;
    assert_int_equal(am_st_open(srcpath("tests/ckpt/fixtures/quant.safetensors"), &f, &err), 0);
    return f;
}

static const struct am_st_info *get(const struct am_st_file *f, const char *name)
{
    const struct am_st_info *t = am_st_find(f, name);
    assert_non_null(t);
    return t;
}

static uint32_t bits(const void *p, int64_t i)
{
    uint32_t u;
    memcpy(&u, (const char *)p + 4 * i, 4);
    return u;
}

static void test_e4m3_every_byte(void **state)
{
    (void)state;
    struct am_st_file *f = fixture_file();
    const struct am_st_info *b = get(f, "e4m3_bytes"), *v = get(f, "e4m3_f32");
    for (int i = 0; i < 256; i++) {
        float x = am_e4m3_to_f32(b->data[i]);
        if (am_f32_bits(x) != bits(v->data, i))
            fail_msg("e4m3 byte 0x%02x: am %a (0x%08x), torch 0x%08x", i, (double)x, am_f32_bits(x), bits(v->data, i));
    }
    assert_true(isnan(am_e4m3_to_f32(0x7f)) && isnan(am_e4m3_to_f32(0xff)));
    assert_true(am_e4m3_to_f32(0x7e) == 448.0f && am_e4m3_to_f32(0x01) == 0x1p-9f);
    am_st_close(f);
}

/* the fixture as a model directory, opened with blocks of 2 x 3 */
static struct am_ckpt *open_fp8(char *dir, bool fp8)
{
    size_t n;
    unsigned char *ref = slurp(srcpath("tests/ckpt/fixtures/quant.safetensors"), &n);
    spit(pathf("%s/model.safetensors", dir), ref, n);
    free(ref);
    struct am_errors err;
    am_errors_init(&err);
    struct am_ckpt *c;
    assert_int_equal(am_ckpt_open(dir, &c, &err), 0);
    if (fp8)
        am_ckpt_set_fp8(c, (const int64_t[2]){2, 3});
    return c;
}

static void test_fp8_reads(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    struct am_ckpt *c = open_fp8(dir, true);
    struct am_st_file *f = fixture_file();
    const struct am_st_info *ref = get(f, "fp8_ref"), *ref16 = get(f, "fp8_ref_bf16");
    struct am_errors err;
    am_errors_init(&err);
    float all[35], part[35];
    struct am_tensor t = am_tensor_view(all, AM_DEV_CPU, AM_F32, 5, 7, 0, 0);
    assert_int_equal(am_ckpt_read(c, "fp8_w", NULL, &t, &err), 0);
    assert_memory_equal(all, ref->data, sizeof(all)); /* equal in fp32: one rounding of the product, as torch's */
    /* rows [1, 4): across a block boundary, as a tp rank's shard */
    struct am_ckpt_slice s = am_ckpt_rows(1, 4);
    t = am_tensor_view(part, AM_DEV_CPU, AM_F32, 3, 7, 0, 0);
    assert_int_equal(am_ckpt_read(c, "fp8_w", &s, &t, &err), 0);
    assert_memory_equal(part, all + 7, 21 * sizeof(float));
    /* columns [2, 6): inside the partial last block and across two */
    s = am_ckpt_cols(2, 6);
    t = am_tensor_view(part, AM_DEV_CPU, AM_F32, 5, 4, 0, 0);
    assert_int_equal(am_ckpt_read(c, "fp8_w", &s, &t, &err), 0);
    for (int r = 0; r < 5; r++)
        assert_memory_equal(part + 4 * r, all + 7 * r + 2, 4 * sizeof(float));
    /* into bf16: rounded once from the fp32 product, as torch's .to(bfloat16) */
    uint16_t half[35];
    t = am_tensor_view(half, AM_DEV_CPU, AM_BF16, 5, 7, 0, 0);
    assert_int_equal(am_ckpt_read(c, "fp8_w", NULL, &t, &err), 0);
    assert_memory_equal(half, ref16->data, sizeof(half));
    s = am_ckpt_cols(4, 7);
    t = am_tensor_view(half, AM_DEV_CPU, AM_BF16, 5, 3, 0, 0);
    assert_int_equal(am_ckpt_read(c, "fp8_w", &s, &t, &err), 0);
    for (int r = 0; r < 5; r++)
        assert_memory_equal(half + 3 * r, (const uint16_t *)ref16->data + 7 * r + 4, 3 * sizeof(uint16_t));
    expect_no_error(&err);
    am_ckpt_close(c);
    /* without quantization_config the block is unknown */
    c = open_fp8(dir, false);
    t = am_tensor_view(all, AM_DEV_CPU, AM_F32, 5, 7, 0, 0);
    assert_int_equal(am_ckpt_read(c, "fp8_w", NULL, &t, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor 'fp8_w' is F8_E4M3, but config.json has no quantization_config "
                 "with quant_method fp8 (the block of one scale, weight_block_size, is unknown): use the model's own "
                 "config.json", dir);
    am_ckpt_close(c);
    am_st_close(f);
    rm_tree(dir);
}

static void test_fp8_errors(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    struct am_st_file *f = fixture_file();
    const struct am_st_info *w = get(f, "fp8_w"), *sc = get(f, "fp8_w_scale_inv");
    struct am_st_wtensor t[] = {
        {"bad", AM_ST_F8_E4M3, 2, {5, 7}, w->data, NULL, NULL},
        {"bad_scale_inv", AM_ST_F32, 2, {3, 2}, sc->data, NULL, NULL},
        {"half", AM_ST_F8_E4M3, 2, {5, 7}, w->data, NULL, NULL},
        {"half_scale_inv", AM_ST_BF16, 2, {3, 3}, sc->data, NULL, NULL},
        {"lost", AM_ST_F8_E4M3, 2, {5, 7}, w->data, NULL, NULL},
        {"vec", AM_ST_F8_E4M3, 1, {35}, w->data, NULL, NULL},
    };
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_st_write(pathf("%s/model.safetensors", dir), t, 6, NULL, 0, 0, &err), 0);
    struct am_ckpt *c;
    assert_int_equal(am_ckpt_open(dir, &c, &err), 0);
    am_ckpt_set_fp8(c, (const int64_t[2]){2, 3});
    float all[35];
    struct am_tensor d = am_tensor_view(all, AM_DEV_CPU, AM_F32, 5, 7, 0, 0);
    assert_int_equal(am_ckpt_read(c, "lost", NULL, &d, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor 'lost' is F8_E4M3 but 'lost_scale_inv' is missing: an FP8 "
                 "checkpoint holds one fp32 scale per 2 x 3 block beside each weight, here [3, 3] (an incomplete "
                 "download, or a checkpoint quantised another way)", dir);
    assert_int_equal(am_ckpt_read(c, "bad", NULL, &d, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor 'bad_scale_inv' is F32 [3, 2], but the FP8 weight 'bad' of [5, 7] "
                 "in blocks of 2 x 3 (quantization_config.weight_block_size) needs F32 [3, 3], one scale per block "
                 "(does weight_block_size match the checkpoint?)", dir);
    assert_int_equal(am_ckpt_read(c, "half", NULL, &d, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor 'half_scale_inv' is BF16 [3, 3], but the FP8 weight 'half' of "
                 "[5, 7] in blocks of 2 x 3 (quantization_config.weight_block_size) needs F32 [3, 3], one scale per "
                 "block (does weight_block_size match the checkpoint?)", dir);
    d = am_tensor_view(all, AM_DEV_CPU, AM_F32, 35, 0, 0, 0);
    assert_int_equal(am_ckpt_read(c, "vec", NULL, &d, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor 'vec': an F8_E4M3 tensor of shape [35]; am dequantises 2-d "
                 "weights only, with one scale per 2 x 3 block (store it in bf16 or fp32, or list it in "
                 "quantization_config.modules_to_not_convert)", dir);
    am_ckpt_close(c);
    am_st_close(f);
    rm_tree(dir);
}

/* a sharded checkpoint whose scale lies in another file than its weight (as in DeepSeek-V3's 163) */
static void test_fp8_sharded(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    struct am_st_file *f = fixture_file();
    const struct am_st_info *w = get(f, "fp8_w"), *sc = get(f, "fp8_w_scale_inv"), *ref = get(f, "fp8_ref");
    struct am_st_wtensor a = {"fp8_w", AM_ST_F8_E4M3, 2, {5, 7}, w->data, NULL, NULL},
                         b = {"fp8_w_scale_inv", AM_ST_F32, 2, {3, 3}, sc->data, NULL, NULL};
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_st_write(pathf("%s/model-00001-of-00002.safetensors", dir), &a, 1, NULL, 0, 0, &err), 0);
    assert_int_equal(am_st_write(pathf("%s/model-00002-of-00002.safetensors", dir), &b, 1, NULL, 0, 0, &err), 0);
    const char *index = "{\"metadata\": {}, \"weight_map\": {\"fp8_w\": \"model-00001-of-00002.safetensors\", "
                        "\"fp8_w_scale_inv\": \"model-00002-of-00002.safetensors\"}}";
    spit(pathf("%s/model.safetensors.index.json", dir), index, strlen(index));
    struct am_ckpt *c;
    assert_int_equal(am_ckpt_open(dir, &c, &err), 0);
    am_ckpt_set_fp8(c, (const int64_t[2]){2, 3});
    float part[20];
    struct am_ckpt_slice s = am_ckpt_rows(3, 5);
    struct am_tensor t = am_tensor_view(part, AM_DEV_CPU, AM_F32, 2, 7, 0, 0);
    assert_int_equal(am_ckpt_read(c, "fp8_w", &s, &t, &err), 0);
    assert_memory_equal(part, ref->data + 3 * 7 * sizeof(float), 14 * sizeof(float));
    expect_no_error(&err);
    am_ckpt_close(c);
    am_st_close(f);
    rm_tree(dir);
}

static void test_mxfp4(void **state)
{
    (void)state;
    struct am_st_file *f = fixture_file();
    const struct am_st_info *b = get(f, "mx_blocks"), *s = get(f, "mx_scales"), *ref = get(f, "mx_ref"),
                            *ref16 = get(f, "mx_ref_bf16");
    assert_int_equal(ref->numel, 2 * 64 * 3);
    float out[2 * 64 * 3];
    am_mxfp4_dequant(b->data, s->data, 2, 3, 2, out);
    for (int64_t i = 0; i < ref->numel; i++) {
        if (am_f32_bits(out[i]) != bits(ref->data, i))
            fail_msg("mxfp4 value %lld: am 0x%08x, transformers 0x%08x", (long long)i, am_f32_bits(out[i]),
                     bits(ref->data, i));
        uint16_t h;
        memcpy(&h, ref16->data + 2 * i, 2);
        assert_int_equal(am_f32_to_bf16(out[i]), h); /* exact: the bf16 conversion is too */
    }
    /* through a model directory: an ep rank's experts [1, 2), and the errors */
    char *dir = scratch_dir();
    size_t n;
    unsigned char *bytes = slurp(srcpath("tests/ckpt/fixtures/quant.safetensors"), &n);
    spit(pathf("%s/model.safetensors", dir), bytes, n);
    free(bytes);
    struct am_errors err;
    am_errors_init(&err);
    struct am_ckpt *c;
    assert_int_equal(am_ckpt_open(dir, &c, &err), 0);
    struct am_tensor t = am_tensor_view(out, AM_DEV_CPU, AM_F32, 1, 64, 3, 0);
    assert_int_equal(am_ckpt_read_mxfp4(c, "mx", 1, 2, &t, &err), 0);
    assert_memory_equal(out, ref->data + 64 * 3 * 4, 64 * 3 * sizeof(float));
    assert_int_equal(am_ckpt_read_mxfp4(c, "mx", 1, 3, &t, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor 'mx_blocks': cannot take experts [1, 3) of 2", dir);
    t = am_tensor_view(out, AM_DEV_CPU, AM_F32, 1, 3, 64, 0);
    assert_int_equal(am_ckpt_read_mxfp4(c, "mx", 0, 1, &t, &err), -1);
    expect_error(&err, "%s/model.safetensors: tensor 'mx': experts [0, 1) dequantise to [1, 64, 3], but the model "
                 "expects [1, 3, 64] (read into a host fp32 tensor; does config.json match the weights?)", dir);
    assert_int_equal(am_ckpt_read_mxfp4(c, "e4m3", 0, 1, &t, &err), -1);
    expect_error(&err, "%s: 'e4m3_blocks' is missing beside 'e4m3_scales': MXFP4 weights are stored as both, the e2m1 "
                 "blocks and their e8m0 scales (an incomplete download?)", dir);
    am_ckpt_close(c);
    assert_int_equal(am_mxfp4_check("f", "x", s, s, &err), -1);
    expect_error(&err, "f: tensor 'x_blocks' is U8 [2, 3, 2], but MXFP4 blocks are U8 [experts, rows, groups, 16], 32 "
                 "e2m1 values in 16 bytes a group (gpt-oss's layout; a checkpoint quantised another way?)");
    assert_int_equal(am_mxfp4_check("f", "x", b, b, &err), -1);
    expect_error(&err, "f: tensor 'x_scales' is U8 [2, 3, 2, 16], but the blocks 'x_blocks' of [2, 3, 2, 16] need U8 "
                 "[2, 3, 2], one e8m0 exponent per 32 values (the two come from different checkpoints?)");
    rm_tree(dir);
    static const float mag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (int k = 0; k < 16; k++)
        assert_true(am_e2m1_to_f32((uint8_t)k) == (k & 8 ? -mag[k & 7] : mag[k & 7]));
    am_st_close(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_e4m3_every_byte),
        cmocka_unit_test(test_fp8_reads),
        cmocka_unit_test(test_fp8_errors),
        cmocka_unit_test(test_fp8_sharded),
        cmocka_unit_test(test_mxfp4),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
