/* text.c - see text.h. */
#include "text.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Length of the valid UTF-8 sequence at s that encodes a printable code point (not a C1
 * control), or 0 when the bytes there are not one. */
static size_t utf8_len(const unsigned char *s)
{
    size_t n;
    if (s[0] >= 0xc2 && s[0] <= 0xdf)
        n = 2;
    else if (s[0] >= 0xe0 && s[0] <= 0xef)
        n = 3;
    else if (s[0] >= 0xf0 && s[0] <= 0xf4)
        n = 4;
    else
        return 0;
    unsigned cp = s[0] & (0x7fu >> n); /* the lead byte's payload bits */
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80) /* also stops at the terminating NUL */
            return 0;
        cp = (cp << 6) | (s[i] & 0x3fu);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) || (cp >= 0xd800 && cp <= 0xdfff) ||
        cp < 0xa0)
        return 0;
    return n;
}

const char *am_shown(const char *s, char *buf, size_t len)
{
    const unsigned char *p = (const unsigned char *)(s ? s : "");
    size_t total = strlen((const char *)p), o = 0, shown = 0;
    if (len == 0)
        return buf;
    buf[0] = '\0';
    /* room for the longest element (\xNN or a 4-byte sequence) and the "...(N bytes)" tail */
    const size_t tail = 32;
    while (*p && shown < AM_SHOWN_MAX && o + 4 + tail < len) {
        size_t n = utf8_len(p);
        if (n) {
            memcpy(buf + o, p, n);
            o += n;
            p += n;
        } else if (*p >= 0x20 && *p < 0x7f) {
            buf[o++] = (char)*p++;
        } else {
            o += (size_t)snprintf(buf + o, len - o, "\\x%02x", *p++);
        }
        shown++;
    }
    buf[o] = '\0';
    if (*p && o + tail <= len)
        snprintf(buf + o, len - o, "...(%zu bytes)", total);
    return buf;
}

int am_parse_count(const char *s, long min, long max, long *out)
{
    long v = 0;
    size_t n = 0;
    if (!s || !*s)
        return -1;
    for (; s[n]; n++) {
        if (s[n] < '0' || s[n] > '9' || n >= 12)
            return -1;
        v = v * 10 + (s[n] - '0');
    }
    if (v < min || v > max)
        return -1;
    *out = v;
    return 0;
}

int am_parse_size(const char *s, double *out)
{
    double v = 0, scale = 1;
    size_t i = 0, digits = 0;
    bool dot = false;
    if (!s)
        return -1;
    for (; (s[i] >= '0' && s[i] <= '9') || (s[i] == '.' && !dot); i++) {
        if (i >= 24)
            return -1;
        if (s[i] == '.') {
            dot = true;
            continue;
        }
        digits++;
        if (dot)
            scale /= 10;
        v = v * 10 + (s[i] - '0');
    }
    if (!digits)
        return -1;
    v *= scale;
    double mult = 1;
    switch (s[i]) {
    case 'k': case 'K': mult = 1024.0; i++; break;
    case 'm': case 'M': mult = 1024.0 * 1024; i++; break;
    case 'g': case 'G': mult = 1024.0 * 1024 * 1024; i++; break;
    case 't': case 'T': mult = 1024.0 * 1024 * 1024 * 1024; i++; break;
    default: break;
    }
    const char *rest = s + i;
    if (strcmp(rest, "") && strcmp(rest, "B") && strcmp(rest, "iB"))
        return -1;
    v *= mult;
    if (!(v > 0) || !isfinite(v))
        return -1;
    *out = v;
    return 0;
}

bool am_has_control(const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if (*p < 0x20 || *p == 0x7f)
            return true;
    return false;
}

const char *am_path_problem(const char *p, char *buf, size_t len)
{
    for (const unsigned char *c = (const unsigned char *)p; *c; c++) {
        if (*c == '\n')
            return "contains a newline";
        if (*c == '\t')
            return "contains a tab";
        if (*c == '\r')
            return "contains a carriage return";
        if (*c < 0x20 || *c == 0x7f) {
            snprintf(buf, len, "contains a control character (\\x%02x)", *c);
            return buf;
        }
    }
    return p[0] == '/' ? NULL : "is not an absolute path";
}

int am_gcd(int a, int b)
{
    if (a <= 0 || b <= 0)
        return 0;
    while (b) {
        int t = a % b;
        a = b;
        b = t;
    }
    return a;
}
