/* am-launch - start a job's ranks and supervise them.
 *
 *   am-launch --nproc N [options] RECIPE [-- PROGRAM ARGS...]     N ranks on this machine
 *   srun --mpi=pmix am-launch [options] RECIPE [-- PROGRAM ...]   one rank per Slurm task
 *
 * The rank program defaults to am-train next to am-launch. It finds its launcher through
 * AM_BOOTSTRAP_FD (bootstrap.h) and the recipe through AM_RECIPE.
 */
#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "standalone.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: am-launch --nproc N [options] RECIPE [-- PROGRAM ARGS...]\n"
               "       srun --mpi=pmix am-launch [options] RECIPE [-- PROGRAM ARGS...]\n"
               "  --nproc N          run N ranks on this machine (no Slurm needed)\n"
               "  --dry-run          stop after placement: print one JSON line per rank\n"
               "  --topology FILE    NVLink domains from FILE instead of NVML (also AM_TOPOLOGY_FILE)\n"
               "  PROGRAM            the rank program (default: am-train next to am-launch)\n");
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {{"nproc", required_argument, 0, 'n'},
                                         {"dry-run", no_argument, 0, 'd'},
                                         {"topology", required_argument, 0, 't'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    struct am_launch_opts o = {.grace_s = 5};
    int c;
    while ((c = getopt_long(argc, argv, "+h", opts, NULL)) != -1) {
        char *end;
        switch (c) {
        case 'n':
            errno = 0;
            long v = strtol(optarg, &end, 10);
            if (*optarg == '\0' || *end || errno || v < 1 || v > 4096) {
                fprintf(stderr, "am-launch: --nproc: '%s' is not a whole number from 1 to 4096\n", optarg);
                return 2;
            }
            o.nproc = (int)v;
            break;
        case 'd':
            setenv("AM_DRY_RUN", "1", 1);
            break;
        case 't':
            setenv("AM_TOPOLOGY_FILE", optarg, 1);
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    char recipe[PATH_MAX];
    if (!realpath(argv[optind], recipe)) {
        fprintf(stderr, "am-launch: %s: %s\n", argv[optind], strerror(errno));
        return 2;
    }
    o.recipe = recipe;
    optind++;
    char self[PATH_MAX], train[PATH_MAX + 16];
    char *default_argv[] = {train, NULL};
    if (optind < argc && strcmp(argv[optind], "--") == 0)
        optind++;
    if (optind < argc) {
        o.argv = &argv[optind];
    } else {
        ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
        self[n > 0 ? n : 0] = '\0';
        snprintf(train, sizeof(train), "%s/am-train", n > 0 ? dirname(self) : ".");
        o.argv = default_argv;
    }
    if (o.nproc > 0)
        return am_launch_standalone(&o);
    fprintf(stderr, "am-launch: no --nproc and no PMIx server: run `am-launch --nproc N %s` on one machine, or "
                    "`srun --mpi=pmix am-launch %s` under Slurm\n", argv[optind - 1], argv[optind - 1]);
    return 2;
}
