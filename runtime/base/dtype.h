/* dtype.h - the dtypes am computes in and communicates: one enum for tensors, kernels, the
 * communicators and the recipe's precision settings (model.torch_dtype, mp_policy's
 * param_dtype and reduce_dtype).
 *
 * File formats keep their own codes: safetensors' dtype list (am_st_dtype, ckpt/safetensors.h)
 * is the format's vocabulary, much wider than this one (F8_E4M3, U8, BOOL, ...) and ordered
 * as the reference writer sorts tensors; Megatron's .idx dtype codes (am_idx_dtype,
 * data/dataset.h) are the numbers on disk. Each maps to this enum in one place, where am reads
 * it. The recipe's spellings ("bfloat16", "bf16", "torch.bfloat16", ...) are parsed by the
 * recipe (recipe.c: its error lists them).
 *
 * Header-only, so that the kernels (which link no base library) use it as they use tensor.h.
 */
#ifndef AM_DTYPE_H
#define AM_DTYPE_H

#include <stddef.h>

/* The codes are stable (the communicators' former codes, AM_F64 after them): messages print
 * an unknown one as a number. */
enum am_dtype { AM_F32, AM_BF16, AM_F16, AM_I32, AM_I64, AM_F64 };

/* Bytes per element; 0 for a value outside the enum. */
static inline size_t am_dtype_size(enum am_dtype d)
{
    switch (d) {
    case AM_F32: return 4;
    case AM_BF16: return 2;
    case AM_F16: return 2;
    case AM_I32: return 4;
    case AM_I64: return 8;
    case AM_F64: return 8;
    }
    return 0;
}

/* am's name: "fp32", "bf16", "fp16", "int32", "int64", "fp64" (messages, the flight
 * recorder's records, which am-diag reads). */
static inline const char *am_dtype_name(enum am_dtype d)
{
    switch (d) {
    case AM_F32: return "fp32";
    case AM_BF16: return "bf16";
    case AM_F16: return "fp16";
    case AM_I32: return "int32";
    case AM_I64: return "int64";
    case AM_F64: return "fp64";
    }
    return "unknown dtype";
}

/* torch's name, as recipes and config.json spell it: "float32", "bfloat16", "float16",
 * "int32", "int64", "float64" (am-plan's summary, the run log's compute_dtype). */
static inline const char *am_dtype_torch_name(enum am_dtype d)
{
    switch (d) {
    case AM_F32: return "float32";
    case AM_BF16: return "bfloat16";
    case AM_F16: return "float16";
    case AM_I32: return "int32";
    case AM_I64: return "int64";
    case AM_F64: return "float64";
    }
    return "unknown dtype";
}

#endif
