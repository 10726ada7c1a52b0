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
#include <unistd.h>

#ifdef AM_DOC_CUDA
#include <cuda_runtime_api.h>
#endif

#include "doctor.h"
#include "version.h"

/* s as a JSON string (control characters escaped; other bytes as they are) */
static void json_text(FILE *f, const char *s)
{
    fputc('"', f);
    for (const char *p = s; *p; p++)
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if ((unsigned char)*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    fputc('"', f);
}

/* Rank 0: the setup's errors, as the report. */
static void print_setup_errors(FILE *f, const struct am_errors *err, const struct am_doc_opts *o, const char *recipe)
{
    const char *name = strrchr(recipe, '/');
    name = name ? name + 1 : recipe;
    if (o->json) {
        fputs("{\"ok\":false,\"recipe\":", f);
        json_text(f, recipe);
        fputs(",\"setup\":[", f);
        for (size_t i = 0; i < err->n; i++) {
            if (i)
                fputc(',', f);
            json_text(f, err->msg[i]);
        }
        fputs("]}\n", f);
        return;
    }
    fprintf(f, "am-doctor: %s: the job cannot start: the recipe, the topology or the placement failed\n", name);
    for (size_t i = 0; i < err->n; i++)
        fprintf(f, "  %-10s %-8s %s\n", "setup", "PROBLEM", err->msg[i]);
    fprintf(f, "  %-10s %-8s fix: %s\n", "", "", "correct what each line names (am-launch --dry-run shows the placement)");
}

int main(int argc, char **argv)
{
    if (am_version_option(argc, argv, "am-doctor"))
        return 0;
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
    /* stdout holds the report alone (scripts read --json from it): what libraries print on
     * stdout (UCX logs there) goes to stderr, the report to the saved stdout */
    fflush(stdout);
    int report_fd = dup(STDOUT_FILENO);
    FILE *out = report_fd >= 0 ? fdopen(report_fd, "w") : NULL;
    if (!out || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
        fprintf(stderr, "am-doctor: cannot set up stdout for the report\n");
        return 1;
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
            print_setup_errors(out, &err, &o, recipe);
        fclose(out);
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
    if (am_doc_bandwidth(&s, all, d, &o, &fault, d->comm_err, sizeof(d->comm_err)) < 0 && !d->comm_err[0])
        snprintf(d->comm_err, sizeof(d->comm_err), "failed without a message");
    if (am_boot_allgather(s.boot, "doctor-result", d, sizeof(*d), all, s.timeout_s, e, sizeof(e)) < 0) {
        fprintf(stderr, "am-doctor: rank %d on %s: the bootstrap failed: %s\n", me, s.info.host, e);
        am_boot_abort(s.boot, 1, "am-doctor: the bootstrap failed");
    }
    int status = 0;
    if (me == 0) {
        const char *dev = getenv("AM_DEVICE");
        /* a sharded checkpoint as am-plan counts it (plan.h: 12 bytes a parameter in the writing
         * ranks' shards, with the norms each tensor-parallel rank keeps and the shards' padding,
         * 4 more with its Hugging Face export, or with save_consolidated: final once, in the last
         * checkpoint); the kept ones and the one being written */
        const struct am_recipe *r = s.recipe;
        struct am_ckpt_cost cost;
        am_plan_ckpt_cost(r, &s.world, &s.plan, &cost);
        double per_ckpt = cost.bytes;
        struct am_doc_need need = {
            .rank_mem = s.plan.mem.total,
            .ckpt_bytes = r->ckpt.enabled ? per_ckpt * (double)(r->ckpt.keep_last > 0 ? r->ckpt.keep_last + 1 : 1) +
                                                (r->ckpt.consolidated_final && !r->peft.enabled ? 4 * s.plan.params.total : 0) : 0,
            .gpu_job = strcmp(all[0].transport, "nccl") == 0 || (dev && strcmp(dev, "cuda") == 0),
            .recipe = recipe,
        };
#ifdef AM_DOC_CUDA
        need.cuda_built = CUDART_VERSION;
#endif
        status = am_doc_report(out, all, n, &need, &o) > 0;
    }
    fclose(out);
    free(d);
    free(all);
    /* rank 0 alone carries the verdict: the others have nothing to report */
    am_rank_setup_exit(&s, status);
}
