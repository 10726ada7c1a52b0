/* nvml.c - NVLink domains from NVML, loaded at run time (topology.h).
 *
 * NVML's header is not installed where am builds, and the library exists only on GPU
 * nodes, so it is opened with dlopen("libnvidia-ml.so.1") and the few functions and types
 * used are declared here, as in nvml.h (NVML API version 12):
 *   nvmlInit_v2, nvmlShutdown, nvmlErrorString, nvmlDeviceGetCount_v2,
 *   nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetP2PStatus (NVML_P2P_CAPS_INDEX_NVLINK),
 *   nvmlDeviceGetGpuFabricInfoV (nvmlGpuFabricInfo_v2_t; absent from older drivers).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "topology.h"

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
enum { NVML_SUCCESS = 0 };
enum { NVML_P2P_CAPS_INDEX_NVLINK = 2 };
enum { NVML_P2P_STATUS_OK = 0 };
enum { NVML_GPU_FABRIC_STATE_COMPLETED = 3 };
#define NVML_GPU_FABRIC_UUID_LEN 16

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
} nvmlGpuFabricInfo_v2_t;
#define nvmlGpuFabricInfo_v2 ((unsigned int)(sizeof(nvmlGpuFabricInfo_v2_t) | (2u << 24)))

#define MAX_GPUS 64

/* The library and its functions, for one query. */
struct nvml {
    void *lib;
    nvmlReturn_t (*init)(void);
    nvmlReturn_t (*shutdown)(void);
    const char *(*error_string)(nvmlReturn_t);
    nvmlReturn_t (*count)(unsigned int *);
    nvmlReturn_t (*handle)(unsigned int, nvmlDevice_t *);
    nvmlReturn_t (*p2p)(nvmlDevice_t, nvmlDevice_t, int, int *);
    nvmlReturn_t (*fabric)(nvmlDevice_t, nvmlGpuFabricInfo_v2_t *); /* may be NULL */
};

static const char *nvml_error(const struct nvml *n, nvmlReturn_t rc, char *buf, size_t len)
{
    const char *s = n->error_string ? n->error_string(rc) : NULL;
    snprintf(buf, len, "%s (%d)", s ? s : "error", rc);
    return buf;
}

/* 1: loaded and initialized; 0: not there (why says so). */
static int nvml_open(struct nvml *n, char *why, size_t why_len)
{
    char e[128];
    memset(n, 0, sizeof(*n));
    n->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!n->lib) {
        snprintf(why, why_len, "libnvidia-ml.so.1 not found (no NVIDIA driver)");
        return 0;
    }
    /* POSIX: a void * from dlsym converts to a function pointer through a cast of its address */
    *(void **)&n->init = dlsym(n->lib, "nvmlInit_v2");
    *(void **)&n->shutdown = dlsym(n->lib, "nvmlShutdown");
    *(void **)&n->error_string = dlsym(n->lib, "nvmlErrorString");
    *(void **)&n->count = dlsym(n->lib, "nvmlDeviceGetCount_v2");
    *(void **)&n->handle = dlsym(n->lib, "nvmlDeviceGetHandleByIndex_v2");
    *(void **)&n->p2p = dlsym(n->lib, "nvmlDeviceGetP2PStatus");
    *(void **)&n->fabric = dlsym(n->lib, "nvmlDeviceGetGpuFabricInfoV");
    if (!n->init || !n->shutdown || !n->count || !n->handle || !n->p2p) {
        snprintf(why, why_len, "libnvidia-ml.so.1 lacks nvmlInit_v2, nvmlDeviceGetCount_v2, "
                 "nvmlDeviceGetHandleByIndex_v2 or nvmlDeviceGetP2PStatus (driver too old)");
        dlclose(n->lib);
        n->lib = NULL;
        return 0;
    }
    nvmlReturn_t rc = n->init();
    if (rc != NVML_SUCCESS) {
        snprintf(why, why_len, "nvmlInit failed: %s", nvml_error(n, rc, e, sizeof(e)));
        dlclose(n->lib);
        n->lib = NULL;
        return 0;
    }
    return 1;
}

static void nvml_close(struct nvml *n)
{
    if (!n->lib)
        return;
    n->shutdown();
    dlclose(n->lib);
    n->lib = NULL;
}

static int find(int *parent, int i)
{
    while (parent[i] != i)
        i = parent[i] = parent[parent[i]];
    return i;
}

int am_nvml_domain(const char *host, int gpu, int *n_gpus, char *out, size_t len, char *why, size_t why_len)
{
    struct nvml n;
    nvmlDevice_t dev[MAX_GPUS];
    unsigned int count = 0;
    char e[128];
    int rc = -1;
    if (!nvml_open(&n, why, why_len))
        return 0;
    nvmlReturn_t st = n.count(&count);
    if (st != NVML_SUCCESS) {
        snprintf(why, why_len, "nvmlDeviceGetCount failed: %s", nvml_error(&n, st, e, sizeof(e)));
        goto out;
    }
    if (count == 0) {
        snprintf(why, why_len, "NVML sees no GPU");
        rc = 0;
        goto out;
    }
    if (count > MAX_GPUS)
        count = MAX_GPUS;
    *n_gpus = (int)count;
    if (gpu < 0) {
        rc = 1;
        goto out;
    }
    if (gpu >= (int)count) {
        snprintf(why, why_len, "GPU %d does not exist: NVML sees %u", gpu, count);
        goto out;
    }
    for (unsigned int i = 0; i < count; i++) {
        st = n.handle(i, &dev[i]);
        if (st != NVML_SUCCESS) {
            snprintf(why, why_len, "nvmlDeviceGetHandleByIndex(%u) failed: %s", i, nvml_error(&n, st, e, sizeof(e)));
            goto out;
        }
    }
    /* A completed fabric registration puts the GPU in its clique's domain, across nodes. */
    if (n.fabric) {
        nvmlGpuFabricInfo_v2_t f;
        memset(&f, 0, sizeof(f));
        f.version = nvmlGpuFabricInfo_v2;
        static const unsigned char zero[NVML_GPU_FABRIC_UUID_LEN];
        if (n.fabric(dev[gpu], &f) == NVML_SUCCESS && f.state == NVML_GPU_FABRIC_STATE_COMPLETED &&
            f.status == NVML_SUCCESS && memcmp(f.clusterUuid, zero, sizeof(zero)) != 0) {
            char hex[2 * NVML_GPU_FABRIC_UUID_LEN + 1];
            for (int i = 0; i < NVML_GPU_FABRIC_UUID_LEN; i++)
                snprintf(hex + 2 * i, 3, "%02x", f.clusterUuid[i]);
            snprintf(out, len, "fabric:%s:%u", hex, f.cliqueId);
            rc = 1;
            goto out;
        }
    }
    /* Otherwise: the node's GPUs joined by NVLink P2P, as connected components. */
    int parent[MAX_GPUS];
    for (int i = 0; i < MAX_GPUS; i++)
        parent[i] = i;
    for (unsigned int i = 0; i < count; i++)
        for (unsigned int j = i + 1; j < count; j++) {
            int status = -1;
            if (n.p2p(dev[i], dev[j], NVML_P2P_CAPS_INDEX_NVLINK, &status) == NVML_SUCCESS &&
                status == NVML_P2P_STATUS_OK)
                parent[find(parent, (int)j)] = find(parent, (int)i);
        }
    /* number the components by their lowest GPU */
    int mine = find(parent, gpu), index = 0;
    for (unsigned int i = 0; i < count; i++) {
        int root = find(parent, (int)i);
        int lowest = 1;
        for (unsigned int k = 0; k < i; k++)
            lowest &= find(parent, (int)k) != root;
        if (!lowest)
            continue;
        if (root == mine)
            break;
        index++;
    }
    snprintf(out, len, "%s:%d", host, index);
    rc = 1;
out:
    nvml_close(&n);
    return rc;
}
