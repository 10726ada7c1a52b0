/* tensor.h - a typed view of memory on a device.
 *
 * The model and the training loop only ever hold tensors: where the bytes live (host or a
 * CUDA device) and what they are (enum am_dtype, dtype.h) travel with the pointer, so the
 * CPU and CUDA backends slot in behind the same kernel table (kernels/kernels.h) without
 * the model changing. A tensor does not own its memory: the model allocates large slabs
 * through the kernel table and hands out views.
 */
#ifndef AM_TENSOR_H
#define AM_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"

enum am_device { AM_DEV_CPU, AM_DEV_CUDA };

#define AM_TENSOR_MAX_DIMS 4

struct am_tensor {
    void *data;
    enum am_device device;
    enum am_dtype dtype;
    int ndim;
    int64_t shape[AM_TENSOR_MAX_DIMS];
    const char *name; /* Hugging Face name for parameters ("model.layers.0.mlp.up_proj.weight"), or NULL */
};

static inline int64_t am_tensor_numel(const struct am_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

static inline size_t am_tensor_bytes(const struct am_tensor *t)
{
    return (size_t)am_tensor_numel(t) * am_dtype_size(t->dtype);
}

/* A 1-, 2-, 3- or 4-d view of data (unused trailing sizes 0). */
static inline struct am_tensor am_tensor_view(void *data, enum am_device dev, enum am_dtype dt, int64_t d0,
                                              int64_t d1, int64_t d2, int64_t d3)
{
    struct am_tensor t = {.data = data, .device = dev, .dtype = dt};
    int64_t d[4] = {d0, d1, d2, d3};
    for (int i = 0; i < 4 && d[i] > 0; i++)
        t.shape[t.ndim++] = d[i];
    return t;
}

#endif
