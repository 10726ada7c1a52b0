/* test_dataset.c - Megatron indexed datasets and GPT samples: fixtures written by an
 * independent port of Megatron's writer (tests/data/fixtures/make_megatron_fixture.py, which
 * also computed the expected samples with numpy's RandomState as Megatron drives it), hand-
 * computed samples with shuffle off, shuffle properties, blending shares, data-parallel
 * sharding, every corruption of an index rejected with its message, and am-data. */
#include <sys/wait.h>

#include "../ckpt/testio.h"
#include "dataset.h"
#include "recipe.h"

/* megatron_u16, seq_length 4, seed 1234, one epoch: 6 samples */
static const int32_t expect_u16_epoch[][5] = {
    {100, 101, 102, 6, 7},
    {5, 202, 203, 204, 205},
    {1, 2, 3, 4, 5},
    {303, 304, 305, 60000, 1},
    {205, 206, 207, 200, 201},
    {7, 300, 301, 302, 303},
};
/* megatron_u16, seq_length 4, seed 1234, 20 samples: 4 epochs, 24 samples */
static const int32_t expect_u16_20[][5] = {
    {202, 203, 204, 205, 206},
    {207, 202, 203, 204, 205},
    {7, 202, 203, 204, 205},
    {303, 304, 305, 60000, 207},
    {303, 304, 305, 60000, 207},
    {302, 303, 304, 305, 60000},
    {2, 3, 4, 5, 207},
    {101, 102, 1, 2, 3},
    {60000, 100, 101, 102, 100},
    {207, 300, 301, 302, 303},
    {3, 4, 5, 6, 7},
    {7, 300, 301, 302, 303},
    {205, 206, 200, 201, 202},
    {200, 201, 300, 301, 302},
    {206, 200, 201, 100, 101},
    {3, 4, 5, 6, 7},
    {100, 101, 102, 1, 2},
    {205, 206, 1, 2, 3},
    {301, 302, 303, 304, 305},
    {207, 6, 7, 300, 301},
};
/* blend 0.3 megatron_u16 + 0.7 megatron_i32, seq_length 3, seed 7, 12 samples: 13 (dataset, sample, tokens...) */
static const int32_t expect_blend[][6] = {
    {1, 0, 70003, 70004, 70005, 90000},
    {0, 0, 300, 301, 302, 303},
    {1, 1, 90000, 90001, 90002, 90003},
    {1, 2, 70005, 90000, 90001, 90002},
    {0, 1, 60000, 200, 201, 6},
    {1, 3, 90003, 70000, 70001, 70002},
    {1, 4, 70000, 70001, 70002, 70003},
    {0, 2, 203, 204, 205, 206},
    {1, 5, 70002, 70003, 70004, 70005},
    {1, 6, 90002, 90003, 80000, 80001},
    {0, 3, 303, 304, 305, 60000},
    {1, 7, 80004, 80005, 80006, 80007},
    {1, 8, 80001, 80002, 80003, 80004},
};

static const char *fixture(const char *name) { return srcpath(pathf("tests/data/fixtures/%s", name)); }

/* Builds PREFIX from documents given as arrays of ids (each ended by -1; the list by NULL). */
static void build(const char *prefix, enum am_idx_dtype dtype, const int64_t *const *docs)
{
    struct am_errors err;
    am_errors_init(&err);
    struct am_indexed_builder *b;
    assert_int_equal(am_indexed_builder_open(prefix, dtype, &b, &err), 0);
    for (size_t d = 0; docs[d]; d++) {
        size_t n = 0;
        while (docs[d][n] >= 0)
            n++;
        assert_int_equal(am_indexed_builder_add(b, docs[d], n, &err), 0);
        assert_int_equal(am_indexed_builder_end_document(b, &err), 0);
    }
    assert_int_equal(am_indexed_builder_finish(b, &err), 0);
    expect_no_error(&err);
}

static struct am_gpt *open_gpt(const char *const *paths, const double *weights, int n, int64_t seq, bool shuffle,
                               uint32_t seed, int64_t num_samples)
{
    struct am_gpt_config cfg = {paths, weights, n, seq, shuffle, seed, num_samples};
    struct am_errors err;
    am_errors_init(&err);
    struct am_gpt *g = NULL;
    assert_int_equal(am_gpt_open(&cfg, &g, &err), 0);
    expect_no_error(&err);
    return g;
}

static void sample(const struct am_gpt *g, int64_t i, int32_t *tok)
{
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_gpt_sample(g, i, tok, &err), 0);
    expect_no_error(&err);
}

/* ---- the Megatron fixtures ---------------------------------------------------------------------- */

static void test_megatron_fixture(void **state)
{
    (void)state;
    struct am_errors err;
    am_errors_init(&err);
    struct am_indexed *d;
    const char *prefix = fixture("megatron_u16");
    assert_int_equal(am_indexed_open(prefix, &d, &err), 0);
    assert_int_equal(am_indexed_dtype(d), AM_IDX_U16);
    assert_int_equal(am_indexed_sequences(d), 7);
    assert_int_equal(am_indexed_documents(d), 4);
    assert_int_equal(am_indexed_tokens(d), 25);
    const int32_t lengths[7] = {5, 2, 3, 2, 5, 1, 7};
    for (int i = 0; i < 7; i++)
        assert_int_equal(am_indexed_length(d, i), lengths[i]);
    const int64_t starts[5] = {0, 2, 3, 6, 7};
    for (int i = 0; i < 5; i++)
        assert_int_equal(am_indexed_doc_start(d, i), starts[i]);
    int32_t tok[8];
    assert_int_equal(am_indexed_read(d, 6, 0, 7, tok, &err), 0);
    const int32_t last[7] = {300, 301, 302, 303, 304, 305, 60000};
    assert_memory_equal(tok, last, sizeof(last));
    assert_int_equal(am_indexed_read(d, 4, 2, 3, tok, &err), 0);
    assert_true(tok[0] == 204 && tok[1] == 205 && tok[2] == 206);
    assert_int_equal(am_indexed_read(d, 4, 3, 3, tok, &err), -1);
    expect_error(&err, "%s: tokens [3, 6) of sequence 4 are outside the dataset (7 sequences)", prefix);
    am_indexed_close(d);

    prefix = fixture("megatron_i32");
    assert_int_equal(am_indexed_open(prefix, &d, &err), 0);
    assert_int_equal(am_indexed_dtype(d), AM_IDX_I32);
    assert_int_equal(am_indexed_sequences(d), 3);
    assert_int_equal(am_indexed_read(d, 1, 8, 1, tok, &err), 0);
    assert_int_equal(tok[0], 80008);
    am_indexed_close(d);
}

static void test_megatron_samples(void **state)
{
    (void)state;
    const char *u16 = fixture("megatron_u16"), *i32 = fixture("megatron_i32");
    int32_t tok[8];
    /* one epoch */
    struct am_gpt *g = open_gpt(&u16, NULL, 1, 4, true, 1234, 0);
    assert_int_equal(am_gpt_size(g), 6);
    for (int i = 0; i < 6; i++) {
        sample(g, i, tok);
        assert_memory_equal(tok, expect_u16_epoch[i], sizeof(expect_u16_epoch[i]));
    }
    am_gpt_close(g);
    /* 20 samples: 4 epochs, the last shuffled separately (used for less than 80%) */
    g = open_gpt(&u16, NULL, 1, 4, true, 1234, 20);
    assert_int_equal(am_gpt_size(g), 24);
    assert_int_equal(am_gpt_dataset_epochs(g, 0), 4);
    for (int i = 0; i < 20; i++) {
        sample(g, i, tok);
        assert_memory_equal(tok, expect_u16_20[i], sizeof(expect_u16_20[i]));
    }
    am_gpt_close(g);
    /* a blend of the two */
    const char *paths[2] = {u16, i32};
    const double w[2] = {0.3, 0.7};
    g = open_gpt(paths, w, 2, 3, true, 7, 12);
    assert_int_equal(am_gpt_size(g), 13);
    for (int i = 0; i < 13; i++) {
        int ds;
        int64_t j;
        assert_int_equal(am_gpt_source(g, i, &ds, &j), 0);
        assert_int_equal(ds, expect_blend[i][0]);
        assert_int_equal(j, expect_blend[i][1]);
        sample(g, i, tok);
        assert_memory_equal(tok, &expect_blend[i][2], 4 * sizeof(int32_t));
    }
    am_gpt_close(g);
}

/* ---- samples by hand ---------------------------------------------------------------------------- */

static void test_samples_in_file_order(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *prefix = pathf("%s/abc", dir);
    build(prefix, AM_IDX_U8, (const int64_t *const[]){(const int64_t[]){1, 2, 3, -1}, (const int64_t[]){4, 5, -1},
                                                      (const int64_t[]){6, 7, 8, 9, -1}, NULL});
    int32_t tok[4];
    /* 9 tokens, seq_length 3: samples of 4 tokens, each starting on the last token of the one
     * before: (9 - 1) / 3 = 2 samples in one epoch */
    struct am_gpt *g = open_gpt(&prefix, NULL, 1, 3, false, 0, 0);
    assert_int_equal(am_gpt_size(g), 2);
    sample(g, 0, tok);
    assert_memory_equal(tok, ((const int32_t[]){1, 2, 3, 4}), sizeof(tok));
    sample(g, 1, tok);
    assert_memory_equal(tok, ((const int32_t[]){4, 5, 6, 7}), sizeof(tok));
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_gpt_sample(g, 2, tok, &err), -1);
    expect_error(&err, "dataset: sample 2 is past the end (2 samples were built: pass the number the run reads as "
                 "num_samples)");
    am_gpt_close(g);
    /* 5 samples need 16 tokens: 2 epochs, in file order */
    g = open_gpt(&prefix, NULL, 1, 3, false, 0, 5);
    assert_int_equal(am_gpt_size(g), 5);
    const int32_t want[5][4] = {{1, 2, 3, 4}, {4, 5, 6, 7}, {7, 8, 9, 1}, {1, 2, 3, 4}, {4, 5, 6, 7}};
    for (int i = 0; i < 5; i++) {
        sample(g, i, tok);
        assert_memory_equal(tok, want[i], sizeof(tok));
    }
    am_gpt_close(g);
    /* seq_length 1: pairs */
    g = open_gpt(&prefix, NULL, 1, 1, false, 0, 0);
    assert_int_equal(am_gpt_size(g), 8);
    sample(g, 7, tok);
    assert_true(tok[0] == 8 && tok[1] == 9);
    am_gpt_close(g);
    rm_tree(dir);
}

static void test_shuffle_properties(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *prefix = pathf("%s/uniq", dir);
    /* 40 documents of 1 to 9 tokens, every token id distinct */
    int64_t store[40][11];
    const int64_t *docs[41];
    int64_t next = 1, total = 0;
    for (int d = 0; d < 40; d++) {
        int len = 1 + (d * 7) % 9;
        for (int i = 0; i < len; i++)
            store[d][i] = next++;
        store[d][len] = -1;
        docs[d] = store[d];
        total += len;
    }
    docs[40] = NULL;
    build(prefix, AM_IDX_U16, docs);
    const int64_t L = 8, n = (total - 1) / L;
    struct am_gpt *g = open_gpt(&prefix, NULL, 1, L, true, 99, 0), *again = open_gpt(&prefix, NULL, 1, L, true, 99, 0),
                  *other = open_gpt(&prefix, NULL, 1, L, true, 100, 0);
    assert_int_equal(am_gpt_size(g), n);
    int32_t tok[9], tok2[9];
    char *seen = calloc((size_t)next, 1);
    int differs = 0;
    for (int64_t i = 0; i < n; i++) {
        sample(g, i, tok);
        sample(again, i, tok2);
        assert_memory_equal(tok, tok2, sizeof(tok)); /* deterministic from the seed */
        sample(other, i, tok2);
        differs += memcmp(tok, tok2, sizeof(tok)) != 0;
        /* every token of the epoch is the input of exactly one sample (but for the tail) */
        for (int t = 0; t < L; t++) {
            assert_true(tok[t] > 0 && tok[t] < next);
            assert_int_equal(seen[tok[t]], 0);
            seen[tok[t]] = 1;
        }
    }
    int used = 0;
    for (int64_t t = 1; t < next; t++)
        used += seen[t];
    assert_int_equal(used, n * L);
    assert_true(differs > n / 2);
    /* with shuffle the order differs from the file's */
    struct am_gpt *plain = open_gpt(&prefix, NULL, 1, L, false, 99, 0);
    sample(plain, 0, tok2);
    assert_int_equal(tok2[0], 1);
    int in_order = 0;
    for (int64_t i = 0; i < n; i++) {
        sample(g, i, tok);
        sample(plain, i, tok2);
        in_order += memcmp(tok, tok2, sizeof(tok)) == 0;
    }
    assert_true(in_order < n / 2);
    free(seen);
    am_gpt_close(g);
    am_gpt_close(again);
    am_gpt_close(other);
    am_gpt_close(plain);
    rm_tree(dir);
}

static void test_blend_shares(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *paths[3];
    for (int k = 0; k < 3; k++) {
        paths[k] = strdup(pathf("%s/part%d", dir, k));
        int64_t doc[64];
        for (int i = 0; i < 63; i++)
            doc[i] = 10 * k + i % 10;
        doc[63] = -1;
        build(paths[k], AM_IDX_U8, (const int64_t *const[]){doc, NULL});
    }
    const double w[3] = {2, 3, 5}; /* normalised: 0.2, 0.3, 0.5 */
    struct am_gpt *g = open_gpt(paths, w, 3, 4, true, 5, 1000);
    assert_int_equal(am_gpt_size(g), 1000);
    int64_t count[3] = {0};
    int32_t tok[5];
    for (int64_t i = 0; i < 1000; i++) {
        int ds;
        int64_t j;
        assert_int_equal(am_gpt_source(g, i, &ds, &j), 0);
        assert_int_equal(j, count[ds]); /* each dataset's samples in its own order */
        count[ds]++;
        /* the realised share never lags or leads its weight by a whole sample */
        for (int k = 0; k < 3; k++) {
            double target = w[k] / 10.0 * (double)(i + 1);
            assert_true((double)count[k] < target + 1.0 && (double)count[k] > target - 1.0);
        }
        sample(g, i, tok);
        assert_true(tok[0] / 10 == ds); /* the tokens come from that dataset */
    }
    assert_int_equal(count[0], 200);
    assert_int_equal(count[1], 300);
    assert_int_equal(count[2], 500);
    /* each dataset built its share plus Megatron's 0.5% surplus, over whole epochs */
    assert_true(am_gpt_dataset_samples(g, 2) >= 503);
    am_gpt_close(g);
    for (int k = 0; k < 3; k++)
        free((void *)paths[k]);
    rm_tree(dir);
}

static void test_data_parallel_sharding(void **state)
{
    (void)state;
    /* global batch 8: one rank (batch 8), two ranks (batch 4), four ranks (batch 2, or 1
     * with 2 accumulation steps): each step covers exactly [8s, 8s + 8) */
    const int64_t G = 8;
    for (int world = 1; world <= 4; world *= 2)
        for (int64_t step = 0; step < 3; step++) {
            int hits[8] = {0};
            for (int r = 0; r < world; r++)
                for (int64_t k = 0; k < G / world; k++) {
                    int64_t i = am_gpt_global_index(step, G, r, world, k);
                    assert_true(i >= step * G && i < (step + 1) * G);
                    hits[i - step * G]++;
                }
            for (int i = 0; i < 8; i++)
                assert_int_equal(hits[i], 1);
        }
    assert_int_equal(am_gpt_global_index(2, 8, 1, 4, 1), 16 + 4 + 1);
}

static void test_gpt_errors(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *prefix = pathf("%s/tiny", dir);
    build(prefix, AM_IDX_U8, (const int64_t *const[]){(const int64_t[]){1, 2, 3, -1}, NULL});
    struct am_errors err;
    am_errors_init(&err);
    struct am_gpt *g = NULL;
    struct am_gpt_config cfg = {&prefix, NULL, 1, 8, true, 1, 0};
    assert_int_equal(am_gpt_open(&cfg, &g, &err), -1);
    expect_error(&err, "%s: 3 tokens, fewer than one sample of seq_length + 1 = 9 (use a larger dataset or a smaller "
                 "dataset.seq_length)", prefix);
    cfg.num_samples = 2; /* possible over several epochs */
    assert_int_equal(am_gpt_open(&cfg, &g, &err), 0);
    assert_int_equal(am_gpt_dataset_epochs(g, 0), 6);
    am_gpt_close(g);
    cfg.seq_length = 0;
    assert_int_equal(am_gpt_open(&cfg, &g, &err), -1);
    expect_error(&err, "dataset.seq_length: 0 must be at least 1");
    const char *two[2] = {prefix, prefix};
    cfg = (struct am_gpt_config){two, NULL, 2, 2, true, 1, 0};
    assert_int_equal(am_gpt_open(&cfg, &g, &err), -1);
    expect_error(&err, "dataset: a blend of 2 datasets needs the number of samples to draw (global batch x steps), "
                 "got 0");
    cfg.num_samples = 4;
    cfg.weights = (const double[]){1, -1};
    assert_int_equal(am_gpt_open(&cfg, &g, &err), -1);
    expect_error(&err, "dataset.paths: weight -1 of %s must be positive", prefix);
    const char *none = pathf("%s/none", dir);
    cfg = (struct am_gpt_config){&none, NULL, 1, 2, true, 1, 0};
    assert_int_equal(am_gpt_open(&cfg, &g, &err), -1);
    expect_error(&err, "%s.idx: cannot open: No such file or directory (build the dataset with am-data build --out "
                 "PREFIX)", none);
    /* token ids that do not fit the dtype */
    struct am_indexed_builder *b;
    assert_int_equal(am_indexed_builder_open(pathf("%s/small", dir), AM_IDX_U8, &b, &err), 0);
    assert_int_equal(am_indexed_builder_add(b, (const int64_t[]){3, 256}, 2, &err), -1);
    expect_error(&err, "%s/small: token id 256 does not fit the dataset's dtype uint8 (0 to 255)", dir);
    am_indexed_builder_abort(b);
    assert_int_equal(count_entries(dir, "small"), 0); /* nothing left behind */
    rm_tree(dir);
}

static void test_recipe_config(void **state)
{
    (void)state;
    const char *yaml = "dataset:\n  paths: [0.25, a/x, 0.75, b/y]\n  seq_length: 16\n  shuffle: false\n"
                       "  seed: 4294967296\n";
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = am_recipe_parse("r.yaml", yaml, strlen(yaml), NULL, 0, &err);
    assert_non_null(r);
    am_errors_free(&err); /* the model section is missing: not this test's business */
    am_errors_init(&err);
    struct am_gpt_config cfg;
    assert_int_equal(am_gpt_config_from_recipe(r, 100, &cfg, &err), -1);
    expect_error(&err, "r.yaml:5:9: dataset.seed: 4294967296 is outside 0 to 4294967295 (numpy's RandomState, which "
                 "Megatron seeds with it, takes a 32-bit seed)");
    r->data.seed = 77;
    assert_int_equal(am_gpt_config_from_recipe(r, 100, &cfg, &err), 0);
    assert_int_equal(cfg.n_paths, 2);
    assert_string_equal(cfg.paths[1], "b/y");
    assert_true(cfg.weights[0] == 0.25);
    assert_int_equal(cfg.seq_length, 16);
    assert_false(cfg.shuffle);
    assert_int_equal(cfg.seed, 77);
    assert_int_equal(cfg.num_samples, 100);
    am_recipe_free(r);
}

/* ---- corrupt indexes ---------------------------------------------------------------------------- */

/* Copies the uint16 fixture to DIR/c, applies the patch to its index and expects the message. */
static void expect_bad_index(const char *dir, size_t cut, size_t at, const void *patch, size_t len, const char *fmt,
                             ...)
{
    size_t n, nb;
    unsigned char *idx = slurp(fixture("megatron_u16.idx"), &n), *bin = slurp(fixture("megatron_u16.bin"), &nb);
    unsigned char *b = calloc(1, n + 16);
    memcpy(b, idx, n);
    if (patch)
        memcpy(b + at, patch, len);
    const char *prefix = pathf("%s/c", dir);
    spit(pathf("%s.idx", prefix), b, cut ? cut : n);
    spit(pathf("%s.bin", prefix), bin, nb);
    free(idx);
    free(bin);
    free(b);
    struct am_errors err;
    am_errors_init(&err);
    struct am_indexed *d = NULL;
    assert_int_equal(am_indexed_open(prefix, &d, &err), -1);
    assert_null(d);
    char want[1024], full[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(want, sizeof(want), fmt, ap);
    va_end(ap);
    snprintf(full, sizeof(full), "%s.idx: %s", prefix, want);
    expect_error(&err, "%s", full);
}

static void test_corrupt_index(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const int32_t minus1 = -1;
    const int64_t one = 1, zero = 0, six = 6, ptr = 999, huge = (int64_t)1 << 60;
    const uint64_t two = 2;
    expect_bad_index(dir, 20, 0, NULL, 0, "truncated: 20 bytes, but the header alone (magic, version, dtype, counts) "
                     "is 34");
    expect_bad_index(dir, 0, 0, "X", 1, "offset 0: expected the magic \"MMIDIDX\\x00\\x00\" of a Megatron index, "
                     "found \"XMIDIDX\\x00\\x00\" (not an MMIDIDX .idx file)");
    expect_bad_index(dir, 0, 9, &two, 8, "offset 9: expected version 1, found 2");
    expect_bad_index(dir, 0, 17, "\x09", 1, "offset 17: dtype code 9 is not one of Megatron's (1 uint8, 2 int8, "
                     "3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)");
    expect_bad_index(dir, 0, 17, "\x06", 1, "offset 17: dtype float64 cannot hold token ids (am reads datasets of "
                     "integer tokens)");
    expect_bad_index(dir, 100, 0, NULL, 0, "truncated: the header announces 7 sequences and 5 document boundaries, "
                     "which need 158 bytes, but the file has 100");
    expect_bad_index(dir, 0, 18, &huge, 8, "truncated: the header announces 1152921504606846976 sequences and 5 "
                     "document boundaries, which need more than 158 bytes, but the file has 158");
    expect_bad_index(dir, 161, 0, NULL, 0, "161 bytes, but the header's counts (7 sequences, 5 document boundaries) "
                     "need 158 (or 165 with multimodal sequence modes): the file is corrupt");
    expect_bad_index(dir, 118, 26, &zero, 8, "offset 26: expected at least 1 document boundary (0), found 0");
    expect_bad_index(dir, 0, 118, &one, 8, "offset 118: document boundary 0 is 1, expected 0 (the index is corrupt)");
    expect_bad_index(dir, 0, 134, &zero, 8, "offset 134: document boundary 2 is 0, expected a sequence index from 2 "
                     "to 7 (the index is corrupt)");
    expect_bad_index(dir, 0, 150, &six, 8, "offset 150: the last document boundary is 6, expected the sequence count "
                     "7 (the index is corrupt)");
    expect_bad_index(dir, 0, 46, &minus1, 4, "offset 46: sequence 3 has length -1, expected a length >= 0 (the index "
                     "is corrupt)");
    expect_bad_index(dir, 0, 78, &ptr, 8, "offset 78: sequence 2 starts at byte 999 of the .bin, expected 14 (where "
                     "the sequence before it ends; the index is corrupt)");

    /* a multimodal index (a mode byte per sequence after the boundaries) is accepted */
    size_t n, nb;
    unsigned char *idx = slurp(fixture("megatron_u16.idx"), &n), *bin = slurp(fixture("megatron_u16.bin"), &nb);
    unsigned char *longer = calloc(1, n + 7);
    memcpy(longer, idx, n);
    const char *prefix = pathf("%s/mm", dir);
    spit(pathf("%s.idx", prefix), longer, n + 7);
    spit(pathf("%s.bin", prefix), bin, nb);
    struct am_errors err;
    am_errors_init(&err);
    struct am_indexed *d;
    assert_int_equal(am_indexed_open(prefix, &d, &err), 0);
    am_indexed_close(d);
    /* a .bin that the index does not describe */
    spit(pathf("%s.bin", prefix), bin, 40);
    assert_int_equal(am_indexed_open(prefix, &d, &err), -1);
    expect_error(&err, "%s.bin: 40 bytes, but %s.idx describes 25 tokens of 2 bytes (50 bytes): the .bin and .idx do "
                 "not belong together, or one is truncated", prefix, prefix);
    unlink(pathf("%s.bin", prefix));
    assert_int_equal(am_indexed_open(prefix, &d, &err), -1);
    expect_error(&err, "%s.bin: cannot open: No such file or directory (build the dataset with am-data build --out "
                 "PREFIX)", prefix);
    free(idx);
    free(bin);
    free(longer);
    rm_tree(dir);
}

/* ---- am-data ------------------------------------------------------------------------------------ */

static int run(const char *cmd)
{
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static const char *am_data(void)
{
    const char *b = getenv("AM_BUILDDIR") ? getenv("AM_BUILDDIR") : ".";
    return pathf("%s/am-data", b);
}

static void test_am_data_bytes(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *prefix = pathf("%s/text", dir);
    assert_int_equal(run(pathf("'%s' build --bytes --out '%s' '%s' '%s' '%s' > '%s/out.txt'", am_data(), prefix,
                               fixture("paragraphs.txt"), fixture("single.txt"), fixture("empty.txt"), dir)), 0);
    size_t n1, n2, nb, no;
    unsigned char *a = slurp(fixture("paragraphs.txt"), &n1), *b = slurp(fixture("single.txt"), &n2);
    char *out = (char *)slurp(pathf("%s/out.txt", dir), &no);
    out[no] = '\0';
    assert_string_equal(out, pathf("%s.bin, %s.idx: 4 documents, dtype uint8\n", prefix, prefix));
    /* the tokens are the files' bytes, back to back */
    unsigned char *bin = slurp(pathf("%s.bin", prefix), &nb);
    assert_int_equal(nb, n1 + n2);
    assert_memory_equal(bin, a, n1);
    assert_memory_equal(bin + n1, b, n2);
    /* one document per paragraph; the blank lines (and the indentation of the next line)
     * end the paragraph before them */
    struct am_errors err;
    am_errors_init(&err);
    struct am_indexed *d;
    assert_int_equal(am_indexed_open(prefix, &d, &err), 0);
    assert_int_equal(am_indexed_documents(d), 4);
    const char *text = (const char *)a;
    int32_t second = (int32_t)(strstr(text, "Second") - text), third = (int32_t)(strstr(text, "Third") - text);
    assert_int_equal(am_indexed_length(d, 0), second);
    assert_int_equal(am_indexed_length(d, 1), third - second);
    assert_int_equal(am_indexed_length(d, 2), (int32_t)n1 - third);
    assert_int_equal(am_indexed_length(d, 3), (int32_t)n2);
    int32_t tok[8];
    assert_int_equal(am_indexed_read(d, 1, 0, 6, tok, &err), 0);
    assert_true(tok[0] == 'S' && tok[5] == 'd');
    am_indexed_close(d);
    /* info and sample */
    assert_int_equal(run(pathf("'%s' info '%s' > '%s/info.txt'", am_data(), prefix, dir)), 0);
    free(out);
    out = (char *)slurp(pathf("%s/info.txt", dir), &no);
    out[no] = '\0';
    assert_string_equal(out, pathf("%s: dtype uint8, 4 documents, 4 sequences, %zu tokens, token ids 10 to 121, "
                                   "longest sequence %zu\n", prefix, n1 + n2, n1 - (size_t)third));
    assert_int_equal(run(pathf("'%s' sample '%s' --seq-length 5 --no-shuffle --count 2 --text > '%s/s.txt'", am_data(),
                               prefix, dir)), 0);
    free(out);
    out = (char *)slurp(pathf("%s/s.txt", dir), &no);
    out[no] = '\0';
    assert_string_equal(out, "0: First \n1:  parag\n");
    free(out);
    free(a);
    free(b);
    free(bin);
    rm_tree(dir);
}

static char *run_err(const char *dir, const char *args, int want_status)
{
    assert_int_equal(run(pathf("'%s' %s 2> '%s/err.txt' > /dev/null", am_data(), args, dir)), want_status);
    size_t n;
    char *e = (char *)slurp(pathf("%s/err.txt", dir), &n);
    e[n] = '\0';
    return e;
}

static void test_am_data_tokens(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *prefix = pathf("%s/ids", dir);
    assert_int_equal(run(pathf("'%s' build --out '%s' '%s' > /dev/null", am_data(), prefix, fixture("tokens.txt"))), 0);
    struct am_errors err;
    am_errors_init(&err);
    struct am_indexed *d;
    assert_int_equal(am_indexed_open(prefix, &d, &err), 0);
    assert_int_equal(am_indexed_dtype(d), AM_IDX_U16); /* 300 > 255 */
    assert_int_equal(am_indexed_documents(d), 3);
    int32_t tok[8];
    assert_int_equal(am_indexed_read(d, 1, 0, 4, tok, &err), 0);
    assert_memory_equal(tok, ((const int32_t[]){4, 5, 6, 7}), 4 * sizeof(int32_t));
    assert_int_equal(am_indexed_read(d, 2, 0, 1, tok, &err), 0);
    assert_int_equal(tok[0], 300);
    am_indexed_close(d);
    /* the dtype follows the largest id */
    spit(pathf("%s/small.txt", dir), "0 255\n", 6);
    spit(pathf("%s/big.txt", dir), "70000 1\n2\n", 10);
    assert_int_equal(run(pathf("'%s' build --out '%s/s' '%s/small.txt' > /dev/null", am_data(), dir, dir)), 0);
    assert_int_equal(run(pathf("'%s' build --out '%s/b' '%s/big.txt' '%s/small.txt' > /dev/null", am_data(), dir, dir,
                               dir)), 0);
    assert_int_equal(am_indexed_open(pathf("%s/s", dir), &d, &err), 0);
    assert_int_equal(am_indexed_dtype(d), AM_IDX_U8);
    am_indexed_close(d);
    assert_int_equal(am_indexed_open(pathf("%s/b", dir), &d, &err), 0);
    assert_int_equal(am_indexed_dtype(d), AM_IDX_I32);
    assert_int_equal(am_indexed_documents(d), 3);
    assert_int_equal(am_indexed_read(d, 0, 0, 1, tok, &err), 0);
    assert_int_equal(tok[0], 70000);
    am_indexed_close(d);
    /* errors */
    spit(pathf("%s/bad.txt", dir), "1 2\n3 x4\n", 9);
    char *e = run_err(dir, pathf("build --out '%s/x' '%s/bad.txt'", dir, dir), 1);
    assert_string_equal(e, pathf("am-data: %s/bad.txt:2:3: unexpected 'x' (a token file holds decimal token ids "
                                 "separated by spaces, one document per line; use --bytes for text)\n", dir));
    free(e);
    assert_int_equal(count_entries(dir, "x."), 0); /* nothing half-written */
    spit(pathf("%s/large.txt", dir), "2147483648\n", 11);
    e = run_err(dir, pathf("build --out '%s/x' '%s/large.txt'", dir, dir), 1);
    assert_string_equal(e, pathf("am-data: %s/large.txt:1:10: token id too large (am's token ids are below 2^31)\n", dir));
    free(e);
    e = run_err(dir, pathf("build --out '%s/x' '%s/missing.txt'", dir, dir), 1);
    assert_string_equal(e, pathf("am-data: %s/missing.txt: cannot open: No such file or directory\n", dir));
    free(e);
    e = run_err(dir, pathf("build --out '%s/x' '%s'", dir, fixture("empty.txt")), 1);
    assert_string_equal(e, pathf("am-data: %s/x: the input files hold no tokens\n", dir));
    free(e);
    e = run_err(dir, "build --bytes", 2);
    assert_non_null(strstr(e, "am-data build: --out PREFIX is required\nusage: am-data build"));
    free(e);
    e = run_err(dir, pathf("info '%s/none'", dir), 1);
    assert_string_equal(e, pathf("am-data: %s/none.idx: cannot open: No such file or directory (build the dataset with "
                                 "am-data build --out PREFIX)\n", dir));
    free(e);
    e = run_err(dir, "frobnicate", 2);
    assert_non_null(strstr(e, "am-data: unknown command 'frobnicate'"));
    free(e);
    assert_int_equal(count_entries(dir, ".tmp-"), 0);
    rm_tree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_megatron_fixture),
        cmocka_unit_test(test_megatron_samples),
        cmocka_unit_test(test_samples_in_file_order),
        cmocka_unit_test(test_shuffle_properties),
        cmocka_unit_test(test_blend_shares),
        cmocka_unit_test(test_data_parallel_sharding),
        cmocka_unit_test(test_gpt_errors),
        cmocka_unit_test(test_recipe_config),
        cmocka_unit_test(test_corrupt_index),
        cmocka_unit_test(test_am_data_bytes),
        cmocka_unit_test(test_am_data_tokens),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
