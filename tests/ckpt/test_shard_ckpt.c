/* test_shard_ckpt.c - the sharded checkpoint format (shard_ckpt.h): two ranks holding a 4 x 6
 * matrix by columns and a vector as flat pieces, committed, read back in rectangles that
 * cross the pieces, checked (sizes, crc32c), kept (max_recent_checkpoints) and resolved. */
#include "testio.h"

#include "crc32c.h"
#include "shard_ckpt.h"

#define ROWS 4
#define COLS 6

static float value(int s, int64_t r, int64_t c) { return (float)(s * 1000 + r * 10 + c); }

/* Rank 0 holds columns 0-2 of "w" and elements 0-2 of "b"; rank 1 columns 3-5 and 3-4. */
static void write_rank(const char *tmp, int rank)
{
    float sec[3][ROWS * 3 + 3];
    int64_t c0 = rank * 3, b0 = rank * 3, nb = rank ? 2 : 3;
    for (int s = 0; s < 3; s++) {
        for (int64_t r = 0; r < ROWS; r++)
            for (int64_t c = 0; c < 3; c++)
                sec[s][r * 3 + c] = value(s, r, c0 + c);
        for (int64_t i = 0; i < nb; i++)
            sec[s][ROWS * 3 + i] = value(s, 9, b0 + i);
    }
    struct am_sckpt_piece p[2] = {{"w", ROWS, COLS, 0, 0, ROWS, c0, 3}, {"b", 5, 0, ROWS * 3, b0, nb, 0, 1}};
    const float *const secs[3] = {sec[0], sec[1], sec[2]};
    char err[512];
    assert_int_equal(am_sckpt_write_rank(tmp, rank, secs, ROWS * 3 + nb, p, 2, NULL, NULL, err, sizeof(err)), 0);
}

static void save(const char *root, long step, long keep)
{
    char tmp[4096], err[512];
    bool already;
    int ranks[2] = {0, 1};
    assert_int_equal(am_sckpt_begin(root, step, "t", err, sizeof(err)), 0);
    am_sckpt_tmp_dir(root, step, "t", tmp, sizeof(tmp));
    write_rank(tmp, 0);
    write_rank(tmp, 1);
    assert_int_equal(am_sckpt_commit(root, step, "t", ranks, 2, json_pack("{s:i}", "x", 1), "0123456789abcdef", keep,
                                     NULL, NULL, &already, err, sizeof(err)), 0);
    assert_false(already);
}

static void test_roundtrip(void **state)
{
    (void)state;
    char *root = scratch_dir(), dir[4096], err[1024];
    bool found;
    save(root, 2, 0);
    assert_int_equal(am_sckpt_resolve(root, "latest", dir, sizeof(dir), &found, err, sizeof(err)), 0);
    assert_true(found);
    assert_string_equal(dir, pathf("%s/step-2", root));
    struct am_sckpt *c;
    assert_int_equal(am_sckpt_open(dir, &c, err, sizeof(err)), 0);
    assert_int_equal(am_sckpt_step(c), 2);
    assert_string_equal(am_sckpt_model_hash(c), "0123456789abcdef");
    assert_int_equal(json_integer_value(json_object_get(am_sckpt_meta(c), "x")), 1);
    int w = am_sckpt_find(c, "w"), b = am_sckpt_find(c, "b");
    assert_true(w >= 0 && b >= 0);
    struct am_sckpt_tensor_info ti;
    am_sckpt_tensor(c, (size_t)b, &ti);
    assert_int_equal(ti.ndim, 1);
    assert_int_equal(ti.rows, 5);
    /* rows 1-3 x columns 1-4: across both ranks' pieces, every section */
    for (int s = 0; s < 3; s++) {
        float got[3 * 4];
        unsigned char mask[3 * 4] = {0};
        assert_int_equal(am_sckpt_read(c, (size_t)w, s, 1, 3, 1, 4, got, 4, mask, err, sizeof(err)), 0);
        for (int r = 0; r < 3; r++)
            for (int k = 0; k < 4; k++) {
                assert_true(got[r * 4 + k] == value(s, 1 + r, 1 + k));
                assert_int_equal(mask[r * 4 + k], 1);
            }
        float v[5];
        assert_int_equal(am_sckpt_read(c, (size_t)b, s, 0, 5, 0, 1, v, 1, NULL, err, sizeof(err)), 0);
        for (int i = 0; i < 5; i++)
            assert_true(v[i] == value(s, 9, i));
    }
    assert_int_equal(am_sckpt_verify(c, err, sizeof(err)), 0);
    am_sckpt_close(c);
    /* the same step saved again takes the place of the one there, in one rename */
    spit(pathf("%s/step-2/marker", root), "x", 1);
    save(root, 2, 0);
    struct stat st;
    assert_int_equal(stat(pathf("%s/step-2/marker", root), &st), -1);
    assert_int_equal(stat(pathf("%s/step-2/manifest.json", root), &st), 0);
    assert_int_equal(count_entries(root, ".tmp-"), 0);
    /* keep the last 2 of 4: step-2 and step-4 go, `latest` names step-8, no temporary left */
    save(root, 4, 2);
    mkdir(pathf("%s/step-7.tmp-old", root), 0755);
    save(root, 6, 2);
    save(root, 8, 2);
    assert_int_equal(count_entries(root, "step-"), 2);
    assert_int_equal(stat(pathf("%s/step-6/manifest.json", root), &st), 0);
    assert_int_equal(stat(pathf("%s/step-8/manifest.json", root), &st), 0);
    size_t len;
    unsigned char *latest = slurp(pathf("%s/latest", root), &len);
    assert_int_equal(len, 7);
    assert_memory_equal(latest, "step-8\n", 7);
    free(latest);
    /* the directory itself, and a checkpoint_dir, resolve too */
    assert_int_equal(am_sckpt_resolve("x", pathf("%s/step-6", root), dir, sizeof(dir), &found, err, sizeof(err)), 0);
    assert_string_equal(dir, pathf("%s/step-6", root));
    assert_int_equal(am_sckpt_resolve("x", root, dir, sizeof(dir), &found, err, sizeof(err)), 0);
    assert_string_equal(dir, pathf("%s/step-8", root));
    rm_tree(root);
}

static void test_refusals(void **state)
{
    (void)state;
    char *root = scratch_dir(), dir[4096], err[1024];
    bool found = true;
    /* nothing saved yet: `latest` is not found, which is no error */
    assert_int_equal(am_sckpt_resolve(pathf("%s/none", root), "latest", dir, sizeof(dir), &found, err, sizeof(err)), 0);
    assert_false(found);
    assert_int_equal(am_sckpt_resolve(root, pathf("%s/none", root), dir, sizeof(dir), &found, err, sizeof(err)), -1);
    save(root, 2, 0);
    snprintf(dir, sizeof(dir), "%s/step-2", root);
    struct am_sckpt *c;
    /* a flipped byte */
    size_t len;
    unsigned char *bin = slurp(pathf("%s/rank-00001.bin", dir), &len);
    bin[5] ^= 1;
    spit(pathf("%s/rank-00001.bin", dir), bin, len);
    assert_int_equal(am_sckpt_open(dir, &c, err, sizeof(err)), 0);
    assert_int_equal(am_sckpt_verify(c, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "shard rank-00001.bin: crc32c "));
    assert_non_null(strstr(err, "(the file is damaged: restore from another checkpoint)"));
    am_sckpt_close(c);
    /* a truncated one */
    spit(pathf("%s/rank-00001.bin", dir), bin, len - 4);
    free(bin);
    assert_int_equal(am_sckpt_open(dir, &c, err, sizeof(err)), 0);
    assert_int_equal(am_sckpt_verify(c, err, sizeof(err)), -1);
    assert_string_equal(err, pathf("checkpoint %s: shard rank-00001.bin is %zu bytes, the manifest says %zu (truncated "
                                   "or damaged: restore from another checkpoint)", dir, len - 4, len));
    am_sckpt_close(c);
    /* a manifest of another format */
    spit(pathf("%s/manifest.json", dir), "{\"format\": \"x\"}", 15);
    assert_int_equal(am_sckpt_open(dir, &c, err, sizeof(err)), -1);
    assert_string_equal(err, pathf("checkpoint %s: manifest.json: \"format\" is not \"am-sharded-checkpoint\" (the "
                                   "manifest is damaged or not am's: restore from another checkpoint)", dir));
    rm_tree(root);
}

static void test_crc32c(void **state)
{
    (void)state;
    /* the standard check value of CRC-32C */
    assert_int_equal(am_crc32c(0, "123456789", 9), 0xE3069283u);
    assert_int_equal(am_crc32c(am_crc32c(0, "12345", 5), "6789", 4), 0xE3069283u);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32c),
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
