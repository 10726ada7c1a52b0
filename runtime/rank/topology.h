/* topology.h - where this rank's GPU is, and which NVLink domain it belongs to.
 *
 * An NVLink domain is a set of GPUs that reach each other over NVLink: the GPUs of one
 * node joined by NVLink/NVSwitch, or the GPUs of several nodes on one NVLink fabric (an
 * NVL72 rack: a "clique"). Tensor-parallel groups must stay inside one (placement.h).
 * A domain is named by a string that is the same on every rank that shares it:
 *   "n1:0", "n1:1"      domains local to node n1 (numbered from its lowest GPU)
 *   "rack-a"            a multi-node domain: a topology file's cluster name
 *   "fabric:UUID:ID"    a multi-node domain found by NVML (cluster UUID and clique id)
 *   "n1"                a node without known GPUs: the whole node is one domain
 *
 * Where the answer comes from, first match wins:
 *   1. a topology file: --topology FILE / AM_TOPOLOGY_FILE (format below);
 *   2. NVML, loaded with dlopen("libnvidia-ml.so.1"): GPUs with NVLink P2P between them form
 *      a domain (connected components), and GPUs whose fabric registration completed with
 *      a cluster UUID share the domain of their clique, across nodes;
 *   3. neither (no file, no NVML library, no GPU): the node is one domain.
 *
 * The topology file (YAML):
 *
 *   nodes:
 *     n1: {gpus: 4, domains: [[0, 1], [2, 3]]}   # two NVLink pairs
 *     "n[2-3]": {gpus: 8}                         # Slurm-style ranges; no domains: one of 8
 *     login1: {gpus: 0}                           # no GPUs: the node is one domain
 *   clusters:                                     # optional: multi-node NVLink domains
 *     - {name: rack-a, nodes: [n2, n3]}           # every GPU of n2 and n3 is in "rack-a"
 *
 * Node names are Slurm's node names (SLURMD_NODENAME), else the host name. `domains`, when
 * given, must list every GPU 0..gpus-1 exactly once. A node belongs to at most one cluster
 * and then has no `domains` of its own. Errors name FILE:LINE:COL, the rule and the fix.
 *
 * GPU binding (am_gpu_bind): the GPUs this rank may use, in CUDA's order, are
 * CUDA_VISIBLE_DEVICES (numbers; translated through SLURM_STEP_GPUS when they are not
 * Slurm's indices, i.e. when a cgroup renumbered them), else SLURM_STEP_GPUS (else
 * SLURM_JOB_GPUS), else all the node's GPUs; the rank takes entry local_rank % count. With
 * more ranks than GPUs on a node, ranks share GPUs round-robin (fine on CPU; NCCL refuses).
 * GPU indices are Slurm's (gres.conf order), which NVML's order matches when gres.conf
 * lists /dev/nvidia0.. in order (AutoDetect=nvml does).
 */
#ifndef AM_TOPOLOGY_H
#define AM_TOPOLOGY_H

#include <stddef.h>

#include "arena.h"
#include "errors.h"

#define AM_DOMAIN_MAX 128

/* ---- the topology file ---------------------------------------------------------------- */

struct am_topo_node {
    const char *name;
    int gpus;
    int *domain_of; /* [gpu] -> index of the node's domain (0.. in order of the lowest GPU) */
    int n_domains;
    int cluster;    /* index into clusters, or -1 */
};

struct am_topology {
    struct am_arena arena; /* everything below lives here */
    const char *file;
    struct am_topo_node *nodes;
    size_t n_nodes;
    const char **clusters;
    size_t n_clusters;
};

/* Reads and checks a topology file. Returns 0, or -1 with every problem in err (each one
 * FILE:LINE:COL: ...). Free with am_topology_free in both cases. */
int am_topology_load(const char *path, struct am_topology *t, struct am_errors *err);
/* The same from a buffer; `name` is used in positions (tests). */
int am_topology_parse(const char *name, const char *buf, size_t len, struct am_topology *t, struct am_errors *err);
void am_topology_free(struct am_topology *t);
const struct am_topo_node *am_topology_node(const struct am_topology *t, const char *host);
/* The domain of `gpu` (-1: none) on node n, as named above. */
void am_topology_domain(const struct am_topology *t, const struct am_topo_node *n, int gpu, char *out, size_t len);

/* ---- NVML ------------------------------------------------------------------------------- */

/* Asks NVML for the node's GPU count and the domain of `gpu` on `host`. Returns 1 with
 * *n_gpus and out set; 0 when NVML is not there (no library, no driver, no GPU: why says
 * which); -1 when NVML failed on a GPU it reported (message in why). With gpu < 0 only the
 * count is set. */
int am_nvml_domain(const char *host, int gpu, int *n_gpus, char *out, size_t len, char *why, size_t why_len);

/* ---- GPU binding ------------------------------------------------------------------------ */

struct am_gpu_binding {
    int gpu;    /* Slurm's/NVML's index of the GPU on the node; -1: none or unknown */
    int device; /* the CUDA device ordinal to use (index in CUDA_VISIBLE_DEVICES); -1: none */
    int n;      /* GPUs the rank could choose from */
};

/* visible = CUDA_VISIBLE_DEVICES, step = SLURM_STEP_GPUS (or SLURM_JOB_GPUS), either NULL;
 * node_gpus: GPUs on the node (0: unknown). Returns 0, or -1 with a message naming the
 * variable in err. */
int am_gpu_bind(const char *visible, const char *step, int local_rank, int node_gpus, struct am_gpu_binding *b,
                char *err, size_t err_len);

/* ---- this rank -------------------------------------------------------------------------- */

struct am_rank_topo {
    char domain[AM_DOMAIN_MAX];
    struct am_gpu_binding gpu;
    char source[64]; /* "topology file", "NVML", "no GPU information" */
};

/* Everything above for a rank on `host` with `local_rank`, from the environment
 * (AM_TOPOLOGY_FILE, CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS, SLURM_JOB_GPUS). Returns 0, or
 * -1 with the problems in err. */
int am_rank_topology(const char *host, int local_rank, struct am_rank_topo *out, struct am_errors *err);

#endif
