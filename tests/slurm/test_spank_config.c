/* test_spank_config.c - the plugin's pure parts: plugstack.conf arguments (spank/config.c),
 * option values (am_setting_parse in spank/options.c) and the text helpers (spank/text.c).
 * The few Slurm functions options.c calls are stubbed below; nothing here needs Slurm. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "config.h"
#include "options.h"
#include "text.h"

/* ---- stubs for the Slurm symbols options.c references ---- */
spank_err_t spank_option_register(spank_t sp, struct spank_option *opt)
{
    (void)sp;
    (void)opt;
    return ESPANK_SUCCESS;
}
const char *spank_strerror(spank_err_t err)
{
    (void)err;
    return "stub";
}
void slurm_error(const char *fmt, ...)
{
    (void)fmt;
}

/* ---- plugstack.conf arguments ---- */

static int parse(struct am_config *c, char *err, size_t len, ...)
{
    char *av[64];
    int ac = 0;
    va_list ap;
    va_start(ap, len);
    for (char *a; (a = va_arg(ap, char *)) && ac < 64;)
        av[ac++] = a;
    va_end(ap);
    am_config_init(c);
    err[0] = '\0';
    return am_config_parse(c, ac, av, err, len);
}

static void config_defaults(void **state)
{
    (void)state;
    struct am_config c;
    char err[1024];
    assert_int_equal(parse(&c, err, sizeof(err), NULL), 0);
    assert_int_equal(c.gpus_per_node, 0);
    assert_int_equal(c.nvlink_domain, 0);
    assert_true(c.gpu_mem == 0);
    /* the installed recipes: PREFIX/share/am/recipes, configure's prefix */
    assert_string_equal(c.recipe_path, AM_RECIPES_DIR);
    assert_true(c.recipe_path == am_config_recipes);
    size_t n = strlen(c.recipe_path), tail = strlen("/share/am/recipes");
    assert_true(c.recipe_path[0] == '/' && n > tail);
    assert_string_equal(c.recipe_path + n - tail, "/share/am/recipes");
    assert_null(c.log_root);
    assert_int_equal(c.n_env, 0);
    assert_true(c.sbatch);
}

static void config_every_key(void **state)
{
    (void)state;
    struct am_config c;
    char err[1024];
    assert_int_equal(parse(&c, err, sizeof(err), "gpus_per_node=8", "nvlink_domain=72", "gpu_mem=80G",
                           "recipe_path=/shared/recipes:/opt/am/recipes", "log_root=/shared/logs",
                           "env=NCCL_IB_HCA=mlx5_0,mlx5_1", "env=UCX_TLS=rc,sm", "sbatch=0", NULL),
                     0);
    assert_string_equal(err, "");
    assert_int_equal(c.gpus_per_node, 8);
    assert_int_equal(c.nvlink_domain, 72);
    assert_true(c.gpu_mem == 80.0 * 1024 * 1024 * 1024);
    assert_string_equal(c.recipe_path, "/shared/recipes:/opt/am/recipes");
    assert_string_equal(c.log_root, "/shared/logs");
    assert_int_equal(c.n_env, 2);
    assert_string_equal(c.env[0], "NCCL_IB_HCA=mlx5_0,mlx5_1");
    assert_string_equal(c.env[1], "UCX_TLS=rc,sm");
    assert_false(c.sbatch);
}

static void config_unknown_key(void **state)
{
    (void)state;
    struct am_config c;
    char err[1024];
    assert_int_equal(parse(&c, err, sizeof(err), "gpus_per_node=8", "gpus=8", NULL), -1);
    assert_string_equal(err, "plugstack.conf argument 'gpus=8': unknown key 'gpus' (valid keys: gpus_per_node, "
                             "nvlink_domain, gpu_mem, recipe_path, log_root, env, sbatch)");
    assert_int_equal(parse(&c, err, sizeof(err), "verbose", NULL), -1);
    assert_string_equal(err, "plugstack.conf argument 'verbose': expected KEY=VALUE (valid keys: gpus_per_node, "
                             "nvlink_domain, gpu_mem, recipe_path, log_root, env, sbatch)");
}

static void config_bad_values(void **state)
{
    (void)state;
    struct am_config c;
    char err[1024];
    static const struct {
        const char *arg, *msg;
    } cases[] = {
        {"gpus_per_node=0", "plugstack.conf argument 'gpus_per_node=0': gpus_per_node must be a whole number from 1 "
                            "to 65536 (GPUs; for example 8)"},
        {"gpus_per_node=-8", NULL},
        {"gpus_per_node=8x", NULL},
        {"gpus_per_node=", NULL},
        {"gpus_per_node=99999999999999999999", NULL},
        {"nvlink_domain=abc", "plugstack.conf argument 'nvlink_domain=abc': nvlink_domain must be a whole number from "
                              "1 to 65536 (GPUs; for example 8)"},
        {"gpu_mem=lots", "plugstack.conf argument 'gpu_mem=lots': gpu_mem must be a memory size such as 80G or "
                         "141GiB"},
        {"gpu_mem=0", NULL},
        {"gpu_mem=inf", NULL},
        {"gpu_mem=nan", NULL},
        {"gpu_mem=80X", NULL},
        {"gpu_mem=-1G", NULL},
        {"recipe_path=relative/dir", "plugstack.conf argument 'recipe_path=relative/dir': recipe_path must be "
                                     "absolute directories separated by ':' (for example "
                                     "recipe_path=/shared/am/recipes:/opt/am/recipes)"},
        {"recipe_path=/a::/b", NULL},
        {"recipe_path=", NULL},
        {"log_root=logs", "plugstack.conf argument 'log_root=logs': log_root must be an absolute directory (for "
                          "example log_root=/shared/am/logs)"},
        {"env=NCCL_IB_HCA", "plugstack.conf argument 'env=NCCL_IB_HCA': env takes NAME=VALUE, one variable per env= "
                            "argument (for example env=NCCL_IB_HCA=mlx5_0,mlx5_1 env=UCX_TLS=rc,sm)"},
        {"env==x", NULL},
        {"env=1X=y", NULL},
        {"env=A-B=y", NULL},
        {"env=AM_TP=8", "plugstack.conf argument 'env=AM_TP=8': env cannot set AM_* or SLURM_* variables: the plugin "
                        "and Slurm own them (set the site's NCCL_*, UCX_* or other defaults here)"},
        {"env=SLURM_CONF=/x", NULL},
        {"sbatch=yes", "plugstack.conf argument 'sbatch=yes': sbatch must be 1 (check recipes in sbatch and salloc, "
                       "the default) or 0 (check them in srun only)"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        assert_int_equal(parse(&c, err, sizeof(err), cases[i].arg, NULL), -1);
        if (cases[i].msg)
            assert_string_equal(err, cases[i].msg);
        else
            assert_non_null(strstr(err, "plugstack.conf argument '"));
    }
}

static void config_repeats(void **state)
{
    (void)state;
    struct am_config c;
    char err[1024];
    assert_int_equal(parse(&c, err, sizeof(err), "gpus_per_node=8", "gpus_per_node=4", NULL), -1);
    assert_string_equal(err, "plugstack.conf argument 'gpus_per_node=4': gpus_per_node is given twice (keep one)");
    assert_int_equal(parse(&c, err, sizeof(err), "env=A=1", "env=A=2", NULL), -1);
    assert_string_equal(err, "plugstack.conf argument 'env=A=2': env sets this variable a second time (keep one "
                             "env= argument per variable)");
    /* A is not a prefix match of AB */
    assert_int_equal(parse(&c, err, sizeof(err), "env=AB=1", "env=A=2", NULL), 0);
    char *many[AM_CONFIG_MAX_ENV + 1];
    char buf[AM_CONFIG_MAX_ENV + 1][32];
    for (int i = 0; i <= AM_CONFIG_MAX_ENV; i++) {
        snprintf(buf[i], sizeof(buf[i]), "env=V%d=1", i);
        many[i] = buf[i];
    }
    am_config_init(&c);
    assert_int_equal(am_config_parse(&c, AM_CONFIG_MAX_ENV, many, err, sizeof(err)), 0);
    am_config_init(&c);
    assert_int_equal(am_config_parse(&c, AM_CONFIG_MAX_ENV + 1, many, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "more than 32 env= arguments"));
}

static void config_hostile(void **state)
{
    (void)state;
    struct am_config c;
    char err[1024];
    size_t n = 100 * 1024;
    char *big = malloc(n + 1);
    assert_non_null(big);
    memset(big, 'k', n);
    big[n] = '\0';
    assert_int_equal(parse(&c, err, sizeof(err), big, NULL), -1);
    assert_true(strlen(err) < 400);
    assert_non_null(strstr(err, "...(102400 bytes)"));
    memcpy(big, "log_root=/", 10);
    assert_int_equal(parse(&c, err, sizeof(err), big, NULL), -1);
    assert_true(strlen(err) < 400);
    free(big);
    char binary[] = "env=X=\xff\xfe\x01\x1b[2J";
    assert_int_equal(parse(&c, err, sizeof(err), binary, NULL), 0); /* an admin's value is taken as is */
    char badkey[] = "\xff\x1b[31m=1";
    assert_int_equal(parse(&c, err, sizeof(err), badkey, NULL), -1);
    assert_string_equal(err, "plugstack.conf argument '\\xff\\x1b[31m=1': unknown key '\\xff\\x1b[31m' (valid keys: "
                             "gpus_per_node, nvlink_domain, gpu_mem, recipe_path, log_root, env, sbatch)");
    char *null_arg[] = {NULL};
    am_config_init(&c);
    assert_int_equal(am_config_parse(&c, 1, null_arg, err, sizeof(err)), -1);
}

/* ---- option values ---- */

static void option_counts(void **state)
{
    (void)state;
    static struct am_setting s; /* large: not on the stack */
    am_setting_parse(AM_OPT_TP, "8", false, &s);
    assert_true(s.given && !s.bad && !s.from_env);
    assert_int_equal(s.num, 8);
    assert_string_equal(s.shown, "--am-tp=8");
    am_setting_parse(AM_OPT_PP, "1048576", true, &s);
    assert_false(s.bad);
    assert_string_equal(s.shown, "AM_PP=1048576");
    static const char *const bad[] = {"abc", "-1", "", "0", "+2", " 2", "2 ", "1048577", "8x", "0x8",
                                      "99999999999999999999999", "2.0", "1e3"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        am_setting_parse(AM_OPT_TP, bad[i], false, &s);
        assert_true(s.bad);
        assert_string_equal(s.why, "the tensor-parallel size must be a whole number from 1 to 1048576 (for example "
                                   "--am-tp=8)");
    }
    am_setting_parse(AM_OPT_EP, "x", true, &s);
    assert_string_equal(s.why, "the expert-parallel size must be a whole number from 1 to 1048576 (for example "
                               "AM_EP=2)");
    am_setting_parse(AM_OPT_CP, NULL, false, &s);
    assert_true(s.bad);
    assert_string_equal(s.shown, "--am-cp=");
}

static void option_paths(void **state)
{
    (void)state;
    static struct am_setting s;
    am_setting_parse(AM_OPT_RECIPE, "llama70b.yaml", false, &s);
    assert_false(s.bad);
    assert_string_equal(s.str, "llama70b.yaml");
    am_setting_parse(AM_OPT_RECIPE, "", false, &s);
    assert_true(s.bad);
    assert_string_equal(s.why, "the recipe path is empty (give a path, for example --am-recipe=llama70b.yaml)");
    am_setting_parse(AM_OPT_LOG_DIR, "a\nb", true, &s);
    assert_true(s.bad);
    assert_string_equal(s.shown, "AM_LOG_DIR=a\\x0ab");
    assert_string_equal(s.why, "the log directory contains a control character such as a newline or a tab (rename "
                               "the file, or give a path without one)");
    size_t n = 100 * 1024;
    char *big = malloc(n + 1);
    assert_non_null(big);
    memset(big, 'x', n);
    big[n] = '\0';
    am_setting_parse(AM_OPT_RECIPE, big, false, &s);
    assert_true(s.bad);
    assert_string_equal(s.shown, "--am-recipe=xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...(102400 bytes)");
    assert_string_equal(s.why, "the recipe path is longer than the 4095 bytes a path may have (give a shorter path)");
    free(big);
    am_setting_parse(AM_OPT_RECIPE, "r\xc3\xa9\xff.yaml", false, &s); /* é valid, \xff not: accepted, shown safely */
    assert_false(s.bad);
    assert_string_equal(s.shown, "--am-recipe=r\xc3\xa9\\xff.yaml");
    am_setting_parse(AM_OPT_DRY_RUN, NULL, false, &s);
    assert_true(s.given && !s.bad);
    assert_string_equal(s.shown, "--am-dry-run");
}

static void forward_names(void **state)
{
    (void)state;
    char buf[96];
    am_opt_forward_name(AM_OPT_RECIPE, buf, sizeof(buf));
    assert_string_equal(buf, "_SLURM_SPANK_OPTION_am_am_recipe");
    am_opt_forward_name(AM_OPT_LOG_DIR, buf, sizeof(buf));
    assert_string_equal(buf, "_SLURM_SPANK_OPTION_am_am_log_dir");
    am_opt_forward_name(AM_OPT_TP, buf, 8); /* truncated, still terminated */
    assert_int_equal(strlen(buf), 7);
}

/* ---- text helpers ---- */

static void shown(void **state)
{
    (void)state;
    char buf[AM_SHOWN_LEN];
    assert_string_equal(am_shown("plain", buf, sizeof(buf)), "plain");
    assert_string_equal(am_shown(NULL, buf, sizeof(buf)), "");
    assert_string_equal(am_shown("\x1b[2J\t\x7f", buf, sizeof(buf)), "\\x1b[2J\\x09\\x7f");
    /* overlong encodings, surrogates and C1 controls are escaped, valid UTF-8 kept */
    assert_string_equal(am_shown("\xc0\xaf\xed\xa0\x80\xc2\x85\xe2\x82\xac", buf, sizeof(buf)),
                        "\\xc0\\xaf\\xed\\xa0\\x80\\xc2\\x85\xe2\x82\xac");
    /* 40 escaped bytes then the length: always fits */
    char bin[300];
    memset(bin, 0xff, sizeof(bin) - 1);
    bin[sizeof(bin) - 1] = '\0';
    am_shown(bin, buf, sizeof(buf));
    assert_true(strlen(buf) < sizeof(buf));
    assert_non_null(strstr(buf, "...(299 bytes)"));
    char small[8];
    am_shown("a long value", small, sizeof(small));
    assert_true(strlen(small) < sizeof(small));
}

/* A path handed over to slurmstepd: what is wrong with it, said exactly. */
static void path_problems(void **state)
{
    (void)state;
    char buf[64];
    assert_null(am_path_problem("/shared/am/recipes/tiny.yaml", buf, sizeof(buf)));
    assert_string_equal(am_path_problem("/tmp/a\nb.yaml", buf, sizeof(buf)), "contains a newline");
    assert_string_equal(am_path_problem("tiny\n.yaml", buf, sizeof(buf)), "contains a newline");
    assert_string_equal(am_path_problem("/tmp/a\tb.yaml", buf, sizeof(buf)), "contains a tab");
    assert_string_equal(am_path_problem("/tmp/a\rb.yaml", buf, sizeof(buf)), "contains a carriage return");
    assert_string_equal(am_path_problem("/tmp/\x1b[2Jb.yaml", buf, sizeof(buf)), "contains a control character (\\x1b)");
    assert_string_equal(am_path_problem("/tmp/a\x7f", buf, sizeof(buf)), "contains a control character (\\x7f)");
    assert_string_equal(am_path_problem("tiny.yaml", buf, sizeof(buf)), "is not an absolute path");
    assert_string_equal(am_path_problem("", buf, sizeof(buf)), "is not an absolute path");
    assert_null(am_path_problem("/tmp/caf\xc3\xa9/tiny.yaml", buf, sizeof(buf))); /* UTF-8 is printable */
}

static void sizes_and_counts(void **state)
{
    (void)state;
    double v;
    long n;
    assert_int_equal(am_parse_size("80G", &v), 0);
    assert_true(v == 80.0 * 1024 * 1024 * 1024);
    assert_int_equal(am_parse_size("141GiB", &v), 0);
    assert_int_equal(am_parse_size("0.5T", &v), 0);
    assert_true(v == 512.0 * 1024 * 1024 * 1024);
    assert_int_equal(am_parse_size("1048576", &v), 0);
    assert_int_equal(am_parse_size("96GB", &v), 0);
    assert_int_equal(am_parse_size(".", &v), -1);
    assert_int_equal(am_parse_size("1..2G", &v), -1);
    assert_int_equal(am_parse_size("1e9", &v), -1);
    assert_int_equal(am_parse_size("80 G", &v), -1);
    assert_int_equal(am_parse_size("0.0G", &v), -1);
    assert_int_equal(am_parse_count("7", 1, 8, &n), 0);
    assert_int_equal(n, 7);
    assert_int_equal(am_parse_count("9", 1, 8, &n), -1);
    assert_int_equal(am_parse_count("0000000000008", 1, 8, &n), -1); /* too many digits */
    assert_int_equal(am_gcd(8, 12), 4);
    assert_int_equal(am_gcd(72, 4), 4);
    assert_int_equal(am_gcd(0, 4), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(config_defaults),  cmocka_unit_test(config_every_key), cmocka_unit_test(config_unknown_key),
        cmocka_unit_test(config_bad_values), cmocka_unit_test(config_repeats),  cmocka_unit_test(config_hostile),
        cmocka_unit_test(option_counts),    cmocka_unit_test(option_paths),     cmocka_unit_test(forward_names),
        cmocka_unit_test(shown),            cmocka_unit_test(sizes_and_counts), cmocka_unit_test(path_problems),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
