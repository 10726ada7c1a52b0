/* checkpoint.h - Hugging Face model directories: read the weights (model.safetensors, or the
 * shards named by model.safetensors.index.json) and save a directory transformers loads.
 *
 * Reading: am_ckpt_open maps every file once; am_ckpt_read copies one tensor, or a slice of
 * it along one dimension (rows [r0, r1) of a 2-d weight, or columns [c0, c1)), converted to
 * the destination's dtype, so that a tensor-parallel rank reads only its shard. The model's
 * architecture comes from config.json through the recipe library (model_config.h), not from
 * here.
 *
 * Saving: am_ckpt_save writes config.json (from struct am_model_config, with Hugging Face's
 * key names, torch_dtype "float32") and the weights (model.safetensors, or shards of at most
 * max_shard_bytes with model.safetensors.index.json, as transformers' save_pretrained does)
 * into DIR.tmp-XXXXXX beside DIR, fsyncs every file and the directory, then swaps it with DIR
 * in one rename (renameat2 RENAME_EXCHANGE; where the filesystem lacks it, DIR is first
 * renamed aside) and removes the previous checkpoint. Until the swap, DIR is the previous
 * checkpoint, untouched; a failure at any point before it leaves DIR as it was and removes the
 * temporary directory. Other top-level files of the previous checkpoint (tokenizer files,
 * generation_config.json, ...) are carried over (hard-linked); its subdirectories are not.
 */
#ifndef AM_CHECKPOINT_H
#define AM_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "errors.h"
#include "model_config.h"
#include "safetensors.h"
#include "tensor.h"

#define AM_CKPT_SINGLE "model.safetensors"
#define AM_CKPT_INDEX "model.safetensors.index.json"
#define AM_CKPT_DEFAULT_SHARD_BYTES 5000000000ULL /* transformers' max_shard_size="5GB" */

struct am_ckpt;

/* Opens a model directory: model.safetensors when present (transformers prefers it), else
 * model.safetensors.index.json and every shard it names. Every file is validated. */
int am_ckpt_open(const char *dir, struct am_ckpt **out, struct am_errors *err);
void am_ckpt_close(struct am_ckpt *c);

const char *am_ckpt_dir(const struct am_ckpt *c);
/* The tensors, sorted by name (for checking that every one was used). */
size_t am_ckpt_count(const struct am_ckpt *c);
const char *am_ckpt_name(const struct am_ckpt *c, size_t i);
/* The tensor's description (dtype, shape) and the file holding it, or NULL. */
const struct am_st_info *am_ckpt_find(const struct am_ckpt *c, const char *name, const struct am_st_file **file);

/* A part of a tensor along one dimension: indices [begin, end) of dimension `dim`. */
struct am_ckpt_slice {
    int dim;
    int64_t begin, end;
};
static inline struct am_ckpt_slice am_ckpt_rows(int64_t r0, int64_t r1) { return (struct am_ckpt_slice){0, r0, r1}; }
static inline struct am_ckpt_slice am_ckpt_cols(int64_t c0, int64_t c1) { return (struct am_ckpt_slice){1, c0, c1}; }

/* Copies tensor `name` (slice NULL: all of it) into dst, a host tensor of dtype F32, BF16 or
 * F16 whose shape must equal the tensor's (with the sliced dimension end - begin). Errors
 * (missing tensor, shape mismatch naming both shapes, slice out of range, unconvertible
 * dtype) name the file and the tensor. */
int am_ckpt_read(const struct am_ckpt *c, const char *name, const struct am_ckpt_slice *slice,
                 const struct am_tensor *dst, struct am_errors *err);

/* Makes an FP8 checkpoint's F8_E4M3 weights readable (block: weight_block_size, the rows and
 * columns of one scale; NULL: none, the default, and such a weight is refused): am_ckpt_read
 * then dequantises them (quant.h) with their `<name>_scale_inv`, reading only the slice's rows
 * and columns and their blocks' scales. Other tensors read as before. */
void am_ckpt_set_fp8(struct am_ckpt *c, const int64_t *block);

/* MXFP4 experts (gpt-oss's `<name>_blocks` and `<name>_scales`, quant.h): experts [e0, e1)
 * dequantised into dst, a host F32 tensor [e1 - e0, G * 32, R] (transformers' layout), reading
 * only those experts' bytes. Errors (a missing or misshapen tensor, experts out of range, dst's
 * shape) name the tensor. */
int am_ckpt_read_mxfp4(const struct am_ckpt *c, const char *name, int64_t e0, int64_t e1, const struct am_tensor *dst,
                       struct am_errors *err);

struct am_ckpt_save_opts {
    uint64_t max_shard_bytes; /* 0: AM_CKPT_DEFAULT_SHARD_BYTES */
    const char *base_config;  /* the config.json the model came from: keys am does not write
                                 (bos/eos token ids, ...) are kept; NULL for none */
    const char *torch_dtype;  /* config.json's torch_dtype (and dtype): the tensors' dtype as torch
                                 names it; NULL: "float32" */
};

/* Saves the tensors (in the order given; shards are consecutive runs of it) and config.json
 * to dir, atomically as described above. opts may be NULL. */
int am_ckpt_save(const char *dir, const struct am_model_config *m, const struct am_st_wtensor *t, size_t n,
                 const struct am_ckpt_save_opts *opts, struct am_errors *err);

/* The config.json text am writes for m (malloc'd, ends with a newline), or NULL. */
char *am_ckpt_config_json(const struct am_model_config *m, const char *base_config, struct am_errors *err);

#endif
