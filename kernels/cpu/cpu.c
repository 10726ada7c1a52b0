/* cpu.c - the CPU backend's table of kernels, and the checks every kernel shares. */
#include <cblas.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu.h"

_Noreturn void am_cpu_fatal(const char *kernel, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct am_dev_fault f = {.kind = AM_DEV_FAULT_BUG, .backend = "cpu", .ordinal = -1, .where = kernel, .error = "",
                             .message = msg};
    am_kernels_fault(&f);
    fprintf(stderr, "am kernels (cpu): %s: %s\n", kernel, msg);
    abort();
}

void am_cpu_check(const char *kernel, const char *what, const struct am_tensor *t)
{
    if (!t)
        am_cpu_fatal(kernel, "%s is NULL", what);
    if (t->device != AM_DEV_CPU)
        am_cpu_fatal(kernel, "%s (%s) is not in host memory: the CPU backend takes CPU tensors only", what,
                     am_tname(t));
    if (t->ndim < 1 || t->ndim > AM_TENSOR_MAX_DIMS)
        am_cpu_fatal(kernel, "%s (%s) has %d dimensions (1 to %d)", what, am_tname(t), t->ndim, AM_TENSOR_MAX_DIMS);
    if (!t->data && am_tensor_numel(t) > 0)
        am_cpu_fatal(kernel, "%s (%s) has no data", what, am_tname(t));
}

static void check_tensor(const char *kernel, const char *what, const struct am_tensor *t, enum am_dtype want)
{
    if (!t)
        am_cpu_fatal(kernel, "%s is NULL", what);
    if (t->device != AM_DEV_CPU)
        am_cpu_fatal(kernel, "%s (%s) is not in host memory: the CPU backend takes CPU tensors only", what,
                     am_tname(t));
    if (t->dtype != want)
        am_cpu_fatal(kernel, "%s (%s) is %s; the CPU backend takes %s here", what, am_tname(t), am_dtype_name(t->dtype),
                     am_dtype_name(want));
    if (t->ndim < 1 || t->ndim > AM_TENSOR_MAX_DIMS)
        am_cpu_fatal(kernel, "%s (%s) has %d dimensions (1 to %d)", what, am_tname(t), t->ndim, AM_TENSOR_MAX_DIMS);
    if (!t->data && am_tensor_numel(t) > 0)
        am_cpu_fatal(kernel, "%s (%s) has no data", what, am_tname(t));
}

float *am_cpu_f32(const char *kernel, const char *what, const struct am_tensor *t)
{
    check_tensor(kernel, what, t, AM_F32);
    return t->data;
}

const int32_t *am_cpu_i32(const char *kernel, const char *what, const struct am_tensor *t)
{
    check_tensor(kernel, what, t, AM_I32);
    return t->data;
}

void *am_cpu_data(const char *kernel, const char *what, const struct am_tensor *t, enum am_dtype dtype)
{
    check_tensor(kernel, what, t, dtype);
    return t->data;
}

double *am_cpu_scalar_f64(const char *kernel, const char *what, const struct am_tensor *t)
{
    check_tensor(kernel, what, t, AM_F64);
    if (am_tensor_numel(t) != 1)
        am_cpu_fatal(kernel, "%s (%s) has %lld elements; a device scalar has one", what, am_tname(t),
                     (long long)am_tensor_numel(t));
    return t->data;
}

static void cpu_sync(const struct am_dev *d) { (void)d; }

static const struct am_kernels cpu_kernels = {
    .name = "cpu",
    .device = AM_DEV_CPU,
    .open = am_cpu_open,
    .close = am_cpu_close,
    .sync = cpu_sync,
    .alloc = am_cpu_alloc,
    .free = am_cpu_free,
    .upload = am_cpu_upload,
    .download = am_cpu_download,
    .zero = am_cpu_zero,
    .copy = am_cpu_copy,
    .mem_stats = am_cpu_mem_stats,
    .add = am_cpu_add,
    .scale = am_cpu_scale,
    .dropout = am_cpu_dropout,
    .convert = am_cpu_convert,
    .sum_squares = am_cpu_sum_squares,
    .all_finite = am_cpu_all_finite,
    .matmul_forward = am_cpu_matmul_forward,
    .matmul_backward = am_cpu_matmul_backward,
    .bias_forward = am_cpu_bias_forward,
    .bias_backward = am_cpu_bias_backward,
    .embedding_forward = am_cpu_embedding_forward,
    .embedding_backward = am_cpu_embedding_backward,
    .rmsnorm_forward = am_cpu_rmsnorm_forward,
    .rmsnorm_backward = am_cpu_rmsnorm_backward,
    .rope_tables = am_cpu_rope_tables,
    .rope_forward = am_cpu_rope_forward,
    .rope_backward = am_cpu_rope_backward,
    .attention_forward = am_cpu_attention_forward,
    .attention_backward = am_cpu_attention_backward,
    .attention_block_forward = am_cpu_attention_block_forward,
    .attention_block_backward = am_cpu_attention_block_backward,
    .swiglu_forward = am_cpu_swiglu_forward,
    .swiglu_backward = am_cpu_swiglu_backward,
    .rmsnorm_offset_forward = am_cpu_rmsnorm_offset_forward,
    .rmsnorm_offset_backward = am_cpu_rmsnorm_offset_backward,
    .geglu_forward = am_cpu_geglu_forward,
    .geglu_backward = am_cpu_geglu_backward,
    .attention_softcap_forward = am_cpu_attention_softcap_forward,
    .attention_softcap_backward = am_cpu_attention_softcap_backward,
    .ce_stats_softcap = am_cpu_ce_stats_softcap,
    .ce_backward_softcap = am_cpu_ce_backward_softcap,
    .moe_route_forward = am_cpu_moe_route_forward,
    .moe_route_backward = am_cpu_moe_route_backward,
    .moe_aux_stats = am_cpu_moe_aux_stats,
    .moe_aux_loss = am_cpu_moe_aux_loss,
    .moe_plan = am_cpu_moe_plan,
    .moe_permute_forward = am_cpu_moe_permute_forward,
    .moe_permute_backward = am_cpu_moe_permute_backward,
    .moe_combine_forward = am_cpu_moe_combine_forward,
    .moe_combine_backward = am_cpu_moe_combine_backward,
    .grouped_matmul_forward = am_cpu_grouped_matmul_forward,
    .grouped_matmul_backward = am_cpu_grouped_matmul_backward,
    .ce_stats = am_cpu_ce_stats,
    .ce_backward = am_cpu_ce_backward,
    .ce_rescale = am_cpu_ce_rescale,
    .ce_loss = am_cpu_ce_loss,
    .ce_fused = am_cpu_ce_fused,
    .adamw = am_cpu_adamw,
    .adamw_multi = am_cpu_adamw_multi,
};

/* One pool of threads (see cpu.h): OpenBLAS runs single-threaded inside our OpenMP
 * regions. Setting it here, where every user of the backend starts, keeps it in one place;
 * it is idempotent and cheap. */
const struct am_kernels *am_kernels_cpu(void)
{
    openblas_set_num_threads(1);
    return &cpu_kernels;
}
