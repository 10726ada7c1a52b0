/* test_flight.c - the flight recorder's ring, its dump, AM_FLIGHT_RECORDER_SIZE, the
 * async-signal-safe formatter (sigfmt.h) and the crash handler's cause line (crash.h). */
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "crash.h"
#include "flight.h"
#include "sigfmt.h"

/* ---- the formatter against printf ------------------------------------------------------- */

static const char *fmt_u64(uint64_t v, char *buf, size_t cap)
{
    struct am_sbuf b;
    am_sbuf_init(&b, buf, cap);
    am_sbuf_u64(&b, v);
    return buf;
}

static void test_integers(void **state)
{
    (void)state;
    char got[64], want[64];
    static const uint64_t u[] = {0, 1, 9, 10, 99, 100, 12345, 4294967295u, 4294967296ull, UINT64_MAX};
    for (size_t i = 0; i < sizeof(u) / sizeof(u[0]); i++) {
        snprintf(want, sizeof(want), "%llu", (unsigned long long)u[i]);
        assert_string_equal(fmt_u64(u[i], got, sizeof(got)), want);
    }
    static const int64_t s[] = {0, -1, 1, -42, INT64_MAX, INT64_MIN};
    for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); i++) {
        struct am_sbuf b;
        am_sbuf_init(&b, got, sizeof(got));
        am_sbuf_i64(&b, s[i]);
        snprintf(want, sizeof(want), "%lld", (long long)s[i]);
        assert_string_equal(got, want);
    }
    static const uint64_t h[] = {0, 0x10, 0xdeadbeef, UINT64_MAX};
    for (size_t i = 0; i < sizeof(h) / sizeof(h[0]); i++) {
        struct am_sbuf b;
        am_sbuf_init(&b, got, sizeof(got));
        am_sbuf_hex(&b, h[i]);
        snprintf(want, sizeof(want), "0x%llx", (unsigned long long)h[i]);
        assert_string_equal(got, want);
    }
}

static void test_fixed(void **state)
{
    (void)state;
    char got[64], want[64];
    static const double v[] = {0, 1, -1, 0.51, 0.26, 3.14159265, -2.71828, 1795996664.858432, 123456.0000004,
                               0.9999996, -0.0000001, 1e-9, 999999.9999999, 42.125};
    static const int dec[] = {0, 1, 3, 6, 9};
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++)
        for (size_t k = 0; k < sizeof(dec) / sizeof(dec[0]); k++) {
            struct am_sbuf b;
            am_sbuf_init(&b, got, sizeof(got));
            am_sbuf_fixed(&b, v[i], dec[k]);
            snprintf(want, sizeof(want), "%.*f", dec[k], v[i]);
            if (want[0] == '-') { /* printf keeps the sign of a value that rounds to zero; we drop it */
                int zero = 1;
                for (const char *p = want + 1; *p; p++)
                    zero &= *p == '0' || *p == '.';
                if (zero)
                    memmove(want, want + 1, strlen(want));
            }
            if (strcmp(got, want) != 0)
                fail_msg("%.10g with %d decimals: got %s, printf says %s", v[i], dec[k], got, want);
        }
    struct am_sbuf b;
    am_sbuf_init(&b, got, sizeof(got));
    am_sbuf_fixed(&b, 0.0 / 0.0, 3);
    am_sbuf_char(&b, ' ');
    am_sbuf_fixed(&b, 1.0 / 0.0, 3);
    am_sbuf_char(&b, ' ');
    am_sbuf_fixed(&b, 1e19, 3);
    assert_string_equal(got, "null null null");
}

static void test_json_string_and_overflow(void **state)
{
    (void)state;
    char got[64];
    struct am_sbuf b;
    am_sbuf_init(&b, got, sizeof(got));
    am_sbuf_json_str(&b, "a\"b\\c\nd\te\x01");
    assert_string_equal(got, "\"a\\\"b\\\\c\\nd\\te\\u0001\"");
    am_sbuf_init(&b, got, sizeof(got));
    am_sbuf_json_str(&b, NULL);
    assert_string_equal(got, "null");
    char small[8];
    am_sbuf_init(&b, small, sizeof(small));
    am_sbuf_str(&b, "0123456789");
    assert_int_equal(b.overflow, 1);
    assert_int_equal(b.len, 7);
    assert_string_equal(small, "0123456");
}

/* ---- the ring --------------------------------------------------------------------------- */

static uint64_t record(struct am_flight *f, uint64_t seq, int state)
{
    struct am_flight_op op = {.op = "allreduce", .dtype = "fp32", .redop = "sum", .group = "dp", .gid = 0,
                              .seq = seq, .count = 100 * seq, .bytes = 400 * seq, .peer = -1};
    uint64_t id = am_flight_begin(f, &op);
    am_flight_start(f, id);
    if (state != AM_FLIGHT_STARTED)
        am_flight_end(f, id, (enum am_flight_state)state);
    return id;
}

static void test_ring_wraps(void **state)
{
    (void)state;
    struct am_flight f;
    char err[256];
    assert_int_equal(am_flight_init(&f, 4, err, sizeof(err)), 0);
    struct am_flight_view v;
    assert_int_equal(am_flight_get(&f, 1, &v), 0); /* empty */
    assert_int_equal(am_flight_oldest_inflight(&f, &v), 0);
    for (uint64_t s = 1; s <= 6; s++)
        assert_int_equal(record(&f, s, AM_FLIGHT_COMPLETED), s);
    /* only the last 4 remain */
    assert_int_equal(am_flight_get(&f, 2, &v), 0);
    assert_int_equal(am_flight_get(&f, 3, &v), 1);
    assert_int_equal(v.seq, 3);
    assert_int_equal(v.count, 300);
    assert_string_equal(v.group, "dp");
    assert_int_equal(v.state, AM_FLIGHT_COMPLETED);
    assert_true(v.ended >= v.started && v.started >= v.enqueued && v.enqueued > 0);
    assert_int_equal(am_flight_get(&f, 7, &v), 0); /* not yet */
    /* one in flight, waiting for rank 3, then timed out by the watchdog */
    uint64_t id = record(&f, 7, AM_FLIGHT_STARTED);
    am_flight_waiting(&f, id, 3);
    assert_int_equal(am_flight_oldest_inflight(&f, &v), 1);
    assert_int_equal(v.id, id);
    assert_int_equal(v.waiting_for, 3);
    am_flight_mark_timed_out(&f, id);
    char line[768];
    size_t n = am_flight_format(&f, &v, line, sizeof(line));
    assert_true(n > 0 && line[n - 1] == '\n');
    assert_non_null(strstr(line, "\"state\":\"timed_out\""));
    assert_non_null(strstr(line, "\"waiting_for\":3"));
    assert_non_null(strstr(line, "\"ended\":null"));
    assert_non_null(strstr(line, "{\"type\":\"flight\",\"id\":7,\"group\":\"dp\",\"gid\":0,\"seq\":7,\"op\":\"allreduce\","
                                  "\"dtype\":\"fp32\",\"count\":700,\"bytes\":2800,\"redop\":\"sum\",\"peer\":null,"));
    am_flight_end(&f, id, AM_FLIGHT_COMPLETED);
    assert_int_equal(am_flight_oldest_inflight(&f, &v), 0);
    am_flight_free(&f);
}

static void test_dump(void **state)
{
    (void)state;
    struct am_flight f;
    char err[256], path[] = "/tmp/am-test-flight-XXXXXX", buf[65536];
    assert_int_equal(am_flight_init(&f, 8, err, sizeof(err)), 0);
    for (uint64_t s = 1; s <= 10; s++)
        record(&f, s, s == 10 ? AM_FLIGHT_FAILED : AM_FLIGHT_COMPLETED);
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(am_flight_dump(&f, fd), 8);
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    close(fd);
    unlink(path);
    assert_true(n > 0);
    buf[n] = '\0';
    int lines = 0;
    for (char *p = buf; *p; p++)
        lines += *p == '\n';
    assert_int_equal(lines, 8);
    assert_non_null(strstr(buf, "\"id\":3,"));   /* oldest kept */
    assert_null(strstr(buf, "\"id\":2,"));
    assert_non_null(strstr(buf, "\"seq\":10,\"op\":\"allreduce\""));
    assert_non_null(strstr(buf, "\"state\":\"failed\""));
    assert_int_equal(am_flight_dump(NULL, 1), 0);
    am_flight_free(&f);
}

static void test_size_from_env(void **state)
{
    (void)state;
    char err[512];
    size_t size = 0;
    unsetenv("AM_FLIGHT_RECORDER_SIZE");
    assert_int_equal(am_flight_size_from_env(&size, err, sizeof(err)), 0);
    assert_int_equal(size, AM_FLIGHT_DEFAULT_SIZE);
    setenv("AM_FLIGHT_RECORDER_SIZE", "64", 1);
    assert_int_equal(am_flight_size_from_env(&size, err, sizeof(err)), 0);
    assert_int_equal(size, 64);
    setenv("AM_FLIGHT_RECORDER_SIZE", "0", 1);
    assert_int_equal(am_flight_size_from_env(&size, err, sizeof(err)), -1);
    assert_string_equal(err, "AM_FLIGHT_RECORDER_SIZE=0: the flight recorder's size must be a whole number of entries "
                             "from 1 to 1048576 (for example AM_FLIGHT_RECORDER_SIZE=1024; unset for the default)");
    setenv("AM_FLIGHT_RECORDER_SIZE", "12k", 1);
    assert_int_equal(am_flight_size_from_env(&size, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "AM_FLIGHT_RECORDER_SIZE=12k: "));
    unsetenv("AM_FLIGHT_RECORDER_SIZE");
}

/* ---- the crash handler's cause line ------------------------------------------------------- */

static void test_crash_line(void **state)
{
    (void)state;
    char line[4096];
    size_t n = am_crash_format_signal(line, sizeof(line), 11, 1, (void *)0x10, 0, 0, 3, 4, 1767000000.25, NULL, 0);
    assert_string_equal(line, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":11,\"signal_name\":\"SIGSEGV\",\"code\":1,"
                              "\"code_name\":\"SEGV_MAPERR\",\"addr\":\"0x10\",\"sender_pid\":null,\"from\":\"kernel\","
                              "\"rank\":3,\"step\":4,\"time\":1767000000.250000,\"backtrace\":[]}\n");
    assert_int_equal(n, strlen(line));
    am_crash_format_signal(line, sizeof(line), 15, 0, NULL, 4242, 1, 0, 0, 1.5, NULL, 0);
    assert_non_null(strstr(line, "\"signal_name\":\"SIGTERM\",\"code\":0,\"code_name\":\"SI_USER\",\"addr\":null,"
                                 "\"sender_pid\":4242,\"from\":\"supervisor\",\"rank\":0,\"step\":null,"));
    /* frames: this function is named (the test is not -rdynamic: a module and an offset at least) */
    void *frames[2] = {(void *)test_crash_line, (void *)test_crash_line};
    am_crash_format_signal(line, sizeof(line), 6, -6, NULL, 1, 0, 0, 2, 1.5, frames, 2);
    assert_non_null(strstr(line, "\"backtrace\":[\"test_flight("));
    /* a line that cannot hold every frame still closes its JSON */
    char small[300];
    n = am_crash_format_signal(small, sizeof(small), 6, -6, NULL, 1, 0, 0, 2, 1.5, frames, 2);
    assert_true(n < sizeof(small));
    assert_string_equal(small + n - 3, "]}\n");
}

/* am_crash_leaving: a stop signal after it neither ends the process nor writes a cause record,
 * before am_crash_uninstall and after it */
static void test_crash_leaving(void **state)
{
    (void)state;
    char path[] = "/tmp/am-test-leaving-XXXXXX", err[256];
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    int log = open(path, O_WRONLY | O_APPEND);
    assert_true(log >= 0);
    assert_int_equal(am_crash_install(log, 0, NULL, err, sizeof(err)), 0);
    am_crash_leaving();
    raise(SIGTERM);
    raise(SIGINT);
    am_crash_uninstall();
    raise(SIGTERM);
    assert_int_equal(lseek(fd, 0, SEEK_END), 0); /* no cause record */
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    close(log);
    close(fd);
    unlink(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_integers),
        cmocka_unit_test(test_fixed),
        cmocka_unit_test(test_json_string_and_overflow),
        cmocka_unit_test(test_ring_wraps),
        cmocka_unit_test(test_dump),
        cmocka_unit_test(test_size_from_env),
        cmocka_unit_test(test_crash_line),
        cmocka_unit_test(test_crash_leaving),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
