/* gpu_probe.c - NVML's view of a rank's GPU for am-doctor (doctor.h), loaded with dlopen as
 * in runtime/rank/nvml.c (no NVML header where am builds). Functions used, as in nvml.h:
 *   nvmlInit_v2, nvmlShutdown, nvmlErrorString, nvmlSystemGetDriverVersion,
 *   nvmlSystemGetCudaDriverVersion_v2, nvmlDeviceGetCount_v2, nvmlDeviceGetHandleByIndex_v2,
 *   nvmlDeviceGetName, nvmlDeviceGetMemoryInfo, nvmlDeviceGetEccMode,
 *   nvmlDeviceGetRetiredPages, nvmlDeviceGetRetiredPagesPendingStatus,
 *   nvmlDeviceGetRemappedRows, nvmlDeviceGetNvLinkState.
 * A function the driver lacks, or a query the GPU does not support, leaves its field
 * unknown (-1) rather than failing the probe. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "doctor.h"
#include "topology.h"

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_INSUFFICIENT_SIZE = 7 };
#define NVML_NVLINK_MAX_LINKS 18

typedef nvmlReturn_t (*fn_void)(void);
typedef const char *(*fn_errstr)(nvmlReturn_t);
typedef nvmlReturn_t (*fn_str)(char *, unsigned int);
typedef nvmlReturn_t (*fn_int)(int *);
typedef nvmlReturn_t (*fn_uint)(unsigned int *);
typedef nvmlReturn_t (*fn_handle)(unsigned int, nvmlDevice_t *);
typedef nvmlReturn_t (*fn_name)(nvmlDevice_t, char *, unsigned int);
typedef nvmlReturn_t (*fn_mem)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*fn_ecc)(nvmlDevice_t, int *, int *);
typedef nvmlReturn_t (*fn_retired)(nvmlDevice_t, int, unsigned int *, unsigned long long *);
typedef nvmlReturn_t (*fn_pending)(nvmlDevice_t, int *);
typedef nvmlReturn_t (*fn_remap)(nvmlDevice_t, unsigned int *, unsigned int *, unsigned int *, unsigned int *);
typedef nvmlReturn_t (*fn_link)(nvmlDevice_t, unsigned int, int *);

static void *sym(void *lib, const char *name)
{
    return dlsym(lib, name);
}

void am_doc_gpu_probe(struct am_doc_gpu *g, const char *host, int gpu)
{
    memset(g, 0, sizeof(*g));
    g->index = gpu;
    g->ecc_current = g->ecc_pending = -1;
    g->retired_sbe = g->retired_dbe = g->retired_pending = -1;
    g->remap_corr = g->remap_unc = g->remap_pending = g->remap_failure = -1;
    g->mem_total = g->mem_free = -1;
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(g->why, sizeof(g->why), "libnvidia-ml.so.1 not found (no NVIDIA driver)");
        return;
    }
    fn_void init, shutdown;
    fn_errstr errstr;
    fn_uint count;
    fn_handle handle;
    *(void **)&init = sym(lib, "nvmlInit_v2");
    *(void **)&shutdown = sym(lib, "nvmlShutdown");
    *(void **)&errstr = sym(lib, "nvmlErrorString");
    *(void **)&count = sym(lib, "nvmlDeviceGetCount_v2");
    *(void **)&handle = sym(lib, "nvmlDeviceGetHandleByIndex_v2");
    if (!init || !shutdown || !count || !handle) {
        snprintf(g->why, sizeof(g->why), "libnvidia-ml.so.1 lacks nvmlInit_v2 or nvmlDeviceGetCount_v2 (driver too old)");
        dlclose(lib);
        return;
    }
    nvmlReturn_t rc = init();
    if (rc != NVML_SUCCESS) {
        const char *s = errstr ? errstr(rc) : NULL;
        snprintf(g->why, sizeof(g->why), "nvmlInit failed: %s (%d)", s ? s : "error", rc);
        dlclose(lib);
        return;
    }
    unsigned int n = 0;
    if ((rc = count(&n)) != NVML_SUCCESS) {
        g->nvml = -1;
        snprintf(g->why, sizeof(g->why), "nvmlDeviceGetCount failed (%d)", rc);
        goto out;
    }
    g->nvml = 1;
    g->count = (int32_t)n;
    fn_str driver;
    fn_int cuda;
    *(void **)&driver = sym(lib, "nvmlSystemGetDriverVersion");
    *(void **)&cuda = sym(lib, "nvmlSystemGetCudaDriverVersion_v2");
    if (driver && driver(g->driver, sizeof(g->driver)) != NVML_SUCCESS)
        g->driver[0] = '\0';
    g->driver[sizeof(g->driver) - 1] = '\0';
    int v = 0;
    if (cuda && cuda(&v) == NVML_SUCCESS)
        g->cuda = v;
    if (gpu < 0)
        goto out;
    nvmlDevice_t dev;
    if (gpu >= (int)n || handle((unsigned int)gpu, &dev) != NVML_SUCCESS) {
        g->nvml = -1;
        snprintf(g->why, sizeof(g->why), "GPU %d: NVML has no handle for it (it sees %u GPUs)", gpu, n);
        goto out;
    }
    fn_name name;
    fn_mem mem;
    fn_ecc ecc;
    fn_retired retired;
    fn_pending pending;
    fn_remap remap;
    fn_link link;
    *(void **)&name = sym(lib, "nvmlDeviceGetName");
    *(void **)&mem = sym(lib, "nvmlDeviceGetMemoryInfo");
    *(void **)&ecc = sym(lib, "nvmlDeviceGetEccMode");
    *(void **)&retired = sym(lib, "nvmlDeviceGetRetiredPages");
    *(void **)&pending = sym(lib, "nvmlDeviceGetRetiredPagesPendingStatus");
    *(void **)&remap = sym(lib, "nvmlDeviceGetRemappedRows");
    *(void **)&link = sym(lib, "nvmlDeviceGetNvLinkState");
    if (name && name(dev, g->name, sizeof(g->name)) != NVML_SUCCESS)
        g->name[0] = '\0';
    g->name[sizeof(g->name) - 1] = '\0';
    nvmlMemory_t m;
    if (mem && mem(dev, &m) == NVML_SUCCESS) {
        g->mem_total = (double)m.total;
        g->mem_free = (double)m.free;
    }
    int cur, pend;
    if (ecc && ecc(dev, &cur, &pend) == NVML_SUCCESS) {
        g->ecc_current = cur != 0;
        g->ecc_pending = pend != 0;
    }
    if (retired) {
        for (int cause = 0; cause < 2; cause++) { /* multiple single-bit errors, double-bit errors */
            unsigned int c = 0;
            rc = retired(dev, cause, &c, NULL);
            if (rc == NVML_SUCCESS || rc == NVML_ERROR_INSUFFICIENT_SIZE)
                *(cause ? &g->retired_dbe : &g->retired_sbe) = (int32_t)c;
        }
    }
    if (pending && pending(dev, &pend) == NVML_SUCCESS)
        g->retired_pending = pend != 0;
    unsigned int corr, unc, rpend, fail;
    if (remap && remap(dev, &corr, &unc, &rpend, &fail) == NVML_SUCCESS) {
        g->remap_corr = (int32_t)corr;
        g->remap_unc = (int32_t)unc;
        g->remap_pending = rpend != 0;
        g->remap_failure = fail != 0;
    }
    if (link)
        for (unsigned int l = 0; l < NVML_NVLINK_MAX_LINKS; l++) {
            int active;
            if (link(dev, l, &active) != NVML_SUCCESS)
                continue; /* not a link of this GPU */
            if (active)
                g->links_up++;
            else
                g->links_down++;
        }
out:
    shutdown();
    dlclose(lib);
    if (g->nvml == 1 && gpu >= 0) {
        /* the domain NVML finds (topology.h), to set against a topology file */
        int gpus = 0;
        char why[128];
        if (am_nvml_domain(host, gpu, &gpus, g->nvml_domain, sizeof(g->nvml_domain), why, sizeof(why)) != 1)
            g->nvml_domain[0] = '\0';
    }
}
