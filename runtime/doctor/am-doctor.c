/* am-doctor - will this node set train? The rank program of `am-launch --doctor` (doctor.h):
 *
 *   srun --mpi=pmix am-launch --doctor RECIPE [-- OPTIONS]    every node of the allocation
 *   am-launch --nproc N --doctor RECIPE [-- OPTIONS]          this machine
 *
 * Every rank probes its node, the ranks exchange timestamps and time all-reduces, and rank 0
 * prints the report (am-doctor --help lists the options).
 *
 * Exit status: 0 the job can run; 1 a problem (the report says which and what to do); 2 bad
 * options or AM_DOCTOR_FAULT; 3 not started by am-launch.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef AM_DOC_CUDA
#include <cuda_runtime_api.h>
#endif

#include "doctor.h"

/* Rank 0: the setup's errors, as the report's first lines. */
static void print_setup_errors(const struct am_errors *err, const struct am_doc_opts *o, const char *recipe)
{
    const char *name = strrchr(recipe, '/');
    name = name ? name + 1 : recipe;
    if (o->json) {
        printf("{\"ok\":false,\"recipe\":\"%s\",\"setup\":[", recipe);
        for (size_t i = 0; i < err->n; i++) {
            fputs(i ? ",\"" : "\"", stdout);
            for (const char *p = err->msg[i]; *p; p++)
                if (*p == '"' || *p == '\\')
                    printf("\\%c", *p);
                else if ((unsigned char)*p < 0x20)
                    printf("\\u%04x", *p);
                else
                    putchar(*p);
            putchar('"');
        }
        printf("]}\n");
        return;
    }
    printf("am-doctor: %s: the job cannot start: the recipe, the topology or the placement failed\n", name);
    for (size_t i = 0; i < err->n; i++)
        printf("  %-10s %-8s %s\n", "setup", "PROBLEM", err->msg[i]);
    printf("  %-10s %-8s fix: %s\n", "", "", "correct what each line names (am-launch --dry-run shows the placement)");
}

int main(int argc, char **argv)
{
    struct am_errors err;
    struct am_rank_setup s;
    struct am_doc_opts o;
    struct am_doc_fault fault;
    char e[AM_COMM_ERR_LEN];
    am_doc_opts_default(&o);
    int parsed = am_doc_opts_parse(&o, argc, argv, stdout, e, sizeof(e));
    if (parsed == 1)
        return 0;
    if (parsed < 0) {
        fprintf(stderr, "am-doctor: %s\n", e);
        return 2;
    }
    if (am_doc_fault_parse(getenv("AM_DOCTOR_FAULT"), &fault, e, sizeof(e)) < 0) {
        fprintf(stderr, "am-doctor: %s\n", e);
        return 2;
    }
    am_errors_init(&err);
    int rc = am_rank_setup(&s, &err);
    if (!s.boot) {
        for (size_t i = 0; i < err.n; i++)
            fprintf(stderr, "am-doctor: error: %s\n", err.msg[i]);
        am_errors_free(&err);
        am_rank_setup_exit(&s, 3);
    }
    const char *recipe = getenv("AM_RECIPE") ? getenv("AM_RECIPE") : "?";
    if (rc < 0) {
        if (s.info.rank == 0)
            print_setup_errors(&err, &o, recipe);
        am_errors_free(&err);
        am_rank_setup_exit(&s, 1);
    }
    am_errors_free(&err);

    int n = s.info.size, me = s.info.rank;
    struct am_doc_rank *d = calloc(1, sizeof(*d)), *all = calloc(n, sizeof(*all));
    if (!d || !all) {
        fprintf(stderr, "am-doctor: rank %d: out of memory\n", me);
        am_boot_abort(s.boot, 1, "am-doctor: out of memory");
    }
    am_doc_probe(d, &s, s.recipe->ckpt.dir);
    if (am_doc_clock(s.boot, s.timeout_s, &fault, me, d, e, sizeof(e)) < 0 ||
        am_boot_allgather(s.boot, "doctor-probe", d, sizeof(*d), all, s.timeout_s, e, sizeof(e)) < 0) {
        fprintf(stderr, "am-doctor: rank %d on %s: the bootstrap failed: %s\n", me, s.info.host, e);
        am_boot_abort(s.boot, 1, "am-doctor: the bootstrap failed");
    }
    char bw_err[AM_COMM_ERR_LEN] = "";
    if (am_doc_bandwidth(&s, all, d, &o, &fault, bw_err, sizeof(bw_err)) < 0)
        for (int k = 0; k < 2; k++)
            if (!d->bw[k].failed) {
                d->bw[k].kind = d->bw[k].kind ? d->bw[k].kind : k + 1;
                d->bw[k].group = d->bw[k].kind == k + 1 ? d->bw[k].group : -1;
                d->bw[k].failed = 1;
                snprintf(d->bw[k].err, sizeof(d->bw[k].err), "%s", bw_err);
            }
    if (am_boot_allgather(s.boot, "doctor-result", d, sizeof(*d), all, s.timeout_s, e, sizeof(e)) < 0) {
        fprintf(stderr, "am-doctor: rank %d on %s: the bootstrap failed: %s\n", me, s.info.host, e);
        am_boot_abort(s.boot, 1, "am-doctor: the bootstrap failed");
    }
    int status = 0;
    if (me == 0) {
        const char *dev = getenv("AM_DEVICE");
        struct am_doc_need need = {
            .rank_mem = s.plan.mem.total,
            .ckpt_bytes = s.recipe->ckpt.enabled
                              ? s.plan.params.total * (double)(am_dtype_size(s.recipe->param_dtype) + 8) : 0,
            .gpu_job = strcmp(all[0].transport, "nccl") == 0 || (dev && strcmp(dev, "cuda") == 0),
            .recipe = recipe,
        };
#ifdef AM_DOC_CUDA
        need.cuda_built = CUDART_VERSION;
#endif
        status = am_doc_report(stdout, all, n, &need, &o) > 0;
    }
    free(d);
    free(all);
    /* rank 0 alone carries the verdict: the others have nothing to report */
    am_rank_setup_exit(&s, status);
}
