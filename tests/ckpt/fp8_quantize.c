/* fp8_quantize.c - an FP8 checkpoint, as DeepSeek-V3 and Kimi ship them, of a Hugging Face
 * model directory, and the same weights dequantised, for tests/train/test-fp8-load.sh.
 *
 *   fp8_quantize SRC OUT B0 B1 [--narrow-scale WEIGHT | --drop-scale WEIGHT]
 *
 * Reads SRC/model.safetensors and SRC/config.json. Writes
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
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "safetensors.h"

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

static int write_config(const char *src, const char *dir, int b0, int b1, int quant)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", src);
    json_error_t je;
    json_t *cfg = json_load_file(path, JSON_PRESERVE_ORDER, &je);
    if (!cfg) {
        fprintf(stderr, "fp8_quantize: %s: %s\n", path, je.text);
        return -1;
    }
    if (quant) {
        json_t *mods = json_array();
        for (size_t i = 0; i < sizeof(keep) / sizeof(keep[0]); i++)
            json_array_append_new(mods, json_string(keep[i]));
        json_object_set_new(cfg, "quantization_config",
                            json_pack("{s:s, s:s, s:s, s:[i, i], s:o}", "activation_scheme", "dynamic", "fmt",
                                      "e4m3", "quant_method", "fp8", "weight_block_size", b0, b1,
                                      "modules_to_not_convert", mods));
    }
    snprintf(path, sizeof(path), "%s/config.json", dir);
    int rc = json_dump_file(cfg, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(cfg);
    return rc;
}

int main(int argc, char **argv)
{
    const char *narrow = NULL, *drop = NULL;
    if (argc == 7 && strcmp(argv[5], "--narrow-scale") == 0)
        narrow = argv[6];
    else if (argc == 7 && strcmp(argv[5], "--drop-scale") == 0)
        drop = argv[6];
    else if (argc != 5) {
        fprintf(stderr, "usage: fp8_quantize SRC OUT B0 B1 [--narrow-scale WEIGHT | --drop-scale WEIGHT]\n");
        return 2;
    }
    const char *src = argv[1], *out = argv[2];
    int b0 = atoi(argv[3]), b1 = atoi(argv[4]);
    if (b0 < 1 || b1 < 1) {
        fprintf(stderr, "fp8_quantize: block sizes must be positive\n");
        return 2;
    }
    struct am_errors err;
    am_errors_init(&err);
    char path[4200], fp8_dir[4096], deq_dir[4096]; /* path: a dir plus a file name */
    snprintf(fp8_dir, sizeof(fp8_dir), "%s/fp8", out);
    snprintf(deq_dir, sizeof(deq_dir), "%s/deq", out);
    mkdir(out, 0755);
    mkdir(fp8_dir, 0755);
    mkdir(deq_dir, 0755);
    snprintf(path, sizeof(path), "%s/model.safetensors", src);
    struct am_st_file *f;
    if (am_st_open(path, &f, &err) != 0) {
        fprintf(stderr, "fp8_quantize: %s\n", err.msg[0]);
        return 1;
    }
    size_t n = am_st_count(f);
    struct am_st_wtensor *q = calloc(2 * n, sizeof(*q)), *d = calloc(n, sizeof(*d));
    void **bufs = calloc(4 * n, sizeof(*bufs)); /* a quantised tensor owns 4 buffers */
    size_t nq = 0, nb = 0;
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        const struct am_st_info *t = am_st_at(f, i);
        float *x = malloc((size_t)t->numel * sizeof(float));
        size_t xi = nb++;
        bufs[xi] = x;
        if (am_st_read_f32(f, t, 0, t->numel, x, &err) != 0) {
            fprintf(stderr, "fp8_quantize: %s\n", err.msg[0]);
            rc = 1;
            break;
        }
        struct am_st_wtensor w = {.name = t->name, .dtype = AM_ST_F32, .ndim = t->ndim, .data = x};
        memcpy(w.shape, t->shape, sizeof(w.shape));
        d[i] = w;
        if (!quantised(t)) {
            q[nq++] = w;
            continue;
        }
        int64_t R = t->shape[0], C = t->shape[1], sr = (R + b0 - 1) / b0, sc = (C + b1 - 1) / b1;
        unsigned char *bytes = malloc((size_t)(R * C));
        float *scale = malloc((size_t)(sr * sc) * sizeof(float)), *deq = malloc((size_t)(R * C) * sizeof(float));
        bufs[nb++] = bytes;
        bufs[nb++] = scale;
        d[i].data = deq;
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
        bufs[xi] = deq; /* d[i] holds deq; x is no longer needed */
        free(x);
        char *sname = malloc(strlen(t->name) + 11);
        sprintf(sname, "%s_scale_inv", t->name);
        bufs[nb++] = sname;
        q[nq] = w;
        q[nq].dtype = AM_ST_F8_E4M3;
        q[nq++].data = bytes;
        if (narrow && strcmp(t->name, narrow) == 0) /* rows of 2 scales, at the top of the buffer */
            for (int64_t bi = 0; bi < sr; bi++)
                memmove(scale + bi * 2, scale + bi * sc, 2 * sizeof(float));
        if (!(drop && strcmp(t->name, drop) == 0))
            q[nq++] = (struct am_st_wtensor){
                .name = sname, .dtype = AM_ST_F32, .ndim = 2, .shape = {sr, narrow && !strcmp(t->name, narrow) ? 2 : sc}, .data = scale};
    }
    if (rc == 0) {
        snprintf(path, sizeof(path), "%s/model.safetensors", fp8_dir);
        if (am_st_write(path, q, nq, NULL, 0, 0, &err) != 0)
            rc = 1;
        snprintf(path, sizeof(path), "%s/model.safetensors", deq_dir);
        if (rc == 0 && am_st_write(path, d, n, NULL, 0, 0, &err) != 0)
            rc = 1;
        if (rc)
            fprintf(stderr, "fp8_quantize: %s\n", err.msg[0]);
    }
    if (rc == 0 && (write_config(src, fp8_dir, b0, b1, 1) != 0 || write_config(src, deq_dir, b0, b1, 0) != 0))
        rc = 1;
    for (size_t i = 0; i < nb; i++)
        free(bufs[i]);
    free(bufs);
    free(q);
    free(d);
    am_st_close(f);
    am_errors_free(&err);
    return rc;
}
