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

static inline int is_ws(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

static inline const char *ws(const char *p, const char *end)
{
    while (p < end && (unsigned char)*p <= ' ' && is_ws(*p))
        p++;
    return p;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define FLAT_SWAR 1
#define ONES 0x0101010101010101ull
#define HIGH 0x8080808080808080ull
/* The bytes of v that end or refuse a string ('"', '\\', below 0x20, from 0x80), as their
 * high bits. A borrow can mark a byte above a marked one, never below: the lowest mark is
 * exact. */
static inline uint64_t stops(uint64_t v)
{
    uint64_t q = v ^ (ONES * '"'), b = v ^ (ONES * '\\');
    return (((q - ONES) & ~q) | ((b - ONES) & ~b) | ((v - ONES * 0x20) & ~v) | v) & HIGH;
}
#endif

/* A string without escapes, ASCII, no control characters: its body, or NULL. */
static inline const char *string(const char *p, const char *end, const char **body, size_t *len)
{
    if (p >= end || *p != '"')
        return NULL;
    const char *b = ++p;
#ifdef FLAT_SWAR
    for (; end - p >= 8; p += 8) { /* 8 bytes at a time */
        uint64_t v, m;
        memcpy(&v, p, 8);
        if ((m = stops(v)) != 0) {
            p += __builtin_ctzll(m) >> 3;
            if (*p != '"')
                return NULL;
            *body = b;
            *len = (size_t)(p - b);
            return p + 1;
        }
    }
#endif
    for (unsigned char c; p < end && (c = (unsigned char)*p) != '"'; p++)
        if (c < 0x20 || c >= 0x80 || c == '\\')
            return NULL;
    if (p >= end)
        return NULL;
    *body = b;
    *len = (size_t)(p - b);
    return p + 1;
}

static inline int digit(char c) { return (unsigned char)(c - '0') < 10; }

static const uint64_t pow10u[] = {1ull, 10ull, 100ull, 1000ull, 10000ull, 100000ull, 1000000ull, 10000000ull,
                                  100000000ull};

/* A run of decimal digits from p: *n its length, *v the value of its first 19 digits (any
 * value when longer). 8 digits at a time where 8 bytes remain. */
static inline const char *digits(const char *p, const char *end, uint64_t *v, int *n)
{
    uint64_t val = 0;
    int count = 0;
#ifdef FLAT_SWAR
    while (end - p >= 8) {
        uint64_t w, nd;
        memcpy(&w, p, 8);
        /* non-digits' high bits: below '0' (borrow), above '9' (carry into the high bit), from
         * 0x80; the lowest mark is exact (no carry nor borrow below it) */
        nd = ((w - ONES * '0') | (w + ONES * (0x7f - '9')) | w) & HIGH;
        int k = nd ? __builtin_ctzll(nd) >> 3 : 8;
        if (k == 0)
            break;
        if (k < 8) /* the k digits as the low end of 8: '0's before them */
            w = (w << (8 * (8 - k))) | (ONES * '0' >> (8 * k));
        /* 8 ASCII digits to their value (the first is the most significant) */
        w -= ONES * '0';
        w = w * 10 + (w >> 8);
        w = (((w & 0x000000FF000000FFull) * (100 + (1000000ull << 32))) +
             (((w >> 16) & 0x000000FF000000FFull) * (1 + (10000ull << 32)))) >> 32;
        val = val * pow10u[k] + (uint32_t)w;
        count += k;
        p += k;
        if (k < 8) {
            *v = val;
            *n = count;
            return p;
        }
    }
#endif
    for (; p < end && digit(*p); p++, count++)
        val = val * 10 + (uint64_t)(*p - '0');
    *v = val;
    *n = count;
    return p;
}

/* A JSON number (RFC 8259 grammar). Integers must fit jansson's json_int_t (long long), reals
 * must not overflow (jansson refuses both). Values are exactly strtoll's and strtod's: the
 * common case, at most 19 significant digits below 2^53 and no exponent, is one division of
 * two exactly representable doubles (correctly rounded, as strtod), done when the value is
 * read (am_diag_flat_real: most reals of a record are never read); the rest by the libc. */
static inline const char *number(const char *p, const char *end, struct am_diag_field *f)
{
    const char *b = p;
    int neg = *p == '-', ni = 0, nf = 0, real = 0, exp = 0;
    uint64_t ip = 0, fp = 0;
    p += neg;
    if (p >= end || !digit(*p))
        return NULL;
    if (*p == '0')
        p++; /* no more digits: JSON has no leading zeros (what follows is refused) */
    else
        p = digits(p, end, &ip, &ni);
    if (p < end && *p == '.') {
        real = 1;
        p = digits(p + 1, end, &fp, &nf);
        if (nf == 0)
            return NULL;
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
    if (!real && ni <= 18) {
        f->kind = 'i';
        f->i = neg ? -(long long)ip : (long long)ip;
        return p;
    }
    if (real && !exp && ni + nf <= 19) {
        /* ip * 10^nf + fp < 10^19: no overflow */
        uint64_t mant = ip;
        for (int k = nf; k > 0; k -= 8)
            mant *= pow10u[k < 8 ? k : 8];
        mant += fp;
        if (mant < ((uint64_t)1 << 53)) {
            f->kind = 'r';
            f->mant = mant;
            f->frac = (char)nf;
            f->neg = (char)neg;
            f->ready = 0;
            return p;
        }
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
        f->ready = 1;
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

double am_diag_flat_real(const struct am_diag_field *f)
{
    static const double pow10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                                   1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
    if (f->ready)
        return f->r;
    double r = (double)f->mant / pow10[(unsigned char)f->frac]; /* both exact: correctly rounded */
    return f->neg ? -r : r;
}

/* The key of field k at p, as the keys of an earlier line predict it ('"', the key, '":'):
 * 1 when the bytes there are exactly the prediction (a key this reader accepted before). */
static inline int predicted(const struct am_diag_flat_keys *keys, int k, const char *p, const char *end)
{
#ifdef FLAT_SWAR
    unsigned L = keys->len[k];
    if (L == 0 || end - p < 16)
        return 0;
    uint64_t a, b;
    memcpy(&a, p, 8);
    memcpy(&b, p + 8, 8);
    uint64_t m0 = L >= 8 ? ~0ull : (1ull << (8 * L)) - 1;
    uint64_t m1 = L <= 8 ? 0 : L >= 16 ? ~0ull : (1ull << (8 * (L - 8))) - 1;
    return ((a ^ keys->text[k][0]) & m0) == 0 && ((b ^ keys->text[k][1]) & m1) == 0;
#else
    (void)keys, (void)k, (void)p, (void)end;
    return 0;
#endif
}

static void remember(struct am_diag_flat_keys *keys, int k, const char *key, size_t n)
{
    if (k >= AM_DIAG_FLAT_KEYS)
        return;
    keys->len[k] = 0;
    keys->tag[k] = 0;
    if (n + 3 > sizeof(keys->text[k]))
        return;
    char t[sizeof(keys->text[k])] = {0};
    t[0] = '"';
    memcpy(t + 1, key, n);
    t[n + 1] = '"';
    t[n + 2] = ':';
    memcpy(keys->text[k], t, sizeof(t));
    keys->len[k] = (unsigned char)(n + 3);
}

int am_diag_flat_parse(const char *line, size_t n, struct am_diag_field *fields, int max)
{
    return am_diag_flat_parse_keys(line, n, fields, max, NULL);
}

int am_diag_flat_parse_keys(const char *line, size_t n, struct am_diag_field *fields, int max,
                            struct am_diag_flat_keys *keys)
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
        if (keys && k < AM_DIAG_FLAT_KEYS && predicted(keys, k, p, end)) {
            f->key = p + 1;
            f->key_len = keys->len[k] - 3u;
            p += keys->len[k];
        } else {
            if (!(p = string(p, end, &f->key, &f->key_len)))
                return -1;
            p = ws(p, end);
            if (p >= end || *p != ':')
                return -1;
            p++;
            if (keys)
                remember(keys, k, f->key, f->key_len);
        }
        p = ws(p, end);
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
        if (p < end && *p == ',' && p + 1 < end && p[1] == '"') { /* compact JSON */
            p++;
            continue;
        }
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
