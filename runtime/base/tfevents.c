/* tfevents.c - TensorBoard event files (tfevents.h): protobuf's wire format for the few
 * messages an Event of scalars needs, framed as TFRecords. */
#include "tfevents.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crc32c.h"
#include "util.h"

#define MAX_TAG 255

/* ---- protobuf's wire format: a bounded writer that counts what does not fit ------------- */

struct buf {
    uint8_t *p;
    size_t cap, len;
};

static void put(struct buf *b, const void *data, size_t n)
{
    if (b->len + n <= b->cap)
        memcpy(b->p + b->len, data, n);
    b->len += n;
}

static void varint(struct buf *b, uint64_t v)
{
    uint8_t tmp[10];
    size_t n = 0;
    do {
        tmp[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    put(b, tmp, n);
}

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v > 0x7f) {
        v >>= 7;
        n++;
    }
    return n;
}

static void le(struct buf *b, uint64_t v, int bytes)
{
    uint8_t tmp[8];
    for (int i = 0; i < bytes; i++)
        tmp[i] = (uint8_t)(v >> (8 * i));
    put(b, tmp, (size_t)bytes);
}

enum { WIRE_VARINT = 0, WIRE_64 = 1, WIRE_LEN = 2, WIRE_32 = 5 };

static void key(struct buf *b, int field, int wire) { varint(b, (uint64_t)(field << 3 | wire)); }

static void field_bytes(struct buf *b, int field, const void *data, size_t n)
{
    key(b, field, WIRE_LEN);
    varint(b, n);
    put(b, data, n);
}

/* Summary.Value {1: tag, 2: simple_value}: its encoded length (simple_value is a member of a
 * oneof, written even when zero) */
static size_t value_len(size_t tag_len) { return 1 + varint_len(tag_len) + tag_len + 5; }

static uint32_t float_bits(double v)
{
    float f = (float)v;
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static size_t tag_len(const char *tag)
{
    size_t n = strlen(tag);
    return n > MAX_TAG ? MAX_TAG : n;
}

static void event(struct buf *b, int64_t step, double wall_time, const char *file_version,
                  const struct am_tfscalar *v, size_t n)
{
    uint64_t bits;
    memcpy(&bits, &wall_time, 8);
    if (bits) { /* wall_time */
        key(b, 1, WIRE_64);
        le(b, bits, 8);
    }
    if (step) { /* step (int64: a negative one is its two's complement) */
        key(b, 2, WIRE_VARINT);
        varint(b, (uint64_t)step);
    }
    if (!v) {
        field_bytes(b, 3, file_version, strlen(file_version));
        return;
    }
    size_t summary = 0; /* Summary {1: repeated Value} */
    for (size_t i = 0; i < n; i++) {
        size_t vl = value_len(tag_len(v[i].tag));
        summary += 1 + varint_len(vl) + vl;
    }
    key(b, 5, WIRE_LEN);
    varint(b, summary);
    for (size_t i = 0; i < n; i++) {
        size_t tl = tag_len(v[i].tag);
        uint32_t fb = float_bits(v[i].value);
        key(b, 1, WIRE_LEN);
        varint(b, value_len(tl));
        field_bytes(b, 1, v[i].tag, tl);
        key(b, 2, WIRE_32);
        le(b, fb, 4);
    }
}

/* ---- the TFRecord framing ----------------------------------------------------------------- */

static uint32_t masked_crc(const void *data, size_t n)
{
    uint32_t c = am_crc32c(0, data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

size_t am_tfevents_record(uint8_t *out, size_t cap, int64_t step, double wall_time, const char *file_version,
                          const struct am_tfscalar *v, size_t n)
{
    struct buf count = {0};
    event(&count, step, wall_time, file_version, v, n);
    size_t total = 8 + 4 + count.len + 4;
    if (total > cap)
        return total;
    struct buf b = {.p = out, .cap = cap};
    le(&b, count.len, 8);
    le(&b, masked_crc(out, 8), 4);
    event(&b, step, wall_time, file_version, v, n);
    le(&b, masked_crc(out + 12, count.len), 4);
    return total;
}

/* ---- the file ------------------------------------------------------------------------------- */

static int write_record(struct am_tfevents *w, int64_t step, double wall_time, const char *file_version,
                        const struct am_tfscalar *v, size_t n, char *err, size_t err_len)
{
    uint8_t stack[2048];
    size_t len = am_tfevents_record(NULL, 0, step, wall_time, file_version, v, n);
    uint8_t *rec = len <= sizeof(stack) ? stack : malloc(len);
    if (!rec)
        return am_fail(err, err_len, "%s: out of memory for a record of %zu bytes", w->path, len);
    am_tfevents_record(rec, len, step, wall_time, file_version, v, n);
    ssize_t put_n = write(w->fd, rec, len);
    int e = errno;
    if (rec != stack)
        free(rec);
    if (put_n != (ssize_t)len)
        return am_fail(err, err_len, "%s: cannot write: %s", w->path, put_n < 0 ? strerror(e) : "short write");
    return 0;
}

int am_tfevents_open(struct am_tfevents *w, const char *dir, const char *host, double wall_time, char *err,
                     size_t err_len)
{
    w->fd = -1;
    if (am_mkdir_p(dir) < 0)
        return am_fail(err, err_len, "%s: cannot create the TensorBoard directory: %s", dir, strerror(errno));
    if (snprintf(w->path, sizeof w->path, "%s/events.out.tfevents.%ld.%s.%ld", dir, (long)wall_time, host,
                 (long)getpid()) >= (int)sizeof w->path)
        return am_fail(err, err_len, "%s: path too long for a TensorBoard file", dir);
    int fd = open(w->path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return am_fail(err, err_len, "%s: cannot create: %s", w->path, strerror(errno));
    w->fd = fd;
    if (write_record(w, 0, wall_time, "brain.Event:2", NULL, 0, err, err_len) < 0) {
        am_tfevents_close(w);
        return -1;
    }
    return 0;
}

int am_tfevents_scalars(struct am_tfevents *w, int64_t step, double wall_time, const struct am_tfscalar *v, size_t n,
                        char *err, size_t err_len)
{
    return write_record(w, step, wall_time, NULL, v, n, err, err_len);
}

void am_tfevents_close(struct am_tfevents *w)
{
    if (w->fd >= 0)
        close(w->fd);
    w->fd = -1;
}
