/* quant.c - FP8 and MXFP4 checkpoint tensors dequantised (quant.h). */
#include "quant.h"

#include <inttypes.h>
#include <math.h>
#include <string.h>

float am_e4m3_to_f32(uint8_t b)
{
    uint32_t sign = (uint32_t)(b & 0x80) << 24, exp = (b >> 3) & 0xf, mant = b & 0x7;
    if ((b & 0x7f) == 0x7f)
        return am_bits_f32(sign | 0x7ff00000u);
    if (exp != 0) /* (1 + m/8) * 2^(exp - 7): fp32's exponent is exp - 7 + 127 */
        return am_bits_f32(sign | ((exp + 120) << 23) | (mant << 20));
    float v = (float)mant * 0x1p-9f; /* subnormal: m/8 * 2^-6, exact */
    return sign ? -v : v;
}

void am_fp8_dequant(const struct am_st_info *w, const struct am_st_info *s, const int64_t block[2], int64_t r0,
                    int64_t r1, int64_t c0, int64_t c1, float *dst)
{
    int64_t C = w->shape[1], sc = s->shape[1];
    float lut[256]; /* every byte's value: a lookup per element */
    for (int b = 0; b < 256; b++)
        lut[b] = am_e4m3_to_f32((uint8_t)b);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w->data + r * C;
        const unsigned char *srow = s->data + (size_t)((r / block[0]) * sc) * sizeof(float);
        float *out = dst + (r - r0) * (c1 - c0);
        for (int64_t c = c0; c < c1;) {
            int64_t j = c / block[1], end = (j + 1) * block[1] < c1 ? (j + 1) * block[1] : c1;
            float scale;
            memcpy(&scale, srow + (size_t)j * sizeof(float), sizeof(float));
            for (; c < end; c++)
                out[c - c0] = lut[row[c]] * scale;
        }
    }
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int am_fp8_check(const char *path, const char *name, const struct am_st_info *w, const struct am_st_info *s,
                 const int64_t block[2], struct am_errors *err)
{
    char have[200], want[200], wshape[200];
    if (w->ndim != 2) {
        am_errorf(err, NULL, "%s: tensor '%s': an F8_E4M3 tensor of shape %s; am dequantises 2-d weights only, "
                  "with one scale per %" PRId64 " x %" PRId64 " block (store it in bf16 or fp32, or list it in "
                  "quantization_config.modules_to_not_convert)", path, name,
                  am_st_shape_str(w->shape, w->ndim, have, sizeof(have)), block[0], block[1]);
        return -1;
    }
    int64_t shape[2] = {ceil_div(w->shape[0], block[0]), ceil_div(w->shape[1], block[1])};
    am_st_shape_str(shape, 2, want, sizeof(want));
    if (!s) {
        am_errorf(err, NULL, "%s: tensor '%s' is F8_E4M3 but '%s" AM_FP8_SCALE_SUFFIX "' is missing: an FP8 "
                  "checkpoint holds one fp32 scale per %" PRId64 " x %" PRId64 " block beside each weight, here %s "
                  "(an incomplete download, or a checkpoint quantised another way)", path, name, name, block[0],
                  block[1], want);
        return -1;
    }
    if (s->dtype != AM_ST_F32 || s->ndim != 2 || s->shape[0] != shape[0] || s->shape[1] != shape[1]) {
        am_errorf(err, NULL, "%s: tensor '%s" AM_FP8_SCALE_SUFFIX "' is %s %s, but the FP8 weight '%s' of %s in "
                  "blocks of %" PRId64 " x %" PRId64 " (quantization_config.weight_block_size) needs F32 %s, one "
                  "scale per block (does weight_block_size match the checkpoint?)", path, name,
                  am_st_dtype_name(s->dtype), am_st_shape_str(s->shape, s->ndim, have, sizeof(have)), name,
                  am_st_shape_str(w->shape, 2, wshape, sizeof(wshape)), block[0], block[1], want);
        return -1;
    }
    return 0;
}

float am_e2m1_to_f32(uint8_t nibble)
{
    static const float v[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    return v[nibble & 0xf];
}

void am_mxfp4_dequant(const uint8_t *blocks, const uint8_t *scales, int64_t E, int64_t R, int64_t G, float *dst)
{
    int64_t K = G * 32; /* expert e's [R][K], written transposed: dst[e][k][r] */
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *b = blocks + ((e * R + r) * G + g) * 16;
                int exp = (int)scales[(e * R + r) * G + g] - 127;
                float *out = dst + e * K * R + r;
                for (int64_t i = 0; i < 16; i++) {
                    int64_t k = g * 32 + 2 * i;
                    out[k * R] = ldexpf(am_e2m1_to_f32(b[i] & 0xf), exp);
                    out[(k + 1) * R] = ldexpf(am_e2m1_to_f32(b[i] >> 4), exp);
                }
            }
}

int am_mxfp4_check(const char *path, const char *name, const struct am_st_info *b, const struct am_st_info *s,
                   struct am_errors *err)
{
    char have[200], want[200], each[200];
    if (!b || !s) {
        am_errorf(err, NULL, "%s: '%s_%s' is missing beside '%s_%s': MXFP4 weights are stored as both, the e2m1 "
                  "blocks and their e8m0 scales (an incomplete download?)", path, name, b ? "scales" : "blocks", name,
                  b ? "blocks" : "scales");
        return -1;
    }
    if (b->dtype != AM_ST_U8 || b->ndim != 4 || b->shape[3] != 16) {
        am_errorf(err, NULL, "%s: tensor '%s_blocks' is %s %s, but MXFP4 blocks are U8 [experts, rows, groups, 16], "
                  "32 e2m1 values in 16 bytes a group (gpt-oss's layout; a checkpoint quantised another way?)", path,
                  name, am_st_dtype_name(b->dtype), am_st_shape_str(b->shape, b->ndim, have, sizeof(have)));
        return -1;
    }
    if (s->dtype != AM_ST_U8 || s->ndim != 3 || s->shape[0] != b->shape[0] || s->shape[1] != b->shape[1] ||
        s->shape[2] != b->shape[2]) {
        am_errorf(err, NULL, "%s: tensor '%s_scales' is %s %s, but the blocks '%s_blocks' of %s need U8 %s, one "
                  "e8m0 exponent per 32 values (the two come from different checkpoints?)", path, name,
                  am_st_dtype_name(s->dtype), am_st_shape_str(s->shape, s->ndim, have, sizeof(have)), name,
                  am_st_shape_str(b->shape, 4, want, sizeof(want)), am_st_shape_str(b->shape, 3, each, sizeof(each)));
        return -1;
    }
    return 0;
}
