/* kernels.c - the table of kernels for a device. */
#include <stddef.h>

#include "kernels.h"

const struct am_kernels *am_kernels_for(enum am_device device)
{
    switch (device) {
    case AM_DEV_CPU: return am_kernels_cpu();
    case AM_DEV_CUDA: return NULL; /* the CUDA backend is a later issue */
    }
    return NULL;
}
