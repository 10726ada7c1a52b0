/* sigfmt.h - text formatting that is safe in a signal handler.
 *
 * The crash handler (crash.h) and the flight recorder's dump (flight.h) write JSON lines
 * from a signal handler, where printf, malloc and stdio may deadlock or corrupt state (the
 * signal may have interrupted them). These functions append to a caller's fixed buffer
 * (usually on the stack), call no library function but memcpy-like loops, and never fail:
 * text that does not fit is cut and `overflow` is set (the caller still writes what fits;
 * a cut line is still one line). The output is printf's for the same value:
 *
 *   am_sbuf_u64 / am_sbuf_i64    "%llu" / "%lld"
 *   am_sbuf_hex                  "0x%llx"
 *   am_sbuf_fixed(v, d)          "%.*f" with d decimals (0..9), rounded half away from zero
 *                                on the decimal digits; |v| >= 1e18, NaN and infinities are
 *                                written as JSON null (JSON has no NaN)
 *   am_sbuf_json_str             a JSON string literal: quotes, \" \\ \n \r \t escaped,
 *                                other control characters as \u00XX; bytes >= 0x80 as is
 */
#ifndef AM_SIGFMT_H
#define AM_SIGFMT_H

#include <stddef.h>
#include <stdint.h>

struct am_sbuf {
    char *buf;
    size_t cap;     /* bytes of buf, including room for a terminating NUL */
    size_t len;     /* bytes written (buf[len] is always NUL) */
    int overflow;   /* something did not fit */
};

void am_sbuf_init(struct am_sbuf *b, char *buf, size_t cap);
void am_sbuf_char(struct am_sbuf *b, char c);
void am_sbuf_str(struct am_sbuf *b, const char *s);     /* as is; NULL writes nothing */
void am_sbuf_u64(struct am_sbuf *b, uint64_t v);
void am_sbuf_i64(struct am_sbuf *b, int64_t v);
void am_sbuf_hex(struct am_sbuf *b, uint64_t v);
void am_sbuf_fixed(struct am_sbuf *b, double v, int decimals);
void am_sbuf_json_str(struct am_sbuf *b, const char *s); /* NULL writes null */

/* write() until all of buf is written or an error other than EINTR; 0 or -1. */
int am_write_all(int fd, const char *buf, size_t len);

#endif
