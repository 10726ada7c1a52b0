/* test_pack.c - packed sequences (runtime/data/pack.h): whole documents packed as NeMo AutoModel
 * packs its samples. Seven documents of 5, 3, 9, 2, 1, 7 and 4 tokens (token j of document d
 * is 100 d + j; document 4 has no row) in packs of 8 rows. The expected packs are what
 * AutoModel's own pack_dataset (thd) and neat_pack_dataset (neat) make of the same samples
 * (input_ids = tokens[:-1], labels = tokens[1:]; numpy's RandomState(1234).shuffle for the
 * shuffled order, [2, 1, 6, 0, 4, 5, 3]), printed by tests/data/fixtures/automodel_packs.py
 * from AutoModel's packed_sequence.py and neat_packing.py (commit 36044ad3): rows, targets (-100
 * there, -1 here) and pads alike. starts are am's (the model's masks). */
#include "../ckpt/testio.h"
#include "dataset.h"
#include "pack.h"

static const int64_t lens[] = {5, 3, 9, 2, 1, 7, 4};

/* PREFIX with the seven documents; with mask, PREFIX.mask beside it: token j's mask j >= 2. */
static void build_docs(const char *prefix, bool mask)
{
    struct am_errors err;
    am_errors_init(&err);
    for (int m = 0; m < 1 + mask; m++) {
        struct am_indexed_builder *b;
        assert_int_equal(am_indexed_builder_open(m ? pathf("%s.mask", prefix) : prefix, m ? AM_IDX_U8 : AM_IDX_I32, &b,
                                                 &err), 0);
        for (int d = 0; d < 7; d++) {
            int64_t tok[16];
            for (int64_t j = 0; j < lens[d]; j++)
                tok[j] = m ? j >= 2 : 100 * d + j;
            assert_int_equal(am_indexed_builder_add(b, tok, (size_t)lens[d], &err), 0);
            assert_int_equal(am_indexed_builder_end_document(b, &err), 0);
        }
        assert_int_equal(am_indexed_builder_finish(b, &err), 0);
    }
    expect_no_error(&err);
}

static struct am_packs *open_packs(const char *prefix, bool neat, bool shuffle, int64_t max_packs)
{
    struct am_pack_config c = {prefix, 8, neat, true, shuffle, 1234, max_packs};
    struct am_errors err;
    am_errors_init(&err);
    struct am_packs *p = NULL;
    assert_int_equal(am_packs_open(&c, &p, &err), 0);
    expect_no_error(&err);
    return p;
}

/* Pack i's rows against the expected ids and labels (-100: none; pads have id 0, label -100). */
static void expect_pack(const struct am_packs *p, int64_t i, const int32_t ids[8], const int32_t labels[8],
                        const int32_t starts[8])
{
    int32_t tok[8], tgt[8], st[8];
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_packs_read(p, i, tok, tgt, st, &err), 0);
    expect_no_error(&err);
    for (int k = 0; k < 8; k++) {
        if (tok[k] != ids[k] || tgt[k] != (labels[k] < 0 ? -1 : labels[k]) || st[k] != starts[k])
            fail_msg("pack %lld row %d: token %d target %d start %d, want %d %d %d", (long long)i, k, tok[k], tgt[k],
                     st[k], ids[k], labels[k], starts[k]);
    }
}

#define ROW(...) ((const int32_t[8]){__VA_ARGS__})

static void test_thd(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *prefix = pathf("%s/docs", dir);
    build_docs(prefix, false);
    struct am_packs *p = open_packs(prefix, false, false, 0);
    assert_int_equal(am_packs_count(p), 4);
    assert_int_equal(am_packs_dropped(p), 0);
    assert_false(am_packs_masked(p));
    expect_pack(p, 0, ROW(0, 1, 2, 3, 100, 101, 0, 0), ROW(1, 2, 3, 4, 101, 102, -100, -100), ROW(0, 0, 0, 0, 4, 4, 6, 6));
    expect_pack(p, 1, ROW(200, 201, 202, 203, 204, 205, 206, 207), ROW(201, 202, 203, 204, 205, 206, 207, 208),
                ROW(0, 0, 0, 0, 0, 0, 0, 0));
    expect_pack(p, 2, ROW(300, 500, 501, 502, 503, 504, 505, 0), ROW(301, 501, 502, 503, 504, 505, 506, -100),
                ROW(0, 1, 1, 1, 1, 1, 1, 7));
    expect_pack(p, 3, ROW(600, 601, 602, 0, 0, 0, 0, 0), ROW(601, 602, 603, -100, -100, -100, -100, -100),
                ROW(0, 0, 0, 3, 3, 3, 3, 3));
    /* the run's sample i is pack i % count: the next epoch walks the packs again */
    expect_pack(p, 5, ROW(200, 201, 202, 203, 204, 205, 206, 207), ROW(201, 202, 203, 204, 205, 206, 207, 208),
                ROW(0, 0, 0, 0, 0, 0, 0, 0));
    /* the rows the documents fill, before the pads (AutoModel's sum of seq_lens) */
    const int64_t rows[] = {6, 8, 7, 3};
    for (int64_t i = 0; i < 8; i++)
        assert_int_equal(am_packs_rows(p, i), rows[i % 4]);
    am_packs_close(p);
    /* shuffled first */
    p = open_packs(prefix, false, true, 0);
    assert_int_equal(am_packs_count(p), 4);
    expect_pack(p, 0, ROW(200, 201, 202, 203, 204, 205, 206, 207), ROW(201, 202, 203, 204, 205, 206, 207, 208),
                ROW(0, 0, 0, 0, 0, 0, 0, 0));
    expect_pack(p, 1, ROW(100, 101, 600, 601, 602, 0, 0, 0), ROW(101, 102, 601, 602, 603, -100, -100, -100),
                ROW(0, 0, 2, 2, 2, 5, 5, 5));
    expect_pack(p, 2, ROW(0, 1, 2, 3, 0, 0, 0, 0), ROW(1, 2, 3, 4, -100, -100, -100, -100), ROW(0, 0, 0, 0, 4, 4, 4, 4));
    expect_pack(p, 3, ROW(500, 501, 502, 503, 504, 505, 300, 0), ROW(501, 502, 503, 504, 505, 506, 301, -100),
                ROW(0, 0, 0, 0, 0, 0, 6, 7));
    am_packs_close(p);
    /* max_packs: the first packs only */
    p = open_packs(prefix, false, false, 2);
    assert_int_equal(am_packs_count(p), 2);
    am_packs_close(p);
    rm_tree(dir);
}

static void test_neat(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *prefix = pathf("%s/docs", dir);
    build_docs(prefix, false);
    for (int shuffle = 0; shuffle < 2; shuffle++) { /* the same packs: ties of length are not met here */
        struct am_packs *p = open_packs(prefix, true, shuffle, 0);
        assert_int_equal(am_packs_count(p), 3);
        expect_pack(p, 0, ROW(200, 201, 202, 203, 204, 205, 206, 207), ROW(201, 202, 203, 204, 205, 206, 207, 208),
                    ROW(0, 0, 0, 0, 0, 0, 0, 0));
        expect_pack(p, 1, ROW(500, 501, 502, 503, 504, 505, 100, 101), ROW(501, 502, 503, 504, 505, 506, 101, 102),
                    ROW(0, 0, 0, 0, 0, 0, 6, 6));
        expect_pack(p, 2, ROW(0, 1, 2, 3, 600, 601, 602, 300), ROW(1, 2, 3, 4, 601, 602, 603, 301),
                    ROW(0, 0, 0, 0, 4, 4, 4, 7));
        const int64_t *docs;
        assert_int_equal(am_packs_docs(p, 2, &docs), 3);
        assert_true(docs[0] == 0 && docs[1] == 6 && docs[2] == 3);
        for (int64_t i = 0; i < 3; i++) /* full packs: no pad */
            assert_int_equal(am_packs_rows(p, i), 8);
        am_packs_close(p);
    }
    rm_tree(dir);
}

/* a loss mask beside the data: the masked targets are -1 (AutoModel: labels -100 where
 * loss_mask is 0) */
static void test_mask(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *prefix = pathf("%s/docs", dir);
    build_docs(prefix, true);
    struct am_packs *p = open_packs(prefix, false, false, 0);
    assert_true(am_packs_masked(p));
    expect_pack(p, 0, ROW(0, 1, 2, 3, 100, 101, 0, 0), ROW(-100, 2, 3, 4, -100, 102, -100, -100),
                ROW(0, 0, 0, 0, 4, 4, 6, 6));
    expect_pack(p, 2, ROW(300, 500, 501, 502, 503, 504, 505, 0), ROW(-100, -100, 502, 503, 504, 505, 506, -100),
                ROW(0, 1, 1, 1, 1, 1, 1, 7));
    am_packs_close(p);
    rm_tree(dir);
}

/* documents longer than a pack: dropped (counted), or refused with drop_long_samples false;
 * nothing that fits: refused */
static void test_long_documents(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *prefix = pathf("%s/docs", dir);
    build_docs(prefix, false);
    struct am_pack_config c = {prefix, 6, false, true, false, 0, 0};
    struct am_errors err;
    am_errors_init(&err);
    struct am_packs *p = NULL;
    assert_int_equal(am_packs_open(&c, &p, &err), 0);
    expect_no_error(&err);
    assert_int_equal(am_packs_dropped(p), 1); /* 9 tokens: 8 rows; 7 tokens are 6 rows, which fit */
    am_packs_close(p);
    c.drop_long = false;
    assert_int_equal(am_packs_open(&c, &p, &err), -1);
    expect_error(&err, "%s: document 2 has 9 tokens, 8 rows, longer than a pack of packed_sequence_size 6 (raise it, "
                 "or drop such documents with packed_sequence.drop_long_samples: true)", prefix);
    c.drop_long = true;
    c.size = 0;
    assert_int_equal(am_packs_open(&c, &p, &err), -1);
    expect_error(&err, "%s: no pack: none of its 7 documents has 2 tokens or more and fits a pack of 0 rows (6 longer "
                 "ones dropped)", prefix);
    rm_tree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_thd),
        cmocka_unit_test(test_neat),
        cmocka_unit_test(test_mask),
        cmocka_unit_test(test_long_documents),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
