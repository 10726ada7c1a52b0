/* probe.c - am-doctor's options, its fault injection, what a rank finds about its node
 * (PMIx, memory, disk, topology) and the clock exchange (doctor.h). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "doctor.h"
#include "util.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

/* ---- options -------------------------------------------------------------------------- */

void am_doc_opts_default(struct am_doc_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->max_skew_s = 0.5;
    o->bytes = 4u << 20;
}

static const char usage[] =
    "usage: am-doctor [--json] [--min-mem-gb G] [--min-disk-gb G] [--max-skew S]\n"
    "                 [--expect-domain-gbs B] [--expect-nodes-gbs B] [--bytes N] [--timeout S]\n"
    "  started by am-launch --doctor (srun --mpi=pmix am-launch --doctor RECIPE [-- OPTIONS])\n"
    "  --json                 one JSON object instead of the tables\n"
    "  --min-mem-gb G         free memory each node needs (default: the plan's estimate on CPUs)\n"
    "  --min-disk-gb G        free disk where checkpoints go (default: the checkpoints kept and one more)\n"
    "  --max-skew S           largest clock difference between nodes, seconds (default 0.5)\n"
    "  --expect-domain-gbs B  all-reduce bus bandwidth expected in an NVLink domain, GB/s\n"
    "                         (default: NCCL 100, UCX 0.02)\n"
    "  --expect-nodes-gbs B   the same across nodes (default: NCCL 10, UCX 0.02)\n"
    "  --bytes N              all-reduce size per rank (default 4194304)\n"
    "  --timeout S            bound on each all-reduce, seconds (default: the recipe's\n"
    "                         dist_env.timeout_minutes, at most 60 s)\n";

static int number(const char *opt, const char *v, double lo, double *out, char *err, size_t err_len)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (*v == '\0' || *end || errno || !(x >= lo) || x > 1e15)
        return am_fail(err, err_len, "%s: '%s' is not a number of at least %g", opt, v, lo);
    *out = x;
    return 0;
}

int am_doc_opts_parse(struct am_doc_opts *o, int argc, char **argv, FILE *out, char *err, size_t err_len)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        double x = 0;
        if (strcmp(a, "--json") == 0) {
            o->json = 1;
            continue;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(usage, out);
            return 1;
        }
        static const char *const valued[] = {"--min-mem-gb", "--min-disk-gb", "--max-skew",
                                             "--expect-domain-gbs", "--expect-nodes-gbs", "--bytes", "--timeout"};
        int k = -1;
        for (int j = 0; j < 7; j++)
            if (strcmp(a, valued[j]) == 0)
                k = j;
        if (k < 0)
            return am_fail(err, err_len, "unknown option '%s' (am-doctor --help lists them)", a);
        if (i + 1 >= argc)
            return am_fail(err, err_len, "%s needs a value", a);
        if (number(a, argv[++i], k == 5 ? 8 : k == 6 ? 0.1 : 0, &x, err, err_len) < 0)
            return -1;
        switch (k) {
        case 0: o->min_mem = x * GIB; break;
        case 1: o->min_disk = x * GIB; break;
        case 2: o->max_skew_s = x; break;
        case 3: o->bw_domain = x * 1e9; break;
        case 4: o->bw_nodes = x * 1e9; break;
        case 5: o->bytes = (size_t)x / 4 * 4; break;
        default: o->timeout_s = x; break;
        }
    }
    return 0;
}

/* ---- fault injection -------------------------------------------------------------------- */

int am_doc_fault_parse(const char *spec, struct am_doc_fault *f, char *err, size_t err_len)
{
    memset(f, 0, sizeof(*f));
    f->rank = -1;
    if (!spec || !*spec)
        return 0;
    int rank = -1, n = 0;
    char kind[32] = "";
    if (sscanf(spec, "rank=%d,kind=%31[^:]%n", &rank, kind, &n) != 2 || rank < 0)
        goto bad;
    if (strcmp(kind, "skip-allreduce") == 0 && spec[n] == '\0') {
        f->rank = rank;
        f->skip = 1;
        return 0;
    }
    if (spec[n] != ':')
        goto bad;
    char *end;
    double v = strtod(spec + n + 1, &end);
    if (*end || end == spec + n + 1)
        goto bad;
    if (strcmp(kind, "slow-allreduce") == 0 && v > 0)
        f->slow_s = v;
    else if (strcmp(kind, "clock") == 0)
        f->clock_s = v;
    else
        goto bad;
    f->rank = rank;
    return 0;
bad:
    return am_fail(err, err_len, "AM_DOCTOR_FAULT='%s': expected rank=R,kind=K with K slow-allreduce:SECONDS (SECONDS > 0), "
                   "clock:SECONDS or skip-allreduce, e.g. rank=1,kind=slow-allreduce:2", spec);
}

/* ---- the node ------------------------------------------------------------------------------ */

/* src cut to fit (NULL: "") */
static void copy(char *dst, size_t len, const char *src)
{
    size_t n = src ? strnlen(src, len - 1) : 0;
    if (n)
        memcpy(dst, src, n);
    dst[n] = '\0';
}

static void probe_pmix(struct am_doc_rank *d)
{
    copy(d->mpi_type, sizeof(d->mpi_type), getenv("SLURM_MPI_TYPE"));
    copy(d->pmix_lib, sizeof(d->pmix_lib), getenv("AM_PMIX_VERSION"));
    copy(d->pmix_server, sizeof(d->pmix_server), getenv("PMIX_VERSION"));
    const char *dir = getenv("PMIX_SERVER_TMPDIR");
    copy(d->pmix_dir, sizeof(d->pmix_dir), dir);
    if (!getenv("PMIX_NAMESPACE") || !dir || !*dir)
        return; /* standalone, or a server that names no directory */
    struct stat st;
    if (stat(dir, &st) < 0) {
        snprintf(d->pmix_why, sizeof(d->pmix_why), "%s", strerror(errno));
        return;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(d->pmix_why, sizeof(d->pmix_why), "not a directory");
        return;
    }
    /* writable for real (root passes access(2) on any mode): create a file and remove it */
    char probe[AM_DOC_PATH + 32];
    snprintf(probe, sizeof(probe), "%s/.am-doctor-XXXXXX", dir);
    int fd = mkstemp(probe);
    if (fd < 0) {
        snprintf(d->pmix_why, sizeof(d->pmix_why), "cannot create a file in it: %s", strerror(errno));
        return;
    }
    close(fd);
    unlink(probe);
}

/* MemTotal and MemAvailable of /proc/meminfo, in bytes (-1: unknown). */
static void probe_memory(struct am_doc_rank *d)
{
    d->mem_avail = d->mem_total = -1;
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return;
    char line[256];
    while (fgets(line, sizeof(line), f)) {
        unsigned long long kb;
        if (sscanf(line, "MemTotal: %llu kB", &kb) == 1)
            d->mem_total = (double)kb * 1024;
        else if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
            d->mem_avail = (double)kb * 1024;
    }
    fclose(f);
}

/* statvfs of dir, or of its nearest existing parent. */
static void probe_disk(struct am_doc_rank *d, const char *dir)
{
    char path[PATH_MAX];
    d->disk_free = -1;
    if (!dir || !*dir)
        dir = "checkpoints";
    if (dir[0] == '/')
        snprintf(path, sizeof(path), "%s", dir);
    else {
        char cwd[PATH_MAX];
        if (!getcwd(cwd, sizeof(cwd))) {
            snprintf(d->disk_why, sizeof(d->disk_why), "cannot read the working directory: %s", strerror(errno));
            return;
        }
        snprintf(path, sizeof(path), "%.2000s/%.2000s", cwd, dir);
    }
    copy(d->disk_for, sizeof(d->disk_for), path);
    for (;;) {
        struct statvfs v;
        if (statvfs(path, &v) == 0) {
            copy(d->disk_path, sizeof(d->disk_path), path);
            d->disk_free = (double)v.f_bavail * (double)v.f_frsize;
            if (access(path, W_OK) < 0)
                snprintf(d->disk_why, sizeof(d->disk_why), "%.160s is not writable: %s", path, strerror(errno));
            return;
        }
        char *slash = strrchr(path, '/');
        if (!slash || slash == path) {
            snprintf(d->disk_why, sizeof(d->disk_why), "no existing directory above %.200s", d->disk_for);
            return;
        }
        *slash = '\0';
    }
}

void am_doc_probe(struct am_doc_rank *d, const struct am_rank_setup *s, const char *ckpt_dir)
{
    d->rank = s->info.rank;
    d->node_id = s->info.node_id;
    d->local_rank = s->info.local_rank;
    copy(d->host, sizeof(d->host), s->info.host);
    probe_pmix(d);
    probe_memory(d);
    probe_disk(d, ckpt_dir);
    copy(d->domain, sizeof(d->domain), s->topo.domain);
    copy(d->topo_source, sizeof(d->topo_source), s->topo.source);
    d->topo_gpus = -1;
    const char *file = getenv("AM_TOPOLOGY_FILE");
    if (file && *file) {
        struct am_topology t;
        struct am_errors e;
        am_errors_init(&e);
        if (am_topology_load(file, &t, &e) == 0) {
            const struct am_topo_node *n = am_topology_node(&t, s->info.host);
            if (n)
                d->topo_gpus = n->gpus;
        }
        am_topology_free(&t);
        am_errors_free(&e);
    }
    am_doc_gpu_probe(&d->gpu, s->info.host, s->topo.gpu.gpu);
}

/* ---- the clock -------------------------------------------------------------------------------- */

double am_doc_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int am_doc_clock(struct am_boot *b, double timeout_s, const struct am_doc_fault *f, int rank,
                 struct am_doc_rank *d, char *err, size_t err_len)
{
    double shift = f->rank == rank ? f->clock_s : 0;
    for (int k = 0; k < AM_DOC_CLOCK_ROUNDS; k++) {
        d->clk_t1[k] = am_doc_now() + shift;
        if (am_boot_fence(b, timeout_s, err, err_len) < 0)
            return -1;
        d->clk_t2[k] = am_doc_now() + shift;
    }
    return 0;
}
