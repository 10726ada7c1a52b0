/* test_safetensors.c - the safetensors reader and writer: conversions, the reference file
 * written by Hugging Face's own library (tests/ckpt/fixtures/reference.safetensors, made by
 * make_fixture.py), byte-identical output, round trips for every dtype, every corruption
 * rejected with its message, and atomic writes. */
#include <math.h>

#include "../ckpt/testio.h"
#include "safetensors.h"

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- conversions ------------------------------------------------------------------------------ */

static void test_f16_exhaustive(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = am_f16_to_f32((uint16_t)h);
        bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        if (nan) {
            assert_true(isnan(f));
            assert_true((am_f32_to_f16(f) & 0x7c00) == 0x7c00 && (am_f32_to_f16(f) & 0x3ff));
            continue;
        }
        if (am_f32_to_f16(f) != h)
            fail_msg("f16 0x%04x -> %a -> 0x%04x", h, (double)f, am_f32_to_f16(f));
    }
    /* values checked by hand */
    assert_int_equal(bits(am_f16_to_f32(0x0001)), 0x33800000); /* 2^-24 */
    assert_int_equal(bits(am_f16_to_f32(0x03ff)), 0x387fc000); /* 1023 * 2^-24 */
    assert_int_equal(bits(am_f16_to_f32(0x0400)), 0x38800000); /* 2^-14 */
    assert_int_equal(bits(am_f16_to_f32(0x7bff)), 0x477fe000); /* 65504 */
    assert_int_equal(bits(am_f16_to_f32(0xfc00)), 0xff800000);
    assert_int_equal(bits(am_f16_to_f32(0x8000)), 0x80000000);
    /* rounding: to nearest, ties to even; overflow to infinity; below half the smallest
     * subnormal to zero */
    assert_int_equal(am_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(am_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(am_f32_to_f16(1e10f), 0x7c00);
    assert_int_equal(am_f32_to_f16(-1e10f), 0xfc00);
    assert_int_equal(am_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);         /* tie, even stays */
    assert_int_equal(am_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);     /* tie, rounds up to even */
    assert_int_equal(am_f32_to_f16(0x1p-25f), 0x0000);                /* tie with 0: even */
    assert_int_equal(am_f32_to_f16(0x1.8p-25f), 0x0001);
    assert_int_equal(am_f32_to_f16(3 * 0x1p-25f), 0x0002);            /* 1.5 ulp: tie to even */
    assert_int_equal(am_f32_to_f16(0x1p-14f - 0x1p-26f), 0x0400);     /* rounds up into the normals */
    assert_int_equal(am_f32_to_f16(-0.0f), 0x8000);
    assert_int_equal(am_f32_to_f16(from_bits(0x00000001)), 0x0000);
}

static void test_bf16_exhaustive(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = am_bf16_to_f32((uint16_t)h);
        assert_int_equal(bits(f), h << 16);
        if (isnan(f))
            assert_true(isnan(am_bf16_to_f32(am_f32_to_bf16(f))));
        else
            assert_int_equal(am_f32_to_bf16(f), h);
    }
    assert_int_equal(am_f32_to_bf16(from_bits(0x3f808000)), 0x3f80); /* tie, even stays */
    assert_int_equal(am_f32_to_bf16(from_bits(0x3f818000)), 0x3f82); /* tie, up to even */
    assert_int_equal(am_f32_to_bf16(from_bits(0x3f808001)), 0x3f81);
    assert_int_equal(am_f32_to_bf16(from_bits(0x7f7fffff)), 0x7f80); /* overflow */
    assert_int_equal(am_f32_to_bf16(from_bits(0x00008000)), 0x0000); /* subnormal tie */
    assert_int_equal(am_f32_to_bf16(from_bits(0x00018000)), 0x0002);
    assert_true(isnan(am_bf16_to_f32(am_f32_to_bf16(from_bits(0x7f800001))))); /* NaN stays NaN */
}

/* ---- the reference file -------------------------------------------------------------------------- */

static void check_f32(const struct am_st_file *f, const char *name, const uint32_t *want, int n)
{
    const struct am_st_info *t = am_st_find(f, name);
    assert_non_null(t);
    assert_int_equal(t->numel, n);
    float got[16];
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_st_read_f32(f, t, 0, n, got, &err), 0);
    for (int i = 0; i < n; i++)
        if (bits(got[i]) != want[i])
            fail_msg("%s[%d]: got 0x%08x, want 0x%08x", name, i, bits(got[i]), want[i]);
}

static void test_reference_file(void **state)
{
    (void)state;
    struct am_errors err;
    am_errors_init(&err);
    struct am_st_file *f;
    assert_int_equal(am_st_open(srcpath("tests/ckpt/fixtures/reference.safetensors"), &f, &err), 0);
    assert_string_equal(am_st_meta(f, "format"), "pt");
    assert_null(am_st_meta(f, "nope"));
    assert_int_equal(am_st_count(f), 6);
    assert_null(am_st_find(f, "missing"));
    const struct am_st_info *t = am_st_find(f, "bf16");
    assert_int_equal(t->dtype, AM_ST_BF16);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 3);
    /* the reference sorts by dtype (widest first) then name: offsets follow that order */
    assert_string_equal(am_st_at(f, 0)->name, "i64");
    assert_string_equal(am_st_at(f, 5)->name, "f16");
    check_f32(f, "f32", (const uint32_t[]){0x00000000, 0x3f800000, 0xc0200000, 0x7f7fffff, 0x00000001, 0x80000000}, 6);
    check_f32(f, "bf16", (const uint32_t[]){0x3f800000, 0xc0490000, 0x00010000, 0x7f800000, 0xff800000, 0x7fc00000}, 6);
    check_f32(f, "f16", (const uint32_t[]){0x3f800000, 0x33800000, 0x387fc000, 0x477fe000, 0xff800000, 0x7fc00000}, 6);
    check_f32(f, "i32", (const uint32_t[]){bits(-2147483648.0f), 0, bits(2147483648.0f)}, 3);
    check_f32(f, "i64", (const uint32_t[]){bits(-5.0f), bits(0x1p40f)}, 2);
    /* a part of a tensor */
    float part[3];
    t = am_st_find(f, "model.layers.0.mlp.up_proj.weight");
    assert_int_equal(am_st_read_f32(f, t, 6, 3, part, &err), 0);
    assert_true(part[0] == 20.0f && part[1] == 21.0f && part[2] == 22.0f);
    assert_int_equal(am_st_read_f32(f, t, 10, 3, part, &err), -1);
    expect_error(&err, "%s: tensor 'model.layers.0.mlp.up_proj.weight': elements [10, 13) are outside its 12 elements",
                 am_st_path(f));
    am_st_close(f);
}

/* The tensors of reference.safetensors, as am would write them. */
static const uint32_t ref_f32[] = {0x00000000, 0x3f800000, 0xc0200000, 0x7f7fffff, 0x00000001, 0x80000000};
static const uint16_t ref_bf16[] = {0x3f80, 0xc049, 0x0001, 0x7f80, 0xff80, 0x7fc0};
static const uint16_t ref_f16[] = {0x3c00, 0x0001, 0x03ff, 0x7bff, 0xfc00, 0x7e00};
static const int32_t ref_i32[] = {INT32_MIN, 0, INT32_MAX};
static const int64_t ref_i64[] = {-5, (int64_t)1 << 40};

static void test_writer_matches_reference(void **state)
{
    (void)state;
    float w[12];
    for (int i = 0; i < 12; i++)
        w[i] = 10.0f * (float)(i / 3) + (float)(i % 3);
    /* given in another order: the writer sorts as the reference does */
    struct am_st_wtensor t[] = {
        {"f16", AM_ST_F16, 1, {6}, ref_f16, NULL, NULL},
        {"model.layers.0.mlp.up_proj.weight", AM_ST_F32, 2, {4, 3}, w, NULL, NULL},
        {"i32", AM_ST_I32, 1, {3}, ref_i32, NULL, NULL},
        {"f32", AM_ST_F32, 2, {2, 3}, ref_f32, NULL, NULL},
        {"bf16", AM_ST_BF16, 2, {2, 3}, ref_bf16, NULL, NULL},
        {"i64", AM_ST_I64, 1, {2}, ref_i64, NULL, NULL},
    };
    char *dir = scratch_dir();
    struct am_errors err;
    am_errors_init(&err);
    const char *path = pathf("%s/mine.safetensors", dir);
    assert_int_equal(am_st_write(path, t, 6, NULL, 0, 0, &err), 0);
    size_t n1, n2;
    unsigned char *mine = slurp(path, &n1), *ref = slurp(srcpath("tests/ckpt/fixtures/reference.safetensors"), &n2);
    assert_int_equal(n1, n2);
    assert_memory_equal(mine, ref, n1);
    assert_int_equal(count_entries(dir, ".tmp-"), 0);
    free(mine);
    free(ref);
    rm_tree(dir);
}

/* ---- round trips ----------------------------------------------------------------------------------- */

static void test_roundtrip_every_dtype(void **state)
{
    (void)state;
    enum { N = 37 };
    float f32[N];
    uint16_t bf16[N], f16[N];
    int32_t i32[N];
    int64_t i64[N];
    uint8_t u8[N];
    for (int i = 0; i < N; i++) {
        f32[i] = (float)(i - 18) * 0.37f + (i % 5 ? 0.0f : 1e-40f);
        bf16[i] = am_f32_to_bf16(f32[i] * 3.0f);
        f16[i] = am_f32_to_f16(f32[i] / 7.0f);
        i32[i] = (i - 18) * 100000007;
        i64[i] = (int64_t)(i - 18) * 1000000000007LL;
        u8[i] = (uint8_t)(i * 7);
    }
    float scalar = 42.5f;
    struct am_st_wtensor t[] = {
        {"a.f32", AM_ST_F32, 1, {N}, f32, NULL, NULL},
        {"b.bf16", AM_ST_BF16, 1, {N}, bf16, NULL, NULL},
        {"c.f16", AM_ST_F16, 1, {N}, f16, NULL, NULL},
        {"d.i32", AM_ST_I32, 1, {N}, i32, NULL, NULL},
        {"e.i64", AM_ST_I64, 1, {N}, i64, NULL, NULL},
        {"f.u8", AM_ST_U8, 1, {N}, u8, NULL, NULL},
        {"g.scalar", AM_ST_F32, 0, {0}, &scalar, NULL, NULL},
        {"h.empty", AM_ST_F32, 2, {0, 5}, f32, NULL, NULL},
        {"i.3d", AM_ST_F32, 3, {1, 1, N}, f32, NULL, NULL},
    };
    const size_t nt = sizeof(t) / sizeof(t[0]);
    const struct am_st_kv meta[] = {{"producer", "am"}};
    char *dir = scratch_dir();
    struct am_errors err;
    am_errors_init(&err);
    const char *path = pathf("%s/rt.safetensors", dir);
    assert_int_equal(am_st_write(path, t, nt, meta, 1, 0, &err), 0);
    struct am_st_file *f;
    assert_int_equal(am_st_open(path, &f, &err), 0);
    expect_no_error(&err);
    assert_string_equal(am_st_meta(f, "format"), "pt");
    assert_string_equal(am_st_meta(f, "producer"), "am");
    assert_int_equal(am_st_count(f), nt);
    for (size_t k = 0; k < nt; k++) {
        const struct am_st_info *r = am_st_find(f, t[k].name);
        assert_non_null(r);
        bool ok;
        assert_int_equal(r->dtype, t[k].dtype);
        assert_int_equal(r->ndim, t[k].ndim);
        for (int d = 0; d < t[k].ndim; d++)
            assert_int_equal(r->shape[d], t[k].shape[d]);
        assert_int_equal(r->end - r->begin, am_st_wtensor_bytes(&t[k], &ok));
        assert_memory_equal(r->data, t[k].data, r->end - r->begin);
    }
    float got[N];
    const struct am_st_info *r = am_st_find(f, "b.bf16");
    assert_int_equal(am_st_read_f32(f, r, 0, N, got, &err), 0);
    for (int i = 0; i < N; i++)
        assert_int_equal(bits(got[i]), bits(am_bf16_to_f32(bf16[i])));
    r = am_st_find(f, "c.f16");
    assert_int_equal(am_st_read_f32(f, r, 0, N, got, &err), 0);
    for (int i = 0; i < N; i++)
        assert_int_equal(bits(got[i]), bits(am_f16_to_f32(f16[i])));
    r = am_st_find(f, "e.i64");
    assert_int_equal(am_st_read_f32(f, r, 0, N, got, &err), 0);
    for (int i = 0; i < N; i++)
        assert_true(got[i] == (float)i64[i]);
    r = am_st_find(f, "g.scalar");
    assert_int_equal(r->numel, 1);
    assert_int_equal(am_st_read_f32(f, r, 0, 1, got, &err), 0);
    assert_true(got[0] == 42.5f);
    assert_int_equal(am_st_find(f, "h.empty")->numel, 0);
    r = am_st_find(f, "f.u8");
    assert_int_equal(am_st_read_f32(f, r, 0, 1, got, &err), -1);
    expect_error(&err, "%s: tensor 'f.u8': dtype U8 is not one am converts (F32, BF16, F16, I32, I64)", path);
    am_st_close(f);
    rm_tree(dir);
}

static int fill_ramp(void *ctx, size_t index, uint64_t offset, void *dst, size_t n, struct am_errors *err)
{
    (void)ctx;
    (void)err;
    for (size_t i = 0; i < n; i++)
        ((unsigned char *)dst)[i] = (unsigned char)(index * 31 + offset + i);
    return 0;
}

static int fill_fails(void *ctx, size_t index, uint64_t offset, void *dst, size_t n, struct am_errors *err)
{
    if (index == *(size_t *)ctx) {
        am_errorf(err, NULL, "injected failure in tensor %zu at byte %llu", index, (unsigned long long)offset);
        return -1;
    }
    return fill_ramp(NULL, index, offset, dst, n, err);
}

static void test_fill_and_atomic_write(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    struct am_errors err;
    am_errors_init(&err);
    const char *path = pathf("%s/w.safetensors", dir);
    /* 3 MiB through the callback: several chunks */
    size_t which = 1;
    struct am_st_wtensor t[] = {
        {"x", AM_ST_U8, 1, {3 << 20}, NULL, fill_ramp, NULL},
        {"y", AM_ST_F32, 2, {16, 4}, NULL, fill_fails, &which},
    };
    which = 99;
    assert_int_equal(am_st_write(path, t, 2, NULL, 0, 0, &err), 0);
    size_t before_len;
    unsigned char *before = slurp(path, &before_len);
    struct am_st_file *f;
    assert_int_equal(am_st_open(path, &f, &err), 0);
    const struct am_st_info *x = am_st_find(f, "x");
    for (size_t i = 0; i < (3u << 20); i += 4099)
        assert_int_equal(x->data[i], (unsigned char)i);
    am_st_close(f);

    /* a failure half way: the previous file stays, no temporary file is left */
    which = 1;
    assert_int_equal(am_st_write(path, t, 2, NULL, 0, 0, &err), -1);
    expect_error(&err, "injected failure in tensor 1 at byte 0");
    size_t after_len;
    unsigned char *after = slurp(path, &after_len);
    assert_int_equal(before_len, after_len);
    assert_memory_equal(before, after, before_len);
    assert_int_equal(count_entries(dir, ".tmp-"), 0);
    free(before);
    free(after);

    /* a directory that does not exist */
    assert_int_equal(am_st_write(pathf("%s/no/such/x.safetensors", dir), t, 1, NULL, 0, 0, &err), -1);
    assert_non_null(strstr(err.msg[0], "cannot create a temporary file beside it: No such file or directory"));
    am_errors_free(&err);
    am_errors_init(&err);

    /* names the writer refuses */
    float v = 1;
    struct am_st_wtensor bad[] = {{"a", AM_ST_F32, 0, {0}, &v, NULL, NULL}, {"a", AM_ST_F32, 0, {0}, &v, NULL, NULL}};
    assert_int_equal(am_st_write(path, bad, 2, NULL, 0, 0, &err), -1);
    expect_error(&err, "%s: tensor 'a': the name is given twice", path);
    bad[0].name = "__metadata__";
    assert_int_equal(am_st_write(path, bad, 1, NULL, 0, 0, &err), -1);
    expect_error(&err, "%s: tensor '__metadata__': the name is reserved", path);
    assert_int_equal(count_entries(dir, ".tmp-"), 0);
    rm_tree(dir);
}

/* ---- corruptions ------------------------------------------------------------------------------------ */

/* Writes the length hlen (0: the header's own length), the header and `data` zero bytes. */
static const char *craft(const char *dir, const char *name, uint64_t hlen, const char *header, size_t data)
{
    const char *path = pathf("%s/%s.safetensors", dir, name);
    size_t n = strlen(header);
    unsigned char *b = calloc(1, 8 + n + data);
    if (!hlen)
        hlen = n;
    memcpy(b, &hlen, 8);
    memcpy(b + 8, header, n);
    spit(path, b, 8 + n + data);
    free(b);
    return path;
}

static void expect_rejected(const char *path, const char *fmt, ...)
{
    struct am_errors err;
    am_errors_init(&err);
    struct am_st_file *f = NULL;
    assert_int_equal(am_st_open(path, &f, &err), -1);
    assert_null(f);
    char want[2048], full[2200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(want, sizeof(want), fmt, ap);
    va_end(ap);
    snprintf(full, sizeof(full), "%s: %s", path, want);
    expect_error(&err, "%s", full);
}

#define H(name, s) craft(dir, name, 0, s, 0)

static void test_corruptions(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *p;

    p = pathf("%s/short.safetensors", dir);
    spit(p, "\x10\0\0\0\0", 5);
    expect_rejected(p, "the file is 5 bytes, too short for the 8-byte header length (truncated, or not a safetensors file)");

    p = craft(dir, "huge", 200000000, "{}", 0);
    expect_rejected(p, "header length 200000000 is more than the 100000000 bytes safetensors allows (corrupt, or "
                       "not a safetensors file)");

    p = craft(dir, "pastend", 1000, "{}", 100);
    expect_rejected(p, "header length 1000 runs past the end of the file (102 bytes follow the length): the file is "
                       "truncated");

    p = H("badjson", "{\"a\": {\"dtype\": \"F32\", ");
    expect_rejected(p, "the header is not valid JSON: string or '}' expected near end of file (at byte 23 of the "
                       "header): the file is corrupt or not a safetensors file");

    p = H("array", "[1, 2]");
    expect_rejected(p, "the header is not a JSON object: not a safetensors file");

    p = H("dup", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
          "\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}");
    expect_rejected(p, "the header names a tensor twice (duplicate object key near '\"a\"'); each name must be "
                       "unique: the file is corrupt");

    p = H("dtype", "{\"w\": {\"dtype\": \"F33\", \"shape\": [1], \"data_offsets\": [0, 4]}}");
    expect_rejected(p, "tensor 'w': unknown dtype 'F33' (safetensors defines BOOL, U8, I8, I16, U16, I32, U32, I64, "
                       "U64, F16, BF16, F32, F64, C64 and the F4/F6/F8 variants)");

    p = H("negshape", "{\"w\": {\"dtype\": \"F32\", \"shape\": [2, -1], \"data_offsets\": [0, 4]}}");
    expect_rejected(p, "tensor 'w': shape must be a list of non-negative integers (the header is corrupt)");

    p = H("missing_key", "{\"w\": {\"dtype\": \"F32\", \"shape\": [2]}}");
    expect_rejected(p, "tensor 'w': needs \"dtype\" (a string), \"shape\" (a list) and \"data_offsets\" (a list) "
                       "(the header is corrupt)");

    p = H("reversed", "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 0]}}");
    expect_rejected(p, "tensor 'w': data_offsets [8, 0] end before they begin (the header is corrupt)");

    p = H("mismatch", "{\"w\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 16]}}");
    expect_rejected(p, "tensor 'w': dtype F32 and shape [2, 3] need 24 bytes, but data_offsets [0, 16] hold 16 "
                       "(the header does not match the data)");

    p = H("overflow", "{\"w\": {\"dtype\": \"F32\", \"shape\": [4611686018427387904, 4], \"data_offsets\": [0, 16]}}");
    expect_rejected(p, "tensor 'w': shape [4611686018427387904, 4] is too large (its size overflows 64 bits; the "
                       "header is corrupt)");

    p = craft(dir, "overlap", 0,
              "{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
              "\"b\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [8, 24]}}", 24);
    expect_rejected(p, "tensor 'b': data_offsets [8, 24] overlap tensor 'a' [0, 16] (tensors must not share bytes; "
                       "the header is corrupt)");

    p = craft(dir, "gap", 0,
              "{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
              "\"b\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [20, 36]}}", 36);
    expect_rejected(p, "tensor 'b': data_offsets start at 20, but the previous tensor 'a' ends at 16 (tensors are "
                       "packed without gaps; the header is corrupt)");

    p = craft(dir, "first", 0, "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}", 8);
    expect_rejected(p, "tensor 'a': data_offsets start at 4, but the first tensor must start at 0 (tensors are "
                       "packed without gaps; the header is corrupt)");

    p = craft(dir, "beyond", 0, "{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 10);
    expect_rejected(p, "tensor 'a': data_offsets [0, 16] run past the end of the data (10 bytes after the header): "
                       "the file is truncated");

    p = craft(dir, "trailing", 0, "{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 20);
    expect_rejected(p, "4 bytes follow the last tensor (the data is 20 bytes, the tensors end at 16); safetensors "
                       "allows no trailing bytes: the file is corrupt");

    p = H("metastr", "{\"__metadata__\": {\"format\": 1}}");
    expect_rejected(p, "__metadata__ must map strings to strings (the header is corrupt)");

    p = pathf("%s/latin1.safetensors", dir);
    craft(dir, "latin1", 0, "{\"\xe9\": 1}", 0);
    expect_rejected(p, "the header is not valid JSON: unable to decode byte 0xe9 near '\"' (at byte 2 of the "
                       "header): the file is corrupt or not a safetensors file");

    /* what the reference accepts, am accepts: fields it does not know, scalars, empty tensors */
    p = craft(dir, "lenient", 0, "{\"s\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [0, 4], \"x\": 1}, "
              "\"z\": {\"dtype\": \"BF16\", \"shape\": [0, 5], \"data_offsets\": [4, 4]}}", 4);
    struct am_errors err;
    am_errors_init(&err);
    struct am_st_file *f;
    assert_int_equal(am_st_open(p, &f, &err), 0);
    assert_int_equal(am_st_count(f), 2);
    assert_int_equal(am_st_find(f, "s")->numel, 1);
    assert_int_equal(am_st_find(f, "z")->numel, 0);
    am_st_close(f);

    /* a real file cut short in its data */
    size_t n;
    unsigned char *ref = slurp(srcpath("tests/ckpt/fixtures/reference.safetensors"), &n);
    p = pathf("%s/cut.safetensors", dir);
    spit(p, ref, n - 5);
    expect_rejected(p, "tensor 'f16': data_offsets [112, 124] run past the end of the data (119 bytes after the "
                       "header): the file is truncated");
    free(ref);

    p = pathf("%s/missing.safetensors", dir);
    expect_rejected(p, "cannot open: No such file or directory");
    expect_rejected(dir, "not a regular file");
    rm_tree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_exhaustive),
        cmocka_unit_test(test_bf16_exhaustive),
        cmocka_unit_test(test_reference_file),
        cmocka_unit_test(test_writer_matches_reference),
        cmocka_unit_test(test_roundtrip_every_dtype),
        cmocka_unit_test(test_fill_and_atomic_write),
        cmocka_unit_test(test_corruptions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
