/* kernels.c - device contexts and the table of kernels for a device. */
#include <stdio.h>
#include <string.h>

#include "half.h"
#include "kernels.h"

/* The process's device-fault hook (kernels.h): the one mutable global of the kernels, because
 * the backends' checks that call it have no context to reach it through. */
static struct {
    am_dev_fault_fn fn;
    void *arg;
    int fatal_told; /* an ERROR or BUG was told: the abort that follows is not told again */
} fault_hook;

void am_kernels_set_fault_hook(am_dev_fault_fn fn, void *arg)
{
    fault_hook.fn = fn;
    fault_hook.arg = arg;
    fault_hook.fatal_told = 0;
}

void am_kernels_fault(const struct am_dev_fault *f)
{
    if (!fault_hook.fn || !f)
        return;
    if (f->kind == AM_DEV_FAULT_ERROR || f->kind == AM_DEV_FAULT_BUG) {
        if (fault_hook.fatal_told)
            return;
        fault_hook.fatal_told = 1;
    }
    fault_hook.fn(fault_hook.arg, f);
}

const struct am_kernels *am_kernels_for(enum am_device device)
{
    switch (device) {
    case AM_DEV_CPU: return am_kernels_cpu();
    case AM_DEV_CUDA:
#ifdef AM_HAVE_CUDA
        return am_kernels_cuda();
#else
        return NULL;
#endif
    }
    return NULL;
}

const char *am_device_name(enum am_device device)
{
    return device == AM_DEV_CUDA ? "cuda" : "cpu";
}

int am_kernels_missing(const struct am_kernels *k, char *buf, size_t len)
{
    int n = 0;
    size_t used = 0;
    if (len)
        buf[0] = 0;
#define AM_NEED(f)                                                                                                   \
    do {                                                                                                             \
        if (!k->f) {                                                                                                 \
            if (used < len) {                                                                                        \
                int w = snprintf(buf + used, len - used, "%s%s", n ? ", " : "", #f);                                 \
                used += w > 0 ? (size_t)w : 0;                                                                       \
            }                                                                                                        \
            n++;                                                                                                     \
        }                                                                                                            \
    } while (0)
    AM_NEED(sync);
    AM_NEED(alloc);
    AM_NEED(free);
    AM_NEED(upload);
    AM_NEED(download);
    AM_NEED(zero);
    AM_NEED(copy);
    AM_NEED(add);
    AM_NEED(scale);
    AM_NEED(convert);
    AM_NEED(sum_squares);
    AM_NEED(all_finite);
    AM_NEED(matmul_forward);
    AM_NEED(matmul_backward);
    AM_NEED(bias_forward);
    AM_NEED(bias_backward);
    AM_NEED(embedding_forward);
    AM_NEED(embedding_backward);
    AM_NEED(rmsnorm_forward);
    AM_NEED(rmsnorm_backward);
    AM_NEED(rope_tables);
    AM_NEED(rope_forward);
    AM_NEED(rope_backward);
    AM_NEED(attention_forward);
    AM_NEED(attention_backward);
    AM_NEED(attention_block_forward);
    AM_NEED(attention_block_backward);
    AM_NEED(swiglu_forward);
    AM_NEED(swiglu_backward);
    AM_NEED(rmsnorm_offset_forward);
    AM_NEED(rmsnorm_offset_backward);
    AM_NEED(geglu_forward);
    AM_NEED(geglu_backward);
    AM_NEED(attention_softcap_forward);
    AM_NEED(attention_softcap_backward);
    AM_NEED(attention_block_softcap_forward);
    AM_NEED(attention_block_softcap_backward);
    AM_NEED(ce_stats_softcap);
    AM_NEED(ce_backward_softcap);
    AM_NEED(ce_stats_lora);
    AM_NEED(ce_backward_lora);
    AM_NEED(moe_route_forward);
    AM_NEED(moe_route_backward);
    AM_NEED(moe_route_sigmoid_forward);
    AM_NEED(moe_route_sigmoid_backward);
    AM_NEED(attention_sink_forward);
    AM_NEED(attention_sink_backward);
    AM_NEED(swiglu_clamped_forward);
    AM_NEED(swiglu_clamped_backward);
    AM_NEED(moe_aux_stats);
    AM_NEED(moe_aux_loss);
    AM_NEED(moe_plan);
    AM_NEED(moe_permute_forward);
    AM_NEED(moe_permute_backward);
    AM_NEED(moe_combine_forward);
    AM_NEED(moe_combine_backward);
    AM_NEED(grouped_matmul_forward);
    AM_NEED(grouped_matmul_backward);
    AM_NEED(ce_stats);
    AM_NEED(ce_backward);
    AM_NEED(ce_rescale);
    AM_NEED(ce_loss);
    AM_NEED(ce_fused);
    AM_NEED(adamw);
    AM_NEED(adamw_multi);
#undef AM_NEED
    return n;
}

int am_dev_open(struct am_dev *d, enum am_device device, int ordinal, char *err, size_t err_len)
{
    memset(d, 0, sizeof(*d));
    d->k = am_kernels_for(device);
    if (!d->k) {
        snprintf(err, err_len, "kernels: this build of am has no %s backend (configure found no toolkit for it): "
                 "run on the CPU (AM_DEVICE=cpu)", am_device_name(device));
        return -1;
    }
    d->device = device;
    d->ordinal = device == AM_DEV_CPU ? -1 : ordinal;
    snprintf(d->name, sizeof d->name, "%s", am_device_name(device));
    if (d->k->open && d->k->open(d, err, err_len) < 0) {
        memset(d, 0, sizeof(*d));
        return -1;
    }
    /* after the backend's open, so that a machine without the device says so first */
    char missing[512];
    if (am_kernels_missing(d->k, missing, sizeof missing) > 0) {
        snprintf(err, err_len, "kernels: the %s backend lacks: %s (run on the CPU: AM_DEVICE=cpu)", d->k->name, missing);
        am_dev_close(d);
        return -1;
    }
    return 0;
}

void am_dev_close(struct am_dev *d)
{
    if (d->k && d->k->close)
        d->k->close(d);
    memset(d, 0, sizeof(*d));
}

#define CONVERT_CHUNK 4096 /* elements converted at a time on the host */

void am_dev_download_f32(const struct am_dev *d, enum am_dtype dt, float *host, const void *src, size_t n)
{
    if (dt == AM_F32) {
        d->k->download(d, host, src, n * sizeof(float));
        return;
    }
    uint16_t h[CONVERT_CHUNK];
    for (size_t i = 0; i < n; i += CONVERT_CHUNK) {
        size_t k = n - i < CONVERT_CHUNK ? n - i : CONVERT_CHUNK;
        d->k->download(d, h, (const uint16_t *)src + i, k * sizeof(*h));
        for (size_t j = 0; j < k; j++)
            host[i + j] = am_bf16_to_f32(h[j]);
    }
}

void am_dev_upload_f32(const struct am_dev *d, enum am_dtype dt, void *dst, const float *host, size_t n)
{
    if (dt == AM_F32) {
        d->k->upload(d, dst, host, n * sizeof(float));
        return;
    }
    uint16_t h[CONVERT_CHUNK];
    for (size_t i = 0; i < n; i += CONVERT_CHUNK) {
        size_t k = n - i < CONVERT_CHUNK ? n - i : CONVERT_CHUNK;
        for (size_t j = 0; j < k; j++)
            h[j] = am_f32_to_bf16(host[i + j]);
        d->k->upload(d, (uint16_t *)dst + i, h, k * sizeof(*h));
    }
}
