/* fuzz_spank.c - libFuzzer target for the plugin's parsers: --am-* option values
 * (am_setting_parse), plugstack.conf arguments (am_config_parse, split at whitespace as
 * Slurm splits the line), and the text helpers. Checks that every result stays bounded and
 * consistent; the sanitizers catch the rest. run-fuzz-spank.sh runs it from `make check`. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "options.h"
#include "text.h"

/* The Slurm functions options.c references (never called here). */
spank_err_t spank_option_register(spank_t sp, struct spank_option *opt)
{
    (void)sp;
    (void)opt;
    return ESPANK_SUCCESS;
}
const char *spank_strerror(spank_err_t err)
{
    (void)err;
    return "";
}
void slurm_error(const char *fmt, ...) { (void)fmt; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct am_setting s;
    char shown[AM_SHOWN_LEN], tiny[7];
    if (size == 0 || size > 200000)
        return 0;
    char *buf = malloc(size + 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    const char *value = buf + 1;

    enum am_opt o = (enum am_opt)(data[0] % AM_OPT_N);
    am_setting_parse(o, value, data[0] & 0x80, &s);
    if (!s.given || strlen(s.shown) >= sizeof(s.shown) || strlen(s.why) >= sizeof(s.why))
        abort();
    if (!s.bad && (o == AM_OPT_TP || o == AM_OPT_PP || o == AM_OPT_EP || o == AM_OPT_CP) &&
        (s.num < 1 || s.num > (1L << 20)))
        abort();
    if (!s.bad && (o == AM_OPT_RECIPE || o == AM_OPT_LOG_DIR) &&
        (strcmp(s.str, value) || !*s.str || am_has_control(s.str)))
        abort();

    am_shown(value, shown, sizeof(shown));
    if (strlen(shown) >= sizeof(shown))
        abort();
    am_shown(value, tiny, sizeof(tiny));
    if (strlen(tiny) >= sizeof(tiny))
        abort();
    double d;
    long n;
    if (am_parse_size(value, &d) == 0 && !(d > 0))
        abort();
    if (am_parse_count(value, 1, 65536, &n) == 0 && (n < 1 || n > 65536))
        abort();

    /* plugstack.conf: the words of the line, as Slurm's strtok_r(" \t\n") makes them */
    char *av[64];
    int ac = 0;
    char *save = NULL;
    for (char *w = strtok_r(buf + 1, " \t\n", &save); w && ac < 64; w = strtok_r(NULL, " \t\n", &save))
        av[ac++] = w;
    struct am_config c;
    char err[1024] = "";
    am_config_init(&c);
    if (am_config_parse(&c, ac, av, err, sizeof(err)) < 0) {
        if (!*err || strlen(err) >= sizeof(err))
            abort();
    } else if (c.n_env > AM_CONFIG_MAX_ENV || (c.gpu_mem && !(c.gpu_mem > 0)) || c.gpus_per_node < 0 ||
               c.nvlink_domain < 0 || (c.log_root && c.log_root[0] != '/')) {
        abort();
    }
    free(buf);
    return 0;
}
