/* test_boot_join.c - what the TCP boot server admits of a decoded munge credential
 * (am_join_check, boot_join.h): the payload the ranks make, and every refusal with its exact
 * reason. munged itself is exercised on the local cluster (test-srun-none.sh). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "boot_join.h"

static const struct am_join_expect x = {.job = 42, .step = 3, .size = 8, .server = "n1:20000", .uid = 1000};

static void refused(const char *payload, unsigned uid, const char *want)
{
    char why[256] = "";
    assert_int_equal(am_join_check(&x, payload, strlen(payload), uid, why, sizeof(why)), -1);
    assert_string_equal(why, want);
}

static void test_admitted(void **state)
{
    (void)state;
    char payload[256], why[256];
    am_join_payload(&x, 5, payload, sizeof(payload));
    assert_string_equal(payload, "am-join job=42 step=3 rank=5 server=n1:20000");
    assert_int_equal(am_join_check(&x, payload, strlen(payload), 1000, why, sizeof(why)), 5);
}

static void test_refused(void **state)
{
    (void)state;
    refused("am-join job=42 step=3 rank=5 server=n1:20000", 0,
            "the credential was made by uid 0, not by the job's user (uid 1000)");
    refused("am-join job=43 step=3 rank=5 server=n1:20000", 1000,
            "the credential is for step 43.3, not this step 42.3");
    refused("am-join job=42 step=4 rank=5 server=n1:20000", 1000,
            "the credential is for step 42.4, not this step 42.3");
    refused("am-join job=42 step=3 rank=5 server=n2:20000", 1000,
            "the credential is for the boot server n2:20000, not this one (n1:20000)");
    refused("am-join job=42 step=3 rank=8 server=n1:20000", 1000,
            "the credential names rank 8, but the step has ranks 0 to 7");
    refused("am-join job=42 step=3 rank=-1 server=n1:20000", 1000,
            "the credential names rank -1, but the step has ranks 0 to 7");
    refused("hello", 1000, "the credential's payload is not an am-launch join (5 bytes)");
    refused("am-join job=42 step=3 rank=5 server=n1:20000 extra", 1000,
            "the credential's payload is not an am-launch join (50 bytes)");
    char why[256];
    assert_int_equal(am_join_check(&x, "am-join job=42\0x", 16, 1000, why, sizeof(why)), -1);
    assert_int_equal(am_join_check(&x, NULL, 0, 1000, why, sizeof(why)), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_admitted), cmocka_unit_test(test_refused)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
