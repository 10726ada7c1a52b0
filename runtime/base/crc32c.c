/* crc32c.c - CRC-32C (Castagnoli), with SSE 4.2's instruction where the CPU has it (crc32c.h). */
#include "crc32c.h"

#include <string.h>

static uint32_t crc32c_soft(uint32_t crc, const unsigned char *p, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
    return crc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse(uint32_t crc, const unsigned char *p, size_t len)
{
    uint64_t c = crc;
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        len -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (len--)
        c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}
#endif

uint32_t am_crc32c(uint32_t crc, const void *buf, size_t len)
{
    crc = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("sse4.2"))
        return ~crc32c_sse(crc, buf, len);
#endif
    return ~crc32c_soft(crc, buf, len);
}
