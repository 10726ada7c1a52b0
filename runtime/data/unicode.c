/* unicode.c - UTF-8 decoding with Python's replacement rule (see unicode.h). */
#include "unicode.h"

#include <stdlib.h>

size_t am_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp)
{
    unsigned c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t need;
    unsigned lo = 0x80, hi = 0xbf; /* the range of the second byte */
    uint32_t v;
    if (c >= 0xc2 && c <= 0xdf) {
        need = 1, v = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
        need = 2, v = c & 0x0f;
        if (c == 0xe0)
            lo = 0xa0; /* overlong */
        else if (c == 0xed)
            hi = 0x9f; /* surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 3, v = c & 0x07;
        if (c == 0xf0)
            lo = 0x90; /* overlong */
        else if (c == 0xf4)
            hi = 0x8f; /* past U+10FFFF */
    } else {
        *cp = 0xfffd; /* a continuation byte, 0xc0, 0xc1, 0xf5..0xff */
        return 1;
    }
    size_t i = 1;
    for (; i <= need; i++) {
        if (i >= n || s[i] < (i == 1 ? lo : 0x80) || s[i] > (i == 1 ? hi : 0xbf)) {
            *cp = 0xfffd;
            return i;
        }
        v = (v << 6) | (s[i] & 0x3f);
    }
    *cp = v;
    return i;
}

size_t am_utf8_encode(uint32_t cp, unsigned char *out)
{
    if (cp < 0x80) {
        out[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (unsigned char)(0xc0 | (cp >> 6));
        out[1] = (unsigned char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (unsigned char)(0xe0 | (cp >> 12));
        out[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (unsigned char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (unsigned char)(0xf0 | (cp >> 18));
    out[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (unsigned char)(0x80 | (cp & 0x3f));
    return 4;
}

int am_utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        size_t k = am_utf8_decode(s + i, n - i, &cp);
        if (cp == 0xfffd && !(k == 3 && s[i] == 0xef && s[i + 1] == 0xbf && s[i + 2] == 0xbd))
            return 0;
        i += k;
    }
    return 1;
}

/* ---- NFC ---------------------------------------------------------------------------------------- */

extern const uint32_t am_nfc_ccc[][2], am_nfc_decomp_index[][3], am_nfc_decomp_data[], am_nfc_unstable[][2];
extern const uint64_t am_nfc_comp[][2];
extern const size_t am_nfc_n_ccc, am_nfc_n_decomp, am_nfc_n_comp, am_nfc_n_unstable;

enum { SBASE = 0xac00, LBASE = 0x1100, VBASE = 0x1161, TBASE = 0x11a7, LCOUNT = 19, VCOUNT = 21, TCOUNT = 28,
       NCOUNT = VCOUNT * TCOUNT, SCOUNT = LCOUNT * NCOUNT };

/* The index of key in the first column of a sorted table of n rows of `width` (uint32 rows
 * when wide is 0, uint64 otherwise), or -1. */
static long find(const void *table, size_t width, int wide, size_t n, uint64_t key)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        uint64_t v = wide ? ((const uint64_t *)table)[mid * width] : ((const uint32_t *)table)[mid * width];
        if (v < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < n && (wide ? ((const uint64_t *)table)[lo * width] : ((const uint32_t *)table)[lo * width]) == key)
        return (long)lo;
    return -1;
}

static unsigned ccc(uint32_t cp)
{
    if (cp < 0x300)
        return 0;
    long i = find(am_nfc_ccc, 2, 0, am_nfc_n_ccc, cp);
    return i < 0 ? 0 : am_nfc_ccc[i][1];
}

static int unstable(uint32_t cp)
{
    size_t lo = 0, hi = am_nfc_n_unstable;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (am_nfc_unstable[mid][1] < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < am_nfc_n_unstable && am_nfc_unstable[lo][0] <= cp;
}

int am_nfc_needed(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        if (s[i] < 0xcc) { /* below U+0300 (lead bytes up to 0xcb): nothing changes */
            i += s[i] < 0x80 ? 1 : 2;
            continue;
        }
        uint32_t cp;
        i += am_utf8_decode(s + i, n - i, &cp);
        if (unstable(cp))
            return 1;
    }
    return 0;
}

static uint32_t compose(uint32_t a, uint32_t b)
{
    if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
        return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
    if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE && b < TBASE + TCOUNT)
        return a + (b - TBASE);
    uint64_t key = (uint64_t)a << 21 | b;
    long i = find(am_nfc_comp, 2, 1, am_nfc_n_comp, key);
    return i < 0 ? 0 : (uint32_t)am_nfc_comp[i][1];
}

unsigned char *am_nfc(const unsigned char *s, size_t n, size_t *len)
{
    /* decomposed, at most 4 code points per one (the longest canonical decomposition; Hangul 3) */
    uint32_t *d = malloc((4 * n + 4) * sizeof(uint32_t));
    unsigned char *out = malloc(4 * (4 * n) + 4);
    size_t m = 0;
    if (!d || !out) {
        free(d);
        free(out);
        return NULL;
    }
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += am_utf8_decode(s + i, n - i, &cp);
        long k;
        if (cp >= SBASE && cp < SBASE + SCOUNT) {
            uint32_t x = cp - SBASE;
            d[m++] = LBASE + x / NCOUNT;
            d[m++] = VBASE + (x % NCOUNT) / TCOUNT;
            if (x % TCOUNT)
                d[m++] = TBASE + x % TCOUNT;
        } else if (cp >= 0xc0 && (k = find(am_nfc_decomp_index, 3, 0, am_nfc_n_decomp, cp)) >= 0) {
            for (uint32_t j = 0; j < am_nfc_decomp_index[k][2]; j++)
                d[m++] = am_nfc_decomp_data[am_nfc_decomp_index[k][1] + j];
        } else {
            d[m++] = cp;
        }
    }
    /* canonical order: a stable sort of each run of non-starters by combining class */
    for (size_t i = 1; i < m; i++) {
        unsigned c = ccc(d[i]);
        if (!c)
            continue;
        uint32_t x = d[i];
        size_t j = i;
        while (j > 0 && ccc(d[j - 1]) > c) {
            d[j] = d[j - 1];
            j--;
        }
        d[j] = x;
    }
    /* canonical composition (UAX #15's algorithm) */
    size_t w = 0;
    if (m) {
        size_t starter = 0;
        unsigned last = ccc(d[0]) ? 256 : 0;
        w = 1;
        for (size_t i = 1; i < m; i++) {
            unsigned c = ccc(d[i]);
            uint32_t comp = compose(d[starter], d[i]);
            if (comp && (last < c || last == 0) && !(last == 0 && w - 1 != starter)) {
                d[starter] = comp;
                continue;
            }
            if (c == 0)
                starter = w;
            last = c;
            d[w++] = d[i];
        }
    }
    size_t o = 0;
    for (size_t i = 0; i < w; i++)
        o += am_utf8_encode(d[i], out + o);
    free(d);
    *len = o;
    return out;
}
