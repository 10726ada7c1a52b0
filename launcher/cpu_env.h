/* cpu_env.h - thread and BLAS defaults for the ranks of one node, set before they start.
 *
 * Several ranks share a node's cores: each rank's OpenMP pool gets its share
 * (OMP_NUM_THREADS = usable cores / ranks on the node, at least 1), so ranks never fight
 * over cores. OpenBLAS picks its kernels once, when it loads, from the CPU it recognises; a
 * release older than the CPU falls back to its slowest generic kernels, several times
 * slower. When OPENBLAS_CORETYPE is unset and the CPU has AVX-512 (F, BW, DQ, VL) or
 * AVX2 + FMA, it is set to SkylakeX or Haswell. A value the user or site set is kept. */
#ifndef AM_CPU_ENV_H
#define AM_CPU_ENV_H

/* Sets the defaults in this process's environment (call before any thread starts). */
void am_cpu_env_defaults(int ranks_on_node);

/* Ranks of this Slurm step on this node, from SLURM_STEP_TASKS_PER_NODE ("2(x3),1") and
 * SLURM_NODEID; 0 when unknown. */
int am_cpu_env_slurm_local_tasks(void);

#endif
