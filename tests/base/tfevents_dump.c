/* tfevents_dump FILE - prints a TensorBoard event file one line per value, checking its
 * framing (both masked crc32c of every record) and decoding each Event independently of the
 * writer's code paths:
 *   version WALL_TIME STEP FILE_VERSION
 *   scalar WALL_TIME STEP TAG VALUE          (VALUE: the float, %.9g)
 * Exit 1 with a message on a bad record (the test scripts compare the lines with the run's
 * step records). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"

static uint32_t masked(const uint8_t *p, size_t n)
{
    uint32_t c = am_crc32c(0, p, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static uint64_t rd_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static int rd_varint(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; *p < end && shift < 64; shift += 7) {
        uint8_t b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return 0;
    }
    return -1;
}

static int bad(const char *what, long off)
{
    fprintf(stderr, "tfevents_dump: %s at byte %ld\n", what, off);
    return 1;
}

/* Summary {1: Value {1: tag, 2: simple_value}} */
static int summary(const uint8_t *p, const uint8_t *end, double wall, int64_t step)
{
    while (p < end) {
        uint64_t k, len;
        if (rd_varint(&p, end, &k) < 0 || k != (1 << 3 | 2) || rd_varint(&p, end, &len) < 0 || len > (uint64_t)(end - p))
            return -1;
        const uint8_t *v = p, *vend = p + len;
        p = vend;
        char tag[256] = "";
        float f = 0;
        while (v < vend) {
            uint64_t vk, tl;
            if (rd_varint(&v, vend, &vk) < 0)
                return -1;
            if (vk == (1 << 3 | 2)) {
                if (rd_varint(&v, vend, &tl) < 0 || tl > (uint64_t)(vend - v) || tl >= sizeof tag)
                    return -1;
                memcpy(tag, v, tl);
                tag[tl] = 0;
                v += tl;
            } else if (vk == (2 << 3 | 5) && vend - v >= 4) {
                uint32_t b = (uint32_t)rd_le(v, 4);
                memcpy(&f, &b, 4);
                v += 4;
            } else
                return -1;
        }
        printf("scalar %.6f %lld %s %.9g\n", wall, (long long)step, tag, f);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: tfevents_dump FILE\n");
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    uint8_t head[12];
    long off = 0;
    size_t got;
    while ((got = fread(head, 1, 12, f)) == 12) {
        uint64_t len = rd_le(head, 8);
        if ((uint32_t)rd_le(head + 8, 4) != masked(head, 8))
            return bad("length crc mismatch", off);
        uint8_t *data = malloc(len + 4);
        if (!data || fread(data, 1, len + 4, f) != len + 4)
            return bad("truncated record", off);
        if ((uint32_t)rd_le(data + len, 4) != masked(data, len))
            return bad("data crc mismatch", off);
        const uint8_t *p = data, *end = data + len;
        double wall = 0;
        int64_t step = 0;
        while (p < end) {
            uint64_t k, v;
            if (rd_varint(&p, end, &k) < 0)
                return bad("bad key", off);
            if (k == (1 << 3 | 1) && end - p >= 8) {
                uint64_t b = rd_le(p, 8);
                memcpy(&wall, &b, 8);
                p += 8;
            } else if (k == (2 << 3 | 0)) {
                if (rd_varint(&p, end, &v) < 0)
                    return bad("bad step", off);
                step = (int64_t)v;
            } else if (k == (3 << 3 | 2) || k == (5 << 3 | 2)) {
                if (rd_varint(&p, end, &v) < 0 || v > (uint64_t)(end - p))
                    return bad("bad length", off);
                if (k == (3 << 3 | 2))
                    printf("version %.6f %lld %.*s\n", wall, (long long)step, (int)v, (const char *)p);
                else if (summary(p, p + v, wall, step) < 0)
                    return bad("bad summary", off);
                p += v;
            } else
                return bad("unexpected field", off);
        }
        free(data);
        off += 12 + (long)len + 4;
    }
    if (got != 0)
        return bad("truncated header", off);
    fclose(f);
    return 0;
}
