/* fuzz_recipe.c - libFuzzer target for the recipe library: parse, override, validate, plan.
 *
 * Input: an optional first line "S:path=value" (an override, as --set or --am-tp give),
 * then the recipe text. The world size and GPU memory come from the input's first bytes,
 * so the planner is driven too. Any crash, leak, hang or sanitizer report is a bug. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "recipe.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = malloc(size + 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    char *text = buf;
    struct am_override ov = {0};
    size_t n_ov = 0;
    if (size > 2 && buf[0] == 'S' && buf[1] == ':') {
        char *nl = strchr(buf, '\n');
        if (nl) {
            *nl = '\0';
            text = nl + 1;
            if (am_override_parse(buf + 2, &ov) == 0) {
                ov.origin = "--set fuzz";
                n_ov = 1;
            }
        }
    }
    size_t len = size - (size_t)(text - buf);
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = am_recipe_parse("fuzz.yaml", text, strnlen(text, len), &ov, n_ov, &err);
    if (r && err.n == 0) {
        am_validate(r, NULL, &err);
        int gpn = size ? 1 + data[0] % 16 : 8;
        int nodes = size > 1 ? 1 + data[1] % 8 : 1;
        struct am_world w = {.size = gpn * nodes, .nodes = nodes, .gpus_per_node = gpn, .nvlink_domain = gpn,
                             .gpu_mem = 1e6};
        struct am_plan p;
        if (am_plan_build(r, &w, &p, &err) == 0) {
            am_plan_check_memory(r, &w, &p, &err);
            int members[16 * 8];
            for (int g = 0; g < AM_NGROUPS; g++)
                am_plan_group(&p, (enum am_group)g, p.world - 1, members);
        }
        am_plan_free(&p);
    }
    am_recipe_free(r);
    am_errors_free(&err);
    free(buf);
    return 0;
}
