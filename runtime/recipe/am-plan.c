/* am-plan - check a recipe against a cluster and print the parallel plan.
 *
 *   am-plan RECIPE [--nodes N] [--gpus-per-node G] [--nvlink-domain K] [--gpu-mem 80G]
 *                  [--ckpt-bw 1G] [--logs DIR] [--set KEY=VALUE]... [--json]
 *
 * With checkpoints enabled it prints the advised lead of `#SBATCH --signal=B:USR1@LEAD`
 * (plan.h: am_plan_lead_s; docs/checkpoints.md): from the checkpoint's bytes at --ckpt-bw, or
 * from a run's logs (--logs: the step and save times its ranks recorded, read by am-diag's
 * loader, diag.h, which keeps each rank's recent ones).
 *
 * Exit status: 0 the plan is valid (and fits --gpu-mem when given); 1 the recipe or the
 * layout is invalid, or the estimate exceeds --gpu-mem; 2 the command line is wrong.
 */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"
#include "plan.h"
#include "recipe.h"
#include "version.h"

static const double GiB = 1024.0 * 1024 * 1024;
/* What am-plan reads of one rank log of --logs: its first 16 MiB and its last 48 (the recent
 * steps and saves), whatever its size. */
static const size_t LOG_BYTES = (size_t)64 << 20;

static void usage(FILE *f)
{
    fprintf(f, "usage: am-plan RECIPE [--nodes N] [--gpus-per-node G] [--nvlink-domain K] [--gpu-mem SIZE]\n"
               "               [--ckpt-bw SIZE] [--logs DIR] [--set KEY=VALUE]... [--json]\n"
               "  --nodes N           nodes in the job (default 1)\n"
               "  --gpus-per-node G   GPUs (ranks) per node (default 8)\n"
               "  --nvlink-domain K   GPUs per NVLink domain (default: G, one domain per node)\n"
               "  --gpu-mem SIZE      memory per GPU, e.g. 80G or 141GiB: fail when the estimate exceeds it\n"
               "  --ckpt-bw SIZE      bytes per second one node writes to checkpoint_dir, fsync included\n"
               "                      (default 1G: 1 GiB/s); estimates a save's time\n"
               "  --logs DIR          a run's log directory: its step and save times replace the estimate\n"
               "  --set KEY=VALUE     override a recipe key, e.g. --set distributed.tp_size=8 (repeatable)\n"
               "  --json              print one JSON object instead of the table\n");
}

/* "80G", "80GiB", "141g", "500M", "1T", or bytes. */
static int parse_size(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || !(v > 0) || !isfinite(v))
        return -1;
    double mult = 1;
    switch (*end) {
    case 'k': case 'K': mult = 1024.0; end++; break;
    case 'm': case 'M': mult = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mult = GiB; end++; break;
    case 't': case 'T': mult = GiB * 1024; end++; break;
    default: break;
    }
    if (strcmp(end, "") && strcmp(end, "B") && strcmp(end, "iB") && strcmp(end, "b"))
        return -1;
    *out = v * mult;
    return 0;
}

static int parse_count(const char *opt, const char *s, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end || errno || v < 1 || v > 1 << 20) {
        fprintf(stderr, "am-plan: %s: '%s' is not a whole number from 1 to %d\n", opt, s, 1 << 20);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* The advised lead of Slurm's warning (plan.h: am_plan_lead_s) and what it comes from. */
struct lead {
    bool enabled;              /* checkpoint.enabled: without it nothing is saved when warned */
    struct am_ckpt_cost cost;
    double bw, estimate_s;     /* --ckpt-bw and the save's time at it */
    const char *logs;          /* --logs, or NULL */
    int log_ranks;             /* logs read there */
    struct am_diag_timing tm;  /* their step and save times */
    double save_s, step_s;     /* those used: the logs' when they have them, else the estimate; step_s -1: unknown */
    long lead_s;
};

/* --logs DIR: the step and save times of its rank logs, each read as its first and last bytes
 * (LOG_BYTES in all). 0, or -1 with a message. */
static int read_logs(const char *dir, struct lead *L, char *err, size_t err_len)
{
    struct am_diag d;
    am_diag_init(&d);
    d.timing = 1;
    d.max_file = LOG_BYTES;
    int rc = am_diag_load_dir(&d, dir, err, err_len);
    if (rc == 0) {
        am_diag_timing(&d, &L->tm);
        for (int i = 0; i < d.n_ranks; i++)
            L->log_ranks += d.ranks[i].have_log;
    }
    am_diag_free(&d);
    return rc;
}

static void lead_plan(const struct am_recipe *r, const struct am_world *w, const struct am_plan *p, struct lead *L)
{
    L->enabled = r->ckpt.enabled;
    am_plan_ckpt_cost(r, w, p, &L->cost);
    L->estimate_s = am_plan_save_s(&L->cost, L->bw);
    bool logged = L->logs && L->tm.save_s > 0, stepped = L->logs && L->tm.step_s > 0;
    L->save_s = logged ? L->tm.save_s : L->estimate_s;
    L->step_s = stepped ? L->tm.step_s : -1;
    L->lead_s = am_plan_lead_s(L->step_s, L->save_s);
}

static void print_lead(const struct lead *L)
{
    char a[32], b[32], c[32], d[32];
    const struct am_ckpt_cost *k = &L->cost;
    if (!L->enabled) {
        printf("checkpoint   disabled (checkpoint.enabled): nothing is saved when Slurm warns the job; no --signal lead\n");
        return;
    }
    printf("checkpoint   %s a save: %ld shard%s, the largest %s, %s from one node at most", am_format_bytes(k->bytes, a, sizeof(a)),
           k->writers, k->writers == 1 ? "" : "s", am_format_bytes(k->rank_bytes, b, sizeof(b)),
           am_format_bytes(k->node_bytes, c, sizeof(c)));
    if (k->hf_bytes > 0)
        printf("; Hugging Face export %s from one rank", am_format_bytes(k->hf_bytes, d, sizeof(d)));
    putchar('\n');
    am_format_bytes(L->bw, a, sizeof(a));
    if (L->logs && L->tm.save_s > 0)
        printf("save         %.3f s measured: the longest recent save in %s (rank %d, step %ld); estimated %.1f s at %s/s "
               "per node\n", L->save_s, L->logs, L->tm.save_rank, L->tm.save_step, L->estimate_s, a);
    else
        printf("save         %.1f s estimated at %s/s per node (--ckpt-bw)%s\n", L->save_s, a,
               L->logs ? "; the logs hold no save" : "");
    if (L->step_s > 0)
        printf("step         %.3f s measured: the median of the slowest rank's recent steps in %s (rank %d)\n", L->step_s,
               L->logs, L->tm.step_rank);
    else if (L->logs)
        printf("step         not known: %s holds no step record (give the logs of a run that trained some steps)\n",
               L->logs);
    else
        printf("step         not known: give a run's log directory with --logs DIR (its steps' step_s)\n");
    printf("lead         #SBATCH --signal=B:USR1@%ld   (%.1f x %s, rounded up, at least %d s%s)\n", L->lead_s,
           AM_LEAD_FACTOR, L->step_s > 0 ? "(step + save)" : "save", AM_LEAD_MIN_S,
           L->step_s > 0 ? "" : "; one step not counted: add the same for it");
    if (L->lead_s > 65535)
        printf("note         sbatch's --signal takes at most 65535 s: write the checkpoints faster (storage, more nodes)\n");
}

static json_t *lead_json(const struct lead *L)
{
    if (!L->enabled)
        return json_pack("{s:b}", "enabled", 0);
    const struct am_ckpt_cost *k = &L->cost;
    json_t *o = json_pack("{s:b,s:f,s:I,s:f,s:f,s:f,s:f,s:f}", "enabled", 1, "bytes", k->bytes, "shards",
                          (json_int_t)k->writers, "shard_bytes_max", k->rank_bytes, "node_bytes_max", k->node_bytes,
                          "hf_bytes", k->hf_bytes, "write_bw", L->bw, "save_estimate_s", L->estimate_s);
    bool logged = L->logs && L->tm.save_s > 0;
    json_object_set_new(o, "save_s", json_real(L->save_s));
    json_object_set_new(o, "save_from", json_string(logged ? "logs" : "estimate"));
    json_object_set_new(o, "step_s", L->step_s > 0 ? json_real(L->step_s) : json_null());
    json_object_set_new(o, "step_from", L->step_s > 0 ? json_string("logs") : json_null());
    json_object_set_new(o, "lead_s", json_integer(L->lead_s));
    char sig[64];
    snprintf(sig, sizeof(sig), "B:USR1@%ld", L->lead_s);
    json_object_set_new(o, "signal", json_string(sig));
    if (L->logs)
        json_object_set_new(o, "logs",
                            json_pack("{s:s,s:i,s:i,s:i,s:i,s:i,s:I}", "dir", L->logs, "ranks", L->log_ranks,
                                      "step_ranks", L->tm.step_ranks, "save_ranks", L->tm.save_ranks, "step_rank",
                                      L->tm.step_rank, "save_rank", L->tm.save_rank, "save_step",
                                      (json_int_t)L->tm.save_step));
    return o;
}

static json_t *str_array(const struct am_list *l)
{
    json_t *a = json_array();
    for (size_t i = 0; i < l->n; i++)
        json_array_append_new(a, json_string(l->v[i]));
    return a;
}

/* One pipeline rank's memory: {"weights":...,"pp_rank":k,"total":...}. */
static json_t *memory_json(const struct am_memory *m)
{
    json_t *o = json_pack("{s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:i}", "weights", m->weights, "grads", m->grads,
                          "optimizer", m->optimizer, "gathered_params", m->gathered, "grad_buffers", m->grad_buffers,
                          "activations", m->activations, "scratch", m->scratch, "kernel_scratch", m->kernel_scratch,
                          "pipeline_buffers", m->p2p, "alltoall_buffers", m->alltoall, "pp_rank", m->pp_rank);
    json_object_set_new(o, "total", json_real(m->total));
    /* expert parallelism: the buffers sized to the loads, in total at the balanced load, and at
     * the worst load (not in total) */
    json_object_set_new(o, "expert_rows", json_real(m->expert_rows));
    json_object_set_new(o, "expert_rows_worst", json_real(m->expert_rows_worst));
    return o;
}

static void print_json(const struct am_recipe *r, const struct am_plan *p, const struct lead *L, bool planned,
                       const struct am_errors *err)
{
    json_t *o = json_object();
    json_t *errors = json_array();
    for (size_t i = 0; i < err->n; i++)
        json_array_append_new(errors, json_string(err->msg[i]));
    if (planned) {
        json_object_set_new(o, "world_size", json_integer(p->world));
        json_object_set_new(o, "strategy", json_string(am_strategy_name(r->dist.strategy)));
        json_object_set_new(o, "tp_size", json_integer(p->tp));
        json_object_set_new(o, "pp_size", json_integer(p->pp));
        json_object_set_new(o, "cp_size", json_integer(p->cp));
        json_object_set_new(o, "ep_size", json_integer(p->ep));
        json_object_set_new(o, "dp_size", json_integer(p->dp));
        json_object_set_new(o, "dp_replicate_size", json_integer(p->dp_replicate));
        json_object_set_new(o, "dp_shard_size", json_integer(p->dp_shard));
        json_object_set_new(o, "dp_replicas", json_string(p->zero_stage ? "sharded" : "full"));
        json_object_set_new(o, "zero_stage", json_integer(p->zero_stage));
        json_object_set_new(o, "ep_shard_size", json_integer(p->ep_shard));
        json_object_set_new(o, "sequence_parallel", json_boolean(r->dist.sequence_parallel));
        json_object_set_new(o, "activation_checkpointing", json_boolean(r->dist.activation_checkpointing));
        json_object_set_new(o, "pp_schedule", json_string(am_pp_schedule_name(r->dist.pipeline.schedule)));
        json_object_set_new(o, "virtual_stages", json_integer(p->virtual_stages));
        json_t *stages = json_array();
        for (int s = 0; s < p->n_stages; s++)
            json_array_append_new(stages, json_pack("{s:i,s:i,s:i,s:b,s:b}", "pp_rank", p->stages[s].pp_rank,
                                                    "first_layer", p->stages[s].first_layer, "n_layers",
                                                    p->stages[s].n_layers, "embedding", p->stages[s].embedding,
                                                    "head", p->stages[s].head));
        json_object_set_new(o, "stages", stages);
        json_object_set_new(o, "global_batch_size", json_integer(p->global_batch));
        json_object_set_new(o, "local_batch_size", json_integer(p->local_batch));
        json_object_set_new(o, "micro_batch_size", json_integer(p->microbatch_size));
        json_object_set_new(o, "micro_batches", json_integer(p->n_microbatches));
        json_object_set_new(o, "grad_accum_steps", json_integer(p->grad_accum));
        json_object_set_new(o, "seq_length", json_integer(p->seq_length));
        json_object_set_new(o, "params_total", json_real(p->params.total));
        json_object_set_new(o, "memory_per_gpu_bytes", json_real(p->mem.total));
        json_object_set_new(o, "memory_breakdown", memory_json(&p->mem));
        json_t *per = json_array(); /* every pipeline rank's, memory_breakdown's being the largest */
        for (int k = 0; p->mem_pp && k < p->pp; k++)
            json_array_append_new(per, memory_json(&p->mem_pp[k]));
        json_object_set_new(o, "memory_per_pp_rank", per);
        if (r->peft.enabled) {
            json_t *targets = json_array();
            for (int t = 0; t < AM_LORA_NTARGETS; t++)
                if (r->peft.targets & (1u << t))
                    json_array_append_new(targets,
                                          json_string(am_lora_target_name_of(&r->model, (enum am_lora_target)t)));
            if (r->peft.experts) /* each expert's gate, up and down (moe.h) */
                json_array_append_new(targets, json_string("experts"));
            json_t *lora = json_pack("{s:o,s:i,s:f,s:f}", "targets", targets, "dim", (int)r->peft.dim, "alpha",
                                     r->peft.alpha, "adapter_params_per_gpu", p->mem.adapter_params);
            if (r->peft.experts && r->peft.rank_scaling) /* the experts' adapters' rank (moe_rank_scaling) */
                json_object_set_new(lora, "experts_dim", json_integer(r->peft.experts_dim));
            json_object_set_new(o, "lora", lora);
        }
        json_object_set_new(o, "tokens_per_step", json_real(p->tokens_per_step));
        json_object_set_new(o, "flops_per_step", json_real(p->flops_per_step));
        json_object_set_new(o, "checkpoint", lead_json(L));
    }
    /* values the plan assumed because the recipe does not give them */
    json_t *assumed = json_object();
    if (r) {
        bool seq_assumed;
        long seq = am_recipe_seq_length(r, &seq_assumed);
        if (seq_assumed)
            json_object_set_new(assumed, "seq_length", json_integer(seq));
        if (r->param_dtype_assumed)
            json_object_set_new(assumed, "torch_dtype", json_string(am_dtype_torch_name(r->param_dtype)));
    }
    json_object_set_new(o, "assumed", assumed);
    json_object_set_new(o, "errors", errors);
    json_object_set_new(o, "ignored_keys", r ? str_array(&r->ignored) : json_array());
    json_object_set_new(o, "notes", r ? str_array(&r->notes) : json_array());
    char *s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(17));
    if (s)
        puts(s);
    free(s);
    json_decref(o);
}

static void print_table(const struct am_recipe *r, const struct am_world *w, const struct am_plan *p,
                        const struct lead *L)
{
    am_plan_print(stdout, r, w, p);
    print_lead(L);
    for (size_t i = 0; i < r->ignored.n; i++)
        printf("%s %s\n", i ? "            " : "ignored     ", r->ignored.v[i]);
    for (size_t i = 0; i < r->notes.n; i++)
        printf("%s %s\n", i ? "            " : "note        ", r->notes.v[i]);
}

int main(int argc, char **argv)
{
    if (am_version_option(argc, argv, "am-plan"))
        return 0;
    static const struct option opts[] = {{"nodes", required_argument, 0, 'n'},
                                         {"gpus-per-node", required_argument, 0, 'g'},
                                         {"nvlink-domain", required_argument, 0, 'k'},
                                         {"gpu-mem", required_argument, 0, 'm'},
                                         {"ckpt-bw", required_argument, 0, 'b'},
                                         {"logs", required_argument, 0, 'l'},
                                         {"set", required_argument, 0, 's'},
                                         {"json", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    struct am_world w = {.nodes = 1, .gpus_per_node = 8};
    struct am_override ov[64];
    size_t n_ov = 0;
    bool json = false;
    struct lead lead = {.bw = AM_CKPT_BW};
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'n':
            if (parse_count("--nodes", optarg, &w.nodes) < 0)
                return 2;
            break;
        case 'g':
            if (parse_count("--gpus-per-node", optarg, &w.gpus_per_node) < 0)
                return 2;
            break;
        case 'k':
            if (parse_count("--nvlink-domain", optarg, &w.nvlink_domain) < 0)
                return 2;
            break;
        case 'm':
            if (parse_size(optarg, &w.gpu_mem) < 0) {
                fprintf(stderr, "am-plan: --gpu-mem: '%s' is not a size (use e.g. 80G or 141GiB)\n", optarg);
                return 2;
            }
            break;
        case 'b': { /* "2G", "2G/s", "500MiB/s": bytes per second */
            char v[64];
            size_t n = strlen(optarg);
            if (n >= 2 && strcmp(optarg + n - 2, "/s") == 0)
                n -= 2;
            snprintf(v, sizeof(v), "%.*s", (int)(n < sizeof(v) ? n : sizeof(v) - 1), optarg);
            if (n >= sizeof(v) || parse_size(v, &lead.bw) < 0) {
                fprintf(stderr, "am-plan: --ckpt-bw: '%s' is not a bandwidth (use e.g. 2G or 500M/s: bytes per second "
                                "per node)\n", optarg);
                return 2;
            }
            break;
        }
        case 'l':
            lead.logs = optarg;
            break;
        case 's':
            if (n_ov == sizeof(ov) / sizeof(ov[0]) || am_override_parse(optarg, &ov[n_ov]) < 0) {
                fprintf(stderr, "am-plan: --set: expected KEY=VALUE (e.g. distributed.tp_size=8), at most 64\n");
                return 2;
            }
            char *origin = malloc(strlen(ov[n_ov].path) + strlen(ov[n_ov].value) + 8);
            if (!origin)
                return 2;
            sprintf(origin, "--set %s=%s", ov[n_ov].path, ov[n_ov].value);
            ov[n_ov++].origin = origin;
            break;
        case 'j':
            json = true;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind != argc - 1) {
        usage(stderr);
        return 2;
    }
    if ((long)w.nodes * w.gpus_per_node > 1 << 24) {
        fprintf(stderr, "am-plan: --nodes %d x --gpus-per-node %d is more than %d GPUs\n", w.nodes, w.gpus_per_node,
                1 << 24);
        return 2;
    }
    if (!w.nvlink_domain)
        w.nvlink_domain = w.gpus_per_node;
    w.size = w.nodes * w.gpus_per_node;
    if (lead.logs) {
        char msg[8192];
        if (read_logs(lead.logs, &lead, msg, sizeof(msg)) < 0) {
            fprintf(stderr, "am-plan: --logs: %s\n", msg);
            return 2;
        }
    }

    struct am_errors err;
    am_errors_init(&err);
    struct am_plan plan = {0};
    struct am_recipe *r = am_recipe_load(argv[optind], ov, n_ov, &err);
    bool planned = false;
    if (r) {
        /* every rule am-train's ranks check, all in one run; a valid layout is planned (and
         * shown) even when am-train would refuse the recipe, whose errors then follow */
        size_t read_errors = err.n;
        struct am_errors layout;
        am_errors_init(&layout);
        am_validate_run(r, &w, &err);
        if (read_errors == 0 && am_plan_build(r, &w, &plan, &layout) == 0) {
            planned = true;
            am_plan_check_memory(r, &w, &plan, &err);
            lead_plan(r, &w, &plan, &lead);
        }
        am_errors_free(&layout); /* am_validate's messages, already in err */
    }
    if (json) {
        print_json(r, &plan, &lead, planned, &err);
    } else {
        if (planned)
            print_table(r, &w, &plan, &lead);
        for (size_t i = 0; i < err.n; i++)
            fprintf(stderr, "error: %s\n", err.msg[i]);
        if (err.truncated)
            fprintf(stderr, "error: ... and %d more\n", err.truncated);
    }
    int rc = err.n ? 1 : 0;
    am_plan_free(&plan);
    am_recipe_free(r);
    am_errors_free(&err);
    for (size_t i = 0; i < n_ov; i++)
        free((char *)ov[i].origin);
    return rc;
}
