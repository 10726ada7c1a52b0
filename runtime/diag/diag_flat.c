/* diag_flat.c - the fast reader of flat records (diag.h): a large job's logs are mostly step
 * and flight records, one flat JSON object per line; jansson builds a tree per line, which
 * makes reading 4096 ranks' logs take minutes. This reader accepts only what it can decode
 * exactly as jansson would (ASCII strings without escapes, scalar values, numbers in range)
 * and gives up on anything else, which then goes to jansson. */
#include "diag.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

static inline const char *ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n'))
        p++;
    return p;
}

/* A string without escapes, ASCII, no control characters: its body, or NULL. */
static inline const char *string(const char *p, const char *end, const char **body, size_t *len)
{
    if (p >= end || *p != '"')
        return NULL;
    const char *b = ++p;
    for (unsigned char c; p < end && (c = (unsigned char)*p) != '"'; p++)
        if (c < 0x20 || c >= 0x80 || c == '\\')
            return NULL;
    if (p >= end)
        return NULL;
    *body = b;
    *len = (size_t)(p - b);
    return p + 1;
}

static int digit(char c) { return c >= '0' && c <= '9'; }

/* A JSON number (RFC 8259 grammar). Integers must fit jansson's json_int_t (long long), reals
 * must not overflow (jansson refuses both). Values are exactly strtoll's and strtod's: the
 * common case, at most 15 significant digits and no exponent, is converted by one division of
 * two exactly representable doubles (correctly rounded, as strtod); the rest by the libc. */
static const char *number(const char *p, const char *end, struct am_diag_field *f)
{
    static const double pow10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                                   1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
    const char *b = p;
    int real = 0, neg = 0, digits = 0, frac = 0, exp = 0;
    uint64_t mant = 0;
    if (p < end && *p == '-') {
        neg = 1;
        p++;
    }
    if (p >= end || !digit(*p))
        return NULL;
    if (*p == '0') {
        p++;
    } else {
        for (; p < end && digit(*p); p++, digits++)
            if (digits < 19)
                mant = mant * 10 + (uint64_t)(*p - '0');
    }
    if (p < end && *p == '.') {
        real = 1;
        if (++p >= end || !digit(*p))
            return NULL;
        for (; p < end && digit(*p); p++, frac++)
            if (digits + frac < 19)
                mant = mant * 10 + (uint64_t)(*p - '0');
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        real = exp = 1;
        if (++p < end && (*p == '+' || *p == '-'))
            p++;
        if (p >= end || !digit(*p))
            return NULL;
        while (p < end && digit(*p))
            p++;
    }
    if (!real && digits <= 18) {
        f->kind = 'i';
        f->i = neg ? -(long long)mant : (long long)mant;
        return p;
    }
    if (real && !exp && digits + frac <= 19 && mant < ((uint64_t)1 << 53) && frac <= 22) {
        f->kind = 'r';
        f->r = (double)mant / pow10[frac];
        if (neg)
            f->r = -f->r;
        return p;
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
        f->s = NULL;
        f->s_len = 0;
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
