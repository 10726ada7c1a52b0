/* test_schedule.c - the learning-rate schedule (optim.h) against values worked by hand from
 * Megatron's OptimizerParamScheduler, which AutoModel uses: linear warm-up from 0 over
 * lr_warmup_steps (step s gets max_lr * s / warmup while s <= warmup), then constant, linear
 * or cosine decay to min_lr at lr_decay_steps (default max_steps), min_lr after. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "optim.h"

static struct am_recipe *recipe(const char *style, const char *extra)
{
    char y[1024];
    snprintf(y, sizeof(y), "model:\n  hidden_size: 8\n  num_hidden_layers: 1\n  num_attention_heads: 1\n"
             "  intermediate_size: 8\n  vocab_size: 8\nstep_scheduler:\n  global_batch_size: 1\n"
             "  local_batch_size: 1\n  max_steps: 110\noptimizer:\n  lr: 1.0e-3\nlr_scheduler:\n"
             "  lr_decay_style: %s\n  lr_warmup_steps: 10\n  min_lr: 1.0e-4\n%s", style, extra);
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = am_recipe_parse("s.yaml", y, strlen(y), NULL, 0, &err);
    assert_int_equal(err.n, 0);
    am_errors_free(&err);
    return r;
}

static void test_warmup_then_constant(void **state)
{
    (void)state;
    struct am_recipe *r = recipe("constant", "");
    assert_float_equal(am_lr_at(r, 0), 0.0, 1e-15);
    assert_float_equal(am_lr_at(r, 5), 5e-4, 1e-15);
    assert_float_equal(am_lr_at(r, 10), 1e-3, 1e-15);
    assert_float_equal(am_lr_at(r, 109), 1e-3, 1e-15);
    am_recipe_free(r);
}

static void test_linear(void **state)
{
    (void)state;
    struct am_recipe *r = recipe("linear", "");
    /* decay over steps 10..110: at 60, halfway: min + 0.5 (max - min) */
    assert_float_equal(am_lr_at(r, 60), 1e-4 + 0.5 * 9e-4, 1e-15);
    assert_float_equal(am_lr_at(r, 110), 1e-4, 1e-15);
    assert_float_equal(am_lr_at(r, 500), 1e-4, 1e-15);
    am_recipe_free(r);
}

static void test_cosine(void **state)
{
    (void)state;
    struct am_recipe *r = recipe("cosine", "  lr_decay_steps: 60\n");
    /* decay over steps 10..60: a quarter of the way, coefficient (cos(pi/4) + 1) / 2 */
    assert_float_equal(am_lr_at(r, 22), 1e-4 + 0.5 * (cos(M_PI * 12.0 / 50.0) + 1.0) * 9e-4, 1e-15);
    assert_float_equal(am_lr_at(r, 35), 1e-4 + 0.5 * 9e-4, 1e-15);
    assert_float_equal(am_lr_at(r, 60), 1e-4, 1e-15);
    assert_float_equal(am_lr_at(r, 61), 1e-4, 1e-15);
    am_recipe_free(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_warmup_then_constant),
        cmocka_unit_test(test_linear),
        cmocka_unit_test(test_cosine),
    };
    return cmocka_run_group_tests_name("schedule", tests, NULL, NULL);
}
