/* version.h - every program's --version: its name, am's version and what the build has
 * (configure's AM_BUILT_WITH: CUDA, cuDNN and NCCL with their versions, PMIx, UCX, OpenBLAS,
 * the SPANK plugin), for example
 *   am-plan (am) 0.1.0
 *   built with: CUDA 13.0, cuDNN 9.19.0, NCCL 2.28.9, PMIx 4.2.2, UCX 1.13.1, OpenBLAS 0.3.21, Slurm SPANK */
#ifndef AM_VERSION_H
#define AM_VERSION_H

#include <stdbool.h>

/* When argv[1] is --version: prints the above for prog on stdout and returns true. */
bool am_version_option(int argc, char **argv, const char *prog);

#endif
