/* half.h - IEEE half (fp16) and bfloat16 <-> float conversions, exact and branch-light:
 * widening is exact (subnormals, infinities and NaN payloads kept); narrowing rounds to
 * nearest, ties to even, as torch does. Header-only: the safetensors reader, the
 * communicators' reductions and the kernels share one definition. */
#ifndef AM_HALF_H
#define AM_HALF_H

#include <stdint.h>
#include <string.h>

static inline float am_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t am_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float am_bf16_to_f32(uint16_t h) { return am_bits_f32((uint32_t)h << 16); }

static inline float am_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0x1f) /* infinity or NaN: keep the payload */
        return am_bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp != 0)
        return am_bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
    if (mant == 0)
        return am_bits_f32(sign);
    /* subnormal: mant * 2^-24; normalise so the leading 1 lands on bit 10 */
    int shift = 0;
    while (!(mant & 0x400)) {
        mant <<= 1;
        shift++;
    }
    return am_bits_f32(sign | ((uint32_t)(113 - shift) << 23) | ((mant & 0x3ff) << 13));
}

static inline uint16_t am_f32_to_bf16(float f)
{
    uint32_t x = am_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN: truncate, keep it a (quiet) NaN */
        return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

static inline uint16_t am_f32_to_f16(float f)
{
    uint32_t x = am_f32_bits(f), sign = (x >> 16) & 0x8000, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u) /* 65520 and above round to infinity */
        return (uint16_t)(sign | 0x7c00);
    if (a >= 0x38800000u) { /* normal half */
        uint32_t h = ((a >> 23) - 112) << 10 | ((a >> 13) & 0x3ff), r = a & 0x1fff;
        if (r > 0x1000 || (r == 0x1000 && (h & 1)))
            h++;
        return (uint16_t)(sign | h);
    }
    /* subnormal half (or zero): value / 2^-24, rounded to nearest even */
    uint32_t e = a >> 23;
    if (e < 102) /* below 2^-25: rounds to zero */
        return (uint16_t)sign;
    uint32_t mant = (a & 0x7fffff) | 0x800000, shift = 126 - e;
    uint32_t q = mant >> shift, r = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (r > half || (r == half && (q & 1)))
        q++;
    return (uint16_t)(sign | q);
}

/* Transformer Engine's split of an fp32 master (its bits u) into a bf16 parameter *hi and a
 * 16-bit remainder *lo (FusedAdam's store_param_remainders): the high half, plus one when the
 * low half's top bit is set (the master rounded to nearest, ties away from zero, not to even:
 * TE's "round up"), and the low half; and the master rebuilt from the two, exactly. */
static inline void am_te_master_split(uint32_t u, uint16_t *hi, uint16_t *lo)
{
    *lo = (uint16_t)(u & 0xffffu);
    *hi = (uint16_t)((u >> 16) + ((u & 0x8000u) ? 1u : 0u));
}

static inline uint32_t am_te_master_join(uint16_t hi, uint16_t lo)
{
    return ((uint32_t)(uint16_t)(hi - ((lo & 0x8000u) ? 1u : 0u)) << 16) | lo;
}

#endif
