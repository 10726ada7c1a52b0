/* sigfmt.c - async-signal-safe formatting (sigfmt.h). */
#include "sigfmt.h"

#include <errno.h>
#include <unistd.h>

void am_sbuf_init(struct am_sbuf *b, char *buf, size_t cap)
{
    b->buf = buf;
    b->cap = cap;
    b->len = 0;
    b->overflow = 0;
    if (cap)
        buf[0] = '\0';
}

void am_sbuf_char(struct am_sbuf *b, char c)
{
    if (b->len + 1 >= b->cap) {
        b->overflow = 1;
        return;
    }
    b->buf[b->len++] = c;
    b->buf[b->len] = '\0';
}

void am_sbuf_str(struct am_sbuf *b, const char *s)
{
    if (!s)
        return;
    for (; *s; s++)
        am_sbuf_char(b, *s);
}

void am_sbuf_u64(struct am_sbuf *b, uint64_t v)
{
    char tmp[24];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        am_sbuf_char(b, tmp[--n]);
}

void am_sbuf_i64(struct am_sbuf *b, int64_t v)
{
    if (v < 0) {
        am_sbuf_char(b, '-');
        am_sbuf_u64(b, (uint64_t)0 - (uint64_t)v); /* INT64_MIN too */
    } else {
        am_sbuf_u64(b, (uint64_t)v);
    }
}

void am_sbuf_hex(struct am_sbuf *b, uint64_t v)
{
    static const char digits[] = "0123456789abcdef";
    char tmp[20];
    int n = 0;
    do {
        tmp[n++] = digits[v & 15];
        v >>= 4;
    } while (v);
    am_sbuf_str(b, "0x");
    while (n)
        am_sbuf_char(b, tmp[--n]);
}

void am_sbuf_fixed(struct am_sbuf *b, double v, int decimals)
{
    if (v != v || v >= 1e18 || v <= -1e18) { /* NaN, infinities, too large for the integer part */
        am_sbuf_str(b, "null");
        return;
    }
    if (decimals < 0)
        decimals = 0;
    if (decimals > 9)
        decimals = 9;
    uint64_t scale = 1;
    for (int i = 0; i < decimals; i++)
        scale *= 10;
    int neg = v < 0;
    double a = neg ? -v : v;
    uint64_t ip = (uint64_t)a;
    double frac = (a - (double)ip) * (double)scale;
    uint64_t fp = (uint64_t)(frac + 0.5);
    if (fp >= scale) { /* 0.9999996 with 6 decimals rounds up into the integer part */
        ip++;
        fp -= scale;
    }
    if (neg && (ip || fp))
        am_sbuf_char(b, '-');
    am_sbuf_u64(b, ip);
    if (!decimals)
        return;
    am_sbuf_char(b, '.');
    char tmp[10];
    for (int i = decimals - 1; i >= 0; i--) {
        tmp[i] = (char)('0' + fp % 10);
        fp /= 10;
    }
    for (int i = 0; i < decimals; i++)
        am_sbuf_char(b, tmp[i]);
}

void am_sbuf_json_str(struct am_sbuf *b, const char *s)
{
    static const char digits[] = "0123456789abcdef";
    if (!s) {
        am_sbuf_str(b, "null");
        return;
    }
    am_sbuf_char(b, '"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        switch (c) {
        case '"': am_sbuf_str(b, "\\\""); break;
        case '\\': am_sbuf_str(b, "\\\\"); break;
        case '\n': am_sbuf_str(b, "\\n"); break;
        case '\r': am_sbuf_str(b, "\\r"); break;
        case '\t': am_sbuf_str(b, "\\t"); break;
        default:
            if (c < 0x20) {
                am_sbuf_str(b, "\\u00");
                am_sbuf_char(b, digits[c >> 4]);
                am_sbuf_char(b, digits[c & 15]);
            } else {
                am_sbuf_char(b, (char)c);
            }
        }
    }
    am_sbuf_char(b, '"');
}

int am_write_all(int fd, const char *buf, size_t len)
{
    while (len) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}
