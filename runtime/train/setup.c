/* setup.c - the rank's communicators, watchdog, model and data parallelism (trainer.h). */
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "model_io.h"
#include "moe.h"
#include "packed.h"
#include "ring.h"
#include "trainer.h"

int am_train_build_comms(struct trainer *t, struct am_errors *err)
{
    enum am_comm_backend be = t->dev.device == AM_DEV_CUDA ? AM_COMM_NCCL : AM_COMM_UCX;
    if (am_groups_build(&t->g, t->s, be, t->dev.ordinal, &t->flight, t->hosts, err) < 0) {
        t->comm_init_failed = true;
        return -1;
    }
    /* NCCL, ordered against the compute stream (comm.h): the tensor- and data-parallel groups
     * on the compute stream itself (collectives after the kernels that wrote their buffers,
     * kernels after the collectives they read; non-blocking ones on the group's communication
     * stream, joined by events); the pipeline's groups on streams of their own that wait for
     * the compute stream before each call (a send's kernel waits for the peer's receive and
     * must not hold the compute stream) */
    for (int g = 0; be == AM_COMM_NCCL && g < t->g.set.n; g++) {
        struct am_comm *c = t->g.comms[g];
        char msg[AM_COMM_ERR_LEN];
        if (!c)
            continue;
        if (c != t->g.pp && c != t->g.pp_grad)
            am_comm_set_stream(c, t->dev.stream);
        else if (am_comm_set_stream_after(c, t->dev.stream, msg, sizeof(msg)) < 0)
            return am_errors_fail(err, "%s", msg);
    }
    t->dp_rank = am_comm_rank(t->g.dp);
    t->grad_dp = t->g.dp_cp;
    am_train_log_groups(t);
    return 0;
}

int am_train_start_watchdog(struct trainer *t, struct am_errors *err)
{
    char msg[512];
    t->wd.flight = &t->flight;
    t->wd.ctx = t->g.ctx;
    t->wd.log = t->log;
    t->wd.hosts = t->hosts;
    t->wd.n_hosts = t->s->info.size;
    t->wd.rank = t->s->info.rank;
    if (am_watchdog_start(&t->wd, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    return 0;
}

/* CUDA: the caching allocator's arena; it grows past that when the estimate falls short */
void am_train_reserve(struct trainer *t)
{
    if (t->K->reserve && am_train_plan_bytes(t) > 0 && t->K->reserve(&t->dev, (size_t)am_train_plan_bytes(t)) < 0)
        fprintf(stderr, "am-train: rank %d: could not reserve the plan's %.0f bytes on %s up front; allocating as "
                "the run goes\n", t->s->info.rank, am_train_plan_bytes(t), t->dev.name);
}

/* AM_GRAD_OVERLAP=0 reduces the gradients after the backward instead of during it. */
static bool grad_overlap(void)
{
    const char *v = getenv("AM_GRAD_OVERLAP");
    return !(v && strcmp(v, "0") == 0);
}

/* Replicated or sharded (dp.h), by am-plan's ZeRO stage, on the mesh's groups. */
static void choose_dp(struct trainer *t)
{
    const struct am_plan *p = t->p;
    struct am_dp_config c = {
        .zero = p->zero_stage, .grad_comm = p->dp * p->cp > 1 ? t->grad_dp : NULL, .shard = t->g.dp_shard,
        .replicate = t->g.dp_replicate, .dp = t->g.dp, .cp = t->g.cp, .overlap = grad_overlap(),
        .reshard_after_forward = t->r->dist.reshard_after_forward, .reduce = t->r->reduce_dtype, .dev = &t->dev,
        .r = t->r, .lora = t->r->peft.enabled};
    am_dp_choose(&t->dp, &c);
}

static int lcm(int a, int b)
{
    int x = a, y = b;
    while (y) {
        int r = x % y;
        x = y;
        y = r;
    }
    return a / x * b;
}

/* After the weights are loaded or drawn: LoRA's adapters as peft and AutoModel start them (B
 * zero, A by peft.lora_A_init, from rng.seed: every layout starts the same adapters), and fp32
 * masters beside bf16 parameters (FusedAdam's master_weights) made the bf16 parameters' values,
 * as FusedAdam takes its masters from a model built in bf16 (model.torch_dtype), not from the
 * file's or the draw's fp32. */
static int finish_weights(struct trainer *t, struct am_errors *err)
{
    if (t->model.sh.lora_r > 0 &&
        am_model_init_lora(&t->model, (uint64_t)t->r->seed, t->r->peft.a_init == AM_LORA_INIT_KAIMING) < 0)
        return am_errors_fail(err, "out of host memory drawing the LoRA adapters' initial values");
    if (t->model.save_dt == AM_BF16 && t->model.store_dt == AM_F32 && am_model_round_to_bf16(&t->model) < 0)
        return am_errors_fail(err, "out of host memory rounding the fp32 masters to the bf16 parameters");
    return 0;
}

/* Weights: the checkpoint named by the recipe when it has any, else a random init. */
int am_train_build_model(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    const struct am_plan *p = t->p;
    char msg[512];
    struct am_model_shard sh;
    if (am_pipe_init(&t->pipe, p, r, &t->s->coords, &sh, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    sh.ep = p->ep; /* expert parallelism: this rank's share of the experts (moe.h) */
    if (r->peft.enabled) { /* LoRA (model.h): the adapters on the targeted projections, the base frozen */
        sh.lora_r = (int)r->peft.dim;
        sh.lora_alpha = (float)r->peft.alpha;
        sh.lora_targets = r->peft.targets & ((1u << AM_LORA_NTARGETS) - 1); /* the projections and lm_head */
        sh.lora_experts = r->peft.experts;
        sh.lora_experts_r = r->peft.experts ? (int)r->peft.experts_dim : 0; /* moe_rank_scaling's rank, or dim */
    }
    sh.ep_rank = p->ep > 1 ? am_comm_rank(t->g.ep) : 0;
    struct am_comm *pp = p->pp > 1 ? t->g.pp : NULL;
    choose_dp(t);
    sh.group_align = am_dp_group_align(&t->dp);
    /* the experts sharded over the expert-data-parallel group (am_train_build_dp): with HSDP it
     * spans the replicas, and its size need not divide the shard group's */
    if (sh.group_align > 1 && p->ep > 1)
        sh.expert_align = lcm(sh.group_align, am_comm_size(t->g.edp));
    /* context parallelism: each rank holds seq_length / cp rows of every sequence (ring.h) */
    if (am_model_init(&t->model, &r->model, &sh, &t->dev, t->g.tp, pp, p->microbatch_size, p->seq_length / p->cp, msg,
                      sizeof(msg)) < 0 ||
        (p->cp > 1 && am_cp_init(&t->model, t->g.cp, p->seq_length, msg, sizeof(msg)) < 0) ||
        (r->packed_sequence_size > 0 && am_packed_init(&t->model, p->seq_length, msg, sizeof(msg)) < 0) ||
        am_pipe_bind(&t->pipe, &t->model, p->microbatch_size, pp, p->pp > 1 ? t->g.pp_grad : NULL, msg,
                     sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    t->model.ep_comm = p->ep > 1 ? t->g.ep : NULL;
    /* AutoModel's load-balancing loss: its gradient's mean over dp and the step's micro-batches (moe.h) */
    am_moe_set_aux_div(&t->model, (double)p->dp * (double)p->grad_accum * (double)p->n_microbatches);
    if (r->peft.enabled) /* adapter dropout from rng.seed: the same masks in every layout (lora.h) */
        am_model_set_lora_dropout(&t->model, r->peft.dropout, r->peft.dropout_pre, (uint64_t)r->seed);
    t->base_config[0] = '\0';
    if (strcmp(r->model_source, "inline") != 0) {
        snprintf(t->base_config, sizeof(t->base_config), "%s", r->model_source);
        char dir[4096];
        snprintf(dir, sizeof(dir), "%s", r->model_source);
        dirname(dir);
        if (am_model_dir_has_weights(dir)) {
            /* rank 0 shows its loading on a terminal (progress.h) */
            struct am_progress bar = {.on = t->s->info.rank == 0 && isatty(2)};
            t->model.load_bar = &bar;
            int rc = am_model_load_hf(&t->model, dir, err);
            t->model.load_bar = NULL;
            if (rc < 0)
                return -1;
            return finish_weights(t, err);
        }
    }
    if (am_model_init_weights(&t->model, (uint64_t)r->seed) < 0)
        return am_errors_fail(err, "out of host memory drawing the initial weights");
    return finish_weights(t, err);
}

int am_train_build_dp(struct trainer *t, struct am_errors *err)
{
    char msg[512];
    /* with expert parallelism the experts (and LoRA's adapters on them) are sharded, and their
     * gradients reduced, over the ranks holding the same ones (fsdp.h; one rank when ep = dp: a
     * communicator of one) */
    for (int g = 0; t->p->ep > 1 && g < t->model.n_groups; g++)
        if (t->model.groups[g].kind == AM_PG_EXPERTS || t->model.groups[g].shard == AM_SHARD_EXPERT)
            t->model.groups[g].comm = t->g.edp;
    if (am_dp_init(&t->dp, &t->model, msg, sizeof(msg)) < 0)
        return am_errors_fail(err, "%s", msg);
    return 0;
}
