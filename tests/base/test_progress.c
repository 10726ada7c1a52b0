/* test_progress.c - the progress line (progress.h): what it draws at the end, with and
 * without a total and an item count, and that it draws nothing when off or when a failed
 * job never showed it; the program options. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "progress.h"

/* runs start, set (done, items), end (ok) into a string */
static char *line(const char *items, uint64_t total, uint64_t done, uint64_t n_items, bool on, bool ok)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    struct am_progress p;
    am_progress_start(&p, "am-x", items, total, on);
    p.out = f;
    am_progress_set(&p, 0, 0);
    am_progress_set(&p, done, n_items);
    am_progress_end(&p, ok);
    fclose(f);
    return buf;
}

static void test_end(void **state)
{
    (void)state;
    char *s = line(NULL, 2500000000u, 2500000000u, 0, true, true);
    assert_true(strncmp(s, "\ram-x: 100.0%  2.50 GB of 2.50 GB  ", 35) == 0);
    assert_non_null(strstr(s, "B/s \n"));
    assert_null(strstr(s, "left")); /* done: no time left */
    free(s);
    s = line("tokens", 3000000, 3000000, 1500000, true, true);
    assert_true(strncmp(s, "\ram-x: 100.0%  3.0 MB of 3.0 MB  ", 33) == 0);
    assert_non_null(strstr(s, "  1.50M tokens  "));
    free(s);
    s = line(NULL, 0, 4000, 0, true, true); /* no total: no percentage */
    assert_true(strncmp(s, "\ram-x: 4 kB  ", 13) == 0);
    free(s);
}

static void test_off(void **state)
{
    (void)state;
    char *s = line(NULL, 100, 100, 0, false, true);
    assert_string_equal(s, "");
    free(s);
    s = line(NULL, 100, 50, 0, true, false); /* failed before its first draw: nothing */
    assert_string_equal(s, "");
    free(s);
}

static void test_option(void **state)
{
    (void)state;
    assert_int_equal(am_progress_option("--progress"), 1);
    assert_int_equal(am_progress_option("--quiet"), 0);
    assert_int_equal(am_progress_option("--no-progress"), 0);
    assert_int_equal(am_progress_option("--progres"), -1);
    assert_int_equal(am_progress_option("x"), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_end),
        cmocka_unit_test(test_off),
        cmocka_unit_test(test_option),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
