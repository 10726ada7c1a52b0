/* fake_nvml.c - a stand-in for libnvidia-ml.so.1 that describes GPUs from the environment,
 * so that the NVML path of launcher/nvml.c runs where no GPU is (tests/launcher/test-nvml.sh
 * links it as libnvidia-ml.so.1 in a directory on LD_LIBRARY_PATH):
 *   FAKE_NVML_GPUS=N          N GPUs (unset: nvmlInit fails as without a driver)
 *   FAKE_NVML_NVLINK=0-1,2-3  pairs of GPUs joined by NVLink (P2P status OK)
 *   FAKE_NVML_FABRIC=AB:7     every GPU registered in the fabric: cluster UUID of bytes 0xAB,
 *                             clique 7 (unset: fabric not supported)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    int status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
} fabric_v2;

int nvmlInit_v2(void);
int nvmlShutdown(void);
const char *nvmlErrorString(int rc);
int nvmlDeviceGetCount_v2(unsigned int *n);
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d);
int nvmlDeviceGetP2PStatus(nvmlDevice_t a, nvmlDevice_t b, int index, int *status);
int nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t d, fabric_v2 *f);

static int gpus(void)
{
    const char *s = getenv("FAKE_NVML_GPUS");
    return s ? atoi(s) : -1;
}

int nvmlInit_v2(void) { return gpus() < 0 ? 9 /* NVML_ERROR_DRIVER_NOT_LOADED */ : 0; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int rc) { return rc == 9 ? "Driver Not Loaded" : "Unknown Error"; }

int nvmlDeviceGetCount_v2(unsigned int *n)
{
    *n = (unsigned int)gpus();
    return 0;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    if ((int)i >= gpus())
        return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *d = (nvmlDevice_t)(uintptr_t)(i + 1);
    return 0;
}

int nvmlDeviceGetP2PStatus(nvmlDevice_t a, nvmlDevice_t b, int index, int *status)
{
    int x = (int)(uintptr_t)a - 1, y = (int)(uintptr_t)b - 1;
    const char *links = getenv("FAKE_NVML_NVLINK");
    *status = 5; /* NVML_P2P_STATUS_NOT_SUPPORTED */
    if (index != 2 || !links)
        return 0;
    for (const char *p = links; *p;) {
        int i, j, used;
        if (sscanf(p, "%d-%d%n", &i, &j, &used) != 2)
            break;
        if ((i == x && j == y) || (i == y && j == x))
            *status = 0;
        p += used;
        if (*p == ',')
            p++;
    }
    return 0;
}

int nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t d, fabric_v2 *f)
{
    (void)d;
    const char *s = getenv("FAKE_NVML_FABRIC");
    unsigned int byte, clique;
    if (f->version != (unsigned int)(sizeof(fabric_v2) | (2u << 24)))
        return 25; /* NVML_ERROR_ARGUMENT_VERSION_MISMATCH */
    if (!s || sscanf(s, "%x:%u", &byte, &clique) != 2) {
        f->state = 0; /* NVML_GPU_FABRIC_STATE_NOT_SUPPORTED */
        return 0;
    }
    memset(f->clusterUuid, (int)byte, sizeof(f->clusterUuid));
    f->cliqueId = clique;
    f->state = 3; /* COMPLETED */
    f->status = 0;
    return 0;
}
