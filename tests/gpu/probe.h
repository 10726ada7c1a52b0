/* probe.h - whether tests/gpu can run on this machine, decided once for gpu_check and
 * pool_check: the CUDA driver's and runtime's versions first, then RUN, SKIP or FAIL.
 *
 * SKIP (exit 77, automake's) only where the machine has no NVIDIA device at all: no device
 * node (/dev/nvidia0, /dev/nvidia1, ...), or cudaGetDeviceCount says cudaErrorNoDevice or 0
 * devices (CUDA_VISIBLE_DEVICES= hides them all). Any other CUDA error where a device node
 * exists is a FAIL naming the error: a driver older than the runtime this build links
 * (cudaErrorInsufficientDriver), a device the driver cannot initialise, ... would otherwise
 * skip the whole GPU suite on a GPU machine, silently. On a machine without the driver
 * (CI, this build's CPUs), cudaGetDeviceCount fails with cudaErrorInsufficientDriver and there
 * is no device node: SKIP. gpu_verdict is the decision alone (gpu_check --self-test runs it on
 * every case); gpu_probe asks the machine. */
#ifndef AM_TESTS_GPU_PROBE_H
#define AM_TESTS_GPU_PROBE_H

#include <cuda_runtime_api.h>
#include <glob.h>
#include <stdbool.h>
#include <stdio.h>

enum gpu_verdict { GPU_RUN = 0, GPU_FAIL = 1, GPU_SKIP = 77 };

/* The decision from cudaGetDeviceCount's error and count and whether an NVIDIA device node
 * exists; why: the reason, one line. */
static enum gpu_verdict gpu_verdict(cudaError_t e, int ndev, bool nodes, int driver, int runtime, char *why,
                                    size_t why_len)
{
    if (e == cudaSuccess && ndev > 0) {
        snprintf(why, why_len, "%d CUDA device%s", ndev, ndev == 1 ? "" : "s");
        return GPU_RUN;
    }
    if (e == cudaSuccess) {
        snprintf(why, why_len, "no NVIDIA device (cudaGetDeviceCount: 0 devices)");
        return GPU_SKIP;
    }
    if (e == cudaErrorNoDevice || !nodes) {
        snprintf(why, why_len, "no NVIDIA device (%scudaGetDeviceCount: %s: %s)",
                 nodes ? "" : "no /dev/nvidia[0-9]* device node; ", cudaGetErrorName(e), cudaGetErrorString(e));
        return GPU_SKIP;
    }
    if (e == cudaErrorInsufficientDriver)
        snprintf(why, why_len, "an NVIDIA device is here but CUDA cannot use it: cudaGetDeviceCount: %s: %s (driver "
                 "%d.%d, runtime %d.%d: install a driver for CUDA %d.%d or later, or build with an older toolkit)",
                 cudaGetErrorName(e), cudaGetErrorString(e), driver / 1000, driver % 1000 / 10, runtime / 1000,
                 runtime % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
    else
        snprintf(why, why_len, "an NVIDIA device is here but CUDA cannot use it: cudaGetDeviceCount: %s: %s",
                 cudaGetErrorName(e), cudaGetErrorString(e));
    return GPU_FAIL;
}

/* true when the machine has an NVIDIA device node */
static bool gpu_nodes(void)
{
    glob_t g;
    int rc = glob("/dev/nvidia[0-9]*", 0, NULL, &g);
    bool any = rc == 0 && g.gl_pathc > 0;
    if (rc == 0)
        globfree(&g);
    return any;
}

/* Prints the versions and the verdict (prog: the program's name, as its lines begin) and
 * returns the verdict. */
static enum gpu_verdict gpu_probe(const char *prog)
{
    int driver = 0, runtime = 0, ndev = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess)
        driver = 0;
    if (cudaRuntimeGetVersion(&runtime) != cudaSuccess)
        runtime = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    cudaGetLastError();
    if (driver)
        printf("%s: CUDA driver %d.%d, runtime %d.%d (this build)\n", prog, driver / 1000, driver % 1000 / 10,
               runtime / 1000, runtime % 1000 / 10);
    else
        printf("%s: no CUDA driver (libcuda), runtime %d.%d (this build)\n", prog, runtime / 1000, runtime % 1000 / 10);
    char why[512];
    enum gpu_verdict v = gpu_verdict(e, ndev, gpu_nodes(), driver, runtime, why, sizeof why);
    if (v == GPU_SKIP)
        printf("skipped: %s\n", why);
    else if (v == GPU_FAIL)
        printf("FAIL: %s\n", why);
    else
        printf("%s: %s\n", prog, why);
    fflush(stdout);
    return v;
}

#endif
