/* testutil.h - helpers shared by the cmocka tests of the recipe library. */
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
#include "plan.h"
#include "recipe.h"

/* Parses `yaml` (named name) with overrides given as "path=value" strings; each override's
 * origin is "--set path=value", as am-plan writes it. */
static inline struct am_recipe *parse_with(const char *name, const char *yaml, const char *const *sets,
                                           struct am_errors *err)
{
    struct am_override ov[16];
    static char buf[16][512], origin[16][600];
    size_t n = 0;
    for (; sets && sets[n]; n++) {
        snprintf(buf[n], sizeof(buf[n]), "%s", sets[n]);
        snprintf(origin[n], sizeof(origin[n]), "--set %s", sets[n]);
        assert_int_equal(am_override_parse(buf[n], &ov[n]), 0);
        ov[n].origin = origin[n];
    }
    return am_recipe_parse(name, yaml, strlen(yaml), ov, n, err);
}

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
