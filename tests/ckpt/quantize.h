/* quantize.h - the driver the test quantisers share (tests/ckpt/fp8_quantize.c,
 * mxfp4_quantize.c; quantize.c): a Hugging Face model directory written again as a quantised
 * checkpoint and as the same weights dequantised. A quantiser says which tensors it quantises,
 * how it stores one and what quantization_config it writes; the driver reads, writes and frees.
 */
#ifndef AM_TESTS_QUANTIZE_H
#define AM_TESTS_QUANTIZE_H

#include <jansson.h>
#include <stddef.h>

#include "safetensors.h"

/* What quantise() adds to: the quantised checkpoint's tensors, the buffers freed at the end. */
struct quantize_out;

struct quantiser {
    const char *name; /* the program, before its messages: "fp8_quantize" */
    const char *dir;  /* OUT's folder of the quantised checkpoint: "fp8" */
    /* whether tensor t is quantised (the others are copied as F32) */
    int (*quantised)(const struct am_st_info *t);
    /* stores t, of values x, in the quantised checkpoint (quantize_add, in the order written)
     * and writes its dequantised values, t->numel floats, to deq */
    void (*quantise)(struct quantize_out *o, const struct am_st_info *t, const float *x, float *deq);
    /* the quantised checkpoint's quantization_config (a new reference) */
    json_t *(*config)(void);
};

/* Reads SRC/model.safetensors and SRC/config.json; writes OUT/<q->dir> (the tensors
 * q->quantised() chooses as q->quantise() stores them, the others converted to F32;
 * config.json with q->config() as quantization_config) and OUT/deq (the chosen tensors
 * dequantised, all F32; config.json as SRC's). Returns 0, or 1 with a message on stderr. */
int quantize_run(const struct quantiser *q, const char *src, const char *out);

/* bytes freed when quantize_run ends */
void *quantize_alloc(struct quantize_out *o, size_t bytes);

/* w (its name and data alive until quantize_run ends) as the next tensor of the quantised checkpoint */
void quantize_add(struct quantize_out *o, struct am_st_wtensor w);

#endif
