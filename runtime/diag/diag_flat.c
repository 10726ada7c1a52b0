/* diag_flat.c - the fast reader of flat records (diag.h): a large job's logs are mostly step
 * and flight records, one flat JSON object per line; jansson builds a tree per line, which
 * makes reading 4096 ranks' logs take minutes. This reader accepts only what it can decode
 * exactly as jansson would (ASCII strings without escapes, scalar values, numbers in range)
 * and gives up on anything else, which then goes to jansson. */
#include "diag.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n'))
        p++;
    return p;
}

/* A string without escapes, ASCII, no control characters: its body, or NULL. */
static const char *string(const char *p, const char *end, const char **body, size_t *len)
{
    if (p >= end || *p != '"')
        return NULL;
    const char *b = ++p;
    while (p < end && *p != '"') {
        unsigned char c = (unsigned char)*p;
        if (c < 0x20 || c >= 0x80 || c == '\\')
            return NULL;
        p++;
    }
    if (p >= end)
        return NULL;
    *body = b;
    *len = (size_t)(p - b);
    return p + 1;
}

static int digit(char c) { return c >= '0' && c <= '9'; }

/* A JSON number (RFC 8259 grammar). Integers must fit jansson's json_int_t (long long), reals
 * must not overflow (jansson refuses both). */
static const char *number(const char *p, const char *end, struct am_diag_field *f)
{
    const char *b = p;
    int real = 0;
    if (p < end && *p == '-')
        p++;
    if (p >= end || !digit(*p))
        return NULL;
    if (*p == '0')
        p++;
    else
        while (p < end && digit(*p))
            p++;
    if (p < end && *p == '.') {
        real = 1;
        if (++p >= end || !digit(*p))
            return NULL;
        while (p < end && digit(*p))
            p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        real = 1;
        if (++p < end && (*p == '+' || *p == '-'))
            p++;
        if (p >= end || !digit(*p))
            return NULL;
        while (p < end && digit(*p))
            p++;
    }
    char buf[64];
    size_t n = (size_t)(p - b);
    if (n >= sizeof(buf))
        return NULL; /* unusual: leave it to jansson */
    memcpy(buf, b, n);
    buf[n] = '\0';
    errno = 0;
    if (real) {
        double v = strtod(buf, NULL);
        if ((v == HUGE_VAL || v == -HUGE_VAL) && errno == ERANGE)
            return NULL;
        f->kind = 'r';
        f->r = v;
    } else {
        long long v = strtoll(buf, NULL, 10);
        if (errno == ERANGE)
            return NULL;
        f->kind = 'i';
        f->i = v;
    }
    return p;
}

int am_diag_flat_parse(const char *line, size_t n, struct am_diag_field *fields, int max)
{
    const char *p = line, *end = line + n;
    int k = 0;
    p = ws(p, end);
    if (p >= end || *p != '{')
        return -1;
    p = ws(p + 1, end);
    if (p < end && *p == '}') {
        p = ws(p + 1, end);
        return p == end ? 0 : -1;
    }
    for (;;) {
        if (k == max)
            return -1;
        struct am_diag_field *f = &fields[k];
        memset(f, 0, sizeof(*f));
        if (!(p = string(p, end, &f->key, &f->key_len)))
            return -1;
        p = ws(p, end);
        if (p >= end || *p != ':')
            return -1;
        p = ws(p + 1, end);
        if (p >= end)
            return -1;
        if (*p == '"') {
            if (!(p = string(p, end, &f->s, &f->s_len)))
                return -1;
            f->kind = 's';
        } else if (*p == '-' || digit(*p)) {
            if (!(p = number(p, end, f)))
                return -1;
        } else if ((size_t)(end - p) >= 4 && memcmp(p, "true", 4) == 0) {
            f->kind = 't';
            p += 4;
        } else if ((size_t)(end - p) >= 5 && memcmp(p, "false", 5) == 0) {
            f->kind = 'f';
            p += 5;
        } else if ((size_t)(end - p) >= 4 && memcmp(p, "null", 4) == 0) {
            f->kind = 'n';
            p += 4;
        } else {
            return -1; /* an object, an array, or not JSON */
        }
        k++;
        p = ws(p, end);
        if (p < end && *p == ',') {
            p = ws(p + 1, end);
            continue;
        }
        if (p < end && *p == '}') {
            p = ws(p + 1, end);
            return p == end ? k : -1;
        }
        return -1;
    }
}
