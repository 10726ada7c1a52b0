/* testutil.h - what the cmocka tests share: cmocka with the headers it needs, and the check of
 * a list of error messages (am_errors) against the exact expected ones. Included by path
 * ("../testutil.h") from a test's folder. */
#ifndef AM_TESTUTIL_H
#define AM_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "errors.h"

/* Asserts that err holds exactly the expected messages (NULL-terminated), in order. */
static inline void assert_messages(const struct am_errors *err, const char *const *expected)
{
    size_t n = 0;
    while (expected[n])
        n++;
    for (size_t i = 0; i < err->n || i < n; i++) {
        const char *got = i < err->n ? err->msg[i] : "(none)";
        const char *want = i < n ? expected[i] : "(none)";
        if (strcmp(got, want) != 0) {
            print_error("message %zu:\n  got:  %s\n  want: %s\n", i, got, want);
            fail();
        }
    }
}

#endif
