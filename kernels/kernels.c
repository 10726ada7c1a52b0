/* kernels.c - device contexts and the table of kernels for a device. */
#include <stdio.h>
#include <string.h>

#include "kernels.h"

const struct am_kernels *am_kernels_for(enum am_device device)
{
    switch (device) {
    case AM_DEV_CPU: return am_kernels_cpu();
    case AM_DEV_CUDA: return NULL; /* the CUDA backend is a later issue */
    }
    return NULL;
}

const char *am_device_name(enum am_device device)
{
    return device == AM_DEV_CUDA ? "cuda" : "cpu";
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
    if (d->k->open && d->k->open(d, err, err_len) < 0) {
        memset(d, 0, sizeof(*d));
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
