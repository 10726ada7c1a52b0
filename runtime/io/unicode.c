/* unicode.c - UTF-8 decoding with Python's replacement rule (see unicode.h). */
#include "unicode.h"

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
