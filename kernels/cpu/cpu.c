/* cpu.c - the CPU backend's table of kernels, its device context (the scratch that bf16
 * operands are widened into, the count of allocated bytes) and the checks every kernel shares
 * (the tensors, the dtype rules of cpu.h). */
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

/* ---- the dtype rules ---- */

enum am_dtype am_cpu_act(const char *kernel, const char *what, const struct am_tensor *t)
{
    am_cpu_check(kernel, what, t);
    if (t->dtype != AM_F32 && t->dtype != AM_BF16)
        am_cpu_fatal(kernel, "%s (%s) is %s; the CPU backend takes fp32 or bf16 here (bf16 storage, fp32 arithmetic)",
                     what, am_tname(t), am_dtype_name(t->dtype));
    return t->dtype;
}

void am_cpu_same(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                 const struct am_tensor *ref)
{
    am_cpu_check(kernel, what, t);
    if (t->dtype != ref->dtype)
        am_cpu_fatal(kernel, "%s (%s) is %s but %s (%s) is %s: a kernel's activations and weights share one dtype "
                     "(fp32, or bf16 for mixed precision)", what, am_tname(t), am_dtype_name(t->dtype), refname,
                     am_tname(ref), am_dtype_name(ref->dtype));
}

void am_cpu_glu_check(const char *kernel, const struct am_tensor *a, const struct am_tensor *gate,
                      const struct am_tensor *up)
{
    am_cpu_act(kernel, "gate", gate);
    am_cpu_same(kernel, "up", up, "gate", gate);
    am_cpu_same(kernel, "out", a, "gate", gate);
    if (am_tensor_numel(a) != am_tensor_numel(gate) || am_tensor_numel(up) != am_tensor_numel(gate))
        am_cpu_fatal(kernel, "gate (%s), up (%s) and %s must have the same shape (%lld, %lld, %lld elements)",
                     am_tname(gate), am_tname(up), am_tname(a), (long long)am_tensor_numel(gate),
                     (long long)am_tensor_numel(up), (long long)am_tensor_numel(a));
}

void am_cpu_grad(const char *kernel, const char *what, const struct am_tensor *t, const char *refname,
                 const struct am_tensor *ref)
{
    am_cpu_check(kernel, what, t);
    if (t->dtype == AM_F32 || (t->dtype == AM_BF16 && ref->dtype == AM_BF16))
        return;
    am_cpu_fatal(kernel, "%s (%s) is %s with %s (%s) %s: a parameter gradient is fp32, or bf16 when the activations "
                 "are bf16", what, am_tname(t), am_dtype_name(t->dtype), refname, am_tname(ref),
                 am_dtype_name(ref->dtype));
}

void am_cpu_stat(const char *kernel, const char *what, const struct am_tensor *t)
{
    am_cpu_check(kernel, what, t);
    if (t->dtype != AM_F32)
        am_cpu_fatal(kernel, "%s (%s) is %s; statistics saved for backward stay fp32, also with bf16 activations", what,
                     am_tname(t), am_dtype_name(t->dtype));
}

/* ---- the context: its scratch, its count of allocated bytes ---- */

struct am_cpu_ws {
    float *p;
    size_t bytes;
    int64_t chunk; /* floats per operand per chunk */
    size_t in_use, peak; /* bytes handed out by alloc (memory.c), not freed */
};

void am_cpu_account(const struct am_dev *dev, size_t bytes, bool freed)
{
    struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    if (!ws)
        return;
    ws->in_use = freed ? (ws->in_use >= bytes ? ws->in_use - bytes : 0) : ws->in_use + bytes;
    if (ws->in_use > ws->peak)
        ws->peak = ws->in_use;
}

void am_cpu_mem_stats(const struct am_dev *dev, struct am_dev_mem *out)
{
    const struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    *out = (struct am_dev_mem){0};
    if (ws) {
        out->in_use = out->held = ws->in_use;
        out->peak = ws->peak;
    }
}

int64_t am_cpu_chunk(const struct am_dev *dev)
{
    const struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    return ws ? ws->chunk : AM_BF16_CHUNK;
}

void am_cpu_set_chunk(const struct am_dev *dev, int64_t n)
{
    struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    if (ws)
        ws->chunk = n > 0 ? n : AM_BF16_CHUNK;
}

int am_cpu_open(struct am_dev *dev, char *err, size_t err_len)
{
    struct am_cpu_ws *ws = calloc(1, sizeof(*ws));
    if (!ws) {
        snprintf(err, err_len, "kernels (cpu): out of memory for the device context");
        return -1;
    }
    ws->chunk = AM_BF16_CHUNK;
    dev->workspace = ws;
    dev->workspace_bytes = 0;
    return 0;
}

void am_cpu_close(struct am_dev *dev)
{
    struct am_cpu_ws *ws = dev->workspace;
    if (ws)
        free(ws->p);
    free(ws);
    dev->workspace = NULL;
}

float *am_cpu_scratch(const char *kernel, const struct am_dev *dev, int64_t nfloats)
{
    struct am_cpu_ws *ws = dev ? dev->workspace : NULL;
    if (!ws)
        am_cpu_fatal(kernel, "the device context has no scratch for bf16 tensors: open it with am_dev_open");
    size_t want = (size_t)(nfloats > 0 ? nfloats : 1) * sizeof(float);
    want = (want + 63) / 64 * 64;
    if (want > ws->bytes) {
        free(ws->p);
        ws->bytes = 0;
        ws->p = aligned_alloc(64, want);
        if (!ws->p)
            am_cpu_fatal(kernel, "out of memory for %zu bytes of scratch (bf16 operands widened to fp32)", want);
        ws->bytes = want;
    }
    return ws->p;
}

float *am_cpu_carve(float **p, int64_t n)
{
    float *r = *p;
    *p += (n + 15) / 16 * 16;
    return r;
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
    .copy_cols = am_cpu_copy_cols,
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
    .attention_block_softcap_forward = am_cpu_attention_block_softcap_forward,
    .attention_block_softcap_backward = am_cpu_attention_block_softcap_backward,
    .ce_stats_softcap = am_cpu_ce_stats_softcap,
    .ce_backward_softcap = am_cpu_ce_backward_softcap,
    .ce_stats_lora = am_cpu_ce_stats_lora,
    .ce_backward_lora = am_cpu_ce_backward_lora,
    .moe_route_forward = am_cpu_moe_route_forward,
    .moe_route_backward = am_cpu_moe_route_backward,
    .moe_route_sigmoid_forward = am_cpu_moe_route_sigmoid_forward,
    .moe_route_sigmoid_backward = am_cpu_moe_route_sigmoid_backward,
    .attention_sink_forward = am_cpu_attention_sink_forward,
    .attention_sink_backward = am_cpu_attention_sink_backward,
    .swiglu_clamped_forward = am_cpu_swiglu_clamped_forward,
    .swiglu_clamped_backward = am_cpu_swiglu_clamped_backward,
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
