/* fuzz_diag.c - libFuzzer target for am-diag's loader and analysis (runtime/diag).
 *
 * Input: the logs of a job, one after the other, separated by lines "@R" (the next log is
 * rank R's; R may be any number, as a file name would give it); text before the first "@R"
 * is rank 0's. Each log goes through am_diag_add_log (which the directory loader calls with
 * each file's bytes), then the analysis, the report, the page (--html: no log's text may add
 * markup to it) and the JSON. Every line the fast reader
 * accepts is also checked against jansson: an object with the same values. Any crash, leak,
 * sanitizer report or disagreement is a bug. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The fast reader must agree with jansson on every line it accepts, reading each line alone
 * and with the keys of the input's lines before it predicted (keys). */
static void check_flat(const char *line, size_t n, struct am_diag_flat_keys *keys)
{
    struct am_diag_field f[32];
    int nf = keys ? am_diag_flat_parse_keys(line, n, f, 32, keys) : am_diag_flat_parse(line, n, f, 32);
    if (nf < 0)
        return;
    json_error_t je;
    json_t *o = json_loadb(line, n, 0, &je);
    if (!json_is_object(o))
        abort(); /* accepted what jansson refuses */
    for (int i = 0; i < nf; i++) {
        char key[256];
        if (f[i].key_len >= sizeof(key))
            continue;
        memcpy(key, f[i].key, f[i].key_len);
        key[f[i].key_len] = '\0';
        int later = 0; /* a duplicate key: the last one counts, in both */
        for (int k = i + 1; k < nf; k++)
            later |= f[k].key_len == f[i].key_len && memcmp(f[k].key, f[i].key, f[i].key_len) == 0;
        if (later)
            continue;
        const json_t *v = json_object_get(o, key);
        int same = 0;
        switch (f[i].kind) {
        case 's': same = json_is_string(v) && json_string_length(v) == f[i].s_len &&
                         memcmp(json_string_value(v), f[i].s, f[i].s_len) == 0; break;
        case 'i': same = json_is_integer(v) && json_integer_value(v) == f[i].i; break;
        case 'r': {
            double r = am_diag_flat_real(&f[i]);
            same = json_is_real(v) && (json_real_value(v) == r || (json_real_value(v) != json_real_value(v) && r != r));
            break;
        }
        case 't': same = json_is_true(v); break;
        case 'f': same = json_is_false(v); break;
        case 'n': same = json_is_null(v); break;
        }
        if (!same)
            abort();
    }
    json_decref(o);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data, *end = text + size;
    struct am_diag d;
    am_diag_init(&d);
    d.max_listed = 64; /* a world of millions: the JSON's list of missing ranks, cut short */
    int rank = 0;
    const char *log = text;
    struct am_diag_flat_keys keys;
    memset(&keys, 0, sizeof(keys));
    for (const char *p = text; p <= end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        check_flat(p, (size_t)(le - p), NULL);
        check_flat(p, (size_t)(le - p), &keys);
        int at_mark = le - p >= 2 && p[0] == '@' && p[1] >= '0' && p[1] <= '9';
        if (at_mark || !nl) {
            const char *log_end = at_mark ? p : end;
            if (log_end > log || !at_mark)
                am_diag_add_log(&d, rank, log, (size_t)(log_end - log));
            if (at_mark) {
                long r = 0;
                for (const char *q = p + 1; q < le && *q >= '0' && *q <= '9' && r <= 100000000; q++)
                    r = r * 10 + (*q - '0');
                rank = (int)r;
                log = nl ? nl + 1 : end;
            }
        }
        if (!nl)
            break;
        p = nl + 1;
    }
    if (d.n_ranks > 0) {
        am_diag_analyze(&d);
        FILE *f = fopen("/dev/null", "w");
        if (f) {
            am_diag_print(&d, f);
            fclose(f);
        }
        /* the page: no text of a log adds markup (the page's own two scripts only) */
        char *page = NULL;
        size_t page_len = 0;
        FILE *m = open_memstream(&page, &page_len);
        if (m) {
            if (am_diag_html(&d, m) < 0)
                abort();
            fclose(m);
            int scripts = 0;
            for (const char *q = strstr(page, "<script"); q; q = strstr(q + 1, "<script"))
                scripts++;
            if (scripts != 2 || strlen(page) != page_len)
                abort();
            free(page);
        }
        json_t *o = am_diag_json(&d);
        char *s = json_dumps(o, JSON_COMPACT);
        if (!s)
            abort(); /* every string must be valid: the JSON always dumps */
        free(s);
        json_decref(o);
    }
    am_diag_free(&d);
    return 0;
}
