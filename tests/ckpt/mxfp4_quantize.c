/* mxfp4_quantize.c - an MXFP4 checkpoint, as gpt-oss ships its experts, of a Hugging Face
 * gpt_oss model directory, and the same weights dequantised, for tests/train/test-mxfp4-load.sh.
 *
 *   mxfp4_quantize SRC OUT
 *
 * Reads SRC/model.safetensors and SRC/config.json. Writes
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
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "safetensors.h"

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

static int write_config(const char *src, const char *dir, int quant)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/config.json", src);
    json_error_t je;
    json_t *cfg = json_load_file(path, JSON_PRESERVE_ORDER, &je);
    if (!cfg) {
        fprintf(stderr, "mxfp4_quantize: %s: %s\n", path, je.text);
        return -1;
    }
    if (quant) /* gpt-oss's: everything but the experts' matrices stored as it is */
        json_object_set_new(cfg, "quantization_config",
                            json_pack("{s:s, s:[s, s, s, s]}", "quant_method", "mxfp4", "modules_to_not_convert",
                                      "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                      "lm_head"));
    snprintf(path, sizeof(path), "%s/config.json", dir);
    int rc = json_dump_file(cfg, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(cfg);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: mxfp4_quantize SRC OUT\n");
        return 2;
    }
    const char *src = argv[1], *out = argv[2];
    struct am_errors err;
    am_errors_init(&err);
    char path[4200], q_dir[4096], deq_dir[4096];
    snprintf(q_dir, sizeof(q_dir), "%s/mxfp4", out);
    snprintf(deq_dir, sizeof(deq_dir), "%s/deq", out);
    mkdir(out, 0755);
    mkdir(q_dir, 0755);
    mkdir(deq_dir, 0755);
    snprintf(path, sizeof(path), "%s/model.safetensors", src);
    struct am_st_file *f;
    if (am_st_open(path, &f, &err) != 0) {
        fprintf(stderr, "mxfp4_quantize: %s\n", err.msg[0]);
        return 1;
    }
    size_t n = am_st_count(f);
    struct am_st_wtensor *q = calloc(2 * n, sizeof(*q)), *d = calloc(n, sizeof(*d));
    void **bufs = calloc(5 * n, sizeof(*bufs));
    size_t nq = 0, nb = 0;
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        const struct am_st_info *t = am_st_at(f, i);
        float *x = malloc((size_t)t->numel * sizeof(float));
        bufs[nb++] = x;
        if (am_st_read_f32(f, t, 0, t->numel, x, &err) != 0) {
            fprintf(stderr, "mxfp4_quantize: %s\n", err.msg[0]);
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
        int64_t E = t->shape[0], K = t->shape[1], R = t->shape[2], G = K / 32;
        uint8_t *blocks = malloc((size_t)(E * R * G * 16)), *scales = malloc((size_t)(E * R * G));
        float *deq = malloc((size_t)t->numel * sizeof(float));
        char *bn = malloc(strlen(t->name) + 8), *sn = malloc(strlen(t->name) + 8);
        bufs[nb++] = blocks;
        bufs[nb++] = scales;
        bufs[nb++] = bn;
        bufs[nb++] = sn;
        d[i].data = deq;
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
        q[nq++] = (struct am_st_wtensor){.name = bn, .dtype = AM_ST_U8, .ndim = 4, .shape = {E, R, G, 16}, .data = blocks};
        q[nq++] = (struct am_st_wtensor){.name = sn, .dtype = AM_ST_U8, .ndim = 3, .shape = {E, R, G}, .data = scales};
        bufs[nb++] = deq;
    }
    if (rc == 0) {
        snprintf(path, sizeof(path), "%s/model.safetensors", q_dir);
        if (am_st_write(path, q, nq, NULL, 0, 0, &err) != 0)
            rc = 1;
        snprintf(path, sizeof(path), "%s/model.safetensors", deq_dir);
        if (rc == 0 && am_st_write(path, d, n, NULL, 0, 0, &err) != 0)
            rc = 1;
        if (rc)
            fprintf(stderr, "mxfp4_quantize: %s\n", err.msg[0]);
    }
    if (rc == 0 && (write_config(src, q_dir, 1) != 0 || write_config(src, deq_dir, 0) != 0))
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
