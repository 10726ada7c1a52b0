/* fake_nvml.c - a stand-in for libnvidia-ml.so.1 that describes GPUs from the environment,
 * so that the NVML path of rank/nvml.c runs where no GPU is (tests/rank/test-nvml.sh
 * links it as libnvidia-ml.so.1 in a directory on LD_LIBRARY_PATH):
 *   FAKE_NVML_GPUS=N          N GPUs (unset: nvmlInit fails as without a driver)
 *   FAKE_NVML_NVLINK=0-1,2-3  pairs of GPUs joined by NVLink (P2P status OK)
 *   FAKE_NVML_FABRIC=AB:7     every GPU registered in the fabric: cluster UUID of bytes 0xAB,
 *                             clique 7 (unset: fabric not supported)
 * and, for am-doctor (runtime/doctor/gpu_probe.c), each with a default:
 *   FAKE_NVML_DRIVER=550.54.15   the driver version
 *   FAKE_NVML_CUDA=13000         the CUDA version the driver supports
 *   FAKE_NVML_MEM=80:79          every GPU's memory, total:free in GiB
 *   FAKE_NVML_ECC=1:1            ECC mode, current:pending
 *   FAKE_NVML_RETIRED=0:0:0      retired pages: single-bit, double-bit, pending (0/1)
 *   FAKE_NVML_REMAP=C:U:P:F      remapped rows: corrected, uncorrected, pending, failure
 *                                (unset: not supported, as before Ampere)
 *   FAKE_NVML_LINK_DOWN=G        GPU G's NVLink links are inactive (one link per peer in
 *                                FAKE_NVML_NVLINK)
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
int nvmlSystemGetDriverVersion(char *out, unsigned int len);
int nvmlSystemGetCudaDriverVersion_v2(int *v);
int nvmlDeviceGetName(nvmlDevice_t d, char *out, unsigned int len);
typedef struct {
    unsigned long long total, free, used;
} memory_v1;
int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, memory_v1 *m);
int nvmlDeviceGetEccMode(nvmlDevice_t d, int *current, int *pending);
int nvmlDeviceGetRetiredPages(nvmlDevice_t d, int cause, unsigned int *count, unsigned long long *addresses);
int nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, int *pending);
int nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr, unsigned int *unc, unsigned int *pending,
                              unsigned int *failure);
int nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, int *active);

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

static const char *env_or(const char *name, const char *dflt)
{
    const char *s = getenv(name);
    return s && *s ? s : dflt;
}

int nvmlSystemGetDriverVersion(char *out, unsigned int len)
{
    snprintf(out, len, "%s", env_or("FAKE_NVML_DRIVER", "550.54.15"));
    return 0;
}

int nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    *v = atoi(env_or("FAKE_NVML_CUDA", "13000"));
    return 0;
}

int nvmlDeviceGetName(nvmlDevice_t d, char *out, unsigned int len)
{
    (void)d;
    snprintf(out, len, "Fake GPU");
    return 0;
}

int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, memory_v1 *m)
{
    (void)d;
    double total = 80, free_gib = 79;
    sscanf(env_or("FAKE_NVML_MEM", "80:79"), "%lf:%lf", &total, &free_gib);
    m->total = (unsigned long long)(total * 1073741824.0);
    m->free = (unsigned long long)(free_gib * 1073741824.0);
    m->used = m->total - m->free;
    return 0;
}

int nvmlDeviceGetEccMode(nvmlDevice_t d, int *current, int *pending)
{
    (void)d;
    *current = *pending = 1;
    sscanf(env_or("FAKE_NVML_ECC", "1:1"), "%d:%d", current, pending);
    return 0;
}

int nvmlDeviceGetRetiredPages(nvmlDevice_t d, int cause, unsigned int *count, unsigned long long *addresses)
{
    (void)d;
    (void)addresses;
    unsigned int n[3] = {0, 0, 0};
    sscanf(env_or("FAKE_NVML_RETIRED", "0:0:0"), "%u:%u:%u", &n[0], &n[1], &n[2]);
    unsigned int want = n[cause ? 1 : 0];
    int rc = *count < want ? 7 /* NVML_ERROR_INSUFFICIENT_SIZE */ : 0;
    *count = want;
    return rc;
}

int nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, int *pending)
{
    (void)d;
    unsigned int n[3] = {0, 0, 0};
    sscanf(env_or("FAKE_NVML_RETIRED", "0:0:0"), "%u:%u:%u", &n[0], &n[1], &n[2]);
    *pending = n[2] != 0;
    return 0;
}

int nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr, unsigned int *unc, unsigned int *pending,
                              unsigned int *failure)
{
    (void)d;
    const char *s = getenv("FAKE_NVML_REMAP");
    if (!s || sscanf(s, "%u:%u:%u:%u", corr, unc, pending, failure) != 4)
        return 3; /* NVML_ERROR_NOT_SUPPORTED */
    return 0;
}

int nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, int *active)
{
    int x = (int)(uintptr_t)d - 1, peers = 0;
    for (int y = 0; y < gpus(); y++) {
        int st = 5;
        if (y != x)
            nvmlDeviceGetP2PStatus(d, (nvmlDevice_t)(uintptr_t)(y + 1), 2, &st);
        peers += st == 0;
    }
    if ((int)link >= peers)
        return 2; /* NVML_ERROR_INVALID_ARGUMENT: no such link */
    const char *down = getenv("FAKE_NVML_LINK_DOWN");
    *active = !(down && *down && atoi(down) == x);
    return 0;
}
