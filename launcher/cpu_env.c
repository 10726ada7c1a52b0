/* cpu_env.c - thread and BLAS defaults for the ranks (cpu_env.h). */
#include "cpu_env.h"

#include <cpuid.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>

static const char *blas_coretype(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return NULL;
    unsigned avx512 = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31); /* F, DQ, BW, VL */
    if ((b & avx512) == avx512)
        return "SkylakeX";
    int avx2 = (b >> 5) & 1;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return NULL;
    int fma = (c >> 12) & 1;
    return avx2 && fma ? "Haswell" : NULL;
}

void am_cpu_env_defaults(int ranks_on_node)
{
    if (!getenv("OMP_NUM_THREADS")) {
        cpu_set_t set;
        int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
        int per = ranks_on_node > 0 ? cores / ranks_on_node : cores;
        char v[16];
        snprintf(v, sizeof(v), "%d", per > 0 ? per : 1);
        setenv("OMP_NUM_THREADS", v, 0);
    }
    const char *type = blas_coretype();
    if (type)
        setenv("OPENBLAS_CORETYPE", type, 0);
}

int am_cpu_env_slurm_local_tasks(void)
{
    const char *list = getenv("SLURM_STEP_TASKS_PER_NODE"), *node = getenv("SLURM_NODEID");
    if (!list || !node)
        return 0;
    long want = strtol(node, NULL, 10), index = 0;
    const char *p = list;
    while (*p) {
        char *end;
        long tasks = strtol(p, &end, 10), repeat = 1;
        if (end == p)
            return 0;
        p = end;
        if (p[0] == '(' && p[1] == 'x') {
            repeat = strtol(p + 2, &end, 10);
            p = end + (*end == ')');
        }
        if (want < index + repeat)
            return (int)tasks;
        index += repeat;
        if (*p == ',')
            p++;
    }
    return 0;
}
