/* am-plan - check a recipe against a cluster and print the parallel plan.
 *
 *   am-plan RECIPE [--nodes N] [--gpus-per-node G] [--nvlink-domain K] [--gpu-mem 80G]
 *                  [--set KEY=VALUE]... [--json]
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

#include "plan.h"
#include "recipe.h"

static const double GiB = 1024.0 * 1024 * 1024;

static void usage(FILE *f)
{
    fprintf(f, "usage: am-plan RECIPE [--nodes N] [--gpus-per-node G] [--nvlink-domain K] [--gpu-mem SIZE]\n"
               "               [--set KEY=VALUE]... [--json]\n"
               "  --nodes N           nodes in the job (default 1)\n"
               "  --gpus-per-node G   GPUs (ranks) per node (default 8)\n"
               "  --nvlink-domain K   GPUs per NVLink domain (default: G, one domain per node)\n"
               "  --gpu-mem SIZE      memory per GPU, e.g. 80G or 141GiB: fail when the estimate exceeds it\n"
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
    json_t *o = json_pack("{s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:i}", "weights", m->weights, "grads", m->grads,
                          "optimizer", m->optimizer, "gathered_params", m->gathered, "grad_buffers", m->grad_buffers,
                          "activations", m->activations, "scratch", m->scratch, "pipeline_buffers", m->p2p,
                          "alltoall_buffers", m->alltoall, "pp_rank", m->pp_rank);
    json_object_set_new(o, "total", json_real(m->total));
    return o;
}

static void print_json(const struct am_recipe *r, const struct am_plan *p, bool planned, const struct am_errors *err)
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
                    json_array_append_new(targets, json_string(am_lora_target_name((enum am_lora_target)t)));
            json_object_set_new(o, "lora", json_pack("{s:o,s:i,s:f,s:f}", "targets", targets, "dim",
                                                     (int)r->peft.dim, "alpha", r->peft.alpha,
                                                     "adapter_params_per_gpu", p->mem.adapter_params));
        }
        json_object_set_new(o, "tokens_per_step", json_real(p->tokens_per_step));
        json_object_set_new(o, "flops_per_step", json_real(p->flops_per_step));
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

static void print_table(const struct am_recipe *r, const struct am_world *w, const struct am_plan *p)
{
    am_plan_print(stdout, r, w, p);
    for (size_t i = 0; i < r->ignored.n; i++)
        printf("%s %s\n", i ? "            " : "ignored     ", r->ignored.v[i]);
    for (size_t i = 0; i < r->notes.n; i++)
        printf("%s %s\n", i ? "            " : "note        ", r->notes.v[i]);
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {{"nodes", required_argument, 0, 'n'},
                                         {"gpus-per-node", required_argument, 0, 'g'},
                                         {"nvlink-domain", required_argument, 0, 'k'},
                                         {"gpu-mem", required_argument, 0, 'm'},
                                         {"set", required_argument, 0, 's'},
                                         {"json", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    struct am_world w = {.nodes = 1, .gpus_per_node = 8};
    struct am_override ov[64];
    size_t n_ov = 0;
    bool json = false;
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

    struct am_errors err;
    am_errors_init(&err);
    struct am_plan plan = {0};
    struct am_recipe *r = am_recipe_load(argv[optind], ov, n_ov, &err);
    bool planned = false;
    if (r && err.n == 0) {
        if (am_plan_build(r, &w, &plan, &err) == 0) {
            planned = true;
            am_plan_check_memory(r, &w, &plan, &err);
        }
    } else if (r) {
        am_validate(r, &w, &err); /* the layout's errors too, all in one run */
    }
    if (json) {
        print_json(r, &plan, planned, &err);
    } else {
        if (planned)
            print_table(r, &w, &plan);
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
