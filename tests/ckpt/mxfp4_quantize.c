/* mxfp4_quantize.c - an MXFP4 checkpoint, as gpt-oss ships its experts, of a Hugging Face
 * gpt_oss model directory, and the same weights dequantised, for tests/train/test-mxfp4-load.sh.
 *
 *   mxfp4_quantize SRC OUT
 *
 * Reads SRC/model.safetensors and SRC/config.json (tests/ckpt/quantize.c, the driver). Writes
 *   OUT/mxfp4: every `*.mlp.experts.gate_up_proj` [E, K, R] and `*.mlp.experts.down_proj` stored
 *              as `<name>_blocks` (U8 [E, R, K / 32, 16]: expert e's [R][K] matrix, the transpose
 *              of its [K][R], in groups of 32 along K, two e2m1 values a byte, the low nibble
 *              first) and `<name>_scales` (U8 [E, R, K / 32], e8m0: 2^(s - 127) a group), the
 *              scale of a group 2^(floor(log2(amax)) - 2) (its largest value then below 8, e2m1's
 *              6 at most after rounding: saturated), each value divided by it and rounded to the
 *              nearest e2m1 (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), ties to the even code; config.json
 *              with quantization_config {quant_method mxfp4, modules_to_not_convert} as gpt-oss's;
 *   OUT/deq:   the same model with those weights dequantised in fp32 (the e2m1 value times its
 *              group's scale), config.json without quantization_config.
 * The other tensors are copied as SRC has them (converted to F32). Deterministic: the same bytes
 * for the same input. The e2m1 and e8m0 coding here is written from the format's definition
 * (OCP Microscaling), apart from runtime/ckpt/quant.c's decoder, so that the test does not check
 * the loader against itself.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "quantize.h"

static const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

/* The nearest e2m1 code (sign in bit 3) to x, ties to the even code, saturated at 6. */
static uint8_t e2m1_encode(float x)
{
    uint8_t sign = signbit(x) ? 8 : 0, best = 0;
    float a = fabsf(x);
    for (uint8_t c = 1; c < 8; c++) {
        float d = fabsf(a - e2m1[c]), db = fabsf(a - e2m1[best]);
        if (d < db || (d == db && !(c & 1)))
            best = c;
    }
    return sign | best;
}

static float e2m1_decode(uint8_t c) { return (c & 8) ? -e2m1[c & 7] : e2m1[c & 7]; }

static int quantised(const struct am_st_info *t)
{
    size_t n = strlen(t->name);
    static const char *const ends[] = {".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"};
    if (t->ndim != 3 || t->shape[1] % 32)
        return 0;
    for (int i = 0; i < 2; i++)
        if (n > strlen(ends[i]) && strcmp(t->name + n - strlen(ends[i]), ends[i]) == 0)
            return 1;
    return 0;
}

/* <name>_blocks and <name>_scales of t's x [E, K, R]: expert e's transpose, 32 values a scale */
static void quantise(struct quantize_out *o, const struct am_st_info *t, const float *x, float *deq)
{
    int64_t E = t->shape[0], K = t->shape[1], R = t->shape[2], G = K / 32;
    uint8_t *blocks = quantize_alloc(o, (size_t)(E * R * G * 16)), *scales = quantize_alloc(o, (size_t)(E * R * G));
    char *bn = quantize_alloc(o, strlen(t->name) + 8), *sn = quantize_alloc(o, strlen(t->name) + 8);
    sprintf(bn, "%s_blocks", t->name);
    sprintf(sn, "%s_scales", t->name);
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t g = 0; g < G; g++) {
                const float *col = x + e * K * R + g * 32 * R + r; /* x[e][g * 32 + j][r] at col[j * R] */
                float amax = 0.0f;
                for (int j = 0; j < 32; j++)
                    amax = fmaxf(amax, fabsf(col[j * R]));
                int ex = amax > 0 ? (int)floor(log2((double)amax)) - 2 : -127;
                ex = ex < -127 ? -127 : ex > 127 ? 127 : ex;
                scales[(e * R + r) * G + g] = (uint8_t)(ex + 127);
                uint8_t *b = blocks + ((e * R + r) * G + g) * 16;
                for (int j = 0; j < 32; j += 2) {
                    uint8_t lo = e2m1_encode(ldexpf(col[j * R], -ex)), hi = e2m1_encode(ldexpf(col[(j + 1) * R], -ex));
                    b[j / 2] = (uint8_t)(lo | hi << 4);
                    deq[e * K * R + (g * 32 + j) * R + r] = ldexpf(e2m1_decode(lo), ex);
                    deq[e * K * R + (g * 32 + j + 1) * R + r] = ldexpf(e2m1_decode(hi), ex);
                }
            }
    quantize_add(o, (struct am_st_wtensor){.name = bn, .dtype = AM_ST_U8, .ndim = 4, .shape = {E, R, G, 16}, .data = blocks});
    quantize_add(o, (struct am_st_wtensor){.name = sn, .dtype = AM_ST_U8, .ndim = 3, .shape = {E, R, G}, .data = scales});
}

/* gpt-oss's: everything but the experts' matrices stored as it is */
static json_t *config(void)
{
    return json_pack("{s:s, s:[s, s, s, s]}", "quant_method", "mxfp4", "modules_to_not_convert", "model.layers.*.self_attn",
                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head");
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: mxfp4_quantize SRC OUT\n");
        return 2;
    }
    static const struct quantiser mxfp4 = {"mxfp4_quantize", "mxfp4", quantised, quantise, config};
    return quantize_run(&mxfp4, argv[1], argv[2]);
}
