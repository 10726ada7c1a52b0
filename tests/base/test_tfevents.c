/* test_tfevents.c - TensorBoard event files (tfevents.h): the bytes of a few events against
 * TensorBoard's own writer's (tests/base/scalars.tfevents, made by make_fixture.py), a file
 * written and read back by tfevents_dump's rules, and the errors. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "tfevents.h"
#include "util.h"

/* the events of make_fixture.py: keep the two in step */
static const struct am_tfscalar e1[] = {{"train/loss", 5.5451774}, {"train/lr", 3.0e-3}};
static const struct am_tfscalar e2[] = {
    {"train/loss", 4.25}, {"train/grad_norm", 1.0e-7}, {"train/tokens_per_s", 123456.0}, {"train/aux_loss", 0.0}};

static size_t append(uint8_t *out, size_t at, size_t cap, int64_t step, double wall, const struct am_tfscalar *v,
                     size_t n)
{
    size_t len = am_tfevents_record(NULL, 0, step, wall, "brain.Event:2", v, n);
    assert_true(at + len <= cap);
    assert_int_equal(am_tfevents_record(out + at, cap - at, step, wall, "brain.Event:2", v, n), len);
    return at + len;
}

static void test_fixture(void **state)
{
    (void)state;
    char path[4096], *want;
    size_t want_len;
    snprintf(path, sizeof path, "%s/tests/base/scalars.tfevents", getenv("AM_SRCDIR") ? getenv("AM_SRCDIR") : ".");
    assert_null(am_read_file(path, 1 << 20, &want, &want_len));
    char tag[256] = "a/";
    memset(tag + 2, 'x', 200);
    struct am_tfscalar e3[] = {{tag, -2.5}};
    uint8_t got[4096];
    size_t n = append(got, 0, sizeof got, 0, 1700000000.25, NULL, 0);
    n = append(got, n, sizeof got, 1, 1700000001.5, e1, 2);
    n = append(got, n, sizeof got, 2, 1700000002.75, e2, 4);
    n = append(got, n, sizeof got, 300, 1700000003.0, e3, 1);
    assert_int_equal(n, want_len);
    assert_memory_equal(got, want, n);
    free(want);
}

/* a record that does not fit is not written: its length comes back */
static void test_record_cap(void **state)
{
    (void)state;
    uint8_t out[16];
    memset(out, 0xab, sizeof out);
    size_t len = am_tfevents_record(out, sizeof out, 1, 1.0, NULL, e1, 2);
    assert_true(len > sizeof out);
    for (size_t i = 0; i < sizeof out; i++)
        assert_int_equal(out[i], 0xab);
}

/* the framing: length, masked crc of the length, data, masked crc of the data */
static void test_framing(void **state)
{
    (void)state;
    uint8_t out[256];
    size_t len = am_tfevents_record(out, sizeof out, 7, 2.0, NULL, e1, 1);
    uint64_t dlen = 0;
    for (int i = 7; i >= 0; i--)
        dlen = dlen << 8 | out[i];
    assert_int_equal(dlen + 16, len);
    uint32_t c = am_crc32c(0, out + 12, dlen), m = ((c >> 15) | (c << 17)) + 0xa282ead8u;
    assert_memory_equal(out + 12 + dlen, &m, 4); /* little-endian machine */
    /* a flipped data byte no longer matches */
    out[20] ^= 1;
    c = am_crc32c(0, out + 12, dlen);
    m = ((c >> 15) | (c << 17)) + 0xa282ead8u;
    assert_memory_not_equal(out + 12 + dlen, &m, 4);
}

static void test_file(void **state)
{
    (void)state;
    char dir[] = "/tmp/am-tfevents-XXXXXX", sub[256], err[512];
    assert_non_null(mkdtemp(dir));
    snprintf(sub, sizeof sub, "%s/a/b", dir);
    struct am_tfevents w;
    assert_int_equal(am_tfevents_open(&w, sub, "node1", 1700000000.0, err, sizeof err), 0);
    assert_int_equal(am_tfevents_scalars(&w, 1, 1700000001.0, e1, 2, err, sizeof err), 0);
    char want[512];
    snprintf(want, sizeof want, "%s/events.out.tfevents.1700000000.node1.%ld", sub, (long)getpid());
    assert_string_equal(w.path, want);
    am_tfevents_close(&w);
    assert_int_equal(w.fd, -1);
    char *data;
    size_t len;
    assert_null(am_read_file(want, 1 << 20, &data, &len));
    size_t l0 = am_tfevents_record(NULL, 0, 0, 1700000000.0, "brain.Event:2", NULL, 0);
    size_t l1 = am_tfevents_record(NULL, 0, 1, 1700000001.0, NULL, e1, 2);
    assert_int_equal(len, l0 + l1);
    free(data);
    unlink(want);
    am_remove_tree(dir);
    /* a directory that cannot be made: the path and the reason */
    assert_int_equal(am_tfevents_open(&w, "/proc/am-no/tb", "h", 1.0, err, sizeof err), -1);
    assert_int_equal(w.fd, -1);
    assert_true(strncmp(err, "/proc/am-no/tb: cannot create the TensorBoard directory: ", 57) == 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture),
        cmocka_unit_test(test_record_cap),
        cmocka_unit_test(test_framing),
        cmocka_unit_test(test_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
