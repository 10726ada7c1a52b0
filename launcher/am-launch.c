/* am-launch - start a job's ranks and supervise them (launch.h).
 *
 *   am-launch --nproc N [options] RECIPE [-- PROGRAM ARGS...]     N ranks on this machine
 *   srun --mpi=pmix am-launch [options] RECIPE [-- PROGRAM ...]   one rank per Slurm task
 *   srun --mpi=none am-launch [options] RECIPE [-- PROGRAM ...]   the same, without PMIx
 *
 * RECIPE may be left out when AM_RECIPE is set (the SPANK plugin's --am-recipe sets it).
 * With --doctor the rank program is am-doctor (runtime/doctor/doctor.h), and what follows `--`
 * are its options: `am-launch --doctor RECIPE -- --json`.
 * The rank program defaults to am-train (with --dry-run: am-place), looked up next to
 * am-launch, then in the installed helper directory. It finds its launcher through
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

#include "cpu_env.h"
#include "launch.h"
#include "version.h"

#ifndef AM_PKGLIBEXECDIR
#define AM_PKGLIBEXECDIR "/usr/local/libexec/am"
#endif

static void usage(FILE *f)
{
    fprintf(f, "usage: am-launch --nproc N [options] [RECIPE] [-- PROGRAM ARGS...]\n"
               "       srun --mpi=pmix am-launch [options] [RECIPE] [-- PROGRAM ARGS...]\n"
               "       srun --mpi=none am-launch [options] [RECIPE] [-- PROGRAM ARGS...]\n"
               "  --nproc N          run N ranks on this machine (no Slurm needed)\n"
               "  --dry-run          stop after placement: rank 0 prints one JSON line per rank\n"
               "  --doctor           check the node set instead of training: rank 0 prints a report;\n"
               "                     what follows `--` are am-doctor's options (-- --help lists them)\n"
               "  --topology FILE    NVLink domains from FILE instead of NVML (also AM_TOPOLOGY_FILE)\n"
               "  --log-dir DIR      where rank logs and exit records go (also AM_LOG_DIR; default ./am-logs)\n"
               "  --boot-port PORT   srun without PMIx: the TCP port of the step's boot server (also\n"
               "                     AM_BOOT_PORT; default: derived from the job and step ids)\n"
               "  RECIPE             the recipe (default: $AM_RECIPE, set by sbatch/srun --am-recipe)\n"
               "  PROGRAM            the rank program (default: am-train, or am-place with --dry-run)\n");
}

/* A helper program: next to am-launch (the build tree, or bindir), else the installed
 * helper directory. */
static void helper(const char *name, char *out, size_t len)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
        self[n] = '\0';
        snprintf(out, len, "%s/%s", dirname(self), name);
        if (access(out, X_OK) == 0)
            return;
    }
    snprintf(out, len, "%s/%s", AM_PKGLIBEXECDIR, name);
}

static int absolute(const char *what, const char *path, char *out)
{
    if (realpath(path, out))
        return 0;
    fprintf(stderr, "am-launch: %s %s: %s\n", what, path, strerror(errno));
    return -1;
}

int main(int argc, char **argv)
{
    if (am_version_option(argc, argv, "am-launch"))
        return 0;
    static const struct option opts[] = {{"nproc", required_argument, 0, 'n'},
                                         {"dry-run", no_argument, 0, 'd'},
                                         {"doctor", no_argument, 0, 'D'},
                                         {"topology", required_argument, 0, 't'},
                                         {"log-dir", required_argument, 0, 'l'},
                                         {"boot-port", required_argument, 0, 'p'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    struct am_launch_opts o = {.grace_s = 5};
    char recipe[PATH_MAX], topology[PATH_MAX], program[PATH_MAX + 16];
    const char *topology_arg = NULL;
    int dry_run = 0, doctor = 0, c;
    while ((c = getopt_long(argc, argv, "+h", opts, NULL)) != -1) {
        char *end;
        switch (c) {
        case 'n': {
            errno = 0;
            long v = strtol(optarg, &end, 10);
            if (*optarg == '\0' || *end || errno || v < 1 || v > 4096) {
                fprintf(stderr, "am-launch: --nproc: '%s' is not a whole number from 1 to 4096\n", optarg);
                return 2;
            }
            o.nproc = (int)v;
            break;
        }
        case 'd':
            dry_run = 1;
            break;
        case 'D':
            doctor = 1;
            break;
        case 't':
            topology_arg = optarg;
            break;
        case 'l':
            o.log_dir = optarg;
            break;
        case 'p': {
            errno = 0;
            long v = strtol(optarg, &end, 10);
            if (*optarg == '\0' || *end || errno || v < 1 || v > 65535) {
                fprintf(stderr, "am-launch: --boot-port: '%s' is not a TCP port (1 to 65535)\n", optarg);
                return 2;
            }
            setenv("AM_BOOT_PORT", optarg, 1);
            break;
        }
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }

    /* RECIPE, then `--` and the program (getopt has eaten a `--` that came first) */
    const char *recipe_arg = NULL;
    int program_next = optind > 1 && strcmp(argv[optind - 1], "--") == 0;
    if (!program_next && optind < argc && strcmp(argv[optind], "--") != 0)
        recipe_arg = argv[optind++];
    if (!program_next && optind < argc && strcmp(argv[optind], "--") == 0)
        optind++;
    else if (!program_next && optind < argc) {
        fprintf(stderr, "am-launch: unexpected '%s' after the recipe: put the rank program after `--`\n", argv[optind]);
        return 2;
    }
    if (!recipe_arg) {
        recipe_arg = getenv("AM_RECIPE");
        if (!recipe_arg || !*recipe_arg) {
            fprintf(stderr, "am-launch: no recipe: give RECIPE, or set AM_RECIPE (sbatch/srun --am-recipe does)\n");
            usage(stderr);
            return 2;
        }
    }
    if (absolute("recipe", recipe_arg, recipe) < 0)
        return 2;
    setenv("AM_RECIPE", recipe, 1);
    if (!topology_arg)
        topology_arg = getenv("AM_TOPOLOGY_FILE");
    if (topology_arg && *topology_arg) {
        if (absolute("topology file", topology_arg, topology) < 0)
            return 2;
        setenv("AM_TOPOLOGY_FILE", topology, 1);
    }
    if (dry_run)
        setenv("AM_DRY_RUN", "1", 1);
    char *default_argv[] = {program, NULL};
    char **doctor_argv = NULL;
    if (doctor) { /* am-doctor, with what follows `--` as its options */
        if (dry_run) {
            fprintf(stderr, "am-launch: --doctor and --dry-run: give one of them\n");
            return 2;
        }
        helper("am-doctor", program, sizeof(program));
        doctor_argv = calloc((size_t)(argc - optind + 2), sizeof(char *));
        if (!doctor_argv) {
            fprintf(stderr, "am-launch: out of memory\n");
            return 1;
        }
        doctor_argv[0] = program;
        for (int i = optind; i < argc; i++)
            doctor_argv[i - optind + 1] = argv[i];
        o.argv = doctor_argv;
    } else if (optind < argc) {
        o.argv = &argv[optind];
    } else {
        helper(dry_run ? "am-place" : "am-train", program, sizeof(program));
        o.argv = default_argv;
    }

    const char *ns = getenv("PMIX_NAMESPACE"), *pmix_rank = getenv("PMIX_RANK");
    int under_pmix = ns && *ns && pmix_rank && *pmix_rank;
    if (under_pmix && o.nproc > 0) {
        fprintf(stderr, "am-launch: --nproc starts ranks on this machine without Slurm, but this am-launch runs under "
                        "a PMIx server (srun --mpi=pmix), where every task is one rank: drop --nproc\n");
        return 2;
    }
    am_cpu_env_defaults(o.nproc > 0 ? o.nproc : am_cpu_env_slurm_local_tasks());
    if (o.nproc > 0)
        return am_launch_standalone(&o);
    if (under_pmix) {
#ifdef AM_HAVE_PMIX
        return am_launch_pmix(&o);
#else
        fprintf(stderr, "am-launch: this am-launch was built without PMIx: install libpmix-dev and rebuild, or run "
                        "`am-launch --nproc N` on one machine\n");
        return 2;
#endif
    }
    if (getenv("SLURM_STEP_ID") && getenv("SLURM_PROCID")) /* its error names both ways */
        return am_launch_slurm_env(&o);
    fprintf(stderr, "am-launch: no --nproc and no PMIx server: run `am-launch --nproc N %s` on one machine, or "
                        "`srun --mpi=pmix am-launch %s` under Slurm\n", recipe_arg, recipe_arg);
    return 2;
}
