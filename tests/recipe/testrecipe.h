/* testrecipe.h - helpers of the recipe library's cmocka tests: a recipe parsed with overrides
 * as am-plan gives them (and, from testutil.h, the exact check of error messages). */
#ifndef AM_TESTRECIPE_H
#define AM_TESTRECIPE_H

#include "../testutil.h"
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

#endif
