/* doctor.h - am-doctor: will this node set train? The pre-flight check of the nodes a job
 * runs on, made the way the job will use them: started by `srun --mpi=pmix am-launch
 * --doctor RECIPE` (or `am-launch --nproc N --doctor RECIPE`), one rank per task, over the
 * same bootstrap, topology, placement, plan and communicators as am-train.
 *
 * Every rank
 *   1. runs the rank setup (rank_setup.h: bootstrap, recipe, topology, placement, plan);
 *   2. probes its node (am_doc_probe): Slurm's MPI plugin and PMIx (SLURM_MPI_TYPE, the
 *      libpmix version am-launch linked, AM_PMIX_VERSION, the server's PMIX_VERSION and its
 *      directory PMIX_SERVER_TMPDIR, which must be a writable directory), free memory
 *      (/proc/meminfo MemAvailable), free disk where checkpoints go (statvfs of the
 *      recipe's checkpoint directory or its nearest existing parent), and NVML's view of
 *      its GPU (am_doc_gpu_probe: count, memory, ECC, retired pages and remapped rows,
 *      NVLink state, driver and CUDA versions; and, when a topology file names the
 *      domains, the domain NVML finds, to compare);
 *   3. exchanges timestamps through the bootstrap (am_doc_clock: fences bracketed by clock
 *      readings, a round trip that bounds each rank's offset from rank 0's);
 *   4. times a short all-reduce in every NVLink domain (the tensor-parallel groups' links)
 *      and across nodes (one rank per node), over the job's transport (NCCL on GPUs, UCX
 *      on CPUs) (am_doc_bandwidth);
 *   5. sends all of it to rank 0 (am_boot_allgather), which sets it against the plan and the
 *      thresholds and prints one report (am_doc_report): a table per node, nodes with
 *      problems first and in each table the problems first, each with what to do; --json
 *      for scripts. The exit status is 0 only when nothing stops the job.
 *
 * Fault injection (the doctor's own tests): AM_DOCTOR_FAULT=rank=R,kind=K, K one of
 *   slow-allreduce:SECONDS   rank R waits SECONDS before each timed all-reduce (a slow node)
 *   clock:SECONDS            rank R's clock readings are SECONDS ahead (a skewed clock)
 *   skip-allreduce           rank R takes no part in the timed all-reduces, as behind a dead
 *                            link: the others' calls time out waiting for it
 * Errors: the runtime's convention (util.h).
 */
#ifndef AM_DOCTOR_H
#define AM_DOCTOR_H

#include <stdint.h>
#include <stdio.h>

#include "comm.h"
#include "placement.h"
#include "rank_setup.h"

#define AM_DOC_TEXT 256
#define AM_DOC_PATH 256
#define AM_DOC_CLOCK_ROUNDS 8
#define AM_DOC_ITERS 5 /* timed all-reduces per test (after one untimed) */

/* ---- what one rank finds (fixed size: all-gathered as bytes) ---------------------------- */

struct am_doc_gpu {
    int32_t nvml;              /* 1 read; 0 no NVML (why); -1 NVML failed (why) */
    char why[AM_DOC_TEXT];
    int32_t count;             /* GPUs NVML sees on the node */
    char driver[32];           /* nvmlSystemGetDriverVersion */
    int32_t cuda;              /* CUDA version the driver supports, 12040 = 12.4; 0 unknown */
    int32_t index;             /* this rank's GPU; -1: none bound */
    char name[64];
    double mem_total, mem_free; /* bytes */
    int32_t ecc_current, ecc_pending;                   /* 1 on, 0 off, -1 unknown */
    int32_t retired_sbe, retired_dbe, retired_pending;  /* pages; -1 unknown */
    int32_t remap_corr, remap_unc, remap_pending, remap_failure; /* rows; -1 unknown */
    int32_t links_up, links_down;                       /* NVLink links active / inactive */
    char nvml_domain[AM_DOMAIN_MAX]; /* the domain NVML finds for the GPU ("" unknown) */
};

struct am_doc_fault {
    int rank;           /* -1: none */
    double slow_s;      /* slow-allreduce:SECONDS */
    double clock_s;     /* clock:SECONDS */
    int skip;           /* skip-allreduce */
};

/* One all-reduce test as one rank saw it. */
struct am_doc_bw {
    int32_t kind;       /* 0 none, 1 NVLink domain, 2 across nodes */
    int32_t group;      /* index of the group among those of its kind */
    int32_t size;       /* ranks in the group */
    int32_t failed;     /* the call failed: err says why */
    int32_t absent;     /* the rank did not take part (fault injection) */
    double call_s[AM_DOC_ITERS]; /* this rank's time inside each timed all-reduce */
    double bytes;       /* per rank */
    char err[AM_COMM_ERR_LEN];
};

struct am_doc_rank {
    int32_t rank, node_id, local_rank, setup_ok;
    char host[AM_PLACE_HOST_MAX];
    /* PMIx */
    char mpi_type[32];           /* SLURM_MPI_TYPE ("" outside Slurm) */
    char pmix_lib[96];           /* AM_PMIX_VERSION (am-launch's PMIx_Get_version) */
    char pmix_server[32];        /* PMIX_VERSION */
    char pmix_dir[AM_DOC_PATH];  /* PMIX_SERVER_TMPDIR */
    char pmix_why[AM_DOC_TEXT];  /* "" usable, else why not */
    /* memory and disk */
    double mem_avail, mem_total; /* bytes; -1 unknown */
    char disk_path[AM_DOC_PATH]; /* the directory measured */
    char disk_for[AM_DOC_PATH];  /* the checkpoint directory it stands for */
    double disk_free;            /* bytes; -1 unknown (disk_why) */
    char disk_why[AM_DOC_TEXT];
    /* clock */
    double clk_t1[AM_DOC_CLOCK_ROUNDS], clk_t2[AM_DOC_CLOCK_ROUNDS];
    /* topology */
    char domain[AM_DOMAIN_MAX];
    char topo_source[64];
    int32_t topo_gpus;           /* GPUs the topology file gives the node; -1 no file */
    struct am_doc_gpu gpu;
    /* communicators */
    char transport[8];           /* "ucx", "nccl" */
    char comm_err[AM_COMM_ERR_LEN]; /* the communicators could not be set up ("" fine) */
    struct am_doc_bw bw[2];      /* [0] the domain test, [1] the nodes test */
};

/* ---- options ------------------------------------------------------------------------ */

struct am_doc_opts {
    int json;
    double min_mem, min_disk;  /* bytes per node; 0: from the plan */
    double max_skew_s;
    double bw_domain, bw_nodes; /* expected bus bandwidth, bytes/s; 0: the transport's default */
    size_t bytes;               /* all-reduce size per rank */
    double timeout_s;           /* bound on each all-reduce; 0: the recipe's, at most 60 s */
};
void am_doc_opts_default(struct am_doc_opts *o);
/* Parses am-doctor's arguments. 0, 1 for --help (usage printed to out), or -1 with the
 * message in err. */
int am_doc_opts_parse(struct am_doc_opts *o, int argc, char **argv, FILE *out, char *err, size_t err_len);

/* AM_DOCTOR_FAULT (spec NULL or "": none). 0, or -1 with a message naming the variable. */
int am_doc_fault_parse(const char *spec, struct am_doc_fault *f, char *err, size_t err_len);

/* ---- the probes (probe.c, gpu_probe.c) --------------------------------------------------- */

/* Fills the node fields of d (PMIx, memory, disk for ckpt_dir, topology) for this rank. */
void am_doc_probe(struct am_doc_rank *d, const struct am_rank_setup *s, const char *ckpt_dir);
/* NVML's view of GPU `gpu` (-1: the node only) on host; never fails (g->nvml, g->why). */
void am_doc_gpu_probe(struct am_doc_gpu *g, const char *host, int gpu);

/* The clock: AM_DOC_CLOCK_ROUNDS fences, each bracketed by readings of CLOCK_REALTIME
 * (plus the fault's offset on its rank). Collective. */
int am_doc_clock(struct am_boot *b, double timeout_s, const struct am_doc_fault *f, int rank,
                 struct am_doc_rank *d, char *err, size_t err_len);
double am_doc_now(void);

/* ---- the communicators (bandwidth.c) ------------------------------------------------------ */

/* Creates the test groups from every rank's host and domain (all[r]), times the all-reduces
 * and fills d->bw and d->transport. Collective. Returns 0, or -1 when the communicators
 * could not be set up at all (err). */
int am_doc_bandwidth(struct am_rank_setup *s, const struct am_doc_rank *all, struct am_doc_rank *d,
                     const struct am_doc_opts *o, const struct am_doc_fault *f, char *err, size_t err_len);

/* ---- the report (report.c) ---------------------------------------------------------------- */

/* What the plan needs, for the report. */
struct am_doc_need {
    double rank_mem;       /* bytes per rank on its device (the plan's estimate) */
    double ckpt_bytes;     /* one checkpoint; 0: checkpoints disabled */
    int gpu_job;           /* the ranks run on GPUs */
    int cuda_built;        /* the CUDA runtime am was built with (12040 = 12.4); 0: none */
    const char *recipe;
};

/* Rank 0: the report of all n ranks on f. Returns the number of problems (0: the job can
 * run). */
int am_doc_report(FILE *f, const struct am_doc_rank *all, int n, const struct am_doc_need *need,
                  const struct am_doc_opts *o);

#endif
