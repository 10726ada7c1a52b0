/* quant.h - quantised checkpoint tensors, dequantised at load into fp32.
 *
 * FP8 (DeepSeek-V3's and Kimi's checkpoints; config.json's quantization_config with
 * quant_method "fp8", fmt "e4m3", weight_block_size [b0, b1]): a 2-d weight W of R x C is
 * stored as F8_E4M3 (e4m3fn: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity,
 * 0x7f and 0xff NaN, subnormals m/8 * 2^-6; 448 the largest) beside `<name>_scale_inv`, F32
 * of ceil(R / b0) x ceil(C / b1), one per block (the edge blocks partial). The weight is
 * fp8(W[r][c]) * scale_inv[r / b0][c / b1], multiplied in fp32 (DeepSeek's weight_dequant,
 * transformers' finegrained-FP8 dequantisation): one rounding, to fp32; a bf16 model rounds
 * that once more, from fp32 to bf16 (as those do when the default dtype is bf16).
 *
 * MXFP4 (gpt-oss's experts, `<name>_blocks` and `<name>_scales`; transformers'
 * integrations/mxfp4.py convert_moe_packed_tensors): blocks U8 [E, R, G, 16], each byte two
 * e2m1 values, the low nibble first (e2m1: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, the sign in bit 3);
 * scales U8 [E, R, G], e8m0: the 32 values of group g are multiplied by 2^(scale - 127)
 * (255 too is 2^128, as transformers' torch.ldexp computes: a zero stays zero, the others become
 * infinities, where the OCP spec says NaN). The result is
 * transformers' [E, G * 32, R]: expert e's [R][G * 32] matrix transposed. Exact in fp32 (and
 * in bf16) except where 2^(scale - 127) overflows.
 */
#ifndef AM_QUANT_H
#define AM_QUANT_H

#include <stdint.h>

#include "errors.h"
#include "safetensors.h"

/* The suffix of an FP8 weight's scale tensor. */
#define AM_FP8_SCALE_SUFFIX "_scale_inv"

/* One e4m3fn byte as fp32, exactly (a NaN is sign | 0x7ff00000, the bits torch gives). */
float am_e4m3_to_f32(uint8_t b);

/* Rows [r0, r1) x columns [c0, c1) of an FP8 block-quantised weight w (F8_E4M3, R x C) with
 * its scales s (F32, ceil(R / b0) x ceil(C / b1); checked by am_fp8_check), dequantised into
 * dst (row-major, (r1 - r0) x (c1 - c0)). Reads only those rows' and columns' bytes and their
 * blocks' scales. */
void am_fp8_dequant(const struct am_st_info *w, const struct am_st_info *s, const int64_t block[2], int64_t r0,
                    int64_t r1, int64_t c0, int64_t c1, float *dst);

/* Checks that w (an F8_E4M3 tensor named `name` in file `path`) can be dequantised with the
 * scale tensor s (NULL: missing) and blocks b0 x b1: w 2-d, s F32 of ceil(R / b0) x
 * ceil(C / b1). Returns 0, or -1 with a message naming the tensor, the rule and the fix. */
int am_fp8_check(const char *path, const char *name, const struct am_st_info *w, const struct am_st_info *s,
                 const int64_t block[2], struct am_errors *err);

/* e2m1 nibble -> its value (transformers' FP4_VALUES). */
float am_e2m1_to_f32(uint8_t nibble);

/* MXFP4 blocks [E, R, G, 16] and scales [E, R, G] into dst, [E, G * 32, R] fp32 (above).
 * Experts [e0, e1) alone (an ep rank's): blocks + e0 * R * G * 16, scales + e0 * R * G, E = e1 - e0. */
void am_mxfp4_dequant(const uint8_t *blocks, const uint8_t *scales, int64_t E, int64_t R, int64_t G, float *dst);

/* Checks `<name>_blocks` (b) and `<name>_scales` (s) of file `path` (NULL: missing): b U8
 * [E, R, G, 16], s U8 [E, R, G]. Returns 0, or -1 with a message naming the tensor, the rule
 * and the fix. */
int am_mxfp4_check(const char *path, const char *name, const struct am_st_info *b, const struct am_st_info *s,
                   struct am_errors *err);

#endif
