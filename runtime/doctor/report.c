/* report.c - am-doctor's verdict (doctor.h): every rank's findings set against the plan and
 * the thresholds, as one table per node (nodes with problems first; in each table problems,
 * then warnings, then what is fine), or one JSON object. A problem stops the job (exit 1);
 * a warning is worth knowing but does not. */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "doctor.h"

/* A report line is cut to its buffer when names are long: that is intended here. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wformat-truncation"
#endif

#define GIB (1024.0 * 1024.0 * 1024.0)

enum sev { OK, WARN, PROBLEM };
static const char *const sev_name[] = {"ok", "warning", "PROBLEM"};
static const char *const sev_json[] = {"ok", "warning", "problem"};

struct row {
    int node;           /* index into nodes */
    enum sev sev;
    const char *check;
    char detail[512];
    char fix[512];
};

struct node {
    int id;
    const char *host;
    int first, n_ranks;  /* ranks, in rank order: idx[0..n_ranks) */
    int *idx;
    int problems, warnings;
};

struct rep {
    const struct am_doc_rank *all;
    int n;
    struct node *nodes;
    int n_nodes;
    struct row *rows;
    int n_rows, cap;
    const struct am_doc_need *need;
    const struct am_doc_opts *o;
    json_t *groups; /* the all-reduce tests, for --json */
};

__attribute__((format(printf, 5, 6))) static struct row *add(struct rep *R, int node, enum sev sev, const char *check,
                                                            const char *fmt, ...)
{
    if (R->n_rows == R->cap) {
        R->cap = R->cap ? 2 * R->cap : 64;
        R->rows = realloc(R->rows, sizeof(*R->rows) * R->cap);
        if (!R->rows) {
            fprintf(stderr, "am-doctor: out of memory\n");
            exit(1);
        }
    }
    struct row *w = &R->rows[R->n_rows++];
    memset(w, 0, sizeof(*w));
    w->node = node;
    w->sev = sev;
    w->check = check;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->detail, sizeof(w->detail), fmt, ap);
    va_end(ap);
    if (sev == PROBLEM)
        R->nodes[node].problems++;
    else if (sev == WARN)
        R->nodes[node].warnings++;
    return w;
}

__attribute__((format(printf, 2, 3))) static void fix(struct row *w, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->fix, sizeof(w->fix), fmt, ap);
    va_end(ap);
}

static int node_of(const struct rep *R, int rank)
{
    for (int i = 0; i < R->n_nodes; i++)
        if (R->nodes[i].id == R->all[rank].node_id)
            return i;
    return 0;
}

/* "0-3" or "0,2,5" */
static void rank_list(const int *idx, int n, char *out, size_t len)
{
    int contiguous = 1;
    for (int i = 1; i < n; i++)
        contiguous &= idx[i] == idx[i - 1] + 1;
    if (n == 1)
        snprintf(out, len, "%d", idx[0]);
    else if (contiguous)
        snprintf(out, len, "%d-%d", idx[0], idx[n - 1]);
    else {
        size_t k = 0;
        out[0] = '\0';
        for (int i = 0; i < n && k < len; i++)
            k += (size_t)snprintf(out + k, len - k, i ? ",%d" : "%d", idx[i]);
    }
}

/* ---- the checks ------------------------------------------------------------------------ */

static void check_pmix(struct rep *R)
{
    /* the libpmix most nodes run: the reference for the others */
    const char *common = R->all[0].pmix_lib;
    int best = 0;
    for (int i = 0; i < R->n_nodes; i++) {
        int c = 0;
        for (int j = 0; j < R->n_nodes; j++)
            c += strcmp(R->all[R->nodes[i].first].pmix_lib, R->all[R->nodes[j].first].pmix_lib) == 0;
        if (c > best) {
            best = c;
            common = R->all[R->nodes[i].first].pmix_lib;
        }
    }
    for (int i = 0; i < R->n_nodes; i++) {
        const char *host = R->nodes[i].host;
        int bad = 0;
        for (int k = 0; k < R->nodes[i].n_ranks; k++) {
            const struct am_doc_rank *d = &R->all[R->nodes[i].idx[k]];
            if (!d->pmix_why[0])
                continue;
            struct row *w = add(R, i, PROBLEM, "pmix", "PMIx directory %s is unusable: %s", d->pmix_dir, d->pmix_why);
            fix(w, "Slurm's PMIx plugin gives each step a directory under PMIxCliTmpDirBase (mpi.conf) on %s: make "
                "it a writable local directory with free space on %s, or drain %s until it is (scontrol update "
                "nodename=%s state=drain reason=pmix-dir)", host, host, host, host);
            bad = 1;
            break;
        }
        const struct am_doc_rank *d = &R->all[R->nodes[i].first];
        if (!d->mpi_type[0] && !d->pmix_lib[0]) {
            add(R, i, OK, "pmix", "standalone: no PMIx (am-launch --nproc)");
            continue;
        }
        if (d->mpi_type[0] && strncmp(d->mpi_type, "pmix", 4) != 0) {
            struct row *w = add(R, i, PROBLEM, "pmix", "Slurm's MPI plugin here is '%s', not PMIx", d->mpi_type);
            fix(w, "start the step with srun --mpi=pmix (or set MpiDefault=pmix in slurm.conf)");
            bad = 1;
        }
        if (strcmp(d->pmix_lib, common) != 0) {
            struct row *w = add(R, i, PROBLEM, "pmix", "libpmix '%s' here, '%s' on most nodes", d->pmix_lib, common);
            fix(w, "install the same PMIx on every node (am-launch links libpmix: use one build or image everywhere)");
            bad = 1;
        }
        if (!bad) {
            /* "OpenPMIx 4.2.2rc2 (PMIx Standard: 4.2, ...)": the name and version */
            int len = (int)strcspn(d->pmix_lib, "(");
            while (len > 0 && d->pmix_lib[len - 1] == ' ')
                len--;
            add(R, i, OK, "pmix", "Slurm mpi %s, libpmix %.*s, server %s, directory writable",
                d->mpi_type[0] ? d->mpi_type : "?", len ? len : 1, len ? d->pmix_lib : "?",
                d->pmix_server[0] ? d->pmix_server : "?");
        }
    }
}

/* Each rank's offset from rank 0's clock, from the round with the tightest bound. */
static void offset_of(const struct am_doc_rank *a, const struct am_doc_rank *z, double *off, double *unc)
{
    *off = 0;
    *unc = INFINITY;
    for (int k = 0; k < AM_DOC_CLOCK_ROUNDS; k++) {
        double wa = a->clk_t2[k] - a->clk_t1[k], wz = z->clk_t2[k] - z->clk_t1[k];
        double u = (wa + wz) / 2;
        if (u < *unc) {
            *unc = u;
            *off = (a->clk_t1[k] + a->clk_t2[k]) / 2 - (z->clk_t1[k] + z->clk_t2[k]) / 2;
        }
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void check_clock(struct rep *R)
{
    if (R->n_nodes == 1) {
        add(R, 0, OK, "clock", "one node: no skew to measure");
        return;
    }
    double *off = malloc(sizeof(double) * R->n_nodes * 3), *unc = off + R->n_nodes, *sorted = unc + R->n_nodes;
    if (!off)
        return;
    for (int i = 0; i < R->n_nodes; i++) {
        offset_of(&R->all[R->nodes[i].first], &R->all[0], &off[i], &unc[i]);
        sorted[i] = off[i];
    }
    qsort(sorted, R->n_nodes, sizeof(double), cmp_double);
    double median = sorted[R->n_nodes / 2], skew = sorted[R->n_nodes - 1] - sorted[0];
    for (int i = 0; i < R->n_nodes; i++) {
        double d = off[i] - median;
        if (fabs(d) < 0.0005)
            d = 0; /* no "-0.000" */
        if (fabs(d) - unc[i] > R->o->max_skew_s) {
            struct row *w = add(R, i, PROBLEM, "clock", "%+.3f s from most nodes (+-%.3f s; largest skew %.3f s, "
                                "allowed %.3f s)", d, unc[i], skew, R->o->max_skew_s);
            fix(w, "synchronise %s's clock (chronyc tracking / chronyc makestep, or its ntpd): am-diag orders the "
                "ranks' logs by time", R->nodes[i].host);
        } else
            add(R, i, OK, "clock", "%+.3f s from most nodes (+-%.3f s; largest skew %.3f s)", d, unc[i], skew);
    }
    free(off);
}

static void check_memory(struct rep *R)
{
    for (int i = 0; i < R->n_nodes; i++) {
        const struct am_doc_rank *d = &R->all[R->nodes[i].first];
        double need = R->o->min_mem > 0 ? R->o->min_mem
                      : R->need->gpu_job ? 0 : R->need->rank_mem * R->nodes[i].n_ranks;
        if (d->mem_avail < 0) {
            add(R, i, WARN, "memory", "/proc/meminfo has no MemAvailable: cannot check");
            continue;
        }
        if (d->mem_avail < need) {
            struct row *w = add(R, i, PROBLEM, "memory", "%.1f GiB free of %.1f GiB, needs %.1f GiB", d->mem_avail / GIB,
                                d->mem_total / GIB, need / GIB);
            fix(w, "free memory on %s (other jobs or processes: ps aux --sort=-rss), run fewer ranks per node, or "
                "lower the requirement (--min-mem-gb)", R->nodes[i].host);
        } else
            add(R, i, OK, "memory", "%.1f GiB free of %.1f GiB, needs %.1f GiB", d->mem_avail / GIB, d->mem_total / GIB,
                need / GIB);
    }
}

static void check_disk(struct rep *R)
{
    for (int i = 0; i < R->n_nodes; i++) {
        const struct am_doc_rank *d = &R->all[R->nodes[i].first];
        double need = R->o->min_disk > 0 ? R->o->min_disk : R->need->ckpt_bytes;
        if (d->disk_free < 0 || (d->disk_why[0] && need > 0)) {
            struct row *w = add(R, i, PROBLEM, "disk", "checkpoints in %s: %s", d->disk_for, d->disk_why);
            fix(w, "create the checkpoint directory where the job can write it, or set checkpoint.checkpoint_dir");
        } else if (d->disk_free < need) {
            struct row *w = add(R, i, PROBLEM, "disk", "%.1f GiB free at %s, needs %.1f GiB (checkpoints in %s)",
                                d->disk_free / GIB, d->disk_path, need / GIB, d->disk_for);
            fix(w, "free space under %s on %s, or set checkpoint.checkpoint_dir to a larger filesystem", d->disk_path,
                R->nodes[i].host);
        } else if (need == 0)
            add(R, i, OK, "disk", "%.1f GiB free at %s (checkpoints disabled)", d->disk_free / GIB, d->disk_path);
        else
            add(R, i, OK, "disk", "%.1f GiB free at %s, needs %.1f GiB", d->disk_free / GIB, d->disk_path, need / GIB);
    }
}

static void check_gpus(struct rep *R)
{
    /* the driver most nodes run */
    const char *common = R->all[0].gpu.driver;
    for (int i = 0; i < R->n_nodes; i++) {
        const char *host = R->nodes[i].host;
        const struct am_doc_rank *d0 = &R->all[R->nodes[i].first];
        const struct am_doc_gpu *g0 = &d0->gpu;
        int bad = 0;
        if (g0->nvml == 0) {
            if (R->need->gpu_job) {
                struct row *w = add(R, i, PROBLEM, "gpus", "no GPU: %s", g0->why);
                fix(w, "the job runs on GPUs: check the driver on %s (nvidia-smi) or leave %s out", host, host);
            } else
                add(R, i, OK, "gpus", "no GPU (%s): ranks run on CPUs", g0->why);
            continue;
        }
        if (g0->nvml < 0) {
            struct row *w = add(R, i, PROBLEM, "gpus", "NVML failed: %s", g0->why);
            fix(w, "check the driver on %s (nvidia-smi); drain %s if it stays", host, host);
            continue;
        }
        for (int k = 0; k < R->nodes[i].n_ranks; k++) {
            const struct am_doc_rank *d = &R->all[R->nodes[i].idx[k]];
            const struct am_doc_gpu *g = &d->gpu;
            if (g->index < 0)
                continue;
            int sharing = 0;
            for (int q = 0; q < R->nodes[i].n_ranks; q++)
                sharing += R->all[R->nodes[i].idx[q]].gpu.index == g->index;
            int first = 1; /* one row per GPU */
            for (int q = 0; q < k; q++)
                first &= R->all[R->nodes[i].idx[q]].gpu.index != g->index;
            if (!first)
                continue;
            double need = R->need->gpu_job ? R->need->rank_mem * sharing : 0;
            if (g->mem_free >= 0 && g->mem_free < need) {
                struct row *w = add(R, i, PROBLEM, "gpus", "GPU %d: %.1f GiB free, the plan needs %.1f GiB (%d rank%s)",
                                    g->index, g->mem_free / GIB, need / GIB, sharing, sharing > 1 ? "s" : "");
                fix(w, "free GPU %d on %s (nvidia-smi shows who holds it), or change the layout so the plan fits "
                    "(am-plan: larger tp or pp, activation_checkpointing)", g->index, host);
                bad = 1;
            }
            if (g->retired_pending == 1 || g->remap_pending == 1) {
                struct row *w = add(R, i, PROBLEM, "gpus", "GPU %d: retired or remapped memory pending a reset", g->index);
                fix(w, "reset GPU %d (nvidia-smi -r -i %d) or reboot %s before running", g->index, g->index, host);
                bad = 1;
            }
            if (g->remap_failure == 1) {
                struct row *w = add(R, i, PROBLEM, "gpus", "GPU %d: row remapping failed", g->index);
                fix(w, "drain %s and have GPU %d replaced", host, g->index);
                bad = 1;
            }
            if (g->links_down > 0) {
                struct row *w = add(R, i, PROBLEM, "gpus", "GPU %d: %d of %d NVLink links down", g->index, g->links_down,
                                    g->links_down + g->links_up);
                fix(w, "check nvidia-smi nvlink -s -i %d on %s; reset the GPU or drain %s", g->index, host, host);
                bad = 1;
            }
            if (g->ecc_current == 0) {
                struct row *w = add(R, i, WARN, "gpus", "GPU %d: ECC is off", g->index);
                fix(w, "nvidia-smi -i %d -e 1, then reboot %s: without ECC a bit flip goes unnoticed", g->index, host);
            } else if (g->ecc_pending >= 0 && g->ecc_pending != g->ecc_current) {
                struct row *w = add(R, i, WARN, "gpus", "GPU %d: an ECC mode change is pending", g->index);
                fix(w, "reboot %s to apply it", host);
            }
            if (g->retired_dbe > 0) {
                struct row *w = add(R, i, WARN, "gpus", "GPU %d: %d pages retired after double-bit errors", g->index,
                                    g->retired_dbe);
                fix(w, "watch GPU %d on %s (nvidia-smi -q -d PAGE_RETIREMENT); replace it if the count grows", g->index,
                    host);
            }
        }
        if (R->need->gpu_job && R->need->cuda_built > 0 && g0->cuda > 0 && g0->cuda < R->need->cuda_built) {
            struct row *w = add(R, i, PROBLEM, "gpus", "the driver supports CUDA %d.%d, am was built with %d.%d",
                                g0->cuda / 1000, g0->cuda % 1000 / 10, R->need->cuda_built / 1000,
                                R->need->cuda_built % 1000 / 10);
            fix(w, "update the driver on %s, or build am against CUDA %d.%d", host, g0->cuda / 1000, g0->cuda % 1000 / 10);
            bad = 1;
        }
        if (strcmp(g0->driver, common) != 0) {
            struct row *w = add(R, i, WARN, "gpus", "driver %s here, %s on rank 0's node", g0->driver, common);
            fix(w, "install one driver version on every node");
        }
        if (!bad) {
            char gpus[256] = "";
            size_t k = 0;
            for (int q = 0; q < R->nodes[i].n_ranks && k < sizeof(gpus); q++) {
                const struct am_doc_gpu *g = &R->all[R->nodes[i].idx[q]].gpu;
                k += (size_t)snprintf(gpus + k, sizeof(gpus) - k, q ? ",%d" : "%d", g->index);
            }
            char mem[64] = "";
            if (g0->mem_free >= 0)
                snprintf(mem, sizeof(mem), ", %.1f GiB free on GPU %d", g0->mem_free / GIB, g0->index);
            add(R, i, OK, "gpus", "%d GPUs, driver %s, CUDA %d.%d; ranks on GPUs %s%s", g0->count,
                g0->driver[0] ? g0->driver : "?", g0->cuda / 1000, g0->cuda % 1000 / 10, gpus, mem);
        }
    }
}

static void check_topology(struct rep *R)
{
    for (int i = 0; i < R->n_nodes; i++) {
        const char *host = R->nodes[i].host;
        const struct am_doc_rank *d0 = &R->all[R->nodes[i].first];
        int bad = 0;
        int file = strcmp(d0->topo_source, "topology file") == 0;
        if (file && d0->gpu.nvml == 1 && d0->topo_gpus >= 0 && d0->topo_gpus != d0->gpu.count) {
            struct row *w = add(R, i, PROBLEM, "topology", "the topology file gives %s %d GPUs, NVML sees %d", host,
                                d0->topo_gpus, d0->gpu.count);
            fix(w, "correct %s's entry in the topology file (or drop --topology: NVML then tells)", host);
            bad = 1;
        }
        for (int k = 0; file && k < R->nodes[i].n_ranks; k++) {
            const struct am_doc_rank *d = &R->all[R->nodes[i].idx[k]];
            if (!d->gpu.nvml_domain[0] || strcmp(d->gpu.nvml_domain, d->domain) == 0)
                continue;
            struct row *w = add(R, i, PROBLEM, "topology", "GPU %d: the topology file puts it in domain %s, NVML's "
                                "NVLink links in %s", d->gpu.index, d->domain, d->gpu.nvml_domain);
            fix(w, "correct %s's domains in the topology file to NVML's (nvidia-smi topo -m), or drop --topology",
                host);
            bad = 1;
            break;
        }
        if (bad)
            continue;
        char doms[512] = "";
        size_t len = 0;
        for (int k = 0; k < R->nodes[i].n_ranks && len < sizeof(doms); k++) {
            const struct am_doc_rank *d = &R->all[R->nodes[i].idx[k]];
            int seen = 0;
            for (int q = 0; q < k; q++)
                seen |= strcmp(R->all[R->nodes[i].idx[q]].domain, d->domain) == 0;
            if (!seen)
                len += (size_t)snprintf(doms + len, sizeof(doms) - len, "%s%s", len ? ", " : "", d->domain);
        }
        add(R, i, OK, "topology", "domain%s %s (%s%s)", strchr(doms, ',') ? "s" : "", doms, d0->topo_source,
            file && d0->gpu.nvml == 1 ? ", NVML agrees" : "");
    }
}

/* The communicators could not be set up on some rank (context, groups, memory). */
static void check_comm_setup(struct rep *R)
{
    for (int i = 0; i < R->n_nodes; i++)
        for (int k = 0; k < R->nodes[i].n_ranks; k++) {
            const struct am_doc_rank *d = &R->all[R->nodes[i].idx[k]];
            if (!d->comm_err[0])
                continue;
            struct row *w = add(R, i, PROBLEM, "allreduce", "rank %d: the communicators (%s) failed: %s", d->rank,
                                d->transport, d->comm_err);
            fix(w, "the message names the step that failed; am-train needs the same communicators (UCX on CPUs, "
                "NCCL on GPUs): check the transport's libraries and network on %s", R->nodes[i].host);
            break;
        }
}

static int cmp_int(const void *a, const void *b)
{
    return *(const int *)a - *(const int *)b;
}

/* The all-reduce tests: for each group (kind, index) found in the ranks' records. */
static void check_allreduce(struct rep *R)
{
    int *members = malloc(sizeof(int) * R->n), *done = malloc(sizeof(int) * R->n_nodes); /* rows per node */
    if (!members || !done) {
        free(members);
        free(done);
        return;
    }
    for (int slot = 0; slot < 2; slot++) {
        for (int r = 0; r < R->n; r++) {
            const struct am_doc_bw *b = &R->all[r].bw[slot];
            if (b->kind == 0)
                continue;
            int first = 1, m = 0;
            for (int q = 0; q < R->n; q++) {
                const struct am_doc_bw *c = &R->all[q].bw[slot];
                if (c->kind == b->kind && c->group == b->group) {
                    if (q < r)
                        first = 0;
                    members[m++] = q;
                }
            }
            if (!first)
                continue;
            const char *transport = R->all[r].transport;
            int nccl = strcmp(transport, "nccl") == 0;
            double expect = b->kind == 1 ? (R->o->bw_domain > 0 ? R->o->bw_domain : nccl ? 100e9 : 0.02e9)
                                         : (R->o->bw_nodes > 0 ? R->o->bw_nodes : nccl ? 10e9 : 0.02e9);
            char what[256], list[128];
            rank_list(members, m, list, sizeof(list));
            if (b->kind == 1)
                snprintf(what, sizeof(what), "all-reduce in domain %s (ranks %s, %s)", R->all[r].domain, list, transport);
            else
                snprintf(what, sizeof(what), "all-reduce across nodes (ranks %s, %s)", list, transport);
            int failed = -1;
            for (int k = 0; k < m; k++)
                if (R->all[members[k]].bw[slot].failed && failed < 0)
                    failed = members[k];
            json_t *jg = json_object();
            json_object_set_new(jg, "kind", json_string(b->kind == 1 ? "domain" : "nodes"));
            if (b->kind == 1)
                json_object_set_new(jg, "domain", json_string(R->all[r].domain));
            json_t *jm = json_array();
            for (int k = 0; k < m; k++)
                json_array_append_new(jm, json_integer(members[k]));
            json_object_set_new(jg, "ranks", jm);
            json_object_set_new(jg, "transport", json_string(transport));
            json_object_set_new(jg, "bytes", json_real(b->bytes));
            json_object_set_new(jg, "expected_busbw_gbs", json_real(expect / 1e9));
            json_array_append_new(R->groups, jg);
            if (failed >= 0) {
                json_object_set_new(jg, "ok", json_false());
                json_object_set_new(jg, "error", json_string(R->all[failed].bw[slot].err));
                /* the members whose own calls did not fail are the ones the others waited
                 * for; when every call failed, every node of the group is suspect */
                int blamed = 0;
                for (int k = 0; k < m; k++)
                    blamed += !R->all[members[k]].bw[slot].failed;
                memset(done, 0, sizeof(int) * R->n_nodes);
                for (int k = 0; k < m; k++) {
                    int q = members[k], nd = node_of(R, q);
                    int suspect = !blamed || !R->all[q].bw[slot].failed;
                    if (blamed && !suspect)
                        continue;
                    if (done[nd]++)
                        continue;
                    struct row *w;
                    if (blamed) {
                        json_object_set_new(jg, "failing_rank", json_integer(q));
                        json_object_set_new(jg, "failing_host", json_string(R->all[q].host));
                        w = add(R, nd, PROBLEM, "allreduce", "%s failed: the others' calls timed out waiting for "
                                "rank %d on %s (%s)", what, q, R->all[q].host, R->all[failed].bw[slot].err);
                        fix(w, "rank %d on %s (or its link) did not answer: check its network (ib_write_bw, "
                            "nvidia-smi nvlink -s) and drain %s if it stays", q, R->all[q].host, R->all[q].host);
                    } else {
                        w = add(R, nd, PROBLEM, "allreduce", "%s failed: %s", what, R->all[failed].bw[slot].err);
                        fix(w, "the rank named in the message (or its link) did not answer: check it is alive and "
                            "its network (ib_write_bw, nvidia-smi nvlink -s); drain its node if it stays");
                    }
                }
                for (int k = 0; blamed && k < m; k++) {
                    int nd = node_of(R, members[k]);
                    if (done[nd]++)
                        continue;
                    struct row *w = add(R, nd, WARN, "allreduce", "%s: failed on a peer", what);
                    fix(w, "see the node with the problem");
                }
                continue;
            }
            /* each timed call lasts as long as its slowest rank: the largest time of each
             * iteration, and the median iteration */
            double iter[AM_DOC_ITERS], mean_min = INFINITY, mean_max = 0;
            int late = -1;
            for (int i = 0; i < AM_DOC_ITERS; i++) {
                iter[i] = 0;
                for (int k = 0; k < m; k++)
                    iter[i] = fmax(iter[i], R->all[members[k]].bw[slot].call_s[i]);
            }
            for (int k = 0; k < m; k++) {
                double s = 0;
                for (int i = 0; i < AM_DOC_ITERS; i++)
                    s += R->all[members[k]].bw[slot].call_s[i];
                s /= AM_DOC_ITERS;
                if (s < mean_min) {
                    mean_min = s;
                    late = members[k];
                }
                mean_max = fmax(mean_max, s);
            }
            qsort(iter, AM_DOC_ITERS, sizeof(double), cmp_double);
            double t = iter[AM_DOC_ITERS / 2];
            double busbw = t > 0 ? b->bytes * 2.0 * (m - 1) / m / t : INFINITY;
            json_object_set_new(jg, "busbw_gbs", json_real(isfinite(busbw) ? busbw / 1e9 : 0));
            json_object_set_new(jg, "ok", json_boolean(busbw >= expect));
            if (busbw >= expect) {
                memset(done, 0, sizeof(int) * R->n_nodes);
                for (int k = 0; k < m; k++) {
                    int nd = node_of(R, members[k]);
                    if (done[nd]++)
                        continue;
                    add(R, nd, OK, "allreduce", "%s: %.3f GB/s bus bandwidth, expected >= %.3f", what, busbw / 1e9,
                        expect / 1e9);
                }
                continue;
            }
            /* the others waited for one rank: it arrived late (a slow node) */
            if (m > 1 && mean_min < 0.5 * mean_max) {
                int nd = node_of(R, late);
                json_object_set_new(jg, "slow_rank", json_integer(late));
                json_object_set_new(jg, "slow_host", json_string(R->all[late].host));
                struct row *w = add(R, nd, PROBLEM, "allreduce", "%s: %.3f GB/s bus bandwidth, expected >= %.3f: the "
                                    "others waited %.3f s per call for rank %d on %s", what, busbw / 1e9,
                                    expect / 1e9, mean_max - mean_min, late, R->all[late].host);
                fix(w, "rank %d on %s is slow to reach each call: look for other load on %s (top), a throttled CPU "
                    "or GPU (nvidia-smi -q -d PERFORMANCE), or drain %s", late, R->all[late].host,
                    R->all[late].host, R->all[late].host);
                memset(done, 0, sizeof(int) * R->n_nodes);
                done[nd] = 1;
                for (int k = 0; k < m; k++) {
                    int q = node_of(R, members[k]);
                    if (done[q]++)
                        continue;
                    struct row *o = add(R, q, WARN, "allreduce", "%s: slowed by rank %d on %s", what, late,
                                        R->all[late].host);
                    fix(o, "see %s", R->all[late].host);
                }
                continue;
            }
            /* everyone was slow: the link */
            memset(done, 0, sizeof(int) * R->n_nodes);
            for (int k = 0; k < m; k++) {
                int nd = node_of(R, members[k]);
                if (done[nd]++)
                    continue;
                struct row *w = add(R, nd, PROBLEM, "allreduce", "%s: %.3f GB/s bus bandwidth, expected >= %.3f",
                                    what, busbw / 1e9, expect / 1e9);
                fix(w, "the link is slow for every rank: check the interconnect (NVLink: nvidia-smi nvlink -s; "
                    "network: ib_write_bw between these nodes), or set the expected figure (--expect-%s-gbs)",
                    b->kind == 1 ? "domain" : "nodes");
            }
        }
    }
    free(members);
    free(done);
}

/* ---- output ------------------------------------------------------------------------------- */

/* nodes with problems first, then by node id (insertion sort: a handful of nodes) */
static int before(const struct node *x, const struct node *y)
{
    if ((x->problems > 0) != (y->problems > 0))
        return x->problems > 0;
    return x->id < y->id;
}

static void sort_nodes(const struct rep *R, int *order)
{
    for (int i = 1; i < R->n_nodes; i++) {
        int v = order[i], j = i;
        while (j > 0 && before(&R->nodes[v], &R->nodes[order[j - 1]])) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = v;
    }
}

static void print_text(FILE *f, struct rep *R, int problems, int warnings, int *order)
{
    const char *name = strrchr(R->need->recipe, '/');
    name = name ? name + 1 : R->need->recipe;
    int bad_nodes = 0;
    for (int i = 0; i < R->n_nodes; i++)
        bad_nodes += R->nodes[i].problems > 0;
    fprintf(f, "am-doctor: %s on %d node%s, %d rank%s (%s): ", name, R->n_nodes, R->n_nodes > 1 ? "s" : "", R->n,
            R->n > 1 ? "s" : "", R->all[0].transport[0] ? R->all[0].transport : "no communicators");
    if (problems)
        fprintf(f, "%d problem%s on %d node%s: the job cannot run\n", problems, problems > 1 ? "s" : "", bad_nodes,
                bad_nodes > 1 ? "s" : "");
    else if (warnings)
        fprintf(f, "%d warning%s: the job can run\n", warnings, warnings > 1 ? "s" : "");
    else
        fprintf(f, "the job can run\n");
    for (int j = 0; j < R->n_nodes; j++) {
        struct node *nd = &R->nodes[order[j]];
        char list[256];
        rank_list(nd->idx, nd->n_ranks, list, sizeof(list));
        fprintf(f, "\nnode %s (rank%s %s): ", nd->host, nd->n_ranks > 1 ? "s" : "", list);
        if (nd->problems)
            fprintf(f, "%d problem%s\n", nd->problems, nd->problems > 1 ? "s" : "");
        else if (nd->warnings)
            fprintf(f, "%d warning%s\n", nd->warnings, nd->warnings > 1 ? "s" : "");
        else
            fprintf(f, "ok\n");
        fprintf(f, "  %-10s %-8s %s\n", "check", "status", "detail");
        for (int sev = PROBLEM; sev >= OK; sev--)
            for (int k = 0; k < R->n_rows; k++) {
                const struct row *w = &R->rows[k];
                if (w->node != order[j] || (int)w->sev != sev)
                    continue;
                fprintf(f, "  %-10s %-8s %s\n", w->check, sev_name[w->sev], w->detail);
                if (w->fix[0])
                    fprintf(f, "  %-10s %-8s fix: %s\n", "", "", w->fix);
            }
    }
}

static void print_json(FILE *f, struct rep *R, int problems, int warnings, int *order)
{
    json_t *j = json_object(), *nodes = json_array();
    json_object_set_new(j, "ok", json_boolean(problems == 0));
    json_object_set_new(j, "problems", json_integer(problems));
    json_object_set_new(j, "warnings", json_integer(warnings));
    json_object_set_new(j, "recipe", json_string(R->need->recipe));
    json_object_set_new(j, "ranks", json_integer(R->n));
    json_object_set_new(j, "transport", json_string(R->all[0].transport));
    for (int jn = 0; jn < R->n_nodes; jn++) {
        struct node *nd = &R->nodes[order[jn]];
        json_t *o = json_object(), *ranks = json_array(), *checks = json_array();
        json_object_set_new(o, "host", json_string(nd->host));
        for (int k = 0; k < nd->n_ranks; k++)
            json_array_append_new(ranks, json_integer(nd->idx[k]));
        json_object_set_new(o, "ranks", ranks);
        json_object_set_new(o, "problems", json_integer(nd->problems));
        json_object_set_new(o, "warnings", json_integer(nd->warnings));
        for (int sev = PROBLEM; sev >= OK; sev--)
            for (int k = 0; k < R->n_rows; k++) {
                const struct row *w = &R->rows[k];
                if (w->node != order[jn] || (int)w->sev != sev)
                    continue;
                json_t *c = json_object();
                json_object_set_new(c, "check", json_string(w->check));
                json_object_set_new(c, "status", json_string(sev_json[w->sev]));
                json_object_set_new(c, "detail", json_string(w->detail));
                if (w->fix[0])
                    json_object_set_new(c, "fix", json_string(w->fix));
                json_array_append_new(checks, c);
            }
        json_object_set_new(o, "checks", checks);
        json_array_append_new(nodes, o);
    }
    json_object_set_new(j, "nodes", nodes);
    json_object_set(j, "allreduce", R->groups);
    json_dumpf(j, f, JSON_COMPACT | JSON_ENSURE_ASCII);
    fputc('\n', f);
    json_decref(j);
}

int am_doc_report(FILE *f, const struct am_doc_rank *all, int n, const struct am_doc_need *need,
                  const struct am_doc_opts *o)
{
    struct rep R = {.all = all, .n = n, .need = need, .o = o, .groups = json_array()};
    R.nodes = calloc(n, sizeof(*R.nodes));
    int *idx = malloc(sizeof(int) * n), *order = malloc(sizeof(int) * n);
    if (!R.nodes || !idx || !order) {
        fprintf(stderr, "am-doctor: out of memory\n");
        exit(1);
    }
    /* nodes by node id, each with its ranks in rank order */
    for (int r = 0; r < n; r++) {
        int i = 0;
        while (i < R.n_nodes && R.nodes[i].id != all[r].node_id)
            i++;
        if (i == R.n_nodes) {
            R.nodes[i].id = all[r].node_id;
            R.nodes[i].host = all[r].host;
            R.nodes[i].first = r;
            R.n_nodes++;
        }
    }
    int k = 0;
    for (int i = 0; i < R.n_nodes; i++) {
        R.nodes[i].idx = idx + k;
        for (int r = 0; r < n; r++)
            if (all[r].node_id == R.nodes[i].id)
                idx[k++] = r, R.nodes[i].n_ranks++;
        qsort(R.nodes[i].idx, R.nodes[i].n_ranks, sizeof(int), cmp_int);
    }
    check_pmix(&R);
    check_clock(&R);
    check_memory(&R);
    check_disk(&R);
    check_gpus(&R);
    check_topology(&R);
    check_comm_setup(&R);
    check_allreduce(&R);
    int problems = 0, warnings = 0;
    for (int i = 0; i < R.n_nodes; i++) {
        problems += R.nodes[i].problems;
        warnings += R.nodes[i].warnings;
        order[i] = i;
    }
    sort_nodes(&R, order);
    if (o->json)
        print_json(f, &R, problems, warnings, order);
    else
        print_text(f, &R, problems, warnings, order);
    fflush(f);
    json_decref(R.groups);
    free(R.rows);
    free(R.nodes);
    free(idx);
    free(order);
    return problems;
}
