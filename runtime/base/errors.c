/* errors.c - the message list behind errors.h. */
#include "errors.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void am_errors_init(struct am_errors *e) { memset(e, 0, sizeof(*e)); }

void am_errors_free(struct am_errors *e)
{
    for (size_t i = 0; i < e->n; i++)
        free(e->msg[i]);
    free(e->msg);
    memset(e, 0, sizeof(*e));
}

void am_pos_format(const struct am_pos *pos, char *buf, size_t len)
{
    if (!pos || (!pos->origin && !pos->file))
        snprintf(buf, len, "%s", "");
    else if (pos->origin)
        snprintf(buf, len, "%s: ", pos->origin);
    else if (pos->line > 0)
        snprintf(buf, len, "%s:%d:%d: ", pos->file, pos->line, pos->col);
    else
        snprintf(buf, len, "%s: ", pos->file);
}

static void verrorf(struct am_errors *e, const struct am_pos *pos, const char *fmt, va_list ap)
{
    if (e->n >= AM_ERRORS_MAX) {
        e->truncated++;
        return;
    }
    if (e->n == e->cap) {
        size_t cap = e->cap ? 2 * e->cap : 8;
        char **m = realloc(e->msg, cap * sizeof(*m));
        if (!m) {
            e->truncated++;
            return;
        }
        e->msg = m;
        e->cap = cap;
    }
    char prefix[512], text[1024];
    am_pos_format(pos, prefix, sizeof(prefix));
    vsnprintf(text, sizeof(text), fmt, ap);
    size_t len = strlen(prefix) + strlen(text) + 1;
    char *s = malloc(len);
    if (!s) {
        e->truncated++;
        return;
    }
    snprintf(s, len, "%s%s", prefix, text);
    e->msg[e->n++] = s;
}

void am_errorf(struct am_errors *e, const struct am_pos *pos, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    verrorf(e, pos, fmt, ap);
    va_end(ap);
}

int am_errors_fail(struct am_errors *e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    verrorf(e, NULL, fmt, ap);
    va_end(ap);
    return -1;
}
