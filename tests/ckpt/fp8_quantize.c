/* fp8_quantize.c - an FP8 checkpoint, as DeepSeek-V3 and Kimi ship them, of a Hugging Face
 * model directory, and the same weights dequantised, for tests/train/test-fp8-load.sh.
 *
 *   fp8_quantize SRC OUT B0 B1 [--narrow-scale WEIGHT | --drop-scale WEIGHT]
 *
 * Reads SRC/model.safetensors and SRC/config.json (tests/ckpt/quantize.c, the driver). Writes
 *   OUT/fp8: every 2-D projection weight (`*_proj.weight`, the experts' included) but those
 *            of the modules kept below stored as F8_E4M3 beside `<name>_scale_inv` (F32, one
 *            per B0 x B1 block, edge blocks partial), quantised as DeepSeek's quantiser does:
 *            per block scale = amax / 448 in fp32, each weight divided by it in fp32 and
 *            rounded to e4m3fn to nearest, ties to even; config.json with quantization_config
 *            {quant_method fp8, fmt e4m3, weight_block_size [B0, B1], modules_to_not_convert};
 *   OUT/deq: the same model with those weights dequantised in fp32 (the e4m3 value times its
 *            block's scale), config.json without quantization_config.
 * The other tensors are copied as SRC has them (converted to F32). For the loader's errors,
 * --narrow-scale keeps only the first 2 columns of WEIGHT's scale, --drop-scale leaves it out.
 *
 * The e4m3 encoding and decoding here are written from the format's definition (1 sign, 4
 * exponent bits of bias 7, 3 mantissa bits; subnormals; 0x7f / 0xff NaN; no infinity), apart
 * from runtime/ckpt/quant.c's, so the test does not check the loader against itself; where
 * torch is installed, test-fp8-load.sh also requires these files to equal, byte for byte,
 * those made by tests/ckpt/make_fp8_checkpoint.py with torch's float8_e4m3fn.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quantize.h"

/* Stored unquantised, as the written config's modules_to_not_convert says. */
static const char *const keep[] = {"model.layers.0.self_attn.o_proj", "lm_head"};

/* The nearest e4m3fn byte to x (|x| <= 448), ties to even. */
static unsigned char e4m3_encode(float x)
{
    unsigned char sign = signbit(x) ? 0x80 : 0;
    double a = fabs((double)x);
    if (a < 0x1p-6) /* subnormal: multiples of 2^-9 (a count of 8 is the smallest normal) */
        return sign | (unsigned char)nearbyint(a * 512.0);
    int e;
    double m = frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    e -= 1;                  /* a = (2m) * 2^e, 2m in [1, 2) */
    double mant = nearbyint((2.0 * m - 1.0) * 8.0);
    if (mant == 8.0) {
        mant = 0.0;
        e += 1;
    }
    return sign | (unsigned char)(((e + 7) << 3) | (int)mant);
}

static float e4m3_decode(unsigned char b)
{
    int e = (b >> 3) & 15, m = b & 7;
    double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp((double)m, -9);
    return (float)((b & 0x80) ? -v : v);
}

static int quantised(const struct am_st_info *t)
{
    size_t n = strlen(t->name);
    if (t->ndim != 2 || n < 12 || strcmp(t->name + n - 12, "_proj.weight") != 0)
        return 0;
    for (size_t i = 0; i < sizeof(keep) / sizeof(keep[0]); i++)
        if (strncmp(t->name, keep[i], n - 7) == 0 && strlen(keep[i]) == n - 7)
            return 0;
    return 1;
}

/* the scale of the weight named `narrow` cut to its first 2 columns; the one of `drop` left out */
static const char *narrow, *drop;
static int b0, b1; /* the block: B0 rows by B1 columns */

/* bytes: e4m3 of t's x, and its <name>_scale_inv: one scale per block, amax / 448 */
static void quantise(struct quantize_out *o, const struct am_st_info *t, const float *x, float *deq)
{
    int64_t R = t->shape[0], C = t->shape[1], sr = (R + b0 - 1) / b0, sc = (C + b1 - 1) / b1;
    unsigned char *bytes = quantize_alloc(o, (size_t)(R * C));
    float *scale = quantize_alloc(o, (size_t)(sr * sc) * sizeof(float));
    for (int64_t bi = 0; bi < sr; bi++)
        for (int64_t bj = 0; bj < sc; bj++) {
            float amax = 0.0f;
            for (int64_t r = bi * b0; r < R && r < (bi + 1) * b0; r++)
                for (int64_t c = bj * b1; c < C && c < (bj + 1) * b1; c++)
                    amax = fmaxf(amax, fabsf(x[r * C + c]));
            float s = amax / 448.0f;
            scale[bi * sc + bj] = s;
            for (int64_t r = bi * b0; r < R && r < (bi + 1) * b0; r++)
                for (int64_t c = bj * b1; c < C && c < (bj + 1) * b1; c++) {
                    bytes[r * C + c] = e4m3_encode(x[r * C + c] / s);
                    deq[r * C + c] = e4m3_decode(bytes[r * C + c]) * s;
                }
        }
    char *sname = quantize_alloc(o, strlen(t->name) + 11);
    sprintf(sname, "%s_scale_inv", t->name);
    quantize_add(o, (struct am_st_wtensor){.name = t->name, .dtype = AM_ST_F8_E4M3, .ndim = 2, .shape = {R, C}, .data = bytes});
    if (narrow && strcmp(t->name, narrow) == 0) { /* rows of 2 scales, at the top of the buffer */
        for (int64_t bi = 0; bi < sr; bi++)
            memmove(scale + bi * 2, scale + bi * sc, 2 * sizeof(float));
        sc = 2;
    }
    if (!(drop && strcmp(t->name, drop) == 0))
        quantize_add(o, (struct am_st_wtensor){.name = sname, .dtype = AM_ST_F32, .ndim = 2, .shape = {sr, sc}, .data = scale});
}

static json_t *config(void)
{
    json_t *mods = json_array();
    for (size_t i = 0; i < sizeof(keep) / sizeof(keep[0]); i++)
        json_array_append_new(mods, json_string(keep[i]));
    return json_pack("{s:s, s:s, s:s, s:[i, i], s:o}", "activation_scheme", "dynamic", "fmt", "e4m3", "quant_method", "fp8",
                     "weight_block_size", b0, b1, "modules_to_not_convert", mods);
}

int main(int argc, char **argv)
{
    if (argc == 7 && strcmp(argv[5], "--narrow-scale") == 0)
        narrow = argv[6];
    else if (argc == 7 && strcmp(argv[5], "--drop-scale") == 0)
        drop = argv[6];
    else if (argc != 5) {
        fprintf(stderr, "usage: fp8_quantize SRC OUT B0 B1 [--narrow-scale WEIGHT | --drop-scale WEIGHT]\n");
        return 2;
    }
    b0 = atoi(argv[3]), b1 = atoi(argv[4]);
    if (b0 < 1 || b1 < 1) {
        fprintf(stderr, "fp8_quantize: block sizes must be positive\n");
        return 2;
    }
    static const struct quantiser fp8 = {"fp8_quantize", "fp8", quantised, quantise, config};
    return quantize_run(&fp8, argv[1], argv[2]);
}
