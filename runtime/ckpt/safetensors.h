/* safetensors.h - Hugging Face's safetensors format: a validating mmap reader and an atomic
 * writer, on jansson.
 *
 * The format (https://github.com/huggingface/safetensors):
 *   8 bytes   N, little-endian u64: the header's length
 *   N bytes   a JSON object {NAME: {"dtype": "F32", "shape": [2, 3], "data_offsets": [B, E]},
 *             ..., "__metadata__": {STR: STR}}, padded with spaces
 *   the rest  the data buffer; each tensor's bytes are [B, E) of it, little-endian, row-major
 *
 * The reader accepts exactly what the reference implementation (the Rust crate behind the
 * Python package) accepts: N at most 100,000,000 and within the file; the header valid UTF-8
 * JSON; tensors, sorted by offsets, packed from 0 with no gap and no overlap; each tensor's
 * byte count equal to its element count times its dtype's size; the last tensor ending at
 * the end of the file (no trailing bytes). In addition a name may not appear twice (the
 * reference would silently keep one). Every rejection names the file, the tensor when
 * there is one, and the rule.
 *
 * The writer writes what the reference writes, byte for byte: tensors sorted by dtype
 * (largest alignment first) then by name, the header compact JSON with "__metadata__" first
 * and padded with spaces to a multiple of 8 bytes. It writes to a temporary file in the same
 * directory, fsyncs it, renames it over the final name and fsyncs the directory: a crash
 * leaves either the old file or the new one, never half of one.
 */
#ifndef AM_SAFETENSORS_H
#define AM_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "errors.h"
#include "half.h"

/* The safetensors dtypes, in the reference's order (increasing alignment): the writer sorts
 * tensors by this order, descending, as the reference does. This is the file format's
 * vocabulary, not am's dtypes (enum am_dtype, dtype.h): much wider (F8_*, U8, BOOL, C64, ...),
 * ordered by the format, named as the header spells them. It maps to am_dtype in one place,
 * am_st_dtype_to_am. */
enum am_st_dtype {
    AM_ST_BOOL, AM_ST_F4, AM_ST_F6_E2M3, AM_ST_F6_E3M2, AM_ST_U8, AM_ST_I8, AM_ST_F8_E5M2,
    AM_ST_F8_E4M3, AM_ST_F8_E8M0, AM_ST_I16, AM_ST_U16, AM_ST_F16, AM_ST_BF16, AM_ST_I32,
    AM_ST_U32, AM_ST_F32, AM_ST_C64, AM_ST_F64, AM_ST_I64, AM_ST_U64,
    AM_ST_NDTYPES
};

#define AM_ST_MAX_DIMS 8
#define AM_ST_MAX_HEADER 100000000ULL /* the reference's limit on N */

/* "F32", "BF16", ... */
const char *am_st_dtype_name(enum am_st_dtype d);
/* Bits per element (4 for F4, 6 for F6_*, else 8 * bytes). */
int am_st_dtype_bits(enum am_st_dtype d);
/* Parses a dtype name; -1 when unknown. */
int am_st_dtype_parse(const char *s, enum am_st_dtype *out);
/* The am dtype of a file dtype that am reads (F32, BF16, F16, I32, I64: what am_st_read_f32
 * converts): true with *out set; false for the others. */
bool am_st_dtype_to_am(enum am_st_dtype d, enum am_dtype *out);

/* One tensor of an open file. `data` points into the read-only mapping. */
struct am_st_info {
    const char *name;
    enum am_st_dtype dtype;
    int ndim;
    int64_t shape[AM_ST_MAX_DIMS];
    int64_t numel;
    uint64_t begin, end; /* byte offsets in the data buffer */
    const unsigned char *data;
};

struct am_st_file;

/* Opens, maps and validates a file. Returns 0, or -1 with one message in err. */
int am_st_open(const char *path, struct am_st_file **out, struct am_errors *err);
void am_st_close(struct am_st_file *f);

const char *am_st_path(const struct am_st_file *f);
size_t am_st_count(const struct am_st_file *f);
/* The i-th tensor in data-offset order. */
const struct am_st_info *am_st_at(const struct am_st_file *f, size_t i);
/* The tensor named `name`, or NULL. */
const struct am_st_info *am_st_find(const struct am_st_file *f, const char *name);
/* A value of __metadata__, or NULL. */
const char *am_st_meta(const struct am_st_file *f, const char *key);

/* Converts elements [first, first + count) of t (row-major order) to fp32. F32, BF16 and F16
 * convert exactly (subnormals, infinities and NaNs included); I32 and I64 as C converts
 * integers to float. Other dtypes: -1 with a message. */
int am_st_read_f32(const struct am_st_file *f, const struct am_st_info *t, int64_t first, int64_t count,
                   float *dst, struct am_errors *err);

/* Formats a shape as "[2, 3]" (or "[]") into buf. */
const char *am_st_shape_str(const int64_t *shape, int ndim, char *buf, size_t len);

/* ---- scalar conversions ------------------------------------------------------------------ */

/* am_bf16_to_f32, am_f16_to_f32, am_f32_to_bf16, am_f32_to_f16: half.h */

/* ---- writing ------------------------------------------------------------------------------ */

/* Supplies bytes [offset, offset + n) of tensor `index` (the writer calls it in increasing
 * offsets, in chunks): for data that is not in host memory, or is converted on the fly.
 * Returns 0, or -1 after adding a message to err (the write is then abandoned). */
typedef int (*am_st_fill_fn)(void *ctx, size_t index, uint64_t offset, void *dst, size_t n,
                             struct am_errors *err);

struct am_st_wtensor {
    const char *name; /* valid UTF-8, not "__metadata__" */
    enum am_st_dtype dtype;
    int ndim;
    int64_t shape[AM_ST_MAX_DIMS];
    const void *data;   /* host bytes, little-endian, row-major; or NULL and fill */
    am_st_fill_fn fill; /* used when data is NULL */
    void *ctx;
};

struct am_st_kv {
    const char *key, *value;
};

/* The tensor's size in bytes; 0 with *ok false when the shape overflows or the dtype has
 * sub-byte elements that do not fill whole bytes. */
uint64_t am_st_wtensor_bytes(const struct am_st_wtensor *t, bool *ok);

/* Writes the tensors to `path` atomically (see above). __metadata__ is {"format": "pt"}
 * (what transformers writes and expects) plus the n_meta pairs given. `index_base` is the
 * index passed to fill callbacks for t[0] (t[i] gets index_base + i). */
int am_st_write(const char *path, const struct am_st_wtensor *t, size_t n, const struct am_st_kv *meta,
                size_t n_meta, size_t index_base, struct am_errors *err);

#endif
